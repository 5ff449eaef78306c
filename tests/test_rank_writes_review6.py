"""A multi-process run's files are written once, by rank 0, and a diffusion plan has the channels its run decodes.

Under trainer.devices=2 Lightning's launcher runs the command again for rank 1, which trained the same weights and
then wrote the classifier's confusion matrix and export, and the denoiser's samples and export, to the same paths
as rank 0, at the same moment (write_atomically's staging folders could collide, and one rank read another's half
file). Which process writes what is observed from outside: a sitecustomize on PYTHONPATH, which every process of
the run (rank 1 too: the launcher passes its environment on) runs at start, records each write under the test's
folder with the writer's LOCAL_RANK (Python's audit events: open for writing, mkdir, rename, replace).

A folder of RGB images of mixed sizes given data.image_size (and data.resize) was planned as 1 channel: the plan's
read of the first image refused the mixed sizes and fell back, while the run decoded 3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, compose, run_cli
from test_diffusion import TINY_UNET, write_images
from test_vision_train import make_images

from onn.errors import UserError
from onn.training.checkpoints import load

# Every write under ONN_TEST_WATCH, one line each (rank, event, path) appended to ONN_TEST_WRITES; the log is opened
# before the hook is installed, and os.write raises no audit event, so the hook never sees itself.
SITECUSTOMIZE = """
import os
import sys

_root, _log = os.environ.get("ONN_TEST_WATCH"), os.environ.get("ONN_TEST_WRITES")
if _root and _log:
    _fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def _written(event, args):
        if event == "open":
            path, mode, flags = args
            if mode is not None:
                if not any(c in mode for c in "wax+"):
                    return
            elif not (isinstance(flags, int) and flags & _WRITING):
                return
        elif event in ("os.rename", "os.replace"):
            path = args[1]
        elif event == "os.mkdir":
            path = args[0]
        else:
            return
        if isinstance(path, int) or path is None:
            return
        path = os.path.abspath(os.fsdecode(os.fspath(path)))
        if path.startswith(_root):
            rank = os.environ.get("LOCAL_RANK", "0")
            os.write(_fd, f"{rank}\\t{event}\\t{path}\\n".encode())

    sys.addaudithook(_written)
