"""plan, train, eval, infer and export of a diffusion denoiser on images.

plan    the denoiser sized on the meta device (one sample and its timestep); a UNet's skip connections
        cross its blocks, which the plan says, keeping it resident (strategy=full)
train   epochs over the image modality's resident dataset (its readers and cache), the noise-prediction
        loss on held-out images every validation, best.ckpt by val/loss beside last.ckpt, resume with the
        history; a grid of samples at the end
infer   task.samples images from task.seed in task.sample_steps (DDIM) or every timestep (DDPM): a PNG grid
        and the images as safetensors
eval    the held-out loss, and the samples labelled by an ONN image classifier (task.classifier): the share
        it is confident about, the classes it sees and an Inception-score-like figure
export  the denoiser (noisy image + timestep -> predicted noise) as ONNX, checked in onnxruntime
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from onn.config import ONNConfig, as_dict, typed
from onn.config.data import ImageData
from onn.config.model import DenoiserConfig
from onn.config.strategy import StrategyConfig
from onn.config.task import TrainTask
from onn.data.resident import HELD_OUT_RULE, drawn_by_name
from onn.errors import UserError
from onn.export.write import export_after_training
from onn.hardware.cluster import is_rank_zero
from onn.hardware.memory import PeakMemory, hold_mmap_threshold
from onn.hardware.profile import Profile
from onn.modalities.base import Job
from onn.modalities.classification import process_batches
from onn.modalities.diffusion.module import MONITOR, DiffusionModule, NoisePrediction, build_denoiser
from onn.modalities.diffusion.sample import draw, sampling_scheduler, write_sample_grid
from onn.modalities.image.dataset import ImageDataModule, as_trained
from onn.modalities.image.formats import list_items
from onn.modalities.image.modality import first_image, trained_inputs
from onn.models.zoo.sizes import image_sides
from onn.planning.plan import make_plan
from onn.planning.spec import network_spec
from onn.streaming import seeded
from onn.streaming.store import LayerStore
from onn.training.callbacks import StepClock, run_callbacks
from onn.training.checkpoints import check_finite, check_state, resumed_optim, saved_config, shared_best, state_shapes
from onn.training.checkpoints import load as load_checkpoint
from onn.training.trainer import build_trainer, optimizer_steps, processes, streaming_store, streaming_strategy

log = logging.getLogger("onn")


def planned_shape(config: ONNConfig) -> list[int]:
    """[channels, height, width] the denoiser is planned for (and built for by task=export without a checkpoint):
    with ckpt= the checkpoint's; else data.image_size and data.channels, or as the data's first images have them
    where image_size is null or channels auto (32 px, 1 channel where there is no data to read). A folder of 256 px
    images was planned as 32 px ones: memory and step time predicted for 64 times fewer pixels."""
    if (trained := trained_inputs(config)) is not None:
        return [int(v) for v in trained["input_shape"]]
    data: ImageData = config.data
    if data.image_size:
        channels = data.channels if isinstance(data.channels, int) else sized_channels(data)
        return [int(channels or 1), *image_sides(data.image_size)]  # [side]: a square, as the data module decodes
    found = first_image(data)
    channels = data.channels if isinstance(data.channels, int) else found.channels if found else 1
    return [int(channels), *(found.size if found else [32, 32])]


def sized_channels(data: ImageData) -> int | None:
    """The channels data.channels=auto decodes the images to, as the data module decides them (1 where its first
    images are all grey, else 3), where data.image_size is given; None where nothing can be read (no data here, or a
    read training refuses in its own sentence). first_image reads the images at their own sizes and refuses sizes
    that differ: a folder of RGB images of mixed sizes, which data.resize brings to data.image_size, was planned as
    1 channel while the run decoded 3. Such a folder is read as training reads it, at data.image_size."""
    with contextlib.suppress(UserError):  # raised where the first images' sizes differ: read again below, resized
        found = first_image(data)
        return found.channels if found else None
    try:
        splits = list_items(Path(str(data.source)).expanduser(), data.format or "auto")
        # the data module's rule: grey in one split and colour in another is colour
        decoded = [items.configure("auto", list(data.image_size), data.resize).channels for items in splits.values()]
    except UserError:  # data.resize=error and an image of another size: training stops with that sentence
        return None
    return max((c for c in decoded if isinstance(c, int)), default=None)


def plan(modality, config: ONNConfig, hardware: Profile, use_tuned: bool = True):
    """The network plan of the denoiser for one image and its timestep; the blocks it cannot stream, said. With
    strategy=sparse_lora its blocks stream (a DiT's transformer blocks), sized with the adapters in place; a
    UNet's cannot, and it trains resident (strategy=full)."""
    from onn.models.layers import blocks_crossed

    shape = planned_shape(config)
    with torch.device("meta"):
        denoiser = build_denoiser(config.model, shape[0], shape[1:])
        sample = (torch.empty(1, *shape), torch.zeros(1, dtype=torch.long))
    crossing = blocks_crossed(denoiser, sample)
    streams = config.strategy.name == "sparse_lora" and not crossing
    if config.strategy.name == "sparse_lora" and crossing:
        config = dataclasses.replace(config, strategy=dataclasses.replace(config.strategy, name="full"))
    if streams:
        with torch.device("meta"):
            denoiser = adapted(denoiser, config)
    spec = network_spec(
        denoiser, sample, str(config.model.name), pretrained=False, blocks_path=config.model.layer_map.blocks
    )
    result = make_plan(config, hardware, spec, use_tuned=use_tuned)
    result.candidates.pop("linear_probe", None)  # a classifier's candidate: a denoiser has no head to probe
    if config.strategy.name == "auto":
        result.reasons[0] = "a denoiser trained from random init: train every weight"
    if crossing:
        result.reasons.insert(
            1,
            f"{type(denoiser.network).__name__}'s skip connections cross its blocks ({crossing}), so it cannot be "
            "streamed block by block: it trains resident (strategy=full)",
        )
    return result, spec


def adapted(denoiser: torch.nn.Module, config: ONNConfig) -> torch.nn.Module:
    """strategy=sparse_lora's denoiser: LoRA adapters (peft) on strategy.layers' blocks, whose frozen weights
    stream; the output layers after the blocks train in full (a denoiser from random init has no trained head)."""
    from onn.models.layers import discover, resolve_indices
    from onn.training.lora import apply

    layer_map = discover(denoiser, config.model.layer_map.blocks)
    layers = resolve_indices(config.strategy.layers, len(layer_map))
    model = apply(denoiser, "sparse_lora", config.strategy, layer_map, layers, task_type=None)
    for _, module in layer_map.suffix:
        module.requires_grad_(True)
    return model


def build(config: ONNConfig, inputs: dict[str, Any], store: LayerStore | None = None) -> DiffusionModule:
    """The DiffusionModule of config.model for `inputs` (input_shape, the validation split's seed, classes);
    its onn_config (saved in every checkpoint, plain values) rebuilds it. With strategy=sparse_lora the random
    weights are drawn block by block from the seed: the blocks' into `store` (all in memory without one)."""
    seed = int(config.seed)
    torch.manual_seed(seed)
    model: DenoiserConfig = config.model
    channels, height, width = inputs["input_shape"]
    streams = config.strategy.name == "sparse_lora"
    onn_config = {
        "model": as_dict(model),
        "strategy": {**as_dict(config.strategy), "name": "sparse_lora" if streams else "full"},
        "data": as_dict(config.data),
        "optim": as_dict(config.optim),  # what a resumed run's optimizer state belongs to (resumed_optim)
        "inputs": inputs,
        "modality": "diffusion",
    }
    if not streams:
        return DiffusionModule(build_denoiser(model, channels, [height, width]), model, config.optim, onn_config)
    denoiser = seeded.empty_network(lambda: build_denoiser(model, channels, [height, width]), seed)
    denoiser.requires_grad_(False)  # LoRA's base: the blocks' weights are frozen (and stream)
    seeded.draw(denoiser, seed, model.layer_map.blocks, store)
    module = DiffusionModule(adapted(denoiser, config), model, config.optim, onn_config)
    module.store = store
    return module


def load_trained(config: ONNConfig, ckpt: Path, checked: bool = True) -> DiffusionModule:
    """The module of the checkpoint's model with its weights (and its moving average), all resident (a streamed
    run's frozen blocks are drawn again from its seed). `checked`: weights that hold NaN or inf are refused for
    config.task (infer, eval, export), whose samples would all be NaN; the training's own sampling is unchecked (a
    diverged run says so as it ends)."""
    saved = saved_config(ckpt, "diffusion")
    model = typed(DenoiserConfig, saved["model"], f"ckpt {ckpt}: model")
    strategy = typed(StrategyConfig, saved["strategy"], f"ckpt {ckpt}: strategy")
    # LoRA's frozen base is the random init of the run's seed, built again
    config = dataclasses.replace(config, model=model, strategy=strategy, seed=int(saved["inputs"]["seed"]))
    module = build(config, saved["inputs"])
    check_state(module, state_shapes(ckpt), ckpt, loads_frozen=strategy.name != "sparse_lora")  # before torch's
    missing, unexpected = module.load_state_dict(load_checkpoint(ckpt)["state_dict"], strict=False)
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad} if strategy.name == "sparse_lora" else ()
    missing = [k for k in missing if k not in frozen]
    if missing or unexpected:
        raise UserError(
            f"ckpt {ckpt} does not match the denoiser it names: missing {missing[:3]}, unexpected {unexpected[:3]}."
        )
    if checked:  # the denoiser and its moving average, by the checkpoint's names (before adapters merge)
        check_finite(module, f"ckpt {ckpt}", config.task.name)
    if strategy.name == "sparse_lora":  # the adapters merged into their layers: a plain denoiser again
        module.denoiser = module.denoiser.merge_and_unload()
    return module


