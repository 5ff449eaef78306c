"""3D meshes: classification of shapes from OBJ, PLY, STL, OFF, glTF files (and point clouds) via trimesh.

The mesh modality: class folders (or an archive of them) of mesh files, or generated
primitives (`builtin:primitives`), sampled once into normalised point sets (onn/modalities/mesh/read.py)
and held on the device; rotation, scaling and jitter on the device (augment.py); ONN's PointNet
(onn/models/zoo/pointnet.py); predictions drawn as rendered point clouds (render.py).
"""

from __future__ import annotations

import logging
import posixpath
from pathlib import Path
from typing import Any

from onn.config import ONNConfig, as_dict
from onn.config.data import MeshData
from onn.config.model import NetworkConfig
from onn.data.files import first_names
from onn.errors import UserError
from onn.modalities.base import ClassifierModality, RunConfig

log = logging.getLogger("onn")
SNIFF_FILES = 2000  # file names looked at when deciding whether a folder holds meshes
DATA_KWARGS = ("in_channels", "num_classes", "num_points")
POINT_NETWORKS = ("zoo:pointnet",)  # the zoo's networks that take [batch, points, channels]


# A mesh's own files beside it in its folder: a textured OBJ's material and pictures, a glTF's buffers, and
# ShapeNet's per-shape metadata and voxel forms (models/model_normalized.{obj,mtl,json,solid.binvox})
TEXTURES = (".png", ".jpg", ".jpeg", ".tga", ".bmp", ".tif", ".tiff")
SIDECARS = (".mtl", ".bin", ".json", ".binvox", *TEXTURES)
# Folders of textures beside a mesh's folder (ShapeNet: MODEL/models/*.obj and MODEL/images/*.jpg)
TEXTURE_FOLDERS = ("images", "textures", "texture", "materials")


def mostly_meshes(names: list[str], meshes: list[str]) -> bool:
    """Two or more meshes, and at least half of the files that are not their sidecars (SIDECARS in a folder that
    holds a mesh, TEXTURES in a texture folder beside it: shapes of .obj + .mtl + .png are meshes, not pictures
    with captions, and ShapeNet's shapes with their textures are meshes, not a picture folder)."""
    folders = {posixpath.dirname(n) for n in meshes}
    shapes = {posixpath.dirname(f) for f in folders}
    others = [n for n in names if n not in meshes]
    return len(meshes) >= 2 and len(meshes) * 2 >= len(names) - sum(_sidecar(n, folders, shapes) for n in others)


def _sidecar(name: str, folders: set[str], shapes: set[str]) -> bool:
    """Whether `name` is a mesh's own file: a sidecar in a mesh's folder, or a texture in a texture folder beside it."""
    folder, suffix = posixpath.dirname(name), posixpath.splitext(name)[1].lower()
    if folder in folders:
        return suffix in SIDECARS
    beside = posixpath.basename(folder).lower() in TEXTURE_FOLDERS and posixpath.dirname(folder) in shapes
    return beside and suffix in TEXTURES


def saved_sampling(inputs: dict[str, Any], data: dict[str, Any], seed: int):
    """The Sampling of a model's `inputs` (points and normals from its input shape, its align); a checkpoint written
    before `inputs` kept the alignment has it in its data config (`data`)."""
    from onn.modalities.mesh.read import Sampling

    points, channels = inputs["input_shape"]
    return Sampling(int(points), int(channels) == 6, seed, str(inputs.get("align") or data.get("align") or "none"))


def _described(settings) -> str:
    normals = ", normals" if settings.normals else ""
    return f"data.points={settings.points}{normals}, data.align={settings.align}, seed {settings.seed}"


