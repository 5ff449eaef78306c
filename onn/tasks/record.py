"""A run's metrics.json from its first second to its end, so that a run that dies still leaves a record.

    status: running   from the start: pid, host and a heartbeat that a background thread refreshes every
                      HEARTBEAT_S seconds with the last optimizer step reached
    status: ok        the run finished
    status: failed    an error, or a terminating signal: SIGTERM (`timeout`, a cluster's pre-emption) or
                      SIGINT (Ctrl-C) end the run at once with `signal` and `steps` (the last step reached);
                      checkpoints are written atomically, so the last one stays whole

A SIGKILLed run (or a machine that went down) cannot write anything: its record still says `running` and
its heartbeat stops. `state` tells such a run from a live one: on this host by its pid, elsewhere by a
heartbeat older than STALE_S. The benchmark grid shows it as crashed and a resumed sweep runs it again.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import hydra.core.utils
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from onn.errors import UserError, write_refused
from onn.hardware.cluster import is_rank_zero, rank_variable
from onn.hardware.locks import holder, try_hold
from onn.json_values import strict_json
from onn.training import progress
from onn.training.trainer import REQUEUE_CHECKPOINTS, newest_checkpoint

log = logging.getLogger("onn")
HEARTBEAT_S = 15.0  # how often a running record is refreshed: one small file write
STALE_S = 6 * HEARTBEAT_S  # a heartbeat older than this is a dead run's (when its pid cannot be asked)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """A terminating signal: a BaseException, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process a signal ended


