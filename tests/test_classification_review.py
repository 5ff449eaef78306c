"""The classifiers' shared task=infer and task=eval (onn/modalities/classification.py), as a review found them: a
label number in task.input (a CSV's numeric label) compared as text with the names data.classes gave the model's
classes (every row true null, no infer/acc), and label numbers past the checkpoint's classes refused with a sentence
about a data.classes the user never set."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MODALITY_HARDWARE, compose
from PIL import Image
from test_vision_train import make_images, run

from onn.errors import UserError

NAMES = ["red", "green", "blue"]  # data.classes naming make_images' label numbers 0, 1, 2


def numbered_table(images: Path, split: str, extra: str = "") -> Path:
    """A `path,label` CSV of one split of make_images' folders, labelled by number (class0 -> 0, ...), and an
    `extra` row."""
    rows = [
        f"{split}/{picture.parent.name}/{picture.name},{picture.parent.name.removeprefix('class')}"
        for picture in sorted((images / split).glob("class*/*.png"))
    ]
    table = images / f"{split}{'_extra' if extra else ''}.csv"
    table.write_text("\n".join(["path,label", *rows, *([extra] if extra else [])]) + "\n")
    return table


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A v28 classifier trained on numbered CSV labels named by data.classes (its classes: the names), and the
    images."""
    tmp = tmp_path_factory.mktemp("numbered")
    images = make_images(tmp / "images")
    source = numbered_table(images, "train")
    metrics, run_dir = run(
        tmp, MODALITY_HARDWARE, f"data.source={source}", f"data.classes=[{','.join(NAMES)}]", "trainer.max_epochs=4"
    )
    assert metrics["train/loss_final"] < metrics["train/loss_initial"]  # the premise: it learned something
    return run_dir, images


@pytest.mark.modalities
def test_infer_scores_label_numbers_as_the_models_classes_of_those_numbers(trained, tmp_path):
    """task.input=test.csv of label numbers 0..2 for a model whose classes data.classes named: "0" was looked up
    among [red, green, blue], so no row had a true label and there was no infer/acc."""
    run_dir, images = trained
    table = numbered_table(images, "test")
    out, _ = run(tmp_path, MODALITY_HARDWARE, "task=infer", f"ckpt={run_dir}", f"task.input={table}", name="infer")
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert len(rows) == 24
    want = {row["name"]: NAMES[int(Path(row["name"]).parent.name.removeprefix("class"))] for row in rows}
    assert all(row["true"] == want[row["name"]] for row in rows)  # label 1 is the model's "green"
    assert out["infer/acc"] == pytest.approx(sum(r["true"] == r["predicted"] for r in rows) / 24, abs=1e-5)
    assert out["infer/acc"] > 0.5  # chance is 1/3: the truths are the classes the model learned them as


@pytest.mark.modalities
def test_eval_of_label_numbers_the_checkpoint_never_learned_names_the_checkpoint(trained, tmp_path):
    """A CSV with a label 3 for a model of three classes was refused as "data.classes names 3 classes but
    data.source has 4; name them all": a key the command never set, and naming a fourth class would not help."""
    from onn.app import execute, given_keys

    run_dir, images = trained
    first = next((images / "test" / "class0").iterdir())
    table = numbered_table(images, "test", extra=f"test/class0/{first.name},3")
    overrides = [MODALITY_HARDWARE, "data=image", f"data.source={table}", "data.val_split=0.5"]
    cfg = compose("task=eval", f"ckpt={run_dir}", "tracking=none", f"paths.outputs={tmp_path}", *overrides)
    (tmp_path / "eval").mkdir()
    with pytest.raises(UserError, match=r"label numbers up to 3 .*but ckpt .* learned 3 classes") as refused:
        execute(cfg, tmp_path / "eval", given_keys(overrides))
    assert "data.classes names" not in str(refused.value)


