"""The second review of the .omny pipelines' runtime and their benchmark: the OCR decoder's keys and values stay
where onnxruntime computes them between tokens, shard_peaks refuses a file it cannot measure in one sentence, and
bench_omny reads its prompt points on the picture upright, as the pipelines do."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose

from onn.errors import UserError
from onn.export.pipelines import export_pipeline, for_model
from onn.export.pipelines.runtime import Pieces
from onn.models.load import load

LIMITS = {"max_shard_size_mb": 2.0, "min_vram_mb": 8.0, "headroom_mb": 0.5}  # tiny models: several shards


def _export(name: str, folder: Path) -> tuple[torch.nn.Module, Path]:
    """The pipeline of model config `name` exported into `folder`: its model and its pipeline.json."""
    config = compose(f"model={name}", "export=omny")
    model, tokenizer = load(config.model)
    metrics = export_pipeline(for_model(model), [model], folder, config.export, LIMITS, name, tokenizer)
    return model, Path(metrics["export/pipeline"])


@pytest.fixture(scope="module")
def trocr(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    return _export("trocr_mini", tmp_path_factory.mktemp("trocr"))


class HostTraffic(Pieces):
    """The pipeline's real onnxruntime sessions; per run, the numpy arrays fed in and read back: what crosses
    between the host and the session's device (an OrtValue kept on the device crosses nothing)."""

    def __init__(self, doc: dict, folder: Path):
        super().__init__(doc, folder)
        self.runs: list[tuple[str, dict[str, int], dict[str, int]]] = []

    def run(self, name, feeds, *args, **kwargs):
        out = super().run(name, feeds, *args, **kwargs)
        self.runs.append((name, _host_bytes(feeds), _host_bytes(out)))
        return out


class ReadBack(Pieces):
    """The pipeline's real sessions, every output read back to the host whatever its caller keeps: the round trip
    the runtime made before."""

    def run(self, name, feeds, keep=()):
        return super().run(name, feeds)


def _host_bytes(values: dict) -> dict[str, int]:
    return {name: value.nbytes for name, value in values.items() if isinstance(value, np.ndarray)}


def test_ocr_keeps_keys_values_and_line_features_off_the_host_between_tokens(trocr):
    """Each token read back every layer's keys and values and the logits, and fed them and the line's features in
    again: under CUDA a copy each way per token, growing with the line. Now a step reads back its logits alone and
    feeds in its one token id, and the line still reads as transformers' generate() reads it."""
    from PIL import Image

    from onn.export.pipelines.images import normalised
    from onn.export.pipelines.ocr import read_line

    model, path = trocr
    doc = json.loads(path.read_text())
    s = {**doc["settings"], "max_new_tokens": 6}
    crop = Image.fromarray(np.random.default_rng(1).integers(0, 255, (40, 200, 3), dtype=np.uint8))
    pieces = HostTraffic(doc, path.parent)
    tokens = read_line(pieces, crop, s)

    steps = [(fed, read) for name, fed, read in pieces.runs if name == "decoder"]
    assert len(steps) >= 2, pieces.runs
    vocab = model.config.decoder.vocab_size
    for fed, read in steps:
        assert set(read) == {"logits"} and read["logits"] == vocab * 4, read
        assert "encoder_hidden_states" not in fed, fed
    for fed, _ in steps[1:]:
        assert fed == {"input_ids": 8}, fed  # the keys and values came from the step before, on the device
    pixels = torch.from_numpy(normalised(crop, (s["image_size"],) * 2, s["mean"], s["std"]))
    with torch.no_grad():
        want = model.generate(pixel_values=pixels, max_new_tokens=6, do_sample=False, num_beams=1)
    assert [s["start_token"], *tokens] == want[0, : len(tokens) + 1].tolist()


def _without_plans(source: Path, target: Path) -> Path:
    """`source`'s .omny with its document's shard plans emptied (a plan list the schema allows)."""
    import onnx

    from onn.export.omny.format import METADATA_KEY

    model = onnx.load(str(source))
    prop = next(p for p in model.metadata_props if p.key == METADATA_KEY)
    doc = json.loads(prop.value)
    doc["shard_plans"]["configurations"], doc["shard_plans"]["allowed_counts"] = [], []
    prop.value = json.dumps(doc)
    onnx.save_model(model, str(target))
    return target


