"""Paired data: pairs found by shared stems (folders, tar shards) and by metadata files, orphans counted
and named, data=auto choosing the pairs modality, and dual encoders trained on generated image-text and
mesh-image pairs to retrieval recall@1 of at least 5x chance, then evaluated, queried and exported."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import MODALITY_HARDWARE, ROOT, compose

from onn.errors import UserError
from onn.modalities.pairs.demo import write_primitives, write_shapes
from onn.modalities.pairs.detect import find_pairs
from onn.training.checkpoints import saved_config


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    return write_shapes(tmp_path_factory.mktemp("shapes"), 12, seed=0, size=16)


def test_pairs_by_shared_stem_with_orphans_and_other_files(shapes, tmp_path):
    folder = shutil.copytree(shapes, tmp_path / "pairs")
    (folder / "0000.txt").unlink()
    (folder / "0001.png").unlink()
    (folder / "0002.json").write_text("{}")  # a sidecar of neither side
    listing = find_pairs(folder)
    assert listing.modalities == ("image", "text") and listing.complete == 10
    assert listing.orphans == {"image": ["0000.png"], "text": ["0001.txt"]} and listing.left_out == ["0002.json"]
    assert listing.entries["text"][0].name == "0002.txt" and listing.entries["image"][0].name == "0002.png"
    summary = listing.summary()
    assert (
        "10 complete image-text pairs" in summary
        and "2 items have no partner (1 image, 1 text; e.g. 0000.png, 0001.txt)" in summary
    )


def test_pairs_inside_tar_shards_and_a_damaged_shard(shapes, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for k, names in enumerate((sorted(shapes.iterdir())[:12], sorted(shapes.iterdir())[12:])):
        with tarfile.open(shards / f"shard-{k:06d}.tar", "w") as tf:
            for path in names:
                tf.add(path, arcname=path.name)
    listing = find_pairs(shards)
    assert listing.complete == 12 and listing.keys[0] == "shard-000000.tar/0000" and not listing.orphan_count
    whole = (shards / "shard-000001.tar").read_bytes()
    (shards / "shard-000001.tar").write_bytes(whole[: len(whole) // 2])  # cut in the middle of a member
    listing = find_pairs(shards)
    assert 6 <= listing.complete < 12 and "shard shard-000001.tar is damaged" in listing.summary()


def test_pairs_in_a_shard_decode_aligned_and_an_unreadable_half_is_named(shapes, tmp_path):
    from onn.modalities.pairs.data import decode_pairs
    from onn.modalities.pairs.sides import build_side, side_config

    with tarfile.open(tmp_path / "shard.tar", "w") as tf:
        for path in sorted(shapes.iterdir()):
            tf.add(path, arcname=f"sample/{path.name}")
        broken = tmp_path / "0012.png"
        broken.write_bytes(b"\x89PNG\r\n\x1a\n broken")
        tf.add(broken, arcname="sample/0012.png")
        tf.add(shapes / "0000.txt", arcname="sample/0012.txt")
    listing = find_pairs(tmp_path / "shard.tar")
    assert listing.complete == 13
    cfg = compose(
        "data=pairs",
        "model=dual_encoder",
        "data.sides.image.image_size=[16,16]",
        "data.sides.text.max_length=48",
    )
    sides = {name: build_side(name, side_config(name, cfg)) for name in listing.modalities}
    with pytest.raises(UserError, match=r"1 of 13 pairs cannot be read \(first: shard.tar/sample/0012.png: "):
        decode_pairs(listing, sides, 0.05, "shard.tar")
    decoded = decode_pairs(listing, sides, 0.1, "shard.tar")
    images, texts = decoded["image"], decoded["text"]
    assert images.inputs.shape == (12, 3, 16, 16) and images.inputs.dtype == torch.uint8
    assert texts.inputs.shape == (12, 48) and texts.names == images.names == [
        f"shard.tar/sample/{i:04d}" for i in range(12)
    ]
    caption = bytes(int(t) for t in texts.inputs[5] if t < 256).decode()
    assert caption == (shapes / "0005.txt").read_text().strip()  # row 5 of both sides is pair 0005
    assert len(images.skipped) == 1 and images.skipped[0].startswith("shard.tar/sample/0012.png: ")


def test_pairs_from_metadata_jsonl_and_csv(shapes, tmp_path):
    folder = tmp_path / "meta"
    (folder / "images").mkdir(parents=True)
    rows = []
    for i in range(12):
        shutil.copy(shapes / f"{i:04d}.png", folder / "images" / f"{i:04d}.png")
        rows.append(
            {
                "file_name": f"images/{i:04d}.png",
                "caption": (shapes / f"{i:04d}.txt").read_text().strip(),
                "id": i,
            }
        )
    rows.append({"file_name": "images/missing.png", "caption": "a caption without its picture", "id": 12})
    rows[3]["caption"] = ""  # a picture without its caption
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    shutil.copy(shapes / "0000.png", folder / "images" / "unlisted.png")
    listing = find_pairs(folder)
    assert listing.modalities == ("image", "text") and listing.complete == 11
    assert listing.how == "metadata.jsonl (file_name + caption)"
    assert listing.entries["text"][0].text == rows[0]["caption"]
    assert len(listing.orphans["text"]) == 1 and "its file_name is missing" in listing.orphans["text"][0]
    assert {o.split(" ")[0] for o in listing.orphans["image"]} == {"images/0003.png", "images/unlisted.png"}
    (folder / "metadata.jsonl").unlink()
    lines = ["file_name,label,text"] + [f'images/{i:04d}.png,{i},"{rows[i]["caption"]}"' for i in range(12)]
    (folder / "metadata.csv").write_text("\n".join(lines) + "\n")
    listing = find_pairs(folder)
    # label is a number, not a caption
    assert listing.complete == 11 and listing.how == "metadata.csv (file_name + text)"
    (folder / "metadata.csv").write_text("file_name,label\n" + "\n".join(f"images/{i:04d}.png,{i}" for i in range(12)))
    with pytest.raises(UserError, match="no text column to pair with file_name"):
        find_pairs(folder)


def test_files_with_a_label_column_are_classification_data_not_pairs(tmp_path):
    """An audiofolder-style manifest (file_name + label "dog"/"cat") was taken by data=auto for audio-text pairs,
    its class names as captions: a dual encoder trained where a classifier was meant. A label column is a class;
    data.text_column=label still pairs the files with their class names."""
    import numpy as np
    import soundfile as sf

    from onn.modalities.registry import detect

    rows = []
    for i in range(8):
        wave = np.sin(np.arange(4000) * (0.05 if i % 2 else 0.2)).astype(np.float32)
        sf.write(tmp_path / f"clip{i}.wav", wave, 8000)
        rows.append({"file_name": f"clip{i}.wav", "label": "dog" if i % 2 else "cat"})
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert detect(tmp_path)[0].name == "audio"
    with pytest.raises(UserError, match=r"or set data\.text_column=label to pair each file with its class name"):
        find_pairs(tmp_path)
    assert find_pairs(tmp_path, text_column="label").complete == 8
    for row in rows:  # another text column beside the label (a speaker's id) is no caption either
        row["speaker_id"] = "a0f9c2"
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert detect(tmp_path)[0].name == "audio"
    for row in rows:  # a caption named as one still pairs
        row["caption"] = "a dog barking"
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert find_pairs(tmp_path).how == "metadata.jsonl (file_name + caption)"


def test_data_auto_says_what_pairs_it_found(shapes, tmp_path):
    from onn.modalities import detect

    modality, reason = detect(shapes)
    assert modality.name == "pairs" and reason == "12 complete image-text pairs by shared file stems"
    # class folders of pictures, one sidecar caption: an image dataset, not pairs
    classes = tmp_path / "classes"
    for i in range(12):
        (classes / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        shutil.copy(shapes / f"{i:04d}.png", classes / f"c{i % 2}" / f"{i:04d}.png")
    shutil.copy(shapes / "0000.txt", classes / "c0" / "0000.txt")
    assert detect(classes)[0].name == "image"


def run(tmp: Path, *overrides: str, name: str = "run") -> tuple[dict, Path]:
    from onn.app import execute, given_keys

    cfg = compose(
        "data=pairs",
        "model=dual_encoder",
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp / 'outputs'}",
        f"paths.cache={tmp / 'cache'}",
        "trainer.max_steps=-1",
        "trainer.max_epochs=2",
        "trainer.val_check_interval=1.0",
        "optim.warmup_steps=5",
        "strategy.precision=32-true",
        *overrides,
    )
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return execute(cfg, run_dir, given_keys(list(overrides))), run_dir  # the keys a command line would set


@pytest.mark.modalities
@pytest.mark.slow
def test_image_text_pairs_half_orphaned_train_to_5x_chance_then_infer_eval_export(tmp_path, capsys, caplog):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from onn.app import compose_detected, execute, to_config
    from onn.config import register

    folder = write_shapes(tmp_path / "pairs", 450, seed=0, size=24)
    for i in range(150, 300):  # half of the files have no partner: 150 pictures and 150 captions lose theirs
        (folder / f"{i:04d}.txt").unlink()
        (folder / f"{i + 150:04d}.png").unlink()
    # one complete pair with an unreadable half
    (folder / "0007.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")

    register()
    overrides = [
        "data=auto",
        f"data.source={folder}",
        f"paths.root={ROOT}",
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.cache={tmp_path / 'cache'}",
        "trainer.max_steps=-1",
        "trainer.max_epochs=8",
        "trainer.val_check_interval=1.0",
        "data.batch_size=24",
        "optim.warmup_steps=5",
        "strategy.precision=32-true",
        "data.sides.image.image_size=[24,24]",
        "export=onnx",
    ]
    # data=auto's own config has only a source: the other data.* keys apply once the pairs config is chosen
    first = [o for o in overrides if not o.startswith("data.") or o.startswith("data.source=")]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose_detected(hydra_compose("config", overrides=first), overrides)
    said = capsys.readouterr().out
    assert (
        "holds 150 complete image-text pairs by shared file stems; 300 items have no partner (150 image, 150 text; "
        "e.g. 0150.png, 0300.txt" in said
    )
    assert "data=pairs model=dual_encoder" in said
    run_dir = tmp_path / "train"
    metrics = execute(to_config(cfg), run_dir)

    assert metrics["modality"] == "pairs" and metrics["pairs/modalities"] == ["image", "text"]
    assert metrics["pairs/complete"] == 150 and metrics["pairs/orphans"] == 300 and metrics["pairs/unreadable"] == 1
    assert "0007.png" in caplog.text and "300 items have no partner" in caplog.text
    # the 32 held out by their names' draw hold 21 texts: identical captions are one right answer (chance 1 in 16)
    assert metrics["pairs/held_out"] == 32 and metrics["val/recall@1_chance"] == pytest.approx(1 / 16, abs=1e-4)
    assert metrics["train/loss_final"] < metrics["train/loss_initial"]
    assert metrics["val/recall@1"] >= 5 * metrics["val/recall@1_chance"], metrics["val/history"]
    # what a resume builds its optimizer from: the checkpoint's optimizer state belongs to these settings
    assert saved_config(run_dir / "checkpoints" / "last.ckpt")["optim"]["warmup_steps"] == 5
    for side in ("image", "text"):
        assert metrics[f"export/max_abs_diff/{side}"] < 1e-4 and Path(metrics[f"export/onnx/{side}"]).is_file()

    queries = tmp_path / "queries"
    queries.mkdir()
    for i in range(20):
        shutil.copy(folder / f"{i:04d}.png", queries / f"{i:04d}.png")
    out, _ = run(
        tmp_path,
        "task=infer",
        f"ckpt={run_dir}",
        f"task.input={queries}",
        f"task.gallery={folder}",
        name="infer",
    )
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert out["infer/queries"] == 19 and out["infer/gallery"] == 300  # 0007.png cannot be read; 300 captions
    assert all(
        r["modality"] == "image" and len(r["matches"]) == 5 and r["matches"][0]["name"].endswith(".txt") for r in rows
    )
    assert out["infer/recall@5"] > 5 * 5 / 300  # each query's own caption is among 300
    out, _ = run(
        tmp_path,
        "task=infer",
        f"ckpt={run_dir}",
        f"task.gallery={folder}",
        "prompt=a red square at the top",
        name="text",
    )
    (row,) = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert row["modality"] == "text" and all(m["name"].endswith(".png") for m in row["matches"])

    evaluated, _ = run(tmp_path, "task=eval", f"ckpt={run_dir / 'checkpoints' / 'best.ckpt'}", name="eval")
    # the same held-out pairs
    assert evaluated["val/recall@1"] == pytest.approx(metrics["val/recall@1"], abs=1e-6)


@pytest.mark.slow
def test_mesh_image_pairs_train_to_5x_chance(tmp_path):
    folder = write_primitives(tmp_path / "pairs", 150, seed=0, size=24)
    metrics, _ = run(
        tmp_path,
        f"data.source={folder}",
        "data.batch_size=24",
        "trainer.max_epochs=12",  # 8 left recall@1 at 4.5x chance with one seed's batch orders (0.15 vs 0.167)
        "data.sides.image.image_size=[24,24]",
        "+data.sides.mesh.augment={rotate: none, scale: [0.9, 1.1], jitter: 0.01}",
        "data.sides.mesh.points=128",
    )
    assert metrics["pairs/modalities"] == ["image", "mesh"] and metrics["pairs/complete"] == 150
    assert metrics["val/recall@1"] >= 5 * metrics["val/recall@1_chance"], metrics["val/history"]


def test_pairs_settings_are_checked_first(tmp_path):
    with pytest.raises(UserError, match="data.modalities: sound is not a modality a pair can have"):
        run(tmp_path, "data.source=/nowhere", "data.modalities=[image,sound]")
    with pytest.raises(UserError, match="a contrastive batch needs 2 pairs or more"):
        run(tmp_path, "data.source=/nowhere", "data.batch_size=1")
    with pytest.raises(UserError, match="data.val_source=/elsewhere is what task=eval of paired data scores"):
        run(tmp_path, "data.source=/nowhere", "data.val_source=/elsewhere")  # training would not read it
    with pytest.raises(UserError, match="is not a dual encoder"):
        run(tmp_path, "data.source=/nowhere", "model=v28_cnn")


def test_a_metadata_line_that_is_not_json_is_named(tmp_path):
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "x"}\n{broken\n')
    with pytest.raises(UserError, match=r"metadata.jsonl line 2 is not valid JSON"):
        find_pairs(tmp_path)


@pytest.fixture(scope="module")
def tiny(shapes, tmp_path_factory) -> tuple[Path, Path]:
    """A dual encoder trained one epoch on the 12 shapes (16x16): (its run folder, a scratch folder)."""
    tmp = tmp_path_factory.mktemp("tiny")
    _, run_dir = run(
        tmp,
        MODALITY_HARDWARE,
        f"data.source={shapes}",
        "data.batch_size=4",
        "trainer.max_epochs=1",
        "data.sides.image.image_size=[16,16]",
        "data.sides.text.max_length=32",
        "model.feature_dim=16",
        "model.embed_dim=8",
        name="train",
    )
    return run_dir, tmp


def test_infer_breaks_ties_against_the_partner_as_validation_does(shapes, tiny, tmp_path, monkeypatch):
    """Ten captions against ten copies of one picture: every score of a row is equal, so the partner ranks by its
    place in the gallery (module.ranks' rule), recall@1 is chance, and the matches list agrees with the ranks."""
    run_dir, _ = tiny
    # one thread: with two, oneDNN's blocking put the copies' embeddings up to 6e-8 apart on an AMD EPYC (no tie)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    queries, gallery = tmp_path / "queries", tmp_path / "gallery"
    queries.mkdir()
    gallery.mkdir()
    for i in range(10):
        shutil.copy(shapes / f"{i:04d}.txt", queries / f"{i:04d}.txt")
        shutil.copy(shapes / "0000.png", gallery / f"{i:04d}.png")
    # one embedding batch: batches of another size may round the same picture's embedding apart
    out, _ = run(
        tmp_path,
        MODALITY_HARDWARE,
        "task=infer",
        f"ckpt={run_dir}",
        f"task.input={queries}",
        f"task.gallery={gallery}",
        "data.eval_batch_size=10",
    )
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert out["infer/recall@1"] == pytest.approx(0.1) and out["infer/recall@5"] == pytest.approx(0.5)
    # captions 0007 and 0008 read alike ("a green triangle at the top"): as task=eval counts such pairs, 0007.png is
    # as right for query 0008 as its own picture, and stands for it at place 8
    assert [r["partner_rank"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8, 8, 10]
    assert all([m["name"] for m in r["matches"]] == [f"{i:04d}.png" for i in range(5)] for r in rows)


def test_eval_on_a_data_source_given_scores_every_pair_of_it(tiny):
    run_dir, tmp = tiny
    other = write_shapes(tmp / "other", 10, seed=3, size=16)
    out, _ = run(tmp, MODALITY_HARDWARE, "task=eval", f"ckpt={run_dir}", f"data.source={other}", name="eval_other")
    assert out["pairs/complete"] == 10 and out["pairs/held_out"] == 10 and out["pairs/train"] == 0
    assert out["val/recall@1_chance"] == pytest.approx(0.1)
    own, _ = run(
        tmp, MODALITY_HARDWARE, "task=eval", f"ckpt={run_dir}", name="eval_own"
    )  # its own data: the seeded held-out pairs (drawn by name: 3 of the 12 at data.val_split 0.1)
    assert own["pairs/held_out"] == 3 and own["pairs/train"] == 9


@pytest.mark.slow  # (10 to 50 s: two towers traced to ONNX and checked in onnxruntime)
def test_an_onnx_export_output_file_name_is_the_folder_of_the_towers(tiny):
    run_dir, tmp = tiny
    (tmp / "exports").mkdir()
    out, _ = run(
        tmp, "task=export", "export=onnx", f"ckpt={run_dir}", f"export.output={tmp / 'exports' / 'towers.onnx'}"
    )
    assert sorted(p.name for p in (tmp / "exports").iterdir()) == ["towers"]
    assert sorted(p.name for p in (tmp / "exports" / "towers").iterdir()) == [
        "image.onnx",
        "onn_export.json",
        "text.onnx",
    ]
    assert Path(out["export/onnx/text"]).parent == tmp / "exports" / "towers"


@pytest.mark.slow  # (about 30 s: a second training, then three towers traced to ONNX and checked)
def test_a_failed_re_export_leaves_the_earlier_towers_together(shapes, tiny, tmp_path, monkeypatch):
    """The towers are written beside the export folder, which they replace only once every tower passed: the disk
    filling up while another training's second tower is written leaves the earlier export's two towers, not one
    tower of each training, and nothing beside them; the message names the folder, not the staged one."""
    import errno

    from torch.onnx import ONNXProgram

    first, _ = tiny
    towers = tmp_path / "towers"
    run(tmp_path, "task=export", "export=onnx", f"ckpt={first}", f"export.output={towers}", name="export1")
    before = {p.name: p.read_bytes() for p in towers.iterdir()}
    assert {"image.onnx", "text.onnx"} <= set(before)
    _, second = run(
        tmp_path,
        f"data.source={shapes}",
        "data.batch_size=4",
        "trainer.max_epochs=1",
        "data.sides.image.image_size=[16,16]",
        "data.sides.text.max_length=32",
        "model.feature_dim=16",
        "model.embed_dim=8",
        "seed=1",
        name="train2",
    )
    saves, save = [], ONNXProgram.save

    def disk_fills_on_the_second_tower(program, path, *args, **kwargs):
        saves.append(path)
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return save(program, path, *args, **kwargs)

    monkeypatch.setattr(ONNXProgram, "save", disk_fills_on_the_second_tower)
    with pytest.raises(UserError, match=rf"cannot write {towers}/text.onnx: the disk is full"):
        run(tmp_path, "task=export", "export=onnx", f"ckpt={second}", f"export.output={towers}", name="export2")
    assert {p.name: p.read_bytes() for p in towers.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staged folder left


def test_infer_on_a_query_that_does_not_decode_names_the_users_file(shapes, tiny, tmp_path, caplog):
    """A picture query of which nothing decodes: the sentence names the user's file, not the folder of links the
    side reads it through (/tmp/onn-pairs-...), with data.max_bad_fraction advice that cannot help."""
    run_dir, _ = tiny
    queries, gallery = tmp_path / "queries", tmp_path / "gallery"
    queries.mkdir()
    gallery.mkdir()
    (queries / "bad.png").write_bytes(b"not a picture")
    for i in range(3):
        shutil.copy(shapes / f"{i:04d}.txt", gallery / f"{i:04d}.txt")
    with pytest.raises(UserError, match="no query or no gallery item could be read") as refused:
        run(
            tmp_path,
            MODALITY_HARDWARE,
            "task=infer",
            f"ckpt={run_dir}",
            f"task.input={queries}",
            f"task.gallery={gallery}",
        )
    assert "bad.png: not a readable image file" in caplog.text
    assert "onn-pairs-" not in caplog.text + str(refused.value)
