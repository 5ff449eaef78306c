"""task=serve: the OpenAI client against the API, the key, a fuzz of malformed requests, continuous batching
(concurrent greedy requests give what each gives alone, resident and layer-streamed), a client that goes away,
a classifier's upload, the real CLI, and the web page in a real browser (Debian's chromium via Playwright)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import ROOT, compose, read_metrics

KEY = "test-key"
MODEL = "llama_tiny"
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT_COPY = Path("/work/wt/serve-screenshot.png")  # where the lead looks at it; written when that folder exists


def serve_job(tmp: Path, *overrides: str, ckpt: Path | None = None, hardware: str = "hardware=cpu_16gb"):
    """The Job app.execute would hand task=serve (by default a preset machine, so nothing is measured)."""
    from onn.app import from_checkpoint
    from onn.hardware.profile import resolve
    from onn.modalities import Job, get

    config = compose(
        "task=serve",
        hardware,
        "tracking=none",
        f"paths.outputs={tmp / 'outputs'}",
        f"paths.cache={tmp / 'cache'}",
        *overrides,
    )
    if ckpt is not None:
        config.ckpt = str(ckpt)
        ckpt, _ = from_checkpoint(config, set())
    modality = get(config.data.modality)
    hardware = resolve(config.hardware, config.paths.cache, config.paths.outputs)
    plan, spec = modality.plan(config, hardware)
    return Job(config, tmp / "run", modality, hardware, plan, spec, ckpt)


def start(job):
    from onn.tasks.serve.server import Running
    from onn.tasks.serve.task import build_app

    return Running(build_app(job))


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A random-init tiny Llama (byte tokenizer), resident, with a key."""
    tmp = tmp_path_factory.mktemp("serve")
    with start(
        serve_job(
            tmp,
            f"model={MODEL}",
            "strategy=full",
            f"serve.api_key={KEY}",
            "serve.slots=4",
            "serve.max_tokens=64",
            "serve.max_prompt_tokens=256",
        )
    ) as running:
        yield running


def client(running, key: str | None = KEY):
    import httpx2

    return httpx2.Client(base_url=running.url, timeout=120, headers={"Authorization": f"Bearer {key}"} if key else {})


def chat(http, content: str, max_tokens: int = 12, **extra) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_openai_client_gets_plain_and_streamed_chat_completions(lm):
    from openai import OpenAI

    api = OpenAI(base_url=f"{lm.url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in api.models.list()] == [MODEL]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    plain = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert plain.usage.completion_tokens <= 10 and plain.usage.prompt_tokens > 0
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    chunks = list(
        api.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content  # greedy: the same text, whether streamed or not
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    text = api.completions.create(model=MODEL, prompt="12+3=", max_tokens=6, temperature=0)
    assert text.choices[0].finish_reason in ("stop", "length") and text.usage.prompt_tokens >= len("12+3=")


def test_the_raw_stream_is_server_sent_events_ending_in_done(lm):
    with (
        client(lm) as http,
        http.stream(
            "POST",
            "/v1/completions",
            json={"model": MODEL, "prompt": "ab", "max_tokens": 5, "temperature": 0, "stream": True},
        ) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_key_is_required_except_for_health(lm):
    with client(lm, key=None) as anonymous, client(lm, key="wrong") as wrong:
        assert anonymous.get("/health").status_code == 200
        for http in (anonymous, wrong):
            for response in (http.get("/v1/models"), http.post("/v1/chat/completions", json={})):
                assert response.status_code == 401
                assert response.json()["error"]["type"] == "authentication_error"


def test_max_tokens_stop_seed_and_limits(lm):
    with client(lm) as http:
        short = chat(http, "count", max_tokens=3)
        assert short["usage"]["completion_tokens"] <= 3
        full = chat(http, "count", max_tokens=12)["choices"][0]["message"]["content"]
        if len(full) >= 4:  # a stop string cuts the text before it, and the finish reason is stop
            stop = full[2:4]
            cut = chat(http, "count", max_tokens=12, stop=[stop])
            assert cut["choices"][0]["message"]["content"] == full[: full.find(stop)]
            assert cut["choices"][0]["finish_reason"] == "stop"
        sampled = [
            chat(http, "pick", max_tokens=8, temperature=1.0, seed=7)["choices"][0]["message"]["content"]
            for _ in range(2)
        ]
        assert sampled[0] == sampled[1]  # the same seed, the same sample
        for body, status in (
            ({"max_tokens": 65}, 400),
            ({"messages": [{"role": "user", "content": "x" * 300}]}, 400),
            ({"model": "gpt-4"}, 404),
            ({"temperature": 3}, 400),
            ({"stop": ["a"] * 5}, 400),
        ):
            response = http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body},
            )
            assert response.status_code == status, (body, response.text)
        too_big = http.post(
            "/v1/chat/completions",
            content=b"{" + b" " * (2**20 + 10) + b"}",
            headers={"Content-Type": "application/json"},
        )
        assert too_big.status_code == 413


ALTERNATING = (  # a chat template like Llama-2's or Mistral's: an optional system message, then user/assistant turns
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set msgs = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and sys %}[SYS]{{ sys }}[/SYS]{% endif %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "[assistant]"
)


def served_model(running):
    """The LanguageModel the running server decodes with (its tokenizer and Prompter)."""
    return running.app.state.scheduler.lm


def serve_settings(running):
    """The running server's serve.* settings (a test may change one for its own requests)."""
    return next(r.endpoint.__self__ for r in running.app.routes if r.path == "/v1/chat/completions").settings


def test_a_one_message_chat_fills_a_data_template_of_record_fields(lm, monkeypatch):
    """docs/text.md's data.template='{instruction}\\n{input}': the user's text is the instruction, the input
    empty, as an Alpaca record without one was trained (it was a 400 naming {instruction})."""
    prompter = served_model(lm).prompter
    monkeypatch.setattr(prompter, "template", "{instruction}\n{input}")
    expected = served_model(lm).tokenizer("Name a colour.\n", add_special_tokens=prompter.add_special_tokens)
    with client(lm) as http:
        reply = chat(http, "Name a colour.", max_tokens=2)
    assert reply["usage"]["prompt_tokens"] == len(expected["input_ids"])


def test_without_max_tokens_the_default_is_cut_to_what_the_context_leaves(lm, monkeypatch):
    """A request that gives no max_tokens is not refused for one: the default fits the context the prompt leaves,
    and a prompt that fills the context is named as the problem."""
    from onn.tasks.serve import api

    monkeypatch.setattr(api, "_context", lambda served: 24)
    body = {"model": MODEL, "temperature": 0}
    with client(lm) as http:
        fits = http.post("/v1/completions", json={**body, "prompt": "x" * 20})
        assert fits.status_code == 200, fits.text
        assert fits.json()["usage"]["total_tokens"] <= 24
        for extra, param in (({"prompt": "x" * 24}, "prompt"), ({"prompt": "x" * 20, "max_tokens": 10}, "max_tokens")):
            refused = http.post("/v1/completions", json={**body, **extra})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
            assert refused.json()["error"]["code"] == "context_length_exceeded"


def test_a_developer_message_is_the_system_message(lm, monkeypatch):
    """OpenAI's developer role replaces system: a chat template that takes a system message and then alternating
    turns gets it as one (it was a user turn, and this template refused user, user)."""
    served = served_model(lm)
    monkeypatch.setattr(served.tokenizer, "chat_template", ALTERNATING)
    monkeypatch.setattr(served.prompter, "chat", True)
    prompt_tokens = {}
    with client(lm) as http:
        for role in ("system", "developer"):
            messages = [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "hi"}]
            body = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            prompt_tokens[role] = response.json()["usage"]["prompt_tokens"]
    assert prompt_tokens["developer"] == prompt_tokens["system"]