def datamodule(config: ONNConfig, device: str, trained: dict[str, Any] | None = None):
    """The image modality's datamodule (its readers, cache, resident splits); the labels go unused. With `trained`
    (the run config of the checkpoint the denoiser comes from) the images are decoded to its channels and size: a
    colour folder given to resume or evaluate a greyscale denoiser failed in its first convolution."""
    data = as_trained(config.data, trained, str(config.ckpt) if trained else None)
    dm = ImageDataModule(data, config.paths.cache, device, seed=int(config.seed))
    dm.setup()
    return dm


def _callbacks(config: ONNConfig, run_dir: Path) -> list:
    return run_callbacks(config, run_dir, MONITOR, "min")


def train(job: Job) -> dict[str, Any]:
    config, run_dir, ckpt = job.config, job.run_dir, job.ckpt
    saved = saved_config(ckpt, "diffusion") if ckpt is not None else None
    if saved:  # a resumed run keeps the validation split it started with, and the optimizer its state belongs to
        config = dataclasses.replace(config, seed=int(saved["inputs"]["seed"]), optim=resumed_optim(config.optim, ckpt))
        # its inputs, saved into this run's checkpoints, keep the rule's absence: it trained on the earlier split
        drawn_by_name(saved["inputs"], ckpt, draws=not config.data.val_source)
    dm = datamodule(config, job.device, saved or None)
    fresh = {
        "input_shape": list(dm.input_shape),
        "classes": dm.classes,
        "seed": int(config.seed),
        "held_out_rule": HELD_OUT_RULE,  # how the seed draws the validation split: an earlier ONN's lacks it
    }
    inputs = saved["inputs"] if saved else fresh
    if job.plan.strategy == "sparse_lora":  # before the weights are built: as planned, the heap keeps no activations
        hold_mmap_threshold()
    module = build(config, inputs, streaming_store(config, job.plan, run_dir, job.device))
    callbacks = _callbacks(config, run_dir)
    clock = next(c for c in callbacks if isinstance(c, StepClock))
    streaming = streaming_strategy(config, job.plan, job.run_dir, job.device, NoisePrediction())
    # one rank's share (the val_check_interval cap, the schedule's length): the data module, before the trainer
    # exists, counts all the data as one process's
    steps_per_epoch = process_batches(dm.train_dataloader(), 1 if streaming is not None else processes(config))
    trainer = build_trainer(config, job.plan, run_dir, callbacks, strategy=streaming, steps_per_epoch=steps_per_epoch)
    module.optimizer_steps = optimizer_steps(trainer, steps_per_epoch, per_process=True)
    with PeakMemory(job.device) as peak:
        trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt) if ckpt else None)
        trainer.save_checkpoint(str(run_dir / "checkpoints" / "last.ckpt"), weights_only=False)  # said: no log line
    writes = is_rank_zero()  # the other processes of a multi-process run trained the same weights
    best = shared_best(trainer, ckpt, run_dir, MONITOR, "min")[0]  # rank 0 copies a resumed run's in
    metrics: dict[str, Any] = {
        "epochs": trainer.current_epoch,
        "steps": trainer.global_step,
        "train/loss_initial": float(module.train_losses[0]) if module.train_losses else None,
        "train/loss_final": module.final_loss(),
        "val/history": module.history,
        "val/loss_final": module.history[-1][MONITOR] if module.history else None,
        "samples_per_s": clock.samples_per_s(skip=min(2, len(clock.step_s) - 1)),
        "peak_memory_mb": round(peak.peak_mb, 1),
        "params_total": sum(p.numel() for p in module.denoiser.parameters()),
        "checkpoint": str(run_dir / "checkpoints" / "last.ckpt"),
        "checkpoint_best": best,
        "resumed_from": str(ckpt) if ckpt else None,
        "items_skipped": len(dm.skipped),
    }
    if module.engine is not None:  # samples and exports from the checkpoint's weights, resident (docs/streaming.md)
        module.engine.close()
        module = load_trained(config, run_dir / "checkpoints" / "last.ckpt", checked=False)
        metrics["streaming"] = {"chunk_size": job.plan.streaming.chunk_size, "store": job.plan.streaming.store}
    metrics.update(sample_grid(config, module, run_dir, torch.device(job.device)))
    if writes and config.export.name != "none":
        export_after_training(metrics, run_dir, lambda: export_module(config, module, run_dir))
    return metrics