class MeshModality(ClassifierModality):
    name = "mesh"
    data_schema = MeshData
    default_data = "mesh"
    default_model = "pointnet"
    description = "3D shape classification (meshes and point clouds)"
    builtins = ("primitives",)
    stored_dtype = "float32"
    sniff_priority = (
        1  # file extensions say it: asked before the image sniffer (a textured mesh's pictures are its parts)
    )

    def reader_version(self) -> int:
        from onn.modalities.mesh.dataset import READER_VERSION

        return READER_VERSION

    def sniff(self, path: Path) -> str | None:
        from onn.modalities.mesh.primitives import BUILTIN
        from onn.modalities.mesh.read import MESH_SUFFIXES, is_mesh_name

        if str(path) == BUILTIN:
            return "generated 3D primitives"
        if path.is_file():
            return f"a 3D file ({path.suffix.lower()})" if is_mesh_name(path.name) else self._archive(path)
        names = first_names(path, SNIFF_FILES)
        meshes = [n for n in names if is_mesh_name(n)]
        if mostly_meshes(names, meshes):
            kinds = sorted({Path(n).suffix.lower() for n in meshes}, key=MESH_SUFFIXES.index)
            return f"{len(meshes)}{'+' if len(names) >= SNIFF_FILES else ''} mesh files ({', '.join(kinds)})"
        return None

    def _archive(self, path: Path) -> str | None:
        from onn.data.files import ARCHIVE_ERRORS, archive_kind, iter_members
        from onn.modalities.mesh.read import is_mesh_name

        kind = archive_kind(path)
        if kind not in ("zip", "tar"):  # a compressed tar is read front to back: too slow to sniff
            return None
        try:
            names = [m.name or m.raw for _, m in zip(range(SNIFF_FILES), iter_members(path, kind))]
        except ARCHIVE_ERRORS:
            return None
        meshes = [n for n in names if is_mesh_name(n)]
        return f"an archive of {len(meshes)} mesh files" if mostly_meshes(names, meshes) else None

    def check(self, config: ONNConfig) -> None:
        from onn.modalities.mesh.augment import PointAugment
        from onn.modalities.mesh.read import sampling

        data: MeshData = config.data
        model: NetworkConfig = config.model
        sampling(data)
        PointAugment(data.augment)
        bad = data.max_bad_fraction
        if isinstance(bad, bool) or not isinstance(bad, int | float) or not 0 <= bad <= 1:
            raise UserError(f"data.max_bad_fraction={bad!r}: give a fraction between 0 and 1.")
        source = str(model.source or "")
        if source not in POINT_NETWORKS:
            raise UserError(
                f"model={model.name} (source {source or 'empty'}) is not a point-cloud network: use "
                "model=pointnet (or model.source=zoo:pointnet) with mesh data, or data=graph to read the meshes as "
                "graphs for a graph network (model=gcn, graphsage, gin or gat)."
            )
        given = [k for k in model.kwargs or {} if k in DATA_KWARGS]
        if given:
            raise UserError(
                f"model.kwargs.{given[0]} is set by ONN from the data (points, channels, classes); remove it."
            )

    def datamodule(self, config: ONNConfig, device: str):
        from onn.modalities.mesh.dataset import MeshDataModule

        dm = MeshDataModule(config.data, config.paths.cache, device, seed=int(config.seed))
        dm.sampling = self._trained_sampling(config)
        return dm

    def _trained_sampling(self, config: ONNConfig):
        """With ckpt=, the sampling its model was trained on (points, normals, align, seed), said where the data
        config's differs (`data=mesh` brings the defaults': 1024 points, no alignment); None without one."""
        from onn.modalities.mesh.read import sampling
        from onn.training.classifier import trained_config

        saved = trained_config(config)
        if saved is None:
            return None
        trained = saved_sampling(saved["inputs"], saved["data"], int(saved["inputs"].get("seed", config.seed)))
        given = sampling(config.data, int(config.seed))
        if given != trained:
            log.warning(
                "ckpt %s: sampling the points as its model was trained (%s), not as the data config says (%s)",
                config.ckpt,
                _described(trained),
                _described(given),
            )
        return trained

    def network(self, model_cfg: NetworkConfig, inputs: dict[str, Any]):
        from onn.models.zoo.registry import build_zoo

        points, channels = inputs["input_shape"]
        name = str(model_cfg.source).partition(":")[2]
        try:
            network = build_zoo(
                name,
                in_channels=channels,
                num_classes=len(inputs["classes"]),
                num_points=points,
                **(model_cfg.kwargs or {}),
            )
        except TypeError as e:  # an unknown or misspelled model.kwargs entry
            raise UserError(f"model.kwargs does not fit {model_cfg.source}: {e}; fix or remove that key.") from e
        if model_cfg.weights:
            from onn.models.vision import load_weights

            load_weights(network, model_cfg.weights)
        return network

    def transform(self, config: RunConfig, inputs: dict[str, Any]):
        from onn.modalities.mesh.augment import PointAugment

        return PointAugment(config.data.augment)

    def input_stats(self, config: ONNConfig, dm) -> dict[str, Any]:
        """data.align, saved in `inputs`: infer and eval turn the shapes as training did."""
        return {"align": (dm.sampling.align if dm.sampling is not None else str(config.data.align))}

    def planned_inputs(self, config: RunConfig) -> dict[str, Any]:
        from onn.modalities.mesh.primitives import BUILTIN, CLASSES
        from onn.modalities.mesh.read import sampling
        from onn.training.classifier import trained_config

        saved = trained_config(config)
        if saved is not None:  # the checkpoint's network: what eval, infer and a resumed run build
            return saved["inputs"]
        data: MeshData = config.data
        settings = sampling(data)
        if data.classes:
            classes = [str(c) for c in data.classes]
        elif isinstance(data.num_classes, int):
            classes = [str(i) for i in range(data.num_classes)]
        else:
            classes = list(CLASSES) if data.source == BUILTIN else [str(i) for i in range(10)]
        return {"classes": classes, "input_shape": [settings.points, settings.channels], "align": settings.align}

    def read_inputs(self, source: Path, inputs: dict[str, Any], config: RunConfig):
        """task.input sampled as the model's training data was: its points, normals, alignment and seed."""
        from onn.modalities.mesh.read import read_source
        from onn.training.classifier import trained_config

        data: MeshData = config.data
        saved = trained_config(config) if "align" not in inputs else None  # a checkpoint from before `align` was kept
        settings = saved_sampling(
            inputs, saved["data"] if saved else as_dict(data), int(inputs.get("seed", config.seed))
        )
        return read_source(
            source, settings, max_bad_fraction=float(data.max_bad_fraction), allow_unlabelled=True, key="task.input"
        )

    def picture(self, samples, predicted, true, path: Path, inputs: dict[str, Any]) -> None:
        from onn.modalities.mesh.render import write_picture

        write_picture(samples, predicted, true, path)
