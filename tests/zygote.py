"""A warm interpreter that forks each `python run.py ...` of the tests (a zygote, as Android starts apps).

Each run of the CLI in a fresh interpreter spends about seven seconds importing torch, Lightning (which
imports torchmetrics, torchvision and transformers) and peft before ONN's first line runs; the suite
starts dozens. This process imports those once and forks a child per run. The child is what a fresh
`python run.py ARGS` is from there on: its own environment, working directory, argv and warning
filters, stdin closed, stdout and stderr in files, ONN's own modules imported anew (the zygote never
imports them), and an ordinary interpreter exit (atexit handlers, exit code, traceback). Nothing in the
zygote ever computes: OpenMP's thread pool does not survive a fork, so the children start it themselves.

Protocol, one JSON line each way: the request {argv, env, cwd, stdout, stderr}; the answer {pid}, then
{returncode} when the child has ended (negative for a signal, as subprocess reports it).
"""

from __future__ import annotations

import json
import os
import sys

HEAVY = ("torch", "lightning", "transformers", "peft", "torchvision", "torchmetrics", "hydra", "omegaconf")
# peft imports bitsandbytes, which starts CUDA as it is imported wherever a GPU is visible: a child forked from a
# process that started CUDA cannot use the GPU ("Cannot re-initialize CUDA in forked subprocess"), so on a GPU
# machine each child imports it itself
STARTS_CUDA = ("peft",)


def warm_imports() -> None:
    """Import HEAVY, leaving CUDA unstarted: on a machine with a GPU (NVML's count, which starts nothing) without
    the modules that start it."""
    import torch

    gpu = torch.cuda.device_count() > 0
    for name in HEAVY:
        if not (gpu and name in STARTS_CUDA):
            __import__(name)


def serve() -> dict:
    """Answer requests until stdin closes; return (in the child only) the request it is to run."""
    warm_imports()
    import torch

    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # a stray print goes to the zygote's log, never into the answers
    # a library that started CUDA anyway: its children could not use the GPU, so the tests start fresh ones
    print(json.dumps({"ready": True, "forks": not torch.cuda.is_initialized()}), file=answers)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            answers.close()
            return request
        print(json.dumps({"pid": pid}), file=answers)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=answers)
    sys.exit(0)


def become(request: dict) -> None:
    """Turn this forked child into `python run.py ARGS` as a fresh interpreter would start it."""
    import runpy
    import signal
    import warnings

    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 stays open for the interpreter's life
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what Python starts with
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.warnoptions[:] = [request["env"].get("PYTHONWARNINGS", "default")]
    warnings.resetwarnings()
    warnings.simplefilter(sys.warnoptions[0])  # the tests' runs ask for "ignore"
    sys.argv = list(request["argv"][1:])  # [python, run.py, ARGS...] -> what python gives run.py
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    become(serve())
