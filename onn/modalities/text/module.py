"""The causal-LM LightningModule: the whole training step on one screen.

Loss is the model's own shifted cross-entropy over answer tokens (labels of prompt tokens are
-100). Validation loss is averaged over tokens, not batches, so it does not depend on batching.

Batches are whole macro-batches (data.batch_size); the step splits them into micro-batches and
accumulates their gradients itself (Lightning's manual optimization), so that an out-of-memory
error can halve the micro-batch and retry the same step with the same macro-batch.

A recurrent model (one that carries its state in `past_key_values`, onn/models/zoo/recurrent_lm.py) can train
with truncated backpropagation through time (task.tbptt_steps): Lightning 2's way, manual optimization over
chunks of the sequence with the state carried from one chunk to the next and detached. The chunks' gradients
accumulate into the batch's one optimizer step, so steps, schedule and resume stay the batch's.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import traceback
from typing import Any

import torch

from onn.config.run import OptimConfig
from onn.errors import UserError
from onn.hardware.memory import is_out_of_memory
from onn.modalities.text.datamodule import HOST_ROWS, IGNORE
from onn.streaming.engine import target_tokens
from onn.training.distributed import clip_gradients, forward_module, wrap_for_fsdp
from onn.training.metrics import WeightedMean
from onn.training.micro_batches import OutOfMemoryFloor, split
from onn.training.module import ONNModule
from onn.training.optim import make_optimizer, make_schedule
from onn.training.record import log_train_loss

log = logging.getLogger("onn")


# What a checkpoint's loop state means: steps of manual optimization with micro-batch accumulation.
LOOP = "manual-accumulation"


class CausalLM(ONNModule):
    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimConfig,
        max_steps: int,
        onn_config: dict[str, Any],
        micro_batch: int,
        min_micro_batch: int = 1,
        tbptt_steps: int = 0,
    ):
        super().__init__()
        self.automatic_optimization = False  # the step accumulates micro-batches itself (see module doc)
        self.model = model
        self.optim = optim
        self.max_steps = max_steps  # the optimizer steps the schedule spans
        # plain dicts (as_dict), stored in every checkpoint so eval/infer can rebuild the model (app.from_checkpoint)
        self.onn_config = onn_config
        self.micro_batch, self.min_micro_batch = micro_batch, min_micro_batch
        self.tbptt_steps = tbptt_steps  # truncated backpropagation through time: tokens per chunk (0: off)
        self.oom_backoffs: list[dict[str, int]] = []  # {"step", "from", "to"} per halving
        # the mean loss per target token over the whole validation set and every process, read once at its end
        self.val_loss = WeightedMean()
        self._losses: list[float] = []  # one mean loss per optimizer step, kept across resume (train_losses)
        self._pending_losses: list[torch.Tensor] = []  # steps' losses not read from the device yet
        self.val_losses: list[float] = []
        self.val_at_step: int | None = None  # global step of the latest validation
        self.engine = None  # set by LayerStreamingStrategy: batches are then macro-batches it streams
        self.store = None  # the layer store the model's frozen blocks were loaded into, when it streams
        self.random_base: str | None = None  # set by build: where model.source=random drew the base (random_base)
        self._held_out: list[dict[str, torch.Tensor]] = []  # a streamed validation's batches, until its epoch ends
        # LoRA checkpoints hold only what trains; the frozen base comes from model.source again.
        self.strict_loading = all(p.requires_grad for p in model.parameters())

    def forward(self, **batch: torch.Tensor):
        return self.model(**batch)

    @property
    def train_losses(self) -> list[float]:
        """One mean loss per optimizer step. Read from the device when asked for (one wait for all the steps
        since the last read), never by the step itself: a GPU step that read its loss could not be queued
        while the previous one computes."""
        if self._pending_losses:
            self._losses += [float(x) for x in torch.stack(self._pending_losses).float().cpu()]
            self._pending_losses = []
        return self._losses

    @train_losses.setter
    def train_losses(self, values: list[float]) -> None:
        self._losses, self._pending_losses = list(values), []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        rows = batch.pop(HOST_ROWS, None)  # counted on the host before the transfer (TextDataModule)
        while True:
            try:
                loss = self._forward_backward(batch, rows)
                break
            except Exception as e:  # noqa: BLE001 - only out-of-memory is handled; the rest re-raises
                if not is_out_of_memory(e):
                    raise
                # backed off after this block, from the error without its traceback: that holds the failed pass's
                # frames, and with them the activations and weights whose memory the retry needs (where it ran
                # out stays with the error, as text)
                e.add_note("".join(traceback.format_tb(e.__traceback__)))
                error = e.with_traceback(None)
            optimizer.zero_grad(set_to_none=True)
            self._back_off(error)
        # logged before the step: optimizer.step() moves global_step on, and logs_now asks for this step's number
        log_train_loss(self, loss, batch["input_ids"].shape[0])
        optimizer.step()  # clips in on_before_optimizer_step, after fp16's unscale
        optimizer.zero_grad(set_to_none=True)
        self.lr_schedulers().step()
        self._pending_losses.append(loss.detach())
        return loss

    def _forward_backward(
        self, batch: dict[str, torch.Tensor], rows: tuple[list[int], list[int]] | None = None
    ) -> torch.Tensor:
        """Every micro-batch's forward and backward. Each micro-batch's mean loss is weighted by its share
        of the global batch's target tokens (every process's), so the update is the whole batch's at any
        micro-batch size and any number of processes. Returns the global batch's loss."""
        world = self.trainer.world_size
        if self.engine is not None:
            # chunk-outer forward of every micro-batch; the chunks' backward runs in manual_backward
            self.engine.micro_batch = self.micro_batch
            pieces = self.engine.split(batch)
            counted = rows is not None and len(rows[1]) == batch["input_ids"].shape[0]
            size = pieces[0]["input_ids"].shape[0]
            weights = [rows[1][a : a + size] for a in range(0, len(rows[1]), size)] if counted else None
            total = self._global_tokens(sum(map(sum, weights)) if weights else sum(target_tokens(p) for p in pieces))
            loss = self.engine.forward_train(
                pieces, loss_scale=self.trainer.strategy.loss_scale(), total_tokens=total, row_weights=weights
            )
            self.manual_backward(loss)
            return self._global_sum(loss.detach())
        pieces, counts = split(batch, self.micro_batch, rows)
        total = self._global_tokens(sum(counts))
        model = forward_module(self)
        losses = []
        for i, (piece, count) in enumerate(zip(pieces, counts)):
            if count == 0 and world == 1:  # no target tokens: nothing to learn from, and its mean loss is 0/0
                continue
            # DDP all-reduces once per step, on the last backward; every process makes the same calls
            sync = i == len(pieces) - 1 or world == 1
            if count and 0 < self.tbptt_steps < piece["input_ids"].shape[1]:
                loss = self._truncated_backward(model, piece, count, count / total * world, sync)
                losses.append(loss * (count / total))
                continue
            with contextlib.nullcontext() if sync else self.trainer.strategy.block_backward_sync():
                out = model(**piece)
                if count == 0:  # a backward through every weight all the same, adding nothing
                    self.manual_backward(out.logits.float().sum() * 0.0)
                    continue
                # DDP averages the processes' gradients: x world makes it their sum
                self.manual_backward(out.loss * (count / total * world))
            losses.append(out.loss.detach() * (count / total))
        local = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
        return self._global_sum(local)

    def _truncated_backward(
        self, model, piece: dict[str, torch.Tensor], tokens: int, weight: float, sync: bool
    ) -> torch.Tensor:
        """Truncated backpropagation through time over one micro-batch: its sequences in chunks of tbptt_steps
        tokens; each chunk starts from the state the previous one ended in, detached, so no gradient crosses a
        chunk boundary, and each chunk's backward frees its activations before the next chunk runs. Each chunk's
        loss is its tokens' summed loss over the micro-batch's `tokens`, so the chunks add up to the micro-batch's
        mean loss (returned), and `weight` scales it as _forward_backward scales a whole micro-batch's."""
        ids, mask = piece["input_ids"], piece.get("attention_mask")  # none: no row is padded (split)
        targets = torch.nn.functional.pad(piece["labels"][:, 1:], (0, 1), value=IGNORE)  # position t predicts t + 1
        state, total = None, torch.zeros((), device=ids.device)
        starts = range(0, ids.shape[1], self.tbptt_steps)
        for start in starts:
            span = slice(start, start + self.tbptt_steps)
            # several processes: DDP reduces the accumulated gradients once, after the last chunk of the last piece
            quiet = self.trainer.world_size > 1 and not (sync and start == starts[-1])
            with self.trainer.strategy.block_backward_sync() if quiet else contextlib.nullcontext():
                out = model(
                    input_ids=ids[:, span],
                    attention_mask=None if mask is None else mask[:, span],
                    shift_labels=targets[:, span].contiguous(),
                    num_items_in_batch=tokens,
                    past_key_values=state,
                    use_cache=True,
                )
                self.manual_backward(out.loss * weight)
            total += out.loss.detach()
            state = tuple(s.detach() for s in out.past_key_values)
        return total

    def _global_tokens(self, tokens: int) -> int:
        """Target tokens of the whole global batch: the sum over every process."""
        if self.trainer.world_size == 1:
            return tokens
        return int(self.trainer.strategy.reduce(torch.tensor(float(tokens), device=self.device), reduce_op="sum"))

    def _global_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.trainer.world_size == 1:
            return value
        return self.trainer.strategy.reduce(value.float(), reduce_op="sum")

    def _back_off(self, error: BaseException) -> None:
        """Halve the micro-batch (the macro-batch stays: more micro-batches accumulate) or give up at the floor."""
        if self.engine is not None:
            self.engine.reset()
        if self.trainer.world_size > 1:
            # one process halving alone would desynchronise the gradient all-reduce
            raise OutOfMemoryFloor(
                f"out of memory at micro-batch {self.micro_batch} in one of {self.trainer.world_size} processes, which "
                "cannot back off alone: set strategy.micro_batch lower. The error was: " + str(error).splitlines()[0]
            ) from error
        if self.micro_batch // 2 < self.min_micro_batch:
            raise OutOfMemoryFloor(
                f"out of memory at micro-batch {self.micro_batch}, the floor (strategy.min_micro_batch="
                f"{self.min_micro_batch}): lower data.max_length or pick a strategy that needs less memory "
                f"(python run.py task=plan shows the options). The error was: {str(error).splitlines()[0]}"
            ) from error
        old, self.micro_batch = self.micro_batch, self.micro_batch // 2
        self.oom_backoffs.append({"step": self.trainer.global_step, "from": old, "to": self.micro_batch})
        log.warning(
            "out of memory at micro-batch %d: retrying step %d with micro-batch %d",
            old,
            self.trainer.global_step,
            self.micro_batch,
        )
        self.log("train/micro_batch", float(self.micro_batch), on_step=True, on_epoch=False)
        gc.collect()  # a cycle through the failed pass (a future holding its error) would keep device memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def on_before_optimizer_step(self, optimizer) -> None:
        clip_gradients(self, optimizer, self.optim.clip_grad_norm)

    def configure_model(self) -> None:
        # FSDP (inside Lightning's wrap context): the model becomes FSDP's root and this module stays unwrapped,
        # so the step's own backward passes (the micro-batches) run outside FSDP's forward
        self.model = wrap_for_fsdp(self.model)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        rows = batch.pop(HOST_ROWS, None)
        if self.engine is not None:
            # streamed: the whole held-out set goes through the blocks at the end of the epoch, so each
            # chunk is loaded once per validation (per pass that memory allows), not once per batch; the
            # batches come on the host (TextDataModule.transfer_batch_to_device)
            self._held_out.append(dict(batch))
            return
        pieces, counts = split(batch, self.micro_batch, rows)
        losses = [self.model(**piece).loss for piece in pieces]
        for loss, tokens in zip(losses, counts):
            if tokens:  # a micro-batch without targets has a 0/0 mean loss
                self.val_loss.update(loss, tokens)

    def on_validation_epoch_end(self) -> None:
        if self._held_out:
            total, tokens = self.engine.evaluate(self._held_out)
            self._held_out = []
            if tokens:  # the held-out set's mean loss per target token
                self.val_loss.update(torch.tensor(float(total) / tokens, device=self.device), tokens)
        loss = self.val_loss.compute(self.device, self.trainer.world_size) or 0.0
        # already the mean over every process (compute() above): sync_dist only says so to Lightning
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/perplexity", math.exp(min(loss, 50)), sync_dist=True)
        if not self.trainer.sanity_checking:
            self.val_losses.append(loss)
            self.val_at_step = self.trainer.global_step

    def configure_optimizers(self):
        optimizer = make_optimizer([p for p in self.model.parameters() if p.requires_grad], self.optim)
        # stepped per optimizer step over the run's length (tasks.run_steps: trainer.max_steps, or fewer where
        # trainer.max_epochs ends the run first); the per-epoch schedules are refused
        return {
            "optimizer": optimizer,
            "lr_scheduler": make_schedule(optimizer, self.optim, self.max_steps, "val/loss", epochs=False),
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if not self.strict_loading:
            trainable = {n for n, p in self.named_parameters() if p.requires_grad}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["onn"] = {
            "loop": LOOP,
            "config": self.onn_config,
            "train_losses": self.train_losses,
            "val_losses": self.val_losses,
            # a frozen random base is drawn again on load: where it was drawn decides its numbers (check_random_base)
            "random_base": None if self.strict_loading else self.random_base,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning's step counter lives elsewhere in the older loop
        if checkpoint.get("onn", {}).get("loop") != LOOP:
            raise UserError(
                "this checkpoint was written by an older ONN whose training loop cannot be resumed: "
                "evaluate it with task=eval ckpt=..., or start training again."
            )
        onn = checkpoint["onn"]
        self.train_losses = list(onn["train_losses"])
        self.val_losses = list(onn["val_losses"])


def summarize_losses(losses: list[float]) -> tuple[float | None, float | None]:
    """(initial, final): the first step's loss, and the mean of the last 5% of steps (at least one)."""
    if not losses:
        return None, None
    tail = max(1, math.ceil(len(losses) * 0.05))
    return losses[0], sum(losses[-tail:]) / tail
