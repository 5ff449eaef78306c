"""Diffusion: a diffusers UNet (and DiT) trained on an image folder through the runner, samples drawn with a seed
(DDIM), judged by an ONN classifier, exported to ONNX and checked in onnxruntime; the LayerMap of both; mixed
image sizes refused in one sentence. Tiny images (8x8) and a few steps: the recipe's figures come from running
recipe=mnist_ddpm (docs/diffusion.md); a run killed -9 and resumed (weights, moving average and optimizer
state bit for bit) is the `diffusion` track of recipe=bench_chaos."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MODALITY_HARDWARE, HostReads, compose

from onn.errors import UserError

TINY_UNET = (
    "model=ddpm_unet",
    "model.ema_decay=0.5",
    "model.kwargs={block_out_channels: [8, 16], layers_per_block: 1, norm_num_groups: 4, add_attention: false,"
    " down_block_types: [DownBlock2D, DownBlock2D], up_block_types: [UpBlock2D, UpBlock2D]}",
)
TINY_DIT = (
    "model=dit_small",
    "model.ema_decay=0.5",
    "model.kwargs={num_layers: 2, num_attention_heads: 2, attention_head_dim: 8, patch_size: 2, norm_num_groups: 4}",
)


def write_images(folder: Path, per_class: int = 12, size: int = 8, odd: int | None = None) -> Path:
    """Two classes of greyscale pictures: a bright top half, a bright left half (a little noise each);
    `odd`: one more picture of that size."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, bright in (("top", np.s_[: size // 2, :]), ("left", np.s_[:, : size // 2])):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 40, (size, size)).astype(np.uint8)
            pixels[bright] += 200
            Image.fromarray(pixels, "L").save(folder / name / f"{i}.png")
    if odd:
        Image.fromarray(np.zeros((odd, odd), np.uint8), "L").save(folder / "top" / "odd.png")
    return folder


def run(tmp: Path, *overrides: str, name: str = "run", given: set[str] | None = None) -> tuple[dict, Path]:
    """`given`: the keys the command line set (app.execute reads a checkpoint's config against them)."""
    from onn.app import execute

    cfg = compose(
        *("data=diffusion", "tracking=none", "trainer.enable_progress_bar=false", "strategy.precision=32-true"),
        *(f"paths.outputs={tmp / 'outputs'}", f"paths.cache={tmp / 'cache'}", MODALITY_HARDWARE),
        *("trainer.max_steps=12", "trainer.val_check_interval=6", "optim.warmup_steps=0", "optim.lr=3e-3"),
        *("data.batch_size=8", "data.val_split=0.25", "task.samples=6", "task.sample_steps=4"),
        *overrides,
    )
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return execute(cfg, run_dir, given), run_dir


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("pictures"))


