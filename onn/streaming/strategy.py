"""LayerStreamingStrategy: Lightning's single-device strategy with ONN's layer streaming.

Placement: the blocks' frozen weights go to the layer store before the model moves, so only
adapters, prefix and suffix ever reach the device wholesale. A batch is a whole macro-batch;
the engine splits it into micro-batches, runs the chunk-outer forward and each loss's backward
to the last hidden state in the module's `training_step`, and walks the chunks backward when
the step calls `manual_backward` (this strategy's `backward`).
Loggers, progress bar, validation, checkpoints (adapters + optimizer + loops, through the
safetensors CheckpointIO) and resume are Lightning's own.

LayerStreamingDDPStrategy does the same in each of several processes (Lightning's DDP launcher,
torchrun or srun start them): every rank streams its own copy of the same frozen blocks, trains the
adapters on its share of the global batch, and the adapters' gradients are summed over the ranks
before the optimizer step (and before clipping). There is no DistributedDataParallel wrapper: the
forward is the engine's, so DDP's autograd hooks would never fire.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from onn.dtypes import torch_dtype
from onn.hardware.profile import CoreWatch
from onn.models.layers import discover
from onn.streaming.engine import Objective, StreamingEngine
from onn.streaming.store import LayerStore


@dataclass
class EngineSettings:
    """What the streaming engine runs with: the config's streaming settings, `auto` filled in from the plan."""

    chunk_size: int  # blocks loaded and computed together
    store: str  # cpu (host memory) or disk
    store_dtype: str  # the frozen weights' dtype in the store
    edges: str  # prefix/suffix resident or stream
    activations: str  # kept chunk inputs on the device or the host
    cache_blocks: int  # blocks of a disk store cached in host memory
    eval_tokens: int  # tokens validation holds hidden states for at once
    mlp_tiles: int = 1  # slices a block's gated MLP computes in
    prefetch: bool = True  # load the next chunk while this one computes
    suffix_rows: int | None = None  # rows whose loss (logits) runs at once
    compute_dtype: str | None = None  # the blocks' compute dtype under mixed precision; None: the model's
    # model.layer_map.blocks: the blocks the loader stored and the adapters went on (None: discovered)
    blocks_path: str | None = None


def layer_store(settings: EngineSettings, store_root: Path, device: torch.device | str = "cpu") -> LayerStore:
    """The store the streaming settings describe: one folder per store dtype under the model's root. For a
    GPU its host memory is pinned (a host-memory store, a disk store's read buffers): the copy engine reads
    pinned pages directly, at the link's speed, while the GPU computes."""
    return LayerStore(
        settings.store,
        settings.store_dtype,
        folder=Path(store_root) / settings.store_dtype,
        pin=torch.device(device).type == "cuda",
    )


def build_engine(
    model: torch.nn.Module,
    settings: EngineSettings,
    store: LayerStore,
    device: torch.device | str,
    micro_batch: int,
    objective: Objective | None = None,
) -> StreamingEngine:
    """Find the blocks (model.layer_map.blocks when the settings name them: rediscovered, a model whose discovery
    picks another list streamed other modules than those that got the adapters), move their frozen weights into the
    store (what the loader has not put there already), and return the engine. `objective`: what the model's batches
    and loss are (default: a causal LM's)."""
    device = torch.device(device)
    s = settings
    layer_map = discover(model, s.blocks_path)
    engine = StreamingEngine(
        model,
        layer_map,
        store,
        int(s.chunk_size),
        device=device,
        prefetch=bool(s.prefetch),
        activations=s.activations,
        micro_batch=micro_batch,
        stream_edges=s.edges == "stream",
        cache_blocks=int(s.cache_blocks),
        eval_tokens=int(s.eval_tokens),
        suffix_rows=s.suffix_rows,
        compute_dtype=torch_dtype(s.compute_dtype) if s.compute_dtype else None,
        objective=objective,
        mlp_tiles=int(s.mlp_tiles),
    )
    engine.offload()
    if device.type == "cpu":
        engine.cores = CoreWatch(torch.get_num_threads())  # at most the threads the plan gave it
    return engine


