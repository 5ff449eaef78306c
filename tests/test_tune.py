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


def test_a_tuned_plan_gives_the_reasons_of_the_settings_it_uses(tmp_path):
    """With task=tune's result cached, the plan took its chunk size while its reasons were the planner's own guess's:
    "streaming: chunk_size 2" above a reason line "streaming: float32 store in host memory, chunk 16"."""
    from conftest import compose

    from onn.hardware.profile import resolve
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec
    from onn.planning.tuned import cache_path

    cfg = compose("task=plan", "hardware=cpu_16gb", *TINY, f"paths.cache={tmp_path / 'cache'}", root=tmp_path)
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    spec = model_spec(cfg.model, 8, cache_dir=cfg.paths.cache)
    guess = make_plan(cfg, hw, spec)
    chunk = 1 if guess.streaming.chunk_size != 1 else 2
    settings = {"micro_batch": guess.micro_batch, "chunk_size": chunk, "store_dtype": guess.streaming.store_dtype}
    path = cache_path(cfg, hw, "sparse_lora", guess.sequence_length)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"settings": settings, "samples_per_s": 2.0, "plan_samples_per_s": 1.0}))
    tuned = make_plan(cfg, hw, spec)
    assert tuned.settings_source == "tune" and tuned.streaming.chunk_size == chunk
    said = [r for r in tuned.reasons if r.startswith("streaming:")]
    assert said and all(f"chunk {chunk}," in r for r in said), tuned.reasons
