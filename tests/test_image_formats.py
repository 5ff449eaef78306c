"""Image-classification formats: every raw format round-trips exact pixels and labels, with clear errors."""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import pickle
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from onn.errors import UserError
from onn.modalities.image.formats import FORMATS, detect_format, list_items, read_splits, source_digest

RNG = np.random.default_rng(0)
CLASSES = ["cat", "dog", "emu"]


def rgb(h=8, w=8, channels=3):
    return RNG.integers(0, 256, (h, w, channels) if channels > 1 else (h, w), dtype=np.uint8)


def encode(arr, fmt="PNG", **kw) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **kw)
    return buf.getvalue()


def chw(arr) -> torch.Tensor:
    return torch.from_numpy(np.array(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)))


def tree(prefix="", classes=CLASSES, per=4, **kw) -> dict[str, np.ndarray]:
    """{relative path: pixels} for PREFIX/CLASS/NNNN.png."""
    return {f"{prefix}{c}/{i:04d}.png": rgb(**kw) for c in classes for i in range(per)}


def write_tree(root: Path, files: dict[str, np.ndarray | bytes]) -> Path:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else encode(data))
    return root


def write_archive(path: Path, files: dict[str, np.ndarray | bytes]) -> Path:
    blobs = {k: v if isinstance(v, bytes) else encode(v) for k, v in files.items()}
    if path.suffix == ".zip":
        with zipfile.ZipFile(path, "w") as zf:
            for k, v in blobs.items():
                zf.writestr(k, v)
    else:
        with tarfile.open(path, "w:gz" if path.name.endswith((".tar.gz", ".tgz")) else "w") as tf:
            for k, v in blobs.items():
                info = tarfile.TarInfo(k)
                info.size = len(v)
                tf.addfile(info, io.BytesIO(v))
    return path


def assert_matches(s, files: dict[str, np.ndarray], strip: str = ""):
    """Every image of ImageSet `s` has exactly the pixels written, and the label of its class folder."""
    assert s.images.dtype == torch.uint8 and s.images.is_contiguous() and s.labels.dtype == torch.int64
    assert len(s.names) == len(s.images) == len(s.labels) > 0
    for name, img, label in zip(s.names, s.images, s.labels):
        assert torch.equal(img, chw(files[name])), name
        cls = name[len(strip) :].split("/")[-2]
        assert s.classes[label] == cls, name


# ---------------------------------------------------------------------------------------------------------
# folder and archive


def test_folder_of_class_folders_round_trips_pixels(tmp_path):
    files = tree()
    write_tree(tmp_path / "ds", files)
    noise = {".hidden/x.png": rgb(), "cat/.x.png": rgb(), "cat/notes.txt": b"hi", "cat/a.json": b"{}"}
    write_tree(tmp_path / "ds", noise)
    assert detect_format(tmp_path / "ds") == "folder"
    splits = read_splits(tmp_path / "ds")
    assert list(splits) == ["all"]
    s = splits["all"]
    assert s.classes == CLASSES and len(s.names) == 12 and s.skipped == []
    assert s.images.shape == (12, 3, 8, 8)
    assert_matches(s, files)
    assert s.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_split_folders_share_classes_and_val_alias(tmp_path):
    files = {
        **tree("train/", ["a", "b"]),
        **tree("validation/", ["a", "b"], per=2),
        **tree("test/", ["b"], 2),
    }
    write_tree(tmp_path, files)
    splits = read_splits(tmp_path)
    assert sorted(splits) == ["test", "train", "val"]
    for s in splits.values():
        assert s.classes == ["a", "b"]
        assert_matches(s, files)
    assert splits["test"].labels.tolist() == [1, 1]
    assert len(splits["train"].names) == 8 and len(splits["val"].names) == 4


def test_a_held_out_class_the_training_split_lacks_is_listed_and_named_when_training_starts(tmp_path):
    """test/automobil beside train/automobile became an 11th class that nothing trained on, without a word. The listing
    keeps it (task=eval scores a source by the checkpoint's classes, not by the source's own train/), and training
    names it when it starts, as for every modality (test_data_review3)."""
    write_tree(tmp_path, {**tree("train/", ["a", "b"], 2), **tree("test/", ["a", "bb"], 1)})
    for read in (read_splits, list_items):
        assert read(tmp_path)["test"].classes == ["a", "b", "bb"]


def test_a_class_folder_written_decomposed_is_the_class_typed_composed(tmp_path):
    """macOS writes "café" as "cafe" + a combining accent (NFD), in folders and in the zips it makes; a test split
    made elsewhere holds "café" composed (NFC). The two were two classes, and the held-out one refused."""
    import unicodedata

    nfd = unicodedata.normalize("NFD", "café")
    write_tree(tmp_path, {**tree("train/", [nfd, "thé"], 2), **tree("test/", ["café"], 1)})
    for read in (read_splits, list_items):
        splits = read(tmp_path)
        assert splits["train"].classes == ["café", "thé"] == splits["test"].classes
        assert unicodedata.is_normalized("NFC", splits["train"].classes[0])


@pytest.mark.parametrize(
    "name,prefix", [("ds.zip", ""), ("ds.tar", "./"), ("ds.tar.gz", "cifar10/"), ("ds.tgz", "wrap/")]
)
def test_archives_are_read_in_place_with_an_optional_wrapping_folder(tmp_path, name, prefix):
    files = {**tree(f"{prefix}train/"), **tree(f"{prefix}test/", per=2)}
    files[f"{prefix}train/readme.md"] = b"not an image"
    files[f"{prefix}__MACOSX/train/cat/._0000.png"] = b"resource fork"
    path = write_archive(tmp_path / name, files)
    assert detect_format(path) == "archive"
    splits = read_splits(path)
    assert sorted(splits) == ["test", "train"]
    clean = {k.removeprefix("./"): v for k, v in files.items() if k.endswith(".png")}
    assert_matches(splits["train"], clean, strip=prefix.removeprefix("./"))
    assert len(splits["train"].names) == 12 and len(splits["test"].names) == 6
    assert not list(tmp_path.glob("*/"))  # nothing unpacked next to the archive


