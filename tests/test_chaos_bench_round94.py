"""bench_chaos must not hang or leave processes behind: a killed run that stalls before its named kill point or
its first checkpoint is stopped at task.timeout_s (it hung the whole bench for good), a server that ignores
SIGTERM is killed with its process group (TimeoutExpired's traceback, the server left running), and a failpoint no
training track reaches is refused before the first run (each such trial became checkpoint_write:1 after a wasted
whole run)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import compose

from onn.bench import chaos, chaos_serve, child
from onn.errors import UserError

SAFETY_S = 60.0  # only a bound on a wait that would otherwise hang the test session; nothing is timed


def _stalling_run(pid_file: str, console: str) -> None:
    """A run as bench_chaos starts one (a session of its own) that stalls before its first checkpoint, with a
    worker in its process group, as a DataLoader worker would be."""
    os.setsid()
    worker = subprocess.Popen(["sleep", "600"])
    Path(console).write_text("loading the data\n")
    Path(pid_file).write_text(str(worker.pid))
    time.sleep(600)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + SAFETY_S
    while not (path.is_file() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)


def _dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (dead all the same), within SAFETY_S."""
    deadline = time.monotonic() + SAFETY_S
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(
    ("kill", "point"), [("checkpoint_write:1", "checkpoint_write:1"), (0.5, "its first checkpoint")]
)
def test_a_killed_run_that_stalls_is_stopped_at_task_timeout_s_with_its_workers(tmp_path, kill, point):
    """proc.join() with no limit (a named point), and a wait for the first checkpoint with none (a kill timed from
    it): a run that stalled before either hung the bench for good; task.timeout_s bounded only whole runs."""
    kill = kill if isinstance(kill, str) else chaos.After(kill)
    folder, pid_file = tmp_path / "killed", tmp_path / "worker.pid"
    folder.mkdir()
    run = multiprocessing.get_context("fork").Process(
        target=_stalling_run, args=(str(pid_file), str(tmp_path / "killed.console.txt"))
    )
    run.start()
    try:
        _wait_for(pid_file)
        worker = int(pid_file.read_text())
        said = (
            rf"^bench_chaos: the run in {re.escape(str(folder))} did not reach {re.escape(point)} within "
            r"task\.timeout_s=1; its console ends: 'loading the data\\n'$"
        )
        with pytest.raises(UserError, match=said):
            chaos._kill_at(run, kill, folder, sweep=False, timeout_s=1.0)
        assert run.exitcode == -signal.SIGKILL
        assert _dead(worker)  # the whole process group went, not the run alone
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.join(SAFETY_S)


@pytest.mark.slow  # the warm interpreter's start (imports torch, lightning): 20-25 s on 2 shared cores
def test_a_stalled_run_started_as_the_bench_starts_its_runs_is_stopped(tmp_path):
    """The same through child.start, bench_chaos's own way to start a run (a forkserver child in its own session)."""
    script = tmp_path / "stall.py"
    script.write_text("import time\nprint('loading the data', flush=True)\ntime.sleep(600)\n")
    folder = tmp_path / "killed"
    folder.mkdir()
    run = child.start(str(script), [], tmp_path / "killed.console.txt", session=True)
    try:
        with pytest.raises(UserError, match=r"did not reach checkpoint_write:2 within task\.timeout_s=5; its console"):
            chaos._kill_at(run, "checkpoint_write:2", folder, sweep=False, timeout_s=5.0)
        assert run.exitcode == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.join(SAFETY_S)


@pytest.mark.parametrize(("ignores", "ended_by"), [(True, signal.SIGKILL), (False, signal.SIGTERM)])
def test_a_server_is_stopped_with_its_process_group_and_killed_when_it_ignores_sigterm(ignores, ended_by):
    """server.wait(timeout=60) after SIGTERM raised TimeoutExpired and left a server that ignores SIGTERM running;
    one that heeds SIGTERM still ends by it (its grace kept)."""
    code = (
        "import signal, subprocess, time\n"
        f"signal.signal(signal.SIGTERM, signal.{'SIG_IGN' if ignores else 'SIG_DFL'})\n"
        "worker = subprocess.Popen(['sleep', '600'])\n"
        "print(worker.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True, text=True)
    try:
        worker = int(server.stdout.readline())
        chaos_serve.stop(server, grace_s=1.0)
        assert server.returncode == -ended_by
        assert _dead(worker)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(SAFETY_S)
        server.stdout.close()


@pytest.mark.parametrize(
    ("override", "unreached", "reach"),
    [
        ("task.tracks.text.failpoints=[checkpoint_write,export_write]", "export_write", "checkpoint_write"),
        ("task.tracks.text.failpoints=[store_write]", "store_write", "checkpoint_write"),  # text: a shared cache
        ("task.tracks.text_streamed.failpoints=[export_write]", "export_write", "checkpoint_write or store_write"),
    ],
)
def test_a_failpoint_no_training_track_reaches_is_refused_before_the_first_run(override, unreached, reach):
    """export_write (task=export only), or store_write on a track whose runs share the whole run's layer store:
    each such trial ran whole, then quietly became checkpoint_write:1."""
    said = rf"^task\.tracks\.\w+\.failpoints names {unreached}, which its runs never reach: give {reach} \("
    with pytest.raises(UserError, match=said):
        chaos.check_settings(compose("recipe=bench_chaos", override).task)
    chaos.check_settings(compose("recipe=bench_chaos").task)  # store_write on text_streamed (own_cache) passes
