"""ONNX export: each tiny model is exported once per module (dynamic batch/sequence axes), then checked with
onnx.checker, run in onnxruntime at the export sample and at other sizes, and compared with PyTorch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import tiny_llama

from onn.errors import UserError
from onn.export.onnx_export import (
    check_onnx,
    export_onnx,
    output_names,
    run_onnx,
    sample_inputs,
)

ROOT = Path(__file__).resolve().parents[1]
TEXT = ["input_ids", "attention_mask"]
# model -> (input names, output names) as documented in onn/export/onnx_export.py
NAMES = {
    "llama": (TEXT, ["logits"]),
    "phi4_tiny": (TEXT, ["logits"]),
    "gpt2": (TEXT, ["logits"]),
    "clip": ([*TEXT, "pixel_values"], ["logits_per_image", "logits_per_text", "text_embeds", "image_embeds"]),
    "resnet": (["pixel_values"], ["output"]),
}
IMAGE_SIZE = {"resnet": 64}


def build(name: str):
    """Tiny random-init models (2 layers) from transformers configs, and a timm CNN."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "llama":
        return tiny_llama()
    if name == "phi4_tiny":
        from onn.config import typed
        from onn.config.model import LanguageModelConfig
        from onn.models.load import architecture

        values = yaml.safe_load((ROOT / "conf" / "model" / "phi4_tiny.yaml").read_text())
        values.pop("defaults")  # the schema it names: LanguageModelConfig
        values["architecture"]["num_hidden_layers"] = 2
        return tf.Phi3ForCausalLM(architecture(typed(LanguageModelConfig, values, "phi4_tiny"))).eval()
    if name == "gpt2":
        config = tf.GPT2Config(
            vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=127, eos_token_id=127
        )
        return tf.GPT2LMHeadModel(config).eval()
    if name == "clip":
        text = dict(
            vocab_size=99,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=32,
            bos_token_id=96,
            eos_token_id=97,
            pad_token_id=1,
        )
        vision = dict(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        )
        return tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()
    if name == "resnet":
        import timm

        return timm.create_model("resnet10t", pretrained=False, num_classes=10).eval()
    raise AssertionError(name)


def torch_outputs(name: str, model, inputs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """PyTorch's outputs by name, computed here independently of the exporter's wrapper."""
    with torch.no_grad():
        if name == "resnet":
            return {"output": model(inputs["pixel_values"]).numpy()}
        extra = {} if name == "clip" else {"use_cache": False}
        result = model(**inputs, **extra)
    return {out: getattr(result, out).numpy() for out in NAMES[name][1]}


_EXPORTS: dict[str, tuple] = {}


def export_once(name: str, tmp_path_factory) -> tuple:
    """Each tiny model traced once per session (tracing takes ~10 s); test_export_omny reuses them."""
    if name not in _EXPORTS:
        model = build(name)
        sample = sample_inputs(model, image_size=IMAGE_SIZE.get(name))
        path = tmp_path_factory.mktemp(name) / f"{name}.onnx"
        _EXPORTS[name] = (name, model, sample, path, export_onnx(model, path, sample))
    return _EXPORTS[name]


# the two llama-shaped models are traced in the slow tier; gpt2 keeps a text model in the suite
@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=pytest.mark.slow) if n in ("llama", "phi4_tiny") else n for n in NAMES],
)
def exported(request, tmp_path_factory):
    return export_once(request.param, tmp_path_factory)


def test_export_checks_names_and_matches_pytorch(exported):
    name, model, sample, path, result = exported
    inputs, outputs = NAMES[name]
    assert list(sample) == inputs
    assert result["export/onnx"] == str(path) and path.is_file()
    assert result["export/opset"] == 18
    assert result["export/inputs"] == inputs and result["export/outputs"] == outputs
    assert set(result["export/max_abs_diff_per_output"]) == set(outputs)
    assert 0 <= result["export/max_abs_diff"] <= 1e-4
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # weights inside, no temp files left

    proto = check_onnx(path)
    assert [i.name for i in proto.graph.input] == inputs
    assert [o.name for o in proto.graph.output] == outputs
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
    for text in set(inputs) & set(TEXT):
        assert dims[text] == ["batch", "sequence"]
    if "pixel_values" in dims:
        size = IMAGE_SIZE.get(name, 32)
        assert dims["pixel_values"] == ["batch", 3, size, size]

    # ORT on the export sample, compared here with PyTorch (not only the exporter's own report)
    got, want = run_onnx(path, sample), torch_outputs(name, model, sample)
    assert list(got) == outputs
    for out in outputs:
        assert np.abs(got[out] - want[out]).max() <= 1e-4
    assert output_names(model) == outputs


