"""Text generation and chat, review 10: a model whose prompts skip the chat template (a plain text model, or
data.chat_template=false) goes on past the template's end of turn, as it learned it; a conversation the chat template
refuses is one sentence; a checkpoint's num_beams leaves greedy generation one path; max_new_tokens=0 is empty."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import compose

from onn.errors import UserError
from onn.modalities.text import generate
from onn.modalities.text.datamodule import TextDataModule
from onn.modalities.text.formats import read_records
from onn.modalities.text.prompts import Prompter

TEXT = compose("data=text", "data.source=unused.jsonl").data  # fields auto, template {prompt}, chat_template auto
# Llama 3 Instruct's chat template, as its tokenizer_config.json ships it
LLAMA3 = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def llama3_base_tokenizer():
    """A byte-level tokenizer (ids 0-255 are bytes) with Llama 3's special tokens from 256 on (EOS <|end_of_text|>,
    padded with it) and the Instruct chat template; built offline with `tokenizers`, as a tokenizer.json defines one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)} | {s: 256 + i for i, s in enumerate(specials)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=specials[0], eos_token=specials[1])
    tok.pad_token = tok.eos_token
    tok.chat_template = LLAMA3
    return tok


def tiny_llama(tok, max_position_embeddings: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)  # fmt: skip
    return LlamaForCausalLM(config)


