"""SAM2, Grounded SAM2 and TrOCR as pipelines of .omny pieces (onn/export/pipelines), at their test sizes:
each piece agrees with PyTorch on inputs it was not traced with, splits where its .omny says, and the pipelines
run end to end in onnxruntime on pictures; bad pictures, points, prompts and pipelines are one sentence."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose

from onn.config.convert import typed
from onn.config.model import LanguageModelConfig
from onn.errors import UserError
from onn.export.pipelines import Request, export_pipeline, for_model, run_pipeline, validate_pipeline
from onn.export.pipelines.grounding_dino import text_masks
from onn.export.pipelines.ocr import lines
from onn.models.load import load

LIMITS = {"max_shard_size_mb": 2.0, "min_vram_mb": 8.0, "headroom_mb": 0.5}  # tiny models: several shards


def _export(name: str, folder: Path, side: int | None = None):
    config = compose(f"model={name}", "export=omny")
    model, tokenizer = load(config.model)
    models = [model]
    if config.model.segmenter:
        models.append(load(typed(LanguageModelConfig, config.model.segmenter, "model.segmenter"))[0])
    pipeline = for_model(model, len(models))
    metrics = export_pipeline(pipeline, models, folder, config.export, LIMITS, name, tokenizer, side=side)
    return models, Path(metrics["export/pipeline"]), metrics


def _grounded(folder: Path):
    return _export("grounded_sam2_mini", folder, side=224)


def _trocr(run_dir: Path):
    """TrOCR exported as `python run.py task=export export=omny model=trocr_mini` does (the app, in this process)."""
    from onn.app import execute

    config = compose(
        "task=export",
        "export=omny",
        "model=trocr_mini",
        "hardware=cpu_16gb",
        "tracking=none",
        f"paths.outputs={run_dir}",
    )
    metrics = execute(config, run_dir)
    model, _ = load(compose("model=trocr_mini").model)  # the same seeded weights
    # from_config builds in training mode: generate() would draw dropout (0.1) from the global RNG
    return [model.eval()], run_dir / "export" / "pipeline.json", metrics


def _photo(folder: Path) -> Path:
    """A 400 x 300 picture (not the models' square size) with a red block on a blue background."""
    from PIL import Image

    pixels = np.zeros((300, 400, 3), np.uint8)
    pixels[:] = (120, 160, 200)
    pixels[100:220, 150:300] = (200, 60, 40)
    path = folder / "photo.jpg"
    Image.fromarray(pixels).save(path)
    return path


def _splits_and_connects(exported) -> None:
    """Every piece splits where its .omny says, within the shard limit, and the pieces connect."""
    _, path, metrics = exported
    lines_ = []
    assert validate_pipeline(path, echo=lines_.append), "\n".join(lines_)
    for name, figures in metrics["export/pieces"].items():
        assert figures["max_abs_diff"] <= 1e-4 and figures["cut_points"] >= 1, (name, figures)
        assert max(figures["shard_counts"]) >= 2 and figures["largest_shard_mb_any_plan"] <= LIMITS["max_shard_size_mb"]


def _hiera_cuts_carry_stage_outputs(grounded) -> None:
    import onnx

    doc = json.loads(grounded[1].read_text())
    assert [p["name"] for p in doc["pieces"]] == ["detector", "image_encoder", "prompt_decoder"]
    # Hiera's stage outputs wait for the neck: its cuts carry them
    encoder = json.loads(onnx.load(str(grounded[1].parent / "image_encoder.omny")).metadata_props[0].value)
    assert any("crossing" in c for c in encoder["cut_points"])


def _sam2_decoder_takes_any_number_of_prompts_as_pytorch_does(grounded) -> None:
    """Traced with two prompts of two points; asked three prompts of three points (one padded), it matches."""
    from onn.export.pipelines.runtime import Pieces

    (_, sam), path, _ = grounded
    pieces = Pieces(json.loads(path.read_text()), path.parent)
    pixels = torch.randn(1, 3, 256, 256, generator=torch.Generator().manual_seed(3))
    features = pieces.run("image_encoder", {"pixel_values": pixels.numpy()})
    points = torch.tensor(
        [[[[30.0, 40.0], [0, 0], [0, 0]], [[100, 120], [10, 200], [0, 0]], [[5, 5], [250, 250], [90, 9]]]]
    )
    labels = torch.tensor([[[1, -10, -10], [1, 0, -10], [2, 3, 1]]])
    got = pieces.run("prompt_decoder", features | {"input_points": points.numpy(), "input_labels": labels.numpy()})
    with torch.no_grad():
        maps = [torch.from_numpy(features[k]) for k in ("high_res_feats_0", "high_res_feats_1", "image_embeddings")]
        want = sam(image_embeddings=maps, input_points=points, input_labels=labels, multimask_output=True)
    assert got["pred_masks"].shape == (1, 3, 3, 64, 64)
    np.testing.assert_allclose(got["pred_masks"], want.pred_masks.numpy(), atol=1e-4)
    np.testing.assert_allclose(got["iou_scores"], want.iou_scores.numpy(), atol=1e-4)


def _ocr_decoder_with_explicit_past_reads_the_tokens_generate_reads(trocr) -> None:
    """Greedy decoding through the exported encoder and decoder, one token a step with the keys and values carried
    by hand, gives transformers' generate()'s tokens on the same line."""
    from PIL import Image

    from onn.export.pipelines.ocr import read_line
    from onn.export.pipelines.runtime import Pieces

    (model,), path, _ = trocr
    doc = json.loads(path.read_text())
    crop = Image.fromarray(np.random.default_rng(1).integers(0, 255, (40, 200, 3), dtype=np.uint8))
    tokens = read_line(Pieces(doc, path.parent), crop, {**doc["settings"], "max_new_tokens": 6})
    from onn.export.pipelines.images import normalised

    s = doc["settings"]
    pixels = torch.from_numpy(normalised(crop, (s["image_size"],) * 2, s["mean"], s["std"]))
    with torch.no_grad():
        want = model.generate(pixel_values=pixels, max_new_tokens=6, do_sample=False, num_beams=1)
    assert [s["start_token"], *tokens] == want[0, : len(tokens) + 1].tolist()


class _Blocks(torch.nn.Module):
    """A stack of residual MLP blocks: a piece that exports in seconds, with a cut point between blocks."""

    def __init__(self, width: int, blocks: int, broken: bool = False, dies_in: int | None = None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(blocks)
        )
        self.broken, self.dies_in = broken, dies_in  # dies_in: a process other than this one, killed as by OOM

    def forward(self, features):
        if self.broken:
            raise ValueError("a shape this piece does not take")
        if self.dies_in is not None and os.getpid() != self.dies_in:
            os.kill(os.getpid(), signal.SIGKILL)
        for block in self.blocks:
            features = features + block(features)
        return {"hidden": features}


def _block_pieces(broken: bool = False, dies_in: int | None = None):
    from onn.export.pipelines.registry import Piece

    torch.manual_seed(0)
    sizes = [(32, 3), (16, 2)]
    return [
        Piece(
            f"piece{i}",
            _Blocks(width, blocks, broken and i == 0, dies_in if i == 1 else None).eval(),
            {"features": torch.randn(2, width)},
            runs=[[f"blocks.{b}" for b in range(blocks)]],
        )
        for i, (width, blocks) in enumerate(sizes)
    ]


def test_pieces_exported_side_by_side_are_the_pieces_exported_one_by_one(tmp_path, monkeypatch, caplog):
    """Forked processes (export_processes: one per free core) write what this process writes; a piece's failure
    in one of them is its own sentence here; one killed leaves its pieces to this process and nothing
    half-written; no more processes start than free cores and memory allow."""
    from onn.export.pipelines import export as piece_export

    settings = compose("export=omny").export

    def jobs(pieces, folder: Path):
        folder.mkdir()
        return [(p, folder, settings, LIMITS, piece_export._source(p, "blocks")) for p in pieces]

    here = piece_export._export_all(jobs(_block_pieces(), tmp_path / "here"), processes=1)
    forked = piece_export._export_all(jobs(_block_pieces(), tmp_path / "forked"), processes=2)
    assert [path.name for path, _, _ in forked] == ["piece0.omny", "piece1.omny"]
    for (_, a, signature_a), (path, b, signature_b) in zip(here, forked, strict=True):
        assert path.parent == tmp_path / "forked" and path.is_file()
        assert signature_a == signature_b and a["bytes"] == b["bytes"] and a["cut_points"] == b["cut_points"] >= 1
        assert a["max_abs_diff"] == b["max_abs_diff"] <= 1e-4
    with pytest.raises(UserError, match="_Blocks fails on the sample input .* a shape this piece does not take"):
        piece_export._export_all(jobs(_block_pieces(broken=True), tmp_path / "broken"), processes=2)
    assert not (tmp_path / "broken" / "piece0.omny").exists()

    killed = tmp_path / "killed"
    with caplog.at_level(logging.WARNING, logger="onn"):
        survived = piece_export._export_all(jobs(_block_pieces(dies_in=os.getpid()), killed), processes=2)
    assert [figures["max_abs_diff"] for _, figures, _ in survived] == [a["max_abs_diff"] for _, a, _ in here]
    assert sorted(p.name for p in killed.iterdir()) == ["piece0.omny", "piece1.omny"]  # no temp folder left
    if piece_export.can_fork():  # else (CUDA initialised by an earlier test) all ran here, none was killed
        assert re.search(r"the processes exporting (piece0, )?piece1 ended without a result", caplog.text)

    pieces = _block_pieces()
    monkeypatch.setattr(piece_export, "can_fork", lambda: True)
    monkeypatch.setattr(piece_export, "cpu_busy_cores", lambda seconds: 1.0)
    monkeypatch.setattr(piece_export.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert piece_export.export_processes(pieces[:1]) == 1
    assert piece_export.export_processes(pieces) == 2  # 7 cores free, 2 pieces
    monkeypatch.setattr(piece_export.os, "sched_getaffinity", lambda pid: {0, 1})
    assert piece_export.export_processes(pieces) == 1  # 1 core free
    monkeypatch.setattr(piece_export.os, "sched_getaffinity", lambda pid: set(range(8)))
    # room for less than one more process's export (the memory the cgroup, or else the host, leaves)
    monkeypatch.setattr(piece_export, "available_memory_mb", lambda: piece_export.TRACER_MB)
    assert piece_export.export_processes(pieces) == 1


class _TiedChoice(torch.nn.Module):
    """Keeps the best 4 of 12 scores, six of them tied, and returns what it kept: PyTorch here breaks the ties
    towards the last index, the exported graph (ONNX's TopK) towards the first, as torch.topk and onnxruntime
    may on a real detector's near-tied scores. `given`: the indices to keep instead (choosing)."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(3, 3)
        self.given = None

    @contextlib.contextmanager
    def choosing(self, outputs):
        self.given = torch.as_tensor(outputs["kept"])
        try:
            yield
        finally:
            self.given = None

    def forward(self, scores, features):
        if self.given is not None:
            kept = self.given
        elif torch.compiler.is_exporting():
            kept = scores.topk(4).indices
        else:
            kept = scores.shape[1] - 1 - scores.flip(1).topk(4).indices
        return {"kept": kept, "picked": self.head(features.gather(1, kept[..., None].expand(-1, -1, 3)))}


def test_a_piece_that_chooses_among_ties_is_checked_on_onnxruntimes_choice(tmp_path):
    """A piece's `follow` makes PyTorch take the choice onnxruntime took before the two are compared: without it,
    the same tied scores fail the export check."""
    from onn.export.pipelines import export as piece_export
    from onn.export.pipelines.registry import Piece

    settings = compose("export=omny").export
    scores = torch.tensor([[0.5, 0.9, 0.9, 0.1, 0.9, 0.2, 0.9, 0.9, 0.3, 0.9, 0.0, 0.4]])
    features = torch.randn(1, 12, 3, generator=torch.Generator().manual_seed(0))
    module = _TiedChoice().eval()
    piece = Piece("chooser", module, {"scores": scores, "features": features}, follow=module.choosing)
    source = piece_export._source(piece, "chooser")
    with pytest.raises(UserError, match="ONNX output 'picked' of _TiedChoice differs from PyTorch"):
        piece_export.export_piece(replace(piece, follow=None), tmp_path, settings, LIMITS, source)
    path, figures, _ = piece_export.export_piece(piece, tmp_path, settings, LIMITS, source)
    assert figures["max_abs_diff"] <= 1e-6
    from onn.export.onnx_export import run_onnx

    assert run_onnx(path, piece.sample)["kept"].tolist() == [[1, 2, 4, 6]]


def test_grounding_dino_takes_given_proposals_only_when_they_are_a_top_k():
    """The detector returns the proposals its queries started from; made to take others (onnxruntime's, in the
    export check) it takes them when they are a top-k of its own scores, and otherwise says so."""
    config = compose("model=grounding_dino_mini", "export=omny")
    model, _ = load(config.model)
    detector = for_model(model).pieces(model, side=224)[0]
    with torch.no_grad():
        chosen = detector.module(**detector.sample)
        reordered = chosen["proposals"].flip(1)  # the same top-k, the queries in another order
        with detector.follow({"proposals": reordered.numpy()}):
            again = detector.module(**detector.sample)
        assert torch.equal(again["proposals"], reordered)
        # each query slot has its own embedding: reordered queries are not the same queries reordered
        assert not torch.allclose(again["logits"].flip(1), chosen["logits"], atol=1e-3)
        text = ("pixel_values", "pixel_mask", "input_ids", "attention_mask", "token_type_ids")
        scores = model(**{k: detector.sample[k] for k in text}).enc_outputs_class.max(-1).values
        k = chosen["proposals"].shape[1]
        assert torch.equal(chosen["proposals"], scores.topk(k).indices)  # the proposals are the query selection's
        worst = scores.argsort(1)[:, :k]
        for bad, match in (
            (worst, f"PyTorch scores .* below its own top {k}"),
            (chosen["proposals"][:, :1].repeat(1, k), "with repeats or another shape"),
            (chosen["proposals"][:, :-1], "with repeats or another shape"),
        ):
            with pytest.raises(UserError, match=match), detector.follow({"proposals": bad.numpy()}):
                detector.module(**detector.sample)


def test_grounding_dino_text_masks_are_transformers_own():
    from transformers.models.grounding_dino.modeling_grounding_dino import (
        SPECIAL_TOKENS,
        generate_masks_with_special_tokens_and_transfer_map,
    )

    ids = np.array([[101, 7, 8, 1012, 9, 1012, 102, 0], [101, 5, 1029, 6, 6, 6, 1012, 102]])
    masks, positions = text_masks(ids)
    want_masks, want_positions = generate_masks_with_special_tokens_and_transfer_map(
        torch.from_numpy(ids), torch.tensor(SPECIAL_TOKENS)
    )
    assert (masks == want_masks.numpy()).all() and (positions == want_positions.numpy()).all()


def _grounded_runs_on_a_photo(grounded, photo, tmp_path) -> None:
    from PIL import Image

    _, path, _ = grounded
    found = run_pipeline(path, Request(photo, tmp_path / "grounded.png", "a red block. the sky."))
    assert Image.open(found["png"]).size == (400, 300) and found["objects"]
    assert all(len(o["box"]) == 4 and "mask" in o for o in found["objects"])


def _pieces_run_at_their_reference_shapes(exported) -> None:
    """Each piece runs at the shapes its .omny's figures are estimated (and recipe=bench_omny measures) at: the
    decoder's positions there (its traced past plus the reference sequence) lie within its position table."""
    from onn.export.omny.format import read_document
    from onn.export.onnx_export import run_onnx
    from onn.export.pipelines.measure import reference_feeds

    _, path, _ = exported
    for piece in json.loads(path.read_text())["pieces"]:
        file = path.parent / piece["file"]
        outputs = run_onnx(file, reference_feeds(read_document(file)))
        assert all(np.isfinite(v).all() for v in outputs.values()), piece["name"]


def _ocr_reads_a_page(trocr, tmp_path) -> None:
    page = _page(tmp_path / "page.png")
    read = run_pipeline(trocr[1], Request(page, tmp_path / "page.result.png"))
    assert len(read["lines"]) == 3  # the page's three lines of print, each read
    assert json.loads(Path(read["json"]).read_text())["lines"][0]["token_ids"]


def _page(path: Path) -> Path:
    from PIL import Image, ImageDraw, ImageFont

    page = Image.new("RGB", (500, 300), "white")
    draw = ImageDraw.Draw(page)
    for k, line in enumerate(("The first line", "a second one", "and the third.")):
        draw.text((30, 30 + 90 * k), line, fill="black", font=ImageFont.load_default(size=30))
    page.save(path)
    return path


def test_page_lines_are_the_bands_of_ink():
    gray = np.full((100, 80), 255.0)
    gray[10:20, 5:60] = 0
    gray[50:62, 10:70] = 0
    assert [(y0 <= 10 and y1 >= 20, y0 <= 50 and y1 >= 62) for _, y0, _, y1 in lines(gray)] == [
        (True, False),
        (False, True),
    ]
    assert lines(np.full((30, 30), 255.0)) == []  # a blank page: no line


def _bad_input_is_one_sentence(grounded, photo, tmp_path) -> None:
    from PIL import Image

    _, path, _ = grounded
    folder = path.parent
    with pytest.raises(UserError, match="empty"):
        run_pipeline(path, Request(photo, tmp_path / "x.png", "   "))
    floats = tmp_path / "depth.tiff"
    Image.fromarray(np.ones((20, 30), np.float32), mode="F").save(floats)
    with pytest.raises(UserError, match="mode F"):
        run_pipeline(path, Request(floats, tmp_path / "x.png", "a cat."))
    doc = json.loads(path.read_text())
    sam2 = {
        **doc,
        "kind": "sam2",
        "pieces": doc["pieces"][1:],
        "connections": doc["connections"][1:],
        "settings": doc["settings"]["segmenter"],
    }
    (folder / "sam2.json").write_text(json.dumps(sam2))
    with pytest.raises(UserError, match="outside the image"):
        run_pipeline(folder / "sam2.json", Request(photo, tmp_path / "x.png", points=[(400.0, 10.0)]))
    found = run_pipeline(folder / "sam2.json", Request(photo, tmp_path / "ok.png", points=[(399.0, 10.0)]))
    assert found["masks"][0]["area"] >= 0  # a point on the edge is inside
    sam2["connections"][0] = {
        "from": "image_encoder.high_res_feats_0",
        "to": "prompt_decoder.image_embeddings",
        "via": "",
    }
    (folder / "broken.json").write_text(json.dumps(sam2))
    with pytest.raises(
        UserError, match="image_encoder's output high_res_feats_0 .* does not fit prompt_decoder's input"
    ):
        validate_pipeline(folder / "broken.json")


def _the_cli_validates_and_runs_a_pipeline(trocr, tmp_path) -> None:
    from onn.export.omny.cli import main

    _, pipeline, metrics = trocr
    assert set(metrics["export/pieces"]) == {"encoder", "decoder"} and metrics["modality"] == "text"
    assert main(["validate", str(pipeline)]) == 0
    page = _page(tmp_path / "page.png")
    assert main(["run", str(pipeline), str(page), "--output", str(tmp_path / "read.png")]) == 0
    assert (tmp_path / "read.png").is_file() and (tmp_path / "read.json").is_file()
    assert main(["run", str(pipeline), str(page), "--points", "1;2"]) == 2  # one sentence, exit 2


@pytest.mark.slow
def test_grounded_sam2_exports_validates_matches_pytorch_and_runs(tmp_path):
    """One export (the test suite's slowest step), every check on it: pytest-xdist may not share a fixture."""
    grounded = _grounded(tmp_path / "export")
    _splits_and_connects(grounded)
    _hiera_cuts_carry_stage_outputs(grounded)
    _sam2_decoder_takes_any_number_of_prompts_as_pytorch_does(grounded)
    photo = _photo(tmp_path)
    _grounded_runs_on_a_photo(grounded, photo, tmp_path)
    _bad_input_is_one_sentence(grounded, photo, tmp_path)


@pytest.mark.slow  # 18-31 s on 2 cores (ci133)
def test_trocr_exports_validates_decodes_as_generate_and_reads_a_page(tmp_path):
    trocr = _trocr(tmp_path / "run")
    _splits_and_connects(trocr)
    _pieces_run_at_their_reference_shapes(trocr)
    _ocr_decoder_with_explicit_past_reads_the_tokens_generate_reads(trocr)
    _ocr_reads_a_page(trocr, tmp_path)
    _the_cli_validates_and_runs_a_pipeline(trocr, tmp_path)


def _run_blocks(doc, pieces_, request):
    """A blocks pipeline's run: the picture read, its first piece run, the picture and what it gave written."""
    from onn.export.pipelines import images
    from onn.export.pipelines.runtime import finish

    image = images.load_rgb(request.image)
    width = doc["pieces"][0]["inputs"][0]["shape"][1]
    hidden = pieces_.run("piece0", {"features": np.ones((2, width), np.float32)})["hidden"]
    return finish(request, image, {"size": list(image.size), "hidden": hidden.shape[1]})


def _blocks_pipeline(kind: str, pieces, takes=frozenset()):
    """A pipeline of `pieces` (no connections): what export_pipeline writes, without a real model's minutes."""
    from onn.export.pipelines.registry import Pipeline

    return Pipeline(
        kind,
        "Blocks",
        lambda *models, side=None: pieces,
        [],
        _run_blocks,
        lambda *m, side=None: {"side": 8},
        names=tuple(p.name for p in pieces),
        needs=("side",),
        takes=takes,
    )


def _export_blocks(kind: str, folder: Path, pieces, monkeypatch, takes=frozenset()) -> dict:
    """The pipeline exported into `folder`, and registered (as each real pipeline's module registers its own)."""
    from onn.export.pipelines import PIPELINES
    from onn.export.pipelines import export as piece_export

    monkeypatch.setattr(piece_export, "export_processes", lambda pieces: 1)  # here, one after another
    settings = compose("export=omny").export
    pipeline = _blocks_pipeline(kind, pieces, takes)
    monkeypatch.setitem(PIPELINES, kind, pipeline)
    return export_pipeline(pipeline, [pieces[0].module], folder, settings, LIMITS, kind)


def test_a_failed_re_export_leaves_the_earlier_pipeline_whole(tmp_path, monkeypatch):
    """The pieces go into a sibling folder that replaces the earlier one only once every piece is done: a piece
    that fails after another was exported leaves the earlier folder as it was, and nothing beside it."""
    folder = tmp_path / "blocks"
    _export_blocks("blocks", folder, _block_pieces(), monkeypatch)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert set(before) == {"piece0.omny", "piece1.omny", "pipeline.json", "onn_export.json"}
    torch.manual_seed(5)
    changed = _block_pieces()  # piece0 with other weights, exported first; then piece1 fails
    changed[0].module.blocks[0][0].weight.data.normal_()
    changed[1].module.broken = True
    with pytest.raises(UserError, match="a shape this piece does not take"):
        _export_blocks("blocks", folder, changed, monkeypatch)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["blocks"]  # no temporary folder left
    assert validate_pipeline(folder / "pipeline.json", echo=lambda *_: None)
    (folder / "onn_export.json").unlink()  # as a pipeline exported before onn_export.json was written
    _export_blocks("blocks", folder, _block_pieces(), monkeypatch)  # its pipeline.json says it is an export
    assert (folder / "onn_export.json").is_file()


def test_each_pipeline_gets_its_own_folder_from_export_output(tmp_path, monkeypatch):
    """export.output=shared/a.omny writes the pipeline to shared/a/: two pipelines named apart in one folder never
    share a pipeline.json, and a folder holding another pipeline is refused before anything is traced."""
    from onn.export import write

    shared = tmp_path / "shared"
    shared.mkdir()
    model = _block_pieces()[0].module

    def export(kind: str, output: str):
        pieces = _block_pieces()[:1]
        monkeypatch.setattr(write, "_pipeline", lambda config, model: _blocks_pipeline(kind, pieces))
        monkeypatch.setattr("onn.export.pipelines.export.export_processes", lambda pieces: 1)
        config = compose("export=omny", f"export.output={shared / output}", "model=llama_tiny")
        return write.export_for_run(config, model, tmp_path / "run")

    first = export("one", "a.omny")
    export("two", "b.omny")
    assert first["export/pipeline"] == str(shared / "a" / "pipeline.json")
    assert first["export/pieces"]["piece0"]["file"] == str(shared / "a" / "piece0.omny")
    assert sorted(p.name for p in shared.iterdir()) == ["a", "b"]
    kinds = {p: json.loads((shared / p / "pipeline.json").read_text())["kind"] for p in ("a", "b")}
    assert kinds == {"a": "one", "b": "two"}
    before = {p.name: p.read_bytes() for p in (shared / "a").iterdir()}
    monkeypatch.setattr("onn.export.onnx_export.export_onnx", lambda *a, **k: pytest.fail("traced"))
    with pytest.raises(UserError, match=r"shared/a already holds a one pipeline of llama_tiny, not this two pipeline"):
        export("two", "a.omny")
    assert {p.name: p.read_bytes() for p in (shared / "a").iterdir()} == before


def test_a_missing_piece_file_is_named_before_any_piece_runs(tmp_path, monkeypatch):
    from onn.export.omny.cli import main

    folder = tmp_path / "blocks"
    _export_blocks("blocks", folder, _block_pieces(), monkeypatch)
    (folder / "piece1.omny").unlink()
    message = rf"piece piece1's file {folder / 'piece1.omny'} is missing; put it back beside pipeline.json"
    for call in (lambda p: run_pipeline(p, Request(tmp_path / "x.png", tmp_path / "y.png")), validate_pipeline):
        with pytest.raises(UserError, match=message):
            call(folder / "pipeline.json")
    assert main(["run", str(folder / "pipeline.json"), str(tmp_path / "x.png")]) == 2


def test_run_writes_beside_the_image_and_never_over_a_file_it_reads(tmp_path, monkeypatch, capsys):
    """The PNG and JSON go beside the picture by default (a re-export replaces the pipeline's folder whole); an
    --output that would overwrite pipeline.json, a piece or the picture, or that lies in no folder or is one, is
    one sentence before any piece runs."""
    from onn.export.omny.cli import main

    folder = tmp_path / "blocks"
    _export_blocks("blocks", folder, _block_pieces(), monkeypatch)
    (tmp_path / "pictures").mkdir()
    photo, pipeline = _photo(tmp_path / "pictures"), folder / "pipeline.json"
    assert main(["run", str(pipeline), str(photo)]) == 0
    result = tmp_path / "pictures" / "photo.result.json"
    assert json.loads(result.read_text())["size"] == [400, 300]
    assert (tmp_path / "pictures" / "photo.result.png").is_file()
    _export_blocks("blocks", folder, _block_pieces(), monkeypatch)  # a re-export leaves the results alone
    assert result.is_file() and not list(folder.glob("*.result.*"))
    before = {p: p.read_bytes() for p in (*folder.iterdir(), photo)}
    for output, said in (
        (folder / "pipeline.png", "would write .*pipeline.json over a file this run reads"),
        (folder / "piece0.omny", "would write .*piece0.omny over a file this run reads"),
        (photo, "would write .*photo.jpg over a file this run reads"),
        (tmp_path / "result.json", "names the PNG to write"),
        (tmp_path / "no" / "x.png", "the folder .*no does not exist"),
        (tmp_path, "is a folder; name the PNG to write"),
    ):
        code = main(["run", str(pipeline), str(photo), "--output", str(output)])
        err = capsys.readouterr().err
        assert code == 2 and re.search(said, err) and "Traceback" not in err, (output, err)
    assert {p: p.read_bytes() for p in (*folder.iterdir(), photo)} == before


def test_text_or_points_a_pipeline_does_not_read_are_refused(tmp_path, monkeypatch):
    folder = tmp_path / "blocks"
    _export_blocks("blocks", folder, _block_pieces(), monkeypatch, takes=frozenset({"points"}))
    photo = _photo(tmp_path)
    with pytest.raises(UserError, match=r"^--text: a blocks pipeline takes --points, not --text\.$"):
        run_pipeline(folder / "pipeline.json", Request(photo, tmp_path / "x.png", "a cat."))
    _export_blocks("lines", tmp_path / "lines", _block_pieces(), monkeypatch)
    with pytest.raises(UserError, match=r"^--points: a lines pipeline takes only the image, not --points\.$"):
        run_pipeline(tmp_path / "lines" / "pipeline.json", Request(photo, tmp_path / "x.png", points=[(1.0, 2.0)]))
    assert run_pipeline(folder / "pipeline.json", Request(photo, tmp_path / "x.png", points=[(1.0, 2.0)]))["json"]
    from onn.export.pipelines import PIPELINES

    takes = {kind: set(p.takes) for kind, p in PIPELINES.items() if kind not in ("blocks", "lines")}
    assert takes == {"sam2": {"points"}, "grounding_dino": {"text"}, "grounded_sam2": {"text"}, "trocr": set()}


@pytest.mark.parametrize(
    "change, said",
    [
        # the files of two pieces swapped, or a piece copied from another export: onnxruntime's raw error at run
        (
            lambda d: [p.update(file=f"piece{1 - k}.omny") for k, p in enumerate(d["pieces"])],
            r"piece piece0's file piece1.omny has input features float32 \[2, 16\], not the float32 \[2, 32\]",
        ),
        (lambda d: d["pieces"].pop(), "a blocks pipeline's pieces are piece0, piece1, not piece0; re-export"),
        (lambda d: d["settings"].pop("side"), r"settings\.side is missing; re-export the pipeline"),
        (lambda d: d.pop("settings"), "invalid at <root>: 'settings' is a required property; re-export"),
        (
            lambda d: d["connections"].append({"from": "piece0.hidden", "to": "piece0.features"}),
            "invalid at connections/0: 'via' is a required property",
        ),
        (
            lambda d: d["connections"].append({"from": "piece0", "to": "piece0.features", "via": ""}),
            "invalid at connections/0/from",
        ),
        (
            lambda d: d["connections"].append({"from": "piece0.hidden", "to": "piece0.features", "via": ""}),
            "a blocks pipeline has connection piece0.hidden -> piece0.features, which it has not",
        ),
    ],
    ids=["files_swapped", "piece_left_out", "setting_left_out", "no_settings", "no_via", "no_tensor", "extra_link"],
)
def test_a_pipeline_json_its_kind_or_files_contradict_is_one_sentence(tmp_path, monkeypatch, capsys, change, said):
    """validate and run hold pipeline.json to its kind's pieces, connections and settings and to its pieces' files,
    before any piece runs: validate passed such documents, and run failed in onnxruntime or with a KeyError."""
    from onn.export.omny.cli import main

    folder = tmp_path / "blocks"
    _export_blocks("blocks", folder, _block_pieces(), monkeypatch)
    doc = json.loads((folder / "pipeline.json").read_text())
    change(doc)
    (folder / "edited.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match=said):
        validate_pipeline(folder / "edited.json", echo=lambda *_: None)
    assert main(["run", str(folder / "edited.json"), str(_photo(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert re.search(said, err) and ".omny document" not in err and "Error:" not in err
    assert main(["inspect", str(folder / "pipeline.json")]) == 2
    assert "inspect reads a .omny piece; validate or run take pipeline.json" in capsys.readouterr().err


def test_export_sample_image_size_is_refused_where_the_model_fixes_it(tmp_path, monkeypatch):
    """SAM2's and TrOCR's image size is their config's: export.sample.image_size was ignored; the detector's
    canvas is square: [320, 480] was cut to 320 x 320. Both are refused before anything is traced."""
    from onn.export import write

    monkeypatch.setattr("onn.export.pipelines.export_pipeline", lambda *a, **k: pytest.fail("traced"))
    for name, size, said in (
        ("sam2_mini", "[128,128]", r"a sam2 pipeline's image size is fixed by the model's config"),
        ("grounding_dino_mini", "[320,480]", r"the grounding_dino detector reads a square canvas; give \[N, N\]"),
    ):
        config = compose(f"model={name}", "export=omny", f"export.sample.image_size={size}")
        with pytest.raises(UserError, match=rf"^export\.sample\.image_size=\[.*\]: {said}"):
            write.export_for_run(config, load(config.model)[0], tmp_path / name)


def test_a_prompt_of_punctuation_alone_is_refused_before_the_detector_runs():
    from PIL import Image

    from onn.export.pipelines.grounding_dino import detect, settings

    config = compose("model=grounding_dino_mini", "export=omny")
    model, tokenizer = load(config.model)
    image = Image.new("RGB", (40, 30))
    for text in ("   .", "?", " . . "):
        with pytest.raises(UserError, match="holds no phrase, only punctuation"):
            detect(None, image, text, settings(model)["detector"], tokenizer.backend_tokenizer)


def test_a_sideways_photograph_is_read_upright_and_one_too_large_is_one_sentence(tmp_path, monkeypatch):
    """A phone's photograph stored 40 x 30 with EXIF orientation 6 (turn 90 degrees) is 30 x 40 upright, as points
    are given on it; one over PIL's decompression-bomb limit was a raw DecompressionBombError."""
    from PIL import Image

    from onn.export.pipelines.images import load_rgb

    pixels = np.zeros((30, 40, 3), np.uint8)
    pixels[:, :10] = 255  # a white band on the stored picture's left: on the upright one's top
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(pixels).save(tmp_path / "sideways.jpg", exif=exif)
    upright = load_rgb(tmp_path / "sideways.jpg")
    assert upright.size == (30, 40) and np.asarray(upright)[:8].mean() > 200 > np.asarray(upright)[12:].mean()
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 30 x 40 is more than twice that: PIL refuses it
    with pytest.raises(UserError, match=r"sideways.jpg has more pixels than PIL opens \(200 at most"):
        load_rgb(tmp_path / "sideways.jpg")


class _Stages(torch.nn.Module):
    """Three blocks whose first output waits for the head (as Hiera's stage outputs wait for SAM2's neck), each
    ending in another op, so that the tensors crossing the second cut sort by name otherwise than in the graph."""

    def __init__(self):
        super().__init__()
        acts = (torch.nn.Tanh(), torch.nn.GELU(), torch.nn.ReLU())
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), a) for a in acts)

    def forward(self, features):
        first = self.blocks[0](features)
        return {"hidden": self.blocks[2](self.blocks[1](first)) + first}


def test_the_tensors_crossing_a_cut_are_listed_in_graph_order(tmp_path):
    import onnx

    from onn.export.omny.format import read_document
    from onn.export.pipelines import export as piece_export
    from onn.export.pipelines.registry import Piece

    torch.manual_seed(0)
    piece = Piece("stages", _Stages().eval(), {"features": torch.randn(2, 8)}, runs=[["blocks.0", "blocks.1"]])
    source = piece_export._source(piece, "stages")
    path, _, _ = piece_export.export_piece(piece, tmp_path, compose("export=omny").export, LIMITS, source)
    graph = onnx.load(str(path), load_external_data=False).graph
    made = {t: i for i, node in enumerate(graph.node) for t in node.output}
    crossing = [c["crossing"] for c in read_document(path)["cut_points"] if "crossing" in c]
    assert crossing and crossing[0] != sorted(crossing[0])  # names sort otherwise: the order is the graph's
    assert all(c == sorted(c, key=made.get) for c in crossing)
