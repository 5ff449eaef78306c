"""`task=bench_chaos` (recipe=bench_chaos): runs killed with SIGKILL at random, seeded moments, resumed, and
compared with the same run never interrupted.

Each track (task.tracks: a name, the run.py overrides of a short training run with frequent checkpoints, and
the data it needs generated) runs once whole in a process of its own. Then each of its trials starts the same
run, kills its process group with SIGKILL after a seeded random share of the whole run's wall time (inside a
step, during validation, a checkpoint write or a layer store build: wherever the moment falls), checks what
the kill left (a `last.ckpt` must load; a half-written one must not be where a resume looks), and resumes:
`ckpt=<killed run>` when it wrote a checkpoint, else the run from the start. The resumed run must end with the
whole run's weights (every tensor of its last checkpoint: the model, the optimizer's moments, the step),
bitwise, or within task.atol where a kernel is not deterministic (said per track), the same best checkpoint
(its step) and the same figures in metrics.json: the loss curve (the same samples seen, in the same order), every
validation (val/history), the best checkpoint's scores, all but where the run ran and what it measured (paths in
its own folder read alike; timings, rates and memory left out). A `grid` track kills a sweep mid-job
and runs the same sweep again: it must finish every job, each with the uninterrupted sweep's weights.

Figures: chaos/trials, chaos/faults (by where the kill fell), chaos/exact, chaos/close, chaos/mismatched,
chaos/corrupt (must be 0), per track chaos/<track>/..., and bench_chaos.md beside metrics.json.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any, NoReturn

import torch

from onn.bench import chaos_data, chaos_serve, child
from onn.bench.chaos_data import generate
from onn.config import ONNConfig
from onn.config.task import BenchChaosTask, ChaosServer, ChaosTrack
from onn.errors import UserError
from onn.hardware import failpoints
from onn.hardware.profile import cache_file
from onn.training.checkpoints import load, read_meta, whole_last

log = logging.getLogger("onn")
RUN_PY = Path(__file__).resolve().parents[2] / "run.py"
# figures of metrics.json that a resumed run need not share with the whole run: where it resumed from (its config's
# digest counts ckpt), and where it ran; the measured ones are named by MEASURED, and resource/*
RUN_SPECIFIC = {
    "resumed_from",
    "from_checkpoint",
    "checkpoint_used",
    "config_digest",
    "wall_s",
    "heartbeat",
    "pid",
    "host",
}
MEASURED = ("_s", "_mb", "seconds")  # key endings: times, rates (samples_per_s), memory
# the failpoints a training run reaches: a checkpoint's write, and a layer store's build in a run with its own
# cache (a shared one is built by the whole run only); export_write only in task=export, which no track runs
TRAINING_POINTS = ("checkpoint_write", "store_write")


def run(job) -> dict[str, Any]:
    task: BenchChaosTask = job.config.task
    check_settings(task)
    root = job.run_dir / "chaos"
    shutil.rmtree(root, ignore_errors=True)  # this bench's own runs from an earlier start in the same folder
    rng = random.Random(task.seed)
    started = time.perf_counter()
    results = {}
    for name, trials in trial_shares(task).items():
        track = task.tracks[name]
        if track.own_cache:  # its runs share the bench's hardware profile, not a fresh measurement of their own
            _share_profile(job.config, root / name / "hardware")
        overrides = [*track.overrides, *generate(track.data, root / "data", task.seed)]
        results[name] = _track(name, overrides, track, trials, root / name, rng, task)
        log.info("chaos %s: %s", name, results[name]["summary"])
    metrics = _figures(results, time.perf_counter() - started)
    if task.server is not None:
        metrics.update(chaos_serve.run(task.server, root / "server", task.seed))
        metrics["chaos/seconds"] = round(time.perf_counter() - started, 1)
    (job.run_dir / "bench_chaos.md").write_text(_table(results, metrics))
    return metrics


def trial_shares(task: BenchChaosTask) -> dict[str, int]:
    """task.trials spread over the tracks in order; a track left with none is not run at all (its whole run alone
    would take minutes and check nothing)."""
    names = list(task.tracks) if task.trials else []
    shares = {name: task.trials // len(names) + (i < task.trials % len(names)) for i, name in enumerate(names)}
    if 0 in shares.values():
        log.warning("chaos: task.trials=%d < %d tracks: only the first %d run", task.trials, len(names), task.trials)
    return {name: n for name, n in shares.items() if n}


def check_settings(task: BenchChaosTask) -> None:
    """Every setting that cannot work, refused before the first run: found at its track's turn (a data kind) or
    in the server part, it failed the bench after every earlier track had run (minutes), a zero clients as
    ThreadPoolExecutor's traceback."""
    if task.trials < 0 or (task.trials and not task.tracks) or (not task.trials and task.server is None):
        raise UserError(
            "give task.trials (1 or more) and task.tracks to kill runs, or task.server to load a server, or both."
        )
    shares = ("failpoint_share", "after_first_checkpoint", "kill_from", "kill_to")
    _check_shares("task", {key: getattr(task, key) for key in shares})
    if task.atol < 0 or task.timeout_s <= 0:
        raise UserError(f"task.atol={task.atol:g} and task.timeout_s={task.timeout_s:g}: give 0 or more and above 0.")
    for name, track in task.tracks.items():
        if not track.overrides:
            raise UserError(f"task.tracks.{name}.overrides is empty: give the run.py overrides of a short run.")
        if unknown := [p for p in track.failpoints or () if p not in failpoints.POINTS]:
            raise UserError(
                f"task.tracks.{name}.failpoints names {', '.join(unknown)}: "
                f"the points are {', '.join(failpoints.POINTS)}."
            )
        reach = TRAINING_POINTS if track.own_cache else TRAINING_POINTS[:1]
        if unreached := [p for p in track.failpoints or () if p not in reach]:
            raise UserError(
                f"task.tracks.{name}.failpoints names {', '.join(unreached)}, which its runs never reach: give "
                f"{' or '.join(reach)} (store_write only on a track with own_cache: true)."
            )
        if track.data is not None and track.data not in chaos_data.WRITERS:
            raise UserError(
                f"task.tracks.{name}.data={track.data}: give one of {', '.join(chaos_data.WRITERS)}, or null."
            )
    if task.server is not None:
        _check_server(task.server)


