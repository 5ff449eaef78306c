"""LayerStreamingStrategy: Lightning's single-device strategy with ONN's layer streaming.

Placement: the blocks' frozen weights go to the layer store before the model moves, so only
adapters, prefix and suffix ever reach the device wholesale. A batch is a whole macro-batch;
the engine splits it into micro-batches, runs the chunk-outer forward and each loss's backward
to the last hidden state in the module's `training_step`, and walks the chunks backward when
the step calls `manual_backward` (this strategy's `backward`).
Loggers, progress bar, validation, checkpoints (adapters + optimizer + loops, through the
safetensors CheckpointIO) and resume are Lightning's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from onn.hardware.profile import CoreWatch
from onn.models.layers import discover
from onn.streaming.engine import StreamingEngine
from onn.streaming.store import LayerStore


def layer_store(settings: dict[str, Any], store_root: Path, device: torch.device | str = "cpu") -> LayerStore:
    """The store the streaming settings describe: one folder per store dtype under the model's root."""
    return LayerStore(settings["store"], settings["store_dtype"], folder=Path(store_root) / settings["store_dtype"],
                      pin=torch.device(device).type == "cuda" and settings["store"] == "cpu")  # fmt: skip


def build_engine(
    model: torch.nn.Module,
    settings: dict[str, Any],
    store_root: Path,
    device: torch.device | str,
    micro_batch: int,
) -> StreamingEngine:
    """Discover the blocks, move their frozen weights into the store, and return the engine."""
    device = torch.device(device)
    layer_map = discover(model)
    store = layer_store(settings, store_root, device)
    engine = StreamingEngine(model, layer_map, store, int(settings["chunk_size"]), device=device, prefetch=bool(settings["prefetch"]),
                             activations=settings["activations"], micro_batch=micro_batch,
                             stream_edges=settings["edges"] == "stream", cache_blocks=int(settings["cache_blocks"]),
                             eval_tokens=int(settings["eval_tokens"]))  # fmt: skip
    engine.offload()
    if device.type == "cpu":
        engine.cores = CoreWatch(torch.get_num_threads())  # at most the threads the plan gave it
    return engine


class LayerStreamingStrategy(SingleDeviceStrategy):
    strategy_name = "onn_layer_streaming"

    def __init__(
        self, settings: dict[str, Any], store_root: Path, micro_batch: int, device: str = "cpu", **kwargs
    ):
        super().__init__(device=torch.device(device), **kwargs)
        self.settings, self.store_root, self.micro_batch = settings, Path(store_root), micro_batch
        self.engine: StreamingEngine | None = None

    def setup(self, trainer) -> None:
        module = self.lightning_module
        if self.engine is None:
            self.engine = build_engine(
                module.model, self.settings, self.store_root, self.root_device, self.micro_batch
            )
            module.engine = self.engine
        super().setup(trainer)

    def loss_scale(self) -> float:
        """fp16's current loss scale (1 without a scaler). The engine scales its own losses, so the
        scaler never sees one: start it here, or its first unscale_ finds no scale."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None:
            return 1.0
        if scaler._scale is None:
            scaler.scale(torch.ones((), device=self.root_device))
        return float(scaler.get_scale())

    def backward(self, closure_loss: torch.Tensor, optimizer, *args, **kwargs) -> torch.Tensor:
        # training_step ran the forward and the loss's backward to the last hidden state; the
        # chunks' backward happens here, into the adapters' .grad (accumulated until the step's optimizer.step).
        self.engine.backward_chunks()
        return closure_loss

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()
        super().teardown()
