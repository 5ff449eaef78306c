"""A user's own network and loss through the classifier runner (model.source and model.loss as file.py:function):
README's CNN-encoder-into-LSTM hybrid trains with its focal loss, resumes from its checkpoint and exports to
ONNX; a loss that returns one value per item is one sentence naming model.loss."""

from __future__ import annotations

import pytest
from conftest import ROOT, compose
from test_audio import make_tones

from onn.errors import UserError

HYBRID = ROOT / "examples" / "hybrid" / "cnn_lstm.py"


def hybrid_config(tmp_path, *overrides: str):
    data = make_tones(tmp_path / "tones", per_class=6)
    return compose(
        "recipe=fsdd_audio_cnn",
        "tracking=csv",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
        "model.name=cnn_lstm",
        f"model.source={HYBRID}:build",
        f"model.loss={HYBRID}:focal_loss",
        "++model.kwargs={width: 4, hidden: 8}",
        f"data.source={data}",
        "data.label_from='^([a-z]+)_'",
        "data.classes=null",
        "data.test_pattern=_bob_",
        "data.batch_groups=null",
        "data.clip_seconds=0.4",
        "data.batch_size=6",
        "data.features.top_db=50",
        "data.augment.truncate=0",
        "data.augment.noise_snr_db=0",
        "task.adapt_norm=false",
        "optim.schedule=constant",
        "optim.lr=0.01",
        *overrides,
    )


@pytest.mark.modalities
@pytest.mark.slow
def test_hybrid_trains_with_its_own_loss_resumes_and_exports(tmp_path):
    from onn.app import execute

    first = execute(hybrid_config(tmp_path, "trainer.max_epochs=2", "export=onnx"), tmp_path / "first")
    assert first["train/loss_final"] < first["train/loss_initial"]
    assert first["export/max_abs_diff"] < 1e-4
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    resumed = execute(hybrid_config(tmp_path, "trainer.max_epochs=3", f"ckpt={last}"), tmp_path / "resumed")
    assert resumed["resumed_from"] == str(last) and resumed["steps"] > first["steps"]
    assert [h["epoch"] for h in resumed["val/history"]] == [0, 1, 2]


def test_a_loss_that_is_not_one_number_is_one_sentence(tmp_path):
    from onn.app import execute

    per_item = tmp_path / "losses.py"
    per_item.write_text(
        "import torch.nn.functional as F\n\n\n"
        "def per_item(outputs, labels):\n    return F.cross_entropy(outputs, labels, reduction='none')\n"
    )
    cfg = hybrid_config(tmp_path, "trainer.max_epochs=1", f"model.loss={per_item}:per_item")
    with pytest.raises(UserError, match=r"model.loss .*per_item returned a tensor of shape \[6\]; it must return one"):
        execute(cfg, tmp_path / "run")
