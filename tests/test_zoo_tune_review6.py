"""Review 6: the zoo's text encoder on ids longer than its positions, and the tuner's cache under a hardware preset."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from onn.errors import UserError

TINY = ["model=llama_tiny", "strategy=sparse_lora", "data.max_length=40", "tracking=none"]


def test_long_captions_are_cut_where_tokenized_and_longer_ids_are_one_sentence_naming_max_length(caplog):
    """The pairs text side cuts each caption at data.sides.text.max_length (one warning) and builds its encoder with
    that max_length, so its ids always fit; ids longer than the encoder's positions, handed to it directly, failed
    inside the position table ("The size of tensor a (12) must match the size of tensor b (8)"). A max_length of 0
    built an encoder that refused every text."""
    from onn.modalities.pairs.sides import TextSide
    from onn.models.zoo.registry import build_zoo

    model = SimpleNamespace(source="zoo:text_encoder", kwargs={"width": 16, "layers": 1, "heads": 2})
    side = TextSide(SimpleNamespace(data=SimpleNamespace(max_length=8), model=model))
    with caplog.at_level(logging.WARNING, logger="onn"):
        ids, index, skipped = side.read(["a caption far longer than eight bytes", "short"])
    assert ids.shape == (2, 8) and index == [0, 1] and not skipped
    assert sum("data.sides.text.max_length=8" in r.getMessage() for r in caplog.records) == 1
    encoder = side.encoder(12).eval()
    with torch.no_grad():
        assert encoder(ids).shape == (2, 12)
        with pytest.raises(UserError, match=r"ids of 12 tokens are longer than its max_length=8; .*max_length=12"):
            encoder.network(torch.randint(0, 256, (2, 12)))
    with pytest.raises(UserError, match=r"zoo:text_encoder: max_length=0: give the most tokens a text has"):
        build_zoo("text_encoder", max_length=0)


@pytest.fixture
def preset(tmp_path):
    """A plan of llama_tiny for the cpu_16gb preset, its model spec, and the profile the preset gives."""
    from conftest import compose

    from onn.hardware.profile import resolve
    from onn.planning.spec import model_spec

    cfg = compose("task=plan", "hardware=cpu_16gb", *TINY, f"paths.cache={tmp_path / 'cache'}", root=tmp_path)
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    return cfg, hw, model_spec(cfg.model, 8, cache_dir=cfg.paths.cache)


def _on(monkeypatch, machine: str) -> None:
    """Runs as if on `machine`: the fingerprint a measured profile of this machine would have."""
    import onn.planning.tuned as tuned

    monkeypatch.setattr(tuned, "machine_fingerprint", lambda: machine, raising=False)


def test_a_tuned_result_is_keyed_by_the_machine_it_was_measured_on(tmp_path, monkeypatch, preset):
    """With hardware=cpu_16gb the key was `preset:cpu_16gb` on every machine, so a result task=tune measured on one
    machine was taken by another sharing paths.cache, its speeds presented as the preset's."""
    from onn.bench.tune import _save
    from onn.planning.plan import make_plan
    from onn.planning.tuned import cache_path, lookup

    cfg, hw, spec = preset
    guess = make_plan(cfg, hw, spec)
    seq, strategy = guess.sequence_length, guess.strategy
    paths = {}
    for machine in ("machine-a", "machine-b"):
        _on(monkeypatch, machine)
        paths[machine] = cache_path(cfg, hw, strategy, seq)
    assert paths["machine-a"] != paths["machine-b"]
    # measured profiles differing only in the machine measured; neither is the preset's result
    measured = {m: replace(hw, name="auto", source="measured", fingerprint=m) for m in ("machine-a", "machine-b")}
    keys = {cache_path(cfg, p, strategy, seq) for p in measured.values()}
    assert len(keys) == 2 and not keys & set(paths.values())

    _on(monkeypatch, "machine-a")  # task=tune with the preset on machine A
    settings = {**{"micro_batch": 1 if guess.micro_batch != 1 else 2}, **_streaming(guess)}
    trial = {"settings": settings, "predicted_mb": 1.0, "status": "ok", "samples_per_s": 2.0, "peak_growth_mb": 1.0}
    result = {
        "strategy": strategy,
        "sequence_length": seq,
        "settings": settings,
        "samples_per_s": 2.0,
        "plan_settings": settings,
        "plan_samples_per_s": 2.0,
        "speedup_over_plan": 1.0,
        "trials": [trial],
        "head_to_head": None,
        "tuned_at": "now",
        "time_s": 1.0,
    }
    (tmp_path / "run").mkdir()
    metrics = _save(SimpleNamespace(config=cfg, hardware=hw, run_dir=tmp_path / "run"), result, 1)
    written = json.loads(paths["machine-a"].read_text())
    assert (
        (written["measured_on"], written["planned_for"])
        == ("machine-a", "cpu_16gb")
        == (
            metrics["tune/measured_on"],
            metrics["tune/planned_for"],
        )
    )
    assert "the speeds are this machine's, not a cpu_16gb's" in (tmp_path / "run" / "tune.md").read_text()
    found = lookup(cfg, hw, strategy, seq)
    assert found["settings"] == settings and "not a cpu_16gb" in found["measured_where"]
    assert make_plan(cfg, hw, spec).settings_source == "tune"

    _on(monkeypatch, "machine-b")  # the same preset on machine B, sharing paths.cache
    assert lookup(cfg, hw, strategy, seq) is None
    assert make_plan(cfg, hw, spec).settings_source == "plan"
    assert lookup(cfg, measured["machine-a"], strategy, seq) is None  # nor does machine A measured take it


def _streaming(plan) -> dict:
    """The streaming settings task=tune varies, as the plan has them (none when it does not stream)."""
    if not plan.streaming:
        return {"gradient_checkpointing": bool(plan.gradient_checkpointing)}
    return {"chunk_size": plan.streaming.chunk_size, "store_dtype": plan.streaming.store_dtype}
