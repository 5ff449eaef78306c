"""3D meshes: every file type read through trimesh into normalised point sets, broken files skipped and
named, on-device augmentation, PointNet, the whole track on generated primitives (train -> infer ->
ONNX), and the 100 real files of ../shared/data/meshes/trimesh."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA, compose

from onn.errors import UserError
from onn.hardware.profile import resolve
from onn.modalities.mesh.primitives import CLASSES, write_primitives
from onn.modalities.mesh.read import Sampling, decode, read_source

MESHES = SHARED_DATA / "meshes" / "trimesh"
SETTINGS = Sampling(points=64, normals=False, seed=0)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    """Six classes of primitives, 6 each, written as OBJ, PLY, STL, OFF and GLB in turn."""
    return write_primitives(tmp_path_factory.mktemp("shapes"), per_class=6, seed=0)


def test_every_format_reads_to_normalised_points(shapes):
    found = read_source(shapes, Sampling(points=64, normals=True, seed=0), max_bad_fraction=0.0)
    (split,) = found.values()
    assert split.inputs.shape == (36, 64, 6) and split.classes == list(CLASSES)
    assert {Path(n).suffix for n in split.names} == {".obj", ".ply", ".stl", ".off", ".glb"}
    xyz, normals = split.inputs[..., :3], split.inputs[..., 3:]
    radius = xyz.norm(dim=-1).amax(dim=1)
    assert torch.allclose(radius, torch.ones(36), atol=1e-5)  # scaled into the unit sphere
    assert xyz.mean(dim=1).abs().max() < 1e-5  # centred
    assert torch.allclose(normals.norm(dim=-1), torch.ones(36, 64), atol=1e-4)
    assert [split.classes[i] for i in split.labels] == [n.split("/")[0] for n in split.names]
    again = read_source(shapes, Sampling(points=64, normals=True, seed=0), max_bad_fraction=0.0)
    assert torch.equal(next(iter(again.values())).inputs, split.inputs)  # seeded by the file's content
    other = read_source(shapes, Sampling(points=64, normals=True, seed=1), max_bad_fraction=0.0)
    assert not torch.equal(next(iter(other.values())).inputs, split.inputs)


def test_pca_alignment_undoes_a_rotation():
    import trimesh

    from onn.modalities.mesh.primitives import rotation
    from onn.modalities.mesh.read import sample_points

    box = trimesh.creation.box(extents=[1.6, 0.9, 0.4])
    turned = box.copy().apply_transform(rotation(np.random.default_rng(3)))
    aligned = Sampling(256, True, 0, "pca")
    a, b = (sample_points(m.vertices, m.faces, aligned, "box") for m in (box, turned))
    assert np.allclose(a, b, atol=1e-4)  # the same points, the same frame, whatever the file's orientation
    spread = np.cov(a[:, :3].T)
    assert np.allclose(spread, np.diag(np.diag(spread)), atol=1e-6) and spread[0, 0] > spread[1, 1] > spread[2, 2]


def test_a_scene_of_two_meshes_is_one_shape(tmp_path):
    import trimesh

    scene = trimesh.Scene()
    scene.add_geometry(
        trimesh.creation.box(extents=[1, 1, 1]),
        transform=trimesh.transformations.translation_matrix([-3, 0, 0]),
    )
    scene.add_geometry(
        trimesh.creation.box(extents=[1, 1, 1]),
        transform=trimesh.transformations.translation_matrix([3, 0, 0]),
    )
    (tmp_path / "two.glb").write_bytes(scene.export(file_type="glb"))
    points = decode(tmp_path / "two.glb", "two.glb", Sampling(256, False))
    assert (points[:, 0] < -0.5).sum() > 64 and (points[:, 0] > 0.5).sum() > 64  # both boxes, where the scene put them


def test_broken_files_are_skipped_with_their_reason(shapes, tmp_path, caplog):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(shapes, data)
    (data / "box" / "nan.obj").write_text("v 0 0 0\nv 1 0 0\nv nan 1 0\nv 0 0 1\nf 1 2 3\nf 1 2 4\n")
    (data / "box" / "empty.ply").write_bytes(b"")
    # trimesh reads this one as an empty scene, without an error
    (data / "cone" / "garbage.stl").write_bytes(b"\x00\x01not a mesh" * 20)
    (data / "cone" / "flat.obj").write_text("v 0 0 0\nv 1 0 0\nv 2 0 0\nf 1 2 3\n")  # every face degenerate
    (data / "torus" / "bad.glb").write_bytes(b"glTF" + bytes(40))  # a header and nothing after it
    (data / "sphere" / "cloud.ply").write_bytes(_point_cloud_ply(50))  # points only: read as points
    with pytest.raises(
        UserError, match=r"5 of 42 mesh files cannot be used .*nan\.obj: 1 of its 4 vertices are not finite"
    ):
        read_source(data, SETTINGS, max_bad_fraction=0.05)
    found = read_source(data, SETTINGS, max_bad_fraction=0.2)
    (split,) = found.values()
    assert len(split.names) == 37 and "sphere/cloud.ply" in split.names
    reasons = dict(s.split(": ", 1) for s in split.skipped)
    assert set(reasons) == {
        "box/nan.obj",
        "box/empty.ply",
        "cone/garbage.stl",
        "cone/flat.obj",
        "torus/bad.glb",
    }
    assert "not finite" in reasons["box/nan.obj"] and "zero surface area" in reasons["cone/flat.obj"]
    assert "empty file (0 bytes)" in reasons["box/empty.ply"] and "no geometry" in reasons["cone/garbage.stl"]
    assert reasons["torus/bad.glb"].startswith("unreadable as GLB")
    assert "Skipped 5 of 42 mesh files" in caplog.text


def test_points_that_coincide_or_overflow_are_skipped_with_their_reason(tmp_path):
    """A file of one distinct point (trimesh's face_in_group_name.obj) was read as a shape: the rounding that
    centring leaves, scaled into the unit sphere, became all zeros or an arbitrary unit vector by the point count.
    Coordinates of 1e200 were "zero surface area", with numpy's overflow warning on stderr."""
    import warnings

    from onn.modalities.mesh.read import MeshError

    (tmp_path / "one.obj").write_text("v 0.3 0.7 0.1\n" * 3)
    (tmp_path / "huge.obj").write_text("v 0 0 0\nv 1e200 0 0\nv 0 1e200 0\nf 1 2 3\n")
    (tmp_path / "tiny.obj").write_text("v 0 0 0\nv 1e-7 0 0\nv 0 1e-7 0\nv 0 0 1e-7\nf 1 2 3\nf 1 2 4\nf 1 3 4\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for points in (4, 16, 64):
            with pytest.raises(MeshError, match=r"has no extent \(all its points coincide\)"):
                decode(tmp_path / "one.obj", "one.obj", Sampling(points, False, 0, "pca"))
        with pytest.raises(MeshError, match="coordinates are too large to sample"):
            decode(tmp_path / "huge.obj", "huge.obj", SETTINGS)
    tiny = decode(tmp_path / "tiny.obj", "tiny.obj", SETTINGS)  # small, not flat: a shape like any other
    assert np.linalg.norm(tiny, axis=1).max() == pytest.approx(1.0, abs=1e-5)


def test_a_files_points_are_the_same_whichever_folder_is_given(shapes):
    """Points were seeded by the name relative to the folder given: a file inferred alone, or from its class
    folder, was sampled otherwise than from the folder above, and its probabilities moved with the path."""
    (whole,) = read_source(shapes, SETTINGS, max_bad_fraction=0.0).values()
    (folder,) = read_source(shapes / "box", SETTINGS, max_bad_fraction=0.0, allow_unlabelled=True).values()
    name = folder.names[0]
    (alone,) = read_source(shapes / "box" / name, SETTINGS, max_bad_fraction=0.0, allow_unlabelled=True).values()
    want = whole.inputs[whole.names.index(f"box/{name}")]
    assert torch.equal(folder.inputs[0], want) and torch.equal(alone.inputs[0], want)


def _point_cloud_ply(n: int) -> bytes:
    rows = "\n".join(f"{math.cos(i)} {math.sin(i)} {i / n}" for i in range(n))
    return (
        f"ply\nformat ascii 1.0\nelement vertex {n}\nproperty float x\nproperty float y\nproperty float z\n"
        f"end_header\n{rows}\n"
    ).encode()


def test_layouts_splits_and_loose_files(shapes, tmp_path):
    import shutil

    for split in ("train", "test"):
        shutil.copytree(shapes, tmp_path / "split" / split)
    found = read_source(tmp_path / "split", SETTINGS, max_bad_fraction=0.0)
    assert set(found) == {"train", "test"} and len(found["test"].names) == 36
    shutil.copytree(shapes / "torus", tmp_path / "modelnet" / "ModelNet" / "torus" / "train")
    shutil.copytree(shapes / "cone", tmp_path / "modelnet" / "ModelNet" / "cone" / "test")
    # a wrapping folder, CLASS/SPLIT/FILE
    found = read_source(tmp_path / "modelnet", SETTINGS, max_bad_fraction=0.0)
    assert found["train"].classes == ["cone", "torus"] and {found["test"].classes[i] for i in found["test"].labels} == {
        "cone"
    }
    shutil.copy(shapes / "box" / "0000.obj", tmp_path / "split" / "loose.obj")
    with pytest.raises(UserError, match="loose.obj is not in a class folder"):
        read_source(tmp_path / "split", SETTINGS, max_bad_fraction=0.0)


def test_point_augment_turns_about_the_up_axis_only_in_training():
    from onn.config.data import MeshAugment
    from onn.modalities.mesh.augment import PointAugment

    points = torch.randn(4, 100, 6)
    augment = PointAugment(MeshAugment(rotate="up", up_axis="z", scale=None, jitter=0.0))
    out = augment(points, train=True, generator=torch.Generator().manual_seed(0))
    # z stays
    assert torch.allclose(out[..., 2], points[..., 2]) and torch.allclose(out[..., 5], points[..., 5])
    assert torch.allclose(out[..., :2].norm(dim=-1), points[..., :2].norm(dim=-1), atol=1e-5)  # a turn
    assert not torch.allclose(out[..., :2], points[..., :2])
    assert torch.equal(augment(points, train=False), points)
    scaled = PointAugment(MeshAugment(scale=[2.0, 2.0]))(points, train=True)
    assert torch.allclose(scaled[..., :3], 2 * points[..., :3]) and torch.equal(scaled[..., 3:], points[..., 3:])
    turned = PointAugment(MeshAugment(rotate="any"))(points, train=True)
    assert torch.allclose(turned[..., :3].norm(dim=-1), points[..., :3].norm(dim=-1), atol=1e-5)
    gram = turned[0, :, :3].T @ turned[0, :, :3]  # a rotation keeps the points' Gram matrix's spectrum
    assert torch.allclose(
        torch.linalg.eigvalsh(gram), torch.linalg.eigvalsh(points[0, :, :3].T @ points[0, :, :3]), rtol=1e-4
    )
    assert torch.equal(PointAugment(None)(points, train=True), points)  # data.augment=null: none
    with pytest.raises(UserError, match="up_axis"):
        PointAugment(MeshAugment(up_axis="w"))
    with pytest.raises(UserError, match="data.augment.scale"):
        PointAugment(MeshAugment(scale=[2.0, 1.0]))


def test_pointnet_ignores_the_order_of_points():
    from onn.models.zoo.pointnet import PointNet

    torch.manual_seed(0)
    model = PointNet(in_channels=3, num_classes=5, widths=(16, 32), hidden=(16,)).eval()
    points = torch.randn(2, 50, 3)
    shuffled = points[:, torch.randperm(50)]
    assert torch.allclose(model(points), model(shuffled), atol=1e-6)


def test_data_auto_recognises_meshes_and_the_recipe_plans(shapes):
    from onn.modalities import detect, get

    modality, reason = detect(shapes)
    assert modality.name == "mesh" and "36 mesh files" in reason
    assert detect("builtin:primitives")[0].name == "mesh"
    cfg = compose("recipe=mesh_primitives", "hardware=cpu_16gb")
    assert cfg.data.modality == "mesh" and cfg.data.source == "builtin:primitives"
    plan, spec = get("mesh").plan(cfg, resolve(cfg.hardware, "/tmp", "/tmp"))
    assert plan.strategy == "full" and spec.n_blocks == 3 and spec.sample_flops > 0


def run(tmp: Path, *overrides: str, name: str = "run") -> tuple[dict, Path]:
    from onn.app import execute

    cfg = compose(
        *("model=pointnet", "data=mesh", "tracking=none", "trainer.enable_progress_bar=false"),
        *(f"paths.outputs={tmp / 'outputs'}", f"paths.cache={tmp / 'cache'}", "strategy.precision=32-true"),
        *("trainer.max_steps=-1", "trainer.val_check_interval=1.0", "optim.warmup_steps=0", "optim.lr=5e-3"),
        *("data.points=128", "data.align=pca", "data.batch_size=8"),
        "model.kwargs={widths: [64, 128], hidden: [64], dropout: 0.0, pooling: [max, mean]}",
        "data.augment={rotate: none, scale: [0.9, 1.1], jitter: 0.01}",
        *overrides,
    )
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return execute(cfg, run_dir), run_dir


@pytest.mark.modalities
@pytest.mark.slow
def test_train_infer_and_onnx_on_generated_primitives(tmp_path):
    data = write_primitives(tmp_path / "shapes", per_class=12, seed=0)
    test = write_primitives(tmp_path / "held_out", per_class=3, seed=1)
    metrics, run_dir = run(
        tmp_path,
        f"data.source={data}",
        f"data.test_source={test}",
        "trainer.max_epochs=10",
        "task.monitor=val/loss",
        "export=onnx",
        "data.max_bad_fraction=0.1",
    )
    assert metrics["modality"] == "mesh" and metrics["resident"] is True and metrics["items_skipped"] == 0
    assert metrics["train/loss_final"] < metrics["train/loss_initial"]
    assert metrics["test/acc"] > 2 / 6  # chance is 1/6
    assert metrics["export/max_abs_diff"] < 1e-4 and Path(metrics["export/onnx"]).is_file()

    import onnxruntime as ort

    session = ort.InferenceSession(metrics["export/onnx"], providers=["CPUExecutionProvider"])
    points = torch.randn(3, 128, 3)
    (logits,) = session.run(None, {session.get_inputs()[0].name: points.numpy()})
    assert logits.shape == (3, 6)

    (test / "box" / "broken.ply").write_bytes(b"ply\nformat ascii 1.0\nelement vertex 0\nend_header\n")
    # the checkpoint's data settings come with it (data.max_bad_fraction=0.1): one broken file of 19 is a counted skip
    out, _ = run(tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={test}", name="infer")
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert len(rows) == 18 and out["infer/items_skipped"] == 1 and {r["true"] for r in rows} == set(CLASSES)
    assert all(r["predicted"] in CLASSES and len(r["top5"]) == 5 for r in rows)
    from PIL import Image

    picture = np.asarray(Image.open(out["infer/picture"]))
    assert picture.shape[1] >= 96 * 8 and picture.std() > 10  # drawn point clouds, not a blank canvas


@pytest.fixture(scope="module")
def mesh_ckpt(tmp_path_factory) -> tuple[Path, Path]:
    """(five classes of primitives, a checkpoint of three epochs of a small PointNet on them: 64 points turned onto
    their principal axes, under bf16 autocast, planned for a named machine)."""
    import shutil

    tmp = tmp_path_factory.mktemp("mesh_ckpt")
    data = write_primitives(tmp / "shapes", per_class=4, seed=0)
    shutil.rmtree(data / "torus")  # five classes: every class is in a prediction's top 5 (infer's loss below)
    _, run_dir = run(
        tmp,
        f"data.source={data}",
        *("data.points=64", "trainer.max_epochs=30", "strategy.precision=bf16-mixed", "hardware=cpu_16gb"),
    )
    return data, run_dir / "checkpoints" / "last.ckpt"


def infer_rows(tmp: Path, *overrides: str, name: str) -> tuple[dict, list[dict]]:
    out, _ = run(tmp, "task=infer", "hardware=cpu_16gb", *overrides, name=name)
    return out, [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]


def test_eval_and_infer_sample_points_as_the_checkpoint_was_trained(mesh_ckpt, tmp_path, caplog):
    """`data=mesh` with ckpt= brought that config's 1024 points and no alignment (infer/acc 0.889 -> 0.528), and
    infer took the sampling seed from the command line (seed=1 moved every probability): the checkpoint's points,
    alignment and seed are used, and a difference is said."""
    from onn.app import execute, given_keys

    data, ckpt = mesh_ckpt
    _, own = infer_rows(tmp_path, f"ckpt={ckpt}", f"task.input={data}", name="own")
    _, named = infer_rows(tmp_path, f"ckpt={ckpt}", f"task.input={data}", "data=mesh", "seed=1", name="named")
    assert named == own
    given = [f"data.source={data}"]
    common = ("tracking=none", "hardware=cpu_16gb", f"paths.outputs={tmp_path}", f"paths.cache={tmp_path / 'cache'}")
    scored = execute(compose(*common, "task=eval", f"ckpt={ckpt}", *given), tmp_path / "e1", given_keys(given))
    with caplog.at_level(logging.WARNING, logger="onn"):
        given = ["data=mesh", f"data.source={data}"]
        again = execute(compose(*common, "task=eval", f"ckpt={ckpt}", *given), tmp_path / "e2", given_keys(given))
    assert again["val/loss"] == pytest.approx(scored["val/loss"], abs=1e-6)
    assert "as its model was trained (data.points=64, data.align=pca, seed 0)" in caplog.text


def test_infer_runs_the_network_as_eval_does(mesh_ckpt, tmp_path):
    """task=infer ran the network in float32 where task=eval ran it under the plan's bf16 autocast: one of 36 shapes
    went the other way between the two. Infer's probabilities now give eval's loss and accuracy on the same files:
    both run under evaluation_autocast, in batches of the same size, on points sampled with the checkpoint's seed,
    and name the earlier class of a tie of bf16 logits (test_infer_names_a_tied_class_as_eval_counts_it)."""
    from onn.app import execute, given_keys

    data, ckpt = mesh_ckpt
    out, rows = infer_rows(tmp_path, f"ckpt={ckpt}", f"task.input={data}", name="infer")
    given = [f"data.source={data}"]
    common = ("tracking=none", "hardware=cpu_16gb", f"paths.outputs={tmp_path}", f"paths.cache={tmp_path / 'cache'}")
    scored = execute(compose(*common, "task=eval", f"ckpt={ckpt}", *given), tmp_path / "eval", given_keys(given))
    assert scored["strategy"] == "full" and out["infer/acc"] == scored["val/acc"]
    loss = float(np.mean([-math.log(dict(r["top5"])[r["true"]]) for r in rows]))
    assert loss == pytest.approx(scored["val/loss"], abs=2e-4)


def test_infer_names_a_tied_class_as_eval_counts_it(mesh_ckpt, tmp_path):
    """Under bf16 autocast two classes' logits often round to one value (on an AMD EPYC one capsule came out
    0.29187 capsule, 0.29187 box). Infer named the class torch.topk put first (capsule) where eval's accuracy,
    torchmetrics' argmax, counted the earlier class (box): infer/acc 0.95, val/acc 0.90. Here the head's capsule row
    is a copy of its box row, so every shape ties the two: infer names box, lists box before capsule, and its
    accuracy is eval's. Whether a close call rounds to a tie depends on the CPU's bf16 kernels; this tie does not."""
    import shutil

    from safetensors.torch import load_file, save_file

    from onn.app import execute, given_keys

    data, ckpt = mesh_ckpt
    tied = tmp_path / "tied.ckpt"
    shutil.copytree(ckpt, tied)
    tensors = load_file(tied / "model.safetensors")
    for name in ("weight", "bias"):
        head = tensors[f"/state_dict/model.head.{name}"]
        head[1] = head[0]  # the checkpoint's classes: box, capsule, cone, cylinder, sphere
    save_file(tensors, tied / "model.safetensors")
    out, rows = infer_rows(tmp_path, f"ckpt={tied}", f"task.input={data}", name="infer")
    for row in rows:
        names, probs = zip(*row["top5"])
        assert probs[names.index("box")] == probs[names.index("capsule")]  # the tie the copy makes
        assert names.index("box") < names.index("capsule") and row["predicted"] != "capsule"
    given = [f"data.source={data}"]
    common = ("tracking=none", "hardware=cpu_16gb", f"paths.outputs={tmp_path}", f"paths.cache={tmp_path / 'cache'}")
    scored = execute(compose(*common, "task=eval", f"ckpt={tied}", *given), tmp_path / "eval", given_keys(given))
    assert out["infer/acc"] == scored["val/acc"]


@pytest.mark.skipif(not MESHES.is_dir(), reason="../shared/data/meshes/trimesh is not here")
def test_the_hundred_real_files_load_or_are_skipped_with_a_reason():
    files = sorted(p for p in MESHES.iterdir() if p.suffix.lower() != ".md")
    assert len(files) == 100
    found = read_source(MESHES, SETTINGS, max_bad_fraction=0.1, allow_unlabelled=True)
    (split,) = found.values()
    assert len(split.names) + len(split.skipped) == 100
    reasons = dict(s.split(": ", 1) for s in split.skipped)
    assert sorted(reasons) == ["empty.obj", "empty.ply", "empty.stl", "empty_nodes.glb", "face_in_group_name.obj"]
    assert all("no geometry" in why for name, why in reasons.items() if name.startswith("empty"))
    assert reasons["face_in_group_name.obj"] == "has no extent (all its points coincide)"  # one vertex
    assert torch.isfinite(split.inputs).all() and split.inputs.shape == (95, 64, 3)


@pytest.mark.slow
def test_a_checkpoint_an_earlier_onn_wrote_still_evaluates(tmp_path):
    """tests/data/mesh_b6b1dee.ckpt was written by commit b6b1dee (a one-epoch PointNet on builtin:primitives,
    test/acc 0.26, test/loss 1.7817), whose saved config has `model.layer_map: null` and no
    `data.batch_groups`: today's config types read it through checkpoints.in_todays_form."""
    from onn.app import execute

    ckpt = Path(__file__).parent / "data" / "mesh_b6b1dee.ckpt"
    cfg = compose(
        "task=eval", f"ckpt={ckpt}", "tracking=none", f"paths.outputs={tmp_path}", "trainer.enable_progress_bar=false"
    )
    metrics = execute(cfg, tmp_path / "eval")
    assert metrics["test/loss"] == pytest.approx(1.7817, abs=1e-3)


def test_data_auto_takes_textured_objs_for_meshes_not_pictures(tmp_path):
    """Shapes as .obj + .mtl + texture .png (a common export) were a third meshes, and data=auto read the folder
    as paired data: a mesh's material and textures beside it are its parts."""
    from PIL import Image

    from onn.modalities import detect

    cube = "v 0 0 0\nv 1 0 0\nv 0 1 0\nv 0 0 1\nvt 0 0\nf 1 2 3\nf 1 2 4\nf 1 3 4\nf 2 3 4\n"
    for shape in ("chair", "table"):
        for i in range(4):
            folder = tmp_path / shape
            folder.mkdir(exist_ok=True)
            (folder / f"{i}.obj").write_text(f"mtllib {i}.mtl\n{cube}")
            (folder / f"{i}.mtl").write_text(f"newmtl m\nmap_Kd texture_{i}.png\n")
            Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(folder / f"texture_{i}.png")
    modality, reason = detect(tmp_path)
    assert modality.name == "mesh" and "8 mesh files (.obj)" in reason
