"""Language models as users meet them: chat templates by default, instruction layouts recognised, every
field of a record reachable from a template, empty completions reported, GSM8K answers extracted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import compose, execute_run

from onn.config.data import TextData, TextFields
from onn.errors import UserError
from onn.modalities.text import generate
from onn.modalities.text.formats import Records, read_records
from onn.modalities.text.prompts import Prompter
from onn.models.tokenizer import byte_tokenizer

# A chat template in the ChatML style (what SmolLM2's GGUF ships), on ONN's byte tokenizer
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = compose("data=text", "data.source=unused.jsonl").data  # fields auto, template {prompt}, chat_template auto


def text_data(prompt: str = "auto", answer: str = "auto", **keys) -> TextData:
    """data=text with these data.fields (and other keys)."""
    return dataclasses.replace(TEXT, fields=TextFields(input=prompt, output=answer), **keys)


AUTO = text_data()


def chat_tokenizer():
    tok = byte_tokenizer()
    tok.chat_template = CHAT
    return tok


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    """A tokenizer folder with a chat template, as model.tokenizer takes it (no hub)."""
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    chat_tokenizer().save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # one hardware profile for the module's runs


def run(tmp: Path, cache: Path, *overrides: str, name: str = "run") -> dict:
    return execute_run(tmp, cache, "hardware=auto", *overrides, name=name)  # planned for the machine, as run.py


def alpaca(path: Path, n: int = 30) -> Path:
    """Alpaca's layout: instruction, input (empty in most rows), output."""
    rows = [
        {
            "instruction": f"Add {i} and {i + 1}.",
            "input": "" if i % 3 else f"Show the sum of {i} + {i + 1}.",
            "output": str(2 * i + 1),
        }
        for i in range(n)
    ]
    path.write_text(json.dumps(rows, indent=2))
    return path


def test_infer_uses_the_tokenizers_chat_template_by_default(tmp_path, cache, chat_folder):
    question = "What is the capital of France?"
    m = run(
        tmp_path,
        cache,
        f"model.tokenizer={chat_folder}",
        "task=infer",
        f"prompt={question}",
        "task.max_new_tokens=2",
    )
    user = f"Question: {question}\nAnswer: "  # data=math's template shapes the user's message
    assert m["infer/prompt_format"] == "chat template"
    assert m["infer/model_input"] == f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    plain = run(
        tmp_path,
        cache,
        f"model.tokenizer={chat_folder}",
        "task=infer",
        f"prompt={question}",
        "task.max_new_tokens=2",
        "data.chat_template=false",
    )
    assert plain["infer/model_input"] == user and plain["infer/prompt_format"] == "data.template"


def test_training_examples_go_through_the_chat_template_without_a_second_bos():
    from onn.modalities.text.datamodule import encode

    tok = chat_tokenizer()
    prompter = Prompter(AUTO, tok)
    records = Records([{"question": "2+2?", "answer": "4"}], ["f.jsonl line 1"])
    [(prompt, answer)] = prompter.examples(records)
    assert prompt == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n" and answer == "4"
    ids, labels = encode(tok, prompt, answer, 64, prompter.add_special_tokens)
    assert tok.decode(ids) == prompt + "4<eos>" and ids.count(tok.bos_token_id) == 0
    assert Prompter(AUTO, byte_tokenizer()).examples(records) == [("2+2?", "4")]  # no chat template: plain