def test_serve_template_false_gives_the_model_the_messages_as_typed(lm, monkeypatch):
    """serve.template=false: no chat template either, the text tokenized as /v1/completions tokenizes a prompt."""
    served = served_model(lm)
    monkeypatch.setattr(
        served.tokenizer,
        "chat_template",
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>",
    )
    monkeypatch.setattr(served.prompter, "chat", True)
    monkeypatch.setattr(serve_settings(lm), "template", False)
    with client(lm) as http:
        typed = chat(http, "hi there", max_tokens=1)["usage"]["prompt_tokens"]
        completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi there", "max_tokens": 1})
    assert typed == completion.json()["usage"]["prompt_tokens"]


def test_openai_nullable_values_are_taken_and_unimplemented_fields_refused(lm):
    """stream: null and top_p: 0 (the likeliest token alone) as OpenAI takes them; logprobs, top_logprobs and
    echo, which this server does not compute, a 400 naming the field (they were answered 200 with no logprobs)."""
    with client(lm) as http:
        greedy = chat(http, "hi", max_tokens=6)["choices"][0]["message"]["content"]
        assert chat(http, "hi", max_tokens=6, stream=None)["choices"][0]["message"]["content"] == greedy
        assert chat(http, "hi", max_tokens=6, temperature=1.0, top_p=0)["choices"][0]["message"]["content"] == greedy
        asks = {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "hi"}
        for path, ask, field, value in (
            ("/v1/chat/completions", asks[0], "logprobs", True),
            ("/v1/chat/completions", asks[0], "top_logprobs", 2),
            ("/v1/completions", asks[1], "logprobs", 2),
            ("/v1/completions", asks[1], "echo", True),
        ):
            response = http.post(path, json={"model": MODEL, "max_tokens": 4, **ask, field: value})
            assert response.status_code == 400, (field, response.text)
            error = response.json()["error"]
            assert error["param"] == field and field in error["message"] and error["code"] == "unsupported_parameter"


def test_openai_fields_the_server_does_not_compute_are_refused_unless_they_ask_for_nothing(lm):
    """Penalties, logit_bias, JSON mode, tools, best_of and suffix were answered 200 with the same text as without
    them: a 400 naming the field now, while null/0/{}/[] and the defaults that ask for nothing are taken."""
    chat_ask = {"messages": [{"role": "user", "content": "hi"}]}
    refused = (
        ("/v1/chat/completions", chat_ask, "frequency_penalty", 5),
        ("/v1/chat/completions", chat_ask, "presence_penalty", 1.5),
        ("/v1/chat/completions", chat_ask, "logit_bias", {"50": 100}),
        ("/v1/chat/completions", chat_ask, "response_format", {"type": "json_object"}),
        ("/v1/chat/completions", chat_ask, "tools", [{"type": "function", "function": {"name": "f"}}]),
        ("/v1/chat/completions", chat_ask, "tool_choice", "required"),
        ("/v1/chat/completions", chat_ask, "functions", [{"name": "f"}]),
        ("/v1/completions", {"prompt": "hi"}, "best_of", 3),
        ("/v1/completions", {"prompt": "hi"}, "suffix", " end"),
    )
    taken = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
             "response_format": {"type": "text"}, "functions": None}  # fmt: skip
    with client(lm) as http:
        for path, ask, field, value in refused:
            response = http.post(path, json={"model": MODEL, "max_tokens": 2, **ask, field: value})
            assert response.status_code == 400, (field, response.text)
            error = response.json()["error"]
            assert error["param"] == field and error["code"] == "unsupported_parameter", error
        assert chat(http, "hi", max_tokens=2, **taken)["choices"][0]["message"]["role"] == "assistant"
        completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "best_of": 1, "suffix": None}
        assert http.post("/v1/completions", json=completion).status_code == 200


def test_a_bool_is_no_neutral_number_and_every_chunk_carries_usage_when_asked(lm):
    """best_of=true was taken (True == 1 matched its neutral 1); OpenAI refuses it. With
    stream_options.include_usage every chunk has a usage field, null until the last (OpenAI's reference)."""
    with client(lm) as http:
        response = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, "prompt": "hi", "best_of": True})
        assert response.status_code == 400 and response.json()["error"]["param"] == "best_of", response.text
        body = {"model": MODEL, "prompt": "12+3=", "max_tokens": 4, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json={**body, "stream_options": {"include_usage": True}}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
        assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] >= 1
        with http.stream("POST", "/v1/completions", json=body) as r:  # not asked: no usage field at all
            assert all(
                "usage" not in json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"
            )