@pytest.mark.modalities
@pytest.mark.slow
def test_train_sample_judge_and_export_a_unet(images, tmp_path):
    from safetensors.torch import load_file

    metrics, run_dir = run(tmp_path, *TINY_UNET, f"data.source={images}", "export=onnx")
    assert metrics["modality"] == "diffusion" and metrics["steps"] == 12
    assert metrics["train/loss_final"] < metrics["train/loss_initial"]
    assert metrics["export/max_abs_diff"] < 1e-4 and metrics["export/inputs"] == ["sample", "timestep"]
    assert Path(metrics["samples/picture"]).is_file()
    # another optim.name on resume failed with KeyError 'momentum' mid-fit: the optimizer is the checkpoint's
    resumed, _ = run(tmp_path, *TINY_UNET, f"data.source={images}", f"ckpt={run_dir}", "optim.name=sgd",
                     "trainer.max_steps=14", name="resumed")  # fmt: skip
    assert resumed["steps"] == 14

    common = (*TINY_UNET, f"ckpt={run_dir}", "task.samples=5")
    first, a = run(tmp_path, *common, "task=infer", "task.seed=7", name="infer_a")
    _, b = run(tmp_path, *common, "task=infer", "task.seed=7", name="infer_b")
    _, c = run(tmp_path, *common, "task=infer", "task.seed=8", name="infer_c")
    drawn = [load_file(str(d / "samples.safetensors"))["images"] for d in (a, b, c)]
    assert drawn[0].shape == (5, 1, 8, 8) and drawn[0].dtype == torch.uint8
    assert torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], drawn[2])  # the seed decides the images

    classifier, classifier_dir = run(
        tmp_path,
        *("model=v28_cnn", "data=image", f"data.source={images}", "data.batch_size=8", "task.monitor=val/loss"),
        name="classifier",
    )
    judged, _ = run(tmp_path, *common, "task=eval", f"task.classifier={classifier_dir}", name="eval")
    assert judged["samples/count"] == 5 and 0 <= judged["samples/confident_share"] <= 1
    assert sum(judged["samples/class_counts"].values()) == round(5 * judged["samples/confident_share"])
    assert 1 <= judged["samples/inception_score"] <= 2  # two classes at most
    assert judged["real/confident_share"] >= judged["samples/confident_share"] - 1  # both were measured
    assert judged["val/loss"] > 0


def test_mixed_image_sizes_are_one_sentence_unless_resized(tmp_path):
    folder = write_images(tmp_path / "mixed", per_class=4, odd=12)
    with pytest.raises(UserError, match=r"different sizes: .* set data.image_size=\[H,W\] with data.resize=resize"):
        run(tmp_path, *TINY_UNET, f"data.source={folder}", "trainer.max_steps=1")
    metrics, _ = run(
        tmp_path,
        *TINY_UNET,
        f"data.source={folder}",
        "data.image_size=[8,8]",
        "data.resize=resize",
        "trainer.max_steps=2",
    )
    assert metrics["steps"] == 2


def test_the_plan_says_a_unet_cannot_stream_and_finds_the_dit_blocks():
    from onn.hardware.profile import resolve
    from onn.modalities import get

    unet = compose("data=diffusion", *TINY_UNET, "data.image_size=[8,8]", "data.channels=1", "hardware=cpu_16gb")
    plan, spec = get("diffusion").plan(unet, resolve(unet.hardware, "/tmp", "/tmp"))
    assert plan.strategy == "full" and spec.sample_flops > 0
    assert any("skip connections cross its blocks" in r and "down_blocks" in r for r in plan.reasons)
    assert "UpBlock2D at 'network.up_blocks'" in spec.layer_map and "network.down_blocks" in spec.layer_map

    dit = compose("data=diffusion", *TINY_DIT, "data.image_size=[8,8]", "data.channels=1", "hardware=cpu_16gb")
    plan, spec = get("diffusion").plan(dit, resolve(dit.hardware, "/tmp", "/tmp"))
    assert spec.n_blocks == 2 and "BasicTransformerBlock at 'network.transformer_blocks'" in spec.layer_map
    assert not any("skip connections" in r for r in plan.reasons)
    # streamed, its blocks compute their MLPs whole: a fixed mlp_tiles is said not to apply, not dropped unsaid
    streamed = compose(
        "data=diffusion", *TINY_DIT, "data.image_size=[8,8]", "data.channels=1", "hardware=cpu_16gb",
        "strategy=sparse_lora", "strategy.layers=[1]", "strategy.streaming.mlp_tiles=2",
    )  # fmt: skip
    plan, _ = get("diffusion").plan(streamed, resolve(streamed.hardware, "/tmp", "/tmp"))
    assert plan.streaming is not None and plan.streaming.mlp_tiles == 1
    assert any("strategy.streaming.mlp_tiles=2 does not apply" in r for r in plan.reasons)


