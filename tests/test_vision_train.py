"""The image track end to end on generated images: train, best checkpoint, resume, early stopping,
schedules, linear probe with cached features, streamed fallback, inference picture, bench_vision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import compose

from onn.errors import UserError
from onn.hardware.profile import resolve

COLOURS = [(220, 40, 40), (40, 200, 60), (50, 60, 230)]


def make_images(root: Path, train: int = 24, test: int = 8, size: int = 16) -> Path:
    """Three classes told apart by colour and stripe direction, with noise: learnable in a few epochs."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for split, count in (("train", train), ("test", test)):
        for c, colour in enumerate(COLOURS):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                base = torch.tensor(colour, dtype=torch.float32).view(3, 1, 1).expand(3, size, size).clone()
                if c == 1:
                    base[:, ::4, :] = 255
                elif c == 2:
                    base[:, :, ::4] = 255
                noisy = (base + 40 * torch.randn(3, size, size, generator=gen)).clamp(0, 255).to(torch.uint8)
                Image.fromarray(noisy.permute(1, 2, 0).numpy()).save(folder / f"{i:03d}.png")
    return root


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("images"))


def run(tmp: Path, *overrides: str, name: str = "run") -> tuple[dict, Path]:
    from onn.app import execute

    groups = [] if any(o.startswith("recipe=") for o in overrides) else ["model=v28_cnn", "data=image"]
    cfg = compose(
        *groups,
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp / 'outputs'}",
        f"paths.cache={tmp / 'cache'}",
        "data.batch_size=16",
        "trainer.max_steps=-1",
        "trainer.max_epochs=3",
        "trainer.val_check_interval=1.0",
        "optim.name=sgd",
        "optim.lr=0.05",
        "optim.warmup_steps=0",
        "optim.clip_grad_norm=0",
        "data.val_split=0.25",
        *overrides,
    )
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.ckpt:
        from onn.training.checkpoints import resolve

        cfg.ckpt = str(resolve(cfg.ckpt, cfg.paths.outputs))
    return execute(cfg, run_dir), run_dir