def test_output_and_sampler_fields_the_server_does_not_apply_are_refused(lm):
    """modalities: ["audio"], audio, top_k, min_p and repetition_penalty were answered 200 with plain text and
    greedy or top-p tokens: a 400 naming the field now, while the values that ask for nothing are taken."""
    ask = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with client(lm) as http:
        for field, value in (
            ("modalities", ["text", "audio"]),
            ("audio", {"voice": "alloy", "format": "wav"}),
            ("top_k", 40),
            ("min_p", 0.1),
            ("repetition_penalty", 1.3),
        ):
            response = http.post("/v1/chat/completions", json={**ask, field: value})
            assert response.status_code == 400, (field, response.text)
            error = response.json()["error"]
            assert error["param"] == field and error["code"] == "unsupported_parameter", error
        taken = {"modalities": ["text"], "top_k": -1, "min_p": 0, "repetition_penalty": 1.0}
        assert chat(http, "hi", max_tokens=2, **taken)["choices"][0]["message"]["role"] == "assistant"


def test_a_refusal_names_the_field_the_client_sent(lm):
    """An image part was "messages.0.content.str: Input should be a valid string", token ids "prompt.str", and
    max_completion_tokens over serve.max_tokens was refused as max_tokens, a field the client had not sent."""
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with client(lm) as http:
        for path, ask, param, said in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": image}]}, "messages.0.content", "text"),
            ("/v1/completions", {"prompt": [1, 2, 3]}, "prompt", "no token ids"),
            ("/v1/completions", {"prompt": "hi", "stop": [5]}, "stop", "list of strings"),
            ("/v1/completions", {"prompt": "hi", "max_completion_tokens": 65}, "max_completion_tokens", "at most 64"),
        ):
            response = http.post(path, json={"model": MODEL, **ask})
            assert response.status_code == 400, (ask, response.text)
            error = response.json()["error"]
            assert error["param"] == param and error["message"].startswith(param) and said in error["message"], error
            assert "str" not in error["message"].split(":")[0] and "Input should be" not in error["message"], error


def test_metrics_count_requests_answered_and_every_token_decoded(lm, monkeypatch):
    """A stream whose client left (the page's Stop) added no completion tokens: only a finish event counted them.
    Each request now counts once, as answered or refused, and every token decoded counts."""
    from onn.tasks.serve.task import figures

    scheduler = lm.app.state.scheduler
    step = scheduler.lm.step

    def paced_step(*args):  # 20 ms a token: 64 tokens outlast a client that reads 6 of them
        time.sleep(0.02)
        return step(*args)

    monkeypatch.setattr(scheduler.lm, "step", paced_step)
    before = figures(lm.app)
    body = {"model": MODEL, "prompt": "long", "max_tokens": 64, "temperature": 0, "stream": True}
    with client(lm) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            read = 0
            for line in response.iter_lines():
                read += line.startswith("data: {")
                if read == 6:
                    break  # the client goes away
        deadline = time.monotonic() + 30
        while (
            scheduler.active or lm.app.state.stats.requests == before["serve/requests"]
        ) and time.monotonic() < deadline:
            time.sleep(0.01)
        monkeypatch.setattr(scheduler.lm, "step", step)
        whole = chat(http, "hi", max_tokens=3)["usage"]["completion_tokens"]
        refused = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 65})
        assert refused.status_code == 400
    after = figures(lm.app)
    assert after["serve/requests"] - before["serve/requests"] == 2
    assert after["serve/refused"] - before["serve/refused"] == 1
    assert after["serve/completion_tokens"] - before["serve/completion_tokens"] >= read + whole


def test_the_browsers_own_icon_request_needs_no_key_and_counts_as_nothing(lm):
    """A browser asks for /favicon.ico by itself: it was a 404 (401 with a key) counted in serve/refused, so
    opening the page showed a refused request in metrics.json."""
    stats = lm.app.state.stats
    refused = stats.refused
    with client(lm, key=None) as anonymous:
        assert anonymous.get("/favicon.ico").status_code == 204
    assert stats.refused == refused


def test_an_unpaired_surrogate_in_a_prompt_is_a_400_naming_it(lm):
    """JSON's "\\ud800" is a lone half of a UTF-16 pair, which the tokenizer refused with a TypeError: a 500 and a
    traceback, for what the client got wrong."""
    with client(lm) as http:
        for path, ask, param in (
            ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
        ):
            body = json.dumps({"model": MODEL, "max_tokens": 2, **ask})  # ensure_ascii: the escape as JSON sends it
            response = http.post(path, content=body.encode(), headers={"Content-Type": "application/json"})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and "unpaired surrogate" in error["message"], error
        assert chat(http, "still there?", max_tokens=2)["choices"][0]["message"]["role"] == "assistant"


INVALID = {  # per field of a chat request, values OpenAI's API refuses (strict types: "5" is no number, true no int)
    "model": [None, 5, [], {}, True, "gpt-4o", "", "llama_tiny ", "../../etc/passwd", "x" * 5000],
    "messages": [None, [], "hi", 5, {}, [None], [[]], [{"content": "hi"}], [{"role": "wizard", "content": "hi"}],
                 [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]],
    "max_tokens": [0, -1, 2**70, 1e308, "5", True, 3.5, 65, [], {}],
    "max_completion_tokens": [0, -3, "7", 1e9, 10**6],
    "temperature": [-1, 2.5, 1e308, "0", True, [], -1e308],
    "top_p": [-0.1, 1.5, "1", False, {}],
    "stop": [5, [5], [None], [""], ["a"] * 9, {}, True, "x" * 300],
    "seed": [-(2**63) - 1, 2**70, "1", 1.5, True, []],
    "n": [0, 2, -1, "1", 1.5],
    "stream": ["yes", 1, 0, []],
    "stream_options": ["x", 5, [], True],
}  # fmt: skip
RAW = [
    b"",
    b"{",
    b"}",
    b"null",
    b"[]",
    b"42",
    b'"text"',
    b"\xff\xfe\x00",
    b'{"model": NaN}',
    b'{"model": Infinity}',
    b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b'{"model": "llama_tiny", "messages": "hi"}',
    b'{"model": "llama_tiny", "prompt": 5}',
    b'{"model": "llama_tiny", "prompt": [1, 2]}',  # token ids (a list of prompts is taken: one choice each)
]


