"""What every classifying modality shares (images, sounds, clips, shapes): plan, train, eval, infer, export.

A `ClassifierModality` (onn/modalities/base.py) supplies its data (a `ClassificationData`), its
networks, the transform that turns a stored batch into the network's input (augmenting it in
training), how to read inputs for inference and how to picture predictions. Everything else is
here, once, as functions of the modality `m`:

  train   epochs over the device-resident dataset, validation every epoch (or every
          trainer.val_check_interval steps), best.ckpt by task.monitor beside last.ckpt, early
          stopping, resume with the history; then the best checkpoint is tested on the test split
  eval    val (and test) metrics of a checkpoint
  infer   predictions.jsonl (top-5, true label when known) and a PNG of what was predicted
  export  safetensors (state dict + config.json that rebuilds it), ONNX or .omny of the network

`inputs`, saved in every checkpoint, is what rebuilds the network and its transform without the
data: classes, input_shape, the validation split's seed and the modality's own (mean/std, ...).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from onn.config import ONNConfig, as_dict, typed
from onn.config.data import eval_batch
from onn.config.export import OnnxExport, SafetensorsExport
from onn.config.model import NetworkConfig
from onn.config.run import PairSideConfig
from onn.config.strategy import StrategyConfig
from onn.config.task import READS_CHECKPOINT, InferTask, TrainTask
from onn.data.cache import cached_tensors
from onn.data.files import write_jsonl
from onn.data.labelled import same_text
from onn.data.resident import (
    HELD_OUT_RULE,
    ClassificationData,
    ResidentBatches,
    Split,
    by_position,
    drawn_by_name,
    planned_val_split,
)
from onn.errors import UserError
from onn.export.hf import save_network
from onn.export.write import export_after_training, export_for_run, refused_write, weight_bytes
from onn.hardware.cluster import is_rank_zero
from onn.hardware.memory import PeakMemory
from onn.hardware.profile import Profile
from onn.modalities.base import ClassifierModality, Job
from onn.models.load import user_function
from onn.models.vision import feature_extractor, feature_width
from onn.planning.plan import STREAMING_LIGHTNING, Plan, make_plan
from onn.planning.spec import network_spec, transform_bytes
from onn.streaming.seeded import draw, empty_network
from onn.streaming.store import LayerStore
from onn.training.callbacks import StepClock, run_callbacks
from onn.training.checkpoints import check_finite, check_state, resumed_optim, saved_config, shared_best, state_shapes
from onn.training.checkpoints import load as load_checkpoint
from onn.training.classifier import (
    Classifier,
    LinearProbe,
    adapt_norm_note,
    evaluation_autocast,
    in_float32,
    save_confusion,
)
from onn.training.distributed import parameter_count
from onn.training.metrics import ranked
from onn.training.optim import monitor_mode
from onn.training.trainer import build_trainer, optimizer_steps, processes, streaming_store, streaming_strategy

log = logging.getLogger("onn")
TOP_K = 5
PICTURED = 64  # inputs drawn in infer's picture


def plan(m: ClassifierModality, config: ONNConfig, hardware: Profile, use_tuned: bool = True):
    """The classifier's plan: full training or a linear probe (make_network_plan); with strategy=sparse_lora a
    recurrent stack's blocks stream (make_network_streaming_plan), sized with what trains (streamed_trainable)."""
    planned_val_split(config)  # said once every image was decoded, though a plan comes before the data
    if isinstance(config.task, TrainTask):  # task=plan refuses what the training's loss would refuse mid-step
        mixup_alpha(config.task)
        smoothing(config.task)
    inputs = m.planned_inputs(config)
    model_cfg: NetworkConfig = config.model
    with torch.device("meta"):
        network = m.network(model_cfg, inputs)
        sample = torch.empty(1, *inputs["input_shape"])
    if config.strategy.name == "sparse_lora":
        check_streams(config)
        streamed_trainable(network, config)
    transform = m.transform(config, {**inputs, **m.neutral_stats(inputs)})
    moved = 0
    if transform is not None:  # the network's input is the transform's output (e.g. a spectrogram)
        stored = torch.zeros(1, *inputs["input_shape"], dtype=getattr(torch, m.stored_dtype))
        sample = transform(stored, train=False).to("meta")
        moved = transform_bytes(transform, stored)  # run on every training batch, augmentation included
    spec = network_spec(
        network,
        sample,
        str(model_cfg.name),
        pretrained=bool(model_cfg.weights),
        head_params=head_params(network, len(inputs["classes"])),
        blocks_path=model_cfg.layer_map.blocks,
        transform_bytes=moved,
    )
    return make_plan(config, hardware, spec, use_tuned=use_tuned), spec


def check_streams(config: ONNConfig) -> None:
    """strategy=sparse_lora trains a classifier only by streaming its blocks in one process: under another Lightning
    strategy (ddp, fsdp) the run streamed anyway and dropped it, while the plan said nothing of it."""
    lightning = config.strategy.lightning
    if config.task.name not in READS_CHECKPOINT and lightning not in STREAMING_LIGHTNING:
        raise UserError(
            f"strategy.lightning={lightning} with strategy=sparse_lora: a classifier's sparse LoRA trains only by "
            "streaming its blocks in one process (strategy.lightning=streaming); use that, or strategy=full "
            f"strategy.lightning={lightning}."
        )


