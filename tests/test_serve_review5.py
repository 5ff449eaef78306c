"""task=serve defects a fifth review reproduced: requests whose clients had left still held their places in the
queue (a 429 for the next client, /health counted them), a step that raised killed the scheduler's thread (every
client then waited forever), and after one step out of device memory every newcomer joined one a step for as long as
any waited (under steady load, for good)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import test_serve_fixes
import test_serve_review
import torch
from test_serve import MODEL, client, serve_job, start
from test_serve_review import complete, held_until, text_of, wait_until
from test_serve_review4 import WIDE, out_of_memory_beside_others

lm = test_serve_fixes.lm  # the served tiny Llama fixture (random init, byte tokenizer, a key), one per module
hooks = test_serve_review.hooks
LATER = "abcdefghijklmnopqrstuvwxyz"  # a prompt whose prefill no other step of the test is as wide as


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    """A tiny Llama that decodes one request at a time and queues two more at most (no key)."""
    job = serve_job(
        tmp_path_factory.mktemp("serve"),
        f"model={MODEL}",
        "strategy=full",
        "serve.slots=1",
        "serve.max_waiting=2",
    )
    with start(job) as running:
        yield running


def leave_once_queued(running) -> None:
    """A streamed chat whose client goes away once the role chunk came (its request was queued by then)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    with client(running, key=None) as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())


def test_a_client_that_left_the_queue_holds_no_place_in_it(one_slot):
    """Behind a full batch, requests whose clients had gone away stayed queued: the next client got a 429 "too
    many requests are waiting" though none was, and /health reported them waiting. Now they are dropped: /health
    says 0 and the next request is queued and served."""
    scheduler = one_slot.app.state.scheduler
    released, holding = threading.Event(), threading.Event()
    with client(one_slot, key=None) as http:
        alone = text_of(complete(http, "ab", 8))
        handle = held_until(scheduler, released, holding)
        with ThreadPoolExecutor(2) as pool:
            try:
                running = pool.submit(complete, http, "hello", 30)
                wait_until(holding.is_set, "the first request to decode and be held")
                for _ in range(2):  # serve.max_waiting requests, whose clients leave
                    leave_once_queued(one_slot)
                wait_until(lambda: all(s.cancelled.is_set() for s in list(scheduler.waiting)), "both to leave")
                assert http.get("/health").json()["waiting"] == 0
                queued = pool.submit(complete, http, "ab", 8)
                wait_until(lambda: scheduler.queued() == 1, "the next request to wait")
            finally:
                released.set()
                handle.remove()
            assert text_of(queued.result()) == alone
            assert running.result().status_code == 200


def test_a_step_that_fails_ends_its_requests_with_an_error_and_the_server_goes_on(lm, hooks):
    """A decode step that raised (a CUDA error, a layer store's read) left the scheduler's thread dead: its handler
    put the requests in a dict, and a Sequence was unhashable. Its client waited forever, and so did every later
    one, while /health said ok. Now the request gets a 503 naming the error, and the next is served as before."""
    scheduler = lm.app.state.scheduler
    failed: list[bool] = []

    def fail_once(module, args):
        if not failed:
            failed.append(True)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with client(lm) as http:
        alone = text_of(complete(http, "ab", 8))
        hooks.append(scheduler.lm.model.model.layers[0].register_forward_pre_hook(fail_once))
        body = {"model": MODEL, "prompt": "ab"}
        response = http.post("/v1/completions", json=body, timeout=60)  # (never answered before: it gives up)
        assert response.status_code == 503, response.text
        assert "generation failed: RuntimeError: CUDA error" in response.json()["error"]["message"]
        assert text_of(complete(http, "ab", 8)) == alone


def held_once(scheduler, released: threading.Event, holding: threading.Event) -> torch.utils.hooks.RemovableHandle:
    """The first step while a newcomer waits for fewer rows (scheduler.held) waits for `released`, having set
    `holding`: requests sent meanwhile queue behind the requests a step out of memory sent back."""

    def hook(module, args):
        if scheduler.held is not None and not holding.is_set():
            holding.set()
            released.wait(60)

    return scheduler.lm.model.model.layers[0].register_forward_pre_hook(hook)


def test_requests_after_the_ones_an_out_of_memory_step_sent_back_join_together_again(lm, hooks):
    """Two wide prompts joining beside a running row run out of memory and go back to the queue to join one by one.
    Requests that came after them used to join one a step too, for as long as any request waited (with steady
    traffic, for the server's life: a layer-streamed model then sweeps its layers once per newcomer). Now the three
    join in one step, each with the text it gets alone."""
    scheduler = lm.app.state.scheduler
    widths: list[int] = []  # each step's width, as the first layer sees it
    with client(lm) as http:
        later_alone = text_of(complete(http, LATER, 6))
        released, holding, released_again, holding_again = (threading.Event() for _ in range(4))
        hooks += [
            out_of_memory_beside_others(scheduler.lm.model, len(WIDE)),
            held_until(scheduler, released, holding),
            held_once(scheduler, released_again, holding_again),
            scheduler.lm.model.model.layers[0].register_forward_pre_hook(
                lambda m, args: widths.append(args[0].shape[1])
            ),
        ]
        wait_until(lambda: not scheduler.active, "the last answer's row to leave")
        with ThreadPoolExecutor(6) as pool:
            running = pool.submit(complete, http, "hello", 30)
            wait_until(holding.is_set, "the first request to decode and be held")
            wide = [pool.submit(complete, http, WIDE, 8) for _ in range(2)]
            wait_until(lambda: len(scheduler.waiting) == 2, "both wide prompts to wait")
            released.set()  # they join beside the running row: out of memory, then the first waits for fewer rows
            wait_until(holding_again.is_set, "a wide prompt to wait for fewer rows")
            later = [pool.submit(complete, http, LATER, 6) for _ in range(3)]
            wait_until(lambda: len(scheduler.waiting) == 5, "three later requests to queue behind them")
            released_again.set()
            assert all(text_of(f.result()) == later_alone for f in later)
            assert running.result().status_code == 200 and all(f.result().status_code == 200 for f in wide)
    later_width, wide_width = (len(scheduler.lm.tokenizer(text)["input_ids"]) for text in (LATER, WIDE))
    assert later_width not in (1, wide_width)
    assert widths.count(later_width) == 1  # one prefill step for the three (one each before)


def test_a_classifier_whose_weights_diverged_answers_in_one_sentence(tmp_path):
    """A checkpoint of a run that diverged (NaN weights) gives NaN probabilities, and JSON has no NaN: /v1/classify
    answered a 500 "internal error: Out of range float values are not JSON compliant". It says what happened."""
    from test_vision_train import make_images, run

    threads = torch.get_num_threads()
    images = make_images(tmp_path / "images", train=4, test=1)
    _, run_dir = run(tmp_path, f"data.source={images}", "trainer.max_epochs=2", "optim.lr=1e6", "hardware=cpu_16gb")
    torch.set_num_threads(threads)
    job = serve_job(tmp_path, "model=v28_cnn", "data=image", f"data.source={images}", ckpt=run_dir)
    with start(job) as running, client(running, key=None) as http:
        picture = images / "test" / "class1" / "000.png"
        response = http.post("/v1/classify", files={"file": ("x.png", picture.read_bytes(), "image/png")})
        assert response.status_code == 500 and response.json()["error"]["code"] == "model_diverged", response.text
        assert "weights diverged in training" in response.json()["error"]["message"]
