"""task=tune: timed trials, a cache keyed by machine/model/strategy/sequence length, and plans that use it."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import read_metrics, run_cli

TINY = [
    "model=llama_tiny",
    "strategy=sparse_lora",
    "data.builtin.train_size=200",
    "data.builtin.val_size=16",
    "data.max_length=40",
    "tracking=none",
]


@pytest.mark.slow
def test_tune_caches_the_fastest_setting_and_the_plan_uses_it(outputs):
    cache = outputs / "cache"
    common = [*TINY, f"paths.outputs={outputs}", f"paths.cache={cache}"]
    proc = run_cli(
        "task=tune",
        "tune.time_budget_s=45",  # at 15, a CI run on two busy cores spent it all on the planner's own trial
        "tune.steps=2",
        "tune.confirm_rounds=1",
        *common,
        f"hydra.run.dir={outputs / 'tune'}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = read_metrics(outputs / "tune")
    assert m["tune/trials"] >= 2
    assert "| 0 (plan)" in (outputs / "tune" / "tune.md").read_text()
    (entry,) = (cache / "tune").glob("*.json")
    tuned = json.loads(entry.read_text())
    # the winner is a trial that ran and stayed within the budget, and no other such trial was faster
    budget = yaml.safe_load((outputs / "tune" / "plan.yaml").read_text())["budget_mb"]
    usable = [t for t in tuned["trials"] if t["status"] == "ok" and t["peak_growth_mb"] <= budget]
    best = next(t for t in usable if t["settings"] == tuned["settings"])
    if tuned["head_to_head"] is None:  # a head-to-head re-measure may overrule the single trials
        assert best["samples_per_s"] == max(t["samples_per_s"] for t in usable)
    assert tuned["settings"] == m["tune/settings"] and set(tuned["settings"]) == {
        "micro_batch",
        "chunk_size",
        "store_dtype",
    }

    proc = run_cli("task=plan", *common, f"hydra.run.dir={outputs / 'plan'}")
    plan = yaml.safe_load((outputs / "plan" / "plan.yaml").read_text())
    assert (
        plan["settings_source"] == "tune" and "from task=tune" in plan["reasons"][0] and "from task=tune" in proc.stdout
    )
    assert plan["micro_batch"] == tuned["settings"]["micro_batch"]
    assert plan["streaming"]["chunk_size"] == tuned["settings"]["chunk_size"]
    # another sequence length is another key; a setting the user fixed is never replaced
    run_cli("task=plan", *common, "data.max_length=32", f"hydra.run.dir={outputs / 'plan32'}")
    assert yaml.safe_load((outputs / "plan32" / "plan.yaml").read_text())["settings_source"] == "plan"
    run_cli(
        "task=plan",
        *common,
        "strategy.micro_batch=1",
        "strategy.streaming.chunk_size=3",
        "strategy.streaming.store_dtype=int8",
        f"hydra.run.dir={outputs / 'fixed'}",
    )
    fixed = yaml.safe_load((outputs / "fixed" / "plan.yaml").read_text())
    assert fixed["settings_source"] == "plan" and fixed["micro_batch"] == 1 and fixed["streaming"]["chunk_size"] == 3


def test_a_tuned_result_is_keyed_by_the_streaming_settings_it_did_not_vary(tmp_path):
    """A result tuned with the store in host memory was taken by a plan streaming from disk: the key held no
    streaming setting. The ones the tuner varies (chunk size, store dtype) stay out of it, or no plan would find it."""
    from conftest import compose

    from onn.hardware.profile import resolve
    from onn.planning.tuned import cache_path

    def path(*overrides: str):
        cfg = compose("task=plan", "hardware=cpu_16gb", *TINY, *overrides, root=tmp_path)
        return cache_path(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path), "sparse_lora", 40)

    cpu = path("strategy.streaming.store=cpu")
    assert cpu == path("strategy.streaming.store=cpu", "strategy.streaming.chunk_size=3")
    assert cpu == path("strategy.streaming.store=cpu", "strategy.streaming.store_dtype=int8")
    for other in (
        "strategy.streaming.store=disk",
        "strategy.streaming.prefetch=false",
        "strategy.streaming.mlp_tiles=4",
    ):
        assert path("strategy.streaming.store=cpu", other) != cpu, other
