"""task=serve defects a fourth review reproduced: a newcomer out of device memory beside running rows got a 503
though it fits once they finish, stream_options without stream and OpenAI's web_search_options and
reasoning_effort were ignored, and a prompt that fills the context alone was blamed on max_tokens."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import test_serve_fixes
import test_serve_review
import torch
from test_serve import MODEL, client
from test_serve_review import complete, held_until, text_of, wait_until

lm = test_serve_fixes.lm  # the served tiny Llama fixture (random init, byte tokenizer, a key), one per module
hooks = test_serve_review.hooks
WIDE = "y" * 60  # a prompt whose prefill fits alone but not beside a running row (see out_of_memory_beside_others)


def out_of_memory_beside_others(model: torch.nn.Module, width: int) -> torch.utils.hooks.RemovableHandle:
    """The last decoder layer raises torch's out-of-memory error on a step at least `width` positions wide that
    holds more than one row (the running rows are padded to the newcomer's width): one alone fits."""

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[0] > 1 and hidden.shape[1] >= width:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    return model.model.layers[-1].register_forward_pre_hook(hook, with_kwargs=True)


def test_a_newcomer_out_of_memory_beside_a_running_row_waits_and_is_served_once_it_finishes(lm, hooks, caplog):
    """A prompt that ran out of device memory joining a decoding row got a 503 at once, though alone it fits.
    It waits at the queue's front now (as vLLM and TGI requeue it) and gets, once the row finished, the text it
    gets alone; the running row goes on with its own."""
    scheduler = lm.app.state.scheduler
    with client(lm) as http:
        running_alone, wide_alone = text_of(complete(http, "hello", 30)), text_of(complete(http, WIDE, 8))
        released, holding = threading.Event(), threading.Event()
        hooks += [out_of_memory_beside_others(scheduler.lm.model, len(WIDE)), held_until(scheduler, released, holding)]
        wait_until(lambda: not scheduler.active, "the last answer's row to leave")
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(complete, http, "hello", 30)
            wait_until(holding.is_set, "the first request to decode and be held")
            newcomer = pool.submit(complete, http, WIDE, 8)
            wait_until(lambda: len(scheduler.waiting) == 1, "the newcomer to wait")
            released.set()
            assert text_of(running.result()) == running_alone
            assert text_of(newcomer.result()) == wide_alone
    assert "out of device memory admitting a request beside 1: it waits" in caplog.text  # it did not fit beside


def test_stream_options_without_stream_is_a_400_naming_it(lm):
    """stream_options with stream false or absent was answered 200 as if absent; OpenAI refuses it with a 400."""
    asks = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/completions": {"prompt": "hi"},
    }
    with client(lm) as http:
        for path, ask in asks.items():
            for stream in ({}, {"stream": False}, {"stream": None}):
                body = {"model": MODEL, "max_tokens": 2, **ask, **stream, "stream_options": {"include_usage": True}}
                response = http.post(path, json=body)
                assert response.status_code == 400, (path, stream, response.text)
                error = response.json()["error"]
                assert error["param"] == "stream_options" and "stream is true" in error["message"], error
            taken = http.post(path, json={"model": MODEL, "max_tokens": 2, **ask, "stream_options": None})
            assert taken.status_code == 200, taken.text
            body = {"model": MODEL, "max_tokens": 2, **ask, "stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", path, json=body) as streamed:
                assert streamed.status_code == 200 and '"usage"' in streamed.read().decode()


@pytest.mark.parametrize(
    "field, value",
    [("web_search_options", {}), ("web_search_options", {"search_context_size": "low"}), ("reasoning_effort", "high")],
)
def test_web_search_and_reasoning_effort_are_refused_naming_the_field(lm, field, value):
    """OpenAI's web_search_options (even {}: a search with its defaults) and reasoning_effort were answered 200
    as if absent; a server that neither searches nor reasons refuses them as the other fields it lacks."""
    ask = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with client(lm) as http:
        response = http.post("/v1/chat/completions", json={**ask, field: value})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and error["code"] == "unsupported_parameter", error
        assert error["message"].startswith(f"{field}: this server"), error
        taken = http.post("/v1/chat/completions", json={**ask, "web_search_options": None, "reasoning_effort": "none"})
        assert taken.status_code == 200, taken.text


def test_a_prompt_that_fills_the_context_is_named_whatever_max_tokens_asks(lm, monkeypatch):
    """A prompt over the model's context with max_tokens given was blamed on max_tokens (param max_tokens), so a
    client lowering it was refused again; the prompt is named now, and a length past what the prompt leaves is
    told how many tokens it may ask for."""
    from onn.tasks.serve import api

    monkeypatch.setattr(api, "_context", lambda served: 24)
    body = {"model": MODEL, "temperature": 0}
    with client(lm) as http:
        for max_tokens in (1, 10):
            refused = http.post("/v1/completions", json={**body, "prompt": "x" * 30, "max_tokens": max_tokens})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "prompt" and error["code"] == "context_length_exceeded", error
        prompt_tokens = len(api.prompt_ids(lm.app.state.scheduler.lm.tokenizer, "x" * 20, True, False))
        refused = http.post("/v1/completions", json={**body, "prompt": "x" * 20, "max_tokens": 10})
        error = refused.json()["error"]
        assert error["param"] == "max_tokens" and f"ask for at most {24 - prompt_tokens}" in error["message"], error