def _check_shares(where: str, shares: dict[str, float]) -> None:
    for key, share in shares.items():
        if not 0.0 <= share <= 1.0:
            raise UserError(f"{where}.{key}={share:g}: a share, give a number from 0 to 1.")


def _check_server(server: ChaosServer) -> None:
    _check_shares("task.server", {"drop_share": server.drop_share, "malformed_share": server.malformed_share})
    if server.drop_share + server.malformed_share > 1.0:
        raise UserError(
            f"task.server.drop_share={server.drop_share:g} and malformed_share={server.malformed_share:g} add up "
            "to more than 1: the rest of the requests are the ones answered; lower one of them."
        )
    for key, least in {"requests": 0, "more_requests": 0, "clients": 1, "max_tokens": 1}.items():
        if getattr(server, key) < least:
            raise UserError(f"task.server.{key}={getattr(server, key)}: give {least} or more.")


def _track(
    name: str, overrides: list[str], track: ChaosTrack, trials: int, folder: Path, rng, task: BenchChaosTask
) -> dict[str, Any]:
    """The whole run, then `trials` killed and resumed ones; what each found."""
    sweep = track.sweep
    whole = folder / "whole"
    wall, first = _finish(_with_cache(overrides, track, whole), whole, sweep, task.timeout_s)
    reference = _final_state(whole, sweep)
    found = []
    for k in range(trials):
        point = None
        if track.failpoints and rng.random() < task.failpoint_share:
            point = f"{rng.choice(track.failpoints)}:{rng.randint(1, 3)}"  # the 1st, 2nd or 3rd time it is reached
        # the other kills: most after the first checkpoint (inside steps, validations, checkpoint writes), the
        # rest before it (start-up, the layer store's build, the first steps)
        elif rng.random() < task.after_first_checkpoint:  # timed from the killed run's own first checkpoint
            moment = After(rng.uniform(0.0, task.kill_to) * (wall - first))
        else:
            moment = rng.uniform(task.kill_from, 1.0) * first
        kill = point or moment
        found.append(_trial(overrides, track, folder / f"trial_{k}", kill, reference, task))
    kinds = Counter(f["fault"] for f in found)
    outcome = Counter(f["outcome"] for f in found)
    return {
        "whole_s": round(wall, 1),
        "trials": found,
        "faults": dict(kinds),
        "outcomes": dict(outcome),
        "corrupt": sum(f["corrupt"] for f in found),
        "summary": f"{trials} trials, {dict(outcome)}, faults {dict(kinds)}",
    }


