"""task=serve and the diffusion judge, as a seventh review found them: one route's bug was logged twice (ONN's line and
uvicorn's "Exception in ASGI application", each with its traceback) and cut a stream off without its error event,
and the judge's refusals of a bad task.classifier said `ckpt` (the denoiser's key)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import test_serve_fixes
import torch
from test_diffusion import TINY_UNET, run, write_images
from test_serve import MODEL, client

from onn.errors import UserError

lm = test_serve_fixes.lm  # the served tiny Llama fixture (random init, byte tokenizer, a key), one per module


# -- one failure, one log record ------------------------------------------------------------------------------------
class Records(logging.Handler):
    """The error records of ONN's logger and uvicorn's (uvicorn's does not reach the root logger caplog reads)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.seen: list[logging.LogRecord] = []
        self.loggers = [logging.getLogger("onn"), logging.getLogger("uvicorn.error")]

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record)

    def __enter__(self) -> Records:
        for logger in self.loggers:
            logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for logger in self.loggers:
            logger.removeHandler(self)


def logged_by_now(http) -> None:
    """Another request answered: uvicorn logs a failure in the event loop's step that wrote its response, so by the
    time a later request is answered, every record of the failed one is in (the client may read the 500 before)."""
    assert http.get("/health").status_code == 200


def test_a_routes_bug_is_one_log_record_and_one_500(lm, monkeypatch):
    """Starlette's ServerErrorMiddleware answered a bug with ONN's handler (which logged it) and raised it again for
    uvicorn, which logged it a second time: two tracebacks for one failed request."""
    from onn.tasks.serve import api

    def broken(served):
        raise RuntimeError("a bug")

    monkeypatch.setattr(api, "_context", broken)
    before = lm.app.state.stats.refused
    with Records() as records, client(lm) as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 2})
        logged_by_now(http)
    assert response.status_code == 500 and response.json()["error"]["message"] == "internal error: a bug"
    assert len(records.seen) == 1 and records.seen[0].exc_info is not None, [r.getMessage() for r in records.seen]
    assert lm.app.state.stats.refused == before + 1


def test_a_bug_mid_stream_ends_it_with_an_error_event_and_done_logged_once(lm, monkeypatch):
    """A stream whose handler failed after its first chunks was cut off (no error event, no [DONE]: the OpenAI client
    raised a bare connection error), logged twice, and counted both answered and refused."""
    from onn.tasks.serve import api

    def broken(finish):
        raise RuntimeError("a bug in usage")

    monkeypatch.setattr(api, "_usage", broken)  # called for the stream's last chunk, after its text
    stats = lm.app.state.stats
    before = stats.requests, stats.refused
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with Records() as records, client(lm) as http, http.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
        logged_by_now(http)
    assert lines[-1] == "data: [DONE]", lines
    assert json.loads(lines[-2][6:])["error"]["message"] == "internal error: a bug in usage"
    assert len(records.seen) == 1, [r.getMessage() for r in records.seen]
    assert (stats.requests, stats.refused) == (before[0], before[1] + 1)


# -- the judge's refusals name task.classifier -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def judge(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A greyscale 8x8 denoiser trained two steps, an image classifier trained three on the same images (the judge),
    and the images."""
    tmp = tmp_path_factory.mktemp("judge")
    images = write_images(tmp / "grey", per_class=6)
    _, denoiser = run(tmp, *TINY_UNET, f"data.source={images}", "trainer.max_steps=2", "task.samples=2")
    classifier = ("model=v28_cnn", "data=image", f"data.source={images}", "data.batch_size=8", "trainer.max_steps=3")
    _, judge_dir = run(tmp, *classifier, name="judge")
    return denoiser, judge_dir, images


def evaluate(tmp: Path, judge: tuple[Path, Path, Path], classifier: str, name: str) -> str:
    """What task=eval of the denoiser says when task.classifier is `classifier`."""
    denoiser, _, images = judge
    given = {"ckpt", "task", "task.classifier", "data", "data.source", "task.samples"}
    with pytest.raises(UserError) as refused:
        run(tmp, *TINY_UNET, f"ckpt={denoiser}", "task=eval", f"task.classifier={classifier}",
            f"data.source={images}", "task.samples=2", name=name, given=given)  # fmt: skip
    return str(refused.value)


@pytest.mark.modalities
def test_every_refusal_of_the_judge_names_task_classifier_not_ckpt(judge, tmp_path):
    """A task.classifier that is no checkpoint was refused as "ckpt=PATH: no ONN checkpoint there": ckpt is the
    denoiser's key, which the user had right. Each refusal now names task.classifier, also in its advice."""
    missing = tmp_path / "no_such_run"
    said = evaluate(tmp_path, judge, str(missing), "missing")
    assert said.startswith(f"task.classifier={missing}: no ONN checkpoint there") and "ckpt=" not in said, said
    pickle = tmp_path / "judge.pt"
    pickle.write_bytes(b"not a checkpoint")
    said = evaluate(tmp_path, judge, str(pickle), "pickle")
    assert said.startswith(f"task.classifier={pickle} is a file") and "ckpt=" not in said, said
    said = evaluate(tmp_path / "empty", judge, "last", "last")  # no checkpoint under this run's outputs
    assert said.startswith("task.classifier=last: no checkpoint under") and "ckpt=" not in said, said
    assert "give task.classifier=PATH" in said, said


@pytest.mark.modalities
def test_a_judge_whose_weights_diverged_is_refused_naming_task_classifier(judge, tmp_path):
    """A classifier checkpoint with NaN weights was refused as "ckpt PATH cannot be used for task=eval ... use a
    checkpoint from before that (ckpt=RUN_DIR/checkpoints/best.ckpt)": the denoiser's key, twice."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, judge_dir, _ = judge
    diverged = tmp_path / "diverged"
    shutil.copytree(judge_dir / "checkpoints", diverged / "checkpoints")
    tensors_file = diverged / "checkpoints" / "last.ckpt" / "model.safetensors"
    tensors = load_file(str(tensors_file))
    name = "/state_dict/model.features.0.0.weight"  # the first convolution's weight
    assert name in tensors, sorted(tensors)[:8]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(tensors_file))
    said = evaluate(tmp_path, judge, str(diverged), "diverged")
    assert said.startswith(f"task.classifier={diverged} cannot be used for task=eval: its weight"), said
    assert "ckpt" not in said.replace(".ckpt", ""), said
    assert "task.classifier=RUN_DIR/checkpoints/best.ckpt" in said, said


def test_a_streamed_model_with_nan_block_weights_is_refused_at_startup_naming_the_weight(tmp_path):
    """Streamed, a model's frozen block weights live in its layer store, and serve's startup check saw only the
    placeholders: NaN in model.source was found when the first request reached that block (a 500 on every
    request). The store refuses the block as it writes it, before the server listens."""
    from conftest import tiny_llama
    from test_serve import serve_job

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
        "strategy=sparse_lora",
        "strategy.layers=[0]",
        f"model.source={folder}",
        "model.architecture=null",
        "model.tokenizer=null",
    )
    assert job.plan.strategy == "sparse_lora"
    with pytest.raises(UserError) as refused:
        build_app(job)
    said = str(refused.value)
    assert "mlp.down_proj.weight" in said and "block 1 " in said and "NaN" in said