def malformed_requests(count: int) -> list[tuple[str, str, dict | None, bytes | None]]:
    """(method, path, json, raw body) of requests no server should take: bad JSON, wrong types, huge or
    negative values, unknown models and routes, and uploads where none belongs."""
    rng = random.Random(0)
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    out = []
    for i in range(count):
        kind = i % 4
        if kind == 0:
            out.append(("POST", rng.choice(["/v1/chat/completions", "/v1/completions"]), None, rng.choice(RAW)))
        elif kind == 1:
            field = rng.choice(sorted(INVALID))
            out.append(("POST", "/v1/chat/completions", {**good, field: rng.choice(INVALID[field])}, None))
        elif kind == 2:
            path = rng.choice(["/v1/nothing", "/v2/chat/completions", "/v1/models/gpt-4", "/etc/passwd", "/v1/chat"])
            out.append((rng.choice(["GET", "POST", "DELETE"]), path, None, b"{}"))
        else:
            out.append(("POST", "/v1/classify", None, rng.choice([b"", b"--x\r\n", b"not multipart", b"\x00" * 100])))
    return out


def test_a_fuzz_of_malformed_requests_gets_4xx_and_the_server_stays_up(lm):
    requests = malformed_requests(360)
    statuses = []
    with client(lm) as http:
        for method, path, body, raw in requests:
            headers = {
                "Content-Type": "multipart/form-data; boundary=x" if path == "/v1/classify" else "application/json"
            }
            response = (
                http.request(method, path, json=body, headers=headers)
                if raw is None
                else http.request(method, path, content=raw, headers=headers)
            )
            statuses.append(response.status_code)
            assert 400 <= response.status_code < 500, (
                method,
                path,
                body,
                raw and raw[:80],
                response.text[:300],
            )
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert chat(http, "still there?", max_tokens=4)["choices"][0]["message"]["role"] == "assistant"
    assert len(statuses) >= 300 and {400, 404, 405} <= set(statuses)


def concurrent_equals_alone(running, prompts: list[str], max_tokens: list[int]) -> None:
    """Greedy requests sent together (they share decode steps, joining as they arrive) give what each gives alone."""
    with client(running) as http:
        alone = [chat(http, p, n)["choices"][0]["message"]["content"] for p, n in zip(prompts, max_tokens)]

        def one(i: int) -> str:
            time.sleep(0.01 * i)  # staggered: later ones join a decode already running
            return chat(http, prompts[i], max_tokens[i])["choices"][0]["message"]["content"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(one, range(len(prompts))))
    assert together == alone
    assert running.app.state.scheduler.widest > 1  # they did share steps


def test_concurrent_greedy_requests_give_what_each_gives_alone(lm):
    prompts = ["a", "the cat sat on", "1+1=", "hello there, how are you today?", "zz", "x y"]
    concurrent_equals_alone(lm, prompts, [10, 6, 14, 8, 12, 9])


def test_a_decode_step_reads_every_rows_token_back_in_one_copy():
    """The batch's next tokens (greedy rows' argmax, sampled rows' draws with their own seeds) come back to the
    host together: on a GPU each read waits for every kernel queued, and a read per row made N waits a step."""
    from types import SimpleNamespace

    from conftest import HostReads

    from onn.tasks.serve.batching import Sampling, _pick

    def row(temperature: float, seed: int | None = None):
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return SimpleNamespace(sampling=Sampling(max_tokens=4, temperature=temperature, top_p=0.9), generator=generator)

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    with HostReads() as reads:
        tokens = _pick(logits, [row(0.0), row(1.0, seed=7), row(0.0)])
    assert reads.seen == ["tolist"]
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert tokens[1] == _pick(logits[1:2], [row(1.0, seed=7)])[0]  # the seed's draw, whatever rows it shares
    assert len({tuple(_pick(logits, [row(2.0, seed=s)] * 3)) for s in range(8)}) > 1  # sampled, not greedy


def test_a_tiny_temperature_is_greedy_and_a_failed_draw_ends_only_its_own_request(lm, monkeypatch):
    """temperature=1e-45 (valid: 0 to 2) divided the logits into inf, and the failed draw ended every request in the
    batch with a 503. It is greedy now; and a row whose draw still fails (NaN logits) ends alone, with its error."""
    scheduler = lm.app.state.scheduler
    with client(lm) as http:
        greedy = chat(http, "hi", max_tokens=8)["choices"][0]["message"]["content"]
        assert chat(http, "hi", max_tokens=8, temperature=1e-45)["choices"][0]["message"]["content"] == greedy
        step, both_in = scheduler.lm.step, threading.Event()

        def poisoned_step(*args):  # the decode thread waits for both requests; the seed-13 row's logits are NaN
            both_in.wait(60)
            logits = step(*args)
            for i, seq in enumerate(scheduler.active):
                if seq.sampling.seed == 13:
                    logits[i] = float("nan")
            return logits

        monkeypatch.setattr(scheduler.lm, "step", poisoned_step)
        while scheduler.active:  # the last answer's row leaves the batch just after its client has it
            time.sleep(0.005)
        with ThreadPoolExecutor(2) as pool:
            victim = pool.submit(chat, http, "hi", 8)
            while in_flight(scheduler) < 1:
                time.sleep(0.005)
            body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "temperature": 1.0, "seed": 13}
            failed = pool.submit(http.post, "/v1/completions", json=body)
            while in_flight(scheduler) < 2:
                time.sleep(0.005)
            both_in.set()
            error = failed.result().json()["error"]  # NaN scores: the model diverged, a 500 as /v1/classify's
            assert failed.result().status_code == 500 and error["code"] == "model_diverged", error
            assert victim.result()["choices"][0]["message"]["content"] == greedy


