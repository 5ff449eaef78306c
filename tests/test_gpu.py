"""ONN on a GPU. Tests marked `gpu` run on a CUDA device and skip without one (`pytest -m gpu` is the GPU
check, with `python run.py recipe=bench_gpu`); the others catch, on any machine, defects that show only on
a GPU."""

import copy
import dataclasses
import importlib.util
import json
import os
import re
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import ROOT, compose, read_metrics, run_cli
from test_streaming import LAYER_SETS, lora_grads, lora_model, micro_batches, store_decoded

from onn.errors import UserError
from onn.models.layers import discover
from onn.streaming.engine import StreamingEngine
from onn.streaming.store import LayerStore, stored_name

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
TINY = [
    "model=llama_tiny",
    "data.builtin.train_size=200",
    "data.builtin.val_size=20",
    "tracking=none",
    "task.exact_match_samples=4",
]


def test_every_process_computes_on_an_indexed_device(monkeypatch):
    """Lightning's single-device strategies need `cuda:N` (a bare `cuda` crashed the streamed Phi-4 run's
    setup), and each rank of a node takes its own GPU."""
    from onn.hardware.cluster import compute_device
    from onn.modalities import Job, get
    from onn.streaming.strategy import LayerStreamingStrategy

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert compute_device("cuda") == "cuda:0" and compute_device("cpu") == "cpu"
    strategy = LayerStreamingStrategy(None, "/nonexistent", 2, device=compute_device("cuda"))
    assert strategy.root_device == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert compute_device("cuda") == "cuda:3"
    job = Job({}, ROOT, get("text"), plan=SimpleNamespace(hardware={"accelerator": "cuda"}))
    assert torch.device(job.device) == torch.device("cuda", 3)


def test_a_rank_that_sees_one_gpu_computes_on_it(monkeypatch):
    """SLURM's --gpus-per-task=1 shows each rank its own GPU as cuda:0 while SLURM_LOCALID counts up: cuda:3
    does not exist there. A rank past the GPUs it sees (and not alone with one) is told so in a sentence."""
    from onn.errors import UserError
    from onn.hardware.cluster import compute_device

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert compute_device("cuda") == "cuda:0"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError, match="local rank 3 but sees 2 GPUs"):
        compute_device("cuda")


# A process that sees one GPU, whose CUDA start is recorded instead of made: what the warm interpreters import
_SEEN_GPU = """
import json, sys, torch
started = []
def start(*args, **kwargs):
    started.append(1)
    raise RuntimeError("CUDA started")
torch.cuda._lazy_init, torch.cuda.is_available, torch.cuda.device_count = start, lambda: True, lambda: 1
torch._C._cuda_getDeviceCount = lambda: 1
sys.path[:0] = [sys.argv[1]]
{imports}
print(json.dumps(started))
"""


@pytest.mark.slow  # three fresh interpreters import the heavy libraries: ~60 s on two shared cores
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is what starts CUDA")
def test_warm_interpreters_leave_cuda_unstarted_on_a_gpu_machine():
    """The test's zygote and the benches' forkserver import the heavy libraries once and fork a run from them;
    a child forked from a process that started CUDA cannot use the GPU, and peft imports bitsandbytes, which
    starts CUDA as it is imported wherever a GPU is visible (three GPU tests failed so on a GPU machine). Seen
    by a process that sees one GPU: importing peft starts CUDA, the warm imports do not."""
    import subprocess
    import sys

    def started(imports: str) -> list:
        script = _SEEN_GPU.format(imports=imports)
        out = subprocess.run([sys.executable, "-c", script, str(ROOT / "tests")], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert started("import peft")  # the libraries as they are: the check below would see a start
    assert not started("import zygote; zygote.warm_imports()")
    assert not started("from onn.bench import child\nfor name in child.warm_modules(): __import__(name)")


def test_each_rank_makes_its_own_gpu_current_before_cuda_is_touched(monkeypatch, tmp_path):
    """The profile, the allocator's cap and the memory readings act on the current CUDA device, which is GPU 0
    until Lightning's setup: rank 2 of a node must make cuda:2 current before the profile runs, or it caps GPU 0
    and puts a second context there."""
    import onn.app as app

    calls = []

    class Profiled(Exception):
        pass

    def profile(*args):
        calls.append("profile")
        raise Profiled

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(f"set_device({index})"))
    monkeypatch.setattr(app, "resolve_hardware", profile)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(Profiled):
        app.execute(compose(*TINY, f"paths.outputs={tmp_path}", f"paths.cache={tmp_path}/cache"), tmp_path / "run")
    assert calls == ["set_device(2)", "profile"]
    calls.clear()
    monkeypatch.setenv("LOCAL_RANK", "0")  # a single process, or a node's first rank: GPU 0 is current already
    with pytest.raises(Profiled):
        app.execute(compose(*TINY, f"paths.outputs={tmp_path}", f"paths.cache={tmp_path}/cache"), tmp_path / "run")
    assert calls == ["profile"]


