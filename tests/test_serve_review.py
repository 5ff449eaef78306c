"""task=serve and diffusion sampling defects a review reproduced: a request out of device memory ended every
request in its batch, vendor fields that change the answer (vLLM's, llama.cpp's) were ignored, and DDPM drew
each step's noise on the host (a copy to the device per step)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import test_serve_fixes
import torch
from test_serve import MODEL, client

lm = test_serve_fixes.lm  # the served tiny Llama fixture (random init, byte tokenizer, a key), one per module
LONG = "x" * 150  # a prompt whose prefill runs out of device memory (see out_of_memory_on_wide_steps)


def complete(http, prompt: str, max_tokens: int = 20):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return http.post("/v1/completions", json=body)


def text_of(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def in_flight(scheduler) -> int:
    return len(scheduler.active) + len(scheduler.waiting)


def decoding(scheduler) -> bool:
    """Whether a row has decoded two tokens (and waits in held_until's hook)."""
    return any(len(seq.tokens) >= 2 for seq in list(scheduler.active))


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"waited a minute for {what}"
        time.sleep(0.005)


def out_of_memory_on_wide_steps(model: torch.nn.Module, width: int) -> torch.utils.hooks.RemovableHandle:
    """The last decoder layer raises torch's out-of-memory error on a step at least `width` positions wide, as
    CUDA's allocator does: after the layers before it have grown the KV cache."""

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] >= width:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    return model.model.layers[-1].register_forward_pre_hook(hook, with_kwargs=True)


def held_until(scheduler, released: threading.Event, holding: threading.Event) -> torch.utils.hooks.RemovableHandle:
    """A step of a row that has decoded two tokens waits for `released`, having set `holding`: requests sent once
    `holding` is set wait in the queue and join the batch together, beside a row that is decoding. (Sent as soon
    as the row had two tokens, before its next step began, a busy machine let the scheduler take them in first.)"""

    def hook(module, args):
        if decoding(scheduler):
            holding.set()
            released.wait(60)

    return scheduler.lm.model.model.layers[0].register_forward_pre_hook(hook)


@pytest.fixture
def hooks(lm) -> Iterator[list]:
    handles: list = []
    yield handles
    for handle in handles:
        handle.remove()


def test_a_prompt_out_of_device_memory_ends_alone_and_the_batch_goes_on(lm, hooks, caplog):
    """A prompt whose prefill ran out of device memory ended every request in the batch with a 503. Now it alone
    gets a 503 (code out_of_memory), a request that joined with it joins again and a running one goes on: both
    give the text each gives alone."""
    scheduler = lm.app.state.scheduler
    with client(lm) as http:
        running_alone, joined_alone = text_of(complete(http, "hello", 30)), text_of(complete(http, "ab", 8))
        released, holding = threading.Event(), threading.Event()
        hooks += [out_of_memory_on_wide_steps(scheduler.lm.model, len(LONG)), held_until(scheduler, released, holding)]
        wait_until(lambda: not scheduler.active, "the last answer's row to leave")
        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(complete, http, "hello", 30)
            wait_until(holding.is_set, "the first request to decode and be held")
            too_long = pool.submit(complete, http, LONG, 4)
            joined = pool.submit(complete, http, "ab", 8)
            wait_until(lambda: len(scheduler.waiting) == 2, "both newcomers to wait")
            released.set()
            assert text_of(running.result()) == running_alone
            assert text_of(joined.result()) == joined_alone
            refused = too_long.result()
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == "out_of_memory" and "ran out of device memory" in error["message"], error
        assert "2 requests: they join one by one" in caplog.text  # the newcomers joined together, then one by one
        assert text_of(complete(http, "ab", 8)) == joined_alone  # and the next request is served as before


def test_a_decode_step_out_of_device_memory_ends_only_the_youngest_row(lm, hooks):
    """A decode step (no newcomer) out of device memory: the row admitted last ends with out_of_memory, the
    older one goes on with the text it gives alone (both ended with a 503 before)."""
    scheduler = lm.app.state.scheduler
    with client(lm) as http:
        alone = text_of(complete(http, "hello", 30))
        released, holding, failed = threading.Event(), threading.Event(), []

        def once_both_decode(module, args):  # one decode step of both rows runs out of memory, once
            if released.is_set() and not failed and args[0].shape[:2] == (2, 1):
                failed.append(True)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        hooks += [held_until(scheduler, released, holding)]
        hooks += [scheduler.lm.model.model.layers[-1].register_forward_pre_hook(once_both_decode)]
        wait_until(lambda: not scheduler.active, "the last answer's row to leave")
        with ThreadPoolExecutor(2) as pool:
            older = pool.submit(complete, http, "hello", 30)
            wait_until(holding.is_set, "the first request to decode and be held")
            younger = pool.submit(complete, http, "ab", 8)
            wait_until(lambda: in_flight(scheduler) == 2, "the second request to wait")
            released.set()
            assert text_of(older.result()) == alone
            assert younger.result().status_code == 503 and failed
            assert younger.result().json()["error"]["code"] == "out_of_memory"


