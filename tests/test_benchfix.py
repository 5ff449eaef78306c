"""Bench review fixes: task=tune's head-to-head rate over all its rounds, and a sweep's grid without an earlier
sweep's jobs numbered past its own."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omegaconf import OmegaConf

from onn.bench import tune
from onn.bench.grid import GridCallback
from onn.tasks.record import BASIC_SWEEPER, failed_jobs, other_sweep

# A real task=tune run (llama_tiny, full, confirm_rounds=2): samples/s of each head-to-head round.
PLAN_RATES = [48.17, 41.729]
CANDIDATE_RATES = [31.412, 63.067]
ROWS_PER_ROUND = 64  # both sides time the same steps of the same batches


class _Replayed(tune._Trials):
    """The head-to-head rounds that run measured, replayed in the order _confirmed asks for them."""

    def __init__(self, job: Any, rates: list[float]) -> None:
        super().__init__(job, None, False)
        self.rates = iter(rates)

    def timed(self, settings: dict[str, Any], folder: Path) -> dict[str, Any]:
        return {"settings": settings, "status": "ok", "samples_per_s": next(self.rates)}


def test_the_head_to_head_rate_is_rows_over_seconds():
    """Each side's rate over its rounds is its rows over its seconds, not the mean of its rounds' rates."""
    for rates in (PLAN_RATES, CANDIDATE_RATES):
        seconds = sum(ROWS_PER_ROUND / r for r in rates)
        assert abs(tune.pooled_samples_per_s(rates) - len(rates) * ROWS_PER_ROUND / seconds) < 1e-9


def test_a_candidate_slower_over_its_rounds_does_not_beat_the_guess(tmp_path):
    """The candidate's mean rate is higher (47.2 against 45.0) but it took longer over its rounds: the guess stays."""
    plan_row = {"settings": {"micro_batch": 8, "gradient_checkpointing": False}, "status": "ok",
                "samples_per_s": 31.684, "peak_growth_mb": 54.0, "predicted_mb": 60.0}  # fmt: skip
    best = {"settings": {"micro_batch": 4, "gradient_checkpointing": False}, "status": "ok",
            "samples_per_s": 35.523, "peak_growth_mb": 46.3, "predicted_mb": 50.0}  # fmt: skip
    plan = SimpleNamespace(strategy="full", sequence_length=64, budget_mb=1e9, context_mb=0.0)
    rounds = [rate for pair in zip(PLAN_RATES, CANDIDATE_RATES, strict=True) for rate in pair]
    trials = _Replayed(SimpleNamespace(run_dir=tmp_path, plan=plan), rounds)
    trials.rows = [plan_row, best]
    result = tune._confirmed(trials, best, plan_row["settings"], SimpleNamespace(confirm_rounds=2))
    assert result["settings"] == plan_row["settings"]
    assert result["speedup_over_plan"] == 1.0
    seconds = sum(ROWS_PER_ROUND / r for r in PLAN_RATES)
    assert abs(result["samples_per_s"] - 2 * ROWS_PER_ROUND / seconds) < 1e-3
    assert "kept" in tune._table({**result, "time_s": 0.0})


def _job(sweep: Path, num: int, strategy: str, status: str, **metrics: Any) -> None:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- strategy={strategy}\n- model=phi4_tiny\n")
    (job / "metrics.json").write_text(json.dumps({"status": status, "task": "bench", **metrics}))


def test_an_earlier_sweeps_failed_job_past_this_sweeps_count_is_not_in_its_grid(tmp_path):
    """An earlier 3-job sweep whose job 2 failed; a 2-job sweep of its first jobs runs into the folder (other_sweep
    lets it in, as a resume): its grid shows its 2 jobs, not the earlier sweep's failed job 2."""
    sweep = tmp_path / "sweep"
    _job(sweep, 0, "full", "ok", **{"bench/step_s": 0.2, "score/overall": 5.0})
    _job(sweep, 1, "lora", "ok", **{"bench/step_s": 0.3, "score/overall": 4.0})
    _job(sweep, 2, "sparse_lora", "failed", error="out of memory (earlier sweep)")
    started = time.time() + 1  # the later sweep starts after the earlier one's records
    config = OmegaConf.create(
        {
            "task": {"name": "bench"},
            "hydra": {
                "sweep": {"dir": str(sweep)},
                "sweeper": {"_target_": BASIC_SWEEPER, "params": {"strategy": "full,lora"}},
                "overrides": {"task": ["model=phi4_tiny"]},
            },
        }
    )
    assert other_sweep(sweep, config) is None
    assert failed_jobs(sweep, started) == []
    GridCallback().on_multirun_end(config)
    grid_md = (sweep / "grid.md").read_text()
    assert "strategy=full" in grid_md and "strategy=lora" in grid_md
    assert "sparse_lora" not in grid_md and "earlier sweep" not in grid_md
    assert "sparse_lora" not in (sweep / "grid.csv").read_text()