def test_no_class_folders_is_an_error_unless_unlabelled(tmp_path):
    flat = {f"{i}.png": rgb() for i in range(3)}
    path = write_archive(tmp_path / "flat.zip", flat)
    with pytest.raises(UserError, match=r"no class folders in .*flat\.zip.*CLASS/IMAGE.*train/CLASS/IMAGE"):
        read_splits(path)
    s = read_splits(path, allow_unlabelled=True)["all"]
    assert s.labels.tolist() == [-1, -1, -1] and s.classes == []
    assert torch.equal(s.images[1], chw(flat["1.png"]))
    write_tree(tmp_path / "flat", flat)
    with pytest.raises(UserError, match="no class folders"):
        read_splits(tmp_path / "flat")


def test_split_folders_mixed_with_other_folders_are_refused(tmp_path):
    write_tree(tmp_path, {**tree("train/"), "samples/x/a.png": rgb()})
    with pytest.raises(UserError, match=r"mixes split folders \(train\) with other folders \(samples\)"):
        read_splits(tmp_path)


def test_a_class_named_like_a_split_beside_other_classes_is_a_class(tmp_path):
    """CIFAR-100 has a class `train`: cat/, tractor/ and train/ holding images were refused as split folders
    mixed with other folders."""
    files = tree(classes=["cat", "test", "train"], per=2)
    write_tree(tmp_path, files)
    s = read_splits(tmp_path)["all"]
    assert s.classes == ["cat", "test", "train"]
    assert_matches(s, files)


def test_task_input_of_one_class_folder_keeps_its_class(tmp_path):
    """task=infer of a folder holding only cat/ took cat/ for a wrapping folder: every row's true label was lost."""
    files = tree(classes=["cat"], per=2)
    write_tree(tmp_path, files)
    s = read_splits(tmp_path, allow_unlabelled=True, key="task.input")["all"]
    assert s.classes == ["cat"] and s.labels.tolist() == [0, 0]
    assert_matches(s, files)


# ---------------------------------------------------------------------------------------------------------
# channels, sizes, damaged files


def test_channels_auto_and_forced(tmp_path):
    from PIL import Image

    gray = tree(classes=["a", "b"], per=2, channels=1)
    write_tree(tmp_path / "g", gray)
    s = read_splits(tmp_path / "g")["all"]
    assert s.images.shape == (4, 1, 8, 8)
    assert_matches(s, gray)
    s3 = read_splits(tmp_path / "g", channels=3)["all"]
    assert s3.images.shape == (4, 3, 8, 8) and torch.equal(s3.images, s.images.repeat(1, 3, 1, 1))

    colour = tree(classes=["a", "b"], per=2)
    write_tree(tmp_path / "c", colour)
    s1 = read_splits(tmp_path / "c", channels=1)["all"]
    want = torch.stack([chw(np.asarray(Image.fromarray(colour[n]).convert("L"))) for n in s1.names])
    assert s1.images.shape == (4, 1, 8, 8) and torch.equal(s1.images, want)

    mixed = dict(gray)
    mixed["b/0001.png"] = rgb()  # the last image is colour: what came before is widened
    rgba = rgb(channels=4)
    rgba[..., 3] = 255  # opaque: transparency is laid on white (tests/test_imagecache.py)
    mixed["a/0002.png"] = rgba
    wide = np.array(2**16 - 1 - RNG.integers(0, 2**16, (8, 8)), dtype=np.uint16)
    write_tree(tmp_path / "m", mixed)
    Image.fromarray(wide).save(tmp_path / "m/a/0003.png")  # 16-bit gray
    s = read_splits(tmp_path / "m")["all"]
    assert s.images.shape == (6, 3, 8, 8)
    by = dict(zip(s.names, s.images))
    assert torch.equal(by["a/0000.png"], chw(gray["a/0000.png"]).repeat(3, 1, 1))
    assert torch.equal(by["b/0001.png"], chw(mixed["b/0001.png"]))
    assert torch.equal(by["a/0002.png"], chw(rgba[..., :3]))
    assert torch.equal(by["a/0003.png"][0], torch.from_numpy((wide >> 8).astype(np.uint8)))
    with pytest.raises(UserError, match="data.channels"):
        read_splits(tmp_path / "m", channels=2)


def test_mixed_sizes_error_then_resize_or_center_crop(tmp_path):
    from PIL import Image

    files = {"a/0.png": rgb(8, 8), "a/1.png": rgb(8, 16), "b/0.png": rgb(8, 8)}
    write_tree(tmp_path, files)
    with pytest.raises(UserError, match=r"a/0\.png is 8x8 but a/1\.png is 8x16.*data\.image_size=\[H,W\].*center_crop"):
        read_splits(tmp_path)
    s = read_splits(tmp_path, image_size=[8, 8], resize="center_crop")["all"]
    by = dict(zip(s.names, s.images))
    assert s.images.shape == (3, 3, 8, 8)
    assert torch.equal(by["a/1.png"], chw(files["a/1.png"][:, 4:12]))  # short side fits: a centre crop
    assert torch.equal(by["a/0.png"], chw(files["a/0.png"]))  # already that size: untouched
    s = read_splits(tmp_path, image_size=[6, 5], resize="resize")["all"]
    want = np.asarray(Image.fromarray(files["a/1.png"]).resize((5, 6), Image.Resampling.BILINEAR))
    assert s.images.shape == (3, 3, 6, 5) and torch.equal(dict(zip(s.names, s.images))["a/1.png"], chw(want))
    with pytest.raises(UserError, match=r"not data\.image_size=\[8,8\]; set data\.resize"):
        read_splits(tmp_path, image_size=[8, 8])
    same = tmp_path / "same"
    write_tree(same, {"a/0.png": files["a/0.png"], "b/0.png": files["b/0.png"]})
    assert torch.equal(read_splits(same, image_size=[8, 8])["all"].images[0], chw(files["a/0.png"]))


