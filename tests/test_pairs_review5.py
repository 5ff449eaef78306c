"""Review of paired data and dual encoders: task=infer embeds as validation does (the plan's mixed precision) and
names and pairs files in subfolders by their paths; a metadata file naming absent files says so; cut captions
are said."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import MODALITY_HARDWARE, compose

from onn.modalities.pairs.demo import write_shapes

SMALL = (
    "data.sides.image.image_size=[16,16]",
    "data.sides.text.max_length=32",
    "model.feature_dim=16",
    "model.embed_dim=8",
)


def run(tmp: Path, *overrides: str, name: str = "run", fixed: tuple[str, ...] = ()) -> tuple[dict, Path]:
    """The run `python run.py data=pairs model=dual_encoder OVERRIDES` makes, in tmp/name. `fixed` settings are
    composed before the overrides but not counted as the user's (the plan may still choose them)."""
    from onn.app import execute, given_keys

    cfg = compose(
        "data=pairs",
        "model=dual_encoder",
        MODALITY_HARDWARE,
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp / 'outputs'}",
        f"paths.cache={tmp / 'cache'}",
        "trainer.max_steps=-1",
        "trainer.max_epochs=1",
        "trainer.val_check_interval=1.0",
        "optim.warmup_steps=5",
        *fixed,
        *overrides,
    )
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return execute(cfg, run_dir, given_keys(list(overrides))), run_dir


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> tuple[Path, Path]:
    """A dual encoder trained one epoch under bf16-mixed on 12 shapes: (its run folder, a scratch folder)."""
    tmp = tmp_path_factory.mktemp("bf16")
    shapes = write_shapes(tmp / "shapes", 12, seed=0, size=16)
    _, run_dir = run(tmp, f"data.source={shapes}", "data.batch_size=4", "strategy.precision=bf16-mixed", *SMALL)
    return run_dir, tmp


class HeldOutEmbeddings(L.Callback):
    """The unit embeddings validation computed, taken before the module ranks and clears them."""

    def on_validation_epoch_end(self, trainer: L.Trainer, module) -> None:
        self.embeddings = [torch.cat(module._held_out[n]).float().cpu() for n in module.names]


def test_infer_scores_are_the_ones_validation_computes_under_bf16_mixed(bf16, tmp_path):
    """task=infer ranked with float32 towers while validation (and task=eval) ran them under the plan's bf16-mixed:
    its cosine scores were 1e-3 off the held-out ones, enough to put close calls the other way."""
    from onn.modalities.pairs.data import PairData
    from onn.modalities.pairs.tasks import load_trained, sides_of

    run_dir, _ = bf16
    held = write_shapes(tmp_path / "held", 8, seed=5, size=16)
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    for picture in held.glob("*.png"):
        shutil.copy(picture, pictures / picture.name)
    out, _ = run(
        tmp_path,
        "task=infer",
        f"ckpt={run_dir}",
        f"task.input={pictures}",
        f"task.gallery={held}",
        "task.top_k=8",
        "data.eval_batch_size=8",
        name="infer",
    )
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    captions = sorted(p.name for p in held.glob("*.txt"))
    inferred = torch.tensor([[{m["name"]: m["score"] for m in r["matches"]}[c] for c in captions] for r in rows])

    ckpt = run_dir / "checkpoints" / "last.ckpt"
    cfg = compose("data=pairs", "model=dual_encoder", f"data.source={held}", "data.eval_batch_size=8")
    module = load_trained(cfg, ckpt)
    data = PairData(
        replace(cfg, data=replace(cfg.data, modalities=list(module.names))), sides_of(cfg, ckpt), whole=True
    )
    held_out = HeldOutEmbeddings()
    trainer = L.Trainer(
        precision="bf16-mixed",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[held_out],
    )
    trainer.validate(module, datamodule=data, verbose=False)
    pictures_, texts = held_out.embeddings
    assert module.names == ("image", "text")
    assert (inferred - pictures_ @ texts.T).abs().max() < 2e-5  # the scores are written to 5 decimals


