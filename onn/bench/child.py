"""The benches that measure in a process of their own (suite, giant): the process, started from a warm
interpreter, and the run's config across the boundary, sent as plain JSON (`as_dict`) and typed again here."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

from onn.config import ONNConfig, typed
from onn.config.registry import SCHEMAS

# the groups whose type is the option's schema, not the root's field type (ModelConfig, TaskConfig, ...)
_OPTION_GROUPS = ("model", "data", "task", "export")


def config_from_dict(values: dict[str, Any], task_schema: type, where: str) -> ONNConfig:
    """`values` (as_dict of an ONNConfig) as the ONNConfig again: model and data as the data's modality types
    them, the task as `task_schema` (the child knows which task sent it), export by its name."""
    from onn.modalities import get

    modality = get(values["data"]["modality"])
    schemas = {
        "model": modality.model_schema,
        "data": modality.data_schema,
        "task": task_schema,
        "export": SCHEMAS["export"][values["export"]["name"]],
    }
    root = {k: ({"name": v["name"]} if k in _OPTION_GROUPS else v) for k, v in values.items()}
    config = typed(ONNConfig, root, where)
    for group, schema in schemas.items():
        setattr(config, group, typed(schema, values[group], f"{where}: {group}"))
    return config


# What every measuring process imports before its first line: 6-7 s of a core, paid once per bench run
WARM = ("torch", "lightning", "transformers", "peft")
# peft imports bitsandbytes, which starts CUDA as it is imported wherever a GPU is visible, and a child forked
# from a server that started CUDA cannot use the GPU: on a GPU machine each child imports it itself
STARTS_CUDA = ("peft",)

# In a child started with a link (`start`'s): its end of a multiprocessing Pipe to the process that started it
link = None


def warm_modules() -> list[str]:
    """What the server imports: WARM, less what would start CUDA there (NVML counts the GPUs without it)."""
    import torch

    gpu = torch.cuda.device_count() > 0
    return [name for name in WARM if not (gpu and name in STARTS_CUDA)]


def start(
    program: str,
    argv: list[str],
    log: Path,
    request: str = "",
    env: dict[str, str] | None = None,
    session: bool = False,
    link=None,
):
    """`python -m PROGRAM ARGV` (or `python PROGRAM ARGV` for a .py file) with REQUEST on stdin and its output
    appended to LOG, forked from a warm server (multiprocessing's forkserver, which imports WARM once) rather
    than a fresh interpreter importing them again: bench_giant starts eight such processes, bench_chaos a run.py
    per kill. `env`: its environment (this one's by default); `session`: a session and process group of its
    own, for a kill that reaches its DataLoader workers too; `link`: one end of a multiprocessing Pipe, which the
    child finds as `onn.bench.child.link` (the caller closes its copy once started). The server never computes, so
    a child starts its own threads and CUDA. Returns the started multiprocessing.Process (`exitcode` is negative
    for a signal)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(warm_modules())
    env = {**os.environ, "PYTHONWARNINGS": "ignore"} if env is None else env  # the server's may be older
    args = (program, argv, str(log), request, env, os.getcwd(), session, link)
    process = context.Process(target=_become, args=args, name=Path(program).name)
    process.start()
    return process


def _become(
    program: str, argv: list[str], log: str, request: str, env: dict, cwd: str, session: bool, pipe_end
) -> None:
    """The forked child's side of `start`: the session, environment, directory, stdin, stdout and argv of a
    fresh `python PROGRAM`, and the link to its parent where it has one."""
    import runpy
    import warnings

    global link
    link = pipe_end
    if session:
        os.setsid()
    opened = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(opened, 1)
    os.dup2(opened, 2)
    os.close(opened)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    warnings.simplefilter("ignore")
    sys.stdin = io.StringIO(request)
    sys.argv = [program, *argv]
    if program.endswith(".py"):
        sys.path[0] = os.path.dirname(os.path.abspath(program))
        runpy.run_path(program, run_name="__main__")
    else:
        runpy.run_module(program, run_name="__main__", alter_sys=True)
