"""Mesh datasets for Lightning: sampled once into point sets, cached as safetensors, held on the device.

A source (class folders of mesh files, an archive of them, or `builtin:primitives`) is decoded once
by onn.modalities.mesh.read into float32 [N, points, 3|6] tensors, cached under paths.cache/meshes
(onn.data.cache: keyed by the source's content and the sampling settings) and moved to the compute
device whole (onn.data.resident). Rotation, scaling and jitter run on the batch, on the device
(onn.modalities.mesh.augment).
"""

from __future__ import annotations

import os
from pathlib import Path

from onn.config import as_dict
from onn.config.data import MeshData
from onn.data.cache import cached_decode
from onn.data.files import content_digest, existing_source
from onn.data.resident import ClassificationData, Decoded
from onn.errors import UserError
from onn.modalities.mesh.primitives import BUILTIN, builtin_splits
from onn.modalities.mesh.read import HELP, Sampling, read_source, sampling

# 3: mirrored scene parts' normals point outwards, a point cloud's NaN points are dropped; 4: an OBJ's relative
# indices count back from the vertices before them, not from the file's end; 5: binary PLYs and OFFs of mixed polygon
# sizes, OBJs with a byte-order mark or tabs are read, where they were skipped; 6: such a PLY whose bytes add up to its
# first face's size is read by its corner counts, where trimesh read wrong faces: caches of before are stale; 7:
# class folders named by numbers sort as numbers (0, 1, 2, ..., 10), where the cache held their text order
READER_VERSION = 7


def read_cached(
    source: str,
    data_cfg: MeshData,
    cache_dir: str | os.PathLike,
    seed: int,
    key: str = "data.source",
    allow_unlabelled: bool = False,
    settings: Sampling | None = None,
) -> dict[str, Decoded]:
    """{split: Decoded} for a source, sampled once and then read from the safetensors cache. `settings`: how to
    sample (a checkpoint's), in place of the data config's."""
    settings = settings or sampling(data_cfg, seed)
    bad = float(data_cfg.max_bad_fraction)
    if source == BUILTIN:
        builtin = data_cfg.builtin
        if builtin is None:
            raise UserError(f"data.source={BUILTIN} needs data.builtin: {{per_class: N, test_per_class: N}}.")
        return cached_decode(
            "meshes",
            {"builtin": as_dict(builtin), "settings": settings.__dict__},
            cache_dir,
            lambda: builtin_splits(builtin, settings, seed),
            source,
        )
    path = existing_source(Path(source).expanduser(), key, HELP)
    digest = {
        "reader": READER_VERSION,
        "digest": content_digest(path),
        "settings": settings.__dict__,
        "unlabelled": allow_unlabelled,
        "max_bad_fraction": bad,  # a cache filled under a looser limit must not pass a stricter one
    }
    return cached_decode(
        "meshes",
        digest,
        cache_dir,
        lambda: read_source(path, settings, max_bad_fraction=bad, allow_unlabelled=allow_unlabelled, key=key),
        str(path),
    )


class MeshDataModule(ClassificationData):
    """train / val / test splits of a mesh dataset, resident on the device."""

    cfg: MeshData
    same_shape_hint = "give every split the same data.points and data.normals"
    sampling: Sampling | None = None  # a checkpoint's (MeshModality.datamodule), in place of the data config's

    def read(self, source: str, key: str) -> dict[str, Decoded]:
        return read_cached(source, self.cfg, self.cache_dir, self.seed, key, settings=self.sampling)
