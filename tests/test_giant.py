"""A model larger than RAM, on tiny models: streamed validation equals resident validation and reads the
store once, the block cache and O_DIRECT reads change no number, a killed build resumes and never uses
a half-written block, and the plan is honest about budgets, disk space and busy cores."""

from __future__ import annotations

import copy
import dataclasses
import math
import re

import lightning as L
import pytest
import torch
from conftest import compose, read_metrics, run_cli
from test_streaming import ARCH, LAYER_SETS, lora_grads, lora_model, micro_batches

from onn.errors import UserError
from onn.models.layers import discover
from onn.streaming.engine import StreamingEngine
from onn.streaming.store import LayerStore

OPTIM = compose("optim.lr=1e-3", "optim.schedule=constant", "optim.warmup_steps=0").optim


def held_out(batches: int = 4, rows: int = 3, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    """Right-padded batches of different widths, as the data module makes them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(batches):
        width = 6 + 2 * b
        ids = torch.randint(3, 97, (rows, width), generator=g)
        mask = torch.ones_like(ids)
        mask[0, width - 3 :] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, : width // 2] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def validate(model, batches, strategy=None):
    from onn.modalities.text.module import CausalLM

    module = CausalLM(model, OPTIM, max_steps=1, onn_config={}, micro_batch=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        strategy=strategy or "auto",
    )
    trainer.validate(module, dataloaders=torch.utils.data.DataLoader(batches, batch_size=None), verbose=False)
    return module


@pytest.mark.parametrize("eval_tokens", [10_000, 20])
def test_streamed_validation_matches_resident_and_loads_each_chunk_once_per_pass(tmp_path, eval_tokens):
    from onn.streaming.strategy import EngineSettings, LayerStreamingStrategy

    resident = lora_model("phi3", LAYER_SETS["last4"])
    streamed = copy.deepcopy(resident)
    batches = held_out()
    want = validate(resident, batches).val_losses[-1]
    settings = EngineSettings(
        chunk_size=3,
        store="disk",
        store_dtype="float32",
        edges="resident",
        activations="device",
        prefetch=True,
        cache_blocks=0,
        eval_tokens=eval_tokens,
    )
    module = validate(streamed, batches, LayerStreamingStrategy(settings, tmp_path, 2))
    assert module.val_losses[-1] == pytest.approx(want, rel=1e-5)
    engine = module.engine
    store_bytes = sum(engine.store.file_bytes(i) for i in range(8))
    ahead = sum(
        engine.store.file_bytes(i) for i in engine.chunks[0]
    )  # the next pass's first chunk, read behind the last
    if eval_tokens > 1000:  # the whole held-out set in one pass: each chunk loaded once, the store read once
        assert engine.times.loads == len(engine.chunks) == 3
        assert engine.times.read_bytes == store_bytes + ahead
    else:  # passes of at most 20 tokens: the store streams once per pass, and the loss is the same
        passes = engine.times.loads / len(engine.chunks)
        assert passes > 1 and passes == int(passes) and engine.times.read_bytes == passes * store_bytes + ahead


def _settled_reads(engine) -> int:
    """The bytes read once the loads started ahead of the next step are done: counted as they finish, in the
    loader's threads, they made a step's reads depend on how far those loads had got (one CI run: 2 blocks, not 3)."""
    for future, _ in engine._pending.values():
        future.result()
    return engine.times.read_bytes


def test_block_cache_and_direct_reads_change_no_number(tmp_path):
    base = lora_model("llama", LAYER_SETS["first4+last4"])
    results, reads = [], []
    for cache in (0, 3):
        model = copy.deepcopy(base)
        store = LayerStore("disk", "float32", folder=tmp_path / f"cache{cache}")
        engine = StreamingEngine(model, discover(model), store, 2, cache_blocks=cache)
        engine.offload()
        for step in range(2):
            model.zero_grad(set_to_none=True)
            before = _settled_reads(engine)
            loss = engine.train_step(micro_batches(seed=step))
        reads.append(_settled_reads(engine) - before)
        results.append((loss, lora_grads(model)))
        # spread among the blocks read twice a step (the lowest trainable chunk's first block and on)
        assert sorted(engine._cached) == [[], [1, 4, 6]][cache > 0]  # read once, then served from memory
        engine.close()
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(results[0][1][n], results[1][1][n]) for n in results[0][1])
    block = store.file_bytes(0)
    saved = reads[0] - reads[1]  # the cached blocks are read in neither direction any more
    assert saved >= 3 * block and saved % block == 0

    from onn.hardware.disk import buffer

    into = buffer(store.file_bytes(5))
    tensors = store.read(5, into=into)
    start, end = into.data_ptr(), into.data_ptr() + into.numel()
    assert all(start <= t.data_ptr() < end for t in tensors.values())  # views of the caller's buffer: no copy


def test_cached_blocks_spread_first_over_the_blocks_read_twice():
    from onn.streaming.schedule import cached_blocks

    assert cached_blocks(40, 0) == []
    assert cached_blocks(40, 4) == [5, 15, 25, 35]  # the loader reads between them while they compute
    assert cached_blocks(10, 3, first_twice=6) == [6, 8, 9]  # blocks 0-5 are only read forward
    assert cached_blocks(10, 6, first_twice=6) == [1, 4, 6, 7, 8, 9]
    assert cached_blocks(10, 12) == list(range(10))


def test_killed_build_resumes_and_never_uses_a_half_written_block(tmp_path, monkeypatch):
    from onn.streaming.loader import load_into_store

    arch = {"model_type": "phi3", **ARCH["phi3"], "vocab_size": 259}  # llama_tiny's byte tokenizer: ids to 258
    source = compose("model=llama_tiny").model
    source = dataclasses.replace(source, name="t", architecture=arch)
    clean = LayerStore("disk", "float32", folder=tmp_path / "clean")
    model, _ = load_into_store(source, torch.float32, None, clean)
    want = StreamingEngine(model, discover(model), clean, 3)
    want.offload()
    want_losses = want.loss(micro_batches())

    store = LayerStore("disk", "float32", folder=tmp_path / "killed")
    write = store.write

    def killed_at_block_3(i, tensors):
        if i == 3:  # the process dies half-way through writing block 3
            path = store.block_file(3).with_suffix(".tmp")
            path.write_bytes(b"\0" * 1000)
            raise KeyboardInterrupt
        write(i, tensors)

    monkeypatch.setattr(store, "write", killed_at_block_3)
    with pytest.raises(KeyboardInterrupt):
        load_into_store(source, torch.float32, None, store)
    monkeypatch.undo()
    # another kill: block 5's file renamed into place but its marker never written
    store.block_file(5).write_bytes(b"\0" * 64)
    again = LayerStore("disk", "float32", folder=tmp_path / "killed")
    model, _ = load_into_store(source, torch.float32, None, again)
    assert again.rebuilt == [3, 4, 5, 6, 7] and not list((tmp_path / "killed").glob("*.tmp"))
    engine = StreamingEngine(model, discover(model), again, 3)
    engine.offload()
    torch.testing.assert_close(torch.stack(engine.loss(micro_batches())), torch.stack(want_losses), rtol=0, atol=0)


def plan(*overrides, tmp_path, **hw_changes):
    from onn.hardware.profile import resolve
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec

    cfg = compose(*overrides, root=tmp_path)
    hw = dataclasses.replace(resolve(cfg.hardware, tmp_path, tmp_path), **hw_changes)
    return make_plan(cfg, hw, model_spec(cfg.model, 8), use_tuned=False)


def test_plan_never_fits_over_budget_and_names_the_smallest_budget(tmp_path):
    from onn.hardware.profile import Profile
    from onn.planning.costs import budget_mb

    refused, planned = {}, {}
    for budget in (3_000, 6_000, 9_000, 14_000, 40_000):
        try:
            p = plan(
                "model=phi4",
                "hardware=cpu_16gb",
                "strategy=sparse_lora",
                f"hardware.budget_mb={budget}",
                "hardware.host_memory_mb=65536",
                tmp_path=tmp_path,
            )
        except UserError as e:
            assert "\n" not in str(e) and str(e).startswith(f"hardware cpu_16gb: a budget of {budget:,} MB")
            refused[budget] = float(
                str(e).split("the smallest budget that works is about ")[1].split(" MB")[0].replace(",", "")
            )
            continue
        assert (
            p.budget_mb
            == budget_mb(Profile(name="cpu", accelerator="cpu", host_memory_mb=65536, budget_mb=budget))
            == budget
        )
        for name, c in p.candidates.items():
            if c["fits"]:
                assert c["peak_mb"] + c["context_mb"] <= budget, name
        assert p.predicted_peak_memory_mb + p.context_mb <= budget
        planned[budget] = p
    assert 3_000 in refused and 40_000 in planned
    smallest = max(refused.values())
    assert all(b < smallest for b in refused) and all(b >= smallest for b in planned)
    p = plan(
        "model=phi4",
        "hardware=cpu_16gb",
        "strategy=sparse_lora",
        f"hardware.budget_mb={math.ceil(smallest)}",
        tmp_path=tmp_path,
    )
    assert p.candidates["sparse_lora"]["fits"]  # the budget the message named works


def test_plan_refuses_a_store_the_disk_cannot_hold(tmp_path):
    with pytest.raises(
        UserError,
        match=r"not enough disk for the layer store: phi4 as \w+ needs [\d.,]+ GB more under .* has 3.9 GB free",
    ):
        plan("model=phi4", "hardware=cpu_16gb", "strategy=sparse_lora", tmp_path=tmp_path, disk_free_mb=4000)
    # the disk holds int8 but not bf16: the plan takes what fits, before anything is written
    p = plan("model=phi4", "hardware=cpu_16gb", "strategy=sparse_lora", tmp_path=tmp_path, disk_free_mb=20_000)
    assert p.streaming.store_dtype == "int8" and not (tmp_path / "outputs" / ".cache" / "stores").exists()


def test_a_disk_refusal_shows_the_shortfall_and_suggests_only_a_smaller_store(tmp_path):
    """A disk 2.001 GB free against a store of some MB and the 2 GB reserve was refused with "needs 0.0 GB more ...
    and 2 GB must stay free, but the disk has 2.0 GB free" (figures that fit) and advice of a smaller store dtype
    below nf4, the smallest. The figures now add up to a shortfall; a smaller dtype is named only where one exists."""
    free = 2.001 * 1024  # MB
    with pytest.raises(UserError) as refused:
        plan(
            "model=phi4_tiny",
            "strategy=sparse_lora",
            "strategy.streaming.store=disk",
            tmp_path=tmp_path,
            disk_free_mb=free,
        )
    message = str(refused.value)
    figures = (
        r"phi4_tiny as nf4 needs [\d.]+ MB more under .*, and 2\.0 GB must stay free for others: 2\.0 GB in all, but "
        r"the disk has 2\.0 GB free \([\d.]+ [KM]B short\); set paths\.cache \(or ONN_CACHE\) to a disk with room\.$"
    )
    assert re.search(figures, message), message
    assert "store_dtype" not in message
    with pytest.raises(UserError, match=r"or a smaller strategy\.streaming\.store_dtype \(bfloat16, int8, nf4\)\.$"):
        plan("model=phi4_tiny", "strategy=sparse_lora", "strategy.streaming.store=disk",
             "strategy.streaming.store_dtype=float32", tmp_path=tmp_path, disk_free_mb=free)  # fmt: skip


def test_threads_follow_the_free_cores_and_the_plan_says_so(tmp_path):
    from onn.hardware.profile import Profile
    from onn.planning.costs import threads_for

    assert threads_for(Profile(name="cpu", accelerator="cpu", cpu_cores=2, cpu_busy_cores=0.1, cpu_share=1.0)) == (
        2,
        1.0,
    )  # quiet: the profile writes a share of 1 (a share timed on quiet cores is noise)
    assert threads_for(Profile(name="cpu", accelerator="cpu", cpu_cores=2, cpu_busy_cores=0.0, cpu_share=0.75)) == (
        2,
        0.75,
    )  # quiet cores under a CPU quota (--cpus=1.5): the profile's quota share
    assert threads_for(Profile(name="cpu", accelerator="cpu", cpu_cores=2, cpu_busy_cores=1.0, cpu_share=1.0)) == (
        1,
        1.0,
    )
    assert threads_for(Profile(name="cpu", accelerator="cpu", cpu_cores=2, cpu_busy_cores=2.0, cpu_share=0.5)) == (
        1,
        0.5,
    )
    assert threads_for(Profile(name="cpu", accelerator="cpu", cpu_cores=8, cpu_busy_cores=0.0, thread_limit=1)) == (
        1,
        1.0,
    )
    quiet = plan("model=llama_tiny", "hardware=cpu_16gb", "strategy=lora", tmp_path=tmp_path)
    busy = plan(
        "model=llama_tiny", "hardware=cpu_16gb", "strategy=lora", tmp_path=tmp_path, cpu_busy_cores=8.0, cpu_share=0.5
    )
    assert quiet.threads == 8 and busy.threads == 1
    assert any("cores busy: other processes use 8.0 of 8 cores" in r for r in busy.reasons)
    assert busy.predicted_step_s > quiet.predicted_step_s


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_settings_and_data_are_checked_before_the_store_is_built(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "1+1", "output": "2"}\nnot json\n')
    outputs = tmp_path / "outputs"
    for args, message in [
        (["data=text", f"data.source={bad}"], f"{bad} line 2 is not valid JSON"),
        (["model.tokenizer=null"], "has no tokenizer"),
    ]:
        proc = run_cli(
            "model=phi4_tiny",
            "strategy=sparse_lora",
            "strategy.streaming.store=disk",
            "tracking=none",
            f"paths.outputs={outputs}",
            *args,
        )
        assert proc.returncode == 1 and message in proc.stdout + proc.stderr, proc.stderr[-2000:]
        assert not (outputs / ".cache" / "stores").exists()  # nothing was written


@pytest.mark.slow
def test_bench_giant_on_a_tiny_model(tmp_path):
    outputs = tmp_path / "outputs"
    proc = run_cli(
        "recipe=bench_giant",
        "model=llama_tiny",
        "hardware.budget_mb=4000",
        "strategy.streaming.cache_blocks=2",
        "strategy.streaming.chunk_size=2",
        "task.disk_probe_mb=16",
        "task.kill_build_after=3",
        "task.steps=4",
        "task.kill_after=2",
        "task.gen_tokens=3",
        "data.builtin.val_size=20",
        f"paths.outputs={outputs}",
        f"hydra.run.dir={outputs / 'giant'}",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = read_metrics(outputs / "giant")
    assert (
        m["giant/build_killed_after_blocks"] >= 3
        and m["giant/build_resumed_blocks"] == 8 - m["giant/build_killed_after_blocks"]
    )
    assert m["giant/train_killed"] and m["giant/resumed_at_step"] == m["giant/killed_after_step"] >= 2
    assert m["giant/steps"] == 4 and m["giant/loss_last"] < m["giant/loss_first"]
    assert m["giant/val_samples"] == 20 and m["giant/val_read_gb"] <= 2 * m["giant/step_read_gb"]
    assert m["giant/accelerate_same_tokens"]  # the same model, read from the same files: the same greedy tokens
    for key in (
        "giant/limit_s",
        "giant/limit_efficiency",
        "giant/gen_s_per_token_b1",
        "giant/gen_s_per_token_b8",
        "giant/vs_accelerate",
        "giant/predicted_peak_mb",
        "giant/predicted_step_s",
        "giant/build_peak_rss_mb",
        "giant/matmul_gflops_steps",
    ):
        assert isinstance(m[key], float | int) and m[key] > 0, key
    assert "| limit_efficiency |" in (outputs / "giant" / "bench_giant.md").read_text()


SMOLLM = __import__("pathlib").Path.home() / ".cache/onn/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM.exists(), reason="SmolLM2 GGUF not fetched (../shared/scripts/fetch-smollm2.sh)")
def test_a_gguf_file_loads_block_by_block_into_the_store(tmp_path):
    """A GGUF larger than RAM must not be de-quantized whole: its tensors go to the store one block at a
    time, through transformers' name mapping and fix-ups (Llama's q/k permutation), and compute what
    transformers' own GGUF loading computes (which also loads it whole, with all its parameters, and generates)."""
    from onn.models.load import load
    from onn.streaming.loader import load_into_store

    source = compose("model=smollm2_135m", f"model.source={SMOLLM}").model
    store = LayerStore("disk", "float32", folder=tmp_path / "store")
    model, tokenizer = load_into_store(source, torch.float32, tmp_path, store)
    assert store.rebuilt == list(range(30)) and not (tmp_path / "gguf").exists()  # nothing converted whole
    engine = StreamingEngine(model, discover(model), store, 10)
    engine.offload()
    full, _ = load(source, dtype=torch.float32, cache_dir=None)  # transformers' own GGUF loading, whole
    assert sum(p.numel() for p in full.parameters()) == 134_515_008 and len(discover(full)) == 30
    ids = tokenizer("What is 2 + 2?", return_tensors="pt")
    out = full.generate(**ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 3
    batch = {
        "input_ids": ids["input_ids"],
        "attention_mask": ids["attention_mask"],
        "labels": ids["input_ids"],
    }
    with torch.no_grad():
        want = full(**batch).loss
    torch.testing.assert_close(engine.loss([batch])[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_large_models_time_copies_of_one_and_two_of_their_own_blocks(tmp_path):
    """A copy of one block is no run of blocks to discover: its layer map must come from the whole model
    (once, a one-block copy streamed an MLP's linears as if they were blocks and crashed)."""
    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.modalities.text.calibrate import block_times

    # blocks wide enough that one block's work, not the timer's noise, sets the difference of the two copies
    # (at llama_tiny's width of 64 a block took microseconds, and once the adapted block timed at 0)
    wide = ("model.architecture.hidden_size=256", "model.architecture.intermediate_size=704")
    cfg = compose("model=llama_tiny", *wide, "strategy=sparse_lora", f"paths.cache={tmp_path}", root=tmp_path)
    hw = resolve(cfg.hardware, tmp_path, tmp_path)
    planned, _ = get("text").plan(cfg, hw)
    costs = block_times(cfg, planned, hw, 64, 2, 1, large=True)
    assert set(costs) == {"lora", "frozen", "below", "rest"} and costs["lora"] > 0


def test_one_stalled_step_does_not_set_a_small_models_block_time(tmp_path, monkeypatch):
    """A small model's copies take nine timed steps each, and the plan reads a typical one: their mean once put a
    grid's llama_small sparse-LoRA plan at 189.5 ms a block (five times its run's), as one stalled step would. Here
    each copy's step is CPU work of 2 ms a block (the one-thread timing reads CPU time) and the 6-block copy's
    fifth timed step stalls for twenty steps' work."""
    import time

    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.modalities.text import calibrate

    cfg = compose("model=llama_tiny", f"paths.cache={tmp_path}", root=tmp_path)
    hw = resolve(cfg.hardware, tmp_path, tmp_path)
    planned, _ = get("text").plan(cfg, hw)
    # these timings are made up: cached beside this test, never where the session's runs read theirs
    cfg = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, cache=str(tmp_path)))

    def copy_step(config, plan, seq, micro, blocks, adapted, vocab, engines):
        calls = []

        def step() -> None:
            calls.append(None)
            work = 0.002 * blocks * (20 if blocks == 6 and len(calls) == 6 else 1)  # the first call is untimed
            end = time.process_time() + work
            while time.process_time() < end:
                pass

        return step

    monkeypatch.setattr(calibrate, "_copy_step", copy_step)
    costs = calibrate.block_times(cfg, planned, hw, 16, 2, 1)
    assert planned.strategy == "full" and set(costs) == {"block", "rest"}
    assert costs["block"] == pytest.approx(0.002, rel=0.25)


def test_streamed_copies_compute_a_chunk_at_a_time_as_the_plan_does(tmp_path):
    """The step-time copies run the plan's chunks: streamed a block at a time, each block paid a chunk boundary's
    work that the run shares over its chunk, and phi4_tiny's sparse-LoRA runs went 12-27% under the plan."""
    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.modalities.text.calibrate import _copy_step

    cfg = compose("model=llama_tiny", "strategy=sparse_lora", f"paths.cache={tmp_path}", root=tmp_path)
    planned, _ = get("text").plan(cfg, resolve(cfg.hardware, tmp_path, tmp_path))
    planned.streaming.chunk_size = 4
    engines: list[StreamingEngine] = []
    for blocks in (2, 6):
        _copy_step(cfg, planned, 16, 2, blocks, list(range(blocks)), None, engines)()  # one training step runs
    assert [e.chunks for e in engines] == [[[0, 1]], [[0, 1, 2, 3], [4, 5]]]


def test_streamed_copies_hold_the_runs_weights_and_compute_dtype(tmp_path):
    """Under bf16-mixed a model whose model.dtype is float32 (llama_small's) trains float32 weights outside the
    blocks, the blocks computing in bf16 from the store. The copies timed for the plan loaded every weight in bf16:
    llama_small's sparse-LoRA runs took 6-42% more than the plan on this CPU."""
    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.modalities.text.calibrate import _copy_step

    cfg = compose("model=llama_tiny", "strategy=sparse_lora", f"paths.cache={tmp_path}", root=tmp_path)
    planned, _ = get("text").plan(cfg, resolve(cfg.hardware, tmp_path, tmp_path))
    planned.precision, planned.weights_dtype = "bf16-mixed", "bfloat16"  # as a CPU with fast bf16 plans it
    planned.streaming.store_dtype, planned.streaming.compute_dtype = "bfloat16", "bfloat16"
    engines: list[StreamingEngine] = []
    _copy_step(cfg, planned, 16, 2, 2, [0, 1], None, engines)()
    engine = engines[0]
    assert cfg.model.dtype == "float32" and engine.compute_dtype == torch.bfloat16
    assert engine.model.get_output_embeddings().weight.dtype == torch.float32
    # sparse_lora placed by a Lightning strategy of its own (ddp), which does not stream it, is timed too
    resident = compose("model=llama_tiny", "strategy=sparse_lora", "strategy.lightning=ddp", root=tmp_path)
    _copy_step(resident, planned, 16, 2, 2, [0, 1], None, engines)()
    assert engines[1].compute_dtype == torch.bfloat16


def test_strategy_auto_streams_the_sparse_lora_it_chooses(tmp_path):
    """strategy=auto chooses sparse_lora for a model LoRA cannot fit, and the plan sizes it streamed: the run streams
    it (it trained resident: smollm2_135m on a 900 MB budget peaked at 1,930 MB against the plan's 899). A Lightning
    strategy named in the config (ddp) still places the model itself, and the plan sizes it resident."""
    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.modalities.text.tasks import build, streaming_settings

    cfg = compose("model=llama_tiny", "strategy=sparse_lora", f"paths.cache={tmp_path}", root=tmp_path)
    planned, _ = get("text").plan(cfg, resolve(cfg.hardware, tmp_path, tmp_path))
    auto = compose("model=llama_tiny", "strategy=auto", f"paths.cache={tmp_path}", root=tmp_path)
    settings = streaming_settings(auto, planned)
    assert auto.strategy.streaming is None and settings is not None
    assert build(auto, planned)[0].store is not None  # the run loads the blocks into a layer store
    assert (settings.chunk_size, settings.store_dtype) == (planned.streaming.chunk_size, planned.streaming.store_dtype)
    ddp = compose("model=llama_tiny", "strategy=sparse_lora", "strategy.lightning=ddp", root=tmp_path)
    resident, _ = get("text").plan(ddp, resolve(ddp.hardware, tmp_path, tmp_path))
    assert resident.streaming is None and streaming_settings(ddp, resident) is None


def test_resident_sparse_lora_is_timed_by_where_its_adapters_are_and_streaming_benches_refuse_it(tmp_path):
    """sparse_lora under ddp trains resident with adapters on strategy.layers only: its blocks are timed as blocks
    with adapters, without them above the lowest adapted block and below it. Timed with adapters on every block,
    llama_small's run with strategy.layers=[-1] took 57% less than the plan. The streaming benches refuse it."""
    from onn.bench.giant import check_settings as check_giant
    from onn.bench.gpu import check_settings as check_gpu
    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.modalities.text.calibrate import block_times

    ddp = compose("model=llama_tiny", "strategy=sparse_lora", "strategy.lightning=ddp", f"paths.cache={tmp_path}")
    hw = resolve(ddp.hardware, tmp_path, tmp_path)
    plan, _ = get("text").plan(ddp, hw)
    costs = block_times(ddp, plan, hw, 16, 2, 1, window_s=0.2)
    assert plan.streaming is None and {"lora", "frozen", "below", "rest"} <= set(costs)
    assert 0 < costs["below"] < costs["lora"]  # forward only, against forward and backward with adapters
    for check, recipe in ((check_giant, "recipe=bench_giant"), (check_gpu, "recipe=bench_gpu")):
        with pytest.raises(UserError, match="strategy=sparse_lora with strategy.lightning=streaming"):
            check(compose(recipe, "strategy.lightning=ddp"))
