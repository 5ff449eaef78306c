"""Lightning's sharded strategies as ONN runs them: FSDP and DeepSpeed ZeRO on one GPU or many.

What ONN adds to Lightning's own:
  - gradient clipping at optim.clip_grad_norm under every strategy (`clip_gradients`): FSDP through its root
    module's own `clip_grad_norm_` (Lightning's FSDP precision refuses norm clipping), DeepSpeed inside its
    engine's step (its `gradient_clipping` setting; Lightning's clip_gradients is a no-op there);
  - ONN's micro-batch accumulation (manual optimization): DeepSpeed's step is the accumulation boundary
    (`managed_gradient_accumulation: false`), and under ZeRO-3 each micro-batch's forward goes through the
    engine (`forward_module`), which counts them;
  - ZeRO-3 with the optimizer offloaded to the host runs torch's AdamW there (`zero_force_ds_cpu_optimizer:
    false`) rather than DeepSpeed's CPU Adam, which is compiled on first use (about a minute per machine);
  - FSDP with one process shards nothing (NO_SHARD, what torch falls back to anyway, said without its warning);
  - checkpoints through ONN's safetensors CheckpointIO, saved and loaded (a resumed run, a classifier's best
    checkpoint tested): FSDP's full state dict as Lightning gathers it (its check that refuses an existing folder
    would refuse ONN's checkpoint folder, and its reader takes a folder for its sharded format), DeepSpeed's
    weights gathered whole (DeepSpeed's own format is pickles), its partitioned optimizer state left out (a
    resumed run starts its moments afresh, at the learning rates its schedule had reached, and its float32
    master weights rebuilt from the saved bf16 ones under bf16-mixed);
  - under DDP, each validation and test sample scored once (`EvaluatedOnceDDP`): Lightning's sampler repeats some;
  - the process group destroyed when the run ends (`end_distributed`), so NCCL has nothing to warn about;
  - under SLURM, the checkpoint Lightning's auto-requeue saved becomes last.ckpt when fit ends, if it is the newest
    (`RequeueCheckpoint`).
"""

from __future__ import annotations

import contextlib
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, Strategy
from lightning.pytorch.trainer.states import RunningStage

from onn.config import ONNConfig
from onn.errors import UserError
from onn.training.trainer import keep_newest_as_last


