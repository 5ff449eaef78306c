"""Small fixes: load() gives every source's model in eval mode (as from_pretrained does); a denoiser's sparse LoRA
under another Lightning strategy is refused, not streamed regardless; docs/serving.md names every error code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import compose
from test_models import LLAMA, language_model

from onn.errors import UserError
from onn.models.load import load

ROOT = Path(__file__).resolve().parents[1]
TINY_DIT = (
    "data=diffusion",
    "model=dit_small",
    "model.ema_decay=0",
    "model.kwargs={num_layers: 2, num_attention_heads: 2, attention_head_dim: 8, patch_size: 2, norm_num_groups: 4}",
    "data.image_size=[8,8]",
    "data.channels=1",
    "hardware=cpu_16gb",
    "strategy=sparse_lora",
    "strategy.layers=[1]",
)


def test_a_random_or_python_built_model_is_loaded_in_eval_mode_as_from_pretrained_gives_one(tmp_path):
    """Random weights or a Python builder's model came back in train mode (dropout on), a folder's in eval mode."""
    model, _ = load(language_model(name="t", source="random", tokenizer="byte", architecture=LLAMA))
    (tmp_path / "mine.py").write_text(
        "import torch.nn as nn\n"
        "def build():\n    return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4))\n"
    )
    built, _ = load(language_model(name="mine", source=f"{tmp_path}/mine.py:build", tokenizer="byte"))
    for name, loaded in (("random", model), ("python", built)):
        assert not any(m.training for m in loaded.modules()), name


@pytest.mark.parametrize("lightning", ["ddp", "fsdp"])
def test_a_denoisers_sparse_lora_under_another_lightning_strategy_is_one_sentence(lightning):
    """train() streamed the blocks in one process whatever strategy.lightning said: ddp was dropped unsaid."""
    from onn.modalities import get

    config = compose(*TINY_DIT, f"strategy.lightning={lightning}")
    with pytest.raises(UserError, match=rf"strategy.lightning={lightning} with strategy=sparse_lora: .* strategy=full"):
        get("diffusion").check(config)
    get("diffusion").check(compose(*TINY_DIT, "strategy.lightning=streaming"))  # the streaming strategy: taken
    get("diffusion").check(compose(*TINY_DIT, "strategy.lightning=auto"))


def test_every_error_code_the_server_sends_is_in_the_serving_docs_errors_table():
    """server_shutting_down (and unknown_url, method_not_allowed, generation_failed ...) were not documented."""
    serve = ROOT / "onn" / "tasks" / "serve"
    source = "".join(p.read_text() for p in sorted(serve.glob("*.py")))
    sent = set(re.findall(r"""code(?:=|": )"([a-z_]+)"|or "([a-z_]+)"$""", source, re.M))
    codes = {c for pair in sent for c in pair if c} | set(re.findall(r'\d{3}: "([a-z_]+)"', source))
    assert {"server_shutting_down", "generation_failed", "unknown_url", "invalid_api_key"} <= codes
    rows = [line for line in (ROOT / "docs" / "serving.md").read_text().splitlines() if line.startswith("| ")]
    table = {c for row in rows for c in re.findall(r"`([a-z_]+)`", row.split("|")[2])}
    assert codes - table == set()
    shutting = next(row for row in rows if "`server_shutting_down`" in row)
    assert shutting.startswith("| 503 ") and "retry" in shutting.split("|")[4]