def test_pinned_host_memory_locks_its_own_pages_not_a_power_of_two_and_unlocks_them_when_freed(monkeypatch):
    """torch's pinned allocator rounds every allocation up to a power of two (a Phi-4 block's int8 tensors: 480 MiB
    locked for 325). A store pinned for the GPU, and a disk store's read buffers, register their bytes with CUDA in
    whole pages of their own (two registrations sharing a page would be refused) and unregister them when the last
    tensor viewing them is freed. CUDA's registration is recorded here instead, so this runs on any machine."""
    import gc

    from torch.cuda import _pin_memory_utils as pins

    from onn.hardware.disk import aligned, buffer

    registered: dict[int, int] = {}
    monkeypatch.setattr(pins, "pin_memory", lambda ptr, size: registered.__setitem__(ptr, size))
    monkeypatch.setattr(pins, "unpin_memory", lambda ptr: registered.pop(ptr))
    torch.manual_seed(0)
    block = {"mlp.up_proj.weight": torch.randn(300, 70), "input_layernorm.weight": torch.randn(70)}
    pinned, plain = LayerStore("cpu", "int8", pin=True), LayerStore("cpu", "int8")
    pinned.fill({0: block})
    plain.fill({0: block})
    stored = plain.read(0)
    # whole pages inside each tensor's own allocation: the 21,000 bytes of codes lock 6 pages (a power of two, 8)
    assert sum(t.numel() * t.element_size() for t in stored.values()) == 21_000 + 300 * 4 + 70 * 4
    assert sorted(registered.values()) == [4096, 4096, 6 * 4096] and all(ptr % 4096 == 0 for ptr in registered)
    ranges = sorted(registered.items())
    assert all(ptr + size <= after for (ptr, size), (after, _) in zip(ranges, ranges[1:]))
    read = pinned.read(0)
    assert all(torch.equal(read[name], t) and read[name].dtype == t.dtype for name, t in stored.items())
    del pinned, read
    gc.collect()
    assert registered == {}
    raw = buffer(5000, pin=True)  # a disk store's read buffer, O_DIRECT-aligned: 12 KiB locked (not 16)
    assert len(raw) == aligned(5000) and list(registered.values()) == [3 * 4096]
    del raw
    gc.collect()
    assert registered == {}

    def refused(ptr, size):
        raise RuntimeError("Registering memory failed with cudaError: 2.")

    monkeypatch.setattr(pins, "pin_memory", refused)  # CUDA keeps the error: no fallback, one sentence
    with pytest.raises(UserError, match="could not page-lock .*strategy.streaming.store=disk"):
        buffer(5000, pin=True)


