"""Shared helpers: compose ONN configs in-process, and run the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker's torch (and every run.py it starts) gets its share of the cores: three
    workers of two threads each on two cores spent their time switching (a test of 30 s alone took 60-130 s)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
        if "torch" in sys.modules:  # a plugin imported it first
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cores()  # before torch is imported: its thread pool reads OMP_NUM_THREADS once

from onn.config import ONNConfig, register  # noqa: E402

register()  # the config schema, as run.py registers it before Hydra composes
ROOT = Path(__file__).resolve().parents[1]
# A modality's train/eval/infer tests plan for this: the same 16 GB CPU preset on every CPU machine (its figures do
# not move with the machine), and the machine itself where it has a GPU, so that the GPU check runs them on CUDA
MODALITY_HARDWARE = "hardware=auto" if __import__("torch").cuda.is_available() else "hardware=cpu_16gb"
# ../shared/data beside the checkout; ONN_SHARED_DATA points elsewhere (a git worktree one level deeper)
SHARED_DATA = Path(os.environ.get("ONN_SHARED_DATA") or ROOT.parent / "shared" / "data")
# A sweep whose jobs write a bench record and whose Hydra callback writes the grid (tests' stand-in apps)
GRID_SWEEP_CONFIG = """x: 0
task:
  name: bench
hydra:
  callbacks:
    grid:
      _target_: onn.bench.grid.GridCallback
"""


class HostReads:
    """The tensor values read back by the host inside `with HostReads() as reads:` (reads.seen: what read them).
    On a GPU each is a wait for every kernel queued, so the host cannot run ahead of the device; on a CPU
    nothing waits, but the reads are the same calls: a value taken to Python (`.item()`, `bool(t)`, `.tolist()`,
    `.cpu()` ...), and an output sized by the values (a boolean mask's indexing, `nonzero`, `unique` ...).
    A tensor brought to the host by `.cpu()` inside the block is on the host after: reading it is not counted
    (on a CPU, `.cpu()` would give the tensor itself; here it gives a copy, as on a GPU)."""

    VALUES = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy"}
    SIZED = {"nonzero", "masked_select", "unique", "_unique2", "unique_dim", "unique_consecutive", "bincount"}

    def __enter__(self) -> HostReads:
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        seen: list[str] = []
        on_host: list = []  # the tensors .cpu() gave (held, so that no other tensor takes their ids)

        def hosted(args) -> bool:
            return bool(args) and any(args[0] is t for t in on_host)

        class Values(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = getattr(func, "__name__", "")
                if name in HostReads.VALUES and not hosted(args):
                    seen.append(name)
                    if name == "cpu":
                        if out is args[0]:
                            with torch._C.DisableTorchFunction():
                                out = out.clone()
                        on_host.append(out)
                return out

        class Sized(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func._schema.name.split("::")[1]
                if not hosted(args):
                    if name in HostReads.SIZED:
                        seen.append(name)
                    elif name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1]):
                        seen.append("index[bool]")
                    elif (
                        name == "repeat_interleave"
                        and torch.is_tensor(args[0])
                        and (kwargs or {}).get("output_size") is None
                        and func._overloadname != "self_int"
                    ):
                        seen.append(name)
                return func(*args, **(kwargs or {}))

        self.seen, self._modes = seen, [Values(), Sized()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def compose(*overrides: str, root: Path | None = None) -> ONNConfig:
    """The typed config `python run.py OVERRIDES` would get (paths.root set, since no Hydra run exists)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from onn.app import to_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("config", overrides=[f"paths.root={root or ROOT}", *overrides])
    return to_config(cfg)


def execute_run(tmp: Path, cache: Path, *overrides: str, name: str = "run", given: set[str] | None = None) -> dict:
    """The run `python run.py model=llama_tiny OVERRIDES` makes, in this process, in `tmp/name` with its hardware
    profile in `cache` (`given`: the keys the command line set, which a run with ckpt= takes over the checkpoint's;
    a later override wins, model= and hardware= included)."""
    from onn.app import execute

    cfg = compose(
        "model=llama_tiny",
        MODALITY_HARDWARE,
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp / 'outputs'}",
        f"paths.cache={cache}",
        *overrides,
    )
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return execute(cfg, run_dir, given)