"""
TWO_CPU_PROCESSES = ("hardware=cpu_16gb", "trainer.accelerator=cpu", "trainer.devices=2", "tracking=none")


def two_process_run(tmp_path: Path, *overrides: str) -> tuple[Path, list[tuple[str, str, Path]]]:
    """`python run.py OVERRIDES` on two CPU processes (gloo), each in a fresh interpreter that runs the recording
    sitecustomize; the run folder and every (rank, event, path) written under tmp_path."""
    hook, log, run_dir = tmp_path / "hook", tmp_path / "writes.tsv", tmp_path / "outputs" / "run"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p),
        "ONN_TEST_WATCH": str(tmp_path),
        "ONN_TEST_WRITES": str(log),
        "HF_HUB_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
    }
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "WORLD_SIZE"):
        env.pop(name, None)  # the run starts as rank 0 of its own launcher
    args = (*TWO_CPU_PROCESSES, *overrides, "trainer.enable_progress_bar=false", f"paths.cache={tmp_path / 'cache'}")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            *args,
            f"paths.outputs={tmp_path / 'outputs'}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok", metrics
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    return run_dir, [(rank, event, Path(path)) for rank, event, path in lines]


def writers(writes: list[tuple[str, str, Path]], where: Path) -> Counter:
    """How many writes each rank made at `where` or under it."""
    return Counter(rank for rank, _, path in writes if path == where or where in path.parents)


def assert_written_by_rank_zero(writes: list[tuple[str, str, Path]], *artifacts: Path) -> None:
    """Each artifact written (by an open, mkdir or rename the recording saw) and by rank 0 alone."""
    for artifact in artifacts:
        assert set(writers(writes, artifact)) == {"0"}, (artifact, writers(writes, artifact))


def assert_whole_export(folder: Path) -> dict:
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    assert weights and all(t.numel() for t in weights.values())
    return json.loads((folder / "config.json").read_text())


@pytest.mark.slow  # a one-process epoch, then two fresh interpreters resume it, test it and export it: ~2 min
def test_a_two_process_classifier_run_copies_tests_and_exports_once(tmp_path: Path):
    """A two-process run resumed from a finished one-process run: rank 0 copies the earlier run's best.ckpt in (rank 1
    copied it too, at once, and could test a half-copied checkpoint), both ranks test it, and rank 0 alone draws the
    confusion matrix and writes the export."""
    from PIL import Image

    images = make_images(tmp_path / "images", train=8, test=3)
    common = ("model=v28_cnn", "data=image", f"data.source={images}", "data.batch_size=4", "data.val_split=0.25",
              "trainer.max_epochs=1")  # fmt: skip
    first = tmp_path / "first"
    proc = run_cli(
        *common, "hardware=cpu_16gb", "tracking=none", "trainer.enable_progress_bar=false",
        f"paths.cache={tmp_path / 'cache'}", f"paths.outputs={first}", f"hydra.run.dir={first}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (first / "checkpoints" / "best.ckpt").is_dir()

    run_dir, writes = two_process_run(tmp_path, *common, f"ckpt={first}", "export=safetensors")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    best, export, picture = (
        run_dir / "checkpoints" / "best.ckpt", run_dir / "export" / "safetensors", run_dir / "confusion_test.png"
    )  # fmt: skip
    assert metrics["checkpoint_best"] == str(best) and metrics["export/path"] == str(export)
    assert metrics["confusion_matrix"] == str(picture) and metrics["test/acc"] >= 0
    assert load(best)["state_dict"].keys() == load(first / "checkpoints" / "best.ckpt")["state_dict"].keys()
    assert assert_whole_export(export)["modality"] == "image"
    with Image.open(picture) as opened:
        opened.verify()
    assert_written_by_rank_zero(writes, best, picture, export.parent)
    staged = best.with_name("best.ckpt.tmp")  # copied beside, then renamed into place: a kill leaves no half copy
    assert [e for r, e, p in writes if p == best] == ["os.rename"]  # copied in once
    assert set(writers(writes, staged)) == {"0"}
    assert [e for r, e, p in writes if p == picture] == ["open"]  # drawn once
    assert [e for r, e, p in writes if p == export] == ["os.rename"]  # staged once, renamed into place once


@pytest.mark.slow  # two fresh interpreters train a tiny UNet for 2 steps, draw 4 samples and export it: ~70 s
def test_a_two_process_diffusion_run_writes_its_samples_and_export_once(tmp_path: Path):
    from PIL import Image
    from safetensors.torch import load_file

    images = write_images(tmp_path / "images", per_class=8)
    run_dir, writes = two_process_run(
        tmp_path, "data=diffusion", *TINY_UNET, f"data.source={images}", "data.batch_size=4", "data.val_split=0.25",
        "strategy.precision=32-true", "trainer.max_steps=2", "trainer.val_check_interval=2", "optim.warmup_steps=0",
        "task.samples=4", "task.sample_steps=2", "export=safetensors",
    )  # fmt: skip
    export, picture, samples = (
        run_dir / "export" / "safetensors",
        run_dir / "samples.png",
        run_dir / "samples.safetensors",
    )
    assert assert_whole_export(export)["modality"] == "diffusion"
    with Image.open(picture) as opened:
        opened.verify()
    drawn = load_file(str(samples))["images"]
    assert tuple(drawn.shape) == (4, 1, 8, 8)  # (safetensors writes it from Rust: no audit event to record)
    assert_written_by_rank_zero(writes, picture, export.parent)
    assert [e for r, e, p in writes if p == picture] == ["open"]
    assert [e for r, e, p in writes if p == export] == ["os.rename"]


def rgb_images(folder: Path, per_class: int = 4) -> Path:
    """Two classes of colour pictures, 8x8 and 12x10 in turn: sizes mixed within the first 16 images."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, name in enumerate(("red", "blue")):
        (folder / name).mkdir(parents=True)
        for i in range(per_class):
            height, width = (8, 8) if i % 2 == 0 else (12, 10)
            pixels = rng.integers(0, 60, (height, width, 3)).astype(np.uint8)
            pixels[..., 2 * c] += 180
            Image.fromarray(pixels, "RGB").save(folder / name / f"{i}.png")
    return folder


def test_a_mixed_size_folder_is_planned_with_the_channels_its_run_decodes(tmp_path: Path):
    """data.image_size=[8,8] data.resize=resize, channels auto: the RGB folder was planned [1, 8, 8] and trained
    [3, 8, 8]; the plan reads it at data.image_size now, as the data module does. A grey folder of mixed sizes stays
    1 channel, and so does a plan with no data to read."""
    from onn.modalities.diffusion.tasks import datamodule, planned_shape

    for folder, channels in ((rgb_images(tmp_path / "rgb"), 3), (write_images(tmp_path / "grey", 4, odd=12), 1)):
        config = compose(
            "data=diffusion", *TINY_UNET, f"data.source={folder}", "data.image_size=[8,8]", "data.resize=resize",
            f"paths.cache={tmp_path / 'cache'}",
        )  # fmt: skip
        assert list(datamodule(config, "cpu").input_shape) == [channels, 8, 8]
        assert planned_shape(config) == [channels, 8, 8]
    nothing = compose("data=diffusion", *TINY_UNET, "data.source=null", "data.image_size=[8,8]")
    assert planned_shape(nothing) == [1, 8, 8]