def test_dynamic_axes_run_at_other_sizes(exported):
    name, model, sample, path, _ = exported
    other = sample_inputs(model, batch_size=3, sequence_length=5, image_size=IMAGE_SIZE.get(name), seed=1)
    assert all(other[k].shape != sample[k].shape for k in sample)
    got, want = run_onnx(path, other), torch_outputs(name, model, other)
    for out in NAMES[name][1]:
        assert got[out].shape == want[out].shape
        assert got[out].shape[0] == 3
        assert np.abs(got[out] - want[out]).max() <= 1e-4, out
    if name in ("llama", "phi4_tiny", "gpt2"):
        assert got["logits"].shape[:2] == (3, 5)
    if name == "llama":  # a left-padded row matches wherever the mask attends (padded positions may differ)
        other["attention_mask"][0, :2] = 0
        got, want = run_onnx(path, other)["logits"], torch_outputs(name, model, other)["logits"]
        keep = other["attention_mask"].numpy().astype(bool)
        assert np.abs(got[keep] - want[keep]).max() <= 1e-4


# ---------------------------------------------------------------- sample inputs


def test_sample_inputs_are_deterministic_and_avoid_special_tokens():
    model = build("llama")
    a, b = (
        sample_inputs(model, batch_size=8, sequence_length=64),
        sample_inputs(model, batch_size=8, sequence_length=64),
    )
    assert torch.equal(a["input_ids"], b["input_ids"]) and a["input_ids"].dtype == torch.long
    assert not torch.equal(a["input_ids"], sample_inputs(model, batch_size=8, sequence_length=64, seed=1)["input_ids"])
    assert a["input_ids"].shape == (8, 64) and int(a["input_ids"].max()) < 128
    assert not torch.isin(a["input_ids"], torch.tensor([0, 1, 2])).any()
    assert torch.equal(a["attention_mask"], torch.ones(8, 64, dtype=torch.long))


def test_sample_inputs_images():
    clip = sample_inputs(build("clip"), batch_size=2, sequence_length=100)
    assert list(clip) == ["input_ids", "attention_mask", "pixel_values"]
    assert clip["pixel_values"].shape == (2, 3, 32, 32) and clip["pixel_values"].dtype == torch.float32
    assert clip["input_ids"].shape == (2, 32)  # clamped to the text tower's 32 positions
    resnet = build("resnet")
    assert sample_inputs(resnet)["pixel_values"].shape == (2, 3, 176, 176)  # timm pretrained_cfg input_size
    assert sample_inputs(resnet, batch_size=1, image_size=64)["pixel_values"].shape == (1, 3, 64, 64)


def test_sample_image_size_from_the_config_is_height_and_width(tmp_path, monkeypatch):
    """export.sample.image_size is a list [H, W] in the config, and export_for_run traces at it as it is."""
    from conftest import compose

    from onn.export import write

    seen = {}
    monkeypatch.setattr(write, "export_model", lambda model, output, sample, settings, **kw: seen.update(sample) or {})
    write.export_for_run(compose("export=onnx", "export.sample.image_size=[32,48]"), build("resnet"), tmp_path)
    assert seen["pixel_values"].shape == (2, 3, 32, 48)


# ---------------------------------------------------------------- bad input


def test_checker_failure_names_the_file(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Add", ["x", "ghost"], ["y"])], "g", [x], [y])
    bad = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), bad)
    with pytest.raises(UserError, match="bad.onnx fails onnx.checker.*'ghost'") as err:
        check_onnx(bad)
    assert "\n" not in str(err.value)

    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a protobuf")
    with pytest.raises(UserError, match="garbage.onnx fails onnx.checker"):
        check_onnx(garbage)
    with pytest.raises(UserError, match="missing.onnx does not exist"):
        check_onnx(tmp_path / "missing.onnx")


def _ids(*shape, dtype=torch.long):
    return torch.randint(3, 100, shape).to(dtype)


