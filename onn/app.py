"""run(cfg): config -> modality -> hardware profile -> plan -> TASKS[task](job) -> metrics.json.

Every run directory ends up with config.yaml (the composed, resolved config), plan.yaml and
metrics.json, also when the run fails: then metrics.json says `status: failed` and why.

The task comes from the task registry (onn/tasks, onn/bench), the modality from the modality
registry (onn/modalities): by the data config's `modality`, or for `data=auto` by what the files
hold. Adding either adds an entry, not a branch here.

metrics.json says `status: running` from the start, with a heartbeat, and a signal (SIGTERM, SIGINT)
ends the run as `failed` with the signal and the last step (onn/tasks/record.py).

In a multirun, a job whose folder already holds a successful metrics.json for the same config is
not run again, so an interrupted sweep picks up where it stopped; failed and crashed jobs (a `running`
record whose process is gone) run again, a training job from the newest checkpoint its folder holds
(resume_job), as a requeued SLURM job does.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError, MissingMandatoryValue

from onn.bench.registry import TASKS as BENCH_TASKS
from onn.config import ONNConfig, StrategyConfig, as_dict, typed
from onn.config.export import OnnxExport, SafetensorsExport
from onn.config.model import LanguageModelConfig
from onn.config.registry import CONF, recipe_group_problem
from onn.config.task import InferTask
from onn.errors import FailedAfterTraining, UserError, diverged
from onn.export.settings import check_graph_output
from onn.export.settings import check_settings as check_export
from onn.hardware import failpoints
from onn.hardware.cluster import is_rank_zero, use_own_gpu
from onn.hardware.disk import write_text_atomically
from onn.hardware.memory import cap_gpu_memory, is_out_of_memory, release_gpu, release_mmap_threshold
from onn.hardware.profile import Profile, use_threads
from onn.hardware.profile import resolve as resolve_hardware
from onn.modalities.base import Job, Modality
from onn.modalities.registry import REGISTRY, detect, get
from onn.planning.plan import render
from onn.streaming.quantized import release_tiles
from onn.tasks.record import Interrupted, RunRecord, writable_file, writable_folder
from onn.tasks.registry import TASKS as RUN_TASKS
from onn.tasks.registry import Task
from onn.training import progress
from onn.training.callbacks import check_every_n_steps
from onn.training.checkpoints import resolve as resolve_checkpoint
from onn.training.checkpoints import saved_config
from onn.training.distributed import end_distributed
from onn.training.optim import check as check_optim
from onn.training.trainer import check as check_trainer
from onn.training.trainer import check_launch, explain_distributed_failure, newest_checkpoint

log = logging.getLogger("onn")
TASKS: dict[str, Task] = {**RUN_TASKS, **BENCH_TASKS}
# the top-level blocks only these tasks give (conf/task/<task>.yaml); null in every other task's config
TASK_BLOCKS = {"serve": ("serve", "bench_serve"), "tune": ("tune",)}
# task.* counts that cut a list (examples[:n]): a negative one would drop the last items without a word
TASK_COUNTS = ("exact_match_samples", "max_samples")
SEEDS = 2**32  # numpy's seeds, and Lightning's seed_everything's: 0 to 2**32 - 1
RUN_DIR = "the run (hydra.run.dir)"  # where to write a run's file the disk refused instead
# paths a run reads, given from the folder `python run.py` started in, and the folders every run keeps its runs and
# caches in: see from_start_folder (a model's weights and tokenizer: onn.models.load.local_path)
READ_PATHS = ("ckpt", "prompt", "data.source", "data.val_source", "data.test_source", "task.input", "task.gallery",
              "task.vision_source", "task.classifier", "task.image", "task.page", "model.weights")  # fmt: skip
BUILDERS = ("model.source", "model.loss")  # file.py:function (a classifier's network, its loss)
KEPT_FOLDERS = ("paths.outputs", "paths.cache", "hardware.cache")
# in a sweep whose jobs run in this process: each output file a job writes (its sweep folder and the file) -> the
# number and config digest of the first job that writes it (sweep_outputs)
OUTPUTS_CLAIMED: dict[tuple[Path, Path], tuple[int, str]] = {}


def run(cfg: DictConfig) -> float | None:
    """Run the task; return metrics[sweep_objective] for a sweeper when that key is set (None if the run failed).

    metrics.json says `running` from the start (onn/tasks/record.py), and `ok` or `failed` at the end: also
    when a signal stops the run, which then exits with 128 + the signal's number."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    quiet_console()
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    # as written: an override's ${...} is resolved with the config, where a misspelt one is one sentence (to_config)
    overrides = [str(o) for o in OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)]
    choices = {str(k): str(v) for k, v in hydra_cfg.runtime.choices.items() if v is not None}
    metrics: dict[str, Any] = {
        "status": "running",
        "error": None,
        "task": _read(cfg, "task.name"),
        **_groups(cfg),
        "hardware": _read(cfg, "hardware.name"),
    }
    record = RunRecord(run_dir, metrics)
    progress.reset()  # a multirun's jobs share this process: no job's record shows the previous job's last step
    config: ONNConfig | None = None
    done: dict[str, Any] | None = None  # a sweep job's finished record of this config: it is not run again
    start = Path(hydra_cfg.runtime.cwd)
    try:
        from_start_folder(cfg, start)
        if (chosen := compose_chosen(cfg, overrides, choices)) is not None:
            cfg = chosen
            from_start_folder(cfg, start)  # composed again from the command line's relative data.source
            metrics.update(_groups(cfg))  # what runs, also in the record of a run that fails before it ends
        name_after_checkpoint(cfg, given_keys(overrides))
        config = to_config(cfg, choices)
        metrics["config_digest"] = config_digest(config)
        if multirun:
            sweep_outputs(config, run_dir, start / hydra_cfg.sweep.dir, hydra_cfg.job.num, metrics["config_digest"])
        done = finished(run_dir, metrics["config_digest"]) if multirun else None
        if done is not None:
            log.info("%s: already finished for this config; not run again", run_dir)
        else:
            run_job(config, run_dir, given_keys(overrides), record, multirun)
    except FolderTaken as e:  # the folder's record is an earlier run's result: it stays as it is
        log.error("%s", e)
        sys.exit(1)  # stops the sweep: the jobs after it, of the same changed config, would be refused the same way
    except UserError as e:
        log.error("%s", e)
        if isinstance(e, FailedAfterTraining):  # the training's figures stay beside the error
            record.update(e.metrics)
        _finish_failed(record, str(e))
        if not multirun:  # in a sweep the other jobs go on; the grid shows this one as failed
            sys.exit(1)
    except Interrupted as e:
        log.error("stopped by %s; %s says so", e, record.path)
        record.interrupted(e.signum)
        sys.exit(e.exit_code)  # a signal stops a sweep too: the jobs not run yet run when it is resumed
    except Exception as e:
        sentence = explain_distributed_failure(e, config) or explain_out_of_memory(e, config)
        if sentence is not None:  # a peer that never came, or memory that ran out where no back-off applies
            log.error("%s", sentence)
            _finish_failed(record, sentence)
            if not multirun:
                sys.exit(1)
            return None
        _finish_failed(record, f"{type(e).__name__}: {e}")
        if not multirun:
            raise
        log.exception("job %s crashed; the sweep goes on", run_dir)  # the traceback, for the bug report
    except BaseException as e:  # SystemExit or KeyboardInterrupt from inside a library: still leave a record
        _finish_failed(record, f"stopped: {type(e).__name__} {e}".strip())
        raise
    finally:
        end_distributed()  # the run's last collective is behind it: NCCL would warn about a live group at exit
    if done is not None:  # after the try: a misspelt sweep_objective's exit leaves the finished record as it is
        return _objective(config.sweep_objective, done)
    return _objective(cfg.sweep_objective, metrics)