class After(float):
    """Seconds after the killed run's own first checkpoint (a plain float: after its start)."""


def _trial(
    overrides: list[str], track: ChaosTrack, folder: Path, kill: float | str, reference, task: BenchChaosTask
) -> dict[str, Any]:
    """One run killed (after `kill` seconds, or at the named point `kill`), checked and resumed."""
    sweep = track.sweep
    for attempt in range(4):  # a run faster than the whole one (caches now warm) may end first: kill it
        shutil.rmtree(folder, ignore_errors=True)
        killed = folder / "killed"
        proc = _start(
            _with_cache(overrides, track, killed), killed, sweep, point=kill if isinstance(kill, str) else None
        )
        fault = _kill_at(proc, kill, killed, sweep, task.timeout_s)
        if fault is not None:
            break
        # sooner; the last try kills at the first checkpoint write, which every run reaches
        kill = type(kill)(kill * 0.6) if isinstance(kill, float) and attempt < 2 else "checkpoint_write:1"
    else:
        fault = "finished before the kill"
    corrupt = _corrupt(killed, sweep)
    if sweep:  # the same sweep again: finished jobs are skipped, the killed one runs again
        resumed, extra = killed, []
    else:
        resumed = folder / "resumed"
        # last.ckpt, or the last.ckpt.old a kill between a save's two renames left: `ckpt=` takes either
        extra = [f"ckpt={killed}"] if whole_last(killed / "checkpoints") is not None else []
    run_again = _with_cache([*overrides, *extra], track, killed)  # the killed run's store, half built or whole
    _finish(run_again, resumed, sweep, task.timeout_s)  # a resume that fails ends the bench
    outcome, diff = _compare(reference, _final_state(resumed, sweep), task.atol)
    return {
        "kill": kill
        if isinstance(kill, str)
        else f"{float(kill):.2f} s after {'its first checkpoint' if isinstance(kill, After) else 'its start'}",
        "fault": fault,
        "resumed_from": "checkpoint" if extra else ("sweep" if sweep else "start"),
        "corrupt": corrupt,
        "outcome": outcome,
        "max_abs_diff": diff,
    }


def _share_profile(config: ONNConfig, folder: Path) -> None:
    """The bench's own hardware profile into an own_cache track's profile folder: a measurement there (tens of
    seconds) would make the whole run that long, and the kills timed from it would all land after the trials'
    first checkpoint."""
    source = cache_file(config.hardware, config.paths.cache)
    if source.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, folder / source.name)


def _with_cache(overrides: list[str], track: ChaosTrack, folder: Path) -> list[str]:
    """A run of an own_cache track builds its own layer store (the hardware profile stays shared: the plan
    must not change between the whole run and a resumed one)."""
    if not track.own_cache:
        return overrides
    shared = folder.parents[1] if folder.parent.name.startswith("trial_") else folder.parent
    return [*overrides, f"paths.cache={folder}.cache", f"hardware.cache={shared / 'hardware'}"]