@pytest.mark.parametrize(
    "model_name, sample, match",
    [
        (
            "llama",
            {"input_ids": _ids(2, 8), "pixel_values": torch.randn(2, 3, 8, 8)},
            r"'pixel_values' \(shape \[2, 3, 8, 8\]\) is not an input of LlamaForCausalLM",
        ),
        (
            "llama",
            {"input_ids": _ids(2, 8, dtype=torch.float32)},
            r"'input_ids' \(shape \[2, 8\]\) is torch.float32; expected integer",
        ),
        ("llama", {"input_ids": _ids(2, 8, 1)}, r"'input_ids' has shape \[2, 8, 1\]; expected 2 dims"),
        (
            "llama",
            {"input_ids": _ids(2, 8), "attention_mask": torch.ones(2, 7, dtype=torch.long)},
            r"'attention_mask' has shape \[2, 7\]; expected the shape of 'input_ids', \[2, 8\]",
        ),
        (
            "llama",
            {"input_ids": torch.full((2, 8), 500)},
            r"'input_ids' .* ids from 500 to 500; .* vocabulary is 0..127",
        ),
        (
            "llama",
            {"input_ids": _ids(1, 8)},
            r"'input_ids' has shape \[1, 8\]; a dynamic export needs batch and sequence sizes of at least 2 .*: "
            r"set export.sample.batch_size and export.sample.sequence_length to 2 or more",
        ),
        (
            "clip",
            {
                "input_ids": _ids(2, 8),
                "attention_mask": torch.ones(2, 8, dtype=torch.long),
                "pixel_values": torch.randn(2, 3, 64, 64),
            },
            r"'pixel_values' has shape \[2, 3, 64, 64\]; CLIPModel's config expects \[batch, 3, 32, 32\]",
        ),
        (
            "resnet",
            {"pixel_values": torch.randn(2, 3, 64, 64), "extra": torch.randn(2, 3)},
            r"ResNet.forward takes 1 tensor\(s\) \['x'\]; the sample input has 2",
        ),
    ],
)
def test_mismatched_sample_input_is_refused_before_export(tmp_path, model_name, sample, match):
    with pytest.raises(UserError, match=match) as err:
        export_onnx(build(model_name), tmp_path / "m.onnx", sample)
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x).relu()


def test_missing_output_folder(tmp_path):
    target = tmp_path / "not" / "there" / "m.onnx"
    with pytest.raises(UserError, match=r"folder of the ONNX export path .*m.onnx does not exist"):
        export_onnx(Tiny(), target, {"x": torch.randn(2, 8)})
    assert not (tmp_path / "not").exists()


def test_failed_export_keeps_the_earlier_file_and_restores_training_mode(tmp_path):
    model = Tiny().train()
    path = tmp_path / "tiny.onnx"
    path.write_bytes(before := b"an earlier run's export")
    with pytest.raises(
        UserError,
        match=r"ONNX output 'output' of Tiny differs from PyTorch by .* so .*tiny.onnx was not written",
    ):
        export_onnx(model, path, {"x": torch.randn(2, 8)}, atol=-1.0)  # every diff fails a negative tolerance
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.onnx"]  # no temp folder left behind
    assert model.training


def test_static_shapes_and_other_opset(tmp_path):
    path = tmp_path / "tiny.onnx"
    result = export_onnx(Tiny(), path, {"x": torch.randn(2, 8)}, opset=17, dynamic=False)
    assert result["export/opset"] == 17
    proto = check_onnx(path)
    assert [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim] == [2, 8]
    assert {o.domain: o.version for o in proto.opset_import}[""] == 17
    with pytest.raises(UserError, match=r"takes inputs \['x'\]; the feeds lack \['x'\] and have extra \['y'\]"):
        run_onnx(path, {"y": np.zeros((2, 8), np.float32)})


