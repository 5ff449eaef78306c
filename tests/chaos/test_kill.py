"""Faults on purpose: kill -9 at seeded random moments of a training run, then `ckpt=<the killed run>`, must end
with the uninterrupted run's weights and optimizer state bit for bit, its loss curve and its metrics keys
(onn/bench/chaos.py; `recipe=bench_chaos` is the long form over every track)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

TRACKS = [
    "text",
    "text_streamed",
    "text_data_streamed",
    "image",
    "audio",
    "video",
    "mesh",
    "pairs",
    "audio_lstm",
    "hybrid",
    "char_lstm",
    "graph",
    "diffusion",
    "dit",
    "grid",
]


@pytest.mark.slow
def test_runs_killed_at_random_moments_resume_bitwise_and_the_server_outlives_its_clients(tmp_path):
    """Two kills of the resident text run (a kill after its first checkpoint resumes from it), then the server
    under 64 clients, a third of which vanish or time out. (A sweep killed mid-job and run again:
    tests/test_run_record.py; every other track: `recipe=bench_chaos`.)"""
    drop = [f"~task.tracks.{t}" for t in TRACKS if t != "text"]
    server = ["task.server.requests=150", "task.server.more_requests=150"]
    proc = run_cli("recipe=bench_chaos", "task.trials=2", "task.seed=3", *drop, *server, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["chaos/trials"] == 2 and metrics["chaos/exact"] == 2 and metrics["chaos/corrupt"] == 0
    trials = metrics["chaos/text"]["trials"]
    assert all(t["fault"] != "finished before the kill" for t in trials)
    assert (tmp_path / "bench_chaos.md").read_text().count("| text | 2 | 2 |") == 1
    served = {k.removeprefix("chaos/server/"): v for k, v in metrics.items() if k.startswith("chaos/server/")}
    assert served["requests"] == 300 and served["right"] > 100 and served["gone"] > 50 and served["refused"] > 0
    assert served["wrong"] == served["errors"] == served["misrefused"] == served["left_in_batch"] == 0