@pytest.mark.slow  # 12-32 s in ci137's fast suite, which took 646 s
def test_a_dit_trains_a_few_steps(images, tmp_path, capfd, caplog):
    metrics, _ = run(tmp_path, *TINY_DIT, f"data.source={images}", "trainer.max_steps=8", "task.samples=2")
    assert metrics["train/loss_final"] < metrics["train/loss_initial"]
    said = caplog.text + "".join(capfd.readouterr())
    assert "weights_only" not in said  # Lightning's line for a checkpoint saved without saying what it holds


def test_bad_settings_are_one_sentence(images, tmp_path):
    with pytest.raises(UserError, match="task.sampler='euler'"):
        run(tmp_path, *TINY_UNET, f"data.source={images}", "task.sampler=euler")
    with pytest.raises(UserError, match="model.kwargs do not build a unet"):
        run(tmp_path, *TINY_UNET, f"data.source={images}", "++model.kwargs.no_such_argument=1")
    with pytest.raises(UserError, match="strategy=sparse_lora: a unet's skip connections cross its blocks"):
        run(tmp_path, *TINY_UNET, f"data.source={images}", "strategy=sparse_lora")
    with pytest.raises(UserError, match="model.ema_decay=0.5: a streamed denoiser keeps no moving average"):
        run(tmp_path, *TINY_DIT, f"data.source={images}", "strategy=sparse_lora")
    with pytest.raises(UserError, match="needs task.classifier"):
        run(tmp_path, *TINY_UNET, f"data.source={images}", "task=eval")


def test_sampling_and_schedule_mistakes_are_refused_before_training(images, tmp_path):
    """Settings that would fail only when samples are drawn, after the training, fail before it in one sentence."""
    with pytest.raises(UserError, match=r"task.sample_steps=2000: ddim takes between 1 and model.train_timesteps=1000"):
        run(tmp_path, *TINY_UNET, f"data.source={images}", "task.sample_steps=2000", name="steps")
    assert not (tmp_path / "steps" / "checkpoints").exists()  # nothing trained
    with pytest.raises(UserError, match=r"task.sample_steps=0: ddim takes between 1 and"):
        run(tmp_path, *TINY_UNET, f"data.source={images}", "task=infer", "task.sample_steps=0")
    with pytest.raises(UserError, match=r"task.samples=0: give the number of images to draw"):
        run(tmp_path, *TINY_UNET, f"data.source={images}", "task.samples=0")
    with pytest.raises(UserError, match=r"model.beta_schedule='foo': use one of linear, scaled_linear, squaredcos"):
        run(tmp_path, *TINY_UNET, f"data.source={images}", "model.beta_schedule=foo")
    with pytest.raises(UserError, match=r"export=omny is not available for a diffusion denoiser; use export=onnx"):
        run(tmp_path, *TINY_UNET, f"data.source={images}", "export=omny", name="omny")
    assert not (tmp_path / "omny" / "checkpoints").exists()  # refused before the training, not after it


@pytest.mark.parametrize("task", [pytest.param("export", marks=pytest.mark.slow), "plan"])
def test_tasks_that_draw_no_samples_skip_the_sampling_keys(images, tmp_path, task):
    """task.sample_steps is checked against model.train_timesteps where samples are drawn, not by export or plan."""
    short = (*TINY_UNET, f"data.source={images}", "model.train_timesteps=10", "task.sample_steps=50")
    with pytest.raises(UserError, match=r"task.sample_steps=50: ddim takes between 1 and model.train_timesteps=10"):
        run(tmp_path, *short, "task=infer", name="infer")
    metrics, _ = run(tmp_path, *short, f"task={task}", "export=safetensors", name=task)
    assert metrics["modality"] == "diffusion" and (task == "plan" or Path(metrics["export/path"]).is_dir())


