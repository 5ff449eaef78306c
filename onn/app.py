"""run(cfg): config -> modality -> hardware profile -> plan -> TASKS[task](job) -> metrics.json.

Every run directory ends up with config.yaml (the composed, resolved config), plan.yaml and
metrics.json, also when the run fails: then metrics.json says `status: failed` and why.

The task comes from the task registry (onn/tasks, onn/bench), the modality from the modality
registry (onn/modalities): by the data config's `modality`, or for `data=auto` by what the files
hold. Adding either adds an entry, not a branch here.

In a multirun, a job whose folder already holds a successful metrics.json for the same config is
not run again, so an interrupted sweep picks up where it stopped; failed jobs run again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from onn.bench import TASKS as BENCH_TASKS
from onn.errors import UserError
from onn.hardware.profile import resolve as resolve_hardware
from onn.hardware.profile import use_threads
from onn.modalities import Job, detect, get
from onn.planning.plan import render
from onn.tasks import TASKS as RUN_TASKS
from onn.tasks import Task
from onn.training.checkpoints import read_meta
from onn.training.checkpoints import resolve as resolve_checkpoint
from onn.training.optim import check as check_optim

log = logging.getLogger("onn")
TASKS: dict[str, Task] = {**RUN_TASKS, **BENCH_TASKS}
GROUPS = ("model", "data", "strategy")


def run(cfg: DictConfig) -> float | None:
    """Run the task; return metrics[sweep_objective] for a sweeper when that key is set (None if the run failed)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    quiet_console()
    on_sigterm()
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    overrides = list(hydra_cfg.overrides.task)
    started = time.perf_counter()
    metrics: dict[str, Any] = {"status": "running", "error": None, "task": cfg.task.name, "model": cfg.model.name, "data": cfg.data.name,
                               "strategy": cfg.strategy.name, "hardware": cfg.hardware.name}  # fmt: skip
    try:
        if cfg.data.name == "auto":
            cfg = compose_detected(cfg, overrides)
        config = OmegaConf.to_container(cfg, resolve=True)
        metrics["config_digest"] = config_digest(config)
        done = finished(run_dir, metrics["config_digest"]) if multirun else None
        if done is not None:
            log.info("%s: already finished for this config; not run again", run_dir)
            return _objective(cfg, done)
        metrics.update(execute(config, run_dir, given_groups(overrides)))
        metrics["status"] = "ok"
        print(summary(metrics, run_dir), flush=True)
    except UserError as e:
        metrics.update(status="failed", error=str(e))
        log.error("%s", e)
        if not multirun:  # in a sweep the other jobs go on; the grid shows this one as failed
            _write_metrics(run_dir, metrics, started)
            sys.exit(1)
    except (Exception, KeyboardInterrupt, SystemExit) as e:  # SIGTERM arrives as SystemExit (see on_sigterm)
        metrics.update(status="failed", error=f"{type(e).__name__}: {e}")
        _write_metrics(run_dir, metrics, started)
        if not multirun or not isinstance(e, Exception):
            raise
        log.exception("job %s crashed; the sweep goes on", run_dir)  # the traceback, for the bug report
        return _objective(cfg, metrics)
    _write_metrics(run_dir, metrics, started)
    return _objective(cfg, metrics)


def quiet_console() -> None:
    """A run prints its plan, a progress bar and its result: not the notices of libraries that a user
    of ONN cannot act on (deprecations inside Lightning, bitsandbytes' optional CPU kernels that it
    would fetch from the Hub, Lightning's hardware inventory and tips). They stay in the job's log file."""
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*(LeafSpec|litlogger|does not have many workers).*")
    for name, level in (("bitsandbytes.backends.cpu.ops", logging.ERROR), ("lightning.pytorch.utilities.rank_zero", logging.WARNING),
                        ("lightning.fabric.utilities.rank_zero", logging.WARNING)):  # fmt: skip
        logging.getLogger(name).setLevel(level)


def on_sigterm() -> None:
    """SIGTERM ends the run as an exception would, so metrics.json still says how it ended."""
    import signal

    def stop(signum, frame):
        raise SystemExit(f"terminated by signal {signum}")

    signal.signal(signal.SIGTERM, stop)


def summary(metrics: dict[str, Any], run_dir: Path) -> str:
    """The run's result in one line: its headline figures and where the rest is."""
    keys = ("train/loss_initial", "train/loss_final", "val/loss_final", "val/acc_best", "test/acc", "val/loss", "val/acc",
            "val/exact_match", "samples_per_s", "peak_memory_mb")  # fmt: skip
    shown = [f"{k} {metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), int | float)]
    return f"{metrics['task']} ok: {', '.join(shown) or 'done'}; metrics.json in {run_dir}"


def given_groups(overrides: list[str]) -> set[str]:
    """The config groups the command line chose or changed (`data=x`, `data.source=y`, `+model.z=1`)."""
    return {o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] for o in overrides}


