"""task=serve defects a sixth review reproduced: a stop string holding U+FFFD matched the first byte of every accented
letter, a greedy row whose scores were NaN decoded token 0 silently, an engine reset that failed after a failed step
killed the scheduler (every later request hung) or replaced the step's own error, a checkpoint with NaN weights was
served, a loop that died left its requests waiting, and a route's 500 was not counted."""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import test_serve_fixes
import torch
from conftest import tiny_llama
from test_serve import MODEL, client, serve_job
from test_serve_review import complete, in_flight, text_of, wait_until

from onn.errors import UserError

lm = test_serve_fixes.lm  # the served tiny Llama fixture (random init, byte tokenizer, a key), one per module
EOS = 257  # the byte tokenizer's: ids 0-255 are the bytes themselves


# -- stop strings and characters still arriving ----------------------------------------------------------------
def detokenizer():
    """A Scheduler's text handling alone (no model, no thread), over the byte tokenizer: token id == byte."""
    from onn.models.tokenizer import byte_tokenizer
    from onn.tasks.serve.batching import Scheduler, special_ids

    tokenizer = byte_tokenizer()
    scheduler = object.__new__(Scheduler)
    scheduler.tokenizer, scheduler.special = tokenizer, special_ids(tokenizer)
    scheduler.eos, scheduler.generated = {EOS}, 0
    return scheduler


def completion(stop: list[str], data: bytes, end: bool) -> tuple[str, str]:
    """The text a client receives for a completion of these bytes, and its finish reason: `end`, the model's end of
    text follows them; else max_tokens is their number."""
    from onn.tasks.serve.batching import Sampling, Sequence

    scheduler, events = detokenizer(), []
    seq = Sequence([1], Sampling(len(data) + end, stop=stop), emit=events.append)
    for token in [*data, EOS] if end else data:
        if scheduler._advance(seq, token):
            break
    assert "finish" in events[-1] and all("finish" not in e for e in events[:-1]), events
    return "".join(e.get("text", "") for e in events), events[-1]["finish"]


@pytest.mark.parametrize("end", [True, False])
def test_a_stop_string_never_matches_a_character_still_arriving_yet_a_real_replacement_character_stops(end):
    """A character of several bytes decodes to U+FFFD until its last byte comes, and the stop strings were matched
    against that: stop="\\ufffd" ended "café 東京" at "caf". Now they are matched against whole characters only; a
    real U+FFFD (an invalid byte, or U+FFFD's own bytes) still stops, also as the last token before the end."""
    text = "café 東京 ok"
    assert completion(["\ufffd"], text.encode(), end) == (text, "stop" if end else "length")
    assert completion(["x\ufffd"], "x東".encode(), end) == ("x東", "stop" if end else "length")
    assert completion(["\ufffd"], b"ab\x80cd", end) == ("ab", "stop")  # a lone continuation byte
    assert completion(["\ufffd"], b"ab\xe6\x9dcd", end) == ("ab", "stop")  # a character cut short
    assert completion(["b\ufffd"], b"ab" + "\ufffd".encode() + b"c", end) == ("a", "stop")
    assert completion(["\ufffd"], b"ab" + "\ufffd".encode(), end) == ("ab", "stop")  # the completion's last character
    assert completion(["\ufffd"], b"ab\xe6\x9d", end) == ("ab", "stop")  # it ends mid-character: U+FFFD is final
    assert completion(["東"], "a東b".encode(), end) == ("a", "stop")


# -- NaN scores ---------------------------------------------------------------------------------------------------
def test_a_row_whose_scores_are_not_finite_ends_with_model_diverged_greedy_or_sampled():
    """argmax of a NaN row is token 0: a greedy row of a diverged checkpoint decoded NUL bytes silently. Every row
    whose scores hold NaN or +inf (or nothing above -inf) now ends with model_diverged; the others get their token."""
    from types import SimpleNamespace

    from onn.tasks.serve.batching import Sampling, _pick

    logits = torch.randn(6, 20, generator=torch.Generator().manual_seed(0))
    logits[1] = float("nan")  # greedy, all NaN
    logits[2, 7] = float("nan")  # greedy, one NaN
    logits[3, 5] = float("inf")  # greedy, an overflow
    logits[4, :10] = float("-inf")  # greedy: tokens ruled out, the others finite
    logits[5, 3] = float("nan")  # sampled
    events: list[list[dict]] = [[] for _ in range(6)]
    rows = [
        SimpleNamespace(sampling=Sampling(4, temperature=1.0 if i == 5 else 0.0), generator=None, emit=events[i].append)
        for i in range(6)
    ]
    tokens = _pick(logits, rows)
    assert tokens == [int(logits[0].argmax()), None, None, None, int(logits[4].argmax()), None]
    assert [[e.get("code") for e in row] for row in events] == [[], *[["model_diverged"]] * 3, [], ["model_diverged"]]