def build(
    m: ClassifierModality, config: ONNConfig, plan: Plan, inputs: dict[str, Any], store: LayerStore | None = None
) -> Classifier:
    """The Classifier for `inputs`: from the data, or from a checkpoint. A streamed network's frozen block weights
    are drawn into `store`, block by block (all in memory without one)."""
    torch.manual_seed(int(config.seed))
    model_cfg: NetworkConfig = config.model
    strategy = plan.strategy
    streamed = strategy == "sparse_lora"
    network = streamed_network(m, config, inputs, store) if streamed else m.network(model_cfg, inputs)
    if strategy == "linear_probe":
        backbone, width = feature_extractor(network)
        network = LinearProbe(backbone, width, len(inputs["classes"]))
    # what the checkpoint keeps to rebuild this model (plain values; read back with onn.config.typed)
    onn_config = {
        "model": as_dict(model_cfg),
        "strategy": as_dict(dataclasses.replace(config.strategy, name=strategy)),
        "data": as_dict(config.data),
        "optim": as_dict(config.optim),  # what a resumed run's optimizer state belongs to (resumed_optim)
        "inputs": inputs,
        "modality": m.name,
    }
    # every task a classifier runs (eval, infer, export, serve, the vision benches) extends train's keys
    task: TrainTask = config.task
    module = m.classifier_class()(
        network,
        inputs["classes"],
        config.optim,
        onn_config,
        transform=m.transform(config, inputs),
        label_smoothing=smoothing(task),
        mixup=mixup_alpha(task),
        channels_last=bool(model_cfg.channels_last),
        inputs="features" if strategy == "linear_probe" else "data",
        monitor=task.monitor,
        adapt_norm=bool(task.adapt_norm),
        loss=(model_cfg.loss, user_function(model_cfg.loss, "model.loss")) if model_cfg.loss else None,
    )
    if model_cfg.compile:
        module.model = torch.compile(module.model)  # the Lightning module keeps the same parameters
    module.store = store
    return module


def mixup_alpha(task: TrainTask) -> float:
    """task.mixup checked: 0 (off) or the positive alpha of mixup's Beta(alpha, alpha)."""
    alpha = float(task.mixup)
    if alpha < 0:
        raise UserError(f"task.mixup={task.mixup}: give 0 (off) or mixup's Beta parameter, e.g. 0.2.")
    return alpha


def smoothing(task: TrainTask) -> float:
    """task.label_smoothing checked: torch's cross-entropy refused one outside 0..1 in the first training step."""
    value = float(task.label_smoothing)
    if not 0 <= value <= 1:
        raise UserError(f"task.label_smoothing={task.label_smoothing}: give a share from 0 (off) to 1, e.g. 0.1.")
    return value


def streamed_network(m: ClassifierModality, config: ONNConfig, inputs: dict[str, Any], store: LayerStore | None):
    """strategy=sparse_lora's network (streamed_trainable). A zoo network of random weights is drawn block by block
    from the run's seed: into the store, one block in memory at a time, or all in memory for eval, infer and export
    of its checkpoint, with the same values. One that loads weights (model.weights, a builder of your own) is built
    whole, and the streaming engine moves its blocks to the store."""
    model_cfg: NetworkConfig = config.model
    seed = int(config.seed)
    drawn = model_cfg.source.startswith("zoo:") and not model_cfg.weights  # its weights are the seed's alone
    network = empty_network(lambda: m.network(model_cfg, inputs), seed) if drawn else m.network(model_cfg, inputs)
    streamed_trainable(network, config)
    draw(network, seed, model_cfg.layer_map.blocks, store)
    return network


def streamed_trainable(network: nn.Module, config: ONNConfig) -> nn.Module:
    """strategy=sparse_lora on a classifier whose blocks are a recurrent stack (an LSTM or GRU has no linear layer
    for LoRA): strategy.layers' blocks train their biases, the layers after the blocks (the head) in full, and every
    other weight stays as the seed built it; the blocks' weights stream from the layer store, and the layers before
    them run without gradients. Dropout in a block is refused: the engine runs a block again in the backward, and
    it would draw another mask than the forward's."""
    from torch.nn import RNNBase

    from onn.models.layers import discover, resolve_indices

    name = config.model.name
    layer_map = discover(network, config.model.layer_map.blocks)
    if not any(isinstance(mod, RNNBase) for block in layer_map.blocks for mod in block.modules()):
        raise UserError(
            f"strategy=sparse_lora streams a classifier's blocks when they are a recurrent stack (model=audio_lstm); "
            f"model={name}'s blocks are not: use strategy=full or strategy=auto."
        )
    for mod in (mod for block in layer_map.blocks for mod in block.modules()):
        if (isinstance(mod, nn.Dropout) and mod.p > 0) or (isinstance(mod, RNNBase) and mod.dropout > 0):
            raise UserError(
                f"strategy=sparse_lora: model={name}'s blocks hold dropout, and a streamed block runs again in the "
                "backward with another mask; set model.kwargs.dropout=0."
            )
    network.requires_grad_(False)
    for i in resolve_indices(config.strategy.layers, len(layer_map)):
        for param_name, param in layer_map.blocks[i].named_parameters():
            param.requires_grad_(param_name.rsplit(".", 1)[-1].startswith("bias"))
    for _, module in layer_map.suffix:
        module.requires_grad_(True)
    return network


def data_inputs(m: ClassifierModality, config: ONNConfig, dm: ClassificationData) -> dict[str, Any]:
    # the seed picks the validation split held out of train: eval and infer of a checkpoint reuse it
    stats = m.input_stats(config, dm)
    return {
        "classes": dm.classes,
        "input_shape": list(dm.input_shape),
        "seed": int(config.seed),
        "held_out_rule": HELD_OUT_RULE,  # how the seed draws the split: an earlier ONN's checkpoint lacks it
        **stats,
        **exported_stats(m, config, stats),
    }


