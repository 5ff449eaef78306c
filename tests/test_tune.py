"""task=tune: timed trials, a cache keyed by machine/model/strategy/sequence length, and plans that use it."""

from __future__ import annotations

import json
from pathlib import Path

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
        "tune.time_budget_s=90",  # at 15, and at 45 beside five other jobs, a CI run spent it on the plan's own trial
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


@pytest.mark.parametrize("rounds", ["0", "-1"])
def test_a_search_with_no_confirm_rounds_is_refused_before_any_trial(tmp_path, rounds):
    """tune.confirm_rounds=0 was accepted: every trial ran, then the head-to-head divided by its zero rounds
    (ZeroDivisionError) and the search was lost, nothing cached."""
    run = tmp_path / "tune"
    search = ("tune.time_budget_s=0", "tune.steps=1", "tune.warmup_steps=0", f"tune.confirm_rounds={rounds}")
    proc = run_cli(
        "task=tune", *TINY, "hardware=cpu_16gb", *search, f"paths.outputs={tmp_path}", f"hydra.run.dir={run}"
    )
    said = f"tune.confirm_rounds={rounds}: give a number, 1 or more."
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and said in out and "Traceback" not in out, out[-3000:]
    assert read_metrics(run)["error"] == said and not (run / "trials").exists() and not (run / "plan.yaml").exists()


def test_a_tuned_result_is_used_by_every_strategy_that_plans_what_it_tuned(tmp_path):
    """task=tune with strategy=auto, planned as a full fine-tune, cached a result that strategy=full did not take
    (nor the other way round): the key held the configured block's LoRA settings, which a full fine-tune never reads."""
    from conftest import compose

    from onn.hardware.profile import resolve
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec
    from onn.planning.tuned import cache_path

    base = ("task=plan", "hardware=cpu_16gb", "model=llama_tiny", "data.max_length=40", f"paths.cache={tmp_path}")
    auto, full = (compose(*base, f"strategy={name}", root=tmp_path) for name in ("auto", "full"))
    hw = resolve(auto.hardware, tmp_path / "cache", tmp_path)
    spec = model_spec(auto.model, 8, cache_dir=auto.paths.cache)
    guess = make_plan(auto, hw, spec)
    assert guess.strategy == "full" and guess.settings_source == "plan"  # random weights: a full fine-tune
    path = cache_path(auto, hw, "full", guess.sequence_length)  # where task=tune with strategy=auto writes
    assert path == cache_path(full, hw, "full", guess.sequence_length)
    micro_batch = 1 if guess.micro_batch != 1 else 2
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"settings": {"micro_batch": micro_batch, "gradient_checkpointing": False}}))
    for cfg in (auto, full):
        tuned = make_plan(cfg, hw, spec)
        assert (tuned.strategy, tuned.settings_source, tuned.micro_batch) == ("full", "tune", micro_batch)
    # the adapter strategies key what they read: LoRA, and for sparse_lora its blocks and streaming settings
    lora, sparse = (compose(*base, f"strategy={name}", root=tmp_path) for name in ("lora", "sparse_lora"))
    assert cache_path(auto, hw, "lora", 40) == cache_path(lora, hw, "lora", 40)
    assert cache_path(auto, hw, "sparse_lora", 40) == cache_path(sparse, hw, "sparse_lora", 40)
    assert cache_path(auto, hw, "lora", 40) != cache_path(
        compose(*base, "strategy.lora.r=4", root=tmp_path), hw, "lora", 40
    )
    other_blocks = compose(*base, "strategy=sparse_lora", "strategy.layers=[0,-1]", root=tmp_path)
    assert cache_path(sparse, hw, "sparse_lora", 40) != cache_path(other_blocks, hw, "sparse_lora", 40)


@pytest.mark.parametrize("written", [{}, {"settings": {"store_dtype": "fp3"}}])
def test_a_damaged_or_stale_tune_result_is_passed_over_not_fatal(tmp_path, caplog, written):
    """A cached task=tune file without settings ended every later plan in KeyError: 'settings'; one holding a value
    this version refuses (a store dtype an older one wrote) blamed strategy.streaming.store_dtype, a key the user
    never set. The planner's own settings stand, and the plan or the log says why."""
    from conftest import compose

    from onn.hardware.profile import resolve
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec
    from onn.planning.tuned import cache_path

    cfg = compose("task=plan", "hardware=cpu_16gb", *TINY, f"paths.cache={tmp_path / 'cache'}", root=tmp_path)
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    spec = model_spec(cfg.model, 8, cache_dir=cfg.paths.cache)
    guess = make_plan(cfg, hw, spec)
    path = cache_path(cfg, hw, guess.strategy, guess.sequence_length)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(written))
    with caplog.at_level("WARNING", logger="onn"):
        plan = make_plan(cfg, hw, spec)
    assert plan.settings_source == "plan" and plan.micro_batch == guess.micro_batch
    said = [r.getMessage() for r in caplog.records] + plan.reasons
    assert any(str(path) in line for line in said), said


def test_a_result_tuned_under_one_optimizer_is_not_another_optimizers(tmp_path):
    """The key left optim out: a result tuned under AdamW (8 bytes of state a weight) was reused, its samples/s
    quoted, for SGD without state; a learning rate, which changes neither time nor memory, still shares it."""
    from conftest import compose

    from onn.hardware.profile import resolve
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec
    from onn.planning.tuned import cache_path

    base = ("task=plan", "hardware=cpu_16gb", *TINY, f"paths.cache={tmp_path / 'cache'}")
    cfg = compose(*base, root=tmp_path)
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    spec = model_spec(cfg.model, 8, cache_dir=cfg.paths.cache)
    guess = make_plan(cfg, hw, spec)
    settings = {"micro_batch": guess.micro_batch, "chunk_size": 1, "store_dtype": guess.streaming.store_dtype}
    path = cache_path(cfg, hw, "sparse_lora", guess.sequence_length)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"settings": settings, "samples_per_s": 2.0, "plan_samples_per_s": 1.0}))
    other_lr = compose(*base, "optim.lr=0.123", root=tmp_path)
    sgd = compose(*base, "optim.name=sgd", "optim.momentum=0", root=tmp_path)
    assert make_plan(other_lr, hw, spec).settings_source == "tune"
    assert make_plan(sgd, hw, spec).settings_source == "plan"


def test_one_process_named_any_way_shares_a_tuned_result(tmp_path):
    """The key held trainer.devices as written: task=tune runs at devices=auto, so a run at devices=1 (one process
    too) planned without its result. auto, 1 and [0] are one key; two processes another."""
    from conftest import compose

    from onn.hardware.profile import resolve
    from onn.planning.tuned import cache_path

    base = ("task=plan", "hardware=cpu_16gb", *TINY, f"paths.cache={tmp_path / 'cache'}")
    hw = resolve(compose(*base, root=tmp_path).hardware, tmp_path / "cache", tmp_path)

    def key(devices: str) -> Path:
        return cache_path(compose(*base, f"trainer.devices={devices}", root=tmp_path), hw, "sparse_lora", 64)

    assert key("auto") == key("1") == key("[0]")
    assert key("2") != key("1")
