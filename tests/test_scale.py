"""Several processes: DDP on the CPU (gloo) through Lightning's launcher and through torchrun, streamed
LoRA under data parallelism, and the one-sentence failures of a multi-process run.

Each multi-process run is compared with one process on the same global batch: the same loss curve and
the same weights after 3 optimizer steps (relative to each tensor's scale, 1e-4)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import GRID_SWEEP_CONFIG, ROOT, compose, read_metrics, run_cli

from onn.errors import UserError
from onn.training.checkpoints import load, read_meta

# 3 optimizer steps of 8 samples, 4 micro-batches of 2; no warmup, so every step moves the weights
STEPS = [
    "model=llama_tiny",
    "data.builtin.train_size=64",
    "data.builtin.val_size=16",
    "tracking=none",
    "task.exact_match_samples=0",
    "trainer.max_steps=3",
    "optim.warmup_steps=0",
    "strategy.micro_batch=2",
    "data.batch_size=8",
    "trainer.enable_progress_bar=false",
]
# SGD: AdamW's first update of a LoRA A matrix divides gradients near its eps (1e-8) by their own size,
# which turns float-rounding differences of the summation order into 1e-3 relative differences
STREAMED = [
    "strategy=sparse_lora",
    "strategy.layers=[0,-1]",
    "strategy.streaming.store=cpu",
    "strategy.streaming.chunk_size=3",
    "optim.name=sgd",
    "optim.lr=0.5",
]


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One cache for this file's runs: this machine's hardware profile is measured once."""
    return tmp_path_factory.mktemp("cache")


def run(*args: str, outputs: Path, run_dir: Path, cache: Path) -> subprocess.CompletedProcess:
    return run_cli(
        *STEPS, *args, f"paths.outputs={outputs}", f"paths.cache={cache}", f"hydra.run.dir={run_dir}", timeout=300
    )


def assert_same_run(one: Path, many: Path) -> None:
    """Same loss per step, and every trained tensor equal within 1e-4 of its own scale."""
    curve_one, curve_many = read_metrics(one)["train/loss_curve"], read_metrics(many)["train/loss_curve"]
    assert len(curve_one) == 3 and curve_one[-1] < curve_one[0]  # it trained
    assert curve_many == pytest.approx(curve_one, rel=1e-4)
    a = load(one / "checkpoints" / "last.ckpt")["state_dict"]
    b = load(many / "checkpoints" / "last.ckpt")["state_dict"]
    assert a.keys() == b.keys() and a
    for key in a:
        scale = float(a[key].abs().max()) or 1.0
        assert float((a[key] - b[key]).abs().max()) <= 1e-4 * scale, key


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache: Path) -> Path:
    """The reference: one process, the whole global batch of 8."""
    outputs = tmp_path_factory.mktemp("single")
    ok(run("strategy=full", outputs=outputs, run_dir=outputs / "one", cache=cache))
    return outputs / "one"