def exported_stats(m: ClassifierModality, config: ONNConfig, measured: dict[str, Any]) -> dict[str, Any]:
    """The mean/std the network of an ONN safetensors export (model.weights, its config.json beside it) was trained
    with, in place of what this data measures: normalised otherwise, it would see other inputs than it learned from
    (and task=eval of the export would not give the checkpoint's figures). {} for weights from elsewhere."""
    from onn.export.folders import MARKER

    weights = getattr(config.model, "weights", None)
    folder = Path(str(weights)).expanduser().parent if weights else None
    if folder is None or not (folder / MARKER).is_file():
        return {}
    try:
        saved = json.loads((folder / "config.json").read_text())
        inputs = saved["inputs"] if saved.get("modality") == m.name else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    kept = {k: inputs[k] for k in ("mean", "std") if k in measured and k in inputs}
    if kept:
        log.info("model.weights: normalised with the mean/std its training measured (%s)", folder / "config.json")
    return kept


def setup_data(m: ClassifierModality, config: ONNConfig, device: str) -> ClassificationData:
    dm = m.datamodule(config, device)
    dm.setup()
    return dm


def process_batches(loader: ResidentBatches | torch.utils.data.DataLoader, world: int) -> int:
    """The training batches each of `world` processes takes in an epoch, counted before the trainer exists (the
    data module's own loader is then one process's view of all the data): Lightning caps the validation interval
    at a process's batches, and the schedule's length counts them. Resident batches share themselves out
    (ResidentBatches); a DataLoader gets DistributedSampler's padded share, drop_last only for a share of a batch
    or more (ClassificationData._loader)."""
    if world == 1:
        return len(loader)
    if isinstance(loader, ResidentBatches):  # equal shares: rank 0's count is every process's
        split, batch, groups = loader.split, loader.batch_size, loader.groups
        return len(ResidentBatches(split, batch, True, drop_last=loader.drop_last, groups=groups, world=world))
    share = -(-len(loader.dataset) // world)
    batch = int(loader.batch_size)
    return share // batch if loader.drop_last and share >= batch else -(-share // batch)


def in_checkpoint_order(
    m: ClassifierModality, config: ONNConfig, dm: ClassificationData, saved: dict[str, Any] | None, device: str
) -> ClassificationData:
    """A resumed run's data with its labels in the checkpoint's class order, by name: class folders 0..11 sorted
    as text (0, 1, 10, ...) before they sorted as numbers, and the head's units keep their classes. The first
    setup's splits (on the device when resident) go before the second sizes itself by the memory free."""
    found = [same_text(str(c)) for c in dm.classes]  # graph and mesh folders keep their names as written (NFD)
    known = [same_text(str(c)) for c in saved["classes"]] if saved else found
    if found == known or by_position(found, known):
        return dm
    if set(found) != set(known):  # trained on by position, a renamed class folder takes another's label
        new, missing = [c for c in found if c not in known], [c for c in known if c not in found]
        differ = [f"has the classes {new[:5]}, which the resumed checkpoint never learned"] if new else []
        differ += [f"lacks its classes {missing[:5]}"] if missing else []
        raise UserError(
            f"data.source {' and '.join(differ)} (it knows {known[:10]}); resume on data of the same classes "
            "(rename the folders back), or start a new run."
        )
    del dm
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return setup_data(m, dataclasses.replace(config, data=dataclasses.replace(config.data, classes=known)), device)


def train(job: Job) -> dict[str, Any]:
    m = job.modality
    config, plan, run_dir, ckpt = job.config, job.plan, job.run_dir, job.ckpt
    saved = saved_inputs(ckpt) if ckpt is not None else None
    if saved and "seed" in saved:  # a resumed run keeps the validation split it started with
        config = dataclasses.replace(config, seed=int(saved["seed"]))
    if ckpt is not None:  # the optimizer's state in the checkpoint belongs to its settings
        config = dataclasses.replace(config, optim=resumed_optim(config.optim, ckpt))
    callbacks = _callbacks(config, run_dir)  # its settings checked before the data and the model are built
    dm = in_checkpoint_order(m, config, setup_data(m, config, job.device), saved, job.device)
    if saved and "seed" in saved:  # its inputs, saved into this run's checkpoints, keep the rule's absence
        drawn_by_name(saved, ckpt, draws=dm.held_out_by_name)
    store = streaming_store(config, plan, run_dir, job.device)
    module = build(m, config, plan, saved or data_inputs(m, config, dm), store)
    if ckpt is not None:  # before Lightning restores it: a checkpoint of another network is one sentence
        check_state(module, state_shapes(ckpt), ckpt, loads_frozen=False)
    if module.inputs == "features":
        dm = features(module, dm, config)
    trainable = parameter_count(module.model)  # before fit: FSDP's ranks hold shards of them after it
    # the network built for the data (the plan's is sized from the config's classes); streamed, the blocks'
    # weights are in the layer store, which the plan's count holds
    total = job.spec.params if store is not None else parameter_count(module.model, trainable=False)
    clock = next(c for c in callbacks if isinstance(c, StepClock))
    streaming = streaming_strategy(config, plan, run_dir, job.device, module.objective())
    # one process's batches: under DDP each takes its share of the epoch (the streaming strategy runs one process)
    steps_per_epoch = process_batches(dm.train_dataloader(), 1 if streaming is not None else processes(config))
    if not steps_per_epoch:  # Lightning would end "ok" having trained nothing, and the untrained model be tested
        raise UserError(
            f"data.source gives no training batch (data.batch_size={dm.batch_size}): nothing would train; "
            "add training data or lower data.batch_size."
        )
    trainer = build_trainer(config, plan, run_dir, callbacks, strategy=streaming, steps_per_epoch=steps_per_epoch)
    module.optimizer_steps = optimizer_steps(trainer, steps_per_epoch, per_process=True)  # one rank's share
    with PeakMemory(job.device) as peak:
        trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt) if ckpt else None)
        trainer.save_checkpoint(str(run_dir / "checkpoints" / "last.ckpt"), weights_only=False)  # the final state
    monitor = config.task.monitor
    writes = is_rank_zero()  # the other processes of a multi-process run trained the same weights
    best, best_score = shared_best(trainer, ckpt, run_dir, monitor, monitor_mode(monitor))  # every rank tests it
    metrics: dict[str, Any] = {
        "epochs": trainer.current_epoch,
        "steps": trainer.global_step,
        "train/loss_initial": float(module.train_losses[0]) if module.train_losses else None,
        "train/loss_final": module.final_loss(),
        f"{monitor}_best": round(best_score, 5) if best_score is not None else None,
        "val/history": module.history,
        "val/acc_final": module.history[-1]["val/acc"] if module.history else None,
        "samples_per_s": clock.samples_per_s(skip=min(2, len(clock.step_s) - 1)),
        "peak_memory_mb": round(peak.peak_mb, 1),
        "params_total": total,
        "params_trainable": trainable,
        "checkpoint": str(run_dir / "checkpoints" / "last.ckpt"),
        "checkpoint_best": best or None,
        "resumed_from": str(ckpt) if ckpt else None,
        "items_skipped": len(dm.skipped),
        "resident": not dm.streamed,
    }
    if monitor != "val/acc":  # every classifier's record has val/acc_best (the grids read it) beside its monitor's
        metrics["val/acc_best"] = max((h["val/acc"] for h in module.history), default=None)
    stage = tested_after_training(trainer, module, dm, best, metrics, run_dir, writes)
    if writes and config.export.name != "none":  # a streamed network exports from its checkpoint, resident
        tested = Path(best) if best else run_dir / "checkpoints" / "last.ckpt"
        # unchecked: a diverged run exports nothing (export_after_training) and says so as it ends
        exported = module if module.engine is None else load_trained(m, config, plan, tested, checked=False)
        if module.engine is not None and module.engine.store.dtype != "float32":
            metrics["export/frozen_weights"] = "float32"  # rebuilt from the seed: not the store the figures are of
            log.warning(
                "export: the blocks' frozen weights are rebuilt at float32; training and its %s figures used them "
                "as stored (%s)",
                stage,
                module.engine.store.dtype,
            )
        export_after_training(metrics, run_dir, lambda: export_module(m, config, exported, run_dir))
    return metrics