def compose_detected(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """`data=auto`: find the modality from what data.source holds, then compose the config again with
    its data config (and its default model when the command line names none), and say why."""
    from hydra import compose

    modality, reason = detect(cfg.data.source)
    given = given_groups(overrides)
    kept = [o for o in overrides if not o.startswith(("data=", "+data=")) and o.lstrip("+~").split("=", 1)[0] != "data.modality"]
    chosen = [f"data={modality.default_data}"]
    if "model" not in given:
        chosen.append(f"model={modality.default_model}")
    print(f"data=auto: {cfg.data.source} holds {reason}: {modality.description}, so {' '.join(chosen)}", flush=True)
    return compose(config_name="config", overrides=[*chosen, *kept])


def config_digest(config: dict[str, Any]) -> str:
    """Identifies what a job computes: its resolved config, less the paths that only say where it runs."""
    relevant = {k: v for k, v in config.items() if k != "paths"}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


def finished(run_dir: Path, digest: str) -> dict[str, Any] | None:
    """The run folder's metrics.json when it holds a successful run of this config."""
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return None
    if metrics.get("config_digest") == digest and metrics.get("status") == "ok":
        return metrics
    return None


def _objective(cfg: DictConfig, metrics: dict[str, Any]) -> float | None:
    key = cfg.get("sweep_objective")
    if not key:
        return None
    value = metrics.get(key) if metrics.get("status") == "ok" else None
    if not isinstance(value, int | float) or not math.isfinite(value):
        return None  # Optuna records None as a failed trial and goes on; NaN would stop the search
    return float(value)


def _write_metrics(run_dir: Path, metrics: dict[str, Any], started: float) -> None:
    metrics["wall_s"] = round(time.perf_counter() - started, 2)
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").write_text(json.dumps(clean, indent=2) + "\n")


def from_checkpoint(config: dict[str, Any], given: set[str]) -> tuple[Path, list[str]]:
    """`ckpt=...`: the architecture (model, strategy) comes from the checkpoint; the data from the command
    line when it names any, else from the checkpoint too. Returns the checkpoint and one line per group
    saying where it came from."""
    ckpt = resolve_checkpoint(config["ckpt"], config["paths"]["outputs"])
    saved = read_meta(ckpt).get("onn", {}).get("config", {})
    if "model" not in saved:
        raise UserError(f"ckpt {ckpt} holds no ONN run config (written by another tool?); it cannot be rebuilt.")
    saved_modality = saved.get("modality") or saved.get("data", {}).get("modality") or "text"
    said = []
    for group in GROUPS:
        if group == "data" and "data" in given:
            modality = config["data"].get("modality")
            if modality != saved_modality:
                raise UserError(
                    f"ckpt {ckpt} is a {saved_modality} model but data={config['data']['name']} is {modality} data: "
                    f"give {saved_modality} data, or leave data out to use the checkpoint's own."
                )
            said.append(f"data={config['data']['name']} (source {config['data'].get('source')}) from the command line")
            continue
        if group in given and group != "data":
            log.warning("ckpt %s: %s comes from the checkpoint; the command line's %s=%s is not used", ckpt, group, group,
                        config[group].get("name"))  # fmt: skip
        config[group] = saved[group]
        said.append(f"{group}={config[group]['name']} from the checkpoint")
    return ckpt, said


def execute(config: dict[str, Any], run_dir: Path, given: set[str] | None = None) -> dict[str, Any]:
    """The run itself, on a plain resolved config dict. `given`: the groups the command line set."""
    name = config["task"]["name"]
    if name not in TASKS:
        raise UserError(f"task={name} is not one of {', '.join(sorted(TASKS))}.")
    task = TASKS[name]
    task.check(config)
    if config["export"]["name"] != "none":
        from onn.export import check_settings as check_export

        check_export(config["export"])  # before hours of training end in a bad key
    ckpt = None
    if config.get("ckpt"):
        ckpt, said = from_checkpoint(config, given or set())
        log.info("checkpoint %s: %s", ckpt, "; ".join(said))
    run_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"model": config["model"]["name"], "data": config["data"]["name"],
                           "data_source": config["data"].get("source"), "checkpoint_used": str(ckpt) if ckpt else None}  # fmt: skip
    if not task.model:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        return {**out, **task.run(Job(config, run_dir, get("text")))}
    modality = get(config["data"].get("modality") or "text")
    if task.modalities is not None and modality.name not in task.modalities:
        raise UserError(
            f"task={name} runs on {', '.join(sorted(task.modalities))} data, and data={config['data']['name']} is "
            f"{modality.name} data{'; for image classifiers use recipe=bench_vision' if name in ('bench', 'tune') else ''}."
        )
    if task.heavy:
        check_optim(config["optim"])
    modality.check(config)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if task.heavy:
        # These tasks import them anyway; importing before planning lets the plan's CPU baseline
        # (the process's resident memory, measured) include them, as the measured peak will.
        import lightning  # noqa: F401
        import peft  # noqa: F401
        import transformers  # noqa: F401

    hardware = resolve_hardware(config["hardware"], Path(config["paths"]["cache"]), Path(config["paths"]["outputs"]))
    # task=tune starts from the planner's own guess; every other task takes a cached tune result
    plan, spec = modality.plan(config, hardware, use_tuned=name != "tune")
    (run_dir / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    print(render(plan), flush=True)
    if task.heavy:
        use_threads(plan)  # torch's threads on the cores other processes leave free
    # On CPUs the measured peak is the process's resident memory, which includes its baseline.
    predicted = plan["predicted_peak_memory_mb"] + (plan["context_mb"] if hardware["accelerator"] != "cuda" else 0)
    out.update({
        "modality": modality.name,
        "strategy": plan["strategy"],
        "hardware": hardware.get("name"),
        "predicted_peak_memory_mb": round(predicted, 1),
        "params_total": spec.params,
        "settings_source": plan["settings_source"],  # plan, or tune (a cached task=tune result)
    })  # fmt: skip
    return {**out, **task.run(Job(config, run_dir, modality, hardware, plan, spec, ckpt))}