class RunRecord:
    """metrics.json of one run: `start` (running, heartbeat, signal handlers), `finish` (the final record)."""

    def __init__(self, run_dir: Path, metrics: dict[str, Any]):
        self.path = Path(run_dir) / "metrics.json"
        self.metrics = metrics
        self.started = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: dict[int, Any] = {}
        self._pid = os.getpid()
        self._started = False  # `start` ran: from then on the folder's record is this run's

    def update(self, values: dict[str, Any]) -> None:
        """Add `values` to the record, under the lock the heartbeat writes it under: a key added while the heartbeat
        read the record ended the heartbeat thread ("dictionary changed size during iteration")."""
        with self._lock:
            self.metrics.update(values)

    def start(self) -> None:
        """Write `status: running` and keep it fresh; SIGTERM and SIGINT raise Interrupted from now on."""
        self.update(
            {"status": "running", "pid": os.getpid(), "host": socket.gethostname(), "steps": progress.last_step()}
        )
        self._started = True
        self.write()
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        self._thread = threading.Thread(target=self._beat, name="onn-heartbeat", daemon=True)
        self._thread.start()

    def finish(self, **final: Any) -> None:
        """The run's last record (status ok or failed); the heartbeat stops and the signals are as before.

        A run that failed before `start` (a config error, a refusal) leaves a finished (ok) record already in its
        folder as it is: a resume into a run's own folder with a misspelt key replaced that run's figures with the
        error, which the run says on stderr anyway."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        with self._lock:
            self.metrics.update(final)
            for key in ("pid", "host", "heartbeat"):  # only a running record needs them
                self.metrics.pop(key, None)
        if not self._started and final["status"] == "failed" and self._earlier_ok():
            log.info("%s: left as it is, an earlier run's finished record (this run never started)", self.path)
            return
        self.write()

    def _earlier_ok(self) -> bool:
        """Whether the folder's metrics.json is an earlier run's finished (ok) record."""
        try:
            earlier = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(earlier, dict) and earlier.get("status") == "ok"

    def interrupted(self, signum: int) -> None:
        """The record of a run a signal ended: failed, with the signal and the last step reached."""
        name = signal.Signals(signum).name
        step = progress.last_step()
        reached = f"after step {step}" if step else "before its first step"
        self.finish(status="failed", signal=name, steps=step, error=f"stopped by {name} {reached}")

    def write(self) -> None:
        """metrics.json, replaced whole (a reader never sees half a file); by rank 0 alone in a multi-process run."""
        if not is_rank_zero():
            return
        with self._lock:
            self.metrics["wall_s"] = round(time.perf_counter() - self.started, 2)
            if self.metrics["status"] == "running":
                self.metrics["heartbeat"] = time.time()
            # a copy (made at once): a caller that adds a key to `metrics` directly cannot change it while it is read
            clean = strict_json(dict(self.metrics))
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(json.dumps(clean, indent=2, default=str) + "\n")
                os.replace(tmp, self.path)
            except OSError as e:
                with contextlib.suppress(OSError):  # its folder may be what could not be made
                    tmp.unlink(missing_ok=True)
                raise write_refused(e, self.path, None, "the run (hydra.run.dir)") from None

    def _beat(self) -> None:
        """The heartbeat's loop: it outlives a write that fails (a dead heartbeat reads as a crashed run after
        STALE_S), and says the first such failure in the log."""
        said = False
        while not self._stop.wait(HEARTBEAT_S):
            step = progress.last_step()
            if step is not None:
                self.update({"steps": step})
            try:
                self.write()
            except UserError:  # the run itself reports a folder it cannot write
                pass
            except Exception as e:  # noqa: BLE001 -- the next beat may write; the run's own end reports its record
                if not said:
                    log.warning("%s: the heartbeat could not write it (%s: %s); it tries again", self.path,
                                type(e).__name__, e)  # fmt: skip
                said = True

    def _on_signal(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:  # a forked DataLoader worker: it ends the way torch expects
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        raise Interrupted(signum)


def state(metrics: dict[str, Any], now: float | None = None) -> str:
    """A record's status, with a `running` record whose process is gone read as `crashed`."""
    status = str(metrics.get("status") or ("failed" if metrics.get("error") else "ok"))
    if status != "running":
        return status
    pid, host, beat = metrics["pid"], metrics["host"], metrics["heartbeat"]  # what `start` writes
    if isinstance(pid, int) and host == socket.gethostname() and not _alive(pid):
        return "crashed"
    fresh = isinstance(beat, int | float) and (now or time.time()) - beat <= STALE_S
    return "running" if fresh else "crashed"  # a reused pid does not keep a dead run's heartbeat going


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process holds the pid: cannot tell, say alive
    try:  # a zombie (exited, not reaped yet) is not running
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def writable_folder(path: str | os.PathLike, key: str) -> Path:
    """`path` as a folder this run can write into (made when missing); one sentence when a file is in the way."""
    path = Path(path).expanduser()
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        what = "is a file" if blocking == path else f"is under {blocking}, which is a file"
        raise UserError(f"{key}={path} {what}, so it cannot be a folder; choose another path.")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{key}={path} cannot be made: {e.strerror or e}; choose another path.") from None
    try:  # an existing folder may still refuse writes (read-only, not ours): say so before any work
        with tempfile.NamedTemporaryFile(dir=path, prefix=".onn-write-probe-"):
            pass
    except OSError as e:
        raise UserError(f"{key}={path} cannot be written to: {e.strerror or e}; choose another path.") from None
    return path