def test_an_opset_the_export_cannot_keep_is_refused_before_anything_loads():
    """torch.onnx writes opset 18 and converts its graph to others: below 18 the conversion fails for most models
    (torch then wrote opset 18 anyway), above what onnx and onnxruntime know the file cannot be checked or run. And
    a dynamic export's sample needs 2 or more on its axes. All of it is said before a model is loaded."""
    from dataclasses import replace

    from conftest import compose

    from onn.export.onnx_export import newest_opset
    from onn.export.settings import check_settings

    base = compose("export=onnx").export
    newest = newest_opset()
    assert newest >= 18
    check_settings(replace(base, opset=newest))
    for opset in (13, 17, newest + 1, 99, True):
        with pytest.raises(UserError, match=rf"export.opset={opset!r}: give a whole number from 18 .* to {newest} "):
            check_settings(replace(base, opset=opset))
    for key in ("batch_size", "sequence_length"):
        with pytest.raises(UserError, match=rf"export.sample.{key}=1: give a whole number, 2 or more"):
            check_settings(replace(base, sample=replace(base.sample, **{key: 1})))


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_an_opset_torch_cannot_write_or_onnxruntime_cannot_run_names_export_opset(tmp_path):
    """A graph torch.onnx's version converter cannot take to the opset asked for is refused (torch wrote opset 18
    instead, saying so only in a logged traceback); a converted graph that fails its check names export.opset and
    the file it was to be, not the temporary file it was checked as."""
    model = build("llama")
    sample = sample_inputs(model, batch_size=2, sequence_length=8)
    path = tmp_path / "llama.onnx"
    with pytest.raises(
        UserError, match=r"could not convert LlamaForCausalLM's graph to opset 17 .*set export.opset=18"
    ):
        export_onnx(model, path, sample, opset=17)
    with pytest.raises(UserError) as err:  # Tiny at a converted opset, held to a tolerance no output meets
        export_onnx(Tiny(), tmp_path / "tiny.onnx", {"x": torch.randn(2, 8)}, opset=20, atol=-1.0)
    assert "export.opset=20: torch.onnx converted its opset-18 graph to it" in str(err.value)
    try:  # onnxruntime 1.31 runs torch's RotaryEmbedding at opset 23 otherwise than torch writes it
        export_onnx(model, path, sample, opset=23)
    except UserError as e:
        assert f"{path} was not written" in str(e) and "export.opset=23" in str(e) and ".tmp" not in str(e)
    else:
        assert {o.domain: o.version for o in check_onnx(path).opset_import}[""] == 23
    assert [p.name for p in tmp_path.iterdir()] in ([], ["llama.onnx"])  # no temp folder left


def test_exports_in_one_process_list_torchlib_ops_once(tmp_path):
    """torch.onnx.export asks onnxscript for its torchlib ops on every call (a second of parsing each time): the
    second export in a process reuses the first's list, and its graph still matches PyTorch (export_onnx checks)."""
    from torch.onnx._internal._lazy_import import onnxscript_apis

    for k in range(2):
        export_onnx(Tiny(), tmp_path / f"tiny{k}.onnx", {"x": torch.randn(2, 8)})
    info = onnxscript_apis.get_torchlib_ops.cache_info()
    assert info.misses == 1 and info.hits >= 1


def test_an_axis_the_code_fixes_is_said_in_a_warning(tmp_path, caplog):
    """A Python loop over the steps fixes their number while torch.export traces: the graph is written (it is right
    at that size) and the run's log and metrics say which axis it takes at one size only."""
    import logging

    class StepSum(torch.nn.Module):
        def forward(self, x):
            total = x[:, 0]
            for t in range(1, x.shape[1]):
                total = total + x[:, t]
            return total

    with caplog.at_level(logging.WARNING, logger="onn"):
        result = export_onnx(StepSum(), tmp_path / "sum.onnx", {"x": torch.randn(2, 5)}, axes={"x": {0: "b", 1: "t"}})
    assert result["export/fixed_axes"] == ["x axis 1 (t) = 5"]
    assert [r.getMessage() for r in caplog.records if "takes only x axis 1 (t) = 5" in r.getMessage()]
    assert export_onnx(Tiny(), tmp_path / "tiny.onnx", {"x": torch.randn(2, 8)})["export/fixed_axes"] == []


def test_peft_model_is_exported_merged_and_left_unmerged(tmp_path):
    import peft

    torch.manual_seed(0)
    model = peft.get_peft_model(Tiny(), peft.LoraConfig(target_modules=["fc"], r=2, init_lora_weights=False))
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = model(x).numpy()
        base = model.get_base_model().fc.base_layer(x).relu().numpy()
    assert np.abs(want - base).max() > 1e-3  # the adapter changes the output
    export_onnx(model, tmp_path / "lora.onnx", {"x": torch.randn(2, 8)})
    assert np.abs(run_onnx(tmp_path / "lora.onnx", {"x": x})["output"] - want).max() <= 1e-5
    assert isinstance(model, peft.PeftModel) and hasattr(model.get_base_model().fc, "lora_A")