@pytest.mark.slow
def test_ddp_two_processes_equal_one(single: Path, tmp_path: Path, cache: Path):
    """strategy=ddp trainer.devices=2 (Lightning's launcher runs the command again for rank 1)."""
    run_dir = tmp_path / "outputs" / "ddp"
    ok(run("strategy=ddp", "trainer.devices=2", outputs=tmp_path / "outputs", run_dir=run_dir, cache=cache))
    assert_same_run(single, run_dir)
    m = read_metrics(run_dir)
    assert m["status"] == "ok" and m["val/loss_final"] == pytest.approx(
        read_metrics(single)["val/loss_final"], rel=1e-4
    )
    # one run folder, written by rank 0; rank 1 only logs there
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir() if not p.name.startswith(".")) == ["ddp"]
    assert (run_dir / "train_ddp_process_1.log").exists() and (run_dir / "plan.yaml").exists()


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_and_its_checkpoint_resumes(tmp_path: Path, cache: Path):
    """SIGKILL rank 1 after a checkpoint: rank 0 fails at once with one sentence (not after Lightning's 30
    minutes), its record says so, and the checkpoint resumes under two processes."""
    import signal

    import psutil

    outputs, run_dir = tmp_path / "outputs", tmp_path / "outputs" / "killed"
    args = [
        *STEPS,
        "strategy=ddp",
        "trainer.devices=2",
        "trainer.max_steps=500",
        "checkpoint.every_n_steps=2",
        "strategy.timeout_s=60",  # the resumed run keeps it: a second rank that starts slowly on a busy machine joins
        f"paths.outputs={outputs}",
        f"paths.cache={cache}",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    log = tmp_path / "killed.log"
    parent = subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    deadline = time.time() + 240
    while not (run_dir / "checkpoints" / "last.ckpt" / "meta.json").exists() and time.time() < deadline:
        assert parent.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    ranks = [p for p in psutil.Process(parent.pid).children() if "train_ddp_process_1" in " ".join(p.cmdline())]
    assert ranks, log.read_text()[-3000:]
    ranks[0].send_signal(signal.SIGKILL)
    code = parent.wait(timeout=120)  # the other rank stops on strategy.timeout_s; a hang fails here
    assert code != 0
    record = read_metrics(run_dir)
    assert record["status"] == "failed" and "lost a peer process" in record["error"], record
    step = read_meta(run_dir / "checkpoints" / "last.ckpt")["global_step"]
    resumed = outputs / "resumed"
    ok(
        run(
            "strategy=ddp",
            "trainer.devices=2",
            f"ckpt={run_dir}",
            f"trainer.max_steps={step + 1}",
            outputs=outputs,
            run_dir=resumed,
            cache=cache,
        )
    )
    assert read_metrics(resumed)["steps"] == step + 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_two_nodes_equal_one(single: Path, tmp_path: Path, cache: Path):
    """Two torchrun "nodes" on localhost (c10d rendezvous), one process each, through run.py."""
    outputs, run_dir, port = tmp_path / "outputs", tmp_path / "outputs" / "tr", free_port()
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=onn-test",
    ]
    args = [
        str(ROOT / "run.py"),
        *STEPS,
        "strategy=ddp",
        "trainer.num_nodes=2",
        f"paths.outputs={outputs}",
        f"paths.cache={cache}",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    logs = [tmp_path / f"node{r}.log" for r in (0, 1)]
    nodes = [
        subprocess.Popen(
            [*torchrun, f"--node-rank={r}", *args], cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
        )
        for r, log in enumerate(logs)
    ]
    codes = [n.wait(timeout=300) for n in nodes]
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    assert_same_run(single, run_dir)
    assert (run_dir / "rank_1.log").exists()  # rank 1 shares the folder and writes no .hydra/ of its own


@pytest.mark.slow
def test_streamed_lora_two_ranks_equal_one(tmp_path: Path, cache: Path):
    """Layer streaming in each of 2 processes, the adapters' gradients all-reduced: the adapters after 3
    steps are those of one process on the whole batch."""
    outputs = tmp_path / "outputs"
    ok(run(*STREAMED, outputs=outputs, run_dir=outputs / "one", cache=cache))
    ok(run(*STREAMED, "trainer.devices=2", outputs=outputs, run_dir=outputs / "two", cache=cache))
    assert_same_run(outputs / "one", outputs / "two")
    adapters = load(outputs / "two" / "checkpoints" / "last.ckpt")["state_dict"]
    assert any("lora_B" in k and float(v.abs().max()) > 0 for k, v in adapters.items())  # B starts at 0: it learned
    assert (outputs / "two" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_unreachable_rendezvous_fails_in_one_sentence(tmp_path: Path, monkeypatch, cache: Path):
    """Rank 1 of 2 whose rank 0 never comes: one sentence naming the address and port, after the timeout."""
    port = free_port()
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "LOCAL_RANK": "1",
        "NODE_RANK": "0",
        "WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(key, value)  # what Lightning's launcher gives the process of rank 1
    # run_cli's timeout (120 s, not Lightning's default 30 minutes) turns a hang into a failure
    proc = run_cli(
        *STEPS,
        "strategy=ddp",
        "trainer.devices=2",
        "strategy.timeout_s=3",
        f"paths.outputs={tmp_path}",
        f"paths.cache={cache}",
        f"hydra.run.dir={tmp_path / 'r1'}",
        "hydra.output_subdir=null",
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr
    assert f"could not reach the rendezvous at 127.0.0.1:{port} within strategy.timeout_s=3" in said
    assert "Traceback" not in said
    assert not (tmp_path / "r1" / "metrics.json").exists()  # rank 1 writes no record


def test_a_rank_waits_for_the_rendezvous_port_and_names_it_when_it_never_opens(monkeypatch):
    """Torch's store client retries past its timeout; ONN's own wait names the address once the timeout is over."""
    from onn.training.trainer import wait_for_rendezvous

    port = free_port()
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(
        UserError,
        match=f"rank 1 could not reach the rendezvous at 127.0.0.1:{port} within strategy.timeout_s=0.5",
    ):
        wait_for_rendezvous(0.5)
    with socket.create_server(("127.0.0.1", port)):  # rank 0's store is listening: no wait, no error
        wait_for_rendezvous(0.5)
    monkeypatch.setenv("LOCAL_RANK", "0")
    wait_for_rendezvous(0.5)  # rank 0 opens the rendezvous itself: it never waits for it


def test_gpu_only_strategies_refuse_the_cpu_in_one_sentence():
    from onn.training.trainer import data_parallel

    for name in ("fsdp", "deepspeed_zero2", "deepspeed_zero3_offload"):
        config = compose(f"strategy={name}")
        with pytest.raises(UserError, match="runs on CUDA GPUs only"):
            data_parallel(config.strategy.lightning, config, "cpu")
    strategy = data_parallel("ddp", compose("strategy=ddp", "strategy.timeout_s=7"), "cpu")
    assert strategy._timeout.total_seconds() == 7


LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "MASTER_ADDR",
    "NODE_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
)


def test_several_processes_under_lightnings_auto_strategy_keep_strategy_timeout(tmp_path: Path, monkeypatch):
    """strategy=lora over two nodes (strategy.lightning=auto): Lightning picked DDP itself with its 30-minute timeout,
    and rank 0 waited 12 minutes for a node that never came whatever strategy.timeout_s said. One process stays
    on Lightning's single-device strategy."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from onn.hardware.profile import resolve
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec
    from onn.training.trainer import build_trainer

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for nodes, kind in ((2, DDPStrategy), (1, SingleDeviceStrategy)):
        cfg = compose(
            "model=llama_tiny",
            "hardware=cpu_16gb",
            "strategy=lora",
            f"trainer.num_nodes={nodes}",
            "strategy.timeout_s=15",
        )
        assert cfg.strategy.lightning == "auto"
        plan = make_plan(cfg, resolve(cfg.hardware, tmp_path, tmp_path), model_spec(cfg.model, cfg.strategy.lora.r))
        strategy = build_trainer(cfg, plan, tmp_path / f"run{nodes}", [], loggers=False).strategy
        assert isinstance(strategy, kind)  # DDP: ONN's EvaluatedOnceDDP, a DDPStrategy
        if nodes > 1:
            assert strategy._timeout.total_seconds() == 15


def test_a_launch_that_would_wait_or_fail_in_every_process_is_one_sentence_first(monkeypatch):
    """Before any process waits: several nodes in a process no launcher started (rank 0 waited strategy.timeout_s
    for nodes nobody starts, deaf to SIGTERM), and torchrun's process count other than trainer.devices x
    trainer.num_nodes (Lightning's ValueError, with a traceback in each process)."""
    from onn.training.trainer import check

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    nodes = compose("strategy=ddp", "trainer.num_nodes=2").trainer
    with pytest.raises(UserError, match=r"^trainer.num_nodes=2 asks for 2 machines, and no launcher started this one"):
        check(nodes)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # Lightning's own multi-node: the address and rank set by hand
    monkeypatch.setenv("NODE_RANK", "1")
    check(nodes)
    for name in ("MASTER_ADDR", "NODE_RANK"):
        monkeypatch.delenv(name)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)  # torchrun --nproc-per-node=2
    with pytest.raises(
        UserError,
        match=r"^torchrun started 2 processes \(2 per node\), and trainer.devices=1 x trainer.num_nodes=1 asks for 1: "
        r"give trainer.devices=2 trainer.num_nodes=1\.$",
    ):
        check(compose("strategy=ddp", "trainer.devices=1").trainer)
    check(compose("strategy=ddp", "trainer.devices=2").trainer)


def test_strategy_lightning_is_one_of_lightnings_that_returns_or_one_sentence():
    """strategy.lightning=ddpx ended in Lightning's ValueError; ddp_spawn trained, then failed the task ("CausalLM is
    not attached to a Trainer": the spawned processes' results never come back)."""
    from onn.training.trainer import check_lightning

    with pytest.raises(UserError, match=r"^strategy.lightning='ddpx' is not a Lightning strategy"):
        check_lightning("ddpx")
    for name in ("ddp_spawn", "ddp_fork_find_unused_parameters_true", "ddp_notebook"):
        with pytest.raises(UserError, match=r"returns nothing to the one that started them.*use strategy=ddp"):
            check_lightning(name)
    for name in ("auto", "streaming", "ddp", "ddp_find_unused_parameters_true", "fsdp", "deepspeed_stage_3_offload"):
        check_lightning(name)


def test_multirun_with_several_devices_is_refused():
    from onn.training.trainer import check_launch

    config = compose("strategy=ddp", "trainer.devices=2")
    with pytest.raises(UserError, match="multirun"):
        check_launch(config, multirun=True)
    check_launch(config, multirun=False)
    check_launch(compose("strategy=ddp", "trainer.devices=1"), multirun=True)


def test_more_devices_than_cores_warns(caplog):
    from onn.training.trainer import warn_oversubscribed

    cores = len(os.sched_getaffinity(0))
    with caplog.at_level("WARNING", logger="onn"):
        warn_oversubscribed({"accelerator": "cpu", "devices": cores + 1})
    assert f"trainer.devices={cores + 1} starts {cores + 1} processes" in caplog.text
    caplog.clear()
    warn_oversubscribed({"accelerator": "cpu", "devices": 1})
    assert not caplog.text


def test_rank_slices_cover_the_global_batch():
    """Two ranks' slices of each global batch are together the one-process batch, in its order."""
    from onn.modalities.text.datamodule import RankSlice, ResumableShuffle

    order = ResumableShuffle(50, seed=3, start=lambda: 16)
    one = iter(order)
    slices = [iter(RankSlice(order, 8, r, 2)) for r in (0, 1)]
    for _ in range(5):
        assert [next(slices[0]) for _ in range(4)] + [next(slices[1]) for _ in range(4)] == [
            next(one) for _ in range(8)
        ]


def test_record_and_files_are_rank_zero_only(tmp_path: Path, monkeypatch):
    from onn.tasks.record import RunRecord

    monkeypatch.setenv("LOCAL_RANK", "1")
    RunRecord(tmp_path, {"status": "running"}).write()
    assert not (tmp_path / "metrics.json").exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    RunRecord(tmp_path, {"status": "running"}).write()
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "running"


SWEEP_APP = """
import json, time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from onn.config import register

register()  # ONN's hydra/launcher=submitit_local, as run.py registers it


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    out = Path(HydraConfig.get().runtime.output_dir)
    x = int(cfg.x)
    start = time.time()
    (out.parent / f"started_{x}").touch()
    # each job of a pair waits for the other to start (a launcher running two at a time starts both now, but a
    # loaded machine's imports can take seconds, and the second-started one had ended before the first began);
    # the first ends last
    partner = out.parent / f"started_{x + 1 if x % 2 else x - 1}"
    while not partner.exists() and time.time() - start < 60:
        time.sleep(0.05)
    time.sleep(2.5 if x % 2 else 0.2)
    (out / "metrics.json").write_text(json.dumps({"status": "ok", "error": None, "model": "m", "strategy": f"s{x}",
        "bench/samples_per_s": 10.0 * x, "bench/peak_memory_mb": 100.0 + x, "score/overall": float(x),
        "start": start, "end": time.time()}))
    return x


if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_submitit_local_runs_two_jobs_at_a_time_and_the_grid_is_complete(tmp_path: Path):
    """4 jobs, each in its own process, 2 at a time; they finish out of order and the grid has them all."""
    import textwrap

    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(GRID_SWEEP_CONFIG)
    (tmp_path / "app.py").write_text(textwrap.dedent(SWEEP_APP))
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "app.py", "-m", "hydra/launcher=submitit_local", "x=1,2,3,4", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = [json.loads((sweep / str(i) / "metrics.json").read_text()) for i in range(4)]
    logs = [p.name for p in (sweep / ".submitit").glob("*_0_log.out")]  # JOBID_0_log.out, one per job
    assert len({name.split("_")[0] for name in logs}) == 4  # 4 processes
    events = sorted([(j["start"], 1) for j in jobs] + [(j["end"], -1) for j in jobs])
    running = [sum(step for _, step in events[: i + 1]) for i in range(len(events))]
    assert max(running) == 2  # two at a time, never more
    assert jobs[1]["end"] < jobs[0]["end"] and jobs[3]["end"] < jobs[2]["end"]  # out of order
    rows = (sweep / "grid.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 4 and (sweep / "grid.md").is_file()


def scale_for(*overrides: str, tmp_path: Path) -> dict:
    from onn.hardware.profile import resolve
    from onn.planning.scale import scale_plan
    from onn.planning.spec import model_spec

    cfg = compose("task=plan", *overrides, root=tmp_path)
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    return scale_plan(cfg, hw, model_spec(cfg.model, 8, cache_dir=str(tmp_path / "cache")))


@pytest.mark.slow
def test_plan_for_phi4_on_1_8_and_16_a100(tmp_path: Path):
    one, eight, sixteen = (
        scale_for(
            "model=phi4",
            "hardware=a100_80gb",
            f"hardware.count={c}",
            f"trainer.num_nodes={n}",
            f"data.batch_size={b}",
            tmp_path=tmp_path,
        )
        for c, n, b in ((1, 1, 8), (8, 1, 8), (8, 2, 16))  # a global batch each process takes an equal slice of
    )
    for plan in (one, eight, sixteen):
        assert set(plan["options"]) == {"ddp", "deepspeed_zero2", "fsdp", "deepspeed_zero3_offload"}
        assert not plan["options"]["ddp"]["fits"]  # 14.7B weights, gradients and Adam: about 16 bytes a weight
    per_device = {n: [p["options"][n]["per_device_mb"] for p in (one, eight, sixteen)] for n in one["options"]}
    # sharded state falls with the devices holding it; DDP's does not
    assert per_device["fsdp"][0] > per_device["fsdp"][1] > per_device["fsdp"][2]
    assert per_device["deepspeed_zero2"][0] > per_device["deepspeed_zero2"][1] > per_device["deepspeed_zero2"][2]
    assert per_device["ddp"][0] == per_device["ddp"][1] == per_device["ddp"][2]
    # one GPU: only offloading the weights and optimizer to host memory fits
    assert one["chosen"] == "deepspeed_zero3_offload" and one["reason"].startswith(
        "14.7B full fine-tune: ZeRO-3+offload over 1 x"
    )
    assert (
        eight["chosen"] in ("deepspeed_zero2", "fsdp") and "over 8 x NVIDIA A100-SXM4-80GB, 1 node" in eight["reason"]
    )
    # between nodes the gradients cross a slower link: the same bytes take longer
    assert sixteen["links"]["all_reduce_s"] > eight["links"]["all_reduce_s"] > 0
    assert sixteen["global_batch"] == 16 and eight["global_batch"] == 8


def test_a_model_that_fits_ddp_gets_ddp_and_the_cpu_refuses_sharding(tmp_path: Path):
    gpus = scale_for("model=llama_tiny", "hardware=a100_80gb", "hardware.count=2", tmp_path=tmp_path)
    assert gpus["chosen"] == "ddp" and gpus["options"]["ddp"]["fits"]
    cpu = scale_for("model=llama_tiny", "hardware=cpu_16gb", "strategy=ddp", "trainer.num_nodes=2", tmp_path=tmp_path)
    assert cpu["chosen"] == "ddp"
    assert all(cpu["options"][n]["refused"] for n in ("deepspeed_zero2", "fsdp", "deepspeed_zero3_offload"))
    assert cpu["links"]["missing"] == ["hardware.network_gb_s"]  # the preset names no network: said, not guessed


def test_cpu_processes_share_their_hosts_memory_and_cores(tmp_path: Path):
    """DDP over hardware.count CPU processes: each holds what the single-device plan holds at its micro-batch (the
    heap's share included) within 1/count of the host's budget, and computes at 1/count of the cores' rate."""
    from onn.hardware.profile import resolve
    from onn.planning.costs import compute_s
    from onn.planning.plan import estimate
    from onn.planning.spec import model_spec

    common = ("model=llama_tiny", "hardware=cpu_16gb", "strategy=ddp", "data.batch_size=8")
    two = scale_for(*common, "hardware.count=2", tmp_path=tmp_path)
    ddp = two["options"]["ddp"]
    cfg = compose("task=plan", *common, root=tmp_path)
    spec = model_spec(cfg.model, 8, cache_dir=str(tmp_path / "cache"))
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    blocks = list(range(spec.n_blocks))
    one = estimate("full", spec, hw, int(cfg.data.max_length), ddp["micro_batch"], two["precision"], blocks, 4)
    assert ddp["per_device_mb"] == pytest.approx(one.peak_mb + one.context_mb, rel=0.01)
    alone = compute_s(spec, hw, "full", int(cfg.data.max_length), 4, ddp["micro_batch"], blocks)
    assert ddp["compute_s"] == pytest.approx(2 * alone, rel=0.01)
    assert "GB over 2 processes" in two["reason"]
    # a budget that holds one process but not two: DDP over two does not fit
    budget = f"hardware.budget_mb={int(ddp['per_device_mb'] * 1.5)}"
    assert scale_for(*common, "hardware.count=1", budget, tmp_path=tmp_path)["options"]["ddp"]["fits"]
    assert not scale_for(*common, "hardware.count=2", budget, tmp_path=tmp_path)["options"]["ddp"]["fits"]


@pytest.mark.slow
def test_the_plan_sizes_the_processes_trainer_devices_starts(tmp_path: Path):
    """trainer.devices=2 ran two processes while the plan sized one for the whole host; hardware.count=2 sized two
    while the run was one process. The plan follows trainer.devices; a hardware.count the run would not start is one
    sentence (task=plan alone plans a node with hardware.count)."""
    from onn.planning.scale import devices_per_node

    common = ("model=llama_tiny", "hardware=cpu_16gb", "strategy=ddp", "data.batch_size=8")
    two = scale_for(*common, "trainer.devices=2", tmp_path=tmp_path)
    assert two["devices_per_node"] == 2 and two["per_device_batch"] == 4 and "GB over 2 processes" in two["reason"]
    three = ("model=llama_tiny", "hardware=cpu_16gb", "strategy=ddp", "data.batch_size=9", "trainer.devices=[0,1,2]")
    assert scale_for(*three, tmp_path=tmp_path)["devices_per_node"] == 3
    # a global batch the processes cannot share equally: refused as the run refuses it (the plan rounded it up)
    with pytest.raises(UserError, match=r"^data\.batch_size=8 does not split evenly over 3 processes: give a multi"):
        scale_for(*common, "trainer.devices=[0,1,2]", tmp_path=tmp_path)
    assert scale_for(*common, "hardware.count=2", tmp_path=tmp_path)["devices_per_node"] == 2  # planned, not run
    with pytest.raises(UserError, match=r"^hardware.count=3 and trainer.devices=2 disagree .*give hardware.count=2"):
        scale_for(*common, "hardware.count=3", "trainer.devices=2", tmp_path=tmp_path)
    with pytest.raises(UserError, match=r"^hardware.count=2 sizes .* which trainer.devices=auto does not start: give "):
        devices_per_node(compose(*common, "task=train", "hardware.count=2"))
    assert devices_per_node(compose(*common, "task=train", "hardware.count=2", "trainer.devices=2")) == 2


def test_an_adapter_fine_tune_over_several_devices_is_sized_as_the_adapters_it_trains(tmp_path: Path):
    """strategy=lora (qlora, sparse_lora) over 8 GPUs: the table sizes that fine-tune, not a full one. Every setup
    holds the frozen weights whole or sharded and the adapters' gradients and moments; the all-reduce moves the
    adapters' gradients; DDP holds what one device's plan holds."""
    from onn.hardware.profile import resolve
    from onn.planning.plan import estimate
    from onn.planning.spec import model_spec

    common = ("model=llama_small", "hardware=a100_80gb", "hardware.count=8")
    full, lora, qlora, sparse = (
        scale_for(*common, f"strategy={s}", tmp_path=tmp_path) for s in ("full", "lora", "qlora", "sparse_lora")
    )
    cfg = compose("task=plan", *common, "strategy=lora", root=tmp_path)
    spec = model_spec(cfg.model, 8, cache_dir=str(tmp_path / "cache"))
    assert full["method"] == "full" and full["trainable_params"] == spec.params
    assert lora["method"] == "lora" and lora["trainable_params"] == sum(spec.lora_params_per_block)
    layers = [0, 1, 2, 3, spec.n_blocks - 4, spec.n_blocks - 3, spec.n_blocks - 2, spec.n_blocks - 1]
    assert sparse["trainable_params"] == sum(spec.lora_params_per_block[i] for i in sorted(set(layers)))
    assert "LoRA fine-tune: DDP over 8 x" in lora["reason"] and lora["fine_tune"] == "LoRA fine-tune"
    # the gradients all-reduced: the adapters' only, a small share of the full fine-tune's
    ratio = lora["trainable_params"] / spec.params
    assert lora["links"]["all_reduce_s"] <= full["links"]["all_reduce_s"] * ratio * 1.1 + 1e-6
    for name in ("ddp", "deepspeed_zero2"):
        assert lora["options"][name]["per_device_mb"] < full["options"][name]["per_device_mb"]
        assert qlora["options"][name]["per_device_mb"] < lora["options"][name]["per_device_mb"]  # NF4 blocks
    # DDP replicates one device's LoRA run: the single-device plan's memory at the same micro-batch
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    ddp = lora["options"]["ddp"]
    seq = int(cfg.data.max_length)
    one = estimate("lora", spec, hw, seq, ddp["micro_batch"], lora["precision"], list(range(spec.n_blocks)), 1)
    states = one.weights_mb + one.trainable_mb + one.optimizer_mb
    assert ddp["per_device_mb"] == pytest.approx((states + one.activations_mb) * 1.05 + one.context_mb, rel=0.01)


def test_one_device_that_fits_the_streamed_plan_is_not_told_to_add_devices(tmp_path: Path):
    """The README's first command: its plan streamed sparse_lora within the GTX 1650's budget, then the table below
    it said "no setup fits 1 x NVIDIA GeForce GTX 1650, 1 node ...: add devices or nodes"."""
    common = ("model=phi4", "data=math", "strategy=sparse_lora", "hardware=gtx1650_4gb")
    one = scale_for(*common, tmp_path=tmp_path)
    assert one["chosen"] is None and "add devices" not in one["reason"]
    assert one["reason"].startswith("14.7B sparse-LoRA fine-tune: streamed, it fits 1 x NVIDIA GeForce GTX 1650")
    assert f"need at least {min(o['per_device_mb'] for o in one['options'].values()):,.0f} MB" in one["reason"]
    # held resident (strategy.lightning=ddp), nothing streams: no setup fits, and the table says so
    resident = scale_for(*common, "strategy.lightning=ddp", tmp_path=tmp_path)
    assert "no setup fits 1 x NVIDIA GeForce GTX 1650" in resident["reason"]


@pytest.mark.slow
def test_plan_table_is_printed(tmp_path: Path):
    proc = run_cli(
        "task=plan",
        "model=phi4",
        "hardware=a100_80gb",
        "hardware.count=8",
        "trainer.num_nodes=2",
        "data.batch_size=16",
        f"paths.outputs={tmp_path}",
        f"hydra.run.dir={tmp_path / 'plan'}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "full fine-tune over 8 device(s) x 2 node(s)" in proc.stdout and "ZeRO-3+offload" in proc.stdout
    assert "14.7B full fine-tune:" in proc.stdout and "over 8 x NVIDIA A100-SXM4-80GB, 2 nodes" in proc.stdout


_FSDP_RANK = """
import json, os, sys
from types import SimpleNamespace
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from onn.training.distributed import gathered

rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
whole = [p.detach().clone() for p in model.parameters()]
root = FullyShardedDataParallel(
    model, sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True, device_id=torch.device("cpu")
)
root(torch.randn(2, 8)).sum().backward()  # a step's forward and backward: the parameters are views of shards after
x = torch.ones(3, 8)
want = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, whole[0], whole[1])), whole[2], whole[3])
# what the LightningModule offers gathered(): its trainer's world and strategy, its modules
module = SimpleNamespace(trainer=SimpleNamespace(world_size=2, strategy=SimpleNamespace(model=root)),
                         parameters=root.parameters, modules=root.modules)
try:
    with gathered(module), torch.no_grad():
        got = root.module(x)  # the wrapped model's own forward, as transformers' generate calls it
    out = {"max_diff": float((got - want).abs().max())}
except RuntimeError as e:
    out = {"error": str(e).splitlines()[0]}
print(json.dumps(out))
dist.destroy_process_group()
"""


@pytest.mark.slow  # two fresh interpreters import torch and set up a process group: ~20 s on two shared cores
def test_fsdp_sharded_over_two_ranks_answers_with_whole_weights(tmp_path: Path):
    """After training, every rank of a sharded FSDP run generates its answers through the wrapped model's own
    forward (transformers' generate), which FSDP's gather never sees: between FSDP's forwards each parameter is
    a 1-D view of its rank's shard, and the forward failed on it. Within `gathered` the weights are whole on
    every rank (two gloo processes on the CPU, FULL_SHARD and the original parameters, as Lightning sets FSDP
    up)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _FSDP_RANK, str(r)], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    outs = [json.loads(r.communicate(timeout=120)[0].strip().splitlines()[-1]) for r in ranks]
    assert all(out.get("max_diff", 1.0) < 1e-5 for out in outs), outs