def in_flight(scheduler) -> int:
    """Requests the scheduler holds: decoding, or waiting for a slot (stats count a request once it is answered)."""
    return len(scheduler.active) + len(scheduler.waiting)


def test_a_layer_streamed_model_batches_through_the_engine(tmp_path):
    job = serve_job(
        tmp_path,
        f"model={MODEL}",
        "strategy=sparse_lora",
        "strategy.streaming.store=disk",
        "strategy.streaming.chunk_size=2",
        f"serve.api_key={KEY}",
    )
    with start(job) as running:
        engine = running.app.state.scheduler.lm.engine
        assert engine is not None and engine.store.kind == "disk"
        concurrent_equals_alone(running, ["a", "the cat", "1+1=", "hello"], [8, 5, 10, 7])
        assert engine.times.loads > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", ["full", "sparse_lora"])
def test_on_the_gpu_concurrent_greedy_requests_give_what_each_gives_alone(strategy, tmp_path):
    """task=serve on CUDA, resident and layer-streamed, in float32 (bf16 kernels differ with the batch's shape, so
    a near-tie between two tokens could flip a greedy choice): requests sent together give what each gives alone."""
    job = serve_job(
        tmp_path,
        f"model={MODEL}",
        f"strategy={strategy}",
        "strategy.precision=32-true",
        f"serve.api_key={KEY}",
        hardware="hardware=auto",
    )
    assert job.plan.hardware["accelerator"] == "cuda"
    with start(job) as running:
        assert (running.app.state.scheduler.lm.engine is not None) == (strategy == "sparse_lora")
        concurrent_equals_alone(running, ["a", "the cat", "1+1=", "hello"], [8, 5, 10, 7])


def test_a_client_that_goes_away_frees_its_slot(lm):
    scheduler = lm.app.state.scheduler
    with client(lm) as http:
        with http.stream(
            "POST",
            "/v1/completions",
            json={"model": MODEL, "prompt": "long", "max_tokens": 64, "temperature": 0, "stream": True},
        ) as response:
            next(response.iter_lines())  # the first event arrived: the sequence decodes
        deadline = time.monotonic() + 30
        while scheduler.active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not scheduler.active
        assert chat(http, "next", max_tokens=3)["usage"]["completion_tokens"] <= 3


def test_a_client_that_leaves_a_whole_completion_frees_its_slot_before_max_tokens(lm, monkeypatch):
    """A non-streamed request's client that disconnects while it decodes: its row leaves the batch then, not at
    max_tokens (the scheduler sends an event every token, so a check only after a quiet second never ran)."""
    scheduler = lm.app.state.scheduler
    step = scheduler.lm.step

    def paced_step(*args):  # 50 ms a token: 64 tokens outlast the client by far, even on a busy machine
        time.sleep(0.05)
        return step(*args)

    monkeypatch.setattr(scheduler.lm, "step", paced_step)
    body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 64, "temperature": 0}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", lm.port)) as raw:
        raw.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while not (scheduler.active and scheduler.active[0].tokens) and time.monotonic() < deadline:
            time.sleep(0.005)
        seq = scheduler.active[0]  # decoding; the client closes its connection now
    deadline = time.monotonic() + 30
    while scheduler.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seq.cancelled.is_set() and len(seq.tokens) < 64


def test_ctrl_c_ends_the_requests_in_flight_with_an_error_and_a_streams_done(tmp_path, monkeypatch):
    """Ctrl-C (uvicorn's handle_exit) stops the model first: a whole request gets a 503 with OpenAI's error object
    and a stream its error event and [DONE]. The scheduler was closed only after uvicorn's grace period had
    cancelled the handlers: a plain-text 500, a stream cut off."""
    with start(serve_job(tmp_path, f"model={MODEL}", "strategy=full", f"serve.api_key={KEY}")) as running:
        scheduler = running.app.state.scheduler
        step, stopped = scheduler.lm.step, threading.Event()

        def held_step(*args):  # from the third step on, decoding waits for the shutdown: both stay in flight
            if scheduler.steps >= 2:
                stopped.wait(60)
            return step(*args)

        monkeypatch.setattr(scheduler.lm, "step", held_step)
        body = {"model": MODEL, "prompt": "long", "max_tokens": 64, "temperature": 0}

        def streamed() -> list[str]:
            with client(running) as http, http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                return [line for line in r.iter_lines() if line]

        with client(running) as http, ThreadPoolExecutor(2) as pool:
            whole, stream = pool.submit(http.post, "/v1/completions", json=body), pool.submit(streamed)
            deadline = time.monotonic() + 60
            while (in_flight(scheduler) < 2 or scheduler.steps < 2) and time.monotonic() < deadline:
                time.sleep(0.01)
            running.server.handle_exit(signal.SIGINT, None)  # what Ctrl-C calls
            stopped.set()
            response, events = whole.result(), stream.result()
    assert response.status_code == 503, response.text
    error, streamed_error = response.json()["error"], json.loads(events[-2][6:])["error"]
    assert "shutting down" in error["message"] and error["code"] == "server_shutting_down"  # retry elsewhere
    assert events[-1] == "data: [DONE]" and "shutting down" in streamed_error["message"]
    assert streamed_error["code"] == "server_shutting_down"


