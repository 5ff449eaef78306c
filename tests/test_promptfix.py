"""A model gets, in every task, the prompt ids it was trained on: serve's /v1/completions and chat route, the
held-out prompts of validation loss and exact match, and task=eval of a checkpoint all begin a plain-text model's
prompt with BOS as training began every text, once, and never through the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import compose, execute_run, tiny_llama
from starlette.testclient import TestClient

from onn.modalities.text import generate
from onn.modalities.text.datamodule import TextDataModule, encode
from onn.modalities.text.prompts import Prompter
from onn.models.tokenizer import byte_tokenizer
from onn.tasks.serve import batching
from onn.tasks.serve.api import create_app

BOS, EOS = 256, 257
MODEL = "tiny"
CHAT = (  # a ChatML-like template that writes BOS itself, as SmolLM2's <|im_start|> (its bos_token) is written
    "{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
)
TRAINING_TEXT = [{"text": f"Paris is the capital of France, said bear {i}."} for i in range(12)]
QA = [{"question": f"Capital of country {i}?", "answer": "Paris"} for i in range(4)]


def chat_tokenizer():
    tok = byte_tokenizer()
    tok.chat_template = CHAT
    return tok


def text_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.fixture()
def plain_server(monkeypatch):
    """The real app around a tiny Llama whose checkpoint learned plain text (prompt_layout `text`), its tokenizer
    carrying a chat template; yields (client, the prompt ids each request handed to the scheduler)."""
    seen: list[list[int]] = []
    enqueue = batching.Scheduler._enqueue  # what submit and admit both queue through

    def recorded(self, seqs):  # the real queueing, the ids it got kept
        seen.extend(list(seq.prompt_ids) for seq in seqs)
        return enqueue(self, seqs)

    monkeypatch.setattr(batching.Scheduler, "_enqueue", recorded)
    tok = chat_tokenizer()
    model = tiny_llama(vocab_size=320, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=258)
    settings = compose("task=serve").serve
    prompter = Prompter(compose("task=serve").data, tok, trained_layout="text")
    app = create_app(generate.LanguageModel(model, tok, prompter), settings, MODEL)
    try:
        with TestClient(app) as http:
            yield http, seen, prompter
    finally:
        app.state.close()


def test_completions_start_with_bos_as_training_and_infer_do(plain_server):
    """/v1/completions gave a plain-text model the text without BOS, where training and task=infer put it first."""
    http, seen, prompter = plain_server
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 2})
    assert response.status_code == 200, response.text
    trained, _ = encode(prompter.tokenizer, "", "Once upon", 64, prompter.add_special_tokens, prompter.answer_end)
    inferred = generate.prompt_ids(prompter.tokenizer, "Once upon", prompter.add_special_tokens, bos=True)
    assert seen[-1] == inferred == trained[:-1] == [BOS, *text_bytes("Once upon")]
    assert response.json()["usage"]["prompt_tokens"] == len(inferred)


def test_chat_of_several_messages_is_role_lines_with_one_bos(plain_server):
    """A system+user chat went through the chat template for a plain-text model, and got BOS twice."""
    http, seen, _ = plain_server
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Once upon"}]
    response = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": messages})
    assert response.status_code == 200, response.text
    assert seen[-1] == [BOS, *text_bytes("system: Be brief\nuser: Once upon\nassistant: ")]
    assert seen[-1].count(BOS) == 1


def test_serve_template_false_joins_messages_by_lines():
    """serve.template=false joined the messages' contents with nothing: "Be brief" + "Hi" -> "Be briefHi"."""
    tok = byte_tokenizer()
    model = tiny_llama(vocab_size=320, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=258)
    settings = compose("task=serve", "serve.template=false").serve
    app = create_app(generate.LanguageModel(model, tok, Prompter(compose().data, tok)), settings, MODEL)
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    try:
        with TestClient(app) as http:
            body = {"model": MODEL, "max_tokens": 1, "messages": messages}
            usage = http.post("/v1/chat/completions", json=body).json()["usage"]
    finally:
        app.state.close()
    assert usage["prompt_tokens"] == len(text_bytes("Be brief\nHi"))