def bos_chat_tokenizer():
    """A tokenizer that adds BOS itself and whose chat template writes it too (as Llama 3's and Gemma's do)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = byte_tokenizer().backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 256)]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = "{{ bos_token }}" + CHAT
    return tok


def test_generation_encodes_prompts_as_training_did_without_a_second_bos():
    """Training encodes a chat-templated prompt without the tokenizer's special tokens (the template wrote BOS);
    eval, infer and the context check tokenized it with them: [bos, bos, ...], a start training never showed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from onn.modalities.text.datamodule import encode

    tok = bos_chat_tokenizer()
    prompter = Prompter(AUTO, tok)
    prompt, special = prompter.render("2+2?"), prompter.add_special_tokens
    trained, _ = encode(tok, prompt, "4", 64, special)
    n = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert trained[:2] != [256, 256] and trained.count(256) == 1
    config = LlamaConfig(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=n + 4,
                         bos_token_id=256, eos_token_id=257, pad_token_id=258)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    seen = []
    model.register_forward_pre_hook(lambda _, args, kw: seen.append(kw["input_ids"][0].tolist()), with_kwargs=True)
    generate.complete(model, tok, [prompt], max_new_tokens=1, add_special_tokens=special)
    generate.stream(model, tok, prompt, max_new_tokens=1, add_special_tokens=special)
    assert seen == [trained[:n], trained[:n]]
    assert generate.check_context(model, tok, [prompt], ["prompt"], 4, add_special_tokens=special) == 4


