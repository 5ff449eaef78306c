"""Faults on purpose: kill -9 at seeded random moments of a training run, then `ckpt=<the killed run>`, must end
with the uninterrupted run's weights and optimizer state bit for bit, its loss curve and its metrics keys
(onn/bench/chaos.py; `recipe=bench_chaos` is the long form over every track)."""

from __future__ import annotations

import json

import pytest
from conftest import compose, run_cli

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


def test_fewer_trials_than_tracks_leave_the_last_tracks_out():
    """Each track ran its whole run even with no trial of its own: with 15 tracks and task.trials=3, twelve whole
    runs (minutes each) that checked nothing."""
    from onn.bench.chaos import trial_shares

    task = compose("recipe=bench_chaos", "task.trials=3").task
    shares = trial_shares(task)
    assert list(shares) == list(task.tracks)[:3] and set(shares.values()) == {1}
    assert sum(trial_shares(compose("recipe=bench_chaos", f"task.trials={len(TRACKS) + 2}").task).values()) == 17


def test_a_track_with_its_own_cache_reads_the_benchs_hardware_profile(tmp_path):
    """An own_cache track pointed its runs at an empty profile folder: its whole run measured the machine (tens of
    seconds), and the kills timed from that run all landed after the trials' first checkpoint."""
    from onn.bench.chaos import _share_profile
    from onn.hardware.profile import resolve

    config = compose("hardware=auto")
    resolve(config.hardware, config.paths.cache, tmp_path)  # the session's profile (conftest)
    _share_profile(config, tmp_path / "track" / "hardware")
    track = compose("hardware=auto", f"hardware.cache={tmp_path / 'track' / 'hardware'}").hardware
    assert resolve(track, tmp_path / "cache", tmp_path).source.startswith("cache")


@pytest.mark.slow  # 18-31 s on 2 cores (ci133)
def test_a_mistyped_failpoint_is_one_sentence_before_the_run(tmp_path, monkeypatch):
    """ONN_FAILPOINT=checkpoint_write:x failed the run at its first checkpoint (int("x") inside the save, the run
    lost); an unknown point or a count of 0 never fired, without a word. A track's failpoints are checked too."""
    from onn.bench.chaos import check_settings
    from onn.errors import UserError
    from onn.hardware import failpoints

    monkeypatch.setenv("ONN_FAILPOINT", "checkpoint_write:x")
    done = run_cli("task=plan", f"paths.outputs={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 1
    assert "ONN_FAILPOINT=checkpoint_write:x: give checkpoint_write or store_write" in done.stdout + done.stderr
    for wanted in ("checkpoint_write:0", "checkpoint_writ", "store_write:2:1"):
        monkeypatch.setenv("ONN_FAILPOINT", wanted)
        with pytest.raises(UserError, match=f"^ONN_FAILPOINT={wanted}: give"):
            failpoints.check()
    for wanted in ("checkpoint_write", "store_write:12"):
        monkeypatch.setenv("ONN_FAILPOINT", wanted)
        failpoints.check()
    task = compose("recipe=bench_chaos", "task.tracks.text.failpoints=[store_writ]").task
    with pytest.raises(UserError, match=r"^task\.tracks\.text\.failpoints names store_writ: the points are"):
        check_settings(task)