def _kill_at(proc, kill: float | str, folder: Path, sweep: bool, timeout_s: float) -> str | None:
    """SIGKILL to the run's process group `kill` seconds after its start, or wait for it to kill itself at the
    named point; where the kill fell (None: the run ended first, whole). A run that failed on its own is the
    harness's finding: it was taken for one that ended first, tried again and counted as a trial. A run that
    stalls before its point or first checkpoint is stopped at timeout_s: it hung the whole bench for good."""
    deadline = time.monotonic() + timeout_s
    if isinstance(kill, str):
        proc.join(timeout=timeout_s)
        if proc.is_alive():
            _stalled(proc, folder, kill, timeout_s)
        with contextlib.suppress(ProcessLookupError):  # what the run started (DataLoader workers) goes with it
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.exitcode == -signal.SIGKILL:
            return f"at {kill.split(':')[0]}"
        _check_ended(proc.exitcode, folder)
        return None
    if isinstance(kill, After):  # a shared machine runs each run at its own pace: wait for its checkpoint
        pattern = "*/checkpoints/last.ckpt" if sweep else "checkpoints/last.ckpt"
        while proc.is_alive() and not any(folder.glob(pattern)):
            if time.monotonic() > deadline:
                _stalled(proc, folder, "its first checkpoint", timeout_s)
            time.sleep(0.02)
    proc.join(timeout=float(kill))
    if not proc.is_alive():
        _check_ended(proc.exitcode, folder)
        return None
    fault = _where(folder, sweep)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.join()
    return fault


def _stalled(proc, folder: Path, point: str, timeout_s: float) -> NoReturn:
    """Kill a run that did not reach `point` in time, with its process group, and say so in one sentence."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.join()
    raise UserError(
        f"bench_chaos: the run in {folder} did not reach {point} within task.timeout_s={timeout_s:g}; "
        f"its console ends: {_console_tail(folder)!r}"
    )


def _start(overrides: list[str], folder: Path, sweep: bool, point: str | None = None):
    """`python run.py OVERRIDES` in a session of its own (forked from a warm interpreter: `child.start`)."""
    where = [f"hydra.sweep.dir={folder}", "-m"] if sweep else [f"hydra.run.dir={folder}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    env.pop("ONN_FAILPOINT", None)
    if point is not None:
        env["ONN_FAILPOINT"] = point
    folder.mkdir(parents=True, exist_ok=True)
    console = folder.parent / f"{folder.name}.console.txt"
    return child.start(str(RUN_PY), [*overrides, *where], console, env=env, session=True)


def _finish(overrides: list[str], folder: Path, sweep: bool, timeout_s: float) -> tuple[float, float]:
    """Run to the end; its wall time, and when its first checkpoint appeared (the wall time if none did). A
    run that fails is the harness's finding, said in one sentence."""
    started = time.perf_counter()
    proc = _start(overrides, folder, sweep)
    first = None
    while proc.is_alive() and time.perf_counter() - started < timeout_s:
        if first is None and any(folder.glob("**/checkpoints/last.ckpt")):
            first = time.perf_counter() - started
        time.sleep(0.05)
    timed_out = proc.is_alive()
    if timed_out:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.join()
    _check_ended(f"a timeout ({timeout_s:g} s)" if timed_out else proc.exitcode, folder)
    wall = time.perf_counter() - started
    return wall, first or wall


def _check_ended(code: int | str, folder: Path) -> None:
    """A run that ended otherwise than whole (exit code 0): the harness's finding, said in one sentence."""
    if code != 0:
        raise UserError(
            f"bench_chaos: the run in {folder} ended with {code}; its console ends: {_console_tail(folder)!r}"
        )


def _console_tail(folder: Path) -> str:
    """The last of what the run in `folder` printed (the console file `_start` gave it)."""
    return (folder.parent / f"{folder.name}.console.txt").read_text(errors="replace")[-600:]


def _runs(folder: Path, sweep: bool) -> list[Path]:
    return sorted(p.parent for p in folder.glob("*/metrics.json")) if sweep else [folder]