def tested_after_training(
    trainer, module: Classifier, dm, best: str | None, metrics: dict, run_dir: Path, writes: bool
) -> str:
    """The best checkpoint scored on the test split, or without one the validation split, into `metrics`, with its
    confusion matrix drawn where `writes`. Every process of a multi-process run scores (the test is a collective)
    and reports the same figures; rank 0 alone draws the picture, which every rank wrote to one path at once.
    Returns the split's name."""
    stage = "test" if dm.has_test() else "val"
    if stage == "test":
        trainer.test(module, datamodule=dm, ckpt_path=best or None, verbose=False)
    else:
        trainer.validate(module, datamodule=dm, ckpt_path=best or None, verbose=False)
    metrics.update({k: round(float(v), 5) for k, v in trainer.callback_metrics.items() if k.startswith(f"{stage}/")})
    if stage in module.confusion:
        picture = run_dir / f"confusion_{stage}.png"
        if writes:
            save_confusion(module.confusion[stage], module.classes, picture)
        metrics["confusion_matrix"] = str(picture)
        log.info("%s accuracy %.4f (best checkpoint %s)", stage, metrics.get(f"{stage}/acc", float("nan")), best)
    else:  # trainer.limit_val_batches=0 (or limit_test_batches=0): nothing held out was scored
        log.warning(
            "no %s batches were scored (trainer.limit_%s_batches): the run has no %s figures", stage, stage, stage
        )
    return stage


def load_trained(m: ClassifierModality, config: ONNConfig, plan: Plan, ckpt: Path, checked: bool = True) -> Classifier:
    """The classifier with the checkpoint's weights. A streamed run's checkpoint holds what trained (and the
    buffers): the frozen weights are its seed's, built again with its strategy, all resident. `checked`: weights
    that hold NaN or inf are refused for config.task (eval, infer, export; a diffusion run's judge): a diverged
    checkpoint's predictions would all be NaN. Unchecked for the training's own export and for serve, whose
    startup checks every served model."""
    inputs, saved = saved_inputs(ckpt), saved_config(ckpt)["strategy"]
    if saved["name"] == "sparse_lora":
        strategy = typed(StrategyConfig, saved, f"ckpt {ckpt}: strategy")
        config = dataclasses.replace(config, strategy=strategy, seed=int(inputs["seed"]))
        plan = dataclasses.replace(plan, strategy="sparse_lora")
    module = build(m, config, plan, inputs)
    check_state(
        module, state_shapes(ckpt), ckpt, loads_frozen=False
    )  # names and shapes, before torch's traceback would
    missing, unexpected = module.load_state_dict(load_checkpoint(ckpt)["state_dict"], strict=False)
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    missing = [k for k in missing if ".backbone." not in k and k not in frozen]
    if unexpected or missing:
        raise UserError(
            f"ckpt {ckpt} does not match the model it names: missing {missing[:3]}, unexpected {unexpected[:3]}."
        )
    if checked:
        check_finite(module, f"ckpt {ckpt}", config.task.name)
    return module


def on_data(module: Classifier) -> Classifier:
    """The classifier fed a stored batch, as infer, serve and export feed it: a linear probe trained on cached
    features runs its frozen backbone on the normalised batch, then its head (fed as features, the pixels reached
    the head raw: infer and serve crashed on the shapes, and an ONNX graph skipped the normalisation)."""
    module.inputs = "data"
    return module


