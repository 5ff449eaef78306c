"""Defects left from earlier reviews: an image plan's size for data.image_size null, a Swin's pretrained weights at
another size, a checkpoint's data keys checked against the default data config, file systems without locks, and
a node of GPUs of several models sharing one hardware profile."""

from __future__ import annotations

import errno
import fcntl
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import ROOT, execute_run
from PIL import Image
from safetensors.torch import save_file

from onn.config.model import NetworkConfig
from onn.models.vision import build_classifier

TINY_SWIN = "{depths: [1, 1, 1, 1], embed_dim: 24, num_heads: [1, 1, 1, 1]}"


def picture_folder(root: Path, size: int, per_class: int = 6) -> Path:
    """CLASS/IMAGE.png of `size` px, two classes told apart by brightness."""
    rng = np.random.default_rng(0)
    for label, name in enumerate(("dark", "light")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 128, (size, size, 3), dtype=np.uint8) + 127 * label
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def plan_of(tmp_path: Path, name: str, *overrides: str) -> dict:
    execute_run(tmp_path, tmp_path / "cache", "task=plan", "model=v28_cnn", "data=image", *overrides, name=name)
    return yaml.safe_load((tmp_path / name / "plan.yaml").read_text())


def test_a_null_image_size_is_planned_at_the_images_own_size(tmp_path):
    """data.image_size null keeps the images' own size, but the plan sized every image classifier at 32 px: a
    folder of larger pictures was planned (memory, micro-batch, step time) at a fraction of its activations."""
    root = picture_folder(tmp_path / "pictures", 96)
    own = plan_of(tmp_path, "own", f"data.source={root}")
    given = plan_of(tmp_path, "given", f"data.source={root}", "data.image_size=[96,96]")
    assert own["predicted_peak_memory_mb"] == given["predicted_peak_memory_mb"]
    assert own["candidates"] == given["candidates"]
    assert any("96x96 px" in reason and "data.source" in reason for reason in own["reasons"])
    without = plan_of(tmp_path, "without", "data.source=null")  # task=plan for data this machine lacks: said
    assert any("32x32 px assumed" in reason for reason in without["reasons"])


def swin(**model: object) -> NetworkConfig:
    return NetworkConfig(
        name="swin",
        source="timm:swin_tiny_patch4_window7_224",
        kwargs=yaml.safe_load(TINY_SWIN),
        **model,
    )


@pytest.fixture
def swin_weights(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A tiny Swin's ImageNet-shaped weights (224 px, 1000 classes) as safetensors."""
    torch.manual_seed(0)
    imagenet = build_classifier(swin(), 3, 1000, [224, 224])
    path = tmp_path / "swin.safetensors"
    save_file({k: v.contiguous() for k, v in imagenet.state_dict().items()}, str(path))
    return path, imagenet


@pytest.mark.parametrize("size", [[64, 64], [96, 160]])
def test_swin_weights_load_at_another_image_size(swin_weights, size):
    """timm shrinks a Swin's 7x7 attention window to a feature map smaller than it, so its relative position bias
    tables change shape: 224 px weights were refused at 64-112 px ('wrong shapes'). They are resampled as timm's own
    checkpoint filter resamples them."""
    from timm.models.swin_transformer import checkpoint_filter_fn

    path, imagenet = swin_weights
    loaded = build_classifier(swin(weights=str(path)), 3, 10, size)
    state = {k: v for k, v in imagenet.state_dict().items() if not k.startswith("head.")}
    expected = checkpoint_filter_fn(state, loaded)
    for key, table in loaded.state_dict().items():
        if key.endswith("relative_position_bias_table"):
            torch.testing.assert_close(table, expected[key])
    assert loaded.layers[3].blocks[0].attn.relative_position_bias_table.shape != (169, 1)  # a smaller window
    assert loaded(torch.zeros(2, 3, *size)).shape == (2, 10)


def test_swin_fine_tunes_from_224_px_weights_on_small_images(tmp_path, swin_weights):
    root = picture_folder(tmp_path / "pictures", 64, per_class=4)
    metrics = execute_run(
        tmp_path,
        tmp_path / "cache",
        "model=resnet18",
        "model.source=timm:swin_tiny_patch4_window7_224",
        f"+model.kwargs={TINY_SWIN}",
        f"model.weights={swin_weights[0]}",
        "data=image",
        f"data.source={root}",
        "data.batch_size=4",
        "trainer.max_steps=2",
        "optim.warmup_steps=0",
    )
    assert metrics["steps"] == 2 and np.isfinite(metrics["train/loss_final"])


def test_a_checkpoint_s_data_key_is_not_checked_against_the_default_data_config():
    """`ckpt=RUN data.test_source=...` (an image checkpoint, no data=NAME): Hydra checked the key against the default
    data=math before the checkpoint was read, and answered "Key 'test_source' not in 'TextData'"."""
    from onn.config.registry import compose_problem

    conf = ROOT / "conf"
    problem = compose_problem(["task=eval", "ckpt=/runs/cnn", "data.test_source=/data/test"], conf)
    assert problem is not None
    assert problem.startswith("data.test_source=/data/test: with ckpt= and no data=NAME")
    assert "data=math" in problem and "data=NAME data.source=PATH" in problem
    # a key the default data config has, or the data config named: nothing to say
    assert compose_problem(["task=eval", "ckpt=/runs/cnn", "data.source=/data/test"], conf) is None
    assert compose_problem(["task=eval", "ckpt=/runs/cnn", "data=image", "data.test_source=/x"], conf) is None


@pytest.fixture
def no_file_locks(monkeypatch):
    """A file system without locks (NFS mounted nolock): flock fails with ENOLCK, as the kernel says it there."""

    def flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)


def test_a_file_system_without_locks_runs_without_the_lock_and_says_so(tmp_path, no_file_locks, caplog):
    """flock's ENOLCK was a raw OSError traceback from the run folder's Hydra callback (and a layer store build)."""
    from onn.hardware.locks import LOCK_NAME, held
    from onn.tasks.record import hold_folder

    with caplog.at_level(logging.WARNING, logger="onn"):
        hold_folder(tmp_path, "hydra.run.dir")
        with held(tmp_path):  # a layer store build in the same folder
            (tmp_path / "built").write_text("ok")
    assert (tmp_path / "built").read_text() == "ok"
    assert str(tmp_path / LOCK_NAME) in caplog.text and "local disk" in caplog.text
    assert caplog.text.count("cannot be locked") == 1  # said once per lock file


def test_each_gpu_model_of_a_node_has_its_own_profile(monkeypatch):
    """The profile measures the current GPU, but its cache was keyed by the node's GPU names alone: on a node of an
    A100 and a T4, the T4's rank read the A100's profile (80 GB, bf16) and planned with it."""
    from onn.hardware import profile

    names = ["NVIDIA A100-SXM4-80GB", "Tesla T4"]
    current = {"index": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: names[current["index"] if i is None else i])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    first = profile.machine_fingerprint()
    current["index"] = 1
    assert profile.machine_fingerprint() != first
    names[0] = names[1]  # two of one model: one profile, whichever rank measures it
    same = profile.machine_fingerprint()
    current["index"] = 0
    assert profile.machine_fingerprint() == same