def _final_state(folder: Path, sweep: bool) -> dict[str, Any]:
    """Per run: its last checkpoint's weights and optimizer state (the callbacks' state names the run's own
    folder) and step, its best checkpoint's step, and the figures of its metrics.json a resumed run must share."""
    out = {}
    for run in _runs(folder, sweep):
        metrics = json.loads((run / "metrics.json").read_text())
        last = run / "checkpoints" / "last.ckpt"
        if not last.is_dir() and metrics.get("resumed_from"):  # resumed after the last step: nothing left to train
            last = Path(metrics["resumed_from"])
        saved = load(last)
        state = {"state_dict": saved["state_dict"], "optimizer_states": saved.get("optimizer_states", [])}
        best = run / "checkpoints" / "best.ckpt"
        out[run.name if sweep else "run"] = {
            "tensors": _tensors(state),
            "step": saved["global_step"],
            "best_step": read_meta(best).get("global_step") if best.is_dir() else None,
            "values": run_values(metrics, run),
        }
    return out


def run_values(metrics: dict[str, Any], run: Path) -> dict[str, Any]:
    """The figures of a run's metrics.json that the same run resumed ends with too (its loss curve, validations,
    best checkpoint's scores, ...): all but the run-specific and measured ones, with the run's own folder in a path
    read as <run>."""
    return {
        key: _in_run(value, str(run))
        for key, value in metrics.items()
        if key not in RUN_SPECIFIC and not key.endswith(MEASURED) and not key.startswith("resource/")
    }


def _in_run(value: Any, run: str) -> Any:
    """`value` with each path into `run` as <run>: the whole run's checkpoint is <run>/checkpoints/last.ckpt, and
    so is the resumed run's, in its own folder."""
    if isinstance(value, str):
        return "<run>" + value.removeprefix(run) if value.startswith(run + "/") else value
    if isinstance(value, list):
        return [_in_run(v, run) for v in value]
    if isinstance(value, dict):
        return {k: _in_run(v, run) for k, v in value.items()}
    return value


def _tensors(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list | tuple) else ()
    found = {}
    for key, value in items:
        found.update(_tensors(value, f"{prefix}/{key}"))
    return found


def _compare(reference: dict[str, Any], resumed: dict[str, Any], atol: float) -> tuple[str, float | None]:
    """exact (every tensor and figure the same), close (within atol), or mismatched (another tensor set, step,
    best checkpoint or figure: a loss curve, a validation record, a score)."""
    if set(reference) != set(resumed):
        return "mismatched", None
    worst = 0.0
    for name, want in reference.items():
        got = resumed[name]
        if want["step"] != got["step"] or want["best_step"] != got["best_step"]:
            return "mismatched", None
        shared = {key: got["values"][key] for key in want["values"] if key in got["values"]}
        diffs = (_tensors_differ(want["tensors"], got["tensors"]), _differ(want["values"], shared))
        if None in diffs:
            return "mismatched", None
        worst = max(worst, *diffs)
    if worst == 0.0:
        return "exact", 0.0
    return ("close" if worst <= atol else "mismatched"), worst