def _zero_shards(source: Path, target: Path) -> Path:
    """`source`'s .omny with its first plan cut to zero shards."""
    import onnx

    from onn.export.omny.format import METADATA_KEY

    model = onnx.load(str(source))
    prop = next(p for p in model.metadata_props if p.key == METADATA_KEY)
    doc = json.loads(prop.value)
    plan = doc["shard_plans"]["configurations"][0]
    plan["shards"], plan["ranges"], plan["detail"] = 0, [], []
    prop.value = json.dumps(doc)
    onnx.save_model(model, str(target))
    return target


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda encoder, tmp: tmp / "missing.omny", r"missing.omny does not exist"),
        (lambda encoder, tmp: encoder.parent, r"is a folder, not an ONNX file; name the file in it"),
        (lambda encoder, tmp: _without_plans(encoder, tmp / "no_plans.omny"), r"no_plans.omny has no shard plans"),
        (lambda encoder, tmp: _zero_shards(encoder, tmp / "zero.omny"), r"zero.omny.*shard_plans/configurations/0"),
    ],
    ids=["missing", "folder", "no-plans", "zero-shards"],
)
def test_shard_peaks_names_a_file_it_cannot_measure_in_one_sentence(trocr, tmp_path, make, said):
    """A missing file or a folder was a raw FileNotFoundError / IsADirectoryError from onnx.load, and a .omny
    whose plan list is empty an IndexError; each is one sentence naming the file."""
    from onn.export.pipelines.measure import shard_peaks

    given = make(trocr[1].parent / "encoder.omny", tmp_path)
    with pytest.raises(UserError, match=said):
        shard_peaks(given)


def _sideways_photo(path: Path) -> Path:
    """A JPEG stored 40 wide and 30 high with EXIF orientation 6 (turn 90 degrees): 30 wide and 40 high upright."""
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(np.full((30, 40, 3), 128, np.uint8)).save(path, exif=exif)
    return path


def test_bench_omny_names_a_missing_picture_in_one_sentence(tmp_path):
    """task.image naming no file was a raw FileNotFoundError from PIL, read before the pipeline ran."""
    from onn.bench.omny import _pictures

    task = compose("task=bench_omny", f"task.image={tmp_path / 'nowhere.jpg'}").task
    with pytest.raises(UserError, match=r"image .*nowhere.jpg does not exist"):
        _pictures(tmp_path / "pipeline.json", "sam2", task, tmp_path)


@pytest.fixture(scope="module")
def sam2(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    return _export("sam2_mini", tmp_path_factory.mktemp("sam2"))


@pytest.mark.slow  # (about half a minute: SAM2 exported at its test size, then run on the photograph)
def test_bench_omny_places_its_points_on_the_upright_photograph(sam2, tmp_path):
    """task.points are fractions of the picture's width and height; bench_omny read them on the stored picture
    (40 x 30) while SAM2 reads the photograph upright (30 x 40), so (0.9, 0.1) became x = 36, off the picture,
    and the run ended in 'lies outside the image'. Now it lands at (27, 4), as on the upright picture."""
    from onn.bench.omny import _pictures

    photo = _sideways_photo(tmp_path / "sideways.jpg")
    task = compose("task=bench_omny", f"task.image={photo}", "task.points=[[0.9,0.1]]", "task.repeats=1").task
    figures = _pictures(sam2[1], "sam2", task, tmp_path)
    found = json.loads(Path(figures["omny/json"]).read_text())
    assert found["size"] == [30, 40] and found["masks"][0]["point"] == pytest.approx([27.0, 4.0])


@pytest.mark.slow  # (SAM2 exported at its test size: the module's other slow test shares it)
def test_sam2_feeds_the_image_features_to_its_decoder_where_the_encoder_left_them(sam2, tmp_path):
    """The image encoder's three feature maps were read back to the host and fed to the prompt decoder again
    (under CUDA a copy each way per image); now the decoder is fed only the prompts from the host, and the masks
    are the ones the features read back give."""
    from PIL import Image

    from onn.export.pipelines.sam2 import FEATURES, segment

    _, path = sam2
    doc = json.loads(path.read_text())
    image = Image.fromarray(np.random.default_rng(2).integers(0, 255, (48, 64, 3), dtype=np.uint8))
    prompts = [[(20.0, 10.0, 1)], [(5.0, 5.0, 2), (60.0, 40.0, 3)]]
    pieces = HostTraffic(doc, path.parent)
    masks, scores = segment(pieces, image, prompts, doc["settings"])

    (_, _, encoded), (name, fed, _) = pieces.runs
    assert name == "prompt_decoder" and not set(FEATURES) & set(encoded), encoded
    assert set(fed) == {"input_points", "input_labels"}, fed
    want_masks, want_scores = segment(ReadBack(doc, path.parent), image, prompts, doc["settings"])
    np.testing.assert_allclose(scores, want_scores, atol=1e-6)
    assert all((a == b).all() for a, b in zip(masks, want_masks))