@pytest.mark.slow
def test_a_safetensors_export_replaces_an_earlier_export_only(images, tmp_path):
    """export=safetensors is written beside its folder and swapped in: an earlier export's folder (it holds
    onn_export.json) is replaced whole, a folder of the user's own is refused and left as it was."""
    mine = tmp_path / "mine"
    (mine / "eval_results").mkdir(parents=True)
    (mine / "config.json").write_text("{}")
    (mine / "NOTES.md").write_text("mine")
    export = (*TINY_UNET, f"data.source={images}", "task=export", "export=safetensors")
    with pytest.raises(UserError, match=rf"export output {mine} exists and is not an earlier export"):
        run(tmp_path, *export, f"export.output={mine}", name="refused")
    assert sorted(p.name for p in mine.iterdir()) == ["NOTES.md", "config.json", "eval_results"]
    assert (mine / "config.json").read_text() == "{}"
    folder = tmp_path / "denoiser"
    for name in ("first", "again"):
        metrics, _ = run(tmp_path, *export, f"export.output={folder}", name=name)
        assert metrics["export/path"] == str(folder)
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "onn_export.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staged folder left


@pytest.mark.parametrize("task", ["train", "plan"])
def test_image_sizes_a_denoiser_cannot_take_are_one_sentence(images, tmp_path, task):
    """A UNet halves images once per down block but its last; a DiT cuts them into patches."""
    resized = (f"task={task}", f"data.source={images}", "data.image_size=[7,7]", "data.resize=resize")
    unet = r"images of 7x7: a unet halves images 1 times .* multiples of 2; set data.image_size=\[8,8\] with"
    with pytest.raises(UserError, match=unet):
        run(tmp_path, *TINY_UNET, *resized)
    dit = r"images of 7x7: a dit cuts images into 2x2 patches .* multiples of 2; set data.image_size=\[8,8\]"
    with pytest.raises(UserError, match=dit):
        run(tmp_path, *TINY_DIT, *resized)


def test_images_of_their_own_odd_size_are_one_sentence(tmp_path):
    """data.image_size=null keeps the images' size: known once they are read, still before any step."""
    folder = write_images(tmp_path / "odd", per_class=4, size=6)
    unet = r"images of 6x6: a unet halves images 2 times .* multiples of 4; set data.image_size=\[8,8\]"
    deeper = "model.kwargs={block_out_channels: [4, 4, 4], layers_per_block: 1, norm_num_groups: 2, " + (
        "add_attention: false, down_block_types: [DownBlock2D, DownBlock2D, DownBlock2D], "
        "up_block_types: [UpBlock2D, UpBlock2D, UpBlock2D]}"
    )
    with pytest.raises(UserError, match=unet):
        run(tmp_path, "model=ddpm_unet", deeper, f"data.source={folder}", name="odd")
    assert not (tmp_path / "odd" / "checkpoints").exists()


@pytest.mark.slow
def test_eval_on_the_training_source_scores_the_runs_own_held_out_images(images, tmp_path):
    """task=eval with the very data.source the denoiser trained on: the held-out loss is the run's own last
    validation (its seeded held-out split, not every image); the real images judged are drawn at random from
    what is held out (a source scored whole lists its images class by class: the first few are all one class)."""
    trained, run_dir = run(tmp_path, *TINY_UNET, f"data.source={images}", name="train")
    judge = ("model=v28_cnn", "data=image", f"data.source={images}", "data.batch_size=8", "trainer.max_steps=30")
    _, judge_dir = run(tmp_path, *judge, name="judge")
    evaluate = (f"ckpt={run_dir}", "task=eval", f"task.classifier={judge_dir}", f"data.source={images}")
    given = {"ckpt", "task", "task.classifier", "data", "data.source", "task.samples", "task.confidence"}
    judged, _ = run(tmp_path, *TINY_UNET, *evaluate, "task.samples=5", "task.confidence=0", name="eval", given=given)
    assert judged["val/loss"] == round(trained["val/loss_final"], 5)
    assert judged["real/classes_present"] == 2  # confidence 0: every image counts, in the class it looks like
    # another source is scored whole: its images are listed class by class, and a random 5 of them are judged
    other = write_images(tmp_path / "other", per_class=8)
    evaluate = (*evaluate[:3], f"data.source={other}")
    fresh, _ = run(tmp_path, *TINY_UNET, *evaluate, "task.samples=5", "task.confidence=0", name="other", given=given)
    assert fresh["real/classes_present"] == 2 and fresh["val/loss"] != judged["val/loss"]


