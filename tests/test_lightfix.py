"""A classifier's sparse_lora under another Lightning strategy, the streamed loader's mode, and a neutral logit_bias."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose

from onn.errors import UserError

STREAMED = ("recipe=fsdd_lstm", "hardware=cpu_16gb", "strategy=sparse_lora", "strategy.layers=all")


def test_a_classifiers_sparse_lora_under_another_lightning_strategy_is_refused_at_plan_time(tmp_path):
    """The plan streamed the LSTM's blocks in one process and said nothing of strategy.lightning=ddp, which the run
    then dropped: now one sentence naming it and what to use. Under streaming (or auto) it still plans streamed,
    and eval of such a checkpoint (built resident) is not refused."""
    from onn.hardware.profile import resolve
    from onn.modalities import get

    asked = compose(*STREAMED, "model.kwargs.dropout=0", "strategy.lightning=ddp", root=tmp_path)
    hw = resolve(asked.hardware, tmp_path / "cache", tmp_path)
    with pytest.raises(UserError, match=r"strategy.lightning=ddp with strategy=sparse_lora.*streaming"):
        get("audio").plan(asked, hw)
    streams = compose(*STREAMED, "model.kwargs.dropout=0", "strategy.lightning=streaming", root=tmp_path)
    plan, _ = get("audio").plan(streams, hw)
    assert plan.strategy == "sparse_lora" and plan.streaming is not None
    evaluated = compose(*STREAMED, "model.kwargs.dropout=0", "task=eval", "strategy.lightning=ddp")
    assert get("audio").plan(evaluated, hw)[0].strategy == "sparse_lora"


def test_a_model_loaded_into_the_store_comes_back_in_eval_mode_as_load_returns_one():
    """load() returns its model in eval mode (from_pretrained's); load_into_store's came back in train mode, so the
    same model's dropout and mode-dependent layers ran otherwise when streamed."""
    from onn.models.load import load
    from onn.streaming.loader import load_into_store
    from onn.streaming.store import LayerStore

    model_cfg = compose("model=llama_tiny").model
    resident, _ = load(model_cfg, dtype=torch.float32)
    streamed, _ = load_into_store(model_cfg, torch.float32, None, LayerStore("cpu", "float32"))
    assert not resident.training
    assert not any(module.training for module in streamed.modules())


def request(**fields):
    from onn.tasks.serve.api import ChatRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatRequest.model_validate_json(json.dumps(body))


@pytest.mark.parametrize("bias", [{"50": 0}, {"50": 0.0, "7": 0}, {}, None, [], 0, False])
def test_a_logit_bias_of_zeros_biases_nothing_and_is_taken(bias):
    """{"50": 0} was refused as unsupported_parameter though it asks for no bias: taken now, as {}, [], 0 and false
    (every field's neutral values, docs/serving.md) still are."""
    from onn.tasks.serve.api import _refuse_unimplemented

    _refuse_unimplemented(request(logit_bias=bias))


@pytest.mark.parametrize("bias", [{"50": 5}, {"50": 0, "7": -100}, {"50": False}, {"50": "0"}, [0]])
def test_a_logit_bias_that_biases_or_is_no_number_map_is_still_refused(bias):
    from onn.tasks.serve.api import ApiError, _refuse_unimplemented

    with pytest.raises(ApiError) as refused:
        _refuse_unimplemented(request(logit_bias=bias))
    assert refused.value.param == "logit_bias" and refused.value.code == "unsupported_parameter"