def writable_file(path: str | os.PathLike, key: str) -> Path:
    """`path` as a file this run can write when it ends (its folder made when missing): a folder there, or a folder
    that cannot be made or written, is one sentence now rather than a traceback after the work is done."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise UserError(f"{key}={path} is a folder: give the file to write, e.g. {key}={path / 'predictions.jsonl'}.")
    writable_folder(path.parent, key)
    return path


def literal_folder(path: str, key: str) -> Path:
    """The folder Hydra writes for hydra.run.dir / hydra.sweep.dir: the path as written. A leading `~` that reaches
    here (a YAML value, or `${paths.outputs}` set to one) Hydra does not expand: it would make a folder named `~`
    while a check of the expanded path held another, so it is refused (on the command line ONN expands it first)."""
    if path.startswith("~"):
        raise UserError(
            f"{key}={path}: Hydra does not expand ~ in its run folders (it would make a folder named ~ here); write "
            "the path in full, or give it on the command line, where ONN expands ~."
        )
    return Path(path)


def raw(node: Any) -> Any:
    """Hydra's overrides and sweeper settings as written: an override's `${...}` is a value to compare, not one to
    resolve here (a misspelt one is the run's own one-sentence error, not this callback's traceback)."""
    return OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node


class RunFolder(Callback):
    """Hydra callback: the run (or sweep) folder is checked before Hydra makes it, so that a path that is a
    file ends in one sentence instead of Hydra's traceback. Set in conf/config.yaml."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        resume_requeued(config)
        self._check(config, "run")
        write_hydra_files_whole("hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "sweep")
        write_hydra_files_whole("hydra.sweep.dir")
        if problem := other_sweep(Path(config.hydra.sweep.dir), config):
            print(f"error: {problem}", file=sys.stderr, flush=True)
            raise SystemExit(1)

    @staticmethod
    def _check(config: DictConfig, mode: str) -> None:
        HydraConfig.instance().set_config(config)  # Hydra sets it only later; ${hydra:runtime.cwd} needs it now
        key = f"hydra.{mode}.dir"
        try:
            try:
                written = str(config.hydra[mode].dir)
            except OmegaConfBaseException as e:  # a misspelt ${...} in it or in paths.outputs, which it reads
                raise UserError(
                    f"{key}: {str(e).splitlines()[0]}; fix the ${{...}} to name a key of the config."
                ) from None
            folder = writable_folder(literal_folder(written, key), key)
            if is_first_process():  # a run's other ranks share its folder (and its lock)
                hold_folder(folder, key)
                if mode == "run":
                    refuse_earlier_run(folder, key, config)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None


def write_hydra_files_whole(key: str) -> None:
    """Hydra writes a job's .hydra/ (config.yaml, hydra.yaml, overrides.yaml) itself, after its folder is made and
    before any callback of the job, with a plain open(): a full disk left a cut-short file (which a resumed sweep
    reads back as the job's overrides) and Hydra's traceback. It offers no hook there, so its writer is replaced by
    one that writes each file whole or not at all and says in one sentence what the disk refused. Hydra 1.3's
    private writer (requirements.lock pins it); a Hydra without it keeps its own. In this process only: jobs that a
    launcher starts elsewhere (submitit) write with Hydra's, as does multirun.yaml, and a refusal ends a sweep.
    In a sweep it is also the first thing each job writes: a job of another config whose folder an earlier job of
    the sweep wrote into (a hydra.sweep.subdir that does not differ from job to job) ends the sweep there, before it
    writes anything. Jobs a launcher runs in other processes are not seen."""
    if not hasattr(hydra.core.utils, "_save_config"):
        return
    jobs: dict[Path, tuple[int, str]] | None = {} if key == "hydra.sweep.dir" else None
    hydra.core.utils._save_config = functools.partial(_save_config_whole, key=key, jobs=jobs)


def _save_config_whole(
    cfg: Any, filename: str, output_dir: Path, key: str, jobs: dict[Path, tuple[int, str]] | None
) -> None:
    """Hydra's _save_config(cfg, filename, output_dir): the YAML in UTF-8 (as Hydra writes it) through a temporary
    file renamed into place; a refused write ends the run with one sentence naming the file (and, for a full disk,
    the space free). `jobs`: in a sweep, the folder of each job so far (its number and config), which config.yaml,
    a job's first file, claims."""
    data = OmegaConf.to_yaml(cfg).encode("utf-8")
    if jobs is not None and filename == "config.yaml":
        claim_job_folder(jobs, computed(cfg))
    path = Path(output_dir) / filename
    tmp = path.with_name(f".{filename}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):  # its folder may be what could not be made
            tmp.unlink(missing_ok=True)
        print(f"error: {write_refused(e, path, len(data), f'the run ({key})')}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def computed(cfg: DictConfig) -> str:
    """What a job computes, as onn.app.config_digest sees it: its config resolved, less the paths that say where it
    runs (written unresolved where a value cannot be resolved yet: app's check then says it in one sentence)."""
    try:
        values = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException:
        values = OmegaConf.to_container(cfg, resolve=False)
    return json.dumps({k: v for k, v in values.items() if k != "paths"}, sort_keys=True, default=str)


def claim_job_folder(jobs: dict[Path, tuple[int, str]], config: str) -> None:
    """The current job's folder for this sweep (`jobs`: each folder its earlier jobs took, by job number and what
    it computes); one that an earlier job of another config took ends the sweep in one sentence: this job would replace
    that one's .hydra/, config, metrics.json and checkpoints. A job of the same config (a sweep that lists a value
    twice, an Optuna trial drawn again) finds that job's record and is not run again (onn.app.run)."""
    job = HydraConfig.get()
    folder = Path(job.runtime.output_dir).resolve()
    if folder in jobs and jobs[folder][1] != config:
        subdir = OmegaConf.to_container(job.sweep, resolve=False)["subdir"]  # as the user wrote it
        print(
            f"error: hydra.sweep.subdir={subdir} gives job {job.job.num} the folder {folder}, where job "
            f"{jobs[folder][0]} of this sweep, of another config, wrote its record, which it would replace: make "
            "hydra.sweep.subdir differ from job to job (its default, ${hydra.job.num}, does).",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1)
    jobs.setdefault(folder, (job.job.num, config))


class SweepStatus(Callback):
    """Hydra callback: a sweep whose jobs failed ends with a non-zero exit, as a failed run does. Each job fails on
    its own and the sweep goes on (the grid shows it as failed); at the end, the jobs of this sweep (their
    metrics.json written since it started: a resumed sweep's folder holds earlier ones too) are counted, and any
    that did not end `ok` are named in one line and the exit is 1. Set in conf/config.yaml, before the grid's
    callback, which Hydra calls first at the end."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.time()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        failed = failed_jobs(Path(config.hydra.sweep.dir), getattr(self, "started", 0.0))
        if failed:
            named = "; ".join(f"job {name}: {why}" for name, why in failed[:3])
            print(f"error: {len(failed)} job(s) of the sweep did not end ok ({named})", file=sys.stderr, flush=True)
            raise SystemExit(1)


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def other_sweep(sweep_dir: Path, config: DictConfig) -> str | None:
    """Why this sweep may not run into sweep_dir: a finished job there (job 0, 1, ...) is not the job this sweep
    would run in its folder, whose .hydra/ and metrics.json it would take over. Hydra's basic sweeper is compared job
    by job (its params and the command line's overrides, in order), so the same sweep again, or one that only adds
    jobs after the finished ones, resumes it (finished jobs are not run again). Another sweeper's jobs are known only
    as it runs them (ONN's Optuna sweeper checks each trial then: job_taken), and job folders named otherwise than by
    number cannot be matched to jobs: the earlier sweep's multirun.yaml is compared instead. None when it may run."""
    finished = [p.parent.name for p in sweep_dir.glob("*/metrics.json") if _ended_ok(p)]
    if not finished:
        return None
    jobs = planned_jobs(config)
    if jobs is None or not all(name.isdigit() for name in finished):  # job folders not named by hydra.job.num
        return _other_sweep_config(sweep_dir, config)
    for num in sorted(int(name) for name in finished):
        if problem := job_taken(sweep_dir, num, jobs[num] if num < len(jobs) else None, len(jobs)):
            return problem
    return None


def planned_jobs(config: DictConfig) -> list[list[str]] | None:
    """Each job's overrides, in job order, as Hydra's basic sweeper will make them: its params first, then the command
    line's task overrides, a key given in both keeping its first place. None for another sweeper, or overrides that
    do not parse (Hydra reports those itself when the sweep starts)."""
    if config.hydra.sweeper.get("_target_") != BASIC_SWEEPER:
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (raw(config.hydra.sweeper.get("params")) or {}).items()]
    try:
        parsed = OverridesParser.create().parse_overrides([*params, *raw(config.hydra.overrides.task)])
        batches = BasicSweeper.split_arguments(parsed, None)
    except Exception:  # noqa: BLE001 - Hydra's own error for the sweep follows, in its words
        return None
    return [list(job) for batch in batches for job in batch]


def job_taken(sweep_dir: Path, num: int, overrides: list[str] | None, count: int = 0) -> str | None:
    """Why job `num` of this sweep (its `overrides`; None: the sweep, of `count` jobs, has no such job) may not run
    into sweep_dir: its folder holds a finished job of other overrides. The order of one job's overrides does not
    change its config. None when it may run (no finished job there, or the same one: it is not run again)."""
    job = sweep_dir / str(num)
    if not _ended_ok(job / "metrics.json"):
        return None
    earlier = _job_overrides(job)
    if earlier is not None and overrides is not None and sorted(earlier) == sorted(overrides):
        return None
    ran = " ".join(earlier or []) or "no overrides"
    if earlier is None:
        ran = "overrides its .hydra/overrides.yaml no longer says"
    clash = (
        f"where this sweep's job {num} is `{' '.join(overrides) or 'no overrides'}` and would overwrite it"
        if overrides is not None
        else f"and this sweep has {count} job(s), so its grid would show that one beside its own"
    )
    return (
        f"hydra.sweep.dir={sweep_dir} holds the finished jobs of another sweep: its job {num} ran `{ran}`, {clash}; "
        "give another hydra.sweep.dir, or move that folder away."
    )


def _job_overrides(job: Path) -> list[str] | None:
    try:
        overrides = OmegaConf.load(job / ".hydra" / "overrides.yaml")
    except (OSError, ValueError):
        return None
    return [str(o) for o in raw(overrides)] if OmegaConf.is_list(overrides) else None


def _other_sweep_config(sweep_dir: Path, config: DictConfig) -> str | None:
    """Another sweeper: its earlier sweep's settings and overrides (in order) against this one's, from the
    multirun.yaml it saved; None when they are the same, or it saved none."""
    try:
        earlier = OmegaConf.load(sweep_dir / "multirun.yaml").hydra
        before = (raw(earlier.sweeper), [str(o) for o in raw(earlier.overrides.task)])
    except (OSError, ValueError, AttributeError):  # no earlier sweep there (or not Hydra's): nothing to take over
        return None
    now = (raw(config.hydra.sweeper), [str(o) for o in raw(config.hydra.overrides.task)])
    if before == now:
        return None
    return (
        f"hydra.sweep.dir={sweep_dir} holds the finished jobs of another sweep ({' '.join(before[1]) or 'no overrides'}"
        f"; sweeper {before[0]}) that this one ({' '.join(now[1]) or 'no overrides'}; sweeper {now[0]}) would "
        "overwrite: give another hydra.sweep.dir, or move that folder away."
    )


def _ended_ok(path: Path) -> bool:
    try:
        return json.loads(path.read_text())["status"] == "ok"
    except (OSError, ValueError, KeyError, TypeError):
        return False


def failed_jobs(sweep_dir: Path, since: float) -> list[tuple[str, str]]:
    """(job folder name, its status and error) of each job under sweep_dir whose metrics.json was written since
    `since` and that did not end ok, in job order."""
    out = []
    jobs = sorted(sweep_dir.glob("*/metrics.json"), key=lambda p: (not p.parent.name.isdigit(), p.parent.name.zfill(9)))
    for path in jobs:
        try:
            if path.stat().st_mtime < since:
                continue
            metrics = json.loads(path.read_text())
            status = state(metrics)
        except (OSError, ValueError, KeyError, TypeError):
            out.append((path.parent.name, "an unreadable metrics.json"))
            continue
        if status != "ok":
            out.append((path.parent.name, f"{status}: {metrics.get('error') or 'see its log'}"))
    return out


def refuse_earlier_run(folder: Path, key: str, config: DictConfig) -> None:
    """What an earlier run left in this run's folder is not replaced: its checkpoints, unless this run is the training
    that resumes them (resumes_here), and a training run's record (metrics.json, with config.yaml and .hydra/), which
    a run of another task would take over. Any ckpt= let a run in: an eval of a run's checkpoint into that run's
    folder replaced its training record, and a resume of another run replaced that run's last.ckpt."""
    task = str(config.task.name)
    earlier = earlier_checkpoints(folder)
    if earlier and task != "train":
        raise UserError(
            f"{key}={folder} holds an earlier run's checkpoints ({', '.join(earlier[:3])}) and its record, which this "
            f"task={task} run would replace: choose another folder (ckpt= names the checkpoint it reads)."
        )
    if not resumes_here(folder, config):
        refuse_earlier_checkpoints(folder, key)
    if task != "train" and _recorded_task(folder / "metrics.json") == "train":
        raise UserError(
            f"{key}={folder} holds the record (metrics.json) of an earlier training run, which this task={task} run "
            "would replace: choose another folder."
        )


def resumes_here(folder: Path, config: DictConfig) -> bool:
    """A training run whose ckpt= is a checkpoint in this folder (the folder, its last.ckpt, or `last` finding one
    there): it continues that run into its own folder, as a requeued SLURM job does. A ckpt elsewhere is not."""
    if not config.ckpt or str(config.task.name) != "train":
        return False
    from onn.training.checkpoints import resolve  # torch: imported here only by a run given ckpt, which needs it

    try:
        ckpt = resolve(str(config.ckpt), config.paths.outputs)
    except UserError:  # no checkpoint there: the run itself says so, once it is let in (or the folder's refusal)
        return False
    return ckpt.resolve().is_relative_to(folder.resolve())


def _recorded_task(path: Path) -> str | None:
    try:
        task = json.loads(path.read_text()).get("task")
    except (OSError, ValueError, AttributeError):
        return None
    return str(task) if task else None


def earlier_checkpoints(folder: Path) -> list[str]:
    """The names of the checkpoints an earlier run left in `folder`: its checkpoints/ and Lightning's SLURM
    auto-requeue's hpc_ckpt_N.ckpt."""
    earlier = sorted(p.name for p in folder.glob("checkpoints/*") if p.name.endswith((".ckpt", ".ckpt.old")))
    return earlier + sorted(p.name for p in folder.glob(REQUEUE_CHECKPOINTS))


def refuse_earlier_checkpoints(folder: Path, key: str) -> None:
    """A run into a folder that holds an earlier run's checkpoints would replace them (a killed run's last.ckpt
    among them, the one thing it left to resume from): that is a resume, said with ckpt=, or another folder. The
    checkpoint Lightning's SLURM auto-requeue saved (hpc_ckpt_N.ckpt) counts too: Lightning loaded it unasked."""
    earlier = earlier_checkpoints(folder)
    if earlier:
        newest = newest_checkpoint(folder)
        resume = newest if newest is not None and newest.parent == folder else folder  # an hpc_ckpt: named whole
        raise UserError(
            f"{key}={folder} holds an earlier run's checkpoints ({', '.join(earlier[:3])}) that this run would "
            f"replace: give ckpt={resume} to resume it, or choose another folder."
        )


def resume_requeued(config: DictConfig) -> None:
    """A job SLURM requeued (Lightning's auto-requeue at sbatch's --signal, or a node that failed) runs the same
    command again, without ckpt, into the run folder its first run left checkpoints in: it resumes from the newest
    of them, as ckpt=THAT would (the run's record names it). Every rank reads the same files before any writes."""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "")
    if config.ckpt or not restarts.isdigit() or int(restarts) < 1:
        return
    HydraConfig.instance().set_config(config)  # Hydra sets it only later; ${hydra:runtime.cwd} needs it now
    newest = newest_checkpoint(Path(config.hydra.run.dir))
    if newest is None:  # requeued before its first checkpoint: it starts over
        return
    config.ckpt = str(newest)
    if is_first_process():
        print(f"SLURM requeued this job ({restarts} time(s)): resuming from {newest}", flush=True)


_HELD: list[int] = []  # the run folder's lock, held until the process exits


def is_first_process() -> bool:
    """Not one of the processes torchrun, srun or Lightning's launcher start for a run's other ranks."""
    return all(rank_variable(v) in (None, 0) for v in ("RANK", "LOCAL_RANK", "SLURM_PROCID"))


def hold_folder(folder: Path, key: str) -> None:
    """This process's hold on its run (or sweep) folder: a second run into the same folder would overwrite the
    first one's config, log and metrics.json, so it is refused; the kernel drops the hold when the holder
    exits, however it exits, so a killed run's folder can be resumed into at once."""
    fd = try_hold(folder)
    if fd is None:
        raise UserError(
            f"{key}={folder} is in use by {holder(folder)}, a run still going; wait for it to end or choose "
            "another folder."
        )
    _HELD.append(fd)
