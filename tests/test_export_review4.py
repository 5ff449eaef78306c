"""Export review: a QLoRA model (bitsandbytes 4-bit base) and a graph network trained in bf16 export to ONNX that
onnxruntime runs as PyTorch does; `enrich --sample` refuses float token ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onn.config.export import ExportSample, OnnxExport
from onn.export import export_model
from onn.export.onnx_export import run_onnx, sample_inputs


def onnx_settings() -> OnnxExport:
    return OnnxExport(name="onnx", output=None, opset=18, atol=1e-4, sample=ExportSample(2, 8, None))


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_a_qlora_model_exports_to_onnx_with_its_merged_dequantized_weights(tmp_path):
    """QLoRA's base holds bitsandbytes' packed 4-bit linears, whose forward cannot run on the dense merged weight
    the export puts in their place (an AssertionError), and transformers refuses to cast a model it loaded
    quantized (what the export does to a GPU run's bf16 model): the exported graph gives the live model's logits,
    and the live model keeps its 4-bit layers."""
    bnb = pytest.importorskip("bitsandbytes")
    from test_export_hf import batch, build_model

    from onn.export.hf import merged_model

    _, _, module, tokenizer = build_model(tmp_path, "strategy=qlora", "model.architecture.num_hidden_layers=2")
    inputs = batch(tokenizer)
    with torch.no_grad():
        want = module.model.eval()(**inputs).logits.float().numpy()
    output = tmp_path / "qlora.onnx"
    export_model(module, output, sample_inputs(module.model, 2, 8), onnx_settings())
    got = run_onnx(output, inputs)["logits"]
    kept = inputs["attention_mask"].bool().numpy()  # left padding: the padded positions are masked out
    assert float(np.abs(got - want)[kept].max()) < 1e-4
    assert merged_model(module).to(torch.bfloat16).dtype == torch.bfloat16  # as a GPU run's export casts it
    base = module.model.get_base_model()
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in base.modules())
    assert base.hf_quantizer is not None and base.config.quantization_config is not None


def test_a_graph_network_trained_in_bf16_exports_to_onnx(tmp_path):
    """strategy.precision=bf16-true (a GPU's choice) leaves the network's weights in bf16, and the graph exporter
    calls export_onnx itself, past export_model's move to float32: its float32 sample met bf16 weights ("mat1 and
    mat2 must have the same dtype"). The graph takes other node and edge counts, as task=infer reads them."""
    import onnxruntime as ort
    from test_graph import ring, run, write_rings_and_stars

    data = write_rings_and_stars(tmp_path / "train", 6, 0)
    metrics, _ = run(
        tmp_path, f"data.source={data}", "trainer.max_epochs=1", "strategy.precision=bf16-true", "export=onnx"
    )
    assert metrics["export/max_abs_diff"] < 1e-4
    session = ort.InferenceSession(metrics["export/onnx"], providers=["CPUExecutionProvider"])
    edges = np.array([*ring(9), (3, 3)]).T
    (logits,) = session.run(None, {"x": np.ones((9, 1), np.float32), "edge_index": edges})
    assert logits.shape == (1, 2) and np.isfinite(logits).all()


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_enrich_refuses_a_float_sample_for_token_ids(tmp_path, capsys):
    """numpy's default dtype is float64: `np.ones((1, 5))` saved as input_ids was taken, the document recorded the
    ids without their value range, and validate then fed the graph ids of -1, 0 and 1. It is refused, naming the
    input and the dtype the graph takes; the same ids as integers make a .omny that validates."""
    from conftest import tiny_llama

    from onn.export.omny import validate
    from onn.export.omny.cli import main
    from onn.export.onnx_export import export_onnx

    model = tiny_llama(num_hidden_layers=1)
    plain = tmp_path / "llama.onnx"
    export_onnx(model, plain, sample_inputs(model, 2, 8))
    ids = np.full((1, 5), 7.0)
    np.savez(tmp_path / "float.npz", input_ids=ids, attention_mask=np.ones((1, 5), np.int64))
    np.savez(tmp_path / "ints.npz", input_ids=ids.astype(np.int64), attention_mask=np.ones((1, 5), np.int64))
    output = tmp_path / "llama.omny"
    assert main(["enrich", str(plain), str(output), "--sample", str(tmp_path / "float.npz")]) == 2
    said = capsys.readouterr().err
    assert "sample input 'input_ids' is float64, but the graph takes int64" in said and not output.exists()
    assert main(["enrich", str(plain), str(output), "--sample", str(tmp_path / "ints.npz")]) == 0
    assert validate(output, echo=lambda *_: None)