def test_infer_in_subfolders_names_files_by_their_path_and_pairs_them_within_their_folder(bf16, tmp_path):
    """Two folders of captions with the same stems (a/0000.txt, b/0000.txt): matches.jsonl named both 0000.txt, and
    every a/NNNN.png query took b/NNNN.txt (the last of the stem) for its partner, ranking and scoring the wrong one."""
    run_dir, tmp = bf16
    shapes = write_shapes(tmp_path / "shapes", 8, seed=2, size=16)
    gallery, queries = tmp_path / "gallery", tmp_path / "queries"
    for i in range(8):
        folder, stem = "ab"[i // 4], f"{i % 4:04d}"
        for root, suffix in ((gallery, ".txt"), (queries, ".png")):
            (root / folder).mkdir(parents=True, exist_ok=True)
            shutil.copy(shapes / f"{i:04d}{suffix}", root / folder / f"{stem}{suffix}")
    out, _ = run(tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={queries}", f"task.gallery={gallery}")
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert [r["query"] for r in rows] == [f"{f}/{i:04d}.png" for f in "ab" for i in range(4)]
    assert [r["partner"] for r in rows] == [f"{f}/{i:04d}.txt" for f in "ab" for i in range(4)]
    assert {m["name"] for r in rows for m in r["matches"]} <= {f"{f}/{i:04d}.txt" for f in "ab" for i in range(4)}
    # one picture of the gallery's own folder tree: its partner is the caption beside it
    shutil.copy(queries / "b" / "0003.png", gallery / "b" / "0003.png")
    out, _ = run(
        tmp_path,
        "task=infer",
        f"ckpt={run_dir}",
        f"task.input={gallery / 'b' / '0003.png'}",
        f"task.gallery={gallery}",
        name="one",
    )
    (row,) = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert row["query"] == "0003.png" and row["partner"] == "b/0003.txt"


def test_a_metadata_file_naming_files_that_are_not_there_says_so(tmp_path):
    """file_name paths relative to another folder (images/0000.png, the pictures beside the metadata file): the run
    stopped on 'no registered modality reads the files of column file_name (none found)', and a single absent file
    was an orphan whose 'file_name is missing' though the row names it."""
    from onn.errors import UserError
    from onn.modalities import detect
    from onn.modalities.pairs.detect import find_pairs

    shapes = write_shapes(tmp_path / "shapes", 6, seed=0, size=16)
    folder = tmp_path / "captioned"
    folder.mkdir()
    rows = [{"file_name": f"images/{i:04d}.png", "text": f"caption {i}"} for i in range(6)]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for i in range(6):
        shutil.copy(shapes / f"{i:04d}.png", folder / f"{i:04d}.png")
    said = r"none of the 6 files metadata.jsonl names is there \(e.g. metadata.jsonl line 1: images/0000.png does not"
    with pytest.raises(UserError, match=said):
        find_pairs(folder)
    with pytest.raises(UserError, match=said):  # data=auto says so too, rather than read a folder of pictures
        detect(folder)
    (folder / "images").mkdir()
    for i in range(5):
        shutil.move(folder / f"{i:04d}.png", folder / "images" / f"{i:04d}.png")
    listing = find_pairs(folder)
    assert listing.complete == 5
    assert (
        "metadata.jsonl line 6 (text) (its file_name is missing: images/0005.png does not exist)"
        in listing.orphans["text"]
    )


def test_captions_cut_at_max_length_bytes_are_said(tmp_path, caplog):
    """Captions longer than data.sides.text.max_length bytes (a CJK character is 3) were cut without a word, so pairs
    told apart only by their ends ("... on the left" / "... on the right") trained and ranked as one caption."""
    from onn.modalities.pairs.sides import build_side, side_config

    config = compose("data=pairs", "model=dual_encoder", "data.sides.text.max_length=16")
    side = build_side("text", side_config("text", config))
    (tmp_path / "long.txt").write_text("a red circle\n\non the left\n", encoding="utf-8")
    captions = [tmp_path / "long.txt", "a red circle", "赤い円が左にある"]  # 24, 12 and 24 bytes
    ids, index, skipped = side.read(captions)
    assert ids.shape == (3, 16) and index == [0, 1, 2] and not skipped
    assert "captions: 2 of 3 are longer than data.sides.text.max_length=16 bytes and are cut there" in caplog.text
    assert "the longest, 24 bytes:" in caplog.text
    side.read(captions)  # a second read (infer's next chunk of a gallery): said once, not once a chunk
    assert caplog.text.count("are longer than data.sides.text.max_length") == 1