def test_a_greedy_request_whose_scores_are_nan_gets_a_500_model_diverged_and_its_batch_goes_on(lm, monkeypatch):
    """Served, the diverged greedy row answered 200 with a text of NUL bytes. It gets the 500 /v1/classify gives a
    diverged classifier now (a stream its error event), and the row decoding beside it gets the text it gets alone."""
    scheduler = lm.app.state.scheduler
    with client(lm) as http:
        alone = text_of(complete(http, "hello", 12))
        step, both_in = scheduler.lm.step, threading.Event()

        def poisoned_step(*args):  # the decode thread waits for both requests; the seed-13 row's scores are NaN
            both_in.wait(60)
            logits = step(*args)
            for i, seq in enumerate(scheduler.active):
                if seq.sampling.seed == 13:
                    logits[i] = float("nan")
            return logits

        monkeypatch.setattr(scheduler.lm, "step", poisoned_step)
        wait_until(lambda: not scheduler.active, "the last answer's row to leave")
        body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "temperature": 0, "seed": 13}
        with ThreadPoolExecutor(2) as pool:
            other = pool.submit(complete, http, "hello", 12)
            wait_until(lambda: in_flight(scheduler) >= 1, "the first request")
            diverged = pool.submit(http.post, "/v1/completions", json=body)
            wait_until(lambda: in_flight(scheduler) >= 2, "the second request")
            both_in.set()
            error = diverged.result().json()["error"]
            assert diverged.result().status_code == 500 and error["code"] == "model_diverged", error
            assert "not finite numbers" in error["message"]
            assert text_of(other.result()) == alone
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
            lines = [line for line in streamed.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and '"code":"model_diverged"' in lines[-2], lines


# -- an engine that cannot be reset -------------------------------------------------------------------------------
class FailingEngine:
    """A layer-streaming engine whose first step raises `error` and whose reset raises its first `failing` times, as
    after a CUDA error; its other steps are the resident model's."""

    def __init__(self, served, error: Exception, failing: int):
        self.resident = dataclasses.replace(served, engine=None)
        self.device = served.device
        self.error, self.failing, self.resets = error, failing, 0

    def decode_step(self, input_ids, attention_mask, position_ids, cache, last=False):
        error, self.error = self.error, None
        if error is not None:
            raise error
        return self.resident.step(input_ids, attention_mask, position_ids, cache)

    def reset(self) -> None:
        self.resets += 1
        if self.resets <= self.failing:
            raise RuntimeError("CUDA error: the device could not be reset")

    def close(self) -> None:
        pass


def failing_engine(lm, monkeypatch, error: Exception, failing: int) -> FailingEngine:
    scheduler = lm.app.state.scheduler
    engine = FailingEngine(scheduler.lm, error, failing)
    monkeypatch.setattr(scheduler.lm, "engine", engine)
    monkeypatch.setattr(scheduler, "broken", None, raising=False)  # put back as it was: the next test has it well
    return engine


def post(http, prompt: str):
    """A greedy completion, given up after 30 s (the old scheduler's thread died, and the request waited for good)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return http.post("/v1/completions", json=body, timeout=30)


ILLEGAL = "CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize(
    "error, code, said",
    [
        (RuntimeError(ILLEGAL), "generation_failed", ILLEGAL),
        (torch.OutOfMemoryError("CUDA out of memory"), "out_of_memory", "ran out of device memory"),
    ],
)
def test_a_reset_that_fails_after_a_failed_step_keeps_its_error_and_the_next_request_is_served(
    lm, monkeypatch, error, code, said
):
    """engine.reset() raising in the failed step's handler killed the scheduler's thread: every later request
    waited for good. After a step out of memory it replaced the step's error: the client read the reset's. The request
    gets its step's error now, the reset is tried again before the next step, and the next request is served."""
    with client(lm) as http:
        alone = text_of(post(http, "ab"))
        engine = failing_engine(lm, monkeypatch, error, failing=1)
        failed = post(http, "ab")
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"]["code"] == code and said in failed.json()["error"]["message"], failed.text
        assert text_of(post(http, "ab")) == alone
        assert engine.resets == 2


def test_an_engine_that_cannot_be_reset_refuses_requests_with_a_503_and_health_says_so(lm, monkeypatch):
    """With a reset that keeps failing, later requests hung (the thread was dead) while /health said ok. Each is
    refused at once now, naming the reset's error, and /health answers 503 until a reset succeeds."""
    scheduler = lm.app.state.scheduler
    with client(lm) as http:
        failing_engine(lm, monkeypatch, RuntimeError(ILLEGAL), failing=10**6)
        first = post(http, "ab")
        assert first.status_code == 503 and ILLEGAL in first.json()["error"]["message"], first.text
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable", health.text
        later = post(http, "ab")
        assert later.status_code == 503, later.text
        error = later.json()["error"]
        assert error["code"] == "model_unavailable" and "could not be reset" in error["message"], error
        assert "restart the server" in error["message"] and "the device could not be reset" in error["message"]
        monkeypatch.setattr(scheduler.lm, "engine", None)  # the device is back: the next request resets and is served
        assert post(http, "ab").status_code == 200
        assert http.get("/health").status_code == 200


def test_an_idle_server_retries_a_failed_reset_without_a_request(lm, monkeypatch):
    """/health's 503 keeps a load balancer's requests away, and the reset was retried only before a request's step:
    an idle server stayed unavailable for good. It retries every RESET_RETRY_S by itself."""
    from onn.tasks.serve import batching

    monkeypatch.setattr(batching, "RESET_RETRY_S", 0.05)
    scheduler = lm.app.state.scheduler
    with client(lm) as http:
        failing_engine(lm, monkeypatch, RuntimeError(ILLEGAL), failing=10**6)
        assert post(http, "ab").status_code == 503
        assert http.get("/health").status_code == 503
        monkeypatch.setattr(scheduler.lm, "engine", None)  # the device is back, and no request comes
        wait_until(lambda: http.get("/health").status_code == 200, "an idle server to try the reset again")


def test_a_decode_loop_that_dies_tells_its_requests_and_refuses_later_ones(lm):
    """A loop that raised outside a step (a bug) left every request it held, and every later one, waiting for good.
    Now they end with an error, and a later request is told at once."""
    from onn.tasks.serve.batching import Sampling, Scheduler, Sequence

    scheduler = Scheduler(lm.app.state.scheduler.lm, 1)  # its own loop, on the served model
    events: queue.Queue = queue.Queue()

    def broken_admission():
        raise RuntimeError("a bug in admission")

    scheduler._holding = broken_admission
    try:
        scheduler.submit(Sequence([1, 2], Sampling(4), events.put))
        assert events.get(timeout=30)["finish"] == "error"
        scheduler.thread.join(30)
        scheduler.submit(Sequence([1, 2], Sampling(4), events.put))
        assert events.get(timeout=1)["finish"] == "error"
        assert scheduler.trouble() is not None
    finally:
        scheduler.close()


# -- a checkpoint whose weights are not finite ----------------------------------------------------------------------
def test_a_checkpoint_with_nan_weights_is_refused_at_startup_naming_it(tmp_path):
    """A diverged checkpoint was served, and every request then failed. The server refuses it before it listens,
    in one sentence naming the checkpoint and the weight."""
    from onn.models.tokenizer import byte_tokenizer
    from onn.tasks.serve.task import build_app

    folder = tmp_path / "diverged"
    model = tiny_llama(vocab_size=320, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 4] = float("nan")
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    job = serve_job(
        tmp_path,
        f"model={MODEL}",
        "strategy=full",
        f"model.source={folder}",
        "model.architecture=null",
        "model.tokenizer=null",
    )
    with pytest.raises(UserError) as refused:
        build_app(job)
    said = str(refused.value)
    assert said.startswith(f"model.source {folder} cannot be served") and "model.layers.1.mlp.down_proj.weight" in said


# -- what a route answers ---------------------------------------------------------------------------------------------
def test_an_unexpected_error_in_a_route_counts_as_refused(lm, monkeypatch):
    """A route's bug answers 500 "internal error", and serve/refused did not count it (every other error answered
    counts there)."""
    from onn.tasks.serve import api

    def broken(served):
        raise RuntimeError("a bug")

    monkeypatch.setattr(api, "_context", broken)
    stats = lm.app.state.stats
    before = stats.refused, stats.requests
    with client(lm) as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 2})
    assert response.status_code == 500 and response.json()["error"]["message"] == "internal error: a bug"
    assert (stats.refused, stats.requests) == (before[0] + 1, before[1])


def test_a_content_length_of_other_digits_is_a_400():
    """ "²".isdigit() is true and int("²") raises: the guard failed with a bare 500 on a Content-Length a server
    that does not check it (not uvicorn's) passes on."""
    from onn.tasks.serve.api import Guard, Stats

    sent: list[dict] = []

    async def call():
        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": [(b"content-length", b"\xb2")]}
        await Guard(None, None, 1000, 1000, Stats())(scope, receive, send)

    asyncio.run(call())
    assert sent[0]["status"] == 400 and b"a bad Content-Length" in sent[1]["body"]