def run_job(config: ONNConfig, run_dir: Path, given: set[str], record: RunRecord, multirun: bool) -> None:
    """The job itself, once no finished record of its config stands in for it: resumed in a sweep from the
    checkpoints its folder holds (resume_job), run, and recorded ok (a diverged run raises its failure)."""
    if multirun:
        resume_job(config, run_dir, record.metrics)
    check_launch(config, multirun)
    failpoints.check()
    record.start()
    results = execute(config, run_dir, given, record)
    if (failure := diverged(results)) is not None:
        raise failure
    record.finish(**results, status="ok")
    if is_rank_zero():
        print(summary(record.metrics, run_dir), flush=True)


def explain_out_of_memory(error: BaseException, config: ONNConfig | None) -> str | None:
    """One sentence for running out of memory where the step's back-off does not apply (validation,
    generation, a store build, the optimizer's first step); None for any other error."""
    if not is_out_of_memory(error) or config is None:
        return None
    where = "the GPU" if isinstance(error, torch_out_of_memory()) else "memory"
    # a language model splits its batch into micro-batches; other networks train each batch in one pass
    micro = "set strategy.micro_batch lower, " if isinstance(config.model, LanguageModelConfig) else ""
    return (
        f"out of {where} outside a training step's back-off ({str(error).strip().splitlines()[0][:160]}): lower "
        f"data.batch_size or data.max_length, {micro}or give hardware.budget_mb room; "
        f"`python run.py task=plan` with the same settings shows what each needs."
    )


def torch_out_of_memory() -> type:
    import torch

    return torch.OutOfMemoryError


def _groups(cfg: DictConfig) -> dict[str, Any]:
    """The model, data and strategy configs a run composed, as its record names them."""
    return {group: _read(cfg, f"{group}.name") for group in ("model", "data", "strategy")}


def _read(cfg: DictConfig, key: str) -> Any:
    """cfg's value at `key` for the run's first record; None where it cannot be resolved (a misspelt ${...} there
    is the run's error, said by to_config, not a traceback before its record exists)."""
    return OmegaConf.select(cfg, key, throw_on_resolution_failure=False)


def _finish_failed(record: RunRecord, error: str) -> None:
    """The failed record, with the last step reached (a run whose checkpoint write failed got that far); a run
    folder that cannot be written (an existing file) is said once, not twice."""
    step = progress.last_step()
    if step is not None:  # as the heartbeat and a signal's record read it
        record.update({"steps": step})
    try:
        record.finish(status="failed", error=error)
    except UserError as e:
        log.error("%s", e)