class Streams:
    """What both streaming strategies add to Lightning's: the engine, its backward and fp16's loss scale."""

    def _streaming(
        self, settings: EngineSettings, store_root: Path, micro_batch: int, objective: Objective | None = None
    ) -> None:
        self.settings, self.store_root, self.micro_batch = settings, Path(store_root), micro_batch
        self.objective = objective
        self.engine: StreamingEngine | None = None

    def setup(self, trainer) -> None:
        module = self.lightning_module
        if self.engine is None:
            # a `-true` precision (bf16-true, 64-true) casts the model in super().setup: cast it before the engine
            # takes its compute dtype from the blocks' weights, or the frozen weights decode in the model's old dtype
            self.model = self.precision_plugin.convert_module(self.model)
            # the store the model was loaded into (a host-memory store holds its blocks already)
            store = module.store or layer_store(self.settings, self.store_root, self.root_device)
            self.engine = build_engine(
                module.model, self.settings, store, self.root_device, self.micro_batch, self.objective
            )
            module.engine = self.engine
        super().setup(trainer)

    def loss_scale(self) -> float | torch.Tensor:
        """fp16's current loss scale (1 without a scaler), as a tensor on the device: read to the host, it would
        wait for the previous step's optimizer on a GPU. The engine scales its own losses, so the scaler never
        sees one: this starts it too, or its first unscale_ finds no scale."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None:
            return 1.0
        return scaler.scale(torch.ones((), device=self.root_device))

    def backward(self, closure_loss: torch.Tensor, optimizer, *args, **kwargs) -> torch.Tensor:
        """Lightning's Strategy.backward with the engine's backward in place of the loss's: training_step ran the
        forward and the loss's backward to the last hidden state; the chunks' backward happens here, into the
        adapters' .grad (accumulated until the step's optimizer.step). The hooks around it are Lightning's own
        (on_before_backward, on_after_backward, the callbacks' and the module's), as for a resident step."""
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.engine.backward_chunks()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()
        super().teardown()


class LayerStreamingStrategy(Streams, SingleDeviceStrategy):
    strategy_name = "onn_layer_streaming"

    def __init__(
        self,
        settings: EngineSettings,
        store_root: Path,
        micro_batch: int,
        device: str = "cpu",
        objective: Objective | None = None,
        **kwargs,
    ):
        super().__init__(device=torch.device(device), **kwargs)
        self._streaming(settings, store_root, micro_batch, objective)


class LayerStreamingDDPStrategy(Streams, DDPStrategy):
    """Layer streaming in each of several processes, the adapters' gradients summed over them. The loss
    weights are each micro-batch's share of the global batch's target tokens, so the sum is the gradient
    one process would compute on the whole global batch. `kwargs`: DDPStrategy's (timeout)."""

    strategy_name = "onn_layer_streaming_ddp"

    def __init__(self, settings: EngineSettings, store_root: Path, micro_batch: int, **kwargs):
        super().__init__(**kwargs)
        self._streaming(settings, store_root, micro_batch)

    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper (see the module doc); what its constructor does that matters
        here: every rank starts from rank 0's trainable weights. The frozen ones come from the same store."""
        for p in self.lightning_module.parameters():
            if p.requires_grad:
                torch.distributed.broadcast(p.data, src=0)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """The adapters' gradients summed over the ranks (sum_gradients) before clipping and the step."""
        sum_gradients([p for p in self.lightning_module.parameters() if p.requires_grad])
        return super().optimizer_step(optimizer, closure, model, **kwargs)


def sum_gradients(params: list[torch.nn.Parameter]) -> None:
    """`params`' gradients summed over the ranks in one all-reduce. Which weights each rank used rides in it too (a 0/1
    per weight, summed), copied from pinned memory; a rank reads the sums back only where it left a weight untouched
    itself (else each is 1 or more): reading them at every step made the host wait for the GPU at every step."""
    if not params:
        return
    local = [p.grad is not None for p in params]
    grads = [p.grad if used else torch.zeros_like(p) for p, used in zip(params, local)]
    device = grads[0].device
    flags = torch.tensor(local, dtype=grads[0].dtype)  # small counts: exact in any float dtype
    flags = (flags.pin_memory() if device.type == "cuda" else flags).to(device, non_blocking=True)
    flat = torch.cat([g.reshape(-1) for g in grads] + [flags])
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    used_anywhere = local if all(local) else (flat[-len(params) :] > 0).tolist()
    offset = 0
    for p, g, was_used in zip(params, grads, used_anywhere):
        # a weight no rank touched keeps no gradient, as in one process (AdamW then skips it)
        p.grad = flat[offset : offset + g.numel()].view_as(g).clone() if was_used else None
        offset += g.numel()