def test_an_upload_keeps_its_extension_when_its_name_has_dots_of_its_own():
    """Audio and video readers go by the extension: "Voice memo 1.2 (edited).wav" lost its .wav and was refused."""
    from onn.tasks.serve.api import _run_classifier

    class NameSeen:
        def classify(self, path, top_k):
            return [(path.name, 1.0)], None

    for name, kept in (
        ("memo.wav", "upload.wav"),
        ("Voice memo 1.2 (edited).wav", "upload.wav"),
        ("take_3.final-mix.wav", "upload.wav"),
        ("Scan.NII.GZ", "upload.nii.gz"),
        ("no extension", "upload"),
    ):
        assert _run_classifier(NameSeen(), b"x", name, 1, False)[0][0][0] == kept, name


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny image classifier trained for a few epochs on generated images, served."""
    from test_vision_train import make_images, run

    tmp = tmp_path_factory.mktemp("classifier")
    threads = torch.get_num_threads()
    images = make_images(tmp / "images", train=12, test=2)
    _, run_dir = run(
        tmp,
        f"data.source={images}",
        "trainer.max_epochs=6",
        "optim.lr=0.1",  # 0.2 diverged to NaN weights with some batch orders
        "data.batch_size=8",
        "hardware=cpu_16gb",
    )  # learns the stripes: test accuracy 1.0
    torch.set_num_threads(threads)  # a preset machine's plan may set its own
    with start(serve_job(tmp, "model=v28_cnn", "data=image", f"data.source={images}", ckpt=run_dir)) as running:
        running.images = images
        yield running


def test_classify_an_upload(classifier):
    picture = classifier.images / "test" / "class1" / "000.png"
    with client(classifier, key=None) as http:
        response = http.post(
            "/v1/classify",
            files={"file": ("x.png", picture.read_bytes(), "image/png")},
            data={"top_k": "2", "picture": "true"},
        )
        assert response.status_code == 200, response.text
        result = response.json()
        assert len(result["labels"]) == 2 and {r["label"] for r in result["labels"]} <= {
            "class0",
            "class1",
            "class2",
        }
        assert result["labels"][0]["probability"] >= result["labels"][1]["probability"]
        assert result["picture"].startswith("data:image/png;base64,")
        bad = http.post("/v1/classify", files={"file": ("x.png", b"\x89PNG not really", "image/png")})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "unreadable_file"
        assert http.post("/v1/classify", data={"top_k": "2"}).status_code == 400
        assert http.post("/v1/chat/completions", json={"model": "v28_cnn", "messages": []}).status_code == 400
        assert http.get("/health").json()["kind"] == "classifier"


def test_an_upload_that_is_no_image_is_named_so_without_a_data_sets_advice(classifier):
    """A text file, or bytes that are no image: the Predictor's own sentence with the reason. read_inputs' message
    for task.input came through (its dataset formats, "or set data.max_bad_fraction")."""
    with client(classifier, key=None) as http:
        for name, data, reason in (
            ("notes.md", b"just some text\n", "cannot tell its format"),
            ("notes.txt", b"just some text\n", "holds a header but no rows"),  # a .txt is read as a list of images
            ("photo.jpg", bytes(random.Random(0).randrange(256) for _ in range(2000)), "not an image"),
        ):
            response = http.post("/v1/classify", files={"file": (name, data, "application/octet-stream")})
            assert response.status_code == 400, response.text
            message = response.json()["error"]["message"]
            assert message.startswith("the upload is no image file ONN can decode: ") and reason in message, message
            assert "task.input" not in message and "data." not in message and "supported formats" not in message


def test_an_undecodable_upload_is_named_by_the_clients_file_name(classifier):
    """The reader's skip report named the server's temporary file: "...decode: upload.jpeg: not an image..."."""
    noise = bytes(random.Random(1).randrange(256) for _ in range(2000))
    with client(classifier, key=None) as http:
        response = http.post("/v1/classify", files={"file": ("my scan.jpeg", noise, "image/jpeg")})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "my scan.jpeg: not an image" in message and "upload.jpeg" not in message, message


def test_a_refused_upload_counts_as_refused_alone(classifier):
    """serve/requests was counted before the upload was decoded: a corrupt file counted as answered and refused."""
    stats = classifier.app.state.stats
    before = stats.requests, stats.refused
    good = (classifier.images / "test" / "class1" / "000.png").read_bytes()
    with client(classifier, key=None) as http:
        assert http.post("/v1/classify", files={"file": ("a.png", good, "image/png")}).status_code == 200
        assert http.post("/v1/classify", files={"file": ("b.png", b"\x89PNG no", "image/png")}).status_code == 400
    assert (stats.requests, stats.refused) == (before[0] + 1, before[1] + 1)


def test_a_classifier_out_of_device_memory_answers_503_and_serves_the_next_upload(classifier, monkeypatch):
    """Out of GPU memory on one upload is the server's state, not a bad file: 503 in one sentence (it was a 400
    saying the file could not be decoded), and the next upload is answered."""
    from onn.modalities.classification import Predictor

    classify = Predictor.classify

    def out_of_memory_once(self, path, top_k):
        monkeypatch.setattr(Predictor, "classify", classify)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Predictor, "classify", out_of_memory_once)
    upload = {"file": ("x.png", (classifier.images / "test" / "class1" / "000.png").read_bytes(), "image/png")}
    with client(classifier, key=None) as http:
        refused = http.post("/v1/classify", files=upload)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "out_of_memory"
        assert "ran out of device memory" in refused.json()["error"]["message"]
        assert http.post("/v1/classify", files=upload).status_code == 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_cli_serves_until_ctrl_c_and_records_the_run(tmp_path):
    import httpx2

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ONN_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "task=serve",
            f"model={MODEL}",
            "strategy=full",
            f"serve.port={port}",
            f"paths.outputs={tmp_path}",
            "hardware=cpu_16gb",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stdout.read() if proc.poll() is not None else "slow"
            )
            time.sleep(0.3)
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx2.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 401  # ONN_API_KEY is the key
        response = httpx2.post(
            f"http://127.0.0.1:{port}/v1/completions",
            headers=headers,
            timeout=60,
            json={"model": MODEL, "prompt": "hi", "max_tokens": 3},
        )
        assert response.status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert f"127.0.0.1:{port}" in out
    metrics = read_metrics(tmp_path / "run")
    assert metrics["status"] == "ok" and metrics["serve/requests"] == 1 and metrics["serve/refused"] == 1


def test_serve_settings_are_checked_first():
    from dataclasses import replace

    from onn.errors import UserError
    from onn.tasks.serve.task import check, free_address

    config = compose("task=serve")
    check(config)
    for key, value in (("port", 70000), ("slots", 0), ("max_tokens", "many"), ("api_key", ""), ("api_key", "clé")):
        with pytest.raises(UserError, match=f"serve.{key}"):
            check(replace(config, serve=replace(config.serve, **{key: value})))  # past Hydra's type checks
    with pytest.raises(Exception, match="serve.max_tokens"):  # a wrong type on the command line: Hydra's message
        compose("task=serve", "serve.max_tokens=many")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(UserError, match="cannot be listened on"):
            free_address("127.0.0.1", taken.getsockname()[1])  # said before the model is built


def test_a_host_that_is_not_this_machines_is_named_as_the_host_not_the_port():
    """serve.host=192.0.2.1 (TEST-NET: no machine's) or a name that does not resolve was told to choose another
    serve.port; with serve.port=0 it was not checked before the model was built at all."""
    from onn.errors import UserError
    from onn.tasks.serve.task import free_address

    for host, port in (("192.0.2.1", 8000), ("192.0.2.1", 0), ("nonexistent.invalid", 8000)):
        with pytest.raises(UserError, match=f"serve.host={host} is not an address of this machine") as said:
            free_address(host, port)
        assert "serve.port" not in str(said.value)
    free_address("127.0.0.1", 0)


def test_the_web_page_chats_and_classifies_in_a_real_browser(lm, classifier, tmp_path):
    with browser_page(lm.url) as page:
        page.fill("#key", KEY)
        page.dispatch_event("#key", "change")
        page.wait_for_selector("#chat-view:not(.hidden)")
        page.fill("#max-tokens", "24")
        page.fill("#prompt", "Hello, ONN!")
        page.click("#send")
        page.wait_for_function(
            "document.querySelector('.assistant') && document.querySelector('.assistant').textContent.length > 0"
        )
        page.wait_for_selector("#send:not([disabled])")
        assert page.text_content(".user") == "Hello, ONN!"
        chat_shot = tmp_path / "chat.png"
        page.screenshot(path=str(chat_shot))

        page.goto(classifier.url)
        page.wait_for_selector("#classify-view:not(.hidden)")
        page.set_input_files("#file", str(classifier.images / "test" / "class2" / "000.png"))
        page.wait_for_selector("#result:not(.hidden)")
        label = page.text_content("#top-label")
        assert label == "class2"
        assert page.eval_on_selector("#preview", "img => img.complete && img.naturalWidth > 0")
        shot = tmp_path / "classify.png"
        page.screenshot(path=str(shot))
    assert shot.stat().st_size > 1000 and chat_shot.stat().st_size > 1000
    if SCREENSHOT_COPY.parent.exists():
        _side_by_side(chat_shot, shot, SCREENSHOT_COPY)


NO_SERVER = "the server did not answer (is it still running?)"


@contextlib.contextmanager
def browser_page(url: str):
    """A page of the server in headless chromium; `page.errors` collects uncaught errors and rejections, and
    `page.bodies` the chat requests' JSON bodies."""
    if not CHROMIUM.exists():
        pytest.skip("no chromium: apt-get install -y chromium")
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            page.set_default_timeout(15000)
            page.errors, page.bodies = [], []
            page.on("pageerror", lambda e: page.errors.append(str(e)))
            page.on(
                "request",
                lambda r: page.bodies.append(json.loads(r.post_data)) if r.url.endswith("/chat/completions") else None,
            )
            page.goto(url)
            yield page
        finally:
            browser.close()


def page_send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")
    page.wait_for_selector("#send:not([disabled])")


def page_log(page) -> list[tuple[str, str]]:
    return [
        tuple(m) for m in page.eval_on_selector_all("#log .msg", "els => els.map(e => [e.className, e.textContent])")
    ]


def test_the_chat_page_keeps_refused_turns_out_and_new_chat_starts_afresh(lm, monkeypatch):
    """The page's conversation holds only turns the server answered. A refused message stayed in it with an empty
    answer (every later message was refused too); New chat left the old stream running into the new chat; a
    built-in max tokens of 128 was over this server's serve.max_tokens=64; a non-ASCII key threw on every fetch;
    an unreachable server was a bare "Failed to fetch"; an Enter confirming an input method's composition sent the
    half-typed text; a right-to-left message was laid out left to right; the browser's icon request was refused."""
    scheduler, stats = lm.app.state.scheduler, lm.app.state.stats
    refused = stats.refused
    with browser_page(lm.url) as page:
        page.fill("#key", "clé")
        page.dispatch_event("#key", "change")
        page.wait_for_function("document.querySelector('#model').textContent.includes('only ASCII')")
        page.fill("#key", KEY)
        page.dispatch_event("#key", "change")
        page.wait_for_selector("#chat-view:not(.hidden)")
        assert page.input_value("#max-tokens") == ""  # blank: the server's default, cut to fit its limits
        page_send(page, "hi")
        assert "max_tokens" not in page.bodies[-1] and [c for c, _ in page_log(page)] == ["msg user", "msg assistant"]
        answer = page_log(page)[1][1]
        page.fill("#max-tokens", "4")
        page_send(page, "x" * 300)  # over serve.max_prompt_tokens: refused
        assert page.input_value("#prompt") == "x" * 300  # given back, to shorten
        assert [c for c, _ in page_log(page)] == ["msg user", "msg assistant", "msg error"]
        page.route("**/v1/chat/completions", lambda route: route.abort())
        page_send(page, "anyone?")
        assert page_log(page)[-1] == ("msg error", NO_SERVER) and page.input_value("#prompt") == "anyone?"
        page.unroute("**/v1/chat/completions")
        page_send(page, "מה שלומך?")
        assert page.bodies[-1]["messages"] == [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "מה שלומך?"},
        ]
        assert page.eval_on_selector_all(".user", "els => getComputedStyle(els[els.length - 1]).direction") == "rtl"
        page.fill("#prompt", "にほん")
        sent = len(page.bodies)
        page.dispatch_event("#prompt", "keydown", {"key": "Enter", "isComposing": True, "keyCode": 229})
        assert page.input_value("#prompt") == "にほん" and len(page.bodies) == sent  # still composing: not sent

        step = scheduler.lm.step

        def paced_step(*args):  # 50 ms a token: the answer still streams when New chat is pressed
            time.sleep(0.05)
            return step(*args)

        monkeypatch.setattr(scheduler.lm, "step", paced_step)
        page.fill("#max-tokens", "60")
        page.fill("#prompt", "a long story")
        page.click("#send")
        page.wait_for_function("[...document.querySelectorAll('.assistant')].pop().textContent.length > 0")
        seq = scheduler.active[0]
        page.click("#clear")  # New chat while the answer streams
        assert page_log(page) == [] and page.is_enabled("#send") and page.is_disabled("#stop")
        while scheduler.active:
            time.sleep(0.01)
        assert len(seq.tokens) < 60  # the stream was stopped, not left decoding unseen
        monkeypatch.setattr(scheduler.lm, "step", step)
        page.fill("#max-tokens", "4")
        page_send(page, "a fresh question")
        assert page.bodies[-1]["messages"] == [{"role": "user", "content": "a fresh question"}]
        assert page.errors == []
    assert stats.refused == refused + 2  # the page's first /v1/models without a key, and the long message


