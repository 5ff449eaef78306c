"""The mesh reader on inputs a review found it wrong on: mirrored scene parts, depth scans with NaN points,
ShapeNet's folder layout under data=auto, and the real files of ../shared/data/meshes/trimesh in class folders."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import MODALITY_HARDWARE, SHARED_DATA, compose

from onn.modalities.mesh.read import MeshError, Sampling, decode, read_source

MESHES = SHARED_DATA / "meshes" / "trimesh"


def _outward(points: np.ndarray) -> float:
    """The fraction of points whose normal points away from the centre (every one, for a closed convex shape)."""
    return float(((points[:, :3] * points[:, 3:]).sum(axis=1) > 0).mean())


def test_a_mirrored_scene_part_keeps_its_normals_outwards(tmp_path):
    """A glTF node that mirrors its mesh (a negative scale) moved the vertices but kept the faces' winding: every
    normal of that part pointed into the shape under data.normals=true."""
    import trimesh

    scene = trimesh.Scene()
    sphere = trimesh.creation.icosphere(subdivisions=2)
    scene.add_geometry(sphere, transform=np.diag([-1.0, 1.0, 1.0, 1.0]))
    (tmp_path / "mirrored.glb").write_bytes(scene.export(file_type="glb"))
    points = decode(tmp_path / "mirrored.glb", "mirrored.glb", Sampling(256, True))
    assert _outward(points) == 1.0


def _scan_ply(rows: list[str]) -> bytes:
    header = (
        "ply\nformat ascii 1.0\nelement vertex {}\nproperty float x\nproperty float y\nproperty float z\nend_header\n"
    )
    return (header.format(len(rows)) + "\n".join(rows) + "\n").encode()


def test_a_depth_scans_unmeasured_points_are_left_out(tmp_path):
    """A point cloud with NaN points (an organised depth scan's unmeasured pixels, as PCL and Open3D write them)
    was refused whole, so a folder of scans could not be read at all; its finite points are the shape."""
    angles = np.linspace(0, 2 * np.pi, 40, endpoint=False)
    rows = [f"{np.cos(a)} {np.sin(a)} {i % 3}" for i, a in enumerate(angles)] + ["nan nan nan"] * 10
    (tmp_path / "scan.ply").write_bytes(_scan_ply(rows))
    points = decode(tmp_path / "scan.ply", "scan.ply", Sampling(64, False))
    assert points.shape == (64, 3) and np.isfinite(points).all()
    assert np.linalg.norm(points, axis=1).max() == pytest.approx(1.0, abs=1e-5)
    (tmp_path / "blank.ply").write_bytes(_scan_ply(["nan nan nan"] * 5))
    with pytest.raises(MeshError, match=r"none of its 5 points is finite"):
        decode(tmp_path / "blank.ply", "blank.ply", Sampling(64, False))


def _shapenet(root: Path, mesh: Path) -> Path:
    """ShapeNetCore v2's layout: SYNSET/MODEL/models/model_normalized.{obj,mtl,json,*.binvox}, MODEL/images/*.jpg."""
    from PIL import Image

    for synset in ("02691156", "03001627"):
        for i in range(3):
            models = root / synset / f"model{i}" / "models"
            models.mkdir(parents=True)
            shutil.copy(mesh, models / "model_normalized.obj")
            (models / "model_normalized.mtl").write_text("newmtl a\nmap_Kd ../images/texture0.jpg\n")
            (models / "model_normalized.json").write_text('{"id": "model"}')
            for form in ("solid", "surface"):
                (models / f"model_normalized.{form}.binvox").write_bytes(b"#binvox 1\ndim 2 2 2\n")
            images = root / synset / f"model{i}" / "images"
            images.mkdir()
            for k in range(2):
                Image.new("RGB", (8, 8), (40 * k, 0, 0)).save(images / f"texture{k}.jpg")
    return root


def test_data_auto_reads_a_shapenet_folder_as_meshes(tmp_path):
    """ShapeNet's shapes, each with its metadata, voxel forms and a folder of textures, were one file in six, and
    data=auto took the folder for pictures: an image classifier trained on the textures."""
    import trimesh

    from onn.modalities import detect

    cube = tmp_path / "cube.obj"
    cube.write_text(trimesh.exchange.obj.export_obj(trimesh.creation.box()))
    root = _shapenet(tmp_path / "ShapeNetCore.v2", cube)
    modality, reason = detect(root)
    assert modality.name == "mesh" and reason == "6 mesh files (.obj)"
    (found,) = read_source(root, Sampling(32, False), max_bad_fraction=0.0).values()
    assert found.classes == ["02691156", "03001627"] and found.labels.tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.skipif(not MESHES.is_dir(), reason="../shared/data/meshes/trimesh is not here")
@pytest.mark.slow
def test_infer_names_the_real_broken_files_and_predicts_the_rest(tmp_path):
    """Train on the real files in class folders (their file type), then infer on the flat folder of all 100: the
    five unusable ones are skipped and counted, every other file gets a prediction."""
    from onn.app import execute

    data = tmp_path / "data"
    for path in sorted(MESHES.iterdir()):
        if path.suffix.lower() in (".stl", ".obj", ".ply"):
            (data / path.suffix.lower()[1:]).mkdir(parents=True, exist_ok=True)
            os.symlink(path, data / path.suffix.lower()[1:] / path.name)
    common = (
        *("model=pointnet", "data=mesh", "tracking=none", "trainer.enable_progress_bar=false", MODALITY_HARDWARE),
        *(f"paths.outputs={tmp_path / 'outputs'}", f"paths.cache={tmp_path / 'cache'}", "strategy.precision=32-true"),
        *("data.points=64", "data.batch_size=8", "model.kwargs={widths: [16, 32], hidden: [16]}"),
    )
    trained = execute(compose(*common, f"data.source={data}", "trainer.max_epochs=1"), tmp_path / "run")
    assert trained["items_skipped"] == 4  # empty.obj, empty.ply, empty.stl, face_in_group_name.obj
    out = execute(compose(*common, "task=infer", f"ckpt={tmp_path / 'run'}", f"task.input={MESHES}"), tmp_path / "inf")
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert out["infer/items_skipped"] == 5 and len(rows) == 95
    assert {r["predicted"] for r in rows} <= {"obj", "ply", "stl"}
