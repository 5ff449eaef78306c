"""Text data, review 9: a chat model's answers end as its chat template ends an assistant's turn (Gemma's
<end_of_turn>, Llama 3's <|eot_id|>, SmolLM2's <|im_end|>) and generation stops there; an Alpaca file whose first
records leave out `input` keeps the later ones' input; a streamed .txt drops the lines the resident reader drops."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import compose

from onn.config.data import TextFields
from onn.modalities.text import generate
from onn.modalities.text.datamodule import IGNORE, TextDataModule
from onn.modalities.text.formats import read_records
from onn.modalities.text.prompts import Prompter, turn_end, turn_end_ids
from onn.modalities.text.streaming import open_reader
from onn.models.tokenizer import byte_tokenizer

TEXT = compose("data=text", "data.source=unused.jsonl").data  # fields auto, template {prompt}, chat_template auto
AUTO = dataclasses.replace(TEXT, fields=TextFields(input="auto", output="auto"), val_split=0.25)
SMOLLM = Path.home() / ".cache/onn/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"

# Gemma's and Llama 3 Instruct's chat templates, as their tokenizer_config.json ship them
GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
LLAMA3 = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def special_tokenizer(specials: list[str], template: str, eos: str, pad: str | None = None):
    """A byte-level tokenizer (ids 0-255 are bytes) with `specials` from 256 on, the first being BOS; built offline
    with `tokenizers`, as a model's tokenizer.json defines one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)} | {s: 256 + i for i, s in enumerate(specials)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=specials[0], eos_token=eos, pad_token=pad)
    tok.chat_template = template
    return tok


def gemma_tokenizer():
    specials = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]
    return special_tokenizer(specials, GEMMA, eos="<eos>", pad="<pad>")


def llama3_base_tokenizer():
    """Llama 3's base tokenizer (EOS <|end_of_text|>, no pad: ONN pads with EOS) given the Instruct template."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = special_tokenizer(specials, LLAMA3, eos="<|end_of_text|>")
    tok.pad_token = tok.eos_token
    return tok


def qa_file(path: Path, n: int = 8) -> Path:
    rows = [{"question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def answer_targets(dm: TextDataModule) -> list[list[int]]:
    """Each encoded example's target tokens (the labels that are not ignored)."""
    return [[t for t in labels if t != IGNORE] for _, labels in dm._encoded_train() + dm.val_set]


def test_a_gemma_answer_ends_with_end_of_turn_not_eos(tmp_path):
    """Every answer ended in the tokenizer's <eos>, where Gemma's template ends an assistant's turn with
    <end_of_turn> and a newline: a fine-tuned chat model never learned to end its turn as it is prompted."""
    tok = gemma_tokenizer()
    end_of_turn, eos = tok.convert_tokens_to_ids("<end_of_turn>"), tok.eos_token_id
    held_out = qa_file(tmp_path / "held_out.jsonl", 1)
    data = dataclasses.replace(AUTO, source=str(qa_file(tmp_path / "qa.jsonl")), val_source=str(held_out))
    dm = TextDataModule(dataclasses.replace(data, streaming=False), tok, batch_size=2)
    dm.setup()
    targets = answer_targets(dm)
    assert len(targets) == 9
    for target in targets:
        assert target[-2:] == [end_of_turn, ord("\n")] and eos not in target
    [(ids, _)] = dm.val_set  # the whole example is the conversation as the template renders it
    conversation = [{"role": "user", "content": "What is 0 plus 0?"}, {"role": "assistant", "content": "0"}]
    assert tok.decode(ids) == tok.apply_chat_template(conversation, tokenize=False)
    streamed = TextDataModule(dataclasses.replace(data, streaming=True, shuffle_buffer=4), tok, batch_size=2)
    streamed.setup()  # a streamed record is encoded record by record: the same end
    record, where = {"question": "What is 9 plus 9?", "answer": "18"}, "qa.jsonl line 9"
    assert [t for t in streamed._encode(record, where)[1] if t != IGNORE] == [*b"18", end_of_turn, ord("\n")]
    # a template that writes nothing after the turn, or only plain text (ChatML spelt in bytes): EOS, as before
    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    for template, after in (("{% for m in messages %}{{ m['content'] }}{% endfor %}", ""), (chatml, "<|im_end|>\n")):
        plain = byte_tokenizer()
        plain.chat_template = template
        assert turn_end(plain) == after and turn_end_ids(plain) == []  # found, and not a special token
        assert Prompter(data, plain).examples(read_records(data.source))  # the layout is chosen
        fallback = TextDataModule(data, plain, batch_size=2)
        fallback.setup()
        assert all(target[-1] == plain.eos_token_id for target in answer_targets(fallback))


