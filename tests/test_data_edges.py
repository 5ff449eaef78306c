"""Users' data at its edges, as a review of the readers found them (2026-12-05): a caption with an unquoted comma,
a CSV field over csv's 128 KB, an archive's wrapping folder over its splits, images outside any class folder, a
replaced image under an unchanged metadata file, grey and colour splits streamed, a Mac zip's resource forks and
members named outside the archive, a class of one sample, a cache filled under a looser limit, batch groups
smaller than a batch, undecodable files streamed. Each ends in one sentence naming the file and line, or reads the
data as the user laid it out."""

from __future__ import annotations

import io
import json
import logging
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import compose
from PIL import Image

from onn.errors import UserError

TETRAHEDRON = "v 0 0 0\nv 1 0 0\nv 0 1 0\nv 0 0 1\nf 1 2 3\nf 1 2 4\nf 1 3 4\nf 2 3 4\n"


def square(path: Path, colour=(0, 0, 0), mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, (8, 8), colour if mode == "RGB" else 100).save(path)


def test_a_caption_or_label_with_an_unquoted_comma_is_one_sentence_naming_its_line(tmp_path):
    """csv's DictReader files a row's extra fields under the key None: the pairs reader then failed with an
    AttributeError (and data=auto read the folder as loose images instead), and a manifest cut the label at the
    comma ("dog, barking" -> "dog") or failed building its own message."""
    from onn.data.labelled import list_labelled
    from onn.modalities.audio.decode import SUFFIXES
    from onn.modalities.pairs.detect import find_pairs
    from onn.modalities.pairs.modality import PairsModality

    pairs = tmp_path / "pairs"
    for i in range(6):
        square(pairs / f"{i}.png", (i * 40, 0, 0))
    rows = "".join(f"{i}.png,a red square number {i}\n" for i in range(5))
    (pairs / "metadata.csv").write_text("file_name,text\n" + rows + "5.png,a dog, running\n")
    for read in (find_pairs, PairsModality().sniff):
        with pytest.raises(UserError, match=r"metadata.csv line 7 has 1 more field\(s\) than its header's 2 columns"):
            read(pairs)
    audio = tmp_path / "audio"
    audio.mkdir()
    for i in range(4):
        (audio / f"{i}.wav").write_bytes(b"RIFF")
    (audio / "metadata.csv").write_text("file_name,label\n0.wav,dog, barking\n1.wav,cat\n2.wav,dog\n3.wav,cat\n")
    with pytest.raises(UserError, match=r"metadata.csv line 2 has 1 more field"):
        list_labelled(audio, SUFFIXES, kind="audio")


def test_a_text_csv_with_a_field_over_128_kb_reads_as_csv(tmp_path):
    """csv refuses a field over 128 KB by default: the text reader fell back to plain text, one record per line
    with the columns' names as text, and data.format=csv raised csv's own error."""
    from onn.modalities.text.formats import read_records

    path = tmp_path / "long.csv"
    path.write_text("input,output\nwhat is 1+1,2\nsummarise this," + "x" * 140_000 + "\nwhat is 2+2,4\n")
    for fmt in ("auto", "csv"):
        records = read_records(path, fmt)
        assert len(records) == 3 and records[1]["input"] == "summarise this" and len(records[1]["output"]) == 140_000


def test_an_archives_wrapping_folder_over_its_splits_keeps_them_for_regex_and_manifest_labels(tmp_path):
    """digits.zip holding digits/train/... and digits/test/...: every file landed in one split ("all") when
    labels came from the names or a manifest, so test files were trained on; a folder of the same tree split."""
    from onn.data.labelled import list_labelled
    from onn.modalities.audio.decode import SUFFIXES

    archive = tmp_path / "digits.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for split in ("train", "test"):
            for i in range(4):
                zf.writestr(f"digits/{split}/{i % 2}_spk_{i}.wav", b"RIFF")
            manifest = "".join(f"{i % 2}_spk_{i}.wav,{i % 2}\n" for i in range(4))
            zf.writestr(f"digits/{split}/metadata.csv", "file_name,label\n" + manifest)
    for label_from in (r"^(\d)_", "manifest"):
        listing = list_labelled(archive, SUFFIXES, label_from=label_from, kind="audio")
        assert {k: len(v) for k, v in listing.splits.items()} == {"train": 4, "test": 4}
        assert all(m.name.startswith("digits/test/") for m in listing.splits["test"])