def test_corrupt_and_truncated_images_are_skipped_counted_and_warned(tmp_path, caplog, monkeypatch):
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)  # as some other library may leave it
    files = tree()
    jpeg = encode(rgb(64, 64), "JPEG", quality=95)
    write_tree(tmp_path, {**files, "cat/junk.png": b"\x89PNG not really", "dog/cut.jpg": jpeg[: len(jpeg) // 2]})
    with caplog.at_level(logging.WARNING, logger="onn"):
        s = read_splits(tmp_path, max_bad_fraction=0.2)["all"]
    assert len(s.names) == 12 and "cat/junk.png" not in s.names and "dog/cut.jpg" not in s.names
    assert sorted(x.split(":")[0] for x in s.skipped) == ["cat/junk.png", "dog/cut.jpg"]
    assert "truncated" in next(x for x in s.skipped if x.startswith("dog/cut.jpg"))
    assert_matches(s, files)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 of 14" in warnings[0].getMessage()
    assert "cat/junk.png" in warnings[0].getMessage()
    with pytest.raises(UserError, match=r"2 of 14 images could not be decoded.*data\.max_bad_fraction"):
        read_splits(tmp_path)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # put back as found


def test_labels_outside_num_classes_name_the_item(tmp_path):
    write_tree(tmp_path, tree())
    with pytest.raises(UserError, match=r"emu/0000\.png has label 'emu' \(class 2 of 3 names.*data\.num_classes is 2"):
        read_splits(tmp_path, num_classes=2)
    assert read_splits(tmp_path, num_classes=3)["all"].classes == CLASSES


# ---------------------------------------------------------------------------------------------------------
# idx (MNIST family)


def idx_bytes(arr: np.ndarray) -> bytes:
    magic = 0x0800 | arr.ndim
    return struct.pack(">I", magic) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.astype(np.uint8).tobytes()


def write_idx(folder: Path, prefix="", n=(6, 3), gz=True):
    folder.mkdir(parents=True, exist_ok=True)
    data = {}
    for split, count in zip(("train", "t10k"), n):
        x, y = RNG.integers(0, 256, (count, 5, 4), dtype=np.uint8), RNG.integers(0, 10, count, dtype=np.uint8)
        suffix = ".gz" if gz else ""
        for kind, arr in (("images-idx3", x), ("labels-idx1", y)):
            raw = idx_bytes(arr)
            (folder / f"{prefix}{split}-{kind}-ubyte{suffix}").write_bytes(gzip.compress(raw) if gz else raw)
        data[split] = (x, y)
    return data


@pytest.mark.parametrize("gz", [True, False])
def test_idx_folder_and_single_file(tmp_path, gz):
    data = write_idx(tmp_path / "mnist", gz=gz)
    assert detect_format(tmp_path / "mnist") == "idx"
    splits = read_splits(tmp_path / "mnist")
    assert sorted(splits) == ["test", "train"]
    for split, key in (("train", "train"), ("t10k", "test")):
        x, y = data[split]
        assert torch.equal(splits[key].images, torch.from_numpy(x[:, None]))
        assert splits[key].labels.tolist() == y.tolist()
    assert splits["train"].classes == [str(i) for i in range(int(max(y.max() for _, y in data.values())) + 1)]
    if not gz:  # the decoded set is a copy in memory, not a view of the file
        with open(tmp_path / "mnist/train-images-idx3-ubyte", "r+b") as f:
            f.seek(16)
            f.write(bytes(20))
        assert torch.equal(splits["train"].images, torch.from_numpy(data["train"][0][:, None]))
        splits["train"].images[0] += 1  # and writable
    one = tmp_path / "mnist" / f"t10k-images-idx3-ubyte{'.gz' if gz else ''}"
    assert detect_format(one) == "idx"
    s = read_splits(one, channels=3)
    assert list(s) == ["all"] and s["all"].images.shape == (3, 3, 5, 4)
    assert s["all"].labels.tolist() == data["t10k"][1].tolist()
    assert read_splits(one, image_size=[10, 8], resize="resize")["all"].images.shape == (3, 1, 10, 8)
    with pytest.raises(UserError, match=r"is 5x4, not data\.image_size=\[10,8\]"):
        read_splits(one, image_size=[10, 8])


def test_emnist_is_transposed(tmp_path):
    data = write_idx(tmp_path, prefix="emnist-letters-")
    s = read_splits(tmp_path)["train"]
    assert s.images.shape == (6, 1, 4, 5)
    assert torch.equal(s.images[:, 0], torch.from_numpy(data["train"][0]).transpose(1, 2))


def test_idx_header_and_count_mismatches(tmp_path):
    write_idx(tmp_path, gz=False)
    images = tmp_path / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes() + b"\0")
    with pytest.raises(
        UserError, match=r"train-images-idx3-ubyte: the IDX header says 6 x 5 x 4 \(136 bytes.*holds 137"
    ):
        read_splits(tmp_path)
    images.write_bytes(images.read_bytes()[:-1])
    labels = tmp_path / "train-labels-idx1-ubyte"
    labels.write_bytes(idx_bytes(np.zeros(5, np.uint8)))
    with pytest.raises(UserError, match=r"holds 6 images but .*train-labels-idx1-ubyte holds 5 labels"):
        read_splits(tmp_path)
    labels.write_bytes(idx_bytes(np.array([0, 1, 2, 3, 4, 12], np.uint8)))
    with pytest.raises(UserError, match=r"train-images-idx3-ubyte#5 has label 12.*data\.num_classes is 10"):
        read_splits(tmp_path, num_classes=10)


# ---------------------------------------------------------------------------------------------------------
# CIFAR binary, pickled CIFAR refused


def cifar_records(n: int, label_bytes: int = 1, top: int = 10):
    x = RNG.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    y = RNG.integers(0, top, (n, label_bytes), dtype=np.uint8)
    return x, y, np.concatenate([y, x.reshape(n, -1)], axis=1).tobytes()


def test_cifar10_binary_folder_and_tar_gz(tmp_path):
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    parts = {}
    for name, n in (("data_batch_2.bin", 2), ("data_batch_1.bin", 3), ("test_batch.bin", 2)):
        x, y, raw = cifar_records(n)
        (folder / name).write_bytes(raw)
        parts[name] = (x, y[:, 0])
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta.txt").write_text("\n".join(names) + "\n\n")
    (folder / "readme.html").write_text("<html/>")
    with tarfile.open(tmp_path / "cifar-10-binary.tar.gz", "w:gz") as tf:
        tf.add(folder, arcname="cifar-10-batches-bin")
    for source in (tmp_path, folder, tmp_path / "cifar-10-binary.tar.gz"):
        assert detect_format(source) == "cifar_binary", source
        splits = read_splits(source)
        train = splits["train"]
        assert train.classes == names
        assert torch.equal(
            train.images,
            torch.from_numpy(np.concatenate([parts["data_batch_1.bin"][0], parts["data_batch_2.bin"][0]])),
        )
        assert train.labels.tolist() == [*parts["data_batch_1.bin"][1], *parts["data_batch_2.bin"][1]]
        assert train.names[3] == "data_batch_2.bin#0"
        assert torch.equal(splits["test"].images, torch.from_numpy(parts["test_batch.bin"][0]))
    from PIL import Image

    gray = read_splits(folder, channels=1)["test"].images
    want = Image.fromarray(parts["test_batch.bin"][0][1].transpose(1, 2, 0)).convert("L")
    assert gray.shape == (2, 1, 32, 32) and torch.equal(gray[1, 0], torch.from_numpy(np.array(want)))
    (folder / "test_batch.bin").write_bytes(cifar_records(2)[2][:-5])
    with pytest.raises(UserError, match=r"test_batch\.bin is 6141 bytes, not a multiple of the 3073-byte CIFAR-10"):
        read_splits(folder)


def test_cifar100_binary_uses_fine_labels(tmp_path):
    x, y, raw = cifar_records(4, label_bytes=2, top=100)
    (tmp_path / "train.bin").write_bytes(raw)
    (tmp_path / "test.bin").write_bytes(cifar_records(1, label_bytes=2)[2])
    (tmp_path / "fine_label_names.txt").write_text("\n".join(f"c{i}" for i in range(100)))
    s = read_splits(tmp_path)
    assert s["train"].labels.tolist() == y[:, 1].tolist() and s["train"].classes[7] == "c7"
    assert torch.equal(s["train"].images, torch.from_numpy(x))
    assert len(s["test"].names) == 1


@pytest.mark.parametrize("files", [["data_batch_1", "batches.meta"], ["meta", "train", "test"]])
def test_pickled_cifar_is_refused_unread(tmp_path, files):
    for f in files:
        (tmp_path / f).write_bytes(b"\x80\x04junk that must never be unpickled")
    for source, fmt in ((tmp_path, "auto"), (tmp_path, "cifar_binary"), (tmp_path / files[0], "auto")):
        with pytest.raises(UserError, match=r"pickled Python version.*cifar-10-binary\.tar\.gz.*kriz/cifar\.html"):
            read_splits(source, fmt)
    archive = tmp_path / "cifar-10-python.tar.gz"
    write_archive(archive, {"cifar-10-batches-py/data_batch_1": b"junk"})
    with pytest.raises(UserError, match="pickled Python version"):
        detect_format(archive)
    renamed = write_archive(tmp_path / "download.tgz", {"cifar-10-batches-py/data_batch_1": b"junk"})
    with pytest.raises(UserError, match="pickled Python version"):
        read_splits(renamed)


# ---------------------------------------------------------------------------------------------------------
# SVHN, STL-10


def test_svhn_mat_maps_10_to_0(tmp_path):
    from scipy.io import savemat

    x = RNG.integers(0, 256, (32, 32, 3, 5), dtype=np.uint8)
    y = np.array([[10], [1], [2], [10], [9]], dtype=np.uint8)
    savemat(tmp_path / "train_32x32.mat", {"X": x, "y": y})
    savemat(tmp_path / "test_32x32.mat", {"X": x[..., :2], "y": y[:2]})
    savemat(tmp_path / "extra_32x32.mat", {"X": x[..., :1], "y": y[:1]})
    assert detect_format(tmp_path) == "svhn_mat"
    s = read_splits(tmp_path)
    assert sorted(s) == ["test", "train"]
    assert s["train"].labels.tolist() == [0, 1, 2, 0, 9] and s["train"].classes == [str(i) for i in range(10)]
    assert torch.equal(s["train"].images, torch.from_numpy(x.transpose(3, 2, 0, 1).copy()))
    extra = read_splits(tmp_path / "extra_32x32.mat")
    assert list(extra) == ["all"] and extra["all"].labels.tolist() == [0]


def test_stl10_binary_is_column_major(tmp_path):
    folder = tmp_path / "stl10_binary"
    folder.mkdir()
    x = RNG.integers(0, 256, (3, 3, 96, 96), dtype=np.uint8)
    (folder / "train_X.bin").write_bytes(x.transpose(0, 1, 3, 2).tobytes())
    (folder / "train_y.bin").write_bytes(bytes([1, 10, 4]))
    (folder / "test_X.bin").write_bytes(x[:1].transpose(0, 1, 3, 2).tobytes())
    (folder / "test_y.bin").write_bytes(bytes([2]))
    (folder / "unlabeled_X.bin").write_bytes(b"\0" * 100)
    (folder / "class_names.txt").write_text("\n".join(f"n{i}" for i in range(10)))
    for source in (tmp_path, folder):
        assert detect_format(source) == "stl10_binary"
        s = read_splits(source)
        assert torch.equal(s["train"].images, torch.from_numpy(x))
        assert s["train"].labels.tolist() == [0, 9, 3] and s["test"].classes[9] == "n9"
    (folder / "test_y.bin").write_bytes(bytes([2, 3]))
    with pytest.raises(UserError, match=r"test_X\.bin holds 1 images but .*test_y\.bin holds 2 labels"):
        read_splits(folder)


# ---------------------------------------------------------------------------------------------------------
# parquet, csv, single image


def write_parquet(path: Path, images: list[np.ndarray], labels: list[int], names=None, struct_col=True, col="label"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    blobs = [encode(a) for a in images]
    image = pa.array([{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(blobs)]) if struct_col else pa.array(blobs)
    table = pa.table({"image": image, col: pa.array(labels, pa.int64())})
    if names:
        meta = {"info": {"features": {"image": {"_type": "Image"}, col: {"names": names, "_type": "ClassLabel"}}}}
        table = table.replace_schema_metadata({"huggingface": json.dumps(meta)})
    pq.write_table(table, path)


def test_parquet_hf_export_with_splits_and_class_names(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    imgs = [rgb() for _ in range(5)]
    write_parquet(data / "train-00000-of-00002.parquet", imgs[:2], [0, 2], names=["a", "b", "c"])
    write_parquet(data / "train-00001-of-00002.parquet", imgs[2:4], [1, 1], names=["a", "b", "c"])
    write_parquet(data / "test-00000-of-00001.parquet", imgs[4:], [2], names=["a", "b", "c"])
    assert detect_format(tmp_path) == "parquet"
    s = read_splits(tmp_path)
    assert sorted(s) == ["test", "train"] and s["train"].classes == ["a", "b", "c"]
    assert torch.equal(s["train"].images, torch.stack([chw(a) for a in imgs[:4]]))
    assert s["train"].labels.tolist() == [0, 2, 1, 1] and s["train"].names[2] == "train-00001-of-00002.parquet#0"
    plain = tmp_path / "plain.parquet"
    write_parquet(plain, imgs[:3], [4, 0, 1], struct_col=False, col="labels")
    s = read_splits(plain)["all"]
    assert s.classes == ["0", "1", "2", "3", "4"] and torch.equal(s.images[0], chw(imgs[0]))
    write_parquet(plain, imgs[:3], [0, -3, 1])
    with pytest.raises(UserError, match=r"plain\.parquet row 1 has label -3"):
        read_splits(plain)


def test_csv_with_names_or_numbers_and_optional_header(tmp_path):
    files = tree()
    write_tree(tmp_path / "img", files)
    rows = [(f"img/{k}", k.split("/")[0]) for k in files]
    (tmp_path / "named.csv").write_text("path,label\n" + "\n".join(f"{p},{c}" for p, c in rows) + "\n")
    assert detect_format(tmp_path / "named.csv") == "csv"
    s = read_splits(tmp_path / "named.csv")["all"]
    assert s.classes == CLASSES and s.names[0] == "img/cat/0000.png"
    assert_matches(s, {f"img/{k}": v for k, v in files.items()})
    (tmp_path / "numbered.csv").write_text("".join(f"{p},{CLASSES.index(c)}\n" for p, c in rows))
    s = read_splits(tmp_path / "numbered.csv")["all"]
    assert s.classes == ["0", "1", "2"] and s.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert torch.equal(s.images[5], chw(files["dog/0001.png"]))
    (tmp_path / "bad.csv").write_text("img/cat/0000.png,0\nimg/cat/0001.png,-1\n")
    with pytest.raises(UserError, match=r"bad\.csv row 2 has label -1"):
        read_splits(tmp_path / "bad.csv")
    with pytest.raises(UserError, match=r"numbered\.csv row 9 \(img/emu/0000\.png\) has label 2.*num_classes is 2"):
        read_splits(tmp_path / "numbered.csv", num_classes=2)


def test_unlabelled_images_are_pointed_at_task_infer_not_at_a_key_that_does_not_exist(tmp_path):
    """The messages said to set data.allow_unlabelled=true, which no data config has."""
    write_tree(tmp_path / "flat", {f"{i}.png": rgb() for i in range(2)})
    (tmp_path / "rows.csv").write_text("path,label\nflat/0.png,cat\nflat/1.png,\n")
    write_parquet(tmp_path / "rows.parquet", [rgb(), rgb()], [0, -1])
    for source, said in (("flat", "no class folders"), ("rows.csv", "row 3 has no label"), ("rows.parquet", "-1")):
        with pytest.raises(UserError, match=said) as e:
            read_splits(tmp_path / source)
        assert "use task=infer task.input=PATH" in str(e.value) and "allow_unlabelled" not in str(e.value)


def test_single_image_for_inference(tmp_path):
    arr = rgb(5, 7)
    (tmp_path / "x.webp").write_bytes(encode(arr, "WEBP", lossless=True))
    assert detect_format(tmp_path / "x.webp") == "image"
    s = read_splits(tmp_path / "x.webp")
    assert list(s) == ["all"] and s["all"].labels.tolist() == [-1] and s["all"].classes == []
    assert torch.equal(s["all"].images[0], chw(arr))


def test_unknown_and_missing_sources_list_the_formats(tmp_path):
    with pytest.raises(UserError, match=r"does not exist.*supported formats: folder.*idx.*parquet"):
        read_splits(tmp_path / "nope")
    (tmp_path / "blob.xyz").write_bytes(os.urandom(2000))
    with pytest.raises(UserError, match=r"cannot tell its format; supported formats"):
        detect_format(tmp_path / "blob.xyz")
    with pytest.raises(UserError, match="data.format 'jpeg' is not one of auto, folder"):
        read_splits(tmp_path / "blob.xyz", "jpeg")
    assert "cifar_binary" in FORMATS and len(FORMATS) == 9


def test_source_digest_follows_content(tmp_path):
    files = tree(per=1)
    write_tree(tmp_path / "ds", files)
    d0 = source_digest(tmp_path / "ds")
    assert d0 == source_digest(tmp_path / "ds") and len(d0) == 64
    target = tmp_path / "ds/cat/0000.png"
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    d1 = source_digest(tmp_path / "ds")
    assert d1 != d0
    (tmp_path / "ds/cat/0001.png").write_bytes(encode(rgb()))
    assert source_digest(tmp_path / "ds") != d1
    zipped = write_archive(tmp_path / "ds.zip", files)
    z0 = source_digest(zipped)
    write_archive(zipped, {**files, "dog/0009.png": rgb()})
    assert source_digest(zipped) != z0
    (tmp_path / "ds/list.csv").write_text("cat/0000.png,0\n")
    c0 = source_digest(tmp_path / "ds/list.csv")
    target.write_bytes(encode(rgb()))  # the csv's bytes are unchanged, the image it names is not
    assert source_digest(tmp_path / "ds/list.csv") != c0


def test_a_folder_of_split_tables_is_digested_with_the_images_they_name_outside_it(tmp_path):
    """tables/train.csv naming ../img/x.png: the folder's digest saw the tables only, so an image replaced in
    img/ kept its old pixels in the decoded cache."""
    write_tree(tmp_path / "img", tree(per=1))
    (tmp_path / "tables").mkdir()
    for split in ("train", "test"):
        (tmp_path / "tables" / f"{split}.csv").write_text("path,label\n../img/cat/0000.png,cat\n")
    before = source_digest(tmp_path / "tables")
    (tmp_path / "img/cat/0000.png").write_bytes(encode(rgb()))
    assert source_digest(tmp_path / "tables") != before


# ---------------------------------------------------------------------------------------------------------
# list_items: streaming decode matches read_splits


def test_list_items_matches_read_splits_for_every_random_access_source(tmp_path):
    files = {**tree("train/"), **tree("test/", per=2)}
    sources = {
        "folder": write_tree(tmp_path / "ds", files),
        "zip": write_archive(tmp_path / "ds.zip", files),
        "tar": write_archive(tmp_path / "ds.tar", files),
    }
    (tmp_path / "ds/train.csv").write_text("".join(f"{k},{k.split('/')[1]}\n" for k in files if k.startswith("train")))
    sources["csv"] = tmp_path / "ds/train.csv"
    write_idx(tmp_path / "mnist")
    sources["idx"] = tmp_path / "mnist"
    (tmp_path / "cifar").mkdir()
    (tmp_path / "cifar/data_batch_1.bin").write_bytes(cifar_records(3)[2])
    sources["cifar"] = tmp_path / "cifar"
    write_parquet(tmp_path / "p.parquet", [rgb() for _ in range(3)], [1, 0, 1])
    sources["parquet"] = tmp_path / "p.parquet"
    from scipy.io import savemat

    savemat(
        tmp_path / "test_32x32.mat",
        {"X": RNG.integers(0, 256, (32, 32, 3, 2), dtype=np.uint8), "y": [[3], [10]]},
    )
    sources["svhn"] = tmp_path / "test_32x32.mat"
    for kind, source in sources.items():
        items, full = list_items(source), read_splits(source)
        assert sorted(items) == sorted(full), kind
        for split, lst in items.items():
            s = full[split]
            assert len(lst) == len(s.names) and lst.names == s.names and lst.classes == s.classes, kind
            assert torch.equal(lst.labels, s.labels), kind
            loaded = torch.stack([lst.load(i) for i in range(len(lst))])
            assert torch.equal(loaded, s.images), (kind, split)
    for kind in ("zip", "tar", "parquet", "cifar"):  # as a spawned DataLoader worker gets it, handles open
        lst = list_items(sources[kind])
        split = next(iter(lst))
        lst[split].load(1)
        lst = pickle.loads(pickle.dumps(lst[split]))
        assert torch.equal(lst.load(2), read_splits(sources[kind])[split].images[2]), kind


def test_list_items_configure_corrupt_and_compressed_tar(tmp_path):
    files = tree(classes=["a", "b"], per=2, channels=1)
    write_tree(tmp_path / "ds", {**files, "b/9.png": b"junk"})
    lst = list_items(tmp_path / "ds")["all"]
    assert lst.names[-1] == "b/9.png" and lst.load(len(lst) - 1) is None
    assert lst.load(0).shape == (1, 8, 8)
    lst.configure(channels=3, image_size=[4, 4], resize="resize")
    assert lst.load(0).shape == (3, 4, 4)
    write_idx(tmp_path / "mnist")
    arr = list_items(tmp_path / "mnist")["train"].configure(channels=3)
    assert torch.equal(arr.load(2), read_splits(tmp_path / "mnist", channels=3)["train"].images[2])
    gz = write_archive(tmp_path / "ds.tar.gz", files)
    with pytest.raises(UserError, match=r"streaming .* needs an uncompressed \.tar, a \.zip or a folder"):
        list_items(gz)


# ---------------------------------------------------------------------------------------------------------
# what real users hand over: links, pipes, hostile archives, odd labels, phone pictures


def test_folder_with_directory_link_loops_lists_each_image_once(tmp_path):
    files = tree(classes=["cat", "dog"], per=2)
    ds = write_tree(tmp_path / "ds", files)
    (ds / "cat/loop").symlink_to(ds / "cat")  # a/loop -> a
    (ds / "dog/up").symlink_to("..")  # b/x -> ..
    outside = write_tree(tmp_path / "elsewhere", {"emu/0000.png": rgb(), "emu/0001.png": rgb()})
    (ds / "emu").symlink_to(outside / "emu")  # a link to another folder: followed once
    (ds / "emu2").symlink_to(outside / "emu")  # the same folder again: not listed twice
    (ds / "cat/0009.png").symlink_to(ds / "dog/0000.png")  # a link to a file: followed
    s = read_splits(ds)["all"]
    assert s.classes == ["cat", "dog", "emu"]
    assert s.names == [
        *sorted([*(k for k in files if k.startswith("cat/")), "cat/0009.png"]),
        *(k for k in files if k.startswith("dog/")),
        "emu/0000.png",
        "emu/0001.png",
    ]
    assert torch.equal(s.images[s.names.index("cat/0009.png")], chw(files["dog/0000.png"]))
    assert len(source_digest(ds)) == 64 and detect_format(ds) == "folder"
    assert len(list_items(ds)["all"]) == 7


def test_sources_that_are_not_files_or_folders_are_refused_before_reading(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    cases = [(fifo, r"is a FIFO \(named pipe\), not a regular file or folder")]
    if Path("/dev/zero").exists():
        cases.append((Path("/dev/zero"), "is a character device, not a regular file or folder"))
    for source, said in cases:
        for call in (detect_format, read_splits, list_items, source_digest):
            with pytest.raises(UserError, match=rf"data\.source {source} {said}; point it at a dataset file"):
                call(source)
    files = tree(classes=["cat", "dog"], per=2)
    write_tree(tmp_path / "ds", files)
    os.mkfifo(tmp_path / "ds/cat/0009.png")  # inside a tree: never opened
    assert read_splits(tmp_path / "ds")["all"].names == sorted(files)
    (tmp_path / "ds/list.csv").write_text("cat/0000.png,0\ncat/0009.png,1\ndog/0000.png,1\n")
    s = read_splits(tmp_path / "ds/list.csv", max_bad_fraction=0.5)["all"]
    assert s.skipped == ["cat/0009.png: a FIFO (named pipe), not a regular file"]
    assert source_digest(tmp_path / "ds/list.csv")


def test_source_that_is_a_link_loop_is_one_sentence(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for call in (detect_format, read_splits, list_items, source_digest):
        with pytest.raises(UserError, match=r"data\.source .*/a is a symbolic link loop"):
            call(tmp_path / "a")
    (tmp_path / "c").symlink_to(tmp_path / "gone")
    with pytest.raises(UserError, match=r"data\.source .*/c is a broken symbolic link to .*/gone"):
        read_splits(tmp_path / "c")


@pytest.mark.parametrize("name", ["ds.zip", "ds.tar", "ds.tar.gz"])
def test_archive_members_with_absolute_or_parent_paths_are_skipped_and_named(tmp_path, name, caplog):
    files = tree(classes=["cat", "dog"], per=4)
    bad = {"/x/cat/1.png": rgb(), "../evil/cat/2.png": rgb(), "cat/../../3.png": rgb()}
    path = write_archive(tmp_path / name, {**files, **bad, "/etc/notes.txt": b"not an image"})
    with caplog.at_level(logging.WARNING, logger="onn"):
        s = read_splits(path, max_bad_fraction=0.5)["all"]
    assert s.classes == ["cat", "dog"] and s.names == sorted(files)
    assert_matches(s, files)
    assert s.skipped == [
        "/x/cat/1.png: an absolute path, not read",
        "../evil/cat/2.png: a '..' in its path, not read",
        "cat/../../3.png: a '..' in its path, not read",
    ]
    message = caplog.records[-1].getMessage()
    assert "3 of 11" in message and "/x/cat/1.png" in message
    with pytest.raises(UserError, match=r"3 of 11 images could not be decoded.*/x/cat/1\.png: an absolute path"):
        read_splits(path)
    if name != "ds.tar.gz":
        assert list_items(path)["all"].names == sorted(files)


def test_csv_with_a_name_among_numeric_labels_names_the_row(tmp_path):
    files = tree(classes=["cat"], per=10)
    write_tree(tmp_path, files)
    rows = [f"{k},{i}" for i, k in enumerate(files)]
    rows[4] = rows[4].rsplit(",", 1)[0] + ",cat"
    (tmp_path / "labels.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    with pytest.raises(UserError, match=r"labels\.csv row 6 has label 'cat', but the other labels are numbers"):
        read_splits(tmp_path / "labels.csv")
    rows = [f"{k},{'cat' if i else 3}" for i, k in enumerate(files)]  # one number among names
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(UserError, match=r"labels\.csv row 1 has label '3', but the other labels are class names"):
        read_splits(tmp_path / "labels.csv")


HEIC = b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + bytes(64)  # an ISO-BMFF header, as phones write
JXL = b"\xff\x0a" + bytes(64)


@pytest.mark.parametrize("kind", ["folder", "zip", "tar.gz"])
def test_images_with_unlisted_extensions_are_decoded_or_named(tmp_path, kind, caplog):
    from importlib.util import find_spec

    from PIL import Image, features

    if find_spec("pillow_heif") or find_spec("pillow_jxl"):
        pytest.skip("the plugin hints are for machines without pillow-heif and pillow-jxl-plugin")
    files = tree(classes=["cat", "dog"], per=3)
    extra = {"dog/scan": encode(rgb()), "dog/photo.dat": encode(rgb(), "JPEG")}  # images by magic bytes
    buf = io.BytesIO()
    if features.check("avif"):
        Image.fromarray(rgb()).save(buf, "AVIF", quality=100)
        extra["cat/phone.avif"] = buf.getvalue()
    unreadable = {"cat/IMG_0001.heic": HEIC, "cat/IMG_0002.CR2": b"II*\0" + bytes(60), "dog/x.jxl": JXL}
    quiet = {
        "cat/README.txt": b"about cats",
        "labels.csv": b"cat/0000.png,cat\n",
        "dog/.DS_Store": b"\0\0\0\1Bud1",
    }
    everything = {**files, **extra, **unreadable, **quiet}
    source = (
        write_tree(tmp_path / "ds", everything)
        if kind == "folder"
        else write_archive(tmp_path / f"ds.{kind}", everything)
    )
    with caplog.at_level(logging.WARNING, logger="onn"):
        s = read_splits(source, max_bad_fraction=0.5)["all"]
    assert s.names == sorted([*files, *extra])
    for name, data in extra.items():
        want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        assert torch.equal(s.images[s.names.index(name)], chw(want)), name
    assert sorted(s.skipped) == [
        "cat/IMG_0001.heic: HEIC needs the pillow-heif plugin (pip install pillow-heif)",
        "cat/IMG_0002.CR2: a camera RAW file, which is not decoded here; convert it to PNG or JPEG",
        "dog/x.jxl: JPEG XL needs the pillow-jxl-plugin (pip install pillow-jxl-plugin)",
    ]
    message = caplog.records[-1].getMessage()
    assert f"3 of {len(s.names) + 3}" in message and "cat/IMG_0001.heic: HEIC needs" in message
    if kind != "tar.gz":  # item by item: listed, and None where nothing decodes them
        items = list_items(source)["all"]
        assert items.names == sorted([*files, *extra, *unreadable])
        assert items.load(items.names.index("dog/x.jxl")) is None
        assert torch.equal(items.load(items.names.index("dog/scan")), s.images[s.names.index("dog/scan")])
    one = tmp_path / "one.heic"
    one.write_bytes(HEIC)
    assert detect_format(one) == "image"
    with pytest.raises(UserError, match=r"1 of 1 images could not be decoded \(first: one\.heic: HEIC needs"):
        read_splits(one)


def test_jpeg_pixels_and_channels_match_pillow(tmp_path):
    from PIL import Image

    smooth = np.stack([*np.meshgrid(np.arange(24) * 9, np.arange(20) * 11), np.full((20, 24), 99)], -1)
    variants = {
        "a/420.jpg": encode(rgb(20, 24), "JPEG", quality=90),
        "a/444.jpg": encode(smooth.astype(np.uint8), "JPEG", quality=95, subsampling=0),
        "a/progressive.jpg": encode(rgb(20, 24), "JPEG", quality=75, progressive=True),
        "b/gray.jpg": encode(rgb(20, 24, channels=1), "JPEG"),
    }
    buf = io.BytesIO()
    Image.fromarray(rgb(20, 24)).convert("CMYK").save(buf, "JPEG")
    variants["b/cmyk.jpg"] = buf.getvalue()
    write_tree(tmp_path, variants)
    for channels, mode in (("auto", None), (1, "L"), (3, "RGB")):
        s = read_splits(tmp_path, channels=channels)["all"]
        assert s.skipped == [] and s.images.shape == (5, 1 if channels == 1 else 3, 20, 24)
        for name, img in zip(s.names, s.images):
            pil = Image.open(io.BytesIO(variants[name]))
            want = np.asarray(pil.convert(mode or ("RGB" if pil.mode != "L" else "L")))
            want = chw(want).expand(img.shape) if want.ndim == 2 else chw(want)
            assert torch.equal(img, want), (name, channels)
        items = list_items(tmp_path)["all"].configure(channels=channels)
        assert torch.equal(torch.stack([items.load(i) for i in range(len(items))]), s.images)


def test_exif_orientation_turns_a_picture_as_a_viewer_shows_it(tmp_path):
    """A phone's portrait photo is stored sideways with EXIF orientation 6: it decoded as stored, 40 wide."""
    from PIL import Image, ImageOps

    exif = Image.Exif()
    exif[0x0112] = 6  # turn 90 degrees clockwise to view
    files = {}
    for name, fmt in (("a/0.jpg", "JPEG"), ("a/1.png", "PNG"), ("b/0.jpg", "JPEG"), ("b/1.png", "PNG")):
        files[name] = encode(rgb(20, 40), fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {}))
    write_tree(tmp_path, files)
    s = read_splits(tmp_path)["all"]
    assert s.images.shape == (4, 3, 40, 20)
    for name, img in zip(s.names, s.images):
        want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(files[name]))).convert("RGB"))
        assert torch.equal(img, chw(want)), name
    items = list_items(tmp_path)["all"]
    assert torch.equal(torch.stack([items.load(i) for i in range(len(items))]), s.images)


# ---------------------------------------------------------------------------------------------------------
# the real thing


@pytest.mark.slow
def test_real_cifar10_jpeg_archive():
    path = (Path(__file__).parents[1] / "../shared/data/cifar10/cifar10-jpeg.tar.gz").resolve()
    if not path.exists():
        pytest.skip(f"{path} is not here")
    splits = read_splits(path)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    assert sorted(splits) == ["test", "train"]
    for split, n in (("train", 50000), ("test", 10000)):
        s = splits[split]
        assert s.images.shape == (n, 3, 32, 32) and s.classes == names and s.skipped == []
        assert torch.bincount(s.labels).tolist() == [n // 10] * 10
    assert splits["test"].images.float().std() > 30  # real pictures, not zeros


def test_an_encrypted_zip_is_one_sentence(tmp_path):
    path = write_archive(tmp_path / "locked.zip", {"cat/scan": rgb(), "dog/scan": rgb()})
    raw = bytearray(path.read_bytes())
    for sig, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # set the "encrypted" flag in every header
        start = 0
        while (i := raw.find(sig, start)) >= 0:
            raw[i + at] |= 1
            start = i + 4
    path.write_bytes(raw)
    for call in (detect_format, lambda p: read_splits(p, "archive")):
        with pytest.raises(UserError, match=r"locked\.zip is not a readable archive: .*encrypted"):
            call(path)