def test_a_model_trained_on_chat_messages_without_a_chat_template_is_prompted_as_it_learned():
    """Trained on `messages` records by a tokenizer without a chat template, the model learned role lines; infer
    gave it the typed prompt alone ("say 5", not "user: say 5\nassistant: ")."""
    records = Records(
        [{"messages": [{"role": "user", "content": "say 12"}, {"role": "assistant", "content": "12"}]}],
        ["c.jsonl line 1"],
    )
    training = Prompter(AUTO, byte_tokenizer())
    assert training.examples(records) == [("user: say 12\nassistant: ", "12")] and training.layout_name == "messages"
    assert training.render("say 5") == "user: say 5\nassistant: "  # a question/answer val_source, as trained
    at_infer = Prompter(AUTO, byte_tokenizer(), trained_layout=training.layout_name)  # the checkpoint's
    assert at_infer.render("say 5") == "user: say 5\nassistant: "
    assert at_infer.prompt_format == "role lines (chat messages without a chat template)"
    assert Prompter(AUTO, byte_tokenizer(), trained_layout="pairs").render("say 5") == "say 5"
    with_chat = Prompter(AUTO, chat_tokenizer(), trained_layout="messages")  # the chat template, as before
    assert with_chat.render("say 5") == "<|im_start|>user\nsay 5<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_infer_of_a_checkpoint_trained_on_chat_messages_prompts_with_role_lines(tmp_path, cache):
    """The checkpoint keeps the layout its model learned (prompt_layout): infer's model_input was the typed prompt
    alone, "say 5", for a model trained on "user: say 12\nassistant: ". task.max_new_tokens=auto
    (1024) is cut to the 512 positions llama_tiny has."""
    chat = tmp_path / "chat.jsonl"
    turns = [[{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": str(i)}] for i in range(20)]
    chat.write_text("".join(json.dumps({"messages": t}) + "\n" for t in turns))
    trained = run(
        tmp_path,
        cache,
        "data=text",
        f"data.source={chat}",
        "trainer.max_steps=1",
        "task.validate_before=false",
        "task.exact_match_samples=0",
        name="train",
    )
    assert trained["data/layout"] == "messages"
    m = run(
        tmp_path,
        cache,
        "task=infer",
        f"ckpt={tmp_path / 'train'}",
        "prompt=say 5",
        "task.max_new_tokens=auto",
        name="infer",
    )
    assert m["infer/model_input"] == "user: say 5\nassistant: "
    assert m["infer/prompt_format"] == "role lines (chat messages without a chat template)"


def test_an_alpaca_file_with_only_its_answer_field_named_keeps_its_input(tmp_path):
    """data.fields.output=output alone on Alpaca records took the first prompt field of the pairs list
    (instruction) and dropped the input: 'Add 0 and 1.' instead of 'Add 0 and 1.\n\nShow the sum of 0 + 1.'."""
    prompter = Prompter(text_data(answer="output"), byte_tokenizer())
    examples = prompter.examples(read_records(alpaca(tmp_path / "a.json")))
    assert examples[:2] == [("Add 0 and 1.\n\nShow the sum of 0 + 1.", "1"), ("Add 1 and 2.", "3")]
    assert prompter.layout.name == "alpaca"
    dolly = Records([{"instruction": "Sum", "context": "1 and 2", "response": "3"}], ["d.jsonl line 1"])
    assert Prompter(text_data(answer="response"), byte_tokenizer()).examples(dolly) == [("Sum\n\n1 and 2", "3")]
    qa = Records([{"question": "2+2?", "answer": "4"}], ["q.jsonl line 1"])
    assert Prompter(text_data(answer="answer"), byte_tokenizer()).examples(qa) == [("2+2?", "4")]


def test_an_alpaca_file_is_mapped_by_itself_and_said(tmp_path, cache):
    source = alpaca(tmp_path / "alpaca_data.json")
    m = run(
        tmp_path,
        cache,
        "data=text",
        f"data.source={source}",
        "trainer.max_steps=2",
        "task.validate_before=false",
        "task.exact_match_samples=0",
    )
    assert m["data/layout"] == "alpaca" and m["data/mapping"] == "{instruction}\n\n{input} -> output"
    assert m["data/train_records"] + m["data/val_records"] == 30
    examples = Prompter(AUTO, byte_tokenizer()).examples(read_records(source))
    assert examples[0] == ("Add 0 and 1.\n\nShow the sum of 0 + 1.", "1") and examples[1] == (
        "Add 1 and 2.",
        "3",
    )


def test_a_mapping_onto_mostly_empty_prompts_is_refused_naming_the_other_fields(tmp_path):
    records = read_records(alpaca(tmp_path / "a.json"))
    wrong = text_data("input", "output")  # what the old defaults did silently
    with pytest.raises(
        UserError, match=r"the prompt \(input\) is empty in 67% .*other text fields are \['instruction'\]"
    ):
        Prompter(wrong, byte_tokenizer()).examples(records)


def test_a_template_reaches_every_field_and_a_typed_newline_is_a_newline(tmp_path):
    records = read_records(alpaca(tmp_path / "a.json"))
    cfg = text_data("instruction", "output", template=r"{instruction}\nInput: {input}\n{prompt}")
    prompt, _ = Prompter(cfg, byte_tokenizer()).examples(records)[0]
    assert (
        prompt == "Add 0 and 1.\nInput: Show the sum of 0 + 1.\nAdd 0 and 1."
    )  # Alpaca's own input is not overwritten
    nested = Records([{"seed": {"instruction": "Name a colour.", "answer": {"text": "red"}}}], ["seeds.jsonl line 1"])
    cfg = text_data("seed.instruction", "seed.answer.text", template="Q: {seed.instruction}")
    assert Prompter(cfg, byte_tokenizer()).examples(nested) == [("Q: Name a colour.", "red")]
    with pytest.raises(
        UserError, match=r"data.template names the field \{context\}, which seeds.jsonl line 1 does not have"
    ):
        Prompter(dataclasses.replace(cfg, template="{context}"), byte_tokenizer()).examples(nested)


def test_chat_layouts_are_recognised():
    openai = Records(
        [
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"},
                ]
            }
        ],
        ["c.jsonl line 1"],
    )
    sharegpt = Records(
        [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}],
        ["s.json line 2"],
    )
    tok = chat_tokenizer()
    [(prompt, answer)] = Prompter(AUTO, tok).examples(openai)
    assert (
        answer == "Hello"
        and prompt.startswith("<|im_start|>system\nBe brief.")
        and prompt.endswith("<|im_start|>assistant\n")
    )
    prompter = Prompter(AUTO, byte_tokenizer())
    assert prompter.examples(sharegpt) == [("user: Hi\nassistant: ", "Hello")] and prompter.layout.name == "messages"
    dolly = Records(
        [{"instruction": "Sum", "context": "1 and 2", "response": "3", "category": "qa"}], ["d.jsonl line 1"]
    )
    assert Prompter(AUTO, byte_tokenizer()).examples(dolly) == [("Sum\n\n1 and 2", "3")]
    with pytest.raises(UserError, match=r"no prompt/answer layout ONN knows; say which field is which"):
        Prompter(AUTO, byte_tokenizer()).examples(Records([{"a": "1", "b": "2"}], ["x.jsonl line 1"]))