def test_the_answers_after_training_take_every_rank_only_where_the_forward_is_a_collective():
    """Under ZeRO-3 (gathering the weights) and sharded FSDP (every forward) the exact-match answers after training
    are collectives: rank 0 alone would wait for ranks that had ended. Under DDP rank 0 answers alone."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    from onn.training.distributed import forward_is_collective

    def trainer(strategy, world_size):
        return SimpleNamespace(strategy=object.__new__(strategy), world_size=world_size)

    assert forward_is_collective(trainer(FSDPStrategy, 2)) and forward_is_collective(trainer(DeepSpeedStrategy, 8))
    assert not forward_is_collective(trainer(DDPStrategy, 2)) and not forward_is_collective(trainer(FSDPStrategy, 1))


def test_a_gpu_plan_streams_phi4_from_pinned_host_memory_within_the_budget():
    """Planned from an H200's measured profile, Phi-4 at batch 128 on a 4 GB budget streams from host memory
    (which holds the store), int8 codes cast on the device, within the budget with its context, and within the
    seeds' 1.5 GB at micro-batch 128 by computing each block's MLP in slices (whole, it would not be); a host
    too small for the store puts it on the disk with what fits cached in host memory."""
    from onn.hardware.profile import resolve
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec

    cfg = compose("recipe=bench_gpu")
    hw = resolve(dataclasses.replace(cfg.hardware, **H200), "/tmp", "/tmp")
    plan = make_plan(cfg, hw, model_spec(cfg.model, 16), use_tuned=False)
    s = plan.streaming
    assert (s.store, s.store_dtype, s.edges) == ("cpu", "int8", "stream")
    assert plan.predicted_peak_memory_mb + plan.context_mb <= 4096 and plan.context_mb == H200["cuda_context_mb"]
    whole, five = (
        make_plan(compose("recipe=bench_gpu", f"strategy.streaming.mlp_tiles={t}"), hw, model_spec(cfg.model, 16))
        for t in (1, 5)
    )
    assert plan.micro_batch == whole.micro_batch == 128 and (s.mlp_tiles, whole.streaming.mlp_tiles) == (9, 1)
    assert plan.predicted_peak_memory_mb < five.predicted_peak_memory_mb <= 1536 < whole.predicted_peak_memory_mb
    assert s.predicted_step_s <= whole.streaming.predicted_step_s * 1.1  # one more MLP pass, under the copies
    assert s.predicted_h2d_gb > 20 and s.predicted_io_s == pytest.approx(s.predicted_h2d_gb * 1024 / 50_000, rel=0.1)
    nf4 = next(a for a in s.alternatives if a["store_dtype"] == "nf4")  # faster, passed over, and the reason says so
    assert nf4["predicted_step_s"] < s.predicted_step_s and any("nf4 costs precision" in r for r in plan.reasons)
    small_host = dataclasses.replace(
        cfg.hardware, **{**H200, "host_memory_mb": 16_000, "host_memory_available_mb": 12_000}
    )
    small = resolve(small_host, "/tmp", "/tmp")
    s = make_plan(cfg, small, model_spec(cfg.model, 16), use_tuned=False).streaming
    assert s.store == "disk" and 0 < s.cache_blocks < 40


@pytest.mark.slow  # (25 to 35 s on 2 cores: a Phi-3 block's recompute and backward tracked at several slicings)
def test_a_gpu_plan_counts_a_sliced_mlp_as_tracked_down_to_the_backwards_tail():
    """A block's recompute and backward with its gated MLP in slices peaks at a slice (its activations and weights
    cast) until the slices are narrow, then at the backward's tail past them (the recomputed norms' float32 copies
    and gradients), where more slices save nothing. Tracked on a CPU (a Phi-3 block with LoRA on its linears, int8
    codes, norms recomputed, bf16 autocast with peft's input cast off, as the engine runs a block; 64 x 16 tokens), the
    plan's peak falls as the block's does, slice count by slice count and from whole; it counted nine and more of
    Phi-4's slices below what they hold."""
    import types

    from peft.helpers import disable_input_dtype_casting
    from test_streaming import LiveBytes

    from onn.hardware.profile import resolve
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec
    from onn.streaming.quantized import Scratch, linear_forward
    from onn.streaming.recompute_norms import recompute_norms
    from onn.streaming.store import quantize_int8
    from onn.streaming.tiled_mlp import tile_blocks

    sizes = dict(hidden_size=256, intermediate_size=2048, num_attention_heads=4, num_key_value_heads=2)
    model = lora_model("phi3", None, **sizes).to(torch.bfloat16)
    for param in model.parameters():  # float32 adapters beside bf16 weights, as a streamed model's on a GPU
        param.data = param.data.float() if param.requires_grad else param.data
    block, scratch = discover(model).blocks[0], Scratch()
    for m in block.modules():
        if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad:  # an int8 store's codes, as on a GPU
            codes, scale = quantize_int8(m.weight.data)
            m.weight = torch.nn.Parameter(codes, requires_grad=False)
            m._onn_scale, m._onn_scratch = scale.view(-1).to(torch.bfloat16), scratch
            m.forward = types.MethodType(linear_forward, m)
    recompute_norms([block])
    x, position = torch.randn(64, 16, 256, dtype=torch.bfloat16), torch.arange(16)[None]
    rotary = model.base_model.model.model.rotary_emb(x, position)

    def tracked_mb(tiles: int) -> float:
        tile_blocks([block], tiles)
        with torch.autocast("cpu", dtype=torch.bfloat16), disable_input_dtype_casting(block), LiveBytes() as held:
            block(x.clone().requires_grad_(True), position_embeddings=rotary, position_ids=position)[0].sum().backward()
        return held.peak / 2**20

    arch = {**sizes, "num_hidden_layers": 2, "vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    fixed = [f"model.architecture.{k}={v}" for k, v in arch.items()]
    fixed += ["data.batch_size=64", "strategy.micro_batch=64", "strategy.layers=[0,1]"]
    fixed += [f"strategy.streaming.{k}" for k in ("store=cpu", "store_dtype=int8", "chunk_size=1", "edges=stream")]
    hw = resolve(dataclasses.replace(compose("recipe=bench_gpu").hardware, **H200), "/tmp", "/tmp")

    def planned_mb(tiles: int) -> float:
        cfg = compose(
            "recipe=bench_gpu", *fixed, "strategy.streaming.activations=host", f"strategy.streaming.mlp_tiles={tiles}"
        )
        plan = make_plan(cfg, hw, model_spec(cfg.model, 16), use_tuned=False)
        assert (plan.micro_batch, plan.streaming.mlp_tiles) == (64, tiles)
        return plan.predicted_peak_memory_mb

    tracked, planned = {t: tracked_mb(t) for t in (1, 2, 4, 8, 16)}, {t: planned_mb(t) for t in (1, 2, 4, 8, 16)}
    assert tracked[16] == pytest.approx(tracked[8], abs=0.1) and tracked[4] > tracked[8] + 1  # the tail, reached at 8
    assert planned[16] == pytest.approx(planned[8], abs=0.1)
    for tiles in (1, 2, 4):  # whole and wider slices above the tail, planned as tracked (and 5% for the allocator)
        assert planned[tiles] - planned[8] == pytest.approx(tracked[tiles] - tracked[8], rel=0.1)


def test_a_gpu_plan_counts_the_hidden_states_a_streamed_step_passes_along():
    """With the chunk inputs on the host, the hidden states a streamed step passes along stay on the device, one per
    micro-batch each: a chunk's input and output in the forward, the gradients in the backward, the final states and
    their gradients in the suffix (StreamingEngine._forward, forward_train, backward_chunks). At the same
    micro-batch, each micro-batch more holds two hidden states more."""
    from onn.hardware.profile import resolve
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec

    fixed = [f"strategy.streaming.{k}" for k in ("activations=host", "chunk_size=1", "store_dtype=int8", "mlp_tiles=1")]
    fixed.append("strategy.micro_batch=32")
    hw = resolve(dataclasses.replace(compose("recipe=bench_gpu").hardware, **H200), "/tmp", "/tmp")
    peaks = []
    for batch in (64, 128, 256):  # 2, 4 and 8 micro-batches
        cfg = compose("recipe=bench_gpu", *fixed, f"data.batch_size={batch}")
        plan = make_plan(cfg, hw, model_spec(cfg.model, 16), use_tuned=False)
        assert (plan.micro_batch, plan.streaming.edges) == (32, "stream")
        peaks.append(plan.predicted_peak_memory_mb)
    state_mb = 32 * 16 * model_spec(cfg.model, 16).hidden * 2 / 2**20  # a micro-batch's hidden state in bf16
    for more, grown in ((2, peaks[1] - peaks[0]), (4, peaks[2] - peaks[1])):
        assert 2 * more * state_mb <= grown <= 2 * more * state_mb * 1.1  # and the 5% the plan adds for the allocator


@pytest.mark.slow
def test_the_runner_overhead_bench_times_a_resident_model_and_refuses_a_streamed_one(tmp_path):
    """task=bench_overhead (bench_gpu's default-job figure) times ONN's runner against a plain loop on the same
    model. A sparse_lora plan (strategy=auto's choice for a model nothing else fits) streams its blocks from a layer
    store, which the plain loop does not have: refused in one sentence, where its first step crashed."""
    bench = ["model=llama_tiny", "task=bench_overhead", "task.steps=2", "task.warmup=1", "task.repeats=1"]
    run_dir = tmp_path / "resident"
    proc = run_cli(*bench, "tracking=none", f"paths.outputs={tmp_path}", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    m = read_metrics(run_dir)
    assert m["overhead/ratio"] > 0 and len(m["overhead/rounds"]["plain"]) == len(m["overhead/rounds"]["onn"]) == 1
    streamed = tmp_path / "streamed"
    args = ["strategy=sparse_lora", "strategy.lightning=auto", "tracking=none", f"hydra.run.dir={streamed}"]
    proc = run_cli(*bench, *args, f"paths.outputs={tmp_path}")
    assert proc.returncode != 0 and read_metrics(streamed)["status"] == "failed"
    assert "this plan streams sparse_lora" in read_metrics(streamed)["error"]


def test_the_runner_overhead_bench_times_more_steps_than_an_epoch_holds(tmp_path):
    """task=bench_overhead's plain loop runs epoch after epoch, as the Trainer on ONN's side does: on 6 streamed
    rows (an epoch of fewer batches than the warm-up and timed steps) it read one epoch and stopped on an
    IndexError."""
    from onn.app import execute

    rows = tmp_path / "small.jsonl"
    rows.write_text(
        "".join(json.dumps({"input": f"What is {i} plus {i}?", "output": str(2 * i)}) + "\n" for i in range(6))
    )
    cfg = compose(
        "task=bench_overhead",
        "model=llama_tiny",
        "hardware=cpu_16gb",
        "strategy=full",
        "data=text",
        f"data.source={rows}",
        "data.streaming=true",
        "data.val_split=0.2",
        "data.max_length=32",
        "task.steps=2",
        "task.warmup=1",
        "task.repeats=1",
        "tracking=none",
        f"paths.outputs={tmp_path}",
        f"paths.cache={tmp_path / 'cache'}",
    )
    m = execute(cfg, tmp_path / "run")
    assert m["overhead/plain_steps_per_s"] > 0 and m["overhead/onn_steps_per_s"] > 0


# An H200's profile as ONN measured it (bench_gpu's machine, 2026-11-27): the planner's GPU inputs
H200 = dict(
    name="auto", measure=False, accelerator="cuda", device_name="NVIDIA H200", device_count=1, device_memory_mb=143_155,
    host_memory_mb=128_887, host_memory_available_mb=126_346, cpu_cores=16, h2d_mb_s=50_732.0, disk_read_mb_s=1504.8,
    bf16=True, memory_gb_s=4147.4,
    decode_gvalues_s={"int8->bfloat16": 377.57, "int8->float16": 385.78, "int8->float32": 365.27},
    cuda_context_mb=742.0, cuda_workspace_mb=32.0, matmul_tflops=796.8,
    block_call_s={"forward": 0.001244, "full": 0.003494, "lora": 0.005723, "step": 0.003711},
    matmul_gflops={"4096": {"bfloat16": {"1": {"1": 1290.7, "16": 25875.0, "128": 226017.7, "1024": 758948.8,
                                               "8192": 796769.1}}}},
)  # fmt: skip


@gpu
@pytest.mark.gpu
def test_a_streaming_engine_given_cuda_alone_streams_on_the_current_gpu():
    """`device="cuda"` (no index) is the current GPU, named: the loader threads call torch.cuda.set_device with
    it, which refuses a device without an index (the first prefetch failed with a broken thread pool)."""
    model = lora_model("llama", LAYER_SETS["first4+last4"], hidden_size=64, intermediate_size=128)
    engine = StreamingEngine(model, discover(model), LayerStore("cpu", "int8", pin=True), 2, device="cuda")
    assert engine.device == torch.device("cuda", torch.cuda.current_device())
    engine.offload()
    model.to(engine.device)
    mbs = [{k: v.to(engine.device) for k, v in mb.items()} for mb in micro_batches()]
    assert torch.isfinite(engine.train_step(mbs)) and engine.times.loads > 0
    engine.close()


@gpu
@pytest.mark.gpu
def test_a_streamed_step_on_the_gpu_is_the_dequantized_models_step():
    """On the GPU: an int8 store in pinned host memory, its codes copied on a side stream and cast a tile at a
    time, edges streamed (the embedding looked up in host memory), kept activations in host memory, the loss
    one row at a time, each gated MLP in two slices (as the plan has Phi-4's), each norm recomputed in the
    backward: the step's loss and LoRA gradients, and the greedy tokens, are the de-quantized model's."""
    from torch.utils._triton import has_triton

    from onn.hardware.cast import fused_scale

    resident = lora_model("llama", LAYER_SETS["first4+last4"], hidden_size=64, intermediate_size=128)
    streamed = copy.deepcopy(resident)
    store = LayerStore("cpu", "int8", pin=True)
    engine = StreamingEngine(
        streamed,
        discover(streamed),
        store,
        2,
        device="cuda:0",
        stream_edges=True,
        activations="host",
        suffix_rows=1,
        mlp_tiles=2,
    )
    assert engine.recomputed_norms == 2 * len(engine.map)  # on a GPU (on a CPU none: host memory holds them)
    engine.offload()
    streamed.to("cuda:0")
    decoded = {
        **{
            f"{discover(resident).block_paths[i]}.{n}": t
            for i in range(len(engine.map))
            for n, t in store_decoded(engine, i).items()
        },
        **store_decoded(engine, "edges"),
    }
    for name, param in resident.named_parameters():
        if stored_name(name) in decoded:
            param.data = decoded[stored_name(name)]
    resident.to("cuda:0")
    mbs = [{k: v.to("cuda:0") for k, v in mb.items()} for mb in micro_batches()]
    losses = [resident(**mb).loss for mb in mbs]
    (sum(losses) / len(mbs)).backward()
    loss = engine.train_step(mbs)
    torch.testing.assert_close(loss, torch.stack(losses).mean().detach(), rtol=1e-4, atol=1e-5)
    want, got = lora_grads(resident), lora_grads(streamed)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-5, msg=name)
    weights = [p for p in engine.resident_weights() if p.numel() >= 4096]
    assert engine.times.copied_bytes > 0 and weights and all(p.dtype == torch.int8 for p in weights)
    # the casts ran as one fused kernel wherever Triton is installed, and never fell back to two passes
    assert fused_scale(torch.device("cuda")) == has_triton()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], device="cuda:0")
    mask = (ids != 0).long()
    want_ids = resident.eval().generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        min_new_tokens=5,
    )[:, 6:]
    assert torch.equal(engine.generate(ids, mask, max_new_tokens=5), want_ids)
    engine.close()