def tiny_llama(**config: object):
    """A random-init two-layer Llama of a few thousand parameters (transformers' LlamaForCausalLM, in eval mode);
    `config` overrides its LlamaConfig's values."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    values = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return tf.LlamaForCausalLM(tf.LlamaConfig(**{**values, **config})).eval()


def run_cli(
    *args: str, cwd: Path | None = None, timeout: int = 600, python_warnings: str = "ignore"
) -> subprocess.CompletedProcess:
    """`python run.py ARGS` in a process of its own. Forked from a warm interpreter (tests/zygote.py) when
    warnings are ignored and the zygote left CUDA unstarted; a fresh interpreter when a test reads the warnings a
    first import prints."""
    argv = [sys.executable, str(ROOT / "run.py"), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": python_warnings}
    zygote = _zygote() if python_warnings == "ignore" else None
    if zygote is None or not zygote.forks:
        return subprocess.run(argv, cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return zygote.run(argv, env, cwd or ROOT, timeout)


class Zygote:
    """This worker's warm interpreter (tests/zygote.py), started on first use; one run at a time."""

    def __init__(self) -> None:
        import atexit
        import shutil
        import tempfile

        self.folder = Path(tempfile.mkdtemp(prefix="onn-zygote-"))
        atexit.register(shutil.rmtree, self.folder, True)  # its log and the runs' captured output
        with open(self.folder / "zygote.log", "w") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "zygote.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=ROOT,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"},
            )
        ready = json.loads(self.proc.stdout.readline())
        assert ready.get("ready"), (self.folder / "zygote.log").read_text()
        self.forks: bool = ready["forks"]  # False: its children could not use the GPU

    def run(self, argv: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        import select

        out, err = self.folder / "stdout.txt", self.folder / "stderr.txt"
        request = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self.proc.stdout.readline())["pid"]
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            os.kill(pid, 9)
            self.proc.stdout.readline()
            raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
        code = json.loads(self.proc.stdout.readline())["returncode"]
        return subprocess.CompletedProcess(argv, code, out.read_text(errors="replace"), err.read_text(errors="replace"))


_zygotes: list[Zygote] = []


def _zygote() -> Zygote:
    if not _zygotes or _zygotes[0].proc.poll() is not None:
        _zygotes[:] = [Zygote()]
    return _zygotes[0]


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture(scope="session", autouse=True)
def hardware_profile_once(tmp_path_factory) -> None:
    """One hardware profile for the whole session, shared by its xdist workers: measuring one takes tens of
    seconds of both cores, and every run with a fresh outputs folder would measure it again."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "hardware"
    # run_cli's subprocesses inherit it; the session's own, never the user's: a profile measured while this
    # process holds GPU memory counts it in the CUDA context, and `recipe=bench_gpu` run after must not read that
    os.environ["ONN_HARDWARE_CACHE"] = str(folder)


@pytest.fixture
def outputs(tmp_path: Path) -> Path:
    return tmp_path / "outputs"


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each xdist worker starts on its share of the slow tests, then runs whole test files. `--dist worksteal`
    hands worker k the k-th contiguous part of this order, so part k is the k-th share of the slow tests, then
    files of quick tests: a file's module-scoped fixtures (a traced export, a served model) are built by one
    worker, not by all three. At the end idle workers steal quick tests, instead of one slow test running alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    slow = [item for item in items if item.get_closest_marker("slow")]
    shares = [slow[k::workers] for k in range(workers)]
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        if not item.get_closest_marker("slow"):
            files.setdefault(item.nodeid.split("::")[0], []).append(item)
    for tests in sorted(files.values(), key=len, reverse=True):  # the largest files first, each to the emptiest share
        min(shares, key=len).extend(tests)
    items[:] = [item for share in shares for item in share]
