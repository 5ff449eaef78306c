"""Export review 10: peft's modules_to_save (a fully trained head beside the adapters) is exported as the head it
trained, in the Hugging Face folder and in ONNX, tied to the embeddings or not; adapters the export cannot merge (a
LoRA bias on a layer without one, trainable token rows) are one sentence, not a folder that computes something else
or a raw AttributeError."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from conftest import tiny_llama
from peft import LoraConfig, get_peft_model

from onn.config.convert import typed
from onn.config.export import OnnxExport
from onn.errors import UserError
from onn.export import export_model, hf
from onn.export.onnx_export import run_onnx, sample_inputs

ONNX = {"name": "onnx", "output": None, "opset": 18, "atol": 1e-4}
ONNX["sample"] = {"batch_size": 2, "sequence_length": 8, "image_size": None}


def trained(tied: bool, **lora: object):
    """A tiny Llama under peft whose every trainable tensor (adapters, modules_to_save copies) is moved away from its
    initial value, as training moves it: a copy still equal to the original would hide which one was exported."""
    model = get_peft_model(tiny_llama(tie_word_embeddings=tied), LoraConfig(r=4, lora_alpha=8, **lora))
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.3)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_a_modules_to_save_head_is_exported_as_the_head_it_trained(tmp_path, tied):
    """The folder held `lm_head.original_module.weight` and `lm_head.modules_to_save.default.weight`, which
    from_pretrained set aside, giving a random head (logits 0.5 off); a head tied to the embeddings was tied again.
    The ONNX export failed with "Linear has no attribute `original_module`"."""
    model = trained(tied, target_modules=["q_proj"], modules_to_save=["lm_head"])
    sample = sample_inputs(model, 2, 8)
    with torch.no_grad():
        want = model(**sample).logits

    folder = tmp_path / "hf"
    hf.save_export(model, None, folder, max_shard_size="2GB", adapter=False)
    reloaded = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        got = reloaded(**sample).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert reloaded.config.tie_word_embeddings is False

    graph = tmp_path / "model.onnx"
    export_model(model, graph, sample, typed(OnnxExport, ONNX, "export"))
    longer = {"input_ids": torch.randint(3, 120, (3, 11)), "attention_mask": torch.ones(3, 11, dtype=torch.long)}
    with torch.no_grad():
        want_longer = model(**longer).logits.numpy()
    np.testing.assert_allclose(run_onnx(graph, longer)["logits"], want_longer, atol=1e-5)


@pytest.mark.parametrize(
    ("lora", "named"),
    [
        ({"target_modules": ["q_proj"], "lora_bias": True}, "lora_bias=True"),
        ({"target_modules": ["q_proj"], "trainable_token_indices": [5, 6, 7]}, "trainable_token_indices"),
    ],
)
def test_an_adapter_the_export_cannot_merge_is_one_sentence(tmp_path, lora, named):
    """A LoRA bias on q_proj (no bias in Llama) was dropped without a word (the folder's logits 0.3 off the trained
    model's); trainable token rows were written untrained, and ONNX failed with a raw AttributeError."""
    model = trained(False, **lora)
    folder = tmp_path / "hf"
    with pytest.raises(UserError, match=named):
        hf.save_export(model, None, folder, max_shard_size="2GB", adapter=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the folder nor the adapter beside it
    with pytest.raises(UserError, match=named):
        export_model(model, tmp_path / "model.onnx", sample_inputs(model, 2, 8), typed(OnnxExport, ONNX, "export"))