def test_an_empty_completion_is_reported_not_ok(tmp_path, cache, caplog):
    """A model whose first token is end-of-text (as SmolLM2 without its chat format): the run says so."""
    builder = tmp_path / "ends_at_once.py"
    builder.write_text(
        "def build():\n    from transformers import LlamaConfig, LlamaForCausalLM\n"
        "    from onn.models.tokenizer import byte_tokenizer\n"
        "    cfg = LlamaConfig(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=2, "
        "num_attention_heads=2,\n"
        "                      num_key_value_heads=1, bos_token_id=256, eos_token_id=257, pad_token_id=258)\n"
        "    import torch\n"
        "    model = LlamaForCausalLM(cfg)\n"
        "    model.lm_head = torch.nn.Linear(16, 320)  # only <eos> can come: its bias alone sets the scores\n"
        "    torch.nn.init.zeros_(model.lm_head.weight)\n"
        "    torch.nn.init.constant_(model.lm_head.bias, -10.0)\n"
        "    model.lm_head.bias.data[257] = 10.0\n"
        "    return model, byte_tokenizer()\n"
    )
    m = run(
        tmp_path,
        cache,
        f"model.source={builder}:build",
        "model.architecture=null",
        "model.tokenizer=null",
        "task=infer",
        "prompt=Hello",
        "task.max_new_tokens=4",
        "task.template=false",
        "strategy=full",
    )
    assert m["infer/completion"] == "" and m["infer/empty_completions"] == 1
    assert "the completion is empty" in caplog.text
    from onn.app import summary

    assert "EMPTY completion" in summary({**m, "task": "infer"}, tmp_path) and " ok" not in summary(
        {**m, "task": "infer"}, tmp_path
    )


def test_gsm8k_answers_are_extracted_by_its_convention_with_room_to_write_them(tmp_path, cache, monkeypatch):
    pattern = r"####\s*(-?[0-9][0-9,\.]*)"
    examples = [
        ("q1", "She has 3 + 2 = 5.\n#### 5"),
        ("q2", "#### 7"),
        ("q3", "#### 1,200"),
        ("q4", "#### 3"),
    ]
    made = ["3 + 2 = 5 apples.\n#### 5", "So the answer is 7.", "That is 1,200 in all", "I do not know."]
    monkeypatch.setattr(generate, "complete", lambda model, tok, prompts, **kw: made[: len(prompts)])
    scores = generate.answer_scores(None, byte_tokenizer(), examples, pattern, 10, 300)
    assert (
        scores["exact_match"] == 0.75
        and scores["exact_match_strict"] == 0.25
        and scores["answer_pattern_found"] == 0.25
    )
    assert "last number" in scores["answer_extraction"]
    rows = [
        {
            "question": f"Tom has {i} apples and buys {i}. How many?",
            "answer": f"He has {i} + {i} = {2 * i} apples.\n#### {2 * i}",
        }
        for i in range(40)
    ]
    source = tmp_path / "gsm8k_test.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.undo()
    m = run(
        tmp_path,
        cache,
        "data=gsm8k",
        f"data.source={source}",
        "task=eval",
        "task.max_samples=2",
        "data.val_split=0.1",
    )
    longest = max(len(r["answer"].encode()) for r in rows)  # byte tokenizer: one token a byte
    assert (
        16 < m["val/max_new_tokens"] <= longest + 16 and m["val/exact_match_samples"] == 2
    )  # was 24: no room for ####
    assert 0 <= m["val/exact_match"] <= 1 and m["val/answer_extraction"].startswith("group 1 of data.answer_pattern")
