"""A small model's step time, measured on this machine rather than modelled.

A small model's step is mostly framework time (Python, dispatch, autograd, small elementwise ops), which no FLOP
count predicts. So the plan times the model's own code: copies of it with 2 and 6 blocks, at the planned micro-batch
and sequence length, in the planned precision and strategy (full, LoRA, QLoRA on the copy's linear layers in NF4 as
load_4bit quantizes a run's, or the streaming engine at the plan's chunk size and compute dtype), with the run's
weights (model.dtype where it is set: llama_small's float32 edges beside bf16 blocks), on the plan's thread count,
with a batch padded as the collator pads a run's (a padded row sends attention down its masked path: phi4_tiny's
40-block LoRA step 2-6% slower than unpadded). Six blocks less two, over
four, is one block's share; two blocks less two shares is the rest (embeddings, head, loss, optimizer). The step of
n blocks is then rest + n x block, divided by the share of a core the plan's threads get now. A small model's timing
is the median of nine steps (the fastest of nine ran 20-35% under what runs measured; their mean once put a grid's
llama_small sparse-LoRA plan at 189.5 ms a block where its run took 37, as one stalled step among nine would);
`window_s` (task=bench, just before its steps, gives as long as its timed steps will take, at most WINDOW_S) skips
the cache and times the copies' steps for that long, their mean: this shared host runs for seconds at a time a third
slower and then fast again (phi4_tiny's run: 0.19 s steps for three seconds, 0.30 s for three, 0.19 again), so nine
steps, under a second, catch one speed where a run's twenty meet both; `windows` (task=bench, between its steps:
onn/bench/suite.py) times them back to back before every fifth of the run's steps, so the timings meet the spells
the steps meet. A large block's is the fastest of three (its matmuls, undisturbed: one disturbed step in three put
Phi-4's at 950 ms per block, where runs took 560). Timings are in CPU time on one thread (which other processes'
load does not stretch), so a busy machine measures what a quiet one would. Results are cached per machine and
shapes for MAX_AGE_S (where hardware.cache can be written: a read-only one is read, and a new timing is used without
being kept): this shared host's speed drifts over the hours (llama_small's grid step was timed at 0.47 s
and ran at 0.68 s in a sweep later, on idle cores; timed again, 0.56 s and ran at 0.58 to 0.60 s), so a timing
older than that is taken again. Large models (whose step is matmuls, which the plan's FLOP model predicts from the
measured matmul rate) and GPUs keep the FLOP model. QLoRA's step is timed too: its NF4 layers dequantize their
weights in every forward and backward, through bitsandbytes' per-call work, which the FLOP model of LoRA it would
otherwise take missed by 2.5-2.8x (phi4_tiny, task=bench).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from onn.config import ONNConfig, as_dict
from onn.errors import UserError
from onn.hardware.disk import read_json, write_text_atomically
from onn.hardware.profile import Profile
from onn.modalities.text.tasks import weights_dtype
from onn.planning.plan import Plan, streaming_reason
from onn.training.trainer import streamed_compute_dtype

log = logging.getLogger("onn")

MAX_PARAMS = 50_000_000  # a 6-block copy about this size trains in a second or so
MAX_AGE_S = 900  # a cached timing older than this is measured again (seconds of work for a small model)
WINDOW_S = 3.0  # the longest a timing window takes (a short run's twenty steps of a 0.15 s step)


def refine(
    plan: Plan,
    config: ONNConfig,
    hw: Profile,
    spec,
    window_s: float | None = None,
    windows: Iterable[float] | None = None,
) -> dict[str, Any]:
    """The plan with predicted_step_s from timing the model's own blocks, where that applies. `window_s`:
    timed now, for that long, whatever the cache holds; `windows`: timed now, whatever the cache holds, for as many
    seconds as each item says when it comes (a run pausing between its steps; see the module's docstring)."""
    if hw.accelerator != "cpu" or hw.source == "preset" or not config.model.architecture:
        return plan
    if plan.strategy not in ("full", "lora", "qlora", "sparse_lora"):
        return plan
    streamed = plan.streaming is not None  # sparse_lora under another Lightning strategy trains resident
    large = is_large(spec)
    if large and (not streamed or 2 * max(spec.block_params) * 2 > 0.5 * _budget_bytes(hw)):
        return plan  # a large model trains streamed; its block copies must fit beside the run comfortably
    from onn.planning.costs import matmul_rate, threads_for

    threads, share = threads_for(hw)
    seq, batch, micro = int(plan.sequence_length), config.data.batch_size, int(plan.micro_batch)
    costs = block_times(config, plan, hw, seq, micro, threads, large, window_s, windows)
    n = spec.n_blocks
    if plan.strategy == "sparse_lora":  # streamed or not, its blocks cost by where the adapters are
        layers = set(plan.sparse_layers)
        lowest = min(layers) if layers else n
        blocks = sum(
            costs["below"] if i < lowest else costs["lora"] if i in layers else costs["frozen"] for i in range(n)
        )
    else:
        blocks = n * costs["block"]
    micro_batches = -(-batch // micro)
    rest = costs["rest"]
    if large:  # the copies had a tiny vocabulary: the head's matmuls (forward, input gradient) by the measured rate
        dtype = plan.streaming.compute_dtype if plan.streaming else "float32"
        rest += 4 * spec.vocab * spec.hidden * micro * seq / matmul_rate(hw, dtype, micro * seq, threads)
    compute = (rest + blocks) * micro_batches / share
    plan = copy.deepcopy(plan)
    step = compute
    if streamed:  # the loaders' reads overlap the compute; their decoding does not
        s = plan.streaming
        step = max(s.predicted_io_s, compute + s.predicted_decode_s)
        s.predicted_compute_s, s.predicted_step_s = round(compute, 3), round(step, 3)
        # the streaming line says the step it predicted: the timed one now, not the model's
        plan.reasons = [streaming_reason(s) if r.startswith("streaming:") else r for r in plan.reasons]
    plan.predicted_step_s = round(step, 4)
    plan.step_time_source = "timed"
    plan.reasons.append(
        f"step time: {spec.name}'s own blocks timed on this machine ({blocks / n * 1e3:,.1f} ms per block and "
        f"micro-batch on average, {rest * 1e3:,.1f} ms for the rest) for {n} blocks and {micro_batches} micro-batch(es)"
        + (f", at {share:.0%} of a core" if share < 1 else "")
    )
    return plan


def is_large(spec) -> bool:
    """Whether the model's copies are too large for nine steps of each: timed as 1- and 2-block copies with a small
    vocabulary, the fastest of three steps, and never between a run's steps."""
    return spec.params - sum(spec.block_params) + 6 * max(spec.block_params) > MAX_PARAMS


def _budget_bytes(hw: Profile) -> float:
    from onn.planning.costs import budget_mb

    return budget_mb(hw) * 2**20


def block_times(
    config: ONNConfig,
    plan: Plan,
    hw: Profile,
    seq: int,
    micro: int,
    threads: int,
    large: bool = False,
    window_s: float | None = None,
    windows: Iterable[float] | None = None,
) -> dict[str, float]:
    """Per micro-batch: one block's share of a step and the rest (`block`, `rest`); for sparse_lora (streamed, or
    resident under another Lightning strategy) a block with adapters (`lora`), one without them above the lowest
    adapted block (`frozen`: its input gradient, recomputed when streamed) and one below it (`below`, forward
    only). Cached per machine and shapes. `large`: copies of 1
    and 2 blocks with a vocabulary of 256 (a block does not depend on it; the head is counted apart)."""
    key = json.dumps(
        {
            "model": config.model.architecture,
            "strategy": plan.strategy,
            "precision": plan.precision,
            "weights": str(weights_dtype(config, plan)),
            "lora": as_dict(config.strategy.lora),
            "seq": seq,
            "micro": micro,
            "threads": threads,
            "streaming": {
                k: getattr(plan.streaming, k, None) for k in ("store", "store_dtype", "chunk_size", "mlp_tiles")
            },
            "machine": hw.fingerprint,
            "large": large,
            "version": 14,
        },
        sort_keys=True,
        default=str,
    )
    # beside the hardware profile: a timing of this machine, shared by every outputs folder that shares it
    folder = config.hardware.cache or Path(config.paths.cache) / "hardware"
    cache = Path(folder) / "calibration" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if window_s is None and windows is None and cache.is_file() and time.time() - cache.stat().st_mtime < MAX_AGE_S:
        saved = read_json(cache)  # a damaged file (a run killed while writing it) is timed again
        if isinstance(saved, dict) and isinstance(saved.get("costs"), dict):
            return saved["costs"]

    def timed(*copies: tuple[int, list[int] | None]) -> list[float]:
        if large:  # a large block's copies, one at a time: two of them at once may not fit beside the run
            return [_step_times(config, plan, seq, micro, threads, [c], vocab=256)[0] for c in copies]
        return _step_times(config, plan, seq, micro, threads, list(copies), window_s=window_s or 0.0, windows=windows)

    if large:  # a block's compute dwarfs any boundary effect: 1 and 2 blocks do
        one, lora, frozen, below = timed((1, [0]), (2, [0, 1]), (2, [0]), (2, [1]))
        costs = {"lora": lora - one, "frozen": frozen - one, "below": below - one}
        costs["rest"] = one - costs["lora"]
    # copies of 2 and 6 blocks: four blocks' difference, so a boundary effect of one copy is not multiplied by n
    elif plan.strategy == "sparse_lora":
        two, lora, frozen, below = timed((2, [0, 1]), (6, [0, 1, 2, 3, 4, 5]), (6, [0, 1]), (6, [4, 5]))
        costs = {"lora": (lora - two) / 4, "frozen": (frozen - two) / 4, "below": (below - two) / 4}
        costs["rest"] = two - 2 * costs["lora"]
    else:
        two, six = timed((2, None), (6, None))
        costs = {"block": (six - two) / 4}
        costs["rest"] = two - 2 * costs["block"]
    costs = {k: max(v, 0.0) for k, v in costs.items()}
    try:  # best effort: a hardware.cache that holds a valid profile may be read-only
        write_text_atomically(cache, json.dumps({"costs": costs, "key": json.loads(key)}))
    except (OSError, UserError) as e:  # UserError: the refusal in write_text_atomically's own words
        log.info("the blocks' timing is used and not kept: %s", e)
    return costs


def _step_times(
    config: ONNConfig,
    plan: Plan,
    seq: int,
    micro: int,
    threads: int,
    copies: list[tuple[int, list[int] | None]],
    vocab: int | None = None,
    window_s: float = 0.0,
    windows: Iterable[float] | None = None,
) -> list[float]:
    """Per copy of the model (`blocks`, `adapted` blocks), its training step as ONN runs it: the median of
    nine, or the mean of as many as window_s (at most WINDOW_S) takes, or of as many as each of `windows` takes
    (after one untimed: the steps before it were another model's); the fastest of three for a large model's. The
    copies take their steps in turns, so a change in the machine's speed meanwhile reaches them all alike and leaves
    their differences (a block's cost) alone: timed one copy after the other, a 2-block copy and a 6-block one a few
    seconds apart put llama_small's LoRA step 38-42% under what its runs took."""
    import torch

    from onn.hardware.memory import release_mmap_threshold

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    engines: list = []
    try:
        steps = [_copy_step(config, plan, seq, micro, blocks, adapted, vocab, engines) for blocks, adapted in copies]
        clock = time.process_time if threads == 1 else time.perf_counter
        for step in steps:
            step()
        times: list[list[float]] = [[] for _ in steps]

        def one_each() -> None:
            for step, taken in zip(steps, times):
                begin = clock()
                step()
                taken.append(clock() - begin)

        if windows is not None:
            for seconds in windows:
                one_each()  # untimed: the caches hold the run's model, not these copies
                for taken in times:
                    taken.pop()
                start = time.perf_counter()
                one_each()
                while time.perf_counter() - start < seconds:
                    one_each()
            least, seconds = 1, 0.0  # a run that ended before its first timed step: one round, for a figure
        else:
            least, seconds = (3 if vocab is not None else 9), min(WINDOW_S, window_s) if vocab is None else 0.0
        start = time.perf_counter()
        while len(times[0]) < least or time.perf_counter() - start < seconds:
            one_each()
        if vocab is not None:
            return [min(t) for t in times]
        return [statistics.mean(t) if seconds or windows is not None else statistics.median(t) for t in times]
    finally:
        torch.set_num_threads(before)
        for engine in engines:  # their loader threads and read buffers: not needed past the timing
            engine.close()
        if engines:  # their malloc setting is process-wide: the next timing starts from glibc's largest
            release_mmap_threshold()


def _copy_step(
    config: ONNConfig,
    plan: Plan,
    seq: int,
    micro: int,
    blocks: int,
    adapted: list[int] | None,
    vocab: int | None,
    engines: list,
):
    """A `blocks`-block copy of the model, set up as the plan trains it; returns its training step."""
    import torch

    from onn.dtypes import torch_dtype
    from onn.models.layers import discover
    from onn.models.load import auto_class, meta_model, seeded_draw
    from onn.streaming.engine import StreamingEngine
    from onn.streaming.store import LayerStore
    from onn.training.lora import apply

    # the blocks' path from the whole model (one block alone is no run of repeated blocks to discover)
    blocks_path = discover(meta_model(config.model), config.model.layer_map.blocks).blocks_path
    arch = _copy_architecture(config, blocks, vocab)
    # the copy's weights, adapters and tokens drawn from seed 0 as every copy's; the caller's generator given back
    with seeded_draw(0, torch.device("cpu")):
        model = auto_class(arch).from_config(arch)
        model = model.to(weights_dtype(config, plan))  # model.dtype where it is set, as the run loads it
        if plan.strategy == "qlora":
            model = _in_nf4(model, weights_dtype(config, plan))
        container = model.get_submodule(blocks_path)
        model = apply(model, plan.strategy, config.strategy, discover(model, blocks_path), adapted)
        # the blocks' path inside the wrapped model, given: a copy of one block is no run to discover
        layer_map = discover(model, next(name for name, m in model.named_modules() if m is container))
        if plan.strategy != "full":  # adapters in fp32, as a run has them
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        batch = _padded_batch(int(getattr(arch, "vocab_size", 256)), micro, seq)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    clip = float(config.optim.clip_grad_norm)  # the run clips every step: a pass over every trained gradient
    autocast = plan.precision.startswith("bf16")
    engine = None
    if plan.streaming is not None:
        s = plan.streaming
        # the plan's chunks (a copy smaller than one holds one): blocks computed a chunk at a time share its
        # boundary's work, which copies streamed a block at a time paid per block (phi4_tiny's 40-block step
        # 12% slower at chunk 1 than at the plan's 16, and its runs 12-27% under the plan)
        chunk = min(int(s.chunk_size), blocks)
        dtype = streamed_compute_dtype(plan)  # the run's
        engine = StreamingEngine(
            model,
            layer_map,
            LayerStore("cpu", s.store_dtype),
            chunk,
            micro_batch=micro,
            compute_dtype=torch_dtype(dtype) if dtype else None,
            mlp_tiles=int(s.mlp_tiles),  # a fixed slicing's extra MLP pass, as the run computes it
        )
        engine.offload()
        engines.append(engine)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if engine is not None:
                engine.train_step([batch])
            else:
                model(**batch).loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(trained, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _copy_architecture(config: ONNConfig, blocks: int, vocab: int | None):
    """The model's architecture with `blocks` blocks (and `vocab` tokens, its special ids kept inside it)."""
    from onn.models.load import architecture

    arch = architecture(config.model)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if hasattr(arch, key):
            setattr(arch, key, blocks)
    if vocab is not None:
        arch.vocab_size = vocab
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(getattr(arch, key, None), int) and getattr(arch, key) >= vocab:
                setattr(arch, key, vocab - 1)
    return arch


def _in_nf4(model, compute_dtype):
    """The copy with its linear layers in NF4, as onn.models.load.load_4bit loads a run's model for QLoRA: written as a
    safetensors folder and read back through transformers' BitsAndBytesConfig, on the CPU (the only device timed)."""
    import tempfile

    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig

    from onn.models.load import auto_class

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype
    )
    with tempfile.TemporaryDirectory(prefix="onn-nf4-copy-") as folder:
        model.save_pretrained(folder, safe_serialization=True)
        model = auto_class(model.config).from_pretrained(
            folder,
            local_files_only=True,
            use_safetensors=True,
            quantization_config=quantization,
            device_map={"": "cpu"},
        )
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False  # as load_4bit: the run's trainable path, not the packed kernel
    return model


def _padded_batch(vocab: int, micro: int, seq: int) -> dict[str, Any]:
    """Random tokens, one row padded to the longest as the collator pads a run's batches (a padded row sends
    attention down its masked path)."""
    import torch

    from onn.modalities.text.datamodule import IGNORE

    ids = torch.randint(0, vocab - 1, (micro, seq))
    mask = torch.ones_like(ids)
    if micro > 1:
        mask[0, seq - seq // 4 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}