def test_the_classify_page_shows_only_the_current_files_labels(classifier, tmp_path):
    """A refused upload left the previous file's labels on screen; a TIFF (which chromium cannot show) had a broken
    preview; an unreachable server left "classifying ..." on screen for good."""
    from PIL import Image

    tiff = tmp_path / "scan.tif"
    Image.open(classifier.images / "test" / "class2" / "000.png").save(tiff)
    (tmp_path / "notes.md").write_text("just some text\n")
    done = "!document.querySelector('#status').textContent.startsWith('classifying')"
    with browser_page(classifier.url) as page:
        page.wait_for_selector("#classify-view:not(.hidden)")
        page.set_input_files("#file", str(classifier.images / "test" / "class1" / "000.png"))
        page.wait_for_selector("#result:not(.hidden)")
        page.set_input_files("#file", str(tmp_path / "notes.md"))
        page.wait_for_function(done)
        assert "cannot tell its format" in page.text_content("#status") and not page.is_visible("#result")
        page.set_input_files("#file", str(tiff))
        page.wait_for_selector("#result:not(.hidden)")
        page.wait_for_function("(img => img.complete && img.naturalWidth > 0)(document.querySelector('#preview'))")
        page.route("**/v1/classify", lambda route: route.abort())
        page.set_input_files("#file", str(classifier.images / "test" / "class0" / "000.png"))
        page.wait_for_function(done)
        assert page.text_content("#status") == NO_SERVER and not page.is_visible("#result")
        assert page.errors == []


