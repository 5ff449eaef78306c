"""A diverged checkpoint (a weight that holds NaN or inf) is refused in one sentence naming it and the weight wherever
ONN loads one to use it: task=infer, eval and export of a classifier, a denoiser, a dual encoder and a language
model, as task=serve refused it at startup. Before, a classifier wrote NaN probabilities, a denoiser NaN samples and
an export full of NaN, a dual encoder said so only once its embeddings came out NaN, a language model generated from
NaN scores. Each modality's run trains once per module; the copy given one NaN weight is written through ONN's own
safetensors checkpoint IO."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import MODALITY_HARDWARE, execute_run

from onn.errors import UserError
from onn.training.checkpoints import check_finite, load, save


def poisoned(run_dir: Path, target: Path, pick) -> tuple[Path, str]:
    """A copy of the run's last.ckpt at target/last.ckpt with one element of the first state_dict weight `pick`
    accepts set to NaN: (the copy, that weight's name). The run's own checkpoint is left as it was."""
    checkpoint = load(run_dir / "checkpoints" / "last.ckpt")
    name = next(k for k, v in checkpoint["state_dict"].items() if pick(k) and v.is_floating_point() and v.numel())
    checkpoint["state_dict"][name].view(-1)[0] = float("nan")
    target.mkdir(parents=True)
    save(checkpoint, target / "last.ckpt")
    return target / "last.ckpt", name


def refused(call, ckpt: Path, weight: str, task: str) -> None:
    with pytest.raises(UserError) as said:
        call()
    assert str(said.value).startswith(
        f"ckpt {ckpt} cannot be used for task={task}: its weight {weight} holds NaN or inf"
    ), said.value
    assert "lower optim.lr" in str(said.value)


def test_the_shared_check_reads_what_is_resident_and_says_the_task():
    """The check serve had, shared: a weight's NaN named for the task that uses it; task=serve keeps its wording;
    a placeholder (a streamed block's empty or meta weight) and integer codes are nothing to read."""
    network = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    network.register_parameter("placeholder", torch.nn.Parameter(torch.empty(0)))
    network.register_parameter("on_meta", torch.nn.Parameter(torch.empty(4, device="meta")))
    network.register_parameter("codes", torch.nn.Parameter(torch.zeros(4, dtype=torch.uint8), requires_grad=False))
    check_finite(network, "ckpt a.ckpt", "infer")  # finite: nothing said
    with torch.no_grad():
        network[1].bias[1] = float("inf")
    with pytest.raises(UserError, match=r"^ckpt a.ckpt cannot be used for task=export: its weight 1.bias holds NaN"):
        check_finite(network, "ckpt a.ckpt", "export")
    with pytest.raises(UserError, match=r"^model.source m cannot be served: its weight 1.bias .*every answer would"):
        check_finite(network, "model.source m", "serve")
    normed = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    normed.register_buffer("mask", torch.full((2, 2), float("-inf")))  # a mask's -inf is no divergence
    check_finite(normed, "ckpt b.ckpt", "infer")
    normed[1].running_var[0] = float("nan")  # a diverged norm's statistics predict NaN however finite its weights
    with pytest.raises(UserError, match=r"^ckpt b.ckpt cannot be used for task=infer: its weight 1.running_var"):
        check_finite(normed, "ckpt b.ckpt", "infer")


# -- a classifier (v28 on generated images) -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> tuple[Path, Path, Path, str]:
    """A v28 classifier trained one epoch: (its run folder, its images, a copy of last.ckpt with a NaN weight, the
    weight's name)."""
    from test_vision_train import make_images
    from test_vision_train import run as run_vision

    tmp = tmp_path_factory.mktemp("classifier")
    images = make_images(tmp / "images", train=8, test=2)
    _, run_dir = run_vision(tmp, MODALITY_HARDWARE, f"data.source={images}", "trainer.max_epochs=1", name="train")
    ckpt, weight = poisoned(run_dir, tmp / "diverged", lambda k: k.endswith(".weight"))
    return run_dir, images, ckpt, weight


def test_a_diverged_classifier_is_refused_by_infer_eval_export_and_serve(classifier, tmp_path):
    from test_serve import serve_job
    from test_vision_train import run as run_vision

    from onn.tasks.serve.task import build_app

    run_dir, images, ckpt, weight = classifier
    infer = (MODALITY_HARDWARE, "task=infer", f"task.input={images / 'test'}")
    refused(lambda: run_vision(tmp_path, *infer, f"ckpt={ckpt}", name="infer"), ckpt, weight, "infer")
    assert not (tmp_path / "infer" / "predictions.jsonl").exists()  # before: NaN probabilities, status ok
    evaluate = (MODALITY_HARDWARE, "task=eval", f"ckpt={ckpt}")
    refused(lambda: run_vision(tmp_path, *evaluate, name="eval"), ckpt, weight, "eval")
    export = (MODALITY_HARDWARE, "task=export", "export=safetensors", f"ckpt={ckpt}")
    refused(lambda: run_vision(tmp_path, *export, name="export"), ckpt, weight, "export")
    assert not (tmp_path / "export" / "export").exists()  # before: an export of NaN weights
    job = serve_job(tmp_path, "model=v28_cnn", "data=image", f"data.source={images}", ckpt=ckpt)
    with pytest.raises(UserError, match=rf"^ckpt {ckpt} cannot be served: its weight {weight} holds NaN"):
        build_app(job)  # checked once, by serve's startup, in serve's words
    metrics, _ = run_vision(tmp_path, *infer, f"ckpt={run_dir}", name="fine")
    assert metrics["infer/items"] == 6  # the untouched checkpoint still predicts


# -- a denoiser (a tiny UNet) ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def denoiser(tmp_path_factory) -> tuple[Path, Path, str]:
    """A tiny UNet trained a few steps: (its run folder, a copy of last.ckpt whose moving average, the weights
    samples are drawn from, holds a NaN, that weight's name)."""
    from test_diffusion import TINY_UNET, write_images
    from test_diffusion import run as run_diffusion

    tmp = tmp_path_factory.mktemp("denoiser")
    images = write_images(tmp / "images", per_class=4)
    _, run_dir = run_diffusion(tmp, *TINY_UNET, f"data.source={images}", "trainer.max_steps=2", name="train")
    ckpt, weight = poisoned(run_dir, tmp / "diverged", lambda k: k.startswith("ema.") and k.endswith(".weight"))
    return run_dir, ckpt, weight


def test_a_diverged_denoiser_draws_no_nan_samples(denoiser, tmp_path):
    from test_diffusion import TINY_UNET
    from test_diffusion import run as run_diffusion

    run_dir, ckpt, weight = denoiser
    common = (*TINY_UNET, "task=infer", "task.samples=2")
    refused(lambda: run_diffusion(tmp_path, *common, f"ckpt={ckpt}", name="infer"), ckpt, weight, "infer")
    assert not (tmp_path / "infer" / "samples.png").exists()  # before: a grid of NaN images, status ok
    export = (*TINY_UNET, "task=export", "export=safetensors", f"ckpt={ckpt}")
    refused(lambda: run_diffusion(tmp_path, *export, name="export"), ckpt, weight, "export")
    metrics, _ = run_diffusion(tmp_path, *common, f"ckpt={run_dir}", name="fine")
    assert metrics["samples/count"] == 2 and Path(metrics["samples/picture"]).is_file()


# -- a dual encoder (image + text) ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dual_encoder(tmp_path_factory) -> tuple[Path, Path, Path, str]:
    """A dual encoder trained one epoch on 12 shapes: (its run folder, the shapes, a copy of last.ckpt with a NaN
    weight, its name)."""
    from test_pairs_review6 import SMALL
    from test_pairs_review6 import run as run_pairs

    from onn.modalities.pairs.demo import write_shapes

    tmp = tmp_path_factory.mktemp("pairs")
    shapes = write_shapes(tmp / "shapes", 12, seed=0, size=16)
    _, run_dir = run_pairs(tmp, f"data.source={shapes}", "data.batch_size=4", *SMALL, name="train")
    ckpt, weight = poisoned(run_dir, tmp / "diverged", lambda k: k.startswith("projections."))
    return run_dir, shapes, ckpt, weight


def test_a_diverged_dual_encoder_is_refused_before_anything_is_embedded(dual_encoder, tmp_path):
    """It was refused only once its embeddings came out NaN, in words that named no weight."""
    from test_pairs_review6 import run as run_pairs

    run_dir, shapes, ckpt, weight = dual_encoder
    query = (f"task.gallery={shapes}", "prompt=a red square")
    refused(lambda: run_pairs(tmp_path, "task=infer", f"ckpt={ckpt}", *query, name="infer"), ckpt, weight, "infer")
    out, _ = run_pairs(tmp_path, "task=infer", f"ckpt={run_dir}", *query, name="fine")
    assert out["infer/gallery"] == 12 and Path(out["infer/output"]).is_file()


# -- a language model (llama_tiny) ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def language_model(tmp_path_factory) -> tuple[Path, Path, tuple[str, ...], Path, str]:
    """llama_tiny trained one step on a few lines: (the tmp folder, its hardware cache, the run's overrides, a copy
    of last.ckpt with a NaN weight, its name)."""
    tmp = tmp_path_factory.mktemp("text")
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(f"Once upon a time there were {i} bears.\n" for i in range(20)))
    common = ("data=text", f"data.source={corpus}")
    execute_run(tmp, tmp / "cache", *common, "trainer.max_steps=1", "task.validate_before=false",
                "task.exact_match_samples=0", name="train")  # fmt: skip
    ckpt, weight = poisoned(tmp / "train", tmp / "diverged", lambda k: k.endswith(".weight"))
    return tmp, tmp / "cache", common, ckpt, weight


def test_a_diverged_language_model_generates_nothing(language_model, tmp_path):
    tmp, cache, common, ckpt, weight = language_model
    infer = (*common, "task=infer", "prompt=Once upon", "task.max_new_tokens=2")
    refused(lambda: execute_run(tmp_path, cache, *infer, f"ckpt={ckpt}", name="infer"), ckpt, weight, "infer")
    refused(lambda: execute_run(tmp_path, cache, *common, "task=eval", f"ckpt={ckpt}", name="eval"), ckpt, weight,
            "eval")  # fmt: skip
    out = execute_run(tmp_path, cache, *infer, f"ckpt={tmp / 'train'}", name="fine")
    assert out["infer/model_input"] == "Once upon" and isinstance(out["infer/completion"], str)