class ShardedFSDP(FSDPStrategy):
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        if self._state_dict_type != "full":  # Lightning's sharded format pickles (meta.pt, .metadata)
            raise UserError(
                f"FSDP's state_dict_type={self._state_dict_type!r} writes pickle; ONN saves whole safetensors "
                "checkpoints only: leave state_dict_type at full."
            )
        # the state dict Lightning gathered for rank 0, written by ONN's CheckpointIO (atomically, over the last)
        return Strategy.save_checkpoint(self, checkpoint, self.broadcast(filepath), storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """ONN's checkpoint folder (resumed, or a classifier's best tested) loaded as Lightning loads a full
        checkpoint file: Lightning's own reader takes a folder for its sharded format and refuses ONN's."""
        from lightning.fabric.strategies.fsdp import _get_full_state_dict_context, _is_sharded_checkpoint
        from lightning.fabric.strategies.model_parallel import _load_raw_module_state
        from lightning.pytorch.trainer.states import TrainerFn
        from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

        path = Path(self.broadcast(checkpoint_path))
        if not path.is_dir() or _is_sharded_checkpoint(path):  # Lightning's readers would torch.load (unpickle) it
            raise UserError(
                f"ckpt {path} is not an ONN checkpoint folder (safetensors): ONN loads no pickle, and a sharded FSDP "
                "checkpoint's meta.pt and .metadata are pickles; resume from a checkpoint an ONN run wrote."
            )
        checkpoint = self.checkpoint_io.load_checkpoint(path)
        module = self.lightning_module
        strict = module.strict_loading
        _load_raw_module_state(
            checkpoint.pop("state_dict"), module=self.model, world_size=self.world_size, strict=strict
        )
        states = checkpoint.get("optimizer_states")
        if states is None or module.trainer.state.fn != TrainerFn.FITTING:
            return checkpoint
        # rank0_only=False: every rank loads the optimizer's state
        with _get_full_state_dict_context(self.model, world_size=self.world_size, rank0_only=False):
            for optimizer, state in zip(self.optimizers, states, strict=True):
                if isinstance(next(iter(state["state"]), None), int):  # saved by a plain optimizer
                    state = FullyShardedDataParallel.rekey_optim_state_dict(
                        state, OptimStateKeyType.PARAM_NAME, self.model
                    )
                state = FullyShardedDataParallel.optim_state_dict_to_load(self.model, optimizer, state)
                optimizer.load_state_dict(state)
        return checkpoint


class ShardedDeepSpeed(DeepSpeedStrategy):
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        """The weights gathered whole and the loops' state, through ONN's CheckpointIO. The optimizer's state
        stays out: DeepSpeed partitions it in objects safetensors cannot hold, so a resumed run starts its
        moments afresh."""
        filepath = self.broadcast(filepath)
        state = whole_state_dict(self.lightning_module, keep=self.is_global_zero)
        kept = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint({**kept, "state_dict": state}, filepath)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """ONN's checkpoint folder, read by ONN's CheckpointIO (DeepSpeed's own reader wants its per-rank files)."""
        return Strategy.load_checkpoint(self, self.broadcast(checkpoint_path), weights_only)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """The whole weights into the engine's module on every rank (under ZeRO-3, Lightning's own load of full
        weights: rank 0's, each layer gathered as it loads, partitioned again), then ZeRO's float32 copies of
        them refreshed: its optimizer steps from those."""
        from lightning.pytorch.trainer.states import TrainerFn

        self.model_to_device()
        if self.zero_stage_3:
            self._restore_zero_state(checkpoint, strict=strict)
        else:  # whole on every rank: each loads the checkpoint it read
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
        optimizer = self.deepspeed_engine.optimizer if self.deepspeed_engine is not None else None
        if hasattr(optimizer, "refresh_fp32_params"):
            optimizer.refresh_fp32_params()
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            restore_learning_rates(self.lr_scheduler_configs, checkpoint["lr_schedulers"])


def whole_state_dict(module, keep: bool) -> dict[str, torch.Tensor]:
    """The module's state dict with every weight whole, copied to the host only where `keep` (the rank that writes
    it): each rank's copy of a 14B model would be 28 GB of host memory per GPU. Under ZeRO-3 every rank takes part
    in gathering each weight, one at a time, so no device holds the whole model at once (DeepSpeed's own
    `_zero3_consolidated_16bit_state_dict` gathers layer by layer likewise)."""
    whole: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict(keep_vars=True).items():  # the parameters themselves: ZeRO-3's partitioned
        with _gathered_one(value):
            if keep:  # a copy even on a CPU: the gathered storage is DeepSpeed's to free or reuse
                whole[key] = value.detach().to("cpu", copy=True)
    return whole


def _gathered_one(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """One ZeRO-3 parameter whole for the body (a collective: every rank enters it); anything else as it is."""
    if not hasattr(tensor, "ds_numel"):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([tensor], modifier_rank=None)


def restore_learning_rates(schedulers: list, states: list[dict[str, Any]]) -> None:
    """Each scheduler's optimizer at the learning rates the saved scheduler last set. A scheduler's state sets
    none, and an optimizer whose own state is not restored (DeepSpeed's) would step at the rates it was built
    with: 0 under a warm-up, its first rate after a plateau's reductions."""
    for config, state in zip(schedulers, states, strict=True):
        for group, lr in zip(config.scheduler.optimizer.param_groups, state["_last_lr"], strict=True):
            group["lr"] = lr


def sharded_strategy(
    name: str, entry: dict[str, Any], config: ONNConfig, processes: int, timeout: timedelta
) -> Strategy:
    """Lightning's registered strategy `name` (fsdp*, deepspeed*) set up as the module doc says."""
    params = dict(entry["init_params"])
    if name.startswith("fsdp"):
        if processes == 1:
            params["sharding_strategy"] = "NO_SHARD"
        return ShardedFSDP(**params, timeout=timeout)
    strategy = ShardedDeepSpeed(**params, timeout=timeout)
    strategy.config["gradient_clipping"] = float(config.optim.clip_grad_norm or 0.0)
    strategy.config["managed_gradient_accumulation"] = False
    if "offload_optimizer" in strategy.config.get("zero_optimization", {}):
        strategy.config["zero_force_ds_cpu_optimizer"] = False
    return strategy


EVALUATIONS = (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)


class EvaluatedOnceDDP(DDPStrategy):
    """Lightning's DDP with each validation and test sample scored once. Lightning's DistributedSampler pads a split
    to a multiple of the ranks by repeating its first samples, so 21 test samples on 2 ranks counted one twice and
    the figures were not one process's on the same data. Evaluations shard without repeats instead (Lightning's
    UnrepeatedDistributedSampler, its own choice for predict): a rank may run one batch fewer, which no evaluation
    step waits on, since the figures are torchmetrics states reduced once at the end."""

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer
        stage = trainer.state.stage
        if stage not in EVALUATIONS or limited_by_fraction(trainer, stage):
            return dataloader
        return evaluated_once(dataloader, stage)


def limited_by_fraction(trainer, stage: RunningStage) -> bool:
    """Whether an evaluation keeps a fraction of its batches (trainer.limit_val_batches=0.4): Lightning keeps
    int(batches x fraction) on each rank and refuses 0, so ranks whose shares differ by a batch could keep 1 and 0,
    one rank raising while the others wait in DDP's buffer sync. Such an evaluation keeps Lightning's shares of
    equal length (a few samples repeated)."""
    limit = trainer.limit_test_batches if stage == RunningStage.TESTING else trainer.limit_val_batches
    return isinstance(limit, float) and 0 < limit < 1


def evaluated_once(dataloader: object, stage: RunningStage) -> object:
    """`dataloader` with Lightning's padding DistributedSampler swapped for one that repeats nothing. A split with
    fewer samples than ranks keeps the padding: DDP's first forward of an evaluation syncs buffers, a collective
    that a rank without a batch would never join."""
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(dataloader, DataLoader) or type(sampler) is not DistributedSampler:
        return dataloader  # not Lightning's padding sampler (an iterable of batches, a data module's own sharding)
    if len(sampler.dataset) < sampler.num_replicas:
        return dataloader
    once = UnrepeatedDistributedSampler(
        sampler.dataset,
        num_replicas=sampler.num_replicas,
        rank=sampler.rank,
        shuffle=sampler.shuffle,
        seed=sampler.seed,
    )
    return _update_dataloader(dataloader, once, mode=stage)


def clip_gradients(module, optimizer, max_norm: float) -> None:
    """Clip the gradients' global norm to `max_norm` under any strategy (after fp16's unscale: call it from
    on_before_optimizer_step). DeepSpeed clips inside its engine's step, set by `sharded_strategy`."""
    if max_norm <= 0:
        return
    strategy = module.trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        return
    root = _fsdp_root(module) if isinstance(strategy, FSDPStrategy) else None
    if root is not None:
        root.clip_grad_norm_(max_norm)  # a collective: every rank calls it
    else:
        module.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")


def _fsdp_root(module):
    """The outermost FSDP module: Lightning's wrapper of the whole module, or the model wrapped in
    configure_model (`wrap_for_fsdp`)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    outer = module.trainer.strategy.model
    if isinstance(outer, FullyShardedDataParallel):
        return outer
    return next((m for m in module.modules() if isinstance(m, FullyShardedDataParallel)), None)


def wrap_for_fsdp(model):
    """The model as FSDP's root when Lightning's FSDP strategy is configuring it (inside its wrap context;
    elsewhere unchanged): the LightningModule itself stays unwrapped, so a training step that runs its own
    backward passes (ONN's micro-batches) runs outside FSDP's forward."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import wrap

    return model if isinstance(model, FullyShardedDataParallel) else wrap(model)


def forward_module(module):
    """What a micro-batch's forward goes through: DeepSpeed's engine (ZeRO-3 counts micro-batches there
    and gathers each layer's weights), else the module's own model."""
    strategy = module.trainer.strategy
    return strategy.model if isinstance(strategy, DeepSpeedStrategy) else module.model


@contextlib.contextmanager
def gathered(module):
    """Every weight whole for the body (greedy answers after training), on every rank: ZeRO-3
    partitions them over the ranks, and between its own forwards FSDP leaves each parameter a view of this
    rank's shard (transformers' generate calls the wrapped model's forward, past FSDP's gather: "'weight' must be
    2-D"). One process, or neither strategy: nothing to do."""
    params = [p for p in module.parameters() if hasattr(p, "ds_numel")]
    if params:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
        return
    root = _fsdp_root(module) if module.trainer.world_size > 1 else None
    if root is None:
        yield
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    # one FSDP unit (wrap_for_fsdp wraps the model whole): nested units' own forwards would refuse to run in here
    with FullyShardedDataParallel.summon_full_params(root, writeback=False):
        yield


def forward_is_collective(trainer) -> bool:
    """Whether a forward after training needs every rank: gathering ZeRO-3's partitioned weights or FSDP's
    shards (`gathered`) is an all-gather. Under DDP each rank holds the whole model and rank 0 can answer
    alone."""
    return trainer.world_size > 1 and isinstance(trainer.strategy, DeepSpeedStrategy | FSDPStrategy)


def parameter_count(module, trainable: bool = True) -> int:
    """Parameters (that train), counted whole under ZeRO-3 too."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad or not trainable)


def end_distributed() -> None:
    """Destroy this process's process group once the run has no more collectives: NCCL warns at exit about
    one left alive. DeepSpeed's own destroy also drops the groups it cached, so a next job (a multirun)
    starts clean."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    comm = sys.modules.get("deepspeed.comm")
    if comm is not None and comm.is_initialized():
        comm.destroy_process_group()
    else:
        dist.destroy_process_group()


class RequeueCheckpoint(Callback):
    """Under SLURM, Lightning's auto-requeue saves RUN_DIR/hpc_ckpt_N.ckpt at sbatch's --signal, and the requeued job
    resumes from it (onn/tasks/record.py). Once fit ends, the run folder's newest checkpoint is its last.ckpt and no
    hpc_ckpt is left (`keep_newest_as_last`): Lightning loaded one again, unasked, at the run's next validate()."""

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            keep_newest_as_last(Path(trainer.default_root_dir))
        trainer.strategy.barrier("onn.requeue_checkpoint")  # no rank's next validate() looks before they are gone