def train(model, dm: TextDataModule, steps: int) -> list[float]:
    """A few Adam steps on the data module's own batches; the losses."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _, batch in zip(range(steps), dm.train_dataloader()):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


def test_a_model_prompted_without_the_chat_template_goes_on_past_its_end_of_turn(tmp_path):
    """Generation stopped at the chat template's end of turn (<|eot_id|>) whenever the tokenizer had a chat template,
    also for a model trained on plain text and with data.chat_template=false, where training ended every text with
    EOS and <|eot_id|> is text like any other: a corpus of chat transcripts completed as an empty string."""
    tok = llama3_base_tokenizer()
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    source = tmp_path / "transcripts.jsonl"
    source.write_text("".join(json.dumps({"text": "Hi<|eot_id|>Hello"}) + "\n" for _ in range(8)))
    data = dataclasses.replace(TEXT, source=str(source), val_source=str(source), streaming=False, num_workers=0)
    dm = TextDataModule(data, tok, batch_size=4)
    dm.setup()
    assert dm.prompter.plain
    model = tiny_llama(tok)
    losses = train(model, dm, 30)
    assert losses[-1] < 0.2 * losses[0], losses
    assert eot not in generate.LanguageModel(model, tok, dm.prompter).eos_ids  # what serve stops at
    special, bos = dm.prompter.add_special_tokens, dm.prompter.starts_with_bos  # as task=infer prompts it
    assert generate.complete(model, tok, ["Hi", "Hi"], max_new_tokens=8, add_special_tokens=special, bos=bos) == [
        "Hello",
        "Hello",
    ]
    assert generate.stream(model, tok, "Hi", max_new_tokens=8, add_special_tokens=special, bos=bos) == "Hello"
    no_chat = Prompter(dataclasses.replace(data, chat_template=False), tok)  # question/answer data, template off
    assert no_chat.add_special_tokens and eot not in generate.LanguageModel(model, tok, no_chat).eos_ids
    chat = Prompter(data, tok)  # through the chat template (auto): <|eot_id|> ends the turn, as training ended it
    assert not chat.add_special_tokens and eot in generate.LanguageModel(model, tok, chat).eos_ids
    written = "<|begin_of_text|>Hi"  # a prompt a chat template wrote holds its special tokens: none added
    ends = chat.answer_end  # what infer passes for a model trained through the template
    assert generate.complete(model, tok, [written], max_new_tokens=8, add_special_tokens=False, turn_end=ends) == [""]
    # task.template=false (the prompt as typed) stops there too: by how the model was trained, as serve stops
    assert generate.complete(model, tok, ["Hi"], max_new_tokens=8, bos=True, turn_end=ends) == [""]
    assert generate.stream(model, tok, "Hi", max_new_tokens=8, bos=True, turn_end=ends) == ""


GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def test_a_conversation_the_chat_template_refuses_is_one_sentence_naming_its_line(tmp_path):
    """Gemma's template raises on a system message (and on roles that do not alternate): a chat file with one
    stopped training with a Jinja traceback from inside transformers, naming neither the file nor the line."""
    tok = llama3_base_tokenizer()
    tok.chat_template = GEMMA
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    rows = [turns, [{"role": "system", "content": "Be brief."}, *turns]]
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"messages": turns}) + "\n")
    data = dataclasses.replace(TEXT, source=str(source), val_source=str(held_out), num_workers=0)
    for streaming in (False, True):
        dm = TextDataModule(dataclasses.replace(data, streaming=streaming, shuffle_buffer=2), tok, batch_size=2)
        with pytest.raises(UserError, match=r"chat.jsonl line 2: the tokenizer's chat template refuses .*System role"):
            dm.setup()
            list(dm.train_dataloader())
    plain = Prompter(dataclasses.replace(data, chat_template=False), tok)  # the way out the sentence names
    assert plain.examples(read_records(source))[1] == ("system: Be brief.\nuser: Hi\nassistant: ", "Hello")


def streaming_engine(model):
    from onn.models.layers import discover
    from onn.streaming.engine import StreamingEngine
    from onn.streaming.store import LayerStore

    model.requires_grad_(False)  # the engine streams frozen weights
    engine = StreamingEngine(model, discover(model), LayerStore("cpu", "float32"), 1)
    engine.offload()
    return engine


def test_a_checkpoints_beam_search_setting_leaves_greedy_generation_one_path():
    """A generation_config with num_beams (a fine-tuned checkpoint's) made model.generate search beams: task=infer
    prompt=... failed (transformers refuses a streamer with beams) and resident completions differed from the
    layer-streamed engine's and serve's, which decode one path."""
    tok = llama3_base_tokenizer()
    model = tiny_llama(tok).eval()
    prompts = ["a", "a much longer prompt than the first", "mid prompt"]
    one_path = generate.complete(model, tok, prompts, max_new_tokens=5, bos=True)
    model.generation_config.num_beams = 4
    assert generate.complete(model, tok, prompts, max_new_tokens=5, bos=True) == one_path
    assert generate.stream(model, tok, prompts[1], max_new_tokens=5, bos=True) == one_path[1]
    engine = streaming_engine(model)
    assert generate.complete(model, tok, prompts, max_new_tokens=5, bos=True, engine=engine) == one_path


def test_no_new_tokens_is_an_empty_completion_resident_and_streamed():
    """max_new_tokens=0 was transformers' ValueError resident and torch.stack's RuntimeError streamed."""
    tok = llama3_base_tokenizer()
    model = tiny_llama(tok).eval()
    for engine in (None, streaming_engine(model)):
        assert generate.complete(model, tok, ["a", "bcd"], max_new_tokens=0, engine=engine) == ["", ""]
        assert generate.stream(model, tok, "a", max_new_tokens=0, engine=engine) == ""


def test_a_prompt_that_is_a_json_object_or_list_is_one_sentence(tmp_path):
    """A prompts file whose prompt is an object or a list was generated from as its Python repr ("{'text': ...}"),
    without a word, where training refuses such a field."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": {"text": "nested"}}\n')
    with pytest.raises(UserError, match=r"task.input .*prompts.jsonl line 2: its 'prompt' is a JSON object, not text"):
        generate.read_prompts(str(path))
    path.write_text('{"question": ["a", "b"]}\n')
    with pytest.raises(UserError, match=r"line 1: its 'question' is a JSON list"):
        generate.read_prompts(str(path))
    path.write_text('{"prompt": 42}\n')  # a number is text enough
    assert generate.prompt_of(generate.read_prompts(str(path))[0]) == "42"
