"""task=serve, round 94: usage left out the end-of-sequence token that ended a completion (OpenAI and vLLM count
every generated token, EOS included), and serve.max_waiting was counted before the requests were queued, so requests
handled at once on several event loops could each count room for themselves and together overfill the queue."""

from __future__ import annotations

import contextlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve import MODEL, client, serve_job
from test_serve_review import held_until, wait_until

LOOPS = 4  # HTTP servers (each its own event loop and thread) in front of the one app and scheduler
MOST = 2  # serve.max_waiting


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A tiny Llama (byte tokenizer, no key) that decodes one request at a time, queues MOST more, and is served by
    LOOPS uvicorn servers at once."""
    from onn.tasks.serve.server import Running
    from onn.tasks.serve.task import build_app

    job = serve_job(
        tmp_path_factory.mktemp("serve"),
        f"model={MODEL}",
        "strategy=full",
        "serve.slots=1",
        f"serve.max_waiting={MOST}",
    )
    app = build_app(job)
    running = [Running(app) for _ in range(LOOPS)]
    yield running
    for server in running:
        server.stop()


def complete(running, prompt: str, max_tokens: int, **extra):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    with client(running, key=None) as http:
        return http.post("/v1/completions", json=body)


def streamed_usage(running, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client(running, key=None) as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    return chunks[-1]["usage"]


def test_the_end_of_sequence_token_counts_in_usage_whole_streamed_and_in_metrics(servers, monkeypatch):
    """Every id is an end-of-sequence id here, so each completion is the one token that ended it: usage said 0
    completion tokens (and metrics.json too) where OpenAI and vLLM say 1."""
    from onn.tasks.serve.task import figures

    app = servers[0].app
    scheduler = app.state.scheduler
    monkeypatch.setattr(scheduler, "eos", set(range(scheduler.lm.model.config.vocab_size)))
    before = figures(app)["serve/completion_tokens"]
    whole = complete(servers[0], "hello", 8)
    assert whole.status_code == 200, whole.text
    choice, usage = whole.json()["choices"][0], whole.json()["usage"]
    assert (choice["finish_reason"], choice["text"]) == ("stop", "")
    assert usage["completion_tokens"] == 1 and usage["total_tokens"] == usage["prompt_tokens"] + 1
    assert streamed_usage(servers[1], "hello", 8) == usage
    assert figures(app)["serve/completion_tokens"] - before == 2


def test_requests_on_several_event_loops_never_overfill_max_waiting(servers, monkeypatch):
    """The one slot is held busy; LOOPS requests arrive at LOOPS servers at once. Each request's count of the queue
    is held until all have counted (the widest window a thread switch could open between counting and queueing):
    counted apart from the queueing, all LOOPS were queued past serve.max_waiting. Counted and queued as one step,
    MOST are queued and the others get a 429."""
    scheduler = servers[0].app.state.scheduler
    counted = threading.Barrier(LOOPS)
    count = scheduler.queued

    def count_together() -> int:
        waiting = count()
        with contextlib.suppress(threading.BrokenBarrierError):
            counted.wait(timeout=10)
        return waiting

    released, holding = threading.Event(), threading.Event()
    handle = held_until(scheduler, released, holding)
    with ThreadPoolExecutor(LOOPS + 1) as pool:
        try:  # released before the pool waits for its requests, however the test ends
            busy = pool.submit(complete, servers[0], "hello", 30)
            wait_until(holding.is_set, "the first request to decode and be held")
            monkeypatch.setattr(scheduler, "queued", count_together)
            answers = [pool.submit(complete, server, "ab", 4) for server in servers]
            # the scheduler is held: only a refused request has its answer yet
            wait_until(lambda: len(scheduler.waiting) + sum(a.done() for a in answers) == LOOPS, "every admission")
            assert len(scheduler.waiting) == MOST and not counted.broken
        finally:
            released.set()
            handle.remove()
        statuses = sorted(answer.result().status_code for answer in answers)
    assert statuses == [200] * MOST + [429] * (LOOPS - MOST)
    assert busy.result().status_code == 200