def quiet_console() -> None:
    """A run prints its plan, a progress bar and its result: not the notices of libraries that a user
    of ONN cannot act on (deprecations inside Lightning, bitsandbytes' optional CPU kernels that it
    would fetch from the Hub, Lightning's hardware inventory and tips). They stay in the job's log file."""
    import warnings

    os.environ.setdefault(
        "HF_HUB_DISABLE_PROGRESS_BARS", "1"
    )  # transformers' per-file bars when it loads or writes weights
    # PyTorch's CUDA allocator grows segments instead of caching blocks of every size it met: a streamed
    # run's chunks, activations and casts come and go in many sizes, and the process stays near what it
    # allocates (read when the first CUDA allocation is made, so it must be set before any)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*(LeafSpec|litlogger|does not have many workers).*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.onnx\..*")  # the exporter's notes on axes
    # FSDP with one process shards nothing, by ONN's choice (onn/training/distributed.py): torch says so at every
    # state_dict; DeepSpeed leaves a one-process group unbound to a device on purpose, and torch says so at its barriers
    warnings.filterwarnings(
        "ignore",
        message=r".*(NO_SHARD|full_state_dict will be returned|using the device under current context).*",
    )
    # bitsandbytes' note that a layer whose width is no multiple of its 4-bit kernel's block runs a slower kernel
    warnings.filterwarnings("ignore", message=r".*is not aligned for fast kernel.*")
    # on a GPU: PyG's note that an optional package (torch-scatter, no wheel for this torch) would speed up a graph's
    # max pooling; cuDNN's that a streamed recurrent block's weights (installed a chunk at a time, beside trainable
    # biases) are not one buffer, so it packs them at each call
    warnings.filterwarnings(
        "ignore", message=r".*(can be accelerated via the 'torch-scatter'|not part of single contiguous).*"
    )
    for name, level in (
        ("bitsandbytes.backends.cpu.ops", logging.ERROR),
        ("lightning.pytorch.utilities.rank_zero", logging.WARNING),
        ("lightning.fabric.utilities.rank_zero", logging.WARNING),
    ):
        logging.getLogger(name).setLevel(level)
    # DeepSpeed sets its logger's level again when it is imported, after this: on a machine without a GPU its
    # import (transformers' save_pretrained makes it) warned that it found none. A filter outlasts the level.
    logging.getLogger("DeepSpeed").addFilter(_errors_only)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def summary(metrics: dict[str, Any], run_dir: Path) -> str:
    """The run's result in one line: its headline figures and where the rest is."""
    keys = ("train/loss_initial", "train/loss_final", "val/loss_final", "val/acc_best", "test/acc",
            "val/loss", "val/acc", "val/exact_match", "samples_per_s", "peak_memory_mb")  # fmt: skip
    shown = [f"{k} {metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), int | float)]
    if metrics.get("infer/empty_completions"):  # the run worked, but did not answer: not "ok"
        return (
            f"{metrics['task']} finished with {metrics['infer/empty_completions']} EMPTY completion(s): "
            f"the model ended the text at once (its prompt format? see the warning above); metrics.json in {run_dir}"
        )
    return f"{metrics['task']} ok: {', '.join(shown) or 'done'}; metrics.json in {run_dir}"


def from_start_folder(cfg: DictConfig, start: Path) -> None:
    """hydra.job.chdir=true runs each job in its own folder, where a relative data.source (ckpt, task.input, ...)
    given from the folder `python run.py` started in (`start`) is not: such paths become absolute there, as Hydra's
    to_absolute_path makes them. A path read is changed only where it exists (builtin:NAME and ckpt=last stay as
    given), a model.source or model.loss only where it names a file.py:function; ONN's own folders (paths.outputs,
    the caches) always, so that every job shares them. A relative task.output or export.output stays the job
    folder's, which is what chdir asks for."""
    if Path.cwd() == start:
        return
    for key in (*READ_PATHS, *BUILDERS, *KEPT_FOLDERS):
        value = _read(cfg, key)
        if not isinstance(value, str) or (key in BUILDERS and ".py:" not in value):
            continue
        if (absolute := _from(start, value, must_exist=key not in KEPT_FOLDERS)) != value:
            OmegaConf.update(cfg, key, absolute, merge=False)


def sweep_outputs(config: ONNConfig, run_dir: Path, sweep_dir: Path, num: int, digest: str) -> None:
    """A sweep job's task.output and export.output: a relative one is written in the job's own folder (`run_dir`), as
    under hydra.job.chdir=true, not from the working directory, where every job would write the same file. One that
    an earlier job of another config in this sweep writes (an absolute path given to every job) is refused: this job
    would overwrite that job's file. Jobs a launcher runs in other processes are not seen."""
    for key, block in (("task.output", config.task), ("export.output", config.export)):
        if not isinstance(block, (InferTask, SafetensorsExport, OnnxExport)) or not block.output:
            continue
        if not os.path.isabs(os.path.expanduser(block.output)):
            block.output = str(run_dir / block.output)
        path = Path(block.output).expanduser().resolve()
        earlier, theirs = OUTPUTS_CLAIMED.setdefault((sweep_dir.resolve(), path), (num, digest))
        if earlier != num and theirs != digest:
            raise UserError(
                f"{key}={block.output} is also written by job {earlier} of this sweep, whose file job {num} would "
                f"overwrite: give {key} a relative path (each job writes it in its own folder) or put "
                "${hydra:job.num} in it."
            )


def _from(start: Path, value: str, must_exist: bool) -> str:
    """`value` taken from `start` when it is a relative path (`file.py:function`: its file), else as given."""
    path, colon, function = value.rpartition(":") if value.rpartition(":")[0].endswith(".py") else (value, "", "")
    path = os.path.expanduser(path)
    if not path or os.path.isabs(path) or (must_exist and not (start / path).exists()):
        return value
    return f"{start / path}{colon}{function}"


def given_keys(overrides: list[str]) -> set[str]:
    """The keys the command line set: a group it chose (`data`) or a key it changed (`data.source`, `+model.z`)."""
    return {o.lstrip("+~").split("=", 1)[0] for o in overrides}


def given_groups(overrides: list[str]) -> set[str]:
    """The config groups the command line chose or changed (`data=x`, `data.source=y`, `+model.z=1`)."""
    return {key.split(".", 1)[0] for key in given_keys(overrides)}


def name_after_checkpoint(cfg: DictConfig, given: set[str]) -> None:
    """ckpt=: the model and strategy are the checkpoint's (from_checkpoint), and so is the data unless the command line
    names a data config. Their names in the composed config become the checkpoint's before it is resolved, so that
    what interpolates them (the Aim experiment `${model.name}-${data.name}`, a recipe's key) names what runs, not
    conf/config.yaml's default model."""
    ckpt, outputs = _read(cfg, "ckpt"), _read(cfg, "paths.outputs")
    if not ckpt or outputs is None:
        return
    for group, name in checkpoint_names(str(ckpt), str(outputs)).items():
        if group != "data" or "data" not in given:
            cfg[group].name = name


def checkpoint_names(ckpt: str, outputs: str) -> dict[str, str]:
    """{group: name} of the model, strategy and data configs the run config in checkpoint `ckpt` names; {} for one
    that cannot be read, which from_checkpoint says in one sentence when the run reads it."""
    try:
        saved = saved_config(resolve_checkpoint(ckpt, os.path.expanduser(outputs)))
    except UserError:
        return {}
    blocks = {group: saved.get(group) for group in ("model", "strategy", "data")}  # {} for another tool's checkpoint
    return {g: b["name"] for g, b in blocks.items() if isinstance(b, dict) and isinstance(b.get("name"), str)}


def checkpoint_name(group: str, *, _root_: DictConfig) -> str:
    """`${onn.ckpt:model}`: the name of the model (or strategy) a run runs, for hydra.run.dir to name its folder by:
    with ckpt= the checkpoint's; a data config with no model named, its modality's default (compose_chosen runs
    it: the folder was named after conf/config.yaml's phi4_tiny); else the composed config's."""
    from hydra.core.hydra_config import HydraConfig

    ckpt, outputs = _read(_root_, "ckpt"), _read(_root_, "paths.outputs")
    if not ckpt and group == "model" and HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        picked = default_model(_root_, list(hydra_cfg.overrides.task), dict(hydra_cfg.runtime.choices))
        if picked is not None:
            return picked
    names = checkpoint_names(str(ckpt), str(outputs)) if ckpt and outputs is not None else {}
    return str(names.get(group, _read(_root_, f"{group}.name")))


def compose_detected(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """`data=auto`: find the modality from what data.source holds, then compose the config again with
    its data config (and its default model when the command line names none), and say why."""
    given = given_groups(overrides)
    if OmegaConf.is_missing(cfg.data, "source"):  # as data=text's says it (to_config)
        raise UserError("data.source has no value: give it on the command line (data.source=...).")
    # a model named on the command line picks between modalities that read the same files (meshes: mesh or graph)
    modality, reason = detect(cfg.data.source, OmegaConf.get_type(cfg.model) if "model" in given else None)
    kept = [
        o
        for o in overrides
        if not o.startswith(("data=", "+data=")) and o.lstrip("+~").split("=", 1)[0] != "data.modality"
    ]
    # data=auto has only `source`: other data keys come as +data.KEY=VALUE, and are plain keys of the data config found
    kept = [o[1:] if o.startswith("+data.") else o for o in kept]
    chosen = [f"data={modality.default_data}"]
    if "model" not in given:
        chosen.append(f"model={modality.default_model}")
    print(
        f"data=auto: {cfg.data.source} holds {reason}: {modality.description}, so {' '.join(chosen)}",
        flush=True,
    )
    return recompose(chosen, kept, "data=auto")


def compose_chosen(cfg: DictConfig, overrides: list[str], choices: dict[str, str]) -> DictConfig | None:
    """The config composed again where ONN picks what the command line left open: data=auto's data config (and
    model), or the default model of an explicit data config's modality; None where nothing is picked. `choices`
    learns the model picked (a recipe's clash in to_config names the option that runs)."""
    if _read(cfg, "data.name") == "auto":
        return compose_detected(cfg, overrides)
    model = default_model(cfg, overrides, choices)
    if model is None:
        return None
    print(f"data={choices['data']} names no model, so model={model}", flush=True)
    choices["model"] = model
    return recompose([f"model={model}"], overrides, f"data={choices['data']}")


def default_model(cfg: DictConfig, overrides: list[str], choices: dict[str, str]) -> str | None:
    """The data config's modality's default_model, for a run where neither the command line nor a recipe names a
    model (`data=mesh` alone composed conf/config.yaml's phi4_tiny, a language model, and was refused). None where
    the model stays: one is named, ckpt= brings the checkpoint's, or the modality's default is the root's own."""
    root = next(d["model"] for d in _root_defaults() if isinstance(d, dict) and "model" in d)
    if "model" in given_groups(overrides) or choices.get("model") != root or _read(cfg, "ckpt"):
        return None
    modality = REGISTRY.get(str(_read(cfg, "data.modality")))
    if modality is None or modality.default_model in ("", root):  # an unknown modality: get() says so later
        return None
    return modality.default_model


def _root_defaults() -> list[Any]:
    """conf/config.yaml's defaults list: the options a run composes where nothing else names one."""
    return yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]


def recompose(chosen: list[str], kept: list[str], chooser: str) -> DictConfig:
    """The config composed again with the options `chooser` chose (`chosen`) and the command line's other
    overrides (`kept`); one sentence where they do not fit together."""
    from hydra import compose

    try:
        return compose(config_name="config", overrides=[*chosen, *kept])
    except ConfigCompositionException as e:
        raise UserError(detected_compose_problem(e, chosen, chooser)) from None


def detected_compose_problem(error: ConfigCompositionException, chosen: list[str], chooser: str = "data=auto") -> str:
    """One sentence for a command line that does not compose with the config `chooser` chose: Hydra's own message
    for a misspelt `+data.KEY` told the user to write `+data.KEY`, which they had."""
    cause = error.__cause__
    kind = getattr(cause, "object_type", None)
    key, full_key = getattr(cause, "key", None), getattr(cause, "full_key", None)
    if isinstance(cause, ConfigAttributeError | ConfigKeyError) and dataclasses.is_dataclass(kind) and key:
        close = difflib.get_close_matches(str(key), [f.name for f in dataclasses.fields(kind)], n=1)
        hint = f" (did you mean {full_key.rsplit('.', 1)[0]}.{close[0]}?)" if close and "." in full_key else ""
        return (
            f"+{full_key}: {chosen[0]}, which {chooser} chose, has no key {key}{hint}; fix its name "
            "(docs/config.md lists the groups' keys)."
        )
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    group = chosen[0].split("=", 1)[0]  # data (data=auto's choice) or model (a data config's default model)
    return (
        f"{chooser} chose {' '.join(chosen)}, and the command line does not fit it ({first.rstrip('.')}); fix that "
        f"override, or name the {group} config with {group}=NAME."
    )


def to_config(cfg: DictConfig, choices: dict[str, str] | None = None) -> ONNConfig:
    """The composed config as ONN's dataclasses (onn/config), every interpolation resolved. A key the
    command line must give (`???`, such as data.source of data=text) is one sentence naming it, and so is a key
    no dataclass has (Hydra's `+trainer.max_step=3`, which OmegaConf would drop without a word), and a `${...}`
    that names no key. `choices`: the option of each group (Hydra's runtime.choices), which names the recipe and
    option that clash where a recipe's block is one the option leaves null."""
    unknown = unknown_keys(cfg)
    if unknown:
        key, fields = unknown[0]
        close = difflib.get_close_matches(key.rsplit(".", 1)[-1], fields, n=1)
        hint = f"did you mean {key.rsplit('.', 1)[0] + '.' if '.' in key else ''}{close[0]}?" if close else ""
        raise UserError(
            f"{key} is not a key of ONN's config{' (' + hint + ')' if hint else ''}; "
            "fix its name (docs/config.md lists the groups' keys)."
        )
    try:
        config = OmegaConf.to_object(cfg)
    except InterpolationResolutionError as e:
        unset = re.search(r"Environment variable '([^']+)' not found", str(e))
        advice = (
            f"set {unset[1]} in the environment, or give a default (${{oc.env:{unset[1]},DEFAULT}})"
            if unset
            else "fix the ${...} to name a key of the config (docs/config.md lists them)"
        )
        raise UserError(f"{e.full_key}={_written(cfg, e.full_key)}: {str(e).splitlines()[0]}; {advice}.") from None
    except MissingMandatoryValue as e:
        if problem := recipe_group_problem(e.full_key, choices or {}, CONF):
            raise UserError(problem) from None
        block, task = e.full_key.split(".", 1)[0], cfg.task.name
        owners = TASK_BLOCKS.get(block, ())
        if owners and task not in owners:  # a recipe of that task (recipe=bench_serve) run as another (task=plan)
            raise UserError(
                f"{e.full_key} has no value: {block}.* holds the settings of "
                f"{' and '.join(f'task={t}' for t in owners)}, and this run is task={task}; drop the block "
                f"(~{block} on the command line drops a recipe's), or run that task."
            ) from None
        raise UserError(f"{e.full_key} has no value: give it on the command line ({e.full_key}=...).") from None
    # the folders ONN writes into, as writable_folder checks them (a YAML's `~/runs`; the command line's is expanded)
    config.paths.outputs, config.paths.cache = (
        os.path.expanduser(p) for p in (config.paths.outputs, config.paths.cache)
    )
    if config.hardware.cache:
        config.hardware.cache = os.path.expanduser(config.hardware.cache)
    return config


def _written(cfg: DictConfig, key: str) -> str:
    """A key's value as the config writes it (`${trainer.max_step}`), unresolved."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, throw_on_resolution_failure=False) if parent else cfg
    try:
        return str(node._get_node(leaf)._value())
    except Exception:  # noqa: BLE001 -- a key under a list or a missing node: the error's own words say enough
        return "..."


def unknown_keys(node: DictConfig, prefix: str = "") -> list[tuple[str, list[str]]]:
    """(dotted key, its dataclass's field names) of every key a dataclass-typed node holds that its dataclass
    lacks, nodes read unresolved; free-form nodes (model.kwargs, a logger's arguments) are walked, not checked."""
    kind = OmegaConf.get_type(node)
    names = [f.name for f in dataclasses.fields(kind)] if dataclasses.is_dataclass(kind) else None
    found = []
    for key in node:
        if names is not None and key not in names:
            found.append((f"{prefix}{key}", names))
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            found += unknown_keys(child, f"{prefix}{key}.")
    return found


def config_digest(config: ONNConfig) -> str:
    """Identifies what a job computes: its resolved config, less the paths that only say where it runs."""
    relevant = {k: v for k, v in as_dict(config).items() if k != "paths"}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


def finished(run_dir: Path, digest: str) -> dict[str, Any] | None:
    """The run folder's metrics.json when it holds a successful run of this config."""
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        done = metrics["status"] == "ok" and metrics["config_digest"] == digest  # both in every ok record
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return metrics if done else None


class FolderTaken(UserError):
    """A sweep job's folder holds the finished (ok) run of another config: refused without a record of its own, as
    the folder's metrics.json is that earlier run's result (a failed one would replace it)."""


def resume_job(config: ONNConfig, run_dir: Path, metrics: dict[str, Any]) -> None:
    """A sweep's training job run again (the sweep resumed after a kill, or after it failed) whose folder holds the
    checkpoints its earlier run of this config left: it resumes from the newest (ckpt=THAT, said in its record), as a
    requeued SLURM job does (onn/tasks/record.resume_requeued), instead of training from step 0 over them. Checkpoints
    of a run of another config are refused: this job would replace them. A finished (ok) run's folder is refused by
    FolderTaken, which leaves its record as it is. Otherwise the refused job's failed record (`metrics`) keeps the
    config_digest of the config the checkpoints are of: with this job's, the same sweep run again resumed this config
    from the other config's checkpoints."""
    digest = metrics["config_digest"]
    task = TASKS.get(config.task.name)
    newest = newest_checkpoint(run_dir) if task is not None and task.trains else None
    if newest is None:
        return
    try:
        earlier = json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        earlier = None
    earlier = earlier if isinstance(earlier, dict) else {}
    if earlier.get("config_digest") == digest:
        config.ckpt = str(newest)
        log.info("resuming job from %s, the checkpoint its earlier run of this config left", newest)
        return
    if earlier.get("status") == "ok":
        raise FolderTaken(
            f"job folder {run_dir} holds the finished run ({newest.name}, metrics.json) of another config (a recipe "
            "or conf/ file changed since, or ONN gained a setting), which this job would replace: give another "
            "hydra.sweep.dir, or move that folder away."
        )
    metrics["config_digest"] = earlier.get("config_digest")  # what the checkpoints are of: that config resumes them
    raise UserError(
        f"job folder {run_dir} holds the checkpoints ({newest.name}) of a run of another config, which this job "
        "would replace: give another hydra.sweep.dir, or move that folder away."
    )


def _objective(key: str | None, metrics: dict[str, Any]) -> float | None:
    """metrics[key] (the config's sweep_objective) for a sweeper; None without a key or a finished run."""
    if not key:
        return None
    if metrics["status"] == "ok" and key not in metrics:  # a misspelt key would fail every trial, then the sweeper
        close = difflib.get_close_matches(key, [k for k, v in metrics.items() if isinstance(v, int | float)], n=3)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        log.error("sweep_objective=%s is not a key of this run's metrics.json%s; fix sweep_objective.", key, hint)
        sys.exit(1)  # stops the sweep: every other trial would end the same way
    value = metrics.get(key) if metrics["status"] == "ok" else None
    if not isinstance(value, int | float) or not math.isfinite(value):
        return None  # Optuna records None as a failed trial and goes on; NaN would stop the search
    return float(value)


def from_checkpoint(config: ONNConfig, given: set[str]) -> tuple[Path, dict[str, str]]:
    """`ckpt=...`: what comes from the checkpoint and what from the command line, as Lightning's and Hugging
    Face's users expect. The architecture (model, strategy) is the checkpoint's. The data is the command
    line's when it names any: `data=NAME` brings that data config (of the checkpoint's modality, or one
    sentence refusing it); `data.KEY=...` changes those keys of the checkpoint's data config, and a new
    data.source replaces the checkpoint's files (its val/test sources too). Returns the checkpoint and where
    each group came from."""
    ckpt = resolve_checkpoint(config.ckpt, config.paths.outputs)
    # resolved once: ckpt=last searched paths.outputs again wherever config.ckpt was read (task=serve's every upload)
    # and could find a newer run's checkpoint than the one loaded
    config.ckpt = str(ckpt)
    saved = saved_config(ckpt)
    if "model" not in saved:  # {} for a checkpoint another tool wrote
        raise UserError(f"ckpt {ckpt} holds no ONN run config (written by another tool?); it cannot be rebuilt.")
    modality = get(saved["modality"])  # every ONN checkpoint names its modality
    ignored = sorted(k for k in given if k.split(".", 1)[0] in ("model", "strategy"))
    if ignored:
        log.warning(
            "ckpt %s: the model and strategy are the checkpoint's; %s on the command line is not used",
            ckpt,
            ", ".join(ignored),
        )
    config.model = typed(modality.model_schema, saved["model"], f"ckpt {ckpt}: model")
    config.strategy = typed(StrategyConfig, saved["strategy"], f"ckpt {ckpt}: strategy")
    came = {"model": "checkpoint", "strategy": "checkpoint"}
    if config.strategy.lightning.startswith(("fsdp", "deepspeed")) and config.task.name != "train":
        # where the weights were sharded while training is not part of the model: evaluating, inferring and
        # exporting run them whole, on whatever this machine has (Lightning refuses these strategies on a CPU)
        config.strategy.lightning = "auto"
    came["data"] = _data_from_checkpoint(config, saved["data"], modality, ckpt, given)
    return ckpt, came


def score_all_given(config: ONNConfig, given: set[str]) -> None:
    """task=eval scores the whole of a data.source the command line gives, with or without ckpt (its
    data.val_source scores another file); a built-in generator keeps its own held-out split."""
    named = "data" in given or "data.source" in given
    source = str(config.data.source or "")
    if config.task.name != "eval" or not named or "data.val_source" in given:
        return
    if not source or source.startswith("builtin:"):
        return
    if hasattr(config.data, "val_source"):  # a data schema without held-out files has nothing to point
        config.data.val_source = config.data.source


def check_builtin_split(config: ONNConfig, given: set[str]) -> None:
    """data.val_split given for built-in text data: its generator draws its own held-out problems, and the fraction
    was ignored without a word (a held-out file, data.val_source, is read)."""
    source = str(getattr(config.data, "source", None) or "")
    if "data.val_split" in given and config.data.modality == "text" and source.startswith("builtin:"):
        raise UserError(
            f"data.val_split={config.data.val_split}: {source} data has its own held-out split, so it takes no "
            "fraction; set data.builtin.val_size (the problems held out) instead."
        )


def _data_from_checkpoint(
    config: ONNConfig, saved: dict[str, Any], modality: Modality, ckpt: Path, given: set[str]
) -> str:
    """Set config.data from the checkpoint's data and the command line's; say where it came from."""
    if "data" in given:
        if config.data.modality != modality.name:
            raise UserError(
                f"ckpt {ckpt} holds a model of {modality.name} data, "
                f"but data={config.data.name} is {config.data.modality} "
                f"data: give {modality.name} data, or leave data out to use the checkpoint's own."
            )
        return "command line"
    data_keys = sorted(k for k in given if k.startswith("data."))
    data = copy.deepcopy(saved)
    if "data.source" in given:
        for key in ("val_source", "test_source", "val_pattern", "test_pattern"):
            if key in data:
                data[key] = None  # the checkpoint's other files and names belong to its own data.source
    given_data = as_dict(config.data)
    for key in data_keys:
        _set(data, key.split(".")[1:], _get(given_data, key.split(".")[1:]))
    config.data = typed(modality.data_schema, data, f"ckpt {ckpt}: data")
    return f"checkpoint, with {', '.join(data_keys)} from the command line" if data_keys else "checkpoint"


def _get(tree: dict[str, Any], path: list[str]) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def _set(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def _hardware(config: ONNConfig, task: Task) -> Profile:
    """The machine's profile, measured or cached, for the current device; said when CUDA_VISIBLE_DEVICES hides
    every GPU, and refused for a task that measures a GPU when there is none (a CPU's plan would refuse it in
    other words: its budget)."""
    use_own_gpu()  # before the profile, the cap and the memory readings act on the current device
    # the disk is measured under paths.cache, where the layer stores are built and read (not paths.outputs)
    hardware = resolve_hardware(config.hardware, Path(config.paths.cache))
    if hardware.gpus_hidden:
        print(
            f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} hides every GPU: "
            "planning and running on the CPU.",
            flush=True,
        )
    if task.gpu and hardware.accelerator != "cuda":
        raise UserError(
            f"task={config.task.name} measures a CUDA GPU, and this machine has none (or CUDA_VISIBLE_DEVICES "
            "hides it)."
        )
    return hardware


def check_settings(config: ONNConfig, task: Task, modality: Modality) -> None:
    """What training would refuse, refused before anything is planned: a plan is the plan of the training these
    settings would run, so it refuses them too."""
    name = config.task.name
    check_graph_output(config.export, modality.several_graphs)  # before training, not after it
    if task.heavy or name == "plan":
        check_optim(config.optim)
        trains = task.trains or name == "plan"
        check_trainer(config.trainer, trains=trains, launches=name != "plan", planned=config.hardware.accelerator)
        if task.trains or name == "plan":  # StepCheckpoint's own check, which a plan would not reach
            check_every_n_steps(config.checkpoint.every_n_steps)
    modality.check(config)


def execute(
    config: ONNConfig, run_dir: Path, given: set[str] | None = None, record: RunRecord | None = None
) -> dict[str, Any]:
    """The run itself, on the typed, resolved config. `given`: the keys the command line set. `record`: the run's
    metrics.json (updated under its lock: its heartbeat writes it meanwhile), which learns what runs (the checkpoint's
    model, the data) before anything can fail."""
    name = config.task.name
    if name not in TASKS:
        raise UserError(f"task={name} is not one of {', '.join(sorted(TASKS))}.")
    task = TASKS[name]
    check_run_numbers(config)
    task.check(config)
    # a path under a file: one sentence now, not a traceback when first written
    writable_folder(config.paths.outputs, "paths.outputs")
    writable_folder(config.paths.cache, "paths.cache")
    if isinstance(config.task, InferTask) and config.task.output:  # before the model runs, not after every answer
        writable_file(config.task.output, "task.output")
    if config.export.name != "none":
        check_export(config.export)  # before hours of training end in a bad key
    ckpt, came = None, {}
    if config.ckpt:
        ckpt, came = from_checkpoint(config, given or set())
        log.info("checkpoint %s: %s", ckpt, "; ".join(f"{group} from the {where}" for group, where in came.items()))
    score_all_given(config, given or set())
    check_builtin_split(config, given or set())
    run_dir.mkdir(parents=True, exist_ok=True)
    out = _what_runs(config, ckpt, came)
    if record is not None:  # a run that fails from here on names the model and data it ran, not the defaults'
        record.update(out)
    writes = is_rank_zero()  # in a multi-process run, rank 0 alone writes the run's files
    if not task.model:
        if writes:
            write_text_atomically(run_dir / "config.yaml", yaml.safe_dump(as_dict(config), sort_keys=False), RUN_DIR)
        return {**out, **task.run(Job(config, run_dir, get("text")))}
    modality = get(config.data.modality)
    if task.modalities is not None and modality.name not in task.modalities:
        raise UserError(
            f"task={name} runs on {', '.join(sorted(task.modalities))} data, "
            f"and data={config.data.name} is {modality.name} "
            f"data{'; for image classifiers use recipe=bench_vision' if name in ('bench', 'tune') else ''}."
        )
    check_settings(config, task, modality)
    if writes:
        write_text_atomically(run_dir / "config.yaml", yaml.safe_dump(as_dict(config), sort_keys=False), RUN_DIR)
    if task.heavy:
        # These tasks import them anyway; importing before planning lets the plan's CPU baseline
        # (the process's resident memory, measured) include them, as the measured peak will.
        import lightning  # noqa: F401
        import peft  # noqa: F401
        import transformers  # noqa: F401

    hardware = _hardware(config, task)
    # task=tune starts from the planner's own guess; every other task takes a cached tune result
    plan, spec = modality.plan(config, hardware, use_tuned=name != "tune")
    if writes:
        write_text_atomically(run_dir / "plan.yaml", yaml.safe_dump(plan.as_dict(), sort_keys=False), RUN_DIR)
        print(render(plan), flush=True)
    threads_before = use_threads(plan.threads) if task.heavy else None  # on the cores other processes leave free
    if task.heavy and hardware.accelerator == "cuda" and config.hardware.budget_mb:
        cap_gpu_memory(plan.budget_mb - plan.context_mb)  # a smaller card, held to for real
    # On CPUs the measured peak is the process's resident memory, which includes its baseline.
    predicted = plan.predicted_peak_memory_mb + (plan.context_mb if hardware.accelerator != "cuda" else 0)
    out.update(
        {
            "modality": modality.name,
            "strategy": plan.strategy,
            "hardware": hardware.name,
            "predicted_peak_memory_mb": round(predicted, 1),
            "params_total": spec.params,
            "settings_source": plan.settings_source,  # plan, or tune (a cached task=tune result)
        }
    )
    if record is not None:  # a run that fails or is stopped from here on names what its plan chose
        record.update(out)
    return {**out, **_run(task, Job(config, run_dir, modality, hardware, plan, spec, ckpt), threads_before)}


def _what_runs(config: ONNConfig, ckpt: Path | None, came: dict[str, str]) -> dict[str, Any]:
    """The model and data the run runs, as its record names them (with ckpt, the checkpoint's model and strategy)."""
    out: dict[str, Any] = {
        "model": config.model.name,
        "data": config.data.name,
        "data_source": config.data.source,
        "checkpoint_used": str(ckpt) if ckpt else None,
        "from_checkpoint": came or None,
    }
    if ckpt:
        out["strategy"] = config.strategy.name  # the checkpoint's; the plan's once it is made
    return out


def check_run_numbers(config: ONNConfig) -> None:
    """The seed and task.* counts, before anything runs: numpy refused a negative seed with a traceback mid-run
    and one of 2**64 overflowed, and exact_match_samples=-1 scored every held-out problem but the last."""
    seed = config.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEEDS:
        raise UserError(f"seed={seed}: give a whole number from 0 to {SEEDS - 1}.")
    for key in TASK_COUNTS:
        value = getattr(config.task, key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"task.{key}={value}: give a whole number, 0 (none) or more.")
    stop = getattr(config.task, "early_stopping", None)
    if stop is not None and stop.patience < 0:
        raise UserError(
            f"task.early_stopping.patience={stop.patience}: give a whole number of validations, "
            "0 (never stop early) or more."
        )


def _run(task: Task, job: Job, threads_before: int | None) -> dict[str, Any]:
    """The task's run, then the process as the run found it, for the next run in it (a notebook, a test worker)."""
    try:
        return task.run(job)
    finally:
        release_mmap_threshold()  # a streamed run's malloc setting
        release_tiles()
        release_gpu()  # its cached memory and the allocator's cap
        use_threads(threads_before)