def test_max_abs_diff_skips_padded_positions_and_flags_mismatches():
    from onn.export.onnx_export import _max_abs_diff

    ref = torch.zeros(2, 3, 4)
    got = ref.numpy().copy()
    got[0, 0] = 5.0  # a padded position: ORT and PyTorch may differ there
    got[1, 2] = 1e-3
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert _max_abs_diff(ref, got, mask) == pytest.approx(1e-3)
    assert _max_abs_diff(ref, got) == 5.0
    assert _max_abs_diff(ref, got[:, :2]) == float("inf")
    got[1, 1, 1] = np.nan
    assert _max_abs_diff(ref, got, mask) == float("inf")


def test_omny_of_each_model_cuts_at_its_blocks_and_validates(exported, tmp_path):
    """The .omny path on every exported model: cut points at each tower's LayerMap block
    boundaries, and every shard plan splits and runs to the whole model's numbers."""
    import onnx

    from onn.export import omny
    from onn.models.layers import block_runs

    name, model, sample, path, _ = exported
    runs = block_runs(model)
    graph = onnx.load(str(path))
    limits = {
        "max_shard_size_mb": 16 if name == "resnet" else 0.25,  # resnet10t's layer4 alone is ~14 MB
        "min_vram_mb": 64,
        "headroom_mb": 1,
        "reference_sequence_length": 32,  # CLIP's text positions end there
    }  # several shards for tiny models
    doc = omny.describe(graph, sample, limits, runs=runs)
    out = omny.write(graph, doc, tmp_path / f"{name}.omny")
    blocks = [b["name"] for b in doc["blocks"] if b["role"] == "block"]
    assert sorted(blocks) == sorted(
        p for run in runs for p in run
    )  # every block a cut point, once (towers in graph order)
    if name == "clip":  # a cut point in each tower, and the finished tower carried past the other's shards
        assert {p.split(".")[0] for p in blocks} == {"vision_model", "text_model"}
        assert any(d["carry"] for c in doc["shard_plans"]["configurations"] for d in c["detail"])
        vision_cut = next(c for c in doc["cut_points"] if c["shape"][1] == 17)  # 16 patches + class token
        assert vision_cut["bytes_per_token"] is None and vision_cut["bytes_per_sample"] == 17 * 32 * 4
        text_cut = next(c for c in doc["cut_points"] if c["shape"][1] == "sequence")
        assert text_cut["bytes_per_token"] == 32 * 4
    assert max(doc["shard_plans"]["allowed_counts"]) > 1
    assert omny.validate(out, echo=lambda *_: None)