def tiny_llama(tok, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=tok.bos_token_id, eos_token_id=eos_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    return LlamaForCausalLM(config)


def test_a_llama3_chat_model_learns_to_end_its_turn_and_generation_stops_there(tmp_path):
    """A Llama 3 base tokenizer (EOS <|end_of_text|>) with the Instruct template: answers ended in <|end_of_text|>
    and generation stopped only there or at the model's generation_config EOS, never at <|eot_id|>, which ends
    every assistant turn the template renders. Trained a few steps on the data module's batches, the model writes
    its answer, then <|eot_id|>, and generation stops on it in a left-padded batch of prompts of unequal length."""
    tok = llama3_base_tokenizer()
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    source = tmp_path / "qa.jsonl"
    rows = [{"question": "2+2?", "answer": "4"}, {"question": "What is three plus three?", "answer": "6"}] * 4
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = dataclasses.replace(AUTO, source=str(source), streaming=False, val_source=str(source), num_workers=0)
    dm = TextDataModule(data, tok, batch_size=4)
    dm.setup()
    assert {tuple(t) for t in answer_targets(dm)} == {(ord("4"), eot), (ord("6"), eot)}
    model = tiny_llama(tok, eos_id=tok.eos_token_id)  # the base model's generation_config ends at <|end_of_text|>
    assert eot in generate.LanguageModel(model, tok, dm.prompter).eos_ids  # what serve stops at
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _, batch in zip(range(40), dm.train_dataloader()):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], losses
    prompts = [p for p, _ in dm.val_examples[:2]]
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    special, ends = dm.prompter.add_special_tokens, dm.prompter.answer_end  # as task=infer generates
    assert generate.complete(model, tok, prompts, max_new_tokens=8, add_special_tokens=special, turn_end=ends) == [
        "4",
        "6",
    ]
    assert len(calls) == 2  # the answer's token, then <|eot_id|>: not 8 steps to max_new_tokens
    # val/exact_match and bench's exact_match read answers generated the same way (they ran on to '4444')
    scores = generate.answer_scores(model, tok, dm.val_examples, None, 2, 8, add_special_tokens=special, turn_end=ends)
    assert scores["exact_match"] == 1.0 and len(calls) == 4


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM.exists(), reason="SmolLM2 GGUF not fetched (../shared/scripts/fetch-smollm2.sh)")
def test_smollm2s_answers_end_as_its_own_template_ends_a_turn(tmp_path):
    """SmolLM2's GGUF template ends an assistant's turn with <|im_end|> and a newline (its EOS is <|im_end|>):
    answers ended with <|im_end|> alone."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SMOLLM.parent), gguf_file=SMOLLM.name)
    source, held_out = qa_file(tmp_path / "qa.jsonl", 4), qa_file(tmp_path / "held_out.jsonl", 1)
    data = dataclasses.replace(AUTO, source=str(source), val_source=str(held_out), streaming=False)
    dm = TextDataModule(data, tok, batch_size=2)
    dm.setup()
    end = tok("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert len(end) == 2 and end[0] == tok.convert_tokens_to_ids("<|im_end|>")
    [(ids, _)] = dm.val_set  # the whole example is the conversation as SmolLM2's template renders it
    conversation = [{"role": "user", "content": "What is 0 plus 0?"}, {"role": "assistant", "content": "0"}]
    assert tok.decode(ids) == tok.apply_chat_template(conversation, tokenize=False)
    assert all(target[-2:] == end for target in answer_targets(dm))


def alpaca_file(path: Path, without_input: int, with_input: int) -> Path:
    rows = [{"instruction": f"Name colour {i}.", "output": f"colour {i}"} for i in range(without_input)]
    rows += [
        {"instruction": "Add the numbers.", "input": f"{i} and {i}", "output": str(2 * i)} for i in range(with_input)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_alpaca_inputs_after_the_first_200_records_are_kept(tmp_path):
    """The layout was chosen on the first 200 records: where none of them had `input`, the prompt was the
    instruction alone, and every later record's input was dropped without a word (resident and streamed)."""
    source = alpaca_file(tmp_path / "alpaca.jsonl", without_input=210, with_input=30)
    data = dataclasses.replace(AUTO, source=str(source), val_source=str(source), shuffle_buffer=8)
    resident = TextDataModule(dataclasses.replace(data, streaming=False), byte_tokenizer(), batch_size=2)
    resident.setup()
    assert resident.train_examples[0] == ("Name colour 0.", "colour 0")
    assert resident.train_examples[215] == ("Add the numbers.\n\n5 and 5", "10")
    streamed = TextDataModule(dataclasses.replace(data, streaming=True), byte_tokenizer(), batch_size=2)
    streamed.setup()
    reader = open_reader(source, "auto")
    late = [(record, where) for _, _, record, where in reader.records(reader.start)][215]
    assert streamed.prompter.example(*late) == ("Add the numbers.\n\n5 and 5", "10")