@pytest.mark.slow  # trains, keeps the best and tests it (~25 s on 2 cores)
def test_train_learns_keeps_best_and_tests_it(images, tmp_path):
    metrics, run_dir = run(tmp_path, f"data.source={images}", "tracking=tensorboard")
    assert metrics["strategy"] == "full" and metrics["resident"] is True
    assert metrics["epochs"] == 3 and len(metrics["val/history"]) == 3
    assert metrics["train/loss_final"] < metrics["train/loss_initial"]
    assert metrics["test/acc"] > 0.6  # chance is 1/3
    assert 0 <= metrics["test/acc"] <= metrics["test/acc_top5"] == 1.0  # 3 classes: top-5 holds them all
    best, last = Path(metrics["checkpoint_best"]), run_dir / "checkpoints" / "last.ckpt"
    assert best == run_dir / "checkpoints" / "best.ckpt" and (best / "model.safetensors").is_file()
    assert any(last.glob("*.safetensors"))
    assert metrics["val/acc_best"] == max(h["val/acc"] for h in metrics["val/history"])
    assert Path(metrics["confusion_matrix"]).stat().st_size > 1000
    events = list((run_dir / "tensorboard").rglob("events.out.tfevents*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(events[0].parent)).Reload().Tags()
    assert "val/confusion_matrix" in tags["images"] and "val/acc" in tags["scalars"]


@pytest.mark.slow  # 12-32 s in ci137's fast suite, which took 646 s
@pytest.mark.modalities
def test_resume_infer_and_eval(images, tmp_path):
    first, run_dir = run(tmp_path, f"data.source={images}", "trainer.max_epochs=2")
    resumed, _ = run(tmp_path, f"data.source={images}", "trainer.max_epochs=3", f"ckpt={run_dir}", name="resumed")
    assert resumed["resumed_from"] and resumed["epochs"] == 3
    assert [h["epoch"] for h in resumed["val/history"]] == [0, 1, 2]  # the history came with the checkpoint
    assert resumed["val/history"][:2] == first["val/history"]
    assert resumed["val/acc_best"] == max(h["val/acc"] for h in resumed["val/history"])  # over both runs
    unchanged, _ = run(tmp_path, f"data.source={images}", "trainer.max_epochs=2", f"ckpt={run_dir}", name="same")
    assert unchanged["val/acc_best"] == max(h["val/acc"] for h in first["val/history"])  # nothing new: the earlier best
    assert unchanged["test/acc"] == pytest.approx(first["test/acc"], abs=1e-6)

    out, infer_dir = run(tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={images / 'test'}", name="infer")
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert len(rows) == 24 and {r["true"] for r in rows} == {"class0", "class1", "class2"}
    assert all(r["predicted"] in ("class0", "class1", "class2") and len(r["top5"]) == 3 for r in rows)
    assert out["infer/acc"] == pytest.approx(sum(r["true"] == r["predicted"] for r in rows) / 24, abs=1e-5)
    from PIL import Image

    assert Image.open(out["infer/picture"]).size[0] > 16 * 8
    single, _ = run(
        tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={images / 'test/class1/000.png'}", name="one"
    )
    assert single["infer/items"] == 1

    evaluated, _ = run(tmp_path, "task=eval", f"ckpt={run_dir / 'checkpoints' / 'best.ckpt'}", name="eval")
    assert evaluated["test/acc"] == pytest.approx(first["test/acc"], abs=1e-6)  # training tested best.ckpt too


@pytest.mark.slow
@pytest.mark.modalities
def test_resuming_the_final_checkpoint_with_more_epochs_trains_them_as_an_unbroken_run(images, tmp_path):
    """trainer.max_steps set (the default's 200) makes Lightning restore last.ckpt inside its finished epoch."""
    steps = ("trainer.max_steps=200", "optim.schedule=constant", f"data.source={images}")  # a constant lr: checkable
    first, run_dir = run(tmp_path, *steps, "trainer.max_epochs=1")
    resumed, _ = run(tmp_path, *steps, "trainer.max_epochs=3", f"ckpt={run_dir}", name="resumed")
    whole, _ = run(tmp_path, *steps, "trainer.max_epochs=3", name="whole")
    per_epoch = first["steps"]
    assert resumed["steps"] == whole["steps"] == 3 * per_epoch and resumed["epochs"] == 3
    assert [h["step"] for h in resumed["val/history"]] == [per_epoch * (e + 1) for e in range(3)]
    assert resumed["val/history"] == whole["val/history"]  # the same numbers as a run that never stopped
    assert resumed["train/loss_final"] == pytest.approx(whole["train/loss_final"], abs=1e-6)


@pytest.mark.slow  # two trainings (~30 s on 2 cores)
def test_val_acc_best_is_recorded_whatever_the_monitor(images, tmp_path):
    metrics, _ = run(tmp_path, f"data.source={images}", "trainer.max_epochs=2", "task.monitor=val/loss")
    assert metrics["val/acc_best"] == max(h["val/acc"] for h in metrics["val/history"])
    assert metrics["val/loss_best"] == pytest.approx(min(h["val/loss"] for h in metrics["val/history"]), abs=1e-5)


@pytest.mark.slow  # 22-32 s on 2 cores (ci136)
def test_early_stopping_and_schedules(images, tmp_path):
    metrics, _ = run(
        tmp_path,
        f"data.source={images}",
        "optim.lr=0",
        "trainer.max_epochs=10",
        "task.early_stopping={patience: 1}",
        "optim.schedule=constant",
    )
    assert metrics["epochs"] < 10  # nothing improves at lr 0: stopped after patience + 1 validations
    # max_steps ends the first epoch before any validation: early stopping has nothing to check yet (a RuntimeError)
    cut, _ = run(
        tmp_path, f"data.source={images}", "task.early_stopping={patience: 1}", "trainer.max_steps=2", name="cut"
    )
    assert cut["steps"] == 2
    for schedule in ("step", "plateau", "onecycle", "linear"):
        metrics, _ = run(
            tmp_path,
            f"data.source={images}",
            f"optim.schedule={schedule}",
            "trainer.max_epochs=2",
            "optim.step_size=1",
            name=schedule,
        )
        assert metrics["epochs"] == 2 and metrics["train/loss_final"] < metrics["train/loss_initial"], schedule
    with pytest.raises(UserError, match="optim.schedule"):
        run(tmp_path, f"data.source={images}", "optim.schedule=wobbly", name="bad")


def test_mixup_blends_the_training_batches_through_the_runner(images, tmp_path):
    plain, _ = run(tmp_path, f"data.source={images}", "trainer.max_epochs=1", name="plain")
    mixed, _ = run(tmp_path, f"data.source={images}", "task.mixup=0.4", name="mixed")
    # the same seed, model and first batch: without the blend the first losses are the same to the bit, and an
    # untrained net's loss is near ln(3) either way (the blend moved it by 0.00099 on an AMD EPYC)
    assert abs(mixed["train/loss_initial"] - plain["train/loss_initial"]) > 1e-6
    assert mixed["train/loss_final"] < mixed["train/loss_initial"]  # the blended loss falls


def test_linear_probe_trains_the_head_on_cached_features(images, tmp_path):
    from safetensors.torch import save_file

    from onn.models.zoo.registry import build_zoo

    torch.manual_seed(0)  # the "pretrained" v28 a probe needs (planning refuses one without model.weights)
    weights = tmp_path / "v28.safetensors"
    save_file(build_zoo("v28_cnn", in_channels=3, num_classes=3, image_size=16).state_dict(), weights)
    probe = ("strategy=linear_probe", f"model.weights={weights}")
    metrics, _ = run(tmp_path, f"data.source={images}", *probe, "optim.lr=0.1")
    assert metrics["strategy"] == "linear_probe"
    assert metrics["params_trainable"] == 256 * 3 + 3  # v28's 256 features -> 3 classes
    cached = list((tmp_path / "cache" / "features").glob("*.safetensors"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    again, _ = run(tmp_path, f"data.source={images}", *probe, "optim.lr=0.1", name="again")
    assert cached[0].stat().st_mtime_ns == stamp  # read from the cache, not computed again
    assert again["val/history"] == metrics["val/history"]


def test_linear_probe_features_are_computed_again_when_the_images_change(tmp_path):
    """The features' cache was keyed by the items' names: test images overwritten under the same names (the
    decoded cache rebuilt) were scored on the old images' features. A damaged cache file was a SafetensorError
    traceback in every later run: it is computed again."""
    from PIL import Image
    from safetensors.torch import load_file, save_file

    from onn.modalities import classification, get
    from onn.models.zoo.registry import build_zoo

    source = make_images(tmp_path / "src", train=4, test=2, size=8)
    weights = tmp_path / "v28.safetensors"
    save_file(build_zoo("v28_cnn", in_channels=3, num_classes=3, image_size=8).state_dict(), weights)
    cfg = compose(
        *("model=v28_cnn", "data=image", "hardware=cpu_16gb", "strategy=linear_probe", f"model.weights={weights}"),
        *(f"data.source={source}", f"paths.cache={tmp_path / 'cache'}", "data.mean=[0.5]", "data.std=[0.25]"),
    )
    image = get("image")
    plan = image.plan(cfg, resolve(cfg.hardware, "/tmp", "/tmp"))[0]

    def test_features() -> torch.Tensor:
        dm = classification.setup_data(image, cfg, "cpu")
        module = classification.build(image, cfg, plan, classification.data_inputs(image, cfg, dm))
        return classification.features(module, dm, cfg).splits["test"].inputs

    before = test_features()
    for path in (source / "test").rglob("*.png"):
        Image.new("RGB", (8, 8)).save(path)
    after = test_features()
    # every test image black now (two of them in one batch: on two threads an AMD EPYC put their features 2e-8 apart)
    assert torch.allclose(after[0], after[-1], atol=1e-6) and not torch.allclose(before, after, atol=1e-3)
    cached = max((tmp_path / "cache" / "features").glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
    cached.write_bytes(cached.read_bytes()[:100])  # a copy cut short, a full disk's leftovers: a SafetensorError
    assert torch.equal(test_features(), after)  # computed again, and the cache file whole again
    assert torch.equal(load_file(cached)["test"], after)


def test_streamed_fallback_trains_like_resident(images, tmp_path):
    metrics, _ = run(
        tmp_path,
        f"data.source={images}",
        "data.resident=false",
        "data.num_workers=0",
        "trainer.max_epochs=2",
        "data.mean=[0.5,0.5,0.5]",
        "data.std=[0.25,0.25,0.25]",
    )
    assert metrics["resident"] is False and metrics["epochs"] == 2
    assert metrics["train/loss_final"] < metrics["train/loss_initial"]


def test_separate_val_source_is_labelled_by_class_name(images, tmp_path):
    import shutil

    from onn.modalities.image.dataset import ImageDataModule

    val = tmp_path / "val"
    for name in ("class0", "class2"):  # one class missing: its folder index would shift the labels
        shutil.copytree(images / "test" / name, val / name)
    data = compose("data=image", f"data.source={images}", f"data.val_source={val}").data
    dm = ImageDataModule(data, tmp_path / "cache")
    dm.setup()
    split = dm.splits["val"]
    assert sorted(set(split.labels.tolist())) == [0, 2]
    assert all(dm.classes[label] in name for label, name in zip(split.labels.tolist(), split.names))


def test_resident_batches_are_seeded_shuffles_of_every_sample():
    from onn.data.resident import ResidentBatches, Split

    split = Split(torch.arange(50).view(50, 1, 1, 1).to(torch.uint8), torch.arange(50), [str(i) for i in range(50)])
    loader = ResidentBatches(split, 8, shuffle=True, seed=3, drop_last=True)
    first = torch.cat([x.flatten() for x, _ in loader])
    second = torch.cat([x.flatten() for x, _ in loader])
    assert len(loader) == 6 and len(first) == 48 and len(set(first.tolist())) == 48
    assert not torch.equal(first, second)  # each epoch its own order
    again = ResidentBatches(split, 8, shuffle=True, seed=3, drop_last=True)
    assert torch.equal(torch.cat([x.flatten() for x, _ in again]), first)  # reproducible from the seed
    plain = ResidentBatches(split, 16, shuffle=False)
    assert [len(y) for _, y in plain] == [16, 16, 16, 2]


def test_no_two_seeds_share_an_epoch_order():
    """Seed 1's first epoch is not seed 0's second (their generators were seeded with seed + epoch), in every
    shuffle ONN draws: resident batches, the streamed sampler and text's endless order."""
    from onn.data.resident import EpochShuffle, ResidentBatches, Split
    from onn.modalities.text.datamodule import ResumableShuffle

    split = Split(torch.arange(40).view(40, 1), torch.arange(40), [str(i) for i in range(40)])

    def resident(seed: int) -> list[list[int]]:
        loader = ResidentBatches(split, 40, shuffle=True, seed=seed)
        return [next(iter(loader))[0].flatten().tolist() for _ in range(2)]

    def streamed(seed: int) -> list[list[int]]:
        sampler = EpochShuffle(40, seed)
        return [list(sampler) for _ in range(2)]

    def text(seed: int) -> list[list[int]]:
        order = iter(ResumableShuffle(40, seed, start=lambda: 0))
        return [[next(order) for _ in range(40)] for _ in range(2)]

    for epochs in (resident, streamed, text):
        seed0, seed1 = epochs(0), epochs(1)
        assert seed0[0] != seed0[1] and seed1[0] != seed0[1] and seed1[1] != seed0[0], epochs.__name__


def test_batch_groups_put_one_group_in_each_training_batch():
    """data.batch_groups: a regex on the file names; every training batch holds one speaker's samples,
    the groups' batches come interleaved and seeded, and each group's leftover short of a batch waits."""
    from onn.data.resident import ResidentBatches, Split, batch_groups

    names = [f"{i % 10}_{('ann', 'bob', 'cy')[i % 3]}_{i}.wav" for i in range(60)]
    split = Split(torch.arange(60).view(60, 1), torch.arange(60) % 10, names)
    groups = batch_groups(names, "_([a-z]+)_")
    loader = ResidentBatches(split, 6, shuffle=True, seed=1, drop_last=True, groups=groups)
    batches = [x.flatten().tolist() for x, _ in loader]
    assert len(loader) == len(batches) == 9  # 20 samples per speaker: 3 batches of 6 each
    assert all(len({groups[i] for i in batch}) == 1 for batch in batches)
    assert len({i for batch in batches for i in batch}) == 54
    owners = [groups[batch[0]] for batch in batches]
    assert owners != sorted(owners)  # interleaved, not one speaker after another
    again = ResidentBatches(split, 6, shuffle=True, seed=1, drop_last=True, groups=groups)
    assert [x.flatten().tolist() for x, _ in again] == batches
    with pytest.raises(UserError, match="finds no group in the training file name '0_ann_0.wav'"):
        batch_groups(names, "_([0-9]+)_")
    with pytest.raises(UserError, match="is not a regular expression"):
        batch_groups(names, "_([a-z]+_")


def test_user_mistakes_are_one_clear_error(images, tmp_path):
    with pytest.raises(UserError, match="data.source is not set"):
        run(tmp_path, name="nosource")
    with pytest.raises(UserError, match="classifiers train with strategy=full"):
        run(tmp_path, f"data.source={images}", "strategy=lora", name="lora")
    with pytest.raises(UserError, match="is a classifier network but data=math is text"):
        run(tmp_path, "data=math", name="mismatch")
    with pytest.raises(UserError, match="task.input"):
        run(tmp_path, "task=infer", f"data.source={images}", name="noinput")


@pytest.mark.slow
def test_bench_vision_reports_both_ratios(images, tmp_path):
    metrics, _ = run(
        tmp_path,
        "task=bench_vision",
        f"data.source={images}",
        "task.steps=3",
        "task.warmup=1",
        "task.repeats=1",
        "task.standard_workers=0",
        "data.augment={crop_padding: 2, hflip: 0.5}",
    )
    for key in ("vision/runner_overhead", "vision/lightning_floor", "vision/resident_speedup", "vision/train_speedup"):
        assert isinstance(metrics[key], float), key
    # ONN's runner asks the device for the plain loop's work: on a GPU, no kernel launches or waits of its own
    # (on a CPU the count sees .item() and outputs sized by their values, not copies: no ops there)
    ops, waits = metrics["vision/device_ops_per_step"], metrics["vision/host_waits_per_step"]
    assert ops["plain"] > 50 and ops["onn"] <= 1.05 * ops["plain"]
    assert waits["onn"] <= waits["plain"]
    assert set(metrics["vision/rounds"]) >= {
        "plain",
        "onn",
        "lightning",
        "standard",
        "resident",
        "pipeline_standard",
        "pipeline_resident",
    }


def test_the_vision_bench_counts_what_makes_the_host_wait_for_a_gpu():
    """What makes the host wait for a GPU, op by op (meta tensors stand in for the GPU's), and on a CPU run."""
    from onn.hardware.waits import aten, makes_the_host_wait

    device, host = torch.empty(4, device="meta"), torch.empty(4)
    to_host = {"device": torch.device("cpu")}
    cases = [
        (aten._local_scalar_dense.default, (device,), {}, True),  # .item(), float(), bool()
        (aten._local_scalar_dense.default, (host,), {}, False),  # a value the host holds
        (aten._to_copy.default, (device,), to_host, True),  # .cpu(), .tolist()
        (aten._to_copy.default, (device,), {**to_host, "non_blocking": True}, False),
        (aten._to_copy.default, (host,), {"device": torch.device("cuda")}, True),  # a batch from pageable memory
        (aten._to_copy.default, (host,), {"device": torch.device("cuda"), "non_blocking": True}, False),
        (aten._to_copy.default, (device,), {"dtype": torch.bfloat16}, False),  # a cast on the device
        (aten.copy_.default, (host, device), {}, True),
        (aten.copy_.default, (host, device, True), {}, False),
        (aten.copy_.default, (device, host), {}, True),
        (aten.copy_.default, (device, host), {"non_blocking": True}, False),
        (aten.nonzero.default, (device,), {}, True),
        (aten.bincount.default, (device,), {}, True),
        (aten.index.Tensor, (device, [torch.empty(4, dtype=torch.bool, device="meta")]), {}, True),
        (aten.index.Tensor, (device, [torch.empty(2, dtype=torch.long, device="meta")]), {}, False),
        (aten.add.Tensor, (device, device), {}, False),
    ]
    assert [makes_the_host_wait(*case[:3], on_cpu=False) for case in cases] == [case[3] for case in cases]
    assert makes_the_host_wait(aten._local_scalar_dense.default, (host,), {}, on_cpu=True)  # would wait on a GPU


def test_bench_visions_standard_pipeline_reads_the_training_split_and_batches_one_smaller_than_a_batch(
    images, tmp_path
):
    """The standard pipeline draws from the datamodule's training split, as the resident side does: not the images
    data.val_split holds out for validation (it read every file outside a `test` folder). A split smaller than
    data.batch_size still gives a batch each epoch (drop_last gave none, and the timing loops spun for ever), the
    loops run epoch after epoch, and a loader with no batch at all is an error, not a loop that never ends."""
    from onn.bench.vision import StandardPipeline, _pipeline_only, epochs
    from onn.modalities import classification, get

    image = get("image")
    sizes = ["data.image_size=[16,16]", "data.val_split=0.25", "data.batch_size=128"]
    cfg = compose("recipe=bench_vision", f"data.source={images}", *sizes, f"paths.cache={tmp_path}")
    dm = classification.setup_data(image, cfg, "cpu")
    standard = StandardPipeline(cfg, dm, classification.data_inputs(image, cfg, dm))
    train = dm.splits["train"]
    held = len(dm.splits["val"])  # 72 training images less those data.val_split=0.25 draws out (their names decide)
    assert 0 < held < 72 and len(standard.items) == len(train) == 72 - held
    assert sorted(label for _, label in standard.items) == sorted(train.labels.tolist())
    assert [len(labels) for _, labels in epochs(standard.loader(), 3)] == [len(train)] * 3
    assert _pipeline_only(standard.loader(), 2, 1, None, dm.device) > 0
    with pytest.raises(UserError, match="data.source's training split gave no batch"):
        next(epochs([], 1))


def test_bench_vision_counts_the_rows_each_timed_step_had():
    """samples/s is the rows the timed steps held over their time, not data.batch_size per step: an epoch's
    partial batch, or a split smaller than a batch, counts what it held."""
    from onn.bench.vision import samples_per_s

    # one warm-up step, then two timed ones of 16 and 5 rows: 2 s from the first timed step's start to the end
    assert samples_per_s([10.0, 11.0, 12.5, 13.0], [16, 16, 5], warmup=1, steps=2) == 21 / 2


def test_bench_visions_plain_loop_trains_bf16_weights_under_bf16_true(images, tmp_path, monkeypatch):
    """Under strategy.precision=bf16-true Lightning trains the converted bf16 weights on bf16 inputs; the plain
    loop autocast float32 weights instead, another work than ONN's side (bench_overhead's plain loop had the same
    mismatch, fixed before)."""
    from onn.bench import vision
    from onn.modalities import classification, get

    built = []
    plain_model = vision._plain_model
    monkeypatch.setattr(vision, "_plain_model", lambda *a: built.append(plain_model(*a)) or built[-1])
    image = get("image")
    sizes = ["data.image_size=[16,16]", "data.batch_size=16", "strategy.precision=bf16-true", "model.compile=false"]
    cfg = compose("recipe=bench_vision", f"data.source={images}", *sizes, f"paths.cache={tmp_path}")
    dm = classification.setup_data(image, cfg, "cpu")
    inputs = classification.data_inputs(image, cfg, dm)
    plan, _ = image.plan(cfg, resolve(cfg.hardware, tmp_path, tmp_path))
    assert vision._plain_loop(cfg, plan, inputs, dm, steps=2, warmup=1) > 0
    assert {p.dtype for p in built[0].parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("compiled", [False, True])
def test_bench_visions_plain_loop_compiles_its_model_as_onns_side_does(compiled):
    """model.compile: both sides of the runner's overhead train the compiled network, or neither does."""
    from onn.bench.vision import _plain_model

    cfg = compose("recipe=bench_vision", "data.source=/nowhere", f"model.compile={compiled}")
    model = _plain_model(cfg, {"input_shape": [3, 32, 32], "classes": list("abcdefghij")}, torch.device("cpu"))
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule) == compiled


@pytest.mark.parametrize(
    "recipe, strategy, channels",
    [
        ("cifar10_v28", "full", 3),
        ("cifar10_v28_aug", "full", 3),
        ("cifar10_resnet18", "full", 3),
        ("fashion_mnist_v28", "full", 1),
        ("oxford_flowers_probe", "linear_probe", 3),
        ("bench_vision", "full", 3),
    ],
)
def test_recipes_compose_and_plan(recipe, strategy, channels, tmp_path):
    from safetensors.torch import save_file

    from onn.modalities import get

    weights = tmp_path / "pretrained.safetensors"  # a probe needs model.weights; planning builds on meta, reads none
    save_file({"unread": torch.zeros(1)}, weights)
    given = [f"model.weights={weights}"] if strategy == "linear_probe" else []
    cfg = compose(
        f"recipe={recipe}", "data.source=/nowhere", "hardware=rtx3060_12gb", *given
    )  # cifar10_resnet18 is a GPU recipe
    assert cfg.data.modality == "image" and cfg.data.channels == channels
    plan, spec = get("image").plan(cfg, resolve(cfg.hardware, "/tmp", "/tmp"))
    assert plan.strategy == strategy and spec.kind == "network"
    assert spec.sample_flops > 0 and spec.sample_activation_bytes > 0 and spec.n_blocks >= 3
    assert plan.candidates[strategy]["fits"]


def test_corrupt_images_are_skipped_and_counted_in_a_run(tmp_path, caplog):
    data = make_images(tmp_path / "bad", train=12, test=4)
    (data / "train" / "class0" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    good = (data / "train" / "class1" / "000.png").read_bytes()
    (data / "train" / "class1" / "truncated.png").write_bytes(good[: len(good) // 2])
    with pytest.raises(UserError, match="max_bad_fraction"):
        run(tmp_path, f"data.source={data}", "trainer.max_epochs=1", name="strict")
    metrics, _ = run(
        tmp_path, f"data.source={data}", "trainer.max_epochs=1", "data.max_bad_fraction=0.1", name="lenient"
    )
    assert metrics["items_skipped"] == 2
    assert "broken.png" in caplog.text


@pytest.mark.slow  # 12-32 s in ci137's fast suite, which took 646 s
def test_idx_files_train_a_one_channel_model_and_export(tmp_path):
    """Fashion-MNIST's layout (gzipped IDX, 28x28 greyscale) through the recipe, then ONNX and safetensors."""
    import gzip
    import struct

    gen = torch.Generator().manual_seed(0)
    folder = tmp_path / "fashion"
    folder.mkdir()
    for prefix, n in (("train", 60), ("t10k", 20)):
        labels = torch.arange(n) % 3
        images = (labels.view(n, 1, 1) * 80 + 20 * torch.rand(n, 28, 28, generator=gen)).to(torch.uint8)
        (folder / f"{prefix}-images-idx3-ubyte.gz").write_bytes(
            gzip.compress(struct.pack(">IIII", 0x803, n, 28, 28) + images.numpy().tobytes())
        )
        (folder / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(struct.pack(">II", 0x801, n) + labels.to(torch.uint8).numpy().tobytes())
        )
    metrics, run_dir = run(
        tmp_path,
        "recipe=fashion_mnist_v28",
        f"data.source={folder}",
        "trainer.max_epochs=4",
        "optim.warmup_steps=0",
        "data.batch_size=16",
        "export=onnx",
    )
    assert metrics["test/acc"] > 0.5 and metrics["export/max_abs_diff"] < 1e-3
    import onnx

    graph = onnx.load(metrics["export/onnx"]).graph
    assert [d.dim_value for d in graph.input[0].type.tensor_type.shape.dim][1:] == [1, 28, 28]
    saved, _ = run(tmp_path, "task=export", "export=safetensors", f"ckpt={run_dir}", name="export")
    from safetensors.torch import load_file

    state = load_file(str(Path(saved["export/path"]) / "model.safetensors"))
    assert state["features.0.0.weight"].shape[1] == 1 and state["classifier.head.weight"].shape[0] == 10


def test_a_classifiers_export_replaces_an_earlier_export_whole_and_traces_at_its_own_size(tmp_path):
    """A classifier's safetensors export wrote into its folder in place (a user's own config.json overwritten, a
    failed write leaving half a folder), and export.sample.image_size was ignored without a word (the graph took
    the data's size)."""
    from onn.app import execute
    from onn.export.folders import MARKER

    common = ("task=export", "model=v28_cnn", "data=image", f"paths.outputs={tmp_path}", f"paths.cache={tmp_path}")
    folder = tmp_path / "export"
    for run in ("first", "second"):
        m = execute(compose(*common, "export=safetensors", f"export.output={folder}"), tmp_path / run)
        assert m["export/path"] == str(folder)
        assert sorted(p.name for p in folder.iterdir()) == sorted(["config.json", "model.safetensors", MARKER])
    with pytest.raises(UserError, match=r"^export\.sample\.image_size=\[64, 64\]: a trained classifier is traced"):
        execute(compose(*common, "export=onnx", "export.sample.image_size=[64,64]"), tmp_path / "onnx")