def sample_grid(config: ONNConfig, module: DiffusionModule, run_dir: Path, device: torch.device) -> dict[str, Any]:
    """task.samples images drawn as task.sampler, task.sample_steps and task.seed say: samples.png (a grid) and
    samples.safetensors (every image, uint8). In a multi-process run rank 0 alone draws and writes them (every rank
    wrote the same files at once; drawing is no collective) and every rank gives the same figures."""
    from safetensors.torch import save_file

    task: TrainTask = config.task
    picture = run_dir / "samples.png"
    metrics = {"samples/picture": str(picture), "samples/count": task.samples, "samples/seed": task.seed}
    if not is_rank_zero():  # (draw_samples gives task.samples images)
        return metrics
    images = draw_samples(config, module, device)
    write_sample_grid(images, picture)
    save_file({"images": images.contiguous()}, str(run_dir / "samples.safetensors"))
    log.info("%d samples (%s, seed %d) in %s", len(images), task.sampler, task.seed, picture)
    return metrics


def draw_samples(config: ONNConfig, module: DiffusionModule, device: torch.device) -> torch.Tensor:
    task: TrainTask = config.task
    if task.samples < 1:
        raise UserError(f"task.samples={task.samples}: give the number of images to draw, 1 or more.")
    # ddpm takes every timestep: its task.sample_steps is unread (DiffusionModality.check checks ddim's)
    if task.sampler == "ddim" and task.sample_steps < 1:
        raise UserError(f"task.sample_steps={task.sample_steps}: ddim takes 1 or more steps of the noise schedule.")
    model: DenoiserConfig = typed(DenoiserConfig, module.onn_config["model"], "the denoiser's model config")
    scheduler = sampling_scheduler(model, task.sampler, task.sample_steps)
    shape = list(module.onn_config["inputs"]["input_shape"])
    return draw(module.sampling_denoiser(), scheduler, task.samples, shape, task.seed, device)