def test_images_outside_any_class_folder_beside_ones_inside_are_one_sentence(tmp_path):
    """Images beside the class folders (root0.png, train/loose0.png) were left out without a word: 8 of 14."""
    from onn.modalities.image.formats import read_splits

    for c in ("cat", "dog"):
        for i in range(3):
            square(tmp_path / "train" / c / f"{i}.png", (i * 40, 0, 0))
    for i in range(4):
        square(tmp_path / "train" / f"loose{i}.png")
        square(tmp_path / f"root{i}.png")
    with pytest.raises(UserError, match=r"8 image\(s\) in .* sit in no class folder beside images that do, e\.g\."):
        read_splits(tmp_path)


def test_a_replaced_image_under_an_unchanged_metadata_file_is_decoded_again(tmp_path):
    """With data.source a metadata.jsonl, the decoded cache was keyed by that file alone: a photo replaced
    beside it kept its old pixels until the cache was deleted."""
    from onn.modalities.pairs.data import PairData
    from onn.modalities.pairs.sides import build_side, side_config

    (tmp_path / "images").mkdir()
    rows = []
    for i in range(8):
        square(tmp_path / "images" / f"{i}.png", (30 * i + 10, 0, 0))
        rows.append({"file_name": f"images/{i}.png", "text": f"a square of shade {i}"})
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose(
        "data=pairs",
        "model=dual_encoder",
        f"data.source={tmp_path}/metadata.jsonl",
        f"paths.cache={tmp_path / 'cache'}",
        "data.sides.image.image_size=[8,8]",
        "data.sides.text.max_length=16",
        root=tmp_path,
    )

    def first_pixel() -> list[int]:
        data = PairData(cfg, {n: build_side(n, side_config(n, cfg)) for n in ("image", "text")})
        data.setup()
        for split in data.splits.values():
            for i, name in enumerate(split.names):
                if name.endswith("line 1"):
                    return split.inputs[i, :, 0, 0].tolist()
        raise AssertionError("the first pair is in no split")

    assert first_pixel() == [10, 0, 0]
    square(tmp_path / "images" / "0.png", (0, 255, 0))
    assert first_pixel() == [0, 255, 0]


def test_grey_and_colour_splits_streamed_come_out_in_colour_as_resident_ones_do(tmp_path):
    """Each streamed split chose its channels from its own first items: grey train/ and colour test/ gave a
    1-channel model and 3-channel test batches."""
    from onn.modalities.image.dataset import ImageDataModule

    for split, mode in (("train", "L"), ("test", "RGB")):
        for c in ("a", "b"):
            for i in range(5):
                square(tmp_path / split / c / f"{i}.png", mode=mode)
    for resident in ("true", "false"):
        cfg = compose("data=image", f"data.source={tmp_path}", f"data.resident={resident}", root=tmp_path)
        data = ImageDataModule(cfg.data, tmp_path / "cache")
        data.setup()
        assert data.input_shape == (3, 8, 8)
        assert next(iter(data.test_dataloader()))[0].shape[1] == 3


def test_streamed_images_are_colour_when_a_colour_one_comes_after_the_first_16_grey_ones(tmp_path):
    """Streamed, the first 16 items chose the channels: 16 grey ones before the colour ones made every image grey,
    where a resident read of the same folder is colour (as docs/images.md says)."""
    from onn.modalities.image.dataset import ImageDataModule

    for i in range(16):
        square(tmp_path / "a" / f"{i:02d}.png", mode="L")
    for i in range(4):
        square(tmp_path / "b" / f"{i}.png", (200, 0, 0))
    given = ("data=image", f"data.source={tmp_path}", "data.resident=false", "data.num_workers=0")
    data = ImageDataModule(compose(*given, root=tmp_path).data, tmp_path / "cache")
    data.setup()
    assert data.input_shape == (3, 8, 8)
    batches = [x for x, _ in data.train_dataloader()] + [x for x, _ in data.val_dataloader()]
    assert {x.shape[1] for x in batches} == {3} and any(x[:, 0].max() == 200 for x in batches)