def test_a_scanned_recurrence_exports_without_torchs_graph_dumps(tmp_path):
    """torch's scan partitioner sets its own logger to DEBUG and prints every scan's forward and backward graphs
    (hundreds of lines for a char_lstm): the export leaves it at warnings."""
    import logging

    from onn.models.zoo.recurrent import recurrence

    class Scanned(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(4, 8, batch_first=True)

        def forward(self, x):
            return recurrence(self.lstm, x)[0]

    class Kept(logging.Handler):
        def emit(self, record):
            dumps.append(record.getMessage())

    dumps: list[str] = []
    partitioner = logging.getLogger("torch._higher_order_ops.partitioner")
    handler = Kept()
    partitioner.addHandler(handler)
    try:
        torch.manual_seed(0)
        export_onnx(Scanned(), tmp_path / "scan.onnx", {"x": torch.randn(2, 5, 4)}, axes={"x": {0: "b", 1: "t"}})
    finally:
        partitioner.removeHandler(handler)
    assert dumps == []


CLASSIFIERS = {  # modality -> (its data and model overrides, its transform's statistics, not the neutral ones)
    "image": (
        ["data=image", "model=v28_cnn", "data.image_size=[16,16]"],
        {"mean": [0.2, 0.4, 0.6], "std": [0.3, 0.2, 0.1]},
    ),
    "audio": (
        ["data=audio", "model=audio_cnn", "data.clip_seconds=0.25", "data.store_seconds=0.3"],
        {"mean": -30.0, "std": 12.0},
    ),
    "video": (
        ["data=video", "model=video_c3d_tiny", "data.image_size=[16,16]", "data.frames=4", "data.decode_frames=6"],
        {"mean": [0.3, 0.4, 0.5], "std": [0.2, 0.25, 0.3]},
    ),
    "mesh": (["data=mesh", "model=pointnet", "data.points=64"], {}),
}


def classifier(tmp_path: Path, modality: str, *overrides: str):
    """(modality, config, Classifier) of random weights whose transform normalises with CLASSIFIERS' statistics, as a
    checkpoint of data that measured them would build it."""
    from conftest import compose

    from onn.hardware.profile import resolve
    from onn.modalities.classification import build
    from onn.modalities.registry import get

    given, stats = CLASSIFIERS[modality]
    config = compose(*given, f"data.source={tmp_path / 'unread'}", "hardware=cpu_16gb", f"paths.outputs={tmp_path}",
                     f"paths.cache={tmp_path / 'cache'}", *overrides)  # fmt: skip
    m = get(config.data.modality)
    plan, _ = m.plan(config, resolve(config.hardware, tmp_path / "cache", tmp_path))
    inputs = {**m.planned_inputs(config), **m.neutral_stats(m.planned_inputs(config)), **stats, "seed": 0}
    return m, config, build(m, config, plan, inputs)


@pytest.mark.parametrize("modality", list(CLASSIFIERS))
def test_a_classifiers_onnx_graph_takes_the_batch_its_data_module_stores(tmp_path, modality):
    """docs/export.md: a trained classifier's graph takes `input`, a batch as its data module stores it. It took the
    network's input after the transform (normalised pixels, a log-mel, the clip's sampled frames) and the mean/std were
    in neither export: fed the stored batch, an image classifier's probabilities were up to 0.6 off task=infer's. The
    transform is traced in front of the network; the graph gives what infer computes from the stored batch."""
    import onnxruntime as ort

    from onn.modalities.classification import export_module, input_shape

    m, config, module = classifier(tmp_path, modality, "export=onnx", "export.sample.batch_size=2")
    metrics = export_module(m, config, module.eval(), tmp_path / "run")
    session = ort.InferenceSession(metrics["export/onnx"], providers=["CPUExecutionProvider"])
    (given,) = session.get_inputs()
    shape = input_shape(module.onn_config["inputs"])
    stored_type = {"uint8": "tensor(uint8)"}.get(m.stored_dtype, "tensor(float)")  # float16 audio: float32 samples
    assert (given.name, given.type, given.shape[1:]) == ("input", stored_type, shape)
    generator = torch.Generator().manual_seed(1)
    if m.stored_dtype == "uint8":
        stored = torch.randint(0, 256, (3, *shape), dtype=torch.uint8, generator=generator)
    else:
        stored = torch.randn(3, *shape, generator=generator).to(getattr(torch, m.stored_dtype))
    with torch.no_grad():  # what task=infer computes from a decoded batch
        want = module(module.prepare(stored, train=False)).float().numpy()
    (got,) = session.run(None, {"input": stored.numpy() if stored.dtype == torch.uint8 else stored.float().numpy()})
    assert np.abs(got - want).max() < 1e-4 * max(1.0, float(np.abs(want).max()))


def test_a_classifiers_omny_takes_the_stored_batch_and_its_safetensors_the_statistics(tmp_path):
    """The .omny of a classifier is the same graph (cut at its network's blocks); the safetensors export's
    config.json has the mean/std, and model.weights of that export normalises with them: task=eval of the export
    measured the data's own, and gave another val/loss than the checkpoint (0.2685 against 0.4463)."""
    import onnx
    from test_vision_train import make_images

    from onn.modalities.classification import data_inputs, export_module, setup_data

    m, config, module = classifier(tmp_path, "image", "export=omny")
    omny = export_module(m, config, module.eval(), tmp_path / "omny")
    graph = onnx.load(omny["export/omny"]).graph
    assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.UINT8 and omny["export/blocks"] > 1
    m, config, module = classifier(tmp_path, "image", "export=safetensors")
    folder = Path(export_module(m, config, module, tmp_path / "st")["export/path"])
    images = make_images(tmp_path / "images", train=4, test=2)
    from conftest import compose

    data = ["model=v28_cnn", "data=image", f"data.source={images}", f"paths.cache={tmp_path / 'cache'}"]
    measured = data_inputs(m, compose(*data), setup_data(m, compose(*data), "cpu"))
    weights = compose(*data, f"model.weights={folder / 'model.safetensors'}")
    kept = data_inputs(m, weights, setup_data(m, weights, "cpu"))
    assert (kept["mean"], kept["std"]) == (CLASSIFIERS["image"][1]["mean"], CLASSIFIERS["image"][1]["std"])
    assert measured["mean"] != kept["mean"] and {**kept, "mean": 0, "std": 0} == {**measured, "mean": 0, "std": 0}
    import onnxruntime as ort

    from onn.app import execute

    given = ["task=export", "export=onnx", *CLASSIFIERS["image"][0], "hardware=cpu_16gb", f"paths.outputs={tmp_path}"]
    again = execute(compose(*given, f"model.weights={folder / 'model.safetensors'}"), tmp_path / "again")
    stored = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = module.eval()(module.prepare(stored, train=False)).numpy()
    session = ort.InferenceSession(again["export/onnx"], providers=["CPUExecutionProvider"])
    assert np.abs(session.run(None, {"input": stored.numpy()})[0] - want).max() < 1e-4  # its weights, its statistics


def test_an_onnx_or_omny_export_output_is_checked_before_training(tmp_path):
    """export=onnx|omny with an export.output whose folder does not exist, or that names a folder, failed only once
    training had ended (safetensors' was checked first): settings.py checks them before a model is loaded."""
    from conftest import compose

    from onn.app import execute
    from onn.export.folders import MARKER
    from onn.export.settings import check_settings

    missing, folder, earlier = tmp_path / "nope" / "model.onnx", tmp_path / "folder", tmp_path / "pipeline"
    folder.mkdir()
    earlier.mkdir()
    (earlier / MARKER).write_text("{}")  # a pipeline's folder, which export.output=DIR/NAME names: taken
    for kind in ("onnx", "omny"):
        with pytest.raises(UserError, match=rf"export.output {missing}: the folder {missing.parent} does not exist"):
            check_settings(compose(f"export={kind}", f"export.output={missing}").export)
        with pytest.raises(UserError, match=rf"export.output {folder} is a folder; name the .{kind} file to write"):
            check_settings(compose(f"export={kind}", f"export.output={folder}").export)
        check_settings(compose(f"export={kind}", f"export.output={earlier}").export)
        check_settings(compose(f"export={kind}", f"export.output={folder / 'model.onnx'}").export)
    run = ["model=llama_tiny", "trainer.max_steps=2", "tracking=none", "hardware=cpu_16gb", f"paths.outputs={tmp_path}"]
    config = compose(*run, "export=onnx", f"export.output={missing}")
    with pytest.raises(UserError, match=r"the folder .*/nope does not exist"):
        execute(config, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before a step was trained


def test_an_export_to_a_full_disk_is_one_sentence_and_leaves_the_earlier_one(tmp_path):
    """safetensors' writer raised SafetensorError for a full disk ("No space left on device (os error 28)"), which
    export caught as OSError only: a 60-line traceback. A classifier's safetensors export was not caught at all."""
    from conftest import compose
    from test_checkpoint_edges import small_disk

    from onn.export import export_model
    from onn.models.load import load

    with small_disk(tmp_path / "disk", "1m") as disk:
        model, tokenizer = load(compose("model=llama_tiny").model)
        with pytest.raises(UserError, match=rf"cannot write {disk}/hf: the disk is full \([\d.]+ MB are needed and"):
            export_model(model, disk / "hf", None, compose("export=safetensors").export, tokenizer=tokenizer)
        m, config, module = classifier(tmp_path, "image", "export=safetensors", f"export.output={disk / 'net'}")
        with pytest.raises(UserError, match=rf"cannot write {disk}/net: the disk is full"):
            from onn.modalities.classification import export_module

            export_module(m, config, module, tmp_path / "run")
        assert [p.name for p in disk.iterdir()] == []  # nothing half-written, no staged folder