def _side_by_side(left: Path, right: Path, out: Path) -> None:
    from PIL import Image

    a, b = Image.open(left), Image.open(right)
    both = Image.new("RGB", (a.width + b.width, max(a.height, b.height)), "white")
    both.paste(a, (0, 0))
    both.paste(b, (a.width, 0))
    both.save(out)
    shutil.copy(left, out.with_name(out.stem + "-chat.png"))


def test_bench_serve_reports_the_speedup_latencies_and_no_errors(tmp_path):
    from onn.app import execute

    config = compose(
        "task=bench_serve",
        f"model={MODEL}",
        "strategy=sparse_lora",
        "strategy.streaming.store=disk",
        "tracking=none",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
        "task.requests=4",
        "task.max_tokens=6",
        "task.clients=8",
        "task.requests_per_client=2",
        "task.load_max_tokens=4",
        "hardware=cpu_16gb",
    )
    threads = torch.get_num_threads()
    try:
        metrics = execute(config, tmp_path / "run")
    finally:
        torch.set_num_threads(threads)  # a preset machine's plan may set its own
    assert metrics["serve/streamed"] and metrics["serve/store"] == "disk"
    assert metrics["serve/errors"] == 0 and metrics["serve/load_requests"] == 16
    assert metrics["serve/identical_to_alone"] == 4 and metrics["serve/widest_batch"] > 1
    # each step of the requests together loaded every chunk once for all of them
    assert metrics["serve/concurrent_chunk_loads"] < metrics["serve/sequential_chunk_loads"]
    for key in ("ttft", "token", ""):
        name = f"serve/{key}_p" if key else "serve/p"
        assert 0 < metrics[f"{name}50_ms"] <= metrics[f"{name}99_ms"]


def test_bench_serve_settings_are_checked_before_the_model_is_built(tmp_path):
    """task.requests=0 was an IndexError, task.max_tokens=0 (or over serve.max_tokens) an HTTP 400 raised from
    the bench, task.clients=0 a thread pool's ValueError after the first phase: one sentence each, first."""
    from dataclasses import replace

    from onn.app import execute
    from onn.errors import UserError

    config = compose(
        "task=bench_serve", f"model={MODEL}", "strategy=full", "tracking=none", "hardware=cpu_16gb",
        f"paths.outputs={tmp_path / 'outputs'}", f"paths.cache={tmp_path / 'cache'}",
    )  # fmt: skip
    most = config.serve.max_tokens
    for key, value, said in (
        ("requests", 0, "1 or more"),
        ("max_tokens", 0, "1 or more"),
        ("clients", 0, "1 or more"),
        ("requests_per_client", -1, "1 or more"),
        ("load_max_tokens", True, "1 or more"),
        ("max_tokens", most + 1, "serve.max_tokens"),
        ("load_max_tokens", most + 1, "serve.max_tokens"),
    ):
        with pytest.raises(UserError, match=f"task.{key}={value!r}.*{said}"):
            execute(replace(config, task=replace(config.task, **{key: value})), tmp_path / "run")
    with pytest.raises(UserError, match="serve.slots"):  # serve.* as task=serve checks them
        execute(replace(config, serve=replace(config.serve, slots=0)), tmp_path / "run")


def test_bench_serve_percentiles_are_the_nearest_rank():
    """The p-th percentile of n values is the ceil(p/100 * n)-th smallest: the p50 of 1..10 ms is 5 and the p99
    of 1..100 ms is 99 (they were 6 and 100: rounding half to even put them one rank high)."""
    from onn.bench.serve import percentile

    ms = [i / 1000 for i in range(1, 101)]
    assert percentile(ms[:10], 50) == 5.0 and percentile(ms, 99) == 99.0 and percentile(ms, 50) == 50.0
    assert percentile(ms[:10], 99) == 10.0 and percentile(ms[:10], 0) == 1.0 and percentile(ms[:1], 50) == 1.0
    assert percentile([], 50) is None