def evaluate(job: Job) -> dict[str, Any]:
    m = job.modality
    config, plan, ckpt = job.config, job.plan, job.ckpt
    dm = setup_data(m, config, job.device) if ckpt is None else trained_data(m, config, ckpt, job.device)
    if ckpt is None:
        log.warning(
            "task=eval without ckpt: evaluating the network as model.source gives it (untrained unless it has weights)"
        )
        module = build(m, config, plan, data_inputs(m, config, dm))
    else:
        module = load_trained(m, config, plan, ckpt)
        adapt_norm_note(module, saved_config(ckpt), ckpt)
    if module.inputs == "features":
        dm = features(module, dm, config)
    resident = "auto" if config.strategy.lightning == "streaming" else None  # a streamed run's checkpoint, resident
    trainer = build_trainer(config, plan, job.run_dir, [], loggers=False, strategy=resident, steps_per_epoch=1)
    metrics: dict[str, Any] = {"checkpoint": str(ckpt) if ckpt else None}
    trainer.validate(module, datamodule=dm, verbose=False)
    metrics.update({k: round(float(v), 5) for k, v in trainer.callback_metrics.items() if k.startswith("val/")})
    if dm.has_test():
        trainer.test(module, datamodule=dm, verbose=False)
        metrics.update({k: round(float(v), 5) for k, v in trainer.callback_metrics.items() if k.startswith("test/")})
    print("  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float)))
    return metrics


def trained_data(m: ClassifierModality, config: ONNConfig, ckpt: Path, device: str) -> ClassificationData:
    """The data a checkpoint is scored on: the validation split its training held out (its seed), and labels by
    class name, in the checkpoint's order (a data.source of fewer classes, or in another order, was scored by
    position, and so was a data.classes listing the checkpoint's classes, or some of them, in another order). A
    class the model never learned is one sentence."""
    inputs = saved_inputs(ckpt)
    known = [same_text(str(c)) for c in inputs["classes"]]  # (one trained before names were NFC: as data names them)
    config = dataclasses.replace(config, seed=int(inputs["seed"]))
    dm = m.datamodule(config, device)
    dm.min_classes = 1  # the checkpoint knows the classes: a folder of one of them is scored too
    dm.known_classes = tuple(known)  # a folder holding one of them (CLASS/SESSION/FILE) is that class, not a wrapper
    dm.setup()
    drawn_by_name(inputs, ckpt, draws=dm.held_out_by_name)
    named = set(dm.classes) <= set(known)  # data.classes naming some of the checkpoint's classes, in any order
    if dm.classes == known or (config.data.classes and not named):
        return dm
    unknown = [c for c in dm.classes if c not in known]
    if unknown and not by_position(dm.classes, known):
        raise UserError(
            f"data.source has the classes {unknown[:5]}, which ckpt {ckpt} never learned (it knows {known[:10]}); "
            "evaluate it on data of its own classes."
        )
    if len(dm.classes) > len(known):  # label numbers past the model's classes (not data.classes' count: unset)
        raise UserError(
            f"data.source has label numbers up to {len(dm.classes) - 1} (data.num_classes counted), but ckpt {ckpt} "
            f"learned {len(known)} classes ({known[:10]}); evaluate it on data of its own classes."
        )
    return setup_data(m, dataclasses.replace(config, data=dataclasses.replace(config.data, classes=known)), device)


def infer(job: Job) -> dict[str, Any]:
    """Predict the classes of task.input (one file, a folder or an archive): predictions.jsonl and a PNG, written by
    rank 0 alone where a launcher (torchrun, srun) runs the command in several processes; each predicts, and
    reports the same figures."""
    m = job.modality
    config = job.config
    task: InferTask = config.task
    source = task.input
    if not source:
        raise UserError(f"task=infer on {m.name} data needs task.input=PATH (a file, a folder or an archive).")
    if job.ckpt is None:
        raise UserError(f"task=infer on {m.name} data needs ckpt=RUN_DIR (a trained classifier) to know its classes.")
    path = Path(str(source)).expanduser()
    if not path.exists():
        raise UserError(f"task.input={source} does not exist.")
    module = on_data(load_trained(m, config, job.plan, job.ckpt))
    inputs = module.onn_config["inputs"]
    sets = m.read_inputs(path, inputs, config)
    device = torch.device(job.device)
    model = module.to(device).eval()
    rows, shown, predicted_names, true_names, correct, known = [], [], [], [], 0, 0
    classes = [same_text(c) if isinstance(c, str) else c for c in inputs["classes"]]  # as the data names them: NFC
    unknown = set()
    batch = eval_batch(config.data)
    for split, decoded in sets.items():
        truths = true_classes(decoded.classes, classes)
        for start in range(0, len(decoded.labels), batch):
            x = decoded.inputs[start : start + batch].to(device)
            with torch.no_grad(), evaluation_autocast(config, job.plan, device):  # as task=eval runs it
                probs = torch.softmax(model(model.prepare(x, train=False)).float(), dim=1).cpu()
            top = ranked(probs, min(TOP_K, len(classes)))
            for i in range(x.shape[0]):
                j = start + i
                label = int(decoded.labels[j])
                true = truths[label] if 0 <= label < len(truths) else None
                if true is None and 0 <= label < len(truths):  # a folder the model has no class of (an archive's
                    unknown.add(decoded.classes[label])  # wrapping folder): no truth to score against
                guess = classes[int(top.indices[i, 0])]
                row = {
                    "name": decoded.names[j],
                    "predicted": guess,
                    "probability": round(float(top.values[i, 0]), 5),
                    "top5": [[classes[int(c)], round(float(p), 5)] for c, p in zip(top.indices[i], top.values[i])],
                    "true": true,
                }
                if split != "all":
                    row["split"] = split
                rows.append(row)
                if true is not None:
                    known += 1
                    correct += true == guess
                if len(shown) < PICTURED:
                    shown.append(decoded.inputs[j])
                    predicted_names.append(guess)
                    true_names.append(true)
    if unknown:
        log.warning(
            "task.input names classes the model has none of (%s): no true label for their rows", sorted(unknown)[:5]
        )
    output = Path(task.output).expanduser() if task.output else job.run_dir / "predictions.jsonl"
    picture = output.with_suffix(".png")
    if is_rank_zero():
        write_jsonl(rows, output)
        m.picture(torch.stack(shown), predicted_names, true_names, picture, inputs)
        print(f"wrote {len(rows)} predictions to {output} and a picture of the first {len(shown)} to {picture}")
    metrics = {
        "infer/items": len(rows),
        "infer/output": str(output),
        "infer/picture": str(picture),
        "infer/items_skipped": sum(len(d.skipped) for d in sets.values()),
    }
    if known:
        metrics["infer/acc"] = round(correct / known, 5)
    return metrics


def true_classes(found: list[str], classes: list[str]) -> list[str | None]:
    """The model's class each label of task.input names (None: none): a folder's by name; a label number (IDX,
    CIFAR binary, a CSV's numeric label, a recording's digit) as the model's class of that number, as training and
    task=eval read it (resident.relabelled), so a model trained with data.classes naming the numbers is scored too
    (the number's text was compared with the names: every row true null, no infer/acc). A folder named by a number
    the model has a class of is that class (by position, folder 2 was class 10 of classes 0, 1, 10, 11, 2, ...)."""
    if by_position(found, classes):
        return [classes[i] if i < len(classes) else None for i in range(len(found))]
    return [name if name in classes else None for name in found]


class Predictor:
    """A trained classifier answering one file at a time (task=serve): decoded by the modality's own
    read_inputs, as task=infer and the training data are."""

    def __init__(
        self,
        m: ClassifierModality,
        config: ONNConfig,
        module: Classifier,
        device: torch.device,
        plan: Plan | None = None,
    ):
        self.modality, self.config, self.device, self.plan = m, config, device, plan
        self.module = module.to(device).eval()
        self.inputs = module.onn_config["inputs"]
        self.classes: list[str] = list(self.inputs["classes"])

    @torch.no_grad()
    def classify(self, path: Path, top_k: int) -> tuple[list[tuple[str, float]], torch.Tensor]:
        """The top_k (class, probability) of one file, best first, and its decoded input (the stored form).
        A file the modality cannot decode is a UserError saying why, in the upload's terms (read_inputs speaks of
        task.input and gives a data set's advice: data.max_bad_fraction, the folder formats)."""
        try:
            sets = self.modality.read_inputs(path, self.inputs, self.config)
        except UserError as e:
            said = str(e).replace(f"task.input {path}", "").lstrip(": ")
            first = re.search(r"\(first: (.+?)\); ", said)  # "1 of 1 images could not be decoded (first: why); ..."
            reason = first[1] if first else said.split("; ")[0]
            raise UserError(f"the upload is no {self.modality.name} file ONN can decode: {reason}") from None
        decoded = next((d for d in sets.values() if len(d.labels)), None)
        if decoded is None:
            reasons = [r for d in sets.values() for r in d.skipped]
            raise UserError(
                f"the upload is no {self.modality.name} file ONN can decode: {'; '.join(reasons) or 'nothing in it'}"
            )
        x = decoded.inputs[:1].to(self.device)
        with evaluation_autocast(self.config, self.plan, self.device):  # as task=eval runs it
            probs = torch.softmax(self.module(self.module.prepare(x, train=False)).float(), dim=1)[0].cpu()
        top = ranked(probs, min(top_k, len(self.classes)))
        return [(self.classes[int(c)], float(p)) for c, p in zip(top.indices, top.values)], decoded.inputs[0]

    def picture(self, sample: torch.Tensor, predicted: str, path: Path) -> None:
        """A PNG of the decoded input captioned with its class (the image, a spectrogram, rendered points)."""
        self.modality.picture(sample[None], [predicted], [None], path, self.inputs)


def serving(job: Job) -> Predictor:
    m = job.modality
    if job.ckpt is None:
        raise UserError(f"task=serve on {m.name} data needs ckpt=RUN_DIR (a trained classifier) to know its classes.")
    module = load_trained(m, job.config, job.plan, job.ckpt, checked=False)  # serve's startup checks it
    return Predictor(m, job.config, on_data(module), torch.device(job.device), job.plan)


def export(job: Job) -> dict[str, Any]:
    """The trained network from `ckpt` (the whole network for a linear probe), or without one the
    network as model.source gives it, sized by the data config."""
    m = job.modality
    if job.ckpt is not None:
        module = load_trained(m, job.config, job.plan, job.ckpt)
    else:  # statistics from no data: neutral ones, or those of the ONN export model.weights names
        neutral = m.neutral_stats(inputs := m.planned_inputs(job.config))
        module = build(m, job.config, job.plan, {**inputs, **neutral, **exported_stats(m, job.config, neutral)})
    return export_module(m, job.config, module, job.run_dir)


def export_module(m: ClassifierModality, config: ONNConfig, module: Classifier, run_dir: Path) -> dict[str, Any]:
    """safetensors: the network's state dict plus what rebuilds it (config.json; model.weights loads it, and its
    mean/std); onnx / omny: the network behind its evaluation transform (StoredBatchClassifier), a graph whose
    `input` is a batch as the data module stores it. Rank 0 alone writes it (and gives its figures) where a launcher
    runs the command in several processes: each wrote the same folder at once, and one read another's half file."""
    if not is_rank_zero():
        return {}
    module = on_data(module)  # (training's own export: its testing is done)
    own = m.export_network(config, module, run_dir)
    if own is not None:
        return own
    settings = config.export
    network = module.model.eval()
    inputs = module.onn_config["inputs"]
    if isinstance(settings, SafetensorsExport):
        from onn.export.folders import write_atomically

        def write(folder: Path) -> None:  # the weights, and a config.json ONN, timm and HF's label maps read
            save_network(network, folder, {"model": as_dict(config.model), "inputs": inputs, "modality": m.name})

        folder = Path(settings.output or run_dir / "export" / "safetensors").expanduser()
        if not settings.output:
            folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            # an earlier export's folder (of this model) only, replaced whole
            write_atomically(folder, "network", write, config.model.name)
        except (OSError, SafetensorError) as e:  # a full or read-only disk: the earlier export stays as it was
            refused = refused_write(e, folder, weight_bytes(network))
            if refused is None:
                raise
            raise refused from None
        log.info("export: %s", folder)
        return {"export/format": "safetensors", "export/path": str(folder)}
    if not isinstance(settings, OnnxExport):  # (export=none never comes here)
        raise UserError(f"export={settings.name}: a classifier exports safetensors, onnx or omny.")
    graph = StoredBatchClassifier(module.prepare, network).eval()
    shape, dtype = [int(settings.sample.batch_size), *input_shape(inputs)], getattr(torch, m.stored_dtype)
    with torch.no_grad():
        x = graph.prepare(torch.zeros(shape, dtype=dtype), train=False)
    size = settings.sample.image_size
    if size is not None and list(size) != list(x.shape[-2:]):  # it was traced at the data's size without a word
        raise UserError(
            f"export.sample.image_size={list(size)}: a trained classifier is traced at the size its network "
            f"takes ({list(x.shape[-2:])}, from its data); leave export.sample.image_size at null."
        )
    generator = torch.Generator().manual_seed(int(config.seed))
    if dtype == torch.uint8:  # pixels of every value check the graph better than zeros
        stored = torch.randint(0, 256, shape, dtype=dtype, generator=generator)
    else:  # float32: an audio run stores float16 samples, and onnxruntime takes float32 ones (onnx_export.traceable)
        stored = torch.randn(shape, generator=generator)
    metrics = export_for_run(config, graph, run_dir, {"input": stored})
    describe(m, inputs, Path(metrics[f"export/{settings.name}"]), shape, dtype)  # the .onnx or the .omny written
    return metrics


def describe(m: ClassifierModality, inputs: dict[str, Any], output: Path, shape: list[int], dtype) -> None:
    """What an exported classifier takes and gives, in the file's metadata (`onn.classes`, `onn.inputs`: the
    settings its data was stored with, the sample rate and clip length of audio among them) and doc_string: a
    user of model.onnx needs the class names and what to feed it, and resampling or decoding is outside the graph."""
    from onn.export.onnx_export import set_metadata

    classes = [str(c) for c in inputs["classes"]]
    doc = (
        f"input: {str(dtype).removeprefix('torch.')} {['batch', *shape[1:]]}, a batch of {m.name} data as ONN stores "
        f"it (onn.inputs holds its settings); output: logits [batch, {len(classes)}] over onn.classes."
    )
    set_metadata(output, {"onn.classes": json.dumps(classes), "onn.inputs": json.dumps(inputs)}, doc)


class StoredBatchClassifier(nn.Module):
    """A trained classifier as evaluation and task=infer run it, from a batch as its data module stores it (uint8
    pixels and clips, waveforms, points): `prepare` (the Classifier's, in its evaluation form: normalised with the
    training data's mean/std, the log-mel, the clip's frames) is traced in front of the network, so the exported
    graph gives infer's answers for the stored batch, with no statistics to carry beside it."""

    def __init__(self, prepare, network: nn.Module):
        super().__init__()
        self.prepare, self.network = prepare, network  # (prepare: a bound method, not a submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(self.prepare(x, train=False))


class SideEncoder(nn.Module):
    """A modality's batch transform (augmenting in training mode) in front of its network: one side of a
    dual encoder. The network alone is what planning sizes and export traces."""

    def __init__(self, transform, network: nn.Module):
        super().__init__()
        self.transform, self.network = transform, network

    def prepare(self, x: torch.Tensor, train: bool) -> torch.Tensor:
        if x.is_floating_point():  # in bf16 under bf16-true, as Lightning casts a float batch
            x = x.float()
        with in_float32(x):  # the transform runs in fp32, as the Classifier's does
            x = self.transform(x, train=train) if self.transform is not None else x
        weights = next(self.network.parameters(), None)  # bf16 under strategy.precision=bf16-true
        return x.to(weights.dtype) if weights is not None and x.is_floating_point() else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(self.prepare(x, train=self.training))


class ClassifierSide:
    """A classifying modality as one side of a dual encoder (base.PairSide): its network with `width`
    outputs is the encoder, its transform (neutral statistics, or the side's data.mean/std) goes in front, and its
    read_inputs decodes the side's files as it decodes task.input: any classifier modality pairs without more code."""

    def __init__(self, m: ClassifierModality, config: PairSideConfig):
        # the side's reader never refuses a set for its unreadable fraction: the pairs' data.max_bad_fraction counts
        # the pairs, and a refused set (a chunk of 1,024 files) would drop its good files with the bad
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, max_bad_fraction=1.0))
        self.m, self.name, self.config = m, m.name, config
        planned = m.planned_inputs(config)
        self.inputs = {**planned, **self.stats(planned)}

    def stats(self, planned: dict[str, Any]) -> dict[str, Any]:
        """The modality's neutral statistics, with data.mean / data.std where the side gives them (image, video:
        a pretrained tower's own, ImageNet's for timm's); nothing measures a side's `auto` ones."""
        from onn.config.data import ImageData, VideoData
        from onn.modalities.image.dataset import given_stat

        stats = self.m.neutral_stats(planned)
        data = self.config.data
        if isinstance(data, ImageData | VideoData):
            channels = input_shape(planned)[0]
            for key in ("mean", "std"):
                given = given_stat(getattr(data, key), f"data.sides.{self.name}.{key}", channels)
                if given is not None:
                    stats[key] = given
        return stats

    def read(self, items: list[Path]) -> tuple[torch.Tensor, list[int], list[tuple[int, str]]]:
        """The files decoded by the modality's read_inputs, from a folder of links named by position."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="onn-pairs-") as stage:
            for i, path in enumerate(items):
                os.symlink(Path(path).resolve(), Path(stage) / f"{i:07d}{Path(path).suffix.lower()}")
            try:
                sets = self.m.read_inputs(Path(stage), self.inputs, self.config)
            except UserError:  # nothing of the set decodes (the one refusal at max_bad_fraction 1.0): each item a skip
                # named by its own file, not the stage's
                return self.sample(0), [], [(i, f"not a readable {self.name} file") for i in range(len(items))]
        tensors, index, skipped = [], [], []
        for decoded in sets.values():
            tensors.append(decoded.inputs)
            index += [int(Path(n).name.split(".", 1)[0]) for n in decoded.names]
            for item in decoded.skipped:
                name, _, reason = item.partition(": ")
                skipped.append((int(Path(name).name.split(".", 1)[0]), reason))
        stored = torch.cat(tensors) if tensors else self.sample(0)
        order = sorted(range(len(index)), key=index.__getitem__)
        return stored[order], [index[i] for i in order], skipped

    def encoder(self, width: int) -> SideEncoder:
        network = self.m.network(self.config.model, {**self.inputs, "classes": [str(i) for i in range(width)]})
        return SideEncoder(self.m.transform(self.config, self.inputs), network)

    def sample(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, *input_shape(self.inputs), dtype=getattr(torch, self.m.stored_dtype))


def input_shape(inputs: dict[str, Any]) -> list[int]:
    """The stored shape of one input (checkpoints written before the modality interface say image_shape)."""
    return list(inputs.get("input_shape") or inputs["image_shape"])


def head_params(network: nn.Module, classes: int) -> int:
    """What a linear probe trains: the head over the backbone's features (the network keeps its own head, which
    the plan's spec counts)."""
    try:
        width = feature_width(network)
    except UserError:
        return 0
    return width * classes + classes