def pretrained_v28(images: Path) -> torch.nn.Module:
    """A seeded v28 whose BatchNorm statistics are measured on the training images, normalised with data.mean=0.4
    (as a pretrained network's are of its data): with the initial statistics (mean 0, var 1) its features of
    normalised pixels barely differ between images (std ~1e-4), and a probe of them learns nothing."""
    from onn.models.zoo.registry import build_zoo

    torch.manual_seed(0)
    network = build_zoo("v28_cnn", in_channels=3, num_classes=3, image_size=16)
    pictures = sorted((images / "train").glob("class*/*.png"))
    pixels = torch.from_numpy(np.stack([np.asarray(Image.open(p)) for p in pictures])).permute(0, 3, 1, 2) / 255
    for norm in network.modules():
        if isinstance(norm, torch.nn.modules.batchnorm._BatchNorm):
            norm.reset_running_stats()
            norm.momentum = None  # the average over every batch seen: here the one batch of all the images
    with torch.no_grad():
        network.train()((pixels - 0.4) / pixels.std(dim=(0, 2, 3), keepdim=True))
    return network.eval()


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> tuple[Path, Path]:
    """A linear probe of a "pretrained" v28 (seeded weights, its norms measured on the images, saved) on
    make_images' three class folders, trained on cached features, and the images."""
    from safetensors.torch import save_file

    tmp = tmp_path_factory.mktemp("probe")
    images = make_images(tmp / "images")
    weights = tmp / "v28.safetensors"
    save_file(pretrained_v28(images).state_dict(), weights)
    given = ("strategy=linear_probe", f"model.weights={weights}", "optim.lr=0.1", "trainer.max_epochs=4")
    metrics, run_dir = run(tmp, MODALITY_HARDWARE, f"data.source={images}", *given, "data.mean=[0.4]")
    assert metrics["strategy"] == "linear_probe" and metrics["train/loss_final"] < metrics["train/loss_initial"]
    assert metrics["test/acc"] > 0.6  # chance is 1/3: the probe learned, so infer agreeing with eval means something
    return run_dir, images


@pytest.mark.modalities
def test_a_linear_probes_checkpoint_infers_and_exports_the_normalised_batch_through_its_backbone(probe, tmp_path):
    """A probe's Classifier takes cached features: task=infer fed it raw pixels as features (a shapes traceback),
    and its ONNX graph cast the stored pixels to float unnormalised, where task=eval runs the backbone on the
    normalised batch. Infer now agrees with eval's figures, and the graph with infer's probabilities."""
    import onnxruntime as ort

    run_dir, images = probe
    out, _ = run(tmp_path, MODALITY_HARDWARE, "task=infer", f"ckpt={run_dir}", f"task.input={images / 'test'}")
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert len(rows) == 24 and out["infer/acc"] == pytest.approx(
        sum(r["true"] == r["predicted"] for r in rows) / 24, abs=1e-5
    )
    scored, _ = run(tmp_path, MODALITY_HARDWARE, "task=eval", f"ckpt={run_dir}", name="eval")
    assert out["infer/acc"] == pytest.approx(scored["test/acc"], abs=1e-5)  # the same 24 test images
    # eval scores the cached features, infer runs the backbone on the normalised batch: the same probabilities (the
    # features were of the raw pixels, and infer scored chance where eval scored 0.79)
    loss = sum(-np.log(dict(r["top5"])[r["true"]]) for r in rows) / 24
    assert loss == pytest.approx(scored["test/loss"], abs=1e-3)
    exported, _ = run(tmp_path, MODALITY_HARDWARE, "task=export", f"ckpt={run_dir}", "export=onnx", name="export")
    session = ort.InferenceSession(exported["export/onnx"], providers=["CPUExecutionProvider"])
    picture = images / "test" / "class2" / "003.png"
    stored = np.asarray(Image.open(picture)).transpose(2, 0, 1)[None].copy()
    (logits,) = session.run(None, {"input": stored})
    probabilities = torch.softmax(torch.from_numpy(logits).float(), dim=1)[0]
    (row,) = [r for r in rows if r["name"].endswith("class2/003.png")]
    assert dict(row["top5"]) == pytest.approx(
        {c: float(p) for c, p in zip(["class0", "class1", "class2"], probabilities)}, abs=1e-4
    )