def test_a_damaged_decoded_cache_is_decoded_again_not_failed_on(tmp_path, caplog):
    """A truncated, emptied or overwritten cache file failed every later run with safetensors' raw error."""
    from onn.data.cache import cached_decode
    from onn.data.resident import Decoded

    calls = []

    def decode() -> dict[str, Decoded]:
        calls.append(1)
        return {"all": Decoded(torch.arange(12).view(3, 4), torch.tensor([0, 1, 0]), ["a", "b"], ["x", "y", "z"])}

    first = cached_decode("images", {"k": 1}, tmp_path, decode, "src")
    (cache,) = (tmp_path / "images").glob("*.safetensors")
    whole = cache.read_bytes()
    for damaged in (whole[: len(whole) // 2], b"", bytes(range(256)) * 8):
        cache.write_bytes(damaged)
        with caplog.at_level(logging.WARNING, logger="onn"):
            again = cached_decode("images", {"k": 1}, tmp_path, decode, "src")
        assert torch.equal(again["all"].inputs, first["all"].inputs) and again["all"].names == ["x", "y", "z"]
        assert f"the decoded cache {cache} is damaged" in caplog.text
    assert len(calls) == 4 and cached_decode("images", {"k": 1}, tmp_path, decode, "src")["all"].classes == ["a", "b"]
    assert len(calls) == 4  # the file written again is read


def test_a_user_error_in_a_streaming_worker_is_its_one_sentence(tmp_path):
    """Raised in a DataLoader worker, the sentence came out as "Caught UserError in DataLoader worker process 1.
    Original Traceback ..." on the console and in metrics.json's error."""
    from onn.modalities.image.dataset import ImageDataModule

    for i in range(8):
        square(tmp_path / "a" / f"{i}.png", (30 * i, 0, 0))
        square(tmp_path / "b" / f"{i}.png", (0, 30 * i, 0))
    given = ("data=image", f"data.source={tmp_path}", "data.resident=false", "data.num_workers=1", "data.batch_size=4")
    data = ImageDataModule(compose(*given, root=tmp_path).data, tmp_path / "cache")
    data.setup()
    items, index = data.streamed["train"]
    first = next(iter(data.train_dataloader().sampler))  # (a pass moves a loader's own epoch on: a fresh one below)
    broken = items.names[index[first]]  # one the epoch loads: drop_last leaves 2 of 14 out
    loader = data.train_dataloader()
    (tmp_path / broken).write_bytes(b"")  # after the check that every item decodes
    with pytest.raises(UserError) as e:
        list(loader)
    assert str(e.value) == (
        f"data.source item {broken} decoded when the run began and no longer does; restore or remove it and run again."
    )
    square(tmp_path / broken)
    Image.new("RGB", (12, 8)).save(tmp_path / "b" / "9.png")  # another size, after the 16 items that set it
    with pytest.raises(UserError) as e:
        ImageDataModule(compose(*given, root=tmp_path).data, tmp_path / "cache").setup()
    assert str(e.value).startswith("images have different sizes: a/0.png is 8x8 but b/9.png is 8x12 (HxW); set")
    assert "Traceback" not in str(e.value)


def test_eval_of_a_given_source_of_train_and_test_folders_scores_all_of_it(tmp_path):
    """task=eval sets data.val_source to the data.source it is given (app.score_all_given): a source of train/ and
    test/ folders was scored on its test/ only, reported as val/* (and again as test/*)."""
    from onn.modalities.image.dataset import ImageDataModule

    for split, count in (("train", 3), ("test", 1)):
        for c in ("a", "b"):
            for i in range(count):
                square(tmp_path / split / c / f"{i}.png", (40 * i, 0, 0))
    cfg = compose("data=image", f"data.source={tmp_path}", f"data.val_source={tmp_path}", root=tmp_path)
    data = ImageDataModule(cfg.data, tmp_path / "cache")
    data.setup()
    assert sorted(data.splits["val"].names) == sorted(data.splits["train"].names + data.splits["test"].names)
    val = data.splits["val"]
    assert len(val) == 8 and val.labels.tolist() == [data.classes.index(n.split("/")[1]) for n in val.names]


def test_a_mac_zips_resource_forks_are_left_out_and_members_named_outside_the_archive_are_reported(tmp_path):
    """A zip made on a Mac holds __MACOSX/._x copies, which the mesh and graph readers took for damaged files
    ("6 of 12 cannot be used"); members named /etc/x or ../x were dropped without a word."""
    from onn.modalities.graph.read import read_source as read_graphs
    from onn.modalities.mesh.read import Sampling, read_source

    appledouble = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + b"\x00" * 60
    mac = tmp_path / "shapes.zip"
    with zipfile.ZipFile(mac, "w") as zf:
        for c in ("chair", "table"):
            for i in range(3):
                zf.writestr(f"shapes/{c}/{i}.obj", TETRAHEDRON)
                zf.writestr(f"__MACOSX/shapes/{c}/._{i}.obj", appledouble)
    found = read_source(mac, Sampling(64, False), max_bad_fraction=0.0)
    assert {k: (len(v.names), v.classes) for k, v in found.items()} == {"all": (6, ["chair", "table"])}
    climbing = tmp_path / "climbing.tar"
    with tarfile.open(climbing, "w") as tf:
        for name in [f"{c}/{i}.obj" for c in ("chair", "table") for i in range(3)] + ["../lamp/0.obj"]:
            info = tarfile.TarInfo(name)
            info.size = len(TETRAHEDRON)
            tf.addfile(info, io.BytesIO(TETRAHEDRON.encode()))
    with pytest.raises(UserError, match=r"1 of 7 mesh files cannot be used \(first: \.\./lamp/0\.obj: a '\.\.'"):
        read_source(climbing, Sampling(64, False), max_bad_fraction=0.0)
    with pytest.raises(UserError, match=r"1 of 7 graph files cannot be used \(first: \.\./lamp/0\.obj"):
        read_graphs(climbing, align="none", max_nodes=100, max_bad_fraction=0.0)


def test_a_graph_archives_wrapping_folder_is_not_taken_for_its_one_class(tmp_path):
    """graphs.zip holding graphs/ring/... and graphs/star/...: one class, "graphs", where its folder read two."""
    from onn.modalities.graph.read import read_source

    archive = tmp_path / "graphs.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for c in ("ring", "star"):
            for i in range(3):
                zf.writestr(f"graphs/{c}/{i}.edges", "0 1\n1 2\n2 0\n" if c == "ring" else "0 1\n0 2\n0 3\n")
    found = read_source(archive, align="none", max_nodes=100, max_bad_fraction=0.0)
    assert {k: (len(v.names), v.classes) for k, v in found.items()} == {"all": (6, ["ring", "star"])}


def test_a_class_of_one_sample_is_trained_on_not_only_validated_on():
    """A seeded random hold-out put the one `bird` sample in validation alone for seeds 6, 24 and 29."""
    from onn.data.resident import ClassificationData, Decoded

    names = [f"cat/{i}.png" for i in range(9)] + [f"dog/{i}.png" for i in range(9)] + ["bird/0.png"]
    labels = torch.tensor([1] * 9 + [2] * 9 + [0])

    class Data(ClassificationData):
        def read(self, source, key):
            images = torch.zeros(len(names), 1, 4, 4, dtype=torch.uint8)
            return {"all": Decoded(images, labels, ["bird", "cat", "dog"], names)}

    cfg = compose("data=image", "data.source=unused", "data.resident=true")
    for seed in (6, 24, 29):
        data = Data(cfg.data, "/unused", seed=seed)
        data.setup()
        assert "bird/0.png" in data.splits["train"].names and len(data.splits["val"]) >= 1


def test_a_mesh_cache_filled_under_a_looser_bad_fraction_does_not_pass_a_stricter_one(tmp_path, caplog):
    """The decoded mesh cache was keyed without data.max_bad_fraction: a run that accepted damaged files filled
    it, and a later run with a strict limit read it instead of refusing."""
    from onn.modalities.mesh.dataset import read_cached

    source = tmp_path / "shapes"
    for c in ("chair", "table"):
        for i in range(3):
            (source / c).mkdir(parents=True, exist_ok=True)
            (source / c / f"{i}.obj").write_text(TETRAHEDRON if i else "not a mesh")

    def data(bad: float) -> SimpleNamespace:
        return SimpleNamespace(points=64, normals=False, align="none", max_bad_fraction=bad, builtin=None)

    with caplog.at_level(logging.WARNING, logger="onn"):
        assert len(read_cached(str(source), data(0.5), tmp_path / "cache", seed=0)["all"].names) == 4
    with pytest.raises(UserError, match=r"2 of 6 mesh files cannot be used"):
        read_cached(str(source), data(0.01), tmp_path / "cache", seed=0)


def test_a_batch_group_smaller_than_a_batch_is_trained_on():
    """data.batch_groups with every group under data.batch_size gave no batch: drop_last was on because the whole
    split filled a batch, and each group's one short batch was dropped; the run trained 0 steps and said `ok`."""
    from onn.data.resident import ResidentBatches, Split, batch_groups

    names = [f"0_{g}_{i}.wav" for g, n in (("ann", 2), ("bob", 3), ("cy", 6)) for i in range(n)]
    split = Split(torch.arange(len(names))[:, None], torch.zeros(len(names), dtype=torch.long), names)
    loader = ResidentBatches(split, 4, shuffle=True, drop_last=True, groups=batch_groups(names, "_([a-z]+)_"))
    batches = [x.flatten().tolist() for x, _ in loader]
    assert len(loader) == len(batches) == 3
    assert sorted(len(b) for b in batches) == [2, 3, 4]  # ann's and bob's whole; cy's full batch, not its remainder
    assert all(len({names[i].split("_")[1] for i in b}) == 1 for b in batches)


def test_streamed_media_skips_counts_and_refuses_undecodable_files_as_resident_media_does(tmp_path):
    """data.resident=false ignored data.max_bad_fraction, counted no skips (items_skipped 0), and put the next good
    file in a bad one's place, in val and test too (scored twice)."""
    from test_audio import make_tones

    from onn.modalities import classification, get

    data = make_tones(tmp_path / "tones", per_class=4, speakers=("ann",))
    (data / "low_ann_9.wav").write_bytes(b"")
    (data / "mid_ann_9.wav").write_bytes(b"RIFF")
    given = (
        *("data=audio", "model=audio_cnn", f"data.source={data}", "data.label_from='^([a-z]+)_'"),
        *("data.num_workers=0", "data.sample_rate=8000", "data.clip_seconds=0.3", "data.val_split=0.25"),
        f"paths.cache={tmp_path / 'cache'}",
    )
    with pytest.raises(UserError, match=r"2 of 14 audio files could not be decoded .*data\.max_bad_fraction"):
        classification.setup_data(get("audio"), compose(*given, "data.resident=false"), "cpu")
    loose = (*given, "data.max_bad_fraction=0.2")
    streamed = classification.setup_data(get("audio"), compose(*loose, "data.resident=false"), "cpu")
    resident = classification.setup_data(get("audio"), compose(*loose, "data.resident=true"), "cpu")
    assert streamed.streamed and sorted(streamed.skipped) == ["low_ann_9.wav", "mid_ann_9.wav"]
    assert len(streamed.skipped) == len(resident.skipped)
    for split in ("train", "val"):  # the same items, held out alike
        items, index = streamed.streamed[split]
        assert [items.names[i] for i in index] == resident.splits[split].names, split
    labels = torch.cat([y for _, y in streamed.val_dataloader()])
    assert labels.tolist() == resident.splits["val"].labels.tolist()  # each item once, none standing in
    items, index = streamed.streamed["val"]
    (data / items.names[index[0]]).write_bytes(b"")  # broken after the check: named, not replaced
    with pytest.raises(UserError, match=rf"item {items.names[index[0]]} decoded when the run began"):
        list(streamed.val_dataloader())


def test_streamed_images_refuse_undecodable_files_above_max_bad_fraction(tmp_path):
    """The same check for images streamed item by item: a damaged PNG of 11 was silently replaced."""
    from onn.modalities.image.dataset import ImageDataModule

    for c in ("a", "b"):
        for i in range(5):
            square(tmp_path / "src" / c / f"{i}.png", (40 * i, 0, 0))
    (tmp_path / "src" / "a" / "broken.png").write_bytes(b"\x89PNG not an image")
    for bad, fails in ((0.01, True), (0.2, False)):
        given = ("data=image", f"data.source={tmp_path / 'src'}", "data.resident=false", "data.num_workers=0")
        cfg = compose(*given, f"data.max_bad_fraction={bad}", root=tmp_path)
        data = ImageDataModule(cfg.data, tmp_path / "cache")
        if fails:
            with pytest.raises(UserError, match=r"1 of 11 items could not be decoded \(first: .*broken\.png\)"):
                data.setup()
        else:
            data.setup()
            assert [s.rsplit("/", 1)[-1] for s in data.skipped] == ["broken.png"]
            assert sum(len(index) for _, index in data.streamed.values()) == 10