# Each strategy and the package it needs beyond ONN's own (the GPU machine may lack the optional ones)
STRATEGIES = {
    "full": None,
    "lora": None,
    "qlora": "bitsandbytes",
    "sparse_lora": None,
    "fsdp": None,
    "deepspeed_zero2": "deepspeed",
    "deepspeed_zero3_offload": "deepspeed",
}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_strategy_trains_the_default_job_on_the_gpu_without_a_warning(strategy, tmp_path):
    """The acceptance's own command, `python run.py strategy=S trainer.max_steps=20 trainer.val_check_interval=10`,
    in a fresh interpreter with Python's default warnings: status ok on CUDA, the loss falls, and the console
    holds no warning (FSDP's gradient clipping, NCCL's unended process group, a library's deprecation)."""
    from importlib.util import find_spec

    if STRATEGIES[strategy] and not find_spec(STRATEGIES[strategy]):
        pytest.skip(f"strategy={strategy} needs {STRATEGIES[strategy]}, which is not installed")
    run_dir = tmp_path / strategy
    proc = run_cli(
        f"strategy={strategy}",
        "trainer.max_steps=20",
        "trainer.val_check_interval=10",
        f"paths.outputs={tmp_path}",
        f"hydra.run.dir={run_dir}",
        python_warnings="default",
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]
    m = read_metrics(run_dir)
    plan = yaml.safe_load((run_dir / "plan.yaml").read_text())
    assert m["status"] == "ok" and plan["hardware"]["accelerator"] == "cuda" and plan["requested"] == strategy
    assert m["train/loss_final"] < m["train/loss_initial"]
    # Lightning prints its own warnings as "file.py:LINE: message", without the word
    noisy = [line for line in console.splitlines() if re.search(r"warn|deprecat|\.py:\d+: ", line, re.I)]
    assert not noisy, noisy


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_zero2", "deepspeed_zero3_offload"])
def test_a_run_trained_under_a_sharded_strategy_resumes_from_its_checkpoint(strategy, tmp_path):
    """ckpt= under FSDP or DeepSpeed: ONN's checkpoint folder loads through the strategy (Lightning's readers
    want their own formats: FSDP's refused the folder, DeepSpeed's asked for its per-rank files), and the run
    goes on from the step it was saved at."""
    from importlib.util import find_spec

    if strategy.startswith("deepspeed") and not find_spec("deepspeed"):
        pytest.skip(f"strategy={strategy} needs deepspeed, which is not installed")
    common = [*TINY, f"strategy={strategy}", "trainer.val_check_interval=3", f"paths.outputs={tmp_path}"]
    common += ["optim.warmup_steps=0", "optim.lr=3e-3"]  # the loss falls far in six steps
    proc = run_cli(*common, "trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'first'}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = run_cli(*common, "trainer.max_steps=12", f"ckpt={tmp_path / 'first'}", f"hydra.run.dir={tmp_path / 'on'}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, m = read_metrics(tmp_path / "first"), read_metrics(tmp_path / "on")
    assert m["status"] == "ok" and m["resumed_from"] and m["steps"] == 12
    before, curve = first["train/loss_curve"], m["train/loss_curve"]
    assert curve[:6] == before and before[-1] < before[0] - 0.3
    # the step after the resume goes on from the trained weights (ZeRO's float32 copies refreshed from them, a
    # ZeRO-3 load that matched every weight), not from the initial ones
    assert curve[6] < (before[0] + before[-1]) / 2, curve


@gpu
@pytest.mark.gpu
def test_a_checkpoint_trained_on_the_gpu_evaluates_on_a_cpu_and_says_so(tmp_path):
    """Trained on the GPU; evaluated with CUDA_VISIBLE_DEVICES= (no GPU visible): the plan falls back to the
    CPU and says why, and the checkpoint loads there."""
    run_dir = tmp_path / "train"
    proc = run_cli(*TINY, "trainer.max_steps=10", f"paths.outputs={tmp_path}", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load((run_dir / "plan.yaml").read_text())["hardware"]["accelerator"] == "cuda"
    hidden = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = _run_with_env(
        hidden,
        "task=eval",
        f"ckpt={run_dir}",
        f"paths.outputs={tmp_path}",
        f"hydra.run.dir={tmp_path / 'eval'}",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "CUDA_VISIBLE_DEVICES" in proc.stdout + proc.stderr  # the fallback is said
    plan = yaml.safe_load((tmp_path / "eval" / "plan.yaml").read_text())
    assert plan["hardware"]["accelerator"] == "cpu" and read_metrics(tmp_path / "eval")["status"] == "ok"


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_bench_gpu_without_a_visible_gpu_says_so_before_planning(tmp_path):
    """recipe=bench_gpu with no GPU visible (CUDA_VISIBLE_DEVICES=, on any machine): one sentence saying the task
    measures a CUDA GPU. It was planned for the CPU first, whose plan refused Phi-4's 4 GB budget as too small for
    one streamed block, which sent a user without a GPU after the budget."""
    hidden = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = _run_with_env(hidden, "recipe=bench_gpu", f"paths.outputs={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}")
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "task=bench_gpu measures a CUDA GPU, and this machine has none" in said, said[
        -2000:
    ]
    assert "budget" not in said and not (tmp_path / "run" / "plan.yaml").exists()  # refused before planning


def _run_with_env(env: dict[str, str], *args: str):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args],
        cwd=ROOT,
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


@gpu
@pytest.mark.gpu
def test_running_out_of_gpu_memory_backs_off_or_says_so_in_one_sentence(tmp_path):
    """A micro-batch forced far above what a card of its CUDA context and 460 MB holds (1.2 GB on the H200): the
    step halves it until it fits (the budget is held to for real), or says in one sentence what to change; never
    a CUDA traceback. The budget follows the context the profile measured, which the device's other processes
    (this test's own, holding earlier tests' memory) can inflate where NVML cannot name this process."""
    from onn.hardware.profile import resolve

    config = compose("tracking=none", f"paths.outputs={tmp_path}")
    context = resolve(config.hardware, config.paths.cache, tmp_path).cuda_context_mb
    run_dir = tmp_path / "oom"
    proc = run_cli(
        "model=llama_small",
        "tracking=none",
        "strategy=full",
        "data.batch_size=256",
        "data.max_length=512",
        "strategy.micro_batch=256",
        f"hardware.budget_mb={round(context) + 460}",
        "trainer.max_steps=2",
        "task.validate_before=false",
        "task.exact_match_samples=0",
        f"paths.outputs={tmp_path}",
        f"hydra.run.dir={run_dir}",
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    m = read_metrics(run_dir)
    if m["status"] == "ok":
        assert m["train/oom_backoffs"], "the forced micro-batch fitted: the test no longer runs out of memory"
    else:
        assert "out of" in m["error"] and "\n" not in m["error"]


@gpu
@pytest.mark.gpu
def test_a_budget_below_one_block_names_the_smallest_that_works(tmp_path):
    """Phi-4 under a budget 200 MB above the CUDA context the profile measured (one int8 block and its
    activations need more): one sentence naming the smallest budget that works, above the one given."""
    from onn.hardware.profile import resolve

    config = compose("tracking=none", f"paths.outputs={tmp_path}")
    budget = round(resolve(config.hardware, config.paths.cache, tmp_path).cuda_context_mb) + 200
    proc = run_cli(
        "recipe=phi4_local",
        f"hardware.budget_mb={budget}",
        "task=plan",
        f"paths.outputs={tmp_path}",
        f"hydra.run.dir={tmp_path / 'plan'}",
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    said = re.search(r"the smallest budget that works is about ([\d,]+) MB", proc.stdout + proc.stderr)
    assert said and int(said[1].replace(",", "")) > budget, proc.stdout[-2000:] + proc.stderr[-2000:]


@gpu
@pytest.mark.gpu
def test_a_classifiers_steps_queue_their_work_without_waiting_for_the_gpu(tmp_path):
    """The image runner's training steps (the batch fetched, device augmentation, loss, the step's record, and
    Lightning's own work between batches: its progress-bar figures, the logged loss among them, are read back at
    every batch's end) and a classifier's validation never wait for the GPU, so the host queues the next batch
    while the GPU computes this one: under CUDA's sync debug mode "error" any wait in them (a value read to the
    host, a blocking copy from it, an output sized by its values) raises. Left out: the first step (it makes the
    augmentation's constants), a logging step (it reads the loss), and each epoch's end (the evaluation reads its
    figures)."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from onn.config.data import ColorJitter, ImageAugment, RandomErasing
    from onn.modalities.image.augment import BatchAugment
    from onn.training.callbacks import logs_now
    from onn.training.classifier import Classifier

    torch.manual_seed(0)
    labels = torch.randint(0, 2, (96,), device="cuda")
    images = (torch.randint(0, 128, (96, 3, 16, 16), device="cuda") + 128 * labels[:, None, None, None]).byte()
    batches = [(images[i : i + 32], labels[i : i + 32]) for i in range(0, 96, 32)]
    augment = ImageAugment(
        crop_padding=2, hflip=0.5, color_jitter=ColorJitter(0.1, 0.2, 0.2), random_erasing=RandomErasing()
    )
    network = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 2),
    )
    optim = compose("optim.name=sgd", "optim.lr=0.1", "optim.schedule=constant", "optim.warmup_steps=0").optim
    module = Classifier(network, ["dark", "bright"], optim, {}, transform=BatchAugment(augment, [0.5] * 3, [0.25] * 3))
    checked = []

    class Strict(L.Callback):
        """From a training batch's start to the next's (or to the evaluation), unless the batch logs."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            torch.cuda.set_sync_debug_mode(0)
            if trainer.global_step > 0 and not logs_now(pl_module):
                checked.append(True)
                torch.cuda.set_sync_debug_mode("error")

        def on_validation_start(self, trainer, pl_module):
            torch.cuda.set_sync_debug_mode(0)

        def on_train_end(self, trainer, pl_module):
            torch.cuda.set_sync_debug_mode(0)

        def on_exception(self, trainer, pl_module, exception):
            torch.cuda.set_sync_debug_mode(0)

    def strict(step):
        def run(batch, batch_idx):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return step(batch, batch_idx)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                checked.append(False)

        return run

    module.validation_step = strict(module.validation_step)
    trainer = L.Trainer(
        callbacks=[Strict()],
        accelerator="cuda",
        devices=1,
        max_steps=12,
        num_sanity_val_steps=0,
        log_every_n_steps=5,
        logger=CSVLogger(tmp_path),  # a reader: the loss is logged at steps 0, 4 and 9
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        precision="bf16-mixed",
    )
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    assert checked.count(True) == 9 and checked.count(False) == 3 * 4  # each epoch's validation (3 batches)
    assert module.history[-1]["val/loss"] < module.history[0]["val/loss"]


@gpu
@pytest.mark.gpu
def test_graph_and_text_batches_go_to_the_gpu_without_waiting_for_it(tmp_path):
    """A blocking copy to the GPU waits for every kernel queued before it, and a copy from pageable memory can
    (the driver stages it). A graph batch (torch_geometric's Batch, which Lightning moves by the Batch's own
    blocking `to`) goes from pinned memory without waiting: under CUDA's sync debug mode "error", a wait raises;
    a node-level graph is on the device from the start and is not copied.
    A text run's loaders, resident or streamed, give pinned batches on a GPU (Lightning copies a batch's tensors
    non-blocking); a layer-streamed model's held-out batches, which stay on the host, are not pinned."""
    import lightning as L

    from onn.modalities.graph.dataset import GraphDataModule
    from onn.modalities.text.datamodule import TextDataModule
    from onn.models.tokenizer import byte_tokenizer

    device = torch.device("cuda", 0)
    graphs = GraphDataModule(compose("data=graph", "data.source=builtin:primitives").data, str(device))
    graphs.setup()
    batch = next(iter(graphs.train_dataloader()))
    edges, want_labels = batch[0].edge_index.clone(), batch[1].clone()  # torch_geometric's `to` moves in place
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        busy = torch.tanh(busy @ busy)  # the GPU has work queued when the batch goes
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved, labels = graphs.transfer_batch_to_device(batch, device, 0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert moved.x.device == device and labels.device == device
    assert torch.equal(moved.edge_index.cpu(), edges) and torch.equal(labels.cpu(), want_labels)
    nodes = compose("data=graph", "data.source=builtin:communities", "data.level=node").data
    nodes = GraphDataModule(nodes, str(device))
    nodes.setup()
    graph, labels = next(iter(nodes.train_dataloader()))  # collated once, on the device since setup
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved, moved_labels = nodes.transfer_batch_to_device((graph, labels), device, 0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert moved.x is graph.x and moved_labels is labels and graph.x.device == device

    class Streamed(L.LightningModule):  # the text module as the loaders read it: layer-streamed or not
        def __init__(self, engine):
            super().__init__()
            self.engine = engine

    source = tmp_path / "qa.jsonl"
    source.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(64)))
    resident = TextDataModule(compose("data=math").data, byte_tokenizer(), 4)
    streamed = compose("data=text", f"data.source={source}", "data.streaming=true").data
    streamed = TextDataModule(streamed, byte_tokenizer(), 4)
    for text in (resident, streamed):
        text.setup()
        for accelerator, engine, pinned in (
            ("cuda", None, (True, True)),
            ("cuda", 1, (True, False)),
            ("cpu", None, (False, False)),
        ):
            text.trainer = L.Trainer(accelerator=accelerator, devices=1, logger=False)
            text.trainer.strategy.connect(Streamed(engine))
            for loader, pins in zip((text.train_dataloader(), text.val_dataloader()), pinned):
                assert all(t.is_pinned() == pins for t in next(iter(loader)).values())


def test_a_model_a_gpu_run_leaves_in_bf16_exports_to_onnx_in_float32(tmp_path):
    """After a run on a GPU, the model ONNX is to trace can be in bf16 (a streamed model's blocks merge in the
    compute dtype) beside float32 edges, and is left on the device: export traces a float32 copy on the CPU
    (bf16 blocks beside float32 edges failed the reference forward, and onnxruntime's CPU provider has no bf16
    matmul), and its outputs are the float32 model's."""
    from test_export_onnx import build

    from onn.export.onnx_export import run_onnx, sample_inputs
    from onn.export.write import export_model

    model = build("llama")
    want_model = copy.deepcopy(model)
    model.model.layers.to(torch.bfloat16)  # as merged_model leaves a streamed run's blocks
    want_model.model.layers.to(torch.bfloat16).float()  # the same weights, rounded through bf16
    sample = sample_inputs(model, 2, 8)
    export_model(model, tmp_path / "model.onnx", sample, compose("export=onnx").export)
    got = run_onnx(tmp_path / "model.onnx", {k: v.numpy() for k, v in sample.items()})
    with torch.no_grad():
        want = want_model(**sample, use_cache=False).logits
    torch.testing.assert_close(torch.from_numpy(got["logits"]), want, rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.gpu
def test_a_run_in_a_process_that_runs_more_leaves_the_gpu_as_it_found_it(tmp_path):
    """A sweep's jobs (Hydra's basic launcher, optuna) and a notebook's runs share one process: a run under
    hardware.budget_mb caps PyTorch's allocator for the whole process, and memory its allocator keeps cached
    reads as used to the next run's profile. After each run the cap is lifted and the cache given back."""
    from onn.app import execute

    torch.cuda.empty_cache()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()  # free parts of segments in use
    held = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    del held  # 512 MB the allocator keeps cached, until a run gives it back
    config = compose(*TINY, "trainer.max_steps=2", "hardware.budget_mb=4096", f"paths.outputs={tmp_path}")
    assert execute(config, tmp_path / "capped")["train/loss_final"] > 0
    assert torch.cuda.get_per_process_memory_fraction() == 1.0
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() <= cached + 64 * 2**20  # pages, not a cache


@gpu
@pytest.mark.gpu
def test_a_large_graph_pools_and_a_recurrence_runs_in_float32_under_bf16_autocast():
    """bf16-mixed on a GPU: a graph of 2,000 nodes pools to the float32 mean of its nodes' features (the mean's
    node count, summed in bf16 by the GPU's atomic adds, stopped at 256), and a recurrent layer whose weights are
    float32 recurs in float32 (autocast sends cuDNN's RNNs to float16, and bf16-mixed scales no loss)."""
    from onn.modalities.graph.network import GraphNetwork
    from onn.models.zoo.recurrent import RecurrentLayer

    torch.manual_seed(0)
    network = GraphNetwork(4, 2, conv="gin", hidden=8, layers=1, pooling=["mean"], dropout=0.0).cuda().eval()
    no_edges = torch.zeros(2, 0, dtype=torch.long, device="cuda")
    seen = []
    network.head.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    x = torch.randn(2000, 4, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        network(x, no_edges, torch.zeros(2000, dtype=torch.long, device="cuda"))
        nodes = network.blocks[0](x, no_edges)
    torch.testing.assert_close(seen[0], nodes.float().mean(0, keepdim=True), rtol=1e-3, atol=1e-3)
    layer = RecurrentLayer(8, 8, "lstm", bidirectional=True, dropout=0.0).cuda()
    lengths = torch.tensor([50, 30], device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(torch.randn(2, 50, 8, device="cuda"), lengths)
    assert out.dtype == torch.float32


def _device_event(name: str, start_us: float, end_us: float, annotation: bool = False):
    """One GPU activity as torch.profiler's events() gives it."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    return FunctionEvent(
        id=0,
        name=name,
        thread=7,
        start_us=start_us,
        end_us=end_us,
        device_type=DeviceType.CUDA,
        device_resource_id=7,
        is_user_annotation=annotation,
    )


def test_a_profiled_steps_copies_count_as_hidden_only_where_kernels_ran_beside_them():
    """The GPU's own timeline, not the host's: copies across the host link on one stream, kernels on another,
    overlapping in part; a gap where neither ran; CPU events and a user annotation spanning everything (which is
    no work) left out. Copies within the device count as compute."""
    from torch.autograd.profiler_util import FunctionEvent

    from onn.bench.timeline import gpu_timeline

    events = [
        FunctionEvent(id=1, name="aten::mm", thread=1, start_us=0, end_us=500),  # the host's: not the GPU's
        _device_event("Memcpy HtoD (Pinned -> Device)", 0, 400),
        _device_event("Memcpy HtoD (Pinned -> Device)", 300, 600),  # a second copy engine: 0..600 busy, once
        _device_event("ampere_bf16_gemm", 100, 300),
        _device_event("Memcpy DtoD (Device -> Device)", 250, 350),  # within the device: compute
        _device_event("vectorized_elementwise_kernel", 700, 1000),  # after a gap 600..700
        _device_event("Memcpy DtoH (Device -> Pinned)", 900, 1100),  # activations to the host
        _device_event("ProfilerStep#3", 0, 1100, annotation=True),
    ]
    t = gpu_timeline(events)
    assert t["io_s"] == pytest.approx(800e-6)  # 0..600 and 900..1100
    assert t["compute_s"] == pytest.approx(550e-6)  # 100..350 and 700..1000
    assert t["overlap_s"] == pytest.approx(350e-6)  # 100..350 and 900..1000
    assert t["idle_s"] == pytest.approx(100e-6) and t["span_s"] == pytest.approx(1100e-6)
    assert t["copies_hidden"] == pytest.approx(350 / 800)
    assert gpu_timeline(events[:1]) == {}  # no GPU activity: nothing measured


@gpu
@pytest.mark.gpu
def test_a_copy_on_a_side_stream_beside_kernels_is_measured_as_hidden():
    """On the GPU: a pinned host-to-device copy queued on a side stream while matmuls run on the current one is
    seen by the profiler as overlapping them, and the same copy run alone as not hidden."""
    from onn.bench.timeline import gpu_timeline

    host = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)  # every CUDA GPU's: a Turing card has no bf16
    side = torch.cuda.Stream()
    torch.cuda.synchronize()

    def profiled(beside: bool) -> dict[str, float]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            if beside:
                for _ in range(40):
                    a @ a
            with torch.cuda.stream(side):
                device.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
        return gpu_timeline(prof.events())

    profiled(True)  # cuBLAS's first call
    together, alone = profiled(True), profiled(False)
    assert together["io_s"] > 0 and together["compute_s"] > 0 and together["copies_hidden"] > 0.5
    assert alone["compute_s"] == 0 and alone["copies_hidden"] == 0 and alone["io_s"] > 0