def infer(job: Job) -> dict[str, Any]:
    if job.ckpt is None:
        raise UserError("task=infer on diffusion data needs ckpt=RUN_DIR (a trained denoiser) to draw images from.")
    module = load_trained(job.config, job.ckpt)
    metrics = sample_grid(job.config, module, job.run_dir, torch.device(job.device))
    if is_rank_zero():  # (the one process that wrote them)
        print(f"wrote {metrics['samples/count']} samples: {metrics['samples/picture']}")
    return metrics


def export(job: Job) -> dict[str, Any]:
    """The checkpoint's denoiser (its moving average), or without one a random-weights denoiser of the config."""
    if job.ckpt is not None:
        module = load_trained(job.config, job.ckpt)
    else:
        module = build(job.config, {"input_shape": planned_shape(job.config), "classes": [], "seed": job.config.seed})
    return export_module(job.config, module, job.run_dir)


def export_module(config: ONNConfig, module: DiffusionModule, run_dir: Path) -> dict[str, Any]:
    """The averaged denoiser as ONNX (inputs `sample` [batch, C, H, W] and `timestep` [batch] int64; output the
    predicted noise), checked against PyTorch in onnxruntime; or its state dict as safetensors. Rank 0 alone writes
    it where a launcher runs the command in several processes (each wrote the same folder at once)."""
    from onn.export.write import export_for_run

    if config.export.name not in ("onnx", "safetensors"):
        raise UserError(f"export={config.export.name}: a diffusion denoiser exports onnx or safetensors.")
    if not is_rank_zero():
        return {}
    denoiser = module.averaged_denoiser().cpu().eval()  # the float32 average, not a bf16 copy of it
    if config.export.name == "safetensors":
        import json

        from safetensors.torch import save_model

        from onn.export.folders import write_atomically

        def write(folder: Path) -> None:
            save_model(denoiser, str(folder / "model.safetensors"), metadata={"format": "pt"})
            (folder / "config.json").write_text(json.dumps(module.onn_config, indent=2, default=str))

        folder = Path(config.export.output or run_dir / "export" / "safetensors").expanduser()
        if not config.export.output:
            folder.parent.mkdir(parents=True, exist_ok=True)
        # an earlier export's folder (of this model) only, replaced whole
        write_atomically(folder, "denoiser", write, config.model.name)
        return {"export/format": "safetensors", "export/path": str(folder)}
    batch = int(config.export.sample.batch_size)
    generator = torch.Generator().manual_seed(int(config.seed))
    shape = module.onn_config["inputs"]["input_shape"]
    steps = int(module.onn_config["model"]["train_timesteps"])
    sample = {
        "sample": torch.randn(batch, *shape, generator=generator),
        "timestep": torch.randint(0, steps, (batch,), generator=generator),
    }
    return export_for_run(config, denoiser, run_dir, sample)