def _tensors_differ(want: dict[str, Any], got: dict[str, Any]) -> float | None:
    """The largest difference between two runs' tensors, None where they are not the same set (names, shapes,
    dtypes), an integer tensor differs or a NaN is where the other run has a number. NaN and equal infinities
    agree with themselves: a NaN difference was lost in max() (`max(0.0, nan)` is 0.0), so a resumed run whose
    weights turned NaN counted as exact."""
    if set(want) != set(got):
        return None
    worst = 0.0
    for key, a in want.items():
        b = got[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            return None
        if not a.is_floating_point():
            if not bool((a == b).all()):
                return None
            continue
        a, b = a.double(), b.double()
        if not torch.equal(a.isnan(), b.isnan()):
            return None
        same = (a == b) | a.isnan()
        worst = max(worst, float(torch.where(same, 0.0, (a - b).abs()).max()) if a.numel() else 0.0)
    return worst


def _differ(a: Any, b: Any) -> float | None:
    """The largest difference between the numbers of two figures (0.0: the same), None where they differ otherwise
    (another text, key set, length or kind of value)."""
    number = (int, float)
    if isinstance(a, number) and isinstance(b, number) and not isinstance(a, bool) and not isinstance(b, bool):
        if math.isnan(a) or math.isnan(b):  # (abs(nan - x) is NaN, which max() drops)
            return 0.0 if math.isnan(a) and math.isnan(b) else None
        return 0.0 if a == b else abs(float(a) - float(b))
    if isinstance(a, dict) and isinstance(b, dict):
        parts = [_differ(a[k], b[k]) for k in a] if a.keys() == b.keys() else [None]
    elif isinstance(a, list) and isinstance(b, list):
        parts = [_differ(x, y) for x, y in zip(a, b, strict=True)] if len(a) == len(b) else [None]
    else:
        return 0.0 if type(a) is type(b) and a == b else None
    return None if None in parts else max(parts, default=0.0)


def _where(folder: Path, sweep: bool) -> str:
    """Where the kill falls, from what the run has on disk at that moment."""
    runs = _runs(folder, sweep)
    for run in runs:
        if list(run.glob("checkpoints/*.tmp")) or list(run.glob("checkpoints/*.ckpt.old")):  # (between its renames)
            return "checkpoint write"
    if list(folder.with_name(folder.name + ".cache").glob("stores/**/*.tmp")):
        return "layer store build"
    if not any((run / "checkpoints" / "last.ckpt").is_dir() for run in runs):
        return "before the first checkpoint"
    return "training or validation"


def _corrupt(folder: Path, sweep: bool) -> int:
    """Checkpoints the kill left that a resume would take as whole but that do not load: each NAME.ckpt, and a
    last.ckpt.old without its last.ckpt (a kill between a save's two renames), which `ckpt=` takes then."""
    bad = 0
    for run in _runs(folder, sweep):
        alone = [old for old in run.glob("checkpoints/last.ckpt.old") if not old.with_suffix("").exists()]
        for ckpt in [*run.glob("checkpoints/*.ckpt"), *alone]:
            try:
                load(ckpt)
            except Exception:  # noqa: BLE001 - any failure to load is the finding
                bad += 1
    return bad


def _figures(results: dict[str, dict[str, Any]], seconds: float) -> dict[str, Any]:
    trials = [t for r in results.values() for t in r["trials"]]
    outcomes = Counter(t["outcome"] for t in trials)
    metrics: dict[str, Any] = {
        "chaos/trials": len(trials),
        "chaos/faults": dict(Counter(t["fault"] for t in trials)),
        "chaos/exact": outcomes["exact"],
        "chaos/close": outcomes["close"],
        "chaos/mismatched": outcomes["mismatched"],
        "chaos/corrupt": sum(r["corrupt"] for r in results.values()),
        "chaos/seconds": round(seconds, 1),
    }
    for name, r in results.items():
        metrics[f"chaos/{name}"] = {k: v for k, v in r.items() if k != "summary"}
    return metrics


def _table(results: dict[str, dict[str, Any]], metrics: dict[str, Any]) -> str:
    lines = [
        "# bench_chaos: kill -9 at random moments, resumed",
        "",
        "| track | trials | exact | close | mismatched | corrupt | faults | whole run s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        o = r["outcomes"]
        faults = ", ".join(f"{k}: {v}" for k, v in r["faults"].items())
        lines.append(
            f"| {name} | {len(r['trials'])} | {o.get('exact', 0)} | {o.get('close', 0)} | {o.get('mismatched', 0)} "
            f"| {r['corrupt']} | {faults} | {r['whole_s']} |"
        )
    total = (
        f"**{metrics['chaos/trials']} trials**: {metrics['chaos/exact']} exact, {metrics['chaos/close']} close, "
        f"{metrics['chaos/mismatched']} mismatched, {metrics['chaos/corrupt']} corrupt checkpoints, "
        f"in {metrics['chaos/seconds']} s"
    )
    return "\n".join([*lines, "", total, ""])