def test_clips_another_process_generated_first_are_taken_not_an_error(tmp_path: Path, monkeypatch):
    """Every process of a multi-process run generates builtin:motion's clips into the shared cache (no process group
    exists yet) and renames its copy into place: one whose peer renamed first between its look and its rename
    failed on the folder there. It takes the peer's clips now; a folder there that no run finished is one sentence."""
    from onn.modalities.video import builtin

    data = compose("data=video").data
    monkeypatch.setattr(builtin, "_write_clips", lambda folder, motion: (folder / "train").mkdir(parents=True))
    rename = Path.rename

    def peer_first(self: Path, target):  # the peer's copy lands just before this process's rename
        if ".tmp" in self.name:
            (Path(target) / "train").mkdir(parents=True)
            (Path(target) / ".done").write_text("")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", peer_first)
    folder = builtin.generated("builtin:motion", data, tmp_path)
    assert (folder / ".done").is_file() and not list(folder.parent.glob("*.tmp*"))

    monkeypatch.setattr(Path, "rename", rename)
    (folder / ".done").unlink()  # a folder no run finished (left by hand, or by another tool)
    with pytest.raises(UserError, match=r"^the cache folder .* holds no \.done .*remove it and run again\.$"):
        builtin.generated("builtin:motion", data, tmp_path)


def test_a_process_other_than_rank_zero_draws_and_exports_nothing(tmp_path: Path, monkeypatch):
    """Where torchrun or srun starts the command in every process (task=infer, task=export: no Trainer launches
    them), each drew task.samples into samples.png and wrote the export: rank 1 writes nothing now, and gives the
    samples' figures rank 0 gives."""
    import torch

    from onn.hardware.profile import resolve
    from onn.modalities import classification, get
    from onn.modalities.diffusion import tasks

    config = compose("data=diffusion", *TINY_UNET, "data.image_size=[8,8]", "data.channels=1", "export=safetensors",
                     "task.samples=2", "task.sample_steps=2")  # fmt: skip
    denoiser = tasks.build(config, {"input_shape": [1, 8, 8], "classes": [], "seed": 0})
    image = compose("model=v28_cnn", "data=image", "hardware=cpu_16gb", "data.image_size=[16,16]", "export=onnx")
    plan = get("image").plan(image, resolve(image.hardware, "/tmp", "/tmp"))[0]
    inputs = get("image").planned_inputs(image)
    classifier = classification.build(get("image"), image, plan, {**inputs, "seed": 0, "mean": [0.5], "std": [0.5]})

    monkeypatch.setenv("RANK", "1")
    other = tasks.sample_grid(config, denoiser, tmp_path / "one", torch.device("cpu"))
    assert tasks.export_module(config, denoiser, tmp_path / "one") == {}
    assert classification.export_module(get("image"), image, classifier.eval(), tmp_path / "one") == {}
    assert not (tmp_path / "one").exists()

    monkeypatch.setenv("RANK", "0")
    (tmp_path / "zero").mkdir()
    assert tasks.sample_grid(config, denoiser, tmp_path / "zero", torch.device("cpu")) == {
        **other, "samples/picture": str(tmp_path / "zero" / "samples.png")
    }  # fmt: skip
    assert (tmp_path / "zero" / "samples.png").is_file() and (tmp_path / "zero" / "samples.safetensors").is_file()


def test_a_best_checkpoint_rank_zero_cannot_take_fails_every_rank_not_only_its_own(tmp_path):
    """run_best runs on rank 0 alone (it copies a resumed run's best.ckpt in): when it failed there (a damaged
    earlier checkpoint), rank 0 raised before the broadcast and every other rank waited in it for good. The failure
    now rides the broadcast: rank 0 raises its own error, the others one naming it."""
    from types import SimpleNamespace

    from onn.training.checkpoints import shared_best

    damaged = tmp_path / "earlier" / "checkpoints" / "last.ckpt"
    damaged.mkdir(parents=True)  # a checkpoint folder with nothing readable in it
    sent: list = []

    def broadcast(obj):  # rank 0's side records what it sends; rank 1's receives it
        if not sent:
            sent.append(obj)
        return sent[0]

    callback = SimpleNamespace(best_model_path="", best_model_score=None)
    rank0 = SimpleNamespace(
        is_global_zero=True, checkpoint_callback=callback, strategy=SimpleNamespace(broadcast=broadcast)
    )
    with pytest.raises(Exception) as raised:
        shared_best(rank0, damaged, tmp_path / "run", "val/acc", "max")
    assert sent and sent[0][1] is not None  # its failure was broadcast before it raised
    rank1 = SimpleNamespace(
        is_global_zero=False, checkpoint_callback=callback, strategy=SimpleNamespace(broadcast=broadcast)
    )
    with pytest.raises(Exception, match="rank 0 could not take the run's best checkpoint") as other:
        shared_best(rank1, damaged, tmp_path / "run", "val/acc", "max")
    assert type(other.value).__name__ in {"UserError", "RuntimeError"} and str(raised.value) in str(other.value)