def test_a_streamed_text_file_drops_the_lines_the_resident_reader_drops(tmp_path):
    """A streamed .txt judged blank lines by bytes.strip: a line of NBSP or ideographic spaces (U+3000) was a
    sample, which the resident reader (str.strip) drops; a line ending \\r\\r\\n lost both \\r."""
    source = tmp_path / "corpus.txt"
    lines = ["first sample", "\u00a0\u00a0", "second sample", "\u3000", "\x1c", "third\r\r", "\u2028 fourth", "last"]
    source.write_bytes("\n".join(lines).encode("utf-8") + b"\r\n")
    resident = read_records(source)
    reader = open_reader(source, "auto")
    streamed = [(record, where) for _, _, record, where in reader.records(reader.start)]
    assert [r["text"] for r in resident] == ["first sample", "second sample", "third\r", "\u2028 fourth", "last"]
    assert streamed == list(zip(resident, resident.where))
    assert reader.count(reader.start) == len(resident)


def test_streamed_records_longer_than_max_length_are_cut_and_said_once(tmp_path, caplog):
    """A streamed file's records were cut to data.max_length without a word (held records are counted and said):
    the first one cut is now named once, and every cut record keeps its answer's tokens as the loss's targets."""
    source = tmp_path / "long.jsonl"
    rows = [{"question": ("Think about this. " * (40 if i % 3 == 0 else 1)) + f"{i}+{i}?", "answer": str(2 * i)}
            for i in range(30)]  # fmt: skip
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = dataclasses.replace(AUTO, source=str(source), streaming=True, max_length=48, shuffle_buffer=8)
    dm = TextDataModule(data, byte_tokenizer(), batch_size=4)
    dm.setup()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onn"):
        batches = [batch for _, batch in zip(range(dm.steps_per_epoch), dm.train_dataloader())]
    assert sum(len(b["input_ids"]) for b in batches) == dm.train_records
    assert all(b["input_ids"].shape[1] <= 48 and ((b["labels"] != IGNORE).sum(1) >= 2).all() for b in batches)
    said = [r.getMessage() for r in caplog.records if "more than data.max_length=48" in r.getMessage()]
    assert len(said) == 1 and "long.jsonl line" in said[0], said
