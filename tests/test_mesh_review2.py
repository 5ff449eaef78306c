"""The mesh reader and PointNet on inputs a second review found them wrong on: OBJ relative indices across objects,
a glTF part whose faces point into the next part, faces flat up to the files' rounding, shapes drawn in small units,
point clouds of huge coordinates, and `pooling: mean` in model.kwargs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA

from onn.modalities.mesh.read import MeshError, Sampling, decode, load_geometry, sample_points

MESHES = SHARED_DATA / "meshes" / "trimesh"


def test_obj_relative_indices_count_back_from_the_vertices_read_so_far(tmp_path):
    """`f -3 -2 -1` in each of two objects (as streaming OBJ writers put them) is each object's own triangle; trimesh
    counted back from the file's last vertex, so both faces were the second object's and the first one vanished."""
    rows = ["o left", "v 0 0 0", "v 1 0 0", "v 0 1 0", "f -3 -2 -1"]
    rows += ["o right", "v 10 0 0", "v 11 0 0", "v 10 1 0", "vt 0 0", "f -3/-1 -2/-1 -1/-1"]
    (tmp_path / "two.obj").write_text("\n".join(rows) + "\n")
    vertices, faces = load_geometry(tmp_path / "two.obj", ".obj")
    corners = {tuple(c) for c in vertices[faces].reshape(-1, 3).tolist()}
    assert corners == {(0, 0, 0), (1, 0, 0), (0, 1, 0), (10, 0, 0), (11, 0, 0), (10, 1, 0)}
    points = decode(tmp_path / "two.obj", "two.obj", Sampling(256, False))
    assert (points[:, 0] < -0.5).sum() > 64 and (points[:, 0] > 0.5).sum() > 64  # both triangles
    (tmp_path / "short.obj").write_text("v 0 0 0\nv 1 0 0\nv 0 1 0\nf -1 -2 -7\n")
    with pytest.raises(MeshError, match=r"line 4: a face refers to v -7, with only 3 before it"):
        load_geometry(tmp_path / "short.obj", ".obj")
    if MESHES.is_dir():  # trimesh's own file of negative indices (one object, every vertex first) is still its cube
        xyz = decode(MESHES / "negative_indices.obj", "negative_indices.obj", Sampling(512, False))
        assert np.ptp(np.abs(xyz - (xyz.min(axis=0) + xyz.max(axis=0)) / 2).max(axis=1)) < 1e-5


def test_a_scene_part_whose_faces_point_past_its_vertices_is_refused(tmp_path):
    """A damaged glTF part's index past its own vertices landed on the next part's, after concatenation: a made-up
    triangle between the two, read without a word."""
    import trimesh

    broken = trimesh.Trimesh([[0, 0, 0], [1, 0, 0], [0, 1, 0]], [[0, 1, 5]], process=False, validate=False)
    whole = trimesh.Trimesh([[5, 5, 5], [6, 5, 5], [5, 6, 5]], [[0, 1, 2]], process=False, validate=False)
    scene = trimesh.Scene()
    scene.add_geometry(broken, node_name="a", geom_name="a")
    scene.add_geometry(whole, node_name="b", geom_name="b")
    (tmp_path / "parts.glb").write_bytes(scene.export(file_type="glb"))
    with pytest.raises(MeshError, match=r"faces point past one part's 3 vertices"):
        load_geometry(tmp_path / "parts.glb", ".glb")


@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_a_mesh_whose_faces_are_flat_up_to_rounding_is_refused(tmp_path, offset):
    """Collinear corners written as decimals are not exactly collinear: a mesh of only such faces has an area of
    1e-17, not 0, and was sampled as a line of points with zero or made-up normals."""
    rows = [f"v {offset + 0.1 * k} {0.2 * k} {0.3 * k}" for k in (0, 1, 3, 7)] + ["f 1 2 3", "f 1 3 4", "f 2 3 4"]
    (tmp_path / "line.obj").write_text("\n".join(rows) + "\n")
    with pytest.raises(MeshError, match=r"has zero surface area \(every face is degenerate\)"):
        decode(tmp_path / "line.obj", "line.obj", Sampling(64, True))


def test_normals_point_outwards_at_any_scale(tmp_path):
    """trimesh's face normals are zeros below an absolute area (1e-13): a shape drawn in small units (a part in
    metres of a tenth of a micron, a molecule's surface) had data.normals all zeros."""
    import trimesh

    for scale in (1e-7, 1.0, 1e6):
        sphere = trimesh.creation.icosphere(subdivisions=2, radius=scale)
        (tmp_path / "ball.obj").write_text(trimesh.exchange.obj.export_obj(sphere, digits=20))
        points = decode(tmp_path / "ball.obj", "ball.obj", Sampling(256, True))
        assert np.allclose(np.linalg.norm(points[:, 3:], axis=1), 1.0, atol=1e-5), scale
        assert ((points[:, :3] * points[:, 3:]).sum(axis=1) > 0).all(), scale  # outwards


def _cloud_ply(points: np.ndarray) -> bytes:
    header = "ply\nformat ascii 1.0\nelement vertex {}\nproperty double x\nproperty double y\nproperty double z\n"
    rows = "".join(f"{x:.17g} {y:.17g} {z:.17g}\n" for x, y, z in points)
    return (header.format(len(points)) + "end_header\n" + rows).encode()


@pytest.mark.parametrize("align", ["none", "pca"])
def test_a_point_cloud_of_huge_coordinates_keeps_its_shape(tmp_path, align):
    """A cloud at 1e200 became 64 points at the origin (its radius overflowed to inf and divided everything to 0),
    or, turned onto its principal axes, a LinAlgError traceback (its covariance was inf)."""
    cloud = np.random.default_rng(0).normal(size=(50, 3)) * [3.0, 2.0, 1.0]
    names = ("huge.ply", "unit.ply")
    for name, factor in zip(names, (1e200, 1.0)):
        (tmp_path / name).write_bytes(_cloud_ply(cloud * factor))
    settings = Sampling(64, False, 0, align)
    huge, unit = (sample_points(*load_geometry(tmp_path / name, ".ply"), settings, "one seed") for name in names)
    assert np.isfinite(huge).all() and np.allclose(huge, unit, atol=1e-6)  # the same points, the same shape
    assert np.linalg.norm(huge, axis=1).max() == pytest.approx(1.0, abs=1e-6)


def test_pointnet_takes_one_pooling_named_as_a_word():
    """model.kwargs={pooling: mean} was refused as "pooling ['m', 'e', 'a', 'n'] must name one or more of max,
    mean": the word was read as its letters."""
    from onn.models.zoo.registry import build_zoo

    torch.manual_seed(0)
    model = build_zoo("pointnet", in_channels=3, num_classes=4, num_points=32, widths=[8], hidden=[], pooling="mean")
    points = torch.randn(2, 32, 3)
    model.eval()
    features = model.features(points.transpose(1, 2))
    assert torch.allclose(model(points), model.head(features.mean(dim=2)))
