"""run(cfg): profile the hardware -> plan -> build model and data -> run the task -> write metrics.json.

Every run directory ends up with config.yaml (the composed, resolved config), plan.yaml and
metrics.json, also when the run fails: then metrics.json says `status: failed` and why.

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

from onn.errors import UserError

log = logging.getLogger("onn")


def run(cfg: DictConfig) -> float | None:
    """Run the task; return metrics[sweep_objective] for a sweeper when that key is set (None if the run failed)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    started = time.perf_counter()
    metrics: dict[str, Any] = {"status": "running", "error": None, "task": cfg.task.name, "model": cfg.model.name, "data": cfg.data.name,
                               "strategy": cfg.strategy.name, "hardware": cfg.hardware.name}  # fmt: skip
    try:
        config = OmegaConf.to_container(cfg, resolve=True)
        metrics["config_digest"] = config_digest(config)
        done = finished(run_dir, metrics["config_digest"]) if multirun else None
        if done is not None:
            log.info("%s: already finished for this config; not run again", run_dir)
            return _objective(cfg, done)
        metrics.update(execute(config, run_dir))
        metrics["status"] = "ok"
    except UserError as e:
        metrics.update(status="failed", error=str(e))
        log.error("%s", e)
        if not multirun:  # in a sweep the other jobs go on; the grid shows this one as failed
            _write_metrics(run_dir, metrics, started)
            sys.exit(1)
    except Exception as e:
        metrics.update(status="failed", error=f"{type(e).__name__}: {e}")
        _write_metrics(run_dir, metrics, started)
        if not multirun:
            raise
        log.exception("job %s crashed; the sweep goes on", run_dir)  # the traceback, for the bug report
        return _objective(cfg, metrics)
    _write_metrics(run_dir, metrics, started)
    return _objective(cfg, metrics)


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
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None  # Optuna records None as a failed trial and goes on; NaN would stop the search
    return float(value)


def _write_metrics(run_dir: Path, metrics: dict[str, Any], started: float) -> None:
    metrics["wall_s"] = round(time.perf_counter() - started, 2)
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").write_text(json.dumps(clean, indent=2) + "\n")


def execute(config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The run itself, on a plain resolved config dict."""
    from onn.hardware.plan import IMAGE_SOURCES, make_plan, model_spec, render
    from onn.hardware.profile import resolve as resolve_hardware

    task = config["task"]["name"]
    if task == "export" and (config.get("export") or {}).get("name") in (None, "none"):
        raise UserError("task=export needs a format: export=safetensors, export=onnx or export=omny.")
    if (config.get("export") or {}).get("name") not in (None, "none"):
        from onn.export import check_settings as check_export

        check_export(config["export"])  # before hours of training end in a bad key
    if task == "bench":
        from onn.bench.suite import check_settings

        check_settings(config["task"])
    ckpt = None
    if config.get("ckpt"):
        from onn.training.checkpoint_io import read_meta, resolve

        ckpt = resolve(config["ckpt"], config["paths"]["outputs"])
        saved = read_meta(ckpt).get("onn", {}).get("config", {})
        for group in ("model", "strategy", "data"):
            if group in saved:
                config[group] = saved[group]  # the checkpoint was trained with these; rebuild exactly that
        log.info(
            "checkpoint %s: model=%s strategy=%s data=%s",
            ckpt,
            config["model"]["name"],
            config["strategy"]["name"],
            config["data"]["name"],
        )
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    image_model = str(config["model"].get("source") or "").startswith(IMAGE_SOURCES)
    image_data = (config.get("data") or {}).get("modality") == "image"
    if image_model != image_data and task != "bench_shard_plan":
        raise UserError(
            f"model={config['model']['name']} is {'an image classifier' if image_model else 'a language model'} but "
            f"data={config['data']['name']} is {'image' if image_data else 'text'} data: pick a matching pair "
            "(e.g. model=v28_cnn data=cifar10, or model=phi4_tiny data=math)."
        )
    if task in ("train", "eval", "infer", "tune"):
        # These tasks import them anyway; importing before planning lets the plan's CPU baseline
        # (the process's resident memory, measured) include them, as the measured peak will.
        import lightning  # noqa: F401
        import peft  # noqa: F401
        import transformers  # noqa: F401

    hardware = resolve_hardware(
        config["hardware"], Path(config["paths"]["cache"]), Path(config["paths"]["outputs"])
    )
    lora_rank = int((config["strategy"].get("lora") or {}).get("r", 8))
    spec = model_spec(config["model"], lora_rank, cache_dir=config["paths"]["cache"], data_cfg=config["data"])
    # task=tune starts from the planner's own guess; every other task takes a cached tune result
    plan = make_plan(config, hardware, spec, use_tuned=task != "tune")
    (run_dir / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    print(render(plan), flush=True)
    # On CPUs the measured peak is the process's resident memory, which includes its baseline.
    predicted = plan["predicted_peak_memory_mb"] + (
        plan["context_mb"] if hardware["accelerator"] != "cuda" else 0
    )
    out = {
        "strategy": plan["strategy"],
        "hardware": hardware.get("name"),
        "predicted_peak_memory_mb": round(predicted, 1),
        "params_total": spec.params,
        "settings_source": plan["settings_source"],  # plan, or tune (a cached task=tune result)
    }
    if task == "plan":
        return out
    from onn.training.vision import is_image_run

    if is_image_run(config) and task in ("bench", "tune", "bench_streaming"):
        raise UserError(
            f"task={task} measures language models; for image classifiers use recipe=bench_vision."
        )
    if is_image_run(config) and task in ("train", "eval", "infer", "export"):
        from onn.training import vision

        return {**out, **getattr(vision, {"eval": "evaluate"}.get(task, task))(config, plan, run_dir, ckpt)}
    if task == "bench_vision":
        from onn.bench.vision import run as bench_vision

        return {**out, **bench_vision(config, plan, run_dir)}
    if task == "train":
        from onn.training.fit import train

        return {**out, **train(config, plan, run_dir, ckpt)}
    if task == "eval":
        from onn.training.fit import evaluate

        return {**out, **evaluate(config, plan, run_dir, ckpt)}
    if task == "infer":
        from onn.training.fit import infer

        return {**out, **infer(config, plan, run_dir, ckpt)}
    if task == "export":
        from onn.training.fit import export

        return {**out, **export(config, plan, run_dir, ckpt)}
    if task == "bench_shard_plan":
        from onn.export.shards import bench as bench_shard_plan

        return {**out, **bench_shard_plan(config)}
    if task == "bench":
        from onn.bench.suite import run as bench

        return {**out, **bench(config, plan, run_dir, hardware, spec)}
    if task == "tune":
        from onn.hardware.tune import run as tune

        return {**out, **tune(config, plan, run_dir, hardware, spec)}
    if task == "bench_streaming":
        from onn.bench.streaming import run as bench_streaming

        return {**out, **bench_streaming(config, plan, run_dir)}
    raise UserError(
        f"task={task} is not one of train, eval, infer, export, plan, bench, bench_streaming, bench_shard_plan, bench_vision, tune."
    )