def saved_inputs(ckpt: Path) -> dict[str, Any]:
    saved = saved_config(ckpt)
    if "inputs" not in saved:  # a text or pairs run's checkpoint, or another tool's
        raise UserError(f"ckpt {ckpt} was not written by a classifier run; it cannot be used with this data.")
    inputs = saved["inputs"]
    if "input_shape" not in inputs:
        inputs = {**inputs, "input_shape": input_shape(inputs)}
    return inputs


def features(module: Classifier, dm: ClassificationData, config: ONNConfig) -> ClassificationData:
    """The same datamodule serving backbone features for every split, computed once and cached (safetensors)."""
    if dm.streamed:
        raise UserError("strategy=linear_probe needs the dataset resident in memory; set data.resident=true.")
    probe = module.model
    state = probe.backbone.state_dict()
    weights = hashlib.sha256()
    for k in sorted(state):
        weights.update(k.encode())
        weights.update(state[k].detach().float().cpu().numpy().tobytes())
    data = {k: v for k, v in as_dict(config.data).items() if k not in ("batch_size", "eval_batch_size", "num_workers")}
    key = json.dumps(
        {
            "weights": weights.hexdigest(),
            "inputs": module.onn_config["inputs"],
            "data": {k: split_digest(v) for k, v in dm.splits.items()},
            "config": data,
            "of": "network_input",  # features of raw pixels were cached before: not read back as these
        },
        sort_keys=True,
        default=str,
    )
    cache = Path(config.paths.cache) / "features" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.safetensors"

    @torch.no_grad()
    def compute() -> dict[str, torch.Tensor]:
        backbone = probe.backbone.to(dm.device).eval()
        saved = {}
        for name, split in dm.splits.items():
            chunks = [
                backbone(module.network_input(x, train=False)).float().flatten(1)
                for x, _ in ResidentBatches(split, dm.eval_batch_size, shuffle=False)
            ]
            saved[name] = torch.cat(chunks)
        log.info(
            "linear probe: %d-wide features of %d items, cached to %s",
            next(iter(saved.values())).shape[1],
            sum(len(v) for v in saved.values()),
            cache,
        )
        return saved

    saved = cached_tensors("linear probe features", cache, compute, str(dm.device))
    dm.splits = {k: Split(saved[k], v.labels, v.names) for k, v in dm.splits.items()}
    return dm


def split_digest(split: Split) -> str:
    """sha256 of a split's names and stored inputs: features cached for images since changed (same names,
    other pixels) are computed again, not read back stale."""
    h = hashlib.sha256("\n".join(split.names).encode())
    h.update(split.inputs.detach().contiguous().cpu().flatten().view(torch.uint8).numpy())
    return h.hexdigest()


def _callbacks(config: ONNConfig, run_dir: Path) -> list:
    monitor = config.task.monitor
    return run_callbacks(config, run_dir, monitor, monitor_mode(monitor))
