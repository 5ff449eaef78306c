"""The review of the .omny pipelines (onn/export/pipelines): a detector that finds nothing says so, the detector's
text and image backbones are cut where their layers are, a model loaded in bf16 exports as the float32 pipeline
its runtime feeds, and a transparent picture is read on white."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose
from test_omny_pipelines import _photo

from onn.config.convert import typed
from onn.config.model import LanguageModelConfig
from onn.export.pipelines import Request, export_pipeline, for_model, run_pipeline, validate_pipeline
from onn.models.load import load

LIMITS = {"max_shard_size_mb": 2.0, "min_vram_mb": 8.0, "headroom_mb": 0.5}  # tiny models: several shards


def _export(name: str, folder: Path, dtype: torch.dtype | None = None, side: int | None = None):
    """The pipeline of model config `name` exported into `folder`, its models loaded as task=export loads them."""
    config = compose(f"model={name}", "export=omny")
    model, tokenizer = load(config.model, dtype=dtype)
    models = [model]
    if config.model.segmenter:
        models.append(load(typed(LanguageModelConfig, config.model.segmenter, "model.segmenter"))[0])
    pipeline = for_model(model, len(models))
    metrics = export_pipeline(pipeline, models, folder, config.export, LIMITS, name, tokenizer, side=side)
    return Path(metrics["export/pipeline"]), metrics


def _page(path: Path, background: tuple[int, ...], mode: str = "RGBA") -> Path:
    """A 500 x 300 page of three lines of black print on `background` (transparent: alpha 0)."""
    from PIL import Image, ImageDraw, ImageFont

    page = Image.new(mode, (500, 300), background)
    draw = ImageDraw.Draw(page)
    ink = (0, 0, 0, 255) if mode == "RGBA" else (0, 255)
    for k, line in enumerate(("The first line", "a second one", "and the third.")):
        draw.text((30, 30 + 90 * k), line, fill=ink, font=ImageFont.load_default(size=30))
    page.save(path)
    return path


def test_black_print_on_a_transparent_page_is_read_on_white(tmp_path):
    """A PNG of black text on a transparent background (hidden pixels 0, 0, 0, 0) became a black page once its
    alpha was dropped: OCR found no line of ink. Laid on white, its three lines are found."""
    from onn.export.pipelines.images import load_rgb
    from onn.export.pipelines.ocr import lines

    for name, background, mode in (("rgba.png", (0, 0, 0, 0), "RGBA"), ("la.png", (0, 0), "LA")):
        picture = load_rgb(_page(tmp_path / name, background, mode))
        pixels = np.asarray(picture)
        assert picture.mode == "RGB" and (pixels[:20] == 255).all(), name  # the transparent margin is white
        assert len(lines(np.asarray(picture.convert("L"), np.float32))) == 3, name


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_a_pipeline_loaded_in_bfloat16_exports_in_float32_and_reads_a_page(tmp_path):
    """model.dtype=bfloat16 (or a model left in bf16 by training on a GPU) was traced as it was: onnxruntime's
    checker refused its bf16 convolution. The pieces are exported in float32, as the runtime feeds them."""
    from onn.export.omny.format import read_document

    path, metrics = _export("trocr_mini", tmp_path / "export", dtype=torch.bfloat16)
    assert validate_pipeline(path, echo=lambda *_: None)
    assert all(figures["max_abs_diff"] <= 1e-4 for figures in metrics["export/pieces"].values())
    inputs = read_document(path.parent / "encoder.omny")["inputs"]
    assert [s["dtype"] for s in inputs] == ["float32"]
    read = run_pipeline(path, Request(_page(tmp_path / "page.png", (255, 255, 255, 255)), tmp_path / "read.png"))
    assert len(read["lines"]) == 3


def _detector_cuts_its_text_and_image_backbones(path: Path) -> None:
    """BERT (two thirds of Grounding DINO-T's weights: its largest shard was 736 of 749 MB in every plan) and
    Swin had no cut points; now each of their layers is one, and the shards still compute the whole model."""
    from onn.export.omny.format import read_document

    doc = read_document(path.parent / "detector.omny")
    blocks = [b["name"] for b in doc["blocks"]]
    assert "model.model.text_backbone.encoder.layer.0" in blocks
    assert any(".swin.encoder.layers.0.blocks.0" in b for b in blocks) and "model.model.encoder.layers.0" in blocks
    finest = doc["shard_plans"]["configurations"][-1]["detail"]
    total = sum(s["weight_bytes"] for s in finest)
    assert max(s["weight_bytes"] for s in finest) < 0.3 * total  # the unsplit prefix held 45% of the mini's
    assert validate_pipeline(path, echo=lambda *_: None)


def _nothing_above_the_threshold_is_nothing_found(path: Path, tmp_path: Path) -> None:
    """A prompt none of whose boxes clears box_threshold found its best box anyway, labelled as a find (and
    segmented); now it finds nothing, and the picture is written as it is."""
    from PIL import Image

    doc = json.loads(path.read_text())
    doc["settings"]["detector"]["box_threshold"] = 1.0  # no sigmoid score exceeds it
    strict = path.parent / "strict.json"
    strict.write_text(json.dumps(doc))
    photo = _photo(tmp_path)
    found = run_pipeline(strict, Request(photo, tmp_path / "none.png", "a red block."))
    assert found["objects"] == [] and Image.open(found["png"]).size == (400, 300)
    assert json.loads(Path(found["json"]).read_text())["objects"] == []
    assert run_pipeline(path, Request(photo, tmp_path / "some.png", "a red block."))["objects"]  # 0.35: found


@pytest.mark.slow
def test_grounded_sam2_detector_is_cut_at_its_backbones_and_finds_nothing_below_its_threshold(tmp_path):
    """One export of the tiny Grounded SAM2 (about 40 s on 2 cores), both checks on it."""
    path, _ = _export("grounded_sam2_mini", tmp_path / "export", side=224)
    _detector_cuts_its_text_and_image_backbones(path)
    _nothing_above_the_threshold_is_nothing_found(path, tmp_path)