def test_a_list_of_module_lists_is_still_a_list_of_blocks():
    """Stages held as a model's ModuleList attributes are not blocks (a UNet's down_blocks and up_blocks), but
    a ModuleList of [attention, feed-forward] ModuleLists, as many transformers hold their layers, is."""
    from torch import nn

    from onn.models.layers import blocks_crossed, discover

    class Layers(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.layers = nn.ModuleList(nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]) for _ in range(3))

        def forward(self, x):
            x = self.embed(x)
            for attend, feed in self.layers:
                x = feed(attend(x))
            return x

    model = Layers()
    found = discover(model)
    assert found.blocks_path == "layers" and len(found) == 3
    assert blocks_crossed(model, (torch.zeros(1, 4),)) is None  # (the ModuleLists are never called themselves)


def test_the_moving_average_is_torchs_and_reads_nothing_back_from_the_device():
    """The same average as AveragedModel's EMA, step for step and across a checkpoint's load, and no value read
    back by the host in an update (on a GPU each read is a wait for it), except the count once after a load."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from onn.modalities.diffusion.module import MovingAverage

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    ours, torchs = (
        MovingAverage(model, 0.5),
        AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5), use_buffers=True),
    )
    for step in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(8, 4))  # the running statistics move too
        with HostReads() as reads:
            ours.update_parameters(model)
        torchs.update_parameters(model)
        assert reads.seen == [], f"update {step} read {reads.seen} from the device"
        for mine, theirs in zip(ours.module.parameters(), torchs.module.parameters()):
            torch.testing.assert_close(mine, theirs)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(ours.module[1], name), getattr(torchs.module[1], name))

    resumed = MovingAverage(model, 0.5)
    resumed.load_state_dict(ours.state_dict())
    for expected in (["__int__"], [], []):  # the loaded count, read once
        with HostReads() as reads:
            resumed.update_parameters(model)
        torchs.update_parameters(model)
        assert reads.seen == expected
    assert int(resumed.n_averaged) == 7 and resumed.updates == 7
    for mine, theirs in zip(resumed.module.parameters(), torchs.module.parameters()):
        torch.testing.assert_close(mine, theirs)


class _Shrink(torch.nn.Module):
    """A denoiser of one weight that uses its timesteps, as a U-Net's embedding does."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.1))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return x * self.scale + t.float().view(-1, 1, 1, 1) / 1000


class _DeviceCopies(torch.overrides.TorchFunctionMode):
    """Counts Tensor.to calls that name a device: each one a blocking copy from the host on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and any(isinstance(a, (torch.device, str)) for a in (*args[1:], *kwargs.values())):
            self.copies += 1
        return func(*args, **kwargs)


def test_drawing_copies_to_the_device_once_per_batch_not_once_per_step():
    """The timestep went to the device at every denoising step: on a GPU a blocking copy, so the host waited for
    the GPU each step. The copies to the device are now the same for 2 steps and for 8."""
    from diffusers import DDIMScheduler

    from onn.modalities.diffusion.sample import draw

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    copies, images = [], []
    for steps in (2, 8):
        scheduler = DDIMScheduler(num_train_timesteps=100)
        scheduler.set_timesteps(steps)
        with _DeviceCopies() as counted:
            images.append(draw(_Shrink(), scheduler, 3, [1, 4, 4], seed=0, device=device))
        copies.append(counted.copies)
    assert copies[0] == copies[1], f"copies to the device for 2 and 8 steps: {copies}"
    assert images[0].shape == (3, 1, 4, 4) and images[0].dtype == torch.uint8
