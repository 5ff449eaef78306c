"""The sweep grid: rows, ranking and labels from a fake sweep folder, and a real Hydra multirun through the callback."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import GRID_SWEEP_CONFIG, ROOT

from onn.bench.grid import collect, write_grid

COMMON = ["task=bench", "recipe=equitable_grid", "data=math"]


def bench_metrics(model: str, strategy: str, overall: float, samples_per_s: float, peak_mb: float) -> dict:
    return {
        "status": "ok",
        "error": None,
        "task": "bench",
        "model": model,
        "data": "math",
        "strategy": strategy,
        "hardware": "auto",
        "params_total": 2_300_000,
        "predicted_peak_memory_mb": 612.3,
        "bench/step_s": 0.51,
        "bench/samples_per_s": samples_per_s,
        "bench/tokens_per_s": samples_per_s * 77,
        "bench/io_s": 0.1,
        "bench/compute_s": 0.4,
        "bench/peak_memory_mb": peak_mb,
        "bench/predicted_memory_mb": 612.3,
        "bench/memory_error": peak_mb / 612.3 - 1,
        "bench/predicted_step_s": 0.6,
        "bench/step_time_error": -0.15,
        "bench/learned": True,
        "bench/learned_p": 0.014,
        "bench/quality": 0.31,
        "bench/loss_curve": [5.9, 5.1, 4.2],
        "score/efficiency": 1347.8,
        "score/speed": 195.0,
        "score/memory": 3100.0,
        "score/overall": overall,
        "wall_s": 35.2,
    }


def make_job(sweep: Path, name: str, overrides: list[str], metrics: dict | None) -> None:
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if metrics is not None:
        (job / "metrics.json").write_text(json.dumps(metrics))


def fake_sweep(sweep: Path) -> Path:
    """Four jobs: two ok (the better one second), one failed, one killed before metrics.json."""
    failed = {
        "status": "failed",
        "error": "CUDA out of memory. Tried to allocate 2.00 GiB " + "x" * 200,
        "task": "bench",
        "model": "phi4_tiny",
        "data": "math",
        "strategy": "full",
        "hardware": "auto",
        "wall_s": 3.1,
    }
    make_job(
        sweep,
        "0",
        ["model=phi4_tiny", "strategy=sparse_lora", *COMMON],
        bench_metrics("phi4_tiny", "sparse_lora", 900.0, 15.6, 640.2),
    )
    make_job(
        sweep,
        "1",
        ["model=llama_tiny", "strategy=lora", *COMMON],
        bench_metrics("llama_tiny", "lora", 1547.6, 31.0, 420.0),
    )
    make_job(sweep, "2", ["model=phi4_tiny", "strategy=full", *COMMON], failed)
    make_job(sweep, "3", ["model=llama_tiny", "strategy=full", *COMMON], None)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    (sweep / "not_a_job").mkdir()
    return sweep


def table_rows(md: str) -> list[list[str]]:
    lines = [line for line in md.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:]]


def test_write_grid(tmp_path):
    sweep = fake_sweep(tmp_path / "sweep")
    paths = write_grid(sweep)
    assert [p.name for p in paths] == ["grid.csv", "grid.md", "grid.png"]

    with (sweep / "grid.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    assert [r["status"] for r in rows] == ["ok", "ok", "failed", "missing"]
    assert rows[3]["model"] == "llama_tiny" and rows[3]["strategy"] == "full"  # from its overrides
    assert json.loads(rows[0]["bench/loss_curve"]) == [5.9, 5.1, 4.2]

    md = (sweep / "grid.md").read_text()
    table = table_rows(md)
    assert [r[0] for r in table] == [
        "model=llama_tiny strategy=lora",
        "model=phi4_tiny strategy=sparse_lora",
        "model=phi4_tiny strategy=full",
        "model=llama_tiny strategy=full",
    ]
    assert [r[1] for r in table] == ["ok", "ok", "failed", "missing"]
    assert table[0][5] == "-15.0%" and table[0][14] == "1,548"
    assert table[2][-1].startswith("CUDA out of memory. Tried to allocate 2.00 GiB") and len(table[2][-1]) <= 80
    assert "never started" in table[3][-1]
    assert "efficiency = quality / parameters x 1e10" in md

    png = (sweep / "grid.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_labels_show_only_what_varies(tmp_path):
    sweep = fake_sweep(tmp_path / "sweep")
    labels = {r["job"]: r["label"] for r in collect(sweep)}
    assert labels["0"] == "model=phi4_tiny strategy=sparse_lora"
    assert all("task=" not in label and "recipe=" not in label for label in labels.values())

    same = tmp_path / "same"
    make_job(same, "0", COMMON, None)
    assert collect(same)[0]["label"] == " ".join(COMMON)  # nothing varies: all overrides


def test_a_grid_run_under_three_seeds_gives_each_jobs_spread(tmp_path):
    """`seed=0,1,2`: grid.md puts each job's runs in one row (a failed run counted, not measured), counts the
    runs the plan held to 25% (step time) and 15% (memory), and gives each run outside its step against both
    predictions and the cores it had."""
    sweep = tmp_path / "sweep"
    steps = {"full": [0.20, 0.26, 0.22], "lora": [0.30, 0.31, 0.29]}
    step_errors = {"full": [-0.05, 0.30, 0.04], "lora": [0.10, -0.12, 0.02]}
    job = 0
    for seed in range(3):
        for strategy in ("full", "lora"):
            metrics = bench_metrics("phi4_tiny", strategy, 900.0, 15.6, 600.0 + seed)
            metrics |= {"bench/step_s": steps[strategy][seed], "bench/step_time_error": step_errors[strategy][seed]}
            # the cores each run had: the one outside 25% had 61% of its threads' time, the hypervisor took 0.5 cores
            busy = 0.61 if (strategy, seed) == ("full", 1) else 0.98
            metrics |= {"bench/cpu_share_planned": 1.0, "bench/cpu_share_measured": busy, "bench/steal_cores": 0.5}
            metrics |= {"bench/predicted_step_s": 0.2, "bench/plan_predicted_step_s": 0.21}
            if (strategy, seed) == ("full", 1):  # the miss, whose blocks were timed again after its steps
                metrics |= {"bench/timed_after_step_s": 0.25}
            if strategy == "lora" and seed == 1:
                metrics = {"status": "failed", "error": "boom", "model": "phi4_tiny", "strategy": "lora"}
            make_job(sweep, str(job), [f"seed={seed}", "model=phi4_tiny", f"strategy={strategy}", *COMMON], metrics)
            job += 1
    write_grid(sweep)
    md = (sweep / "grid.md").read_text()
    spread = table_rows(md.split("## The same jobs under each seed")[1])
    assert spread == [
        ["strategy=full", "3 of 3", "0.22 (0.2-0.26)", "-5.0%, +30.0%, +4.0%", "601 (600-602)",
         "-2.0%, -1.8%, -1.7%", "3 of 3"],
        ["strategy=lora", "2 of 3", "0.295 (0.29-0.3)", "+10.0%, +2.0%", "601 (600-602)", "-2.0%, -1.7%", "2 of 2"],
    ]  # fmt: skip
    assert "Step time within 25% of the plan in 4 of 5 runs (worst +30.0%)." in md
    assert "Peak memory within 15% of the plan in 5 of 5 runs (worst -2.0%)." in md
    slow = (
        md.split("Outside 25%: each run's step against its predictions, and the cores it had:\n")[1]
        .strip()
        .splitlines()
    )
    assert slow == [
        "- seed=1 strategy=full: +30.0% (0.26 s a step against 0.2 timed just before it, 0.25 timed just after it, "
        "0.21 when the job was planned); its threads ran 61% of the time (planned 100%); the hypervisor took 0.50 "
        "cores meanwhile (steal)."
    ]
    assert (
        "## The same jobs"
        not in (write_grid(fake_sweep(tmp_path / "one")) and (tmp_path / "one" / "grid.md")).read_text()
    )


def test_a_slow_run_says_when_its_prediction_was_timed(tmp_path):
    """grid.md said the prediction was "timed just before it" for a run whose blocks were timed between its steps
    (bench/timing_windows 2), while its own explanation and the docs said "between the steps"."""
    sweep = tmp_path / "sweep"
    for job, windows in enumerate((2, 0)):  # the bench's windows between the steps; 0: a large model's, timed before
        metrics = bench_metrics("phi4_tiny", "full", 900.0, 15.6, 600.0)
        metrics |= {"bench/step_s": 0.311, "bench/predicted_step_s": 0.232, "bench/step_time_error": 0.343}
        metrics |= {"bench/timed_after_step_s": 0.219, "bench/timing_windows": windows}
        make_job(sweep, str(job), [f"seed={job}", *COMMON], metrics)
    write_grid(sweep)
    slow = [line for line in (sweep / "grid.md").read_text().splitlines() if line.startswith("- seed=")]
    assert slow == [
        "- seed=0: +34.3% (0.311 s a step against 0.232 timed between its steps, 0.219 timed just after them).",
        "- seed=1: +34.3% (0.311 s a step against 0.232 timed just before it, 0.219 timed just after it).",
    ]


def test_no_successful_jobs_and_broken_files(tmp_path):
    sweep = tmp_path / "sweep"
    make_job(sweep, "0", ["model=phi4_tiny"], {"status": "failed", "error": "boom", "model": "phi4_tiny"})
    make_job(sweep, "1", ["model=llama_tiny"], None)
    (sweep / "1" / "metrics.json").write_text('{"status": "o')  # cut off mid-write
    make_job(sweep, "2", ["model=x"], None)
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text("[unclosed")
    paths = write_grid(sweep)
    assert len(paths) == 3 and all(p.is_file() for p in paths)
    statuses = {r["job"]: r["status"] for r in collect(sweep)}
    assert statuses == {"0": "failed", "1": "missing", "2": "missing"}

    single = tmp_path / "single"
    make_job(
        single,
        "only",
        ["model=phi4_tiny"],
        {"status": "ok", "model": "phi4_tiny", "bench/samples_per_s": 3.0},
    )
    assert (single / "grid.png") in write_grid(single)  # all-None scores, one job


APP = """
import json
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    out = Path(HydraConfig.get().runtime.output_dir)
    x = int(cfg.x)
    (out / "metrics.json").write_text(json.dumps({"status": "ok", "error": None, "model": "m", "strategy": f"s{x}",
        "bench/samples_per_s": 10.0 * x, "bench/peak_memory_mb": 100.0 + x, "score/overall": float(x)}))


if __name__ == "__main__":
    main()
"""


@pytest.mark.slow  # 18-31 s on 2 cores (ci133)
def test_callback_after_real_multirun(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(GRID_SWEEP_CONFIG)
    (tmp_path / "app.py").write_text(textwrap.dedent(APP))
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "app.py", "-m", "x=1,2", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (sweep / "grid.md").read_text()
    assert [r[0] for r in table_rows(md)] == ["x=2", "x=1"]
    assert "| x=2 | ok |" in proc.stdout  # the table, printed
    assert (sweep / "grid.png").is_file() and (sweep / "grid.csv").is_file()