def test_other_servers_fields_that_change_the_answer_are_refused_unless_they_ask_for_nothing(lm):
    """vLLM's and llama.cpp's own fields, which OpenAI clients send (extra_body), were answered 200 as if absent:
    a JSON schema, a grammar, llama.cpp's length (n_predict), stop token ids, special tokens kept in the text.
    Each is a 400 naming the field now, while their values that ask for nothing are taken."""
    chat_ask = {"messages": [{"role": "user", "content": "hi"}]}
    refused = {
        "guided_json": {"type": "object"},
        "guided_choice": ["yes", "no"],
        "structured_outputs": {"regex": "[0-9]+"},
        "grammar": 'root ::= "a"',
        "json_schema": {"type": "object"},
        "n_predict": 5,
        "stop_token_ids": [5],
        "bad_words": ["a"],
        "use_beam_search": True,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template": "{{ messages }}",
        "mirostat": 2,
    }
    taken = {"skip_special_tokens": True, "add_generation_prompt": True, "use_beam_search": False, "mirostat": 0,
             "stop_token_ids": [], "guided_json": None, "user": "u-1", "metadata": {"a": "b"}}  # fmt: skip
    with client(lm) as http:
        for field, value in refused.items():
            for path, ask in (("/v1/chat/completions", chat_ask), ("/v1/completions", {"prompt": "hi"})):
                response = http.post(path, json={"model": MODEL, "max_tokens": 2, **ask, field: value})
                assert response.status_code == 400, (field, path, response.text)
                error = response.json()["error"]
                assert error["param"] == field and error["code"] == "unsupported_parameter", error
                assert error["message"].startswith(f"{field}: this server"), error
        response = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, **chat_ask, **taken})
        assert response.status_code == 200, response.text


class Shrink(torch.nn.Module):
    """A denoiser of one weight that uses its timesteps, as a U-Net's embedding does."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.1))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return x * self.scale + t.float().view(-1, 1, 1, 1) / 1000


def ddpm_images(steps: int, seed: int, device: torch.device) -> torch.Tensor:
    """Three 4x4 images drawn by DDPM over `steps` timesteps (one step each)."""
    from diffusers import DDPMScheduler

    from onn.modalities.diffusion.sample import draw

    scheduler = DDPMScheduler(num_train_timesteps=steps)
    scheduler.set_timesteps(steps)
    return draw(Shrink(), scheduler, 3, [1, 4, 4], seed=seed, device=device)


def test_ddpm_images_are_the_seeds_on_this_device():
    """With its step noise drawn on the device, DDPM stays reproducible: the same seed draws the same images, another
    seed other ones (where the noise is drawn is checked on a GPU, by the waits below)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    images = ddpm_images(8, seed=0, device=device)
    assert images.shape == (3, 1, 4, 4) and images.dtype == torch.uint8
    assert torch.equal(images, ddpm_images(8, seed=0, device=device))
    assert not torch.equal(images, ddpm_images(8, seed=1, device=device))


def test_ddim_images_start_from_the_seeds_own_noise():
    """DDPM's step-noise seed is derived from task.seed without drawing from the starting noise's generator: DDIM's
    images are those of the seed's first draw denoised (a draw before it changed every seed's samples)."""
    from diffusers import DDIMScheduler

    from onn.modalities.diffusion.module import to_pixels
    from onn.modalities.diffusion.sample import draw

    scheduler = DDIMScheduler(num_train_timesteps=20)
    scheduler.set_timesteps(5)
    x = torch.randn(3, 1, 4, 4, generator=torch.Generator().manual_seed(7))
    for t in scheduler.timesteps:
        x = scheduler.step(Shrink()(x, t.expand(3)), t, x).prev_sample
    drawn = draw(Shrink(), scheduler, 3, [1, 4, 4], seed=7, device=torch.device("cpu"))
    assert torch.equal(drawn, to_pixels(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_ddpm_waits_for_the_device_as_often_for_2_steps_as_for_8():
    """DDPM drew each step's noise on the CPU (diffusers' randn_tensor with a CPU generator) and copied it to the
    device: a blocking copy, so the host waited for the GPU at every step. The waits are the same for 2 steps and 8."""
    from onn.hardware.waits import DeviceOps

    device, waits = torch.device("cuda"), []
    for steps in (2, 8):
        with DeviceOps(device) as counted:
            ddpm_images(steps, seed=0, device=device)
        waits.append(counted.waits)
    assert waits[0] == waits[1], f"waits for the device for 2 and 8 steps: {waits}"