def test_a_plain_model_never_goes_through_the_chat_template():
    """Prompter.render_messages checked only `chat`: a plain-text model's conversation was chat-templated."""
    data = compose().data
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    plain = Prompter(data, chat_tokenizer(), trained_layout="text")
    assert plain.render_messages(messages) == "system: Be brief\nuser: Hi\nassistant: "
    assert not plain.chat_templated and plain.chat  # the tokenizer has one; a plain model does not use it
    chat = Prompter(data, chat_tokenizer(), trained_layout="pairs")
    assert chat.render_messages(messages).startswith("<bos>system\nBe brief<eos>")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_held_out_questions_of_a_plain_model_start_with_bos(tmp_path):
    """Validation loss encoded a plain-text model's held-out question without BOS (add_special_tokens adds none
    on the byte tokenizer), while training began every text with it and task=infer begins the prompt with it."""
    train = write_jsonl(tmp_path / "train.jsonl", TRAINING_TEXT)
    val = write_jsonl(tmp_path / "val.jsonl", QA)
    data = compose("data=text", f"data.source={train}", f"data.val_source={val}").data
    dm = TextDataModule(data, byte_tokenizer(), batch_size=4)
    dm.setup("fit")
    assert dm.prompter.plain and dm.prompter.starts_with_bos
    assert dm.train_set[0][0][0] == BOS  # training: BOS, then the text
    question = "Capital of country 0?"
    ids, labels = dm.val_set[0]
    assert ids == [BOS, *text_bytes(question), *text_bytes("Paris"), EOS]
    assert ids[: len(question) + 1] == generate.prompt_ids(dm.tokenizer, question, True, dm.prompter.starts_with_bos)
    assert labels[: len(question) + 1] == [-100] * (len(question) + 1)


def test_eval_datamodule_takes_the_checkpoints_layout(tmp_path):
    """task=eval's datamodule built its Prompter without the checkpoint's prompt_layout: a plain-text model's QA
    held-out file went through the chat template (no BOS of ours) instead of BOS + the question as infer sends it."""
    from onn.modalities.text import tasks

    qa = write_jsonl(tmp_path / "qa.jsonl", QA)
    config = compose("data=text", f"data.source={qa}", f"data.val_source={qa}")
    tok = chat_tokenizer()
    dm = tasks.datamodule(config, tok, stage="validate", trained_layout="text")
    question = "Capital of country 0?"
    assert dm.val_examples[0] == (question, "Paris")  # not chat-templated
    assert dm.val_set[0][0][: len(question) + 1] == [BOS, *text_bytes(question)]
    infer = Prompter(config.data, tok, trained_layout="text")
    assert generate.prompt_ids(tok, infer.render(question), infer.add_special_tokens, infer.starts_with_bos) == [
        BOS,
        *text_bytes(question),
    ]


@pytest.mark.slow
def test_train_then_eval_of_a_plain_model_prompt_as_trained(tmp_path, monkeypatch):
    """Train llama_tiny on plain text (its tokenizer has a chat template), then task=eval it on a QA file: the
    prompts exact match generates from (after training and in eval) are BOS + the question, not chat-templated."""
    generated: list[list[int]] = []
    batch = generate.prompt_batch

    def recorded(tokenizer, texts, add_special_tokens=True, bos=False):  # the real prompt_batch, its ids kept
        out = batch(tokenizer, texts, add_special_tokens, bos)
        generated.extend([i for i in row.tolist() if i != tokenizer.pad_token_id] for row in out["input_ids"])
        return out

    monkeypatch.setattr(generate, "prompt_batch", recorded)
    folder = tmp_path / "tokenizer"
    chat_tokenizer().save_pretrained(str(folder))
    train = write_jsonl(tmp_path / "train.jsonl", TRAINING_TEXT)
    qa = write_jsonl(tmp_path / "qa.jsonl", QA)
    cache, common = tmp_path / "cache", ("data=text", f"model.tokenizer={folder}", "task.validate_before=false")
    execute_run(tmp_path, cache, *common, f"data.source={train}", f"data.val_source={qa}", "trainer.max_steps=1",
                "task.exact_match_samples=2", name="train")  # fmt: skip
    assert generated and all(ids[0] == BOS and ids.count(BOS) == 1 for ids in generated)
    generated.clear()
    metrics = execute_run(tmp_path, cache, *common, "task=eval", f"ckpt={tmp_path / 'train'}", f"data.source={qa}",
                          "task.max_samples=2", "task.max_new_tokens=2", name="eval")  # fmt: skip
    assert metrics["data/prompt_format"] == "data.template (plain text: no chat template)"
    assert generated[0] == [BOS, *text_bytes("Capital of country 0?")]
