"""Plan -> objects -> Trainer for causal language models: train, eval, infer and export."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from onn.config import ONNConfig, as_dict
from onn.config.data import TextData
from onn.config.model import LanguageModelConfig
from onn.config.strategy import StreamingConfig
from onn.config.task import EvalTask, InferTask, TrainTask
from onn.data.files import write_jsonl
from onn.data.resident import HELD_OUT_RULE, drawn_by_name
from onn.dtypes import torch_dtype
from onn.errors import UserError, write_refused
from onn.export.write import export_after_training, export_for_run
from onn.hardware.cluster import compute_device, is_rank_zero
from onn.hardware.memory import PeakMemory
from onn.modalities.base import Job
from onn.modalities.text.datamodule import SampleTrace, TextDataModule
from onn.modalities.text.generate import (
    LanguageModel,
    answer_scores,
    answer_tokens,
    check_context,
    complete,
    prompt_of,
    read_prompts,
    stream,
)
from onn.modalities.text.modality import check_max_length
from onn.modalities.text.module import CausalLM, summarize_losses
from onn.modalities.text.prompts import Prompter
from onn.modalities.text.stream_loader import check_resume
from onn.models.layers import discover
from onn.models.load import (
    converted_gguf,
    expand,
    finish_tokenizer,
    hub_folder,
    load,
    load_4bit,
    model_fingerprint,
    random_base,
    source_kind,
    tokenizer_from,
)
from onn.planning.plan import Plan
from onn.planning.streaming import STREAMING_KEYS
from onn.streaming.loader import load_into_store
from onn.streaming.strategy import (
    EngineSettings,
    LayerStreamingDDPStrategy,
    LayerStreamingStrategy,
    build_engine,
    layer_store,
)
from onn.training.callbacks import RandomState, ResourceMonitor, StepCheckpoint, StepClock
from onn.training.checkpoints import (
    check_finite,
    check_random_base,
    check_state,
    read_meta,
    resumed_optim,
    saved_config,
    state_shapes,
)
from onn.training.checkpoints import load as load_checkpoint
from onn.training.distributed import forward_is_collective, gathered, parameter_count
from onn.training.lora import apply
from onn.training.trainer import build_trainer, limited_batches, processes_per_node, streamed_compute_dtype

log = logging.getLogger("onn")
SHORT_ANSWER_TOKENS = 32  # exact match after training only where generating answers is cheap
AUTO_NEW_TOKENS_MARGIN = 16  # task.max_new_tokens=auto: the longest reference answer plus this
MAX_AUTO_NEW_TOKENS = 1024
EMPTY_HINT = (
    "its first token was end-of-text, or it wrote only blank space; a chat model answers in its chat format: "
    "check data.chat_template and task.template"
)


def build(config: ONNConfig, plan: Plan) -> tuple[CausalLM, Any]:
    """The LightningModule and tokenizer the plan describes (weights loaded, strategy applied)."""
    torch.manual_seed(config.seed)
    model_cfg, cache = config.model, config.paths.cache
    dtype = weights_dtype(config, plan)
    settings = streaming_settings(config, plan)
    loaded, store, device = None, None, "cpu"
    if settings:  # block by block into the store: the whole model never has to fit in memory
        device = compute_device(plan.hardware["accelerator"])
        store = layer_store(settings, store_root(config), device)
        loaded = load_into_store(model_cfg, dtype, cache, store, device)
    drawn = random_base(model_cfg, store.kind if loaded is not None else None, device)
    if plan.strategy == "qlora":
        loaded = load_4bit(model_cfg, dtype, cache, compute_device(plan.hardware["accelerator"]))
    model, tokenizer = loaded or load(model_cfg, dtype=dtype, cache_dir=cache)
    layer_map = discover(model, model_cfg.layer_map.blocks)
    model = apply(model, plan.strategy, config.strategy, layer_map, plan.sparse_layers)
    if plan.gradient_checkpointing:
        checkpoint_activations(model)
    # Save what rebuilds this exact model into every checkpoint: the planned strategy, not "auto".
    strategy = dataclasses.replace(config.strategy, name=plan.strategy, micro_batch=plan.micro_batch)
    if plan.sparse_layers is not None:
        strategy.layers = plan.sparse_layers
    if settings:  # the base the adapters trained on: eval, infer and export of the checkpoint stream the same one
        streaming = strategy.streaming or StreamingConfig()
        strategy.streaming = dataclasses.replace(streaming, store_dtype=settings.store_dtype)
    # plain dicts: a checkpoint holds data, and app.from_checkpoint types them again
    saved = {
        "seed": int(config.seed),  # the held-out split and training order: a resume and task=eval keep them
        "held_out_rule": HELD_OUT_RULE,  # how the seed draws that split: an earlier ONN's checkpoint lacks it
        "model": as_dict(model_cfg),
        "strategy": as_dict(strategy),
        "data": as_dict(config.data),
        "optim": as_dict(config.optim),  # what a resumed run's optimizer state belongs to (resumed_optim)
    }
    module = CausalLM(
        model,
        config.optim,
        config.trainer.max_steps,
        {**saved, "modality": "text"},
        plan.micro_batch,
        config.strategy.min_micro_batch,
        tbptt_steps(config),
    )
    module.store, module.random_base = store, drawn
    return module, tokenizer


def checkpoint_activations(model) -> None:
    """Each block recomputed in the backward: transformers 5's activation_checkpointing_enable, or on older ones
    gradient_checkpointing_enable, which transformers 5 keeps as an alias that prints a FutureWarning every run."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def trained_seed(config: ONNConfig, ckpt: Path | None) -> ONNConfig:
    """The config with the seed `ckpt`'s run trained with: it picks the held-out split and the training order, so
    a resumed run trains on in that order and task=eval scores the records that run held out (a checkpoint an
    earlier ONN wrote saved none: config.seed). As classification, diffusion and pairs do, it replaces seed=."""
    saved = saved_config(ckpt) if ckpt is not None else {}
    if "seed" not in saved:
        return config
    data: TextData = config.data  # a built-in generator's val set is its own, drawn by no rule
    drawn_by_name(saved, ckpt, draws=not data.val_source and not str(data.source).startswith("builtin:"))
    if int(saved["seed"]) != config.seed:
        log.info("ckpt %s trained with seed=%s: its held-out split and order are used", ckpt, saved["seed"])
    return dataclasses.replace(config, seed=int(saved["seed"]))


def validated_first(config: ONNConfig, ckpt: Path | None) -> bool:
    """Whether the run validated before its first step (its first val loss is val/loss_initial): task.validate_before,
    or a resumed run's checkpoint's, which says so (one an earlier ONN wrote does not: it had the default, true)."""
    if ckpt is None:
        return bool(config.task.validate_before)
    return bool(saved_config(ckpt).get("validated_before", True))


def tbptt_steps(config: ONNConfig) -> int:
    """task.tbptt_steps of a training run; 0 (whole sequences) for the tasks that have no such key (bench, tune)."""
    return config.task.tbptt_steps if isinstance(config.task, TrainTask) else 0


def check_tbptt(config: ONNConfig, module: CausalLM) -> None:
    """task.tbptt_steps needs a model whose state can be carried from chunk to chunk, resident."""
    steps = tbptt_steps(config)
    if steps and (module.store is not None or not getattr(module.model, "carries_state", False)):
        what = "is layer-streamed" if module.store is not None else "carries none (a transformer attends instead)"
        raise UserError(
            f"task.tbptt_steps={steps}: truncated backpropagation carries a recurrent model's state from one chunk "
            f"to the next, and model '{config.model.name}' {what}; set task.tbptt_steps=0, or train a recurrent "
            "model (model=char_lstm) with strategy=full."
        )


def weights_dtype(config: ONNConfig, plan: Plan) -> torch.dtype:
    """model.dtype, or the plan's choice when it is auto."""
    dtype = config.model.dtype
    return torch_dtype(plan.weights_dtype if dtype in (None, "auto") else dtype)


def streaming_settings(
    config: ONNConfig, plan: Plan, generate: bool = False, sequences: int | None = None
) -> EngineSettings | None:
    """The streaming engine's settings: the config's, with `auto` filled in from the plan; None when not
    streaming. `generate`: for generation only (task=infer), which streams one block at a time and
    gives the memory training needs to cached blocks; `sequences`: generated together, when fewer than
    the plan's generate_batch (the room of the others goes to cached blocks too). A plan's sparse_lora streams
    unless another Lightning strategy was named, which the plan sized resident (its `streaming` is None):
    strategy=auto choosing it for a model LoRA cannot fit trained it resident, and smollm2_135m on a 900 MB
    budget peaked at 1,930 MB."""
    if plan.streaming is None or plan.strategy != "sparse_lora":
        return None
    fixed, s = config.strategy.streaming or StreamingConfig(), plan.streaming
    given = as_dict(fixed)
    chosen = {key: getattr(s, key) if given[key] in (None, "auto") else given[key] for key in STREAMING_KEYS}
    # Mixed precision computes the matmuls in the plan's compute dtype anyway: frozen weights streamed in
    # it skip a decode to the model's float32 and autocast's cast back (a bf16 store on a CPU: zero-copy).
    settings = EngineSettings(
        **chosen,
        prefetch=fixed.prefetch,
        suffix_rows=s.suffix_rows,
        compute_dtype=streamed_compute_dtype(plan),
        blocks_path=config.model.layer_map.blocks,  # the blocks build() loaded into the store and adapted
    )
    if generate:
        settings.chunk_size = settings.chunk_size if fixed.chunk_size not in (None, "auto") else 1
        if fixed.cache_blocks in (None, "auto"):
            cache = s.generate_cache_blocks
            on_host = settings.store == "disk" and plan.hardware["accelerator"] != "cuda"
            if on_host and sequences is not None and sequences < s.generate_batch and s.block_mb:
                unused = (s.generate_batch - sequences) * s.generate_sequence_mb + s.generate_spare_mb
                cache += int(unused // s.block_mb)
            settings.cache_blocks = min(cache, plan.model["blocks"])
    return settings


def generate_batch(plan: Plan, samples: int) -> int:
    """Prompts generated together: streamed, as many as memory allows (each chunk load serves them all)."""
    streaming = plan.streaming
    return max(1, min(samples, int(streaming.generate_batch or 16))) if streaming else 16


def store_root(config: ONNConfig) -> Path:
    """Where this model's layer stores live: one folder per frozen-weights fingerprint."""
    return Path(config.paths.cache) / "stores" / model_fingerprint(config.model)


def datamodule(config: ONNConfig, tokenizer, stage: str = "fit", trained_layout: str | None = None) -> TextDataModule:
    """The data, its prompts built in `trained_layout` where a checkpoint says how the model learned them (eval)."""
    # Whole macro-batches: the module splits them into micro-batches itself.
    dm = TextDataModule(config.data, tokenizer, config.data.batch_size, seed=config.seed, trained_layout=trained_layout)
    dm.setup(stage)
    return dm


def trainer(
    config: ONNConfig,
    plan: Plan,
    run_dir: Path,
    callbacks: list,
    loggers: bool = True,
    steps_per_epoch: int | None = None,
):
    """The Trainer for a language model: the layer-streaming strategy when the plan streams (its data-parallel
    form with several processes). Each process takes its own slice of every global batch (TextDataModule)."""
    strategy = None
    processes = processes_per_node(config.trainer) * config.trainer.num_nodes
    if (settings := streaming_settings(config, plan)) and processes > 1:
        from datetime import timedelta

        timeout = timedelta(seconds=config.strategy.timeout_s)
        strategy = LayerStreamingDDPStrategy(settings, store_root(config), plan.micro_batch, timeout=timeout)
    elif settings:
        device = compute_device(plan.hardware["accelerator"])
        strategy = LayerStreamingStrategy(settings, store_root(config), plan.micro_batch, device=device)
    elif config.strategy.lightning == "streaming":
        strategy = "auto"  # sparse_lora that the plan did not choose to stream
    return build_trainer(
        config,
        plan,
        run_dir,
        callbacks,
        strategy=strategy,
        loggers=loggers,
        steps_per_epoch=steps_per_epoch,
        distributed_sampler=False,
    )


def check_positions(config: ONNConfig, module: CausalLM) -> None:
    """data.max_length within the positions of the model as built: a Python builder's, a folder's or a GGUF's
    config is only known here (TextModality.check read model.architecture's)."""
    positions = getattr(getattr(module.model, "config", None), "max_position_embeddings", None)
    check_max_length(config, positions, "its config's max_position_embeddings")


def load_weights(module: CausalLM, ckpt: Path, task: str | None) -> None:
    """A checkpoint's trained weights into a freshly built module (its frozen base came from model.source). With
    `task` (eval, infer, export) weights that hold NaN or inf are refused: every token's scores would be NaN. None:
    the caller checks (serve's startup). Training resumes through Lightning, not here. A layer-streamed model's
    frozen blocks are in its store, not read here: the checkpoint's own weights (adapters, head) are resident."""
    check_state(module, state_shapes(ckpt), ckpt, loads_frozen=module.strict_loading)
    check_random_base(ckpt, module.random_base)
    module.load_state_dict(load_checkpoint(ckpt)["state_dict"], strict=False)
    if task is not None:
        check_finite(module, f"ckpt {ckpt}", task)


def early_tokenizer(model_cfg: LanguageModelConfig, cache_dir) -> Any | None:
    """The tokenizer, when it can be had without the model (byte, a tokenizer folder, an HF folder or a
    converted GGUF): the data is then read and checked before a long model or store build starts."""
    source, remote = model_cfg.source, model_cfg.trust_remote_code
    if model_cfg.tokenizer:
        return finish_tokenizer(model_cfg, None, remote)
    folder = {
        "folder": lambda: expand(source),
        "hub": lambda: hub_folder(source),
        "gguf": lambda: converted_gguf(source, cache_dir),
    }.get(source_kind(source), lambda: None)()
    tokenizer = tokenizer_from(folder, remote) if folder else None
    return finish_tokenizer(model_cfg, tokenizer, remote) if tokenizer is not None else None


def run_steps(config: ONNConfig, dm: TextDataModule) -> int:
    """The optimizer steps this run trains, which its schedule is sized for: trainer.max_steps, or fewer where
    trainer.max_epochs ends the run first (an epoch: one pass over the training records in global batches, or
    trainer.limit_train_batches of them).
    Lightning ends a streamed run's epochs itself; resident data is one endless shuffled stream, whose epochs
    only this count ends."""
    steps, epochs = config.trainer.max_steps, config.trainer.max_epochs
    if epochs < 1:
        return steps
    per_epoch = dm.steps_per_epoch or math.ceil(dm.train_records / dm.batch_size)
    per_epoch = limited_batches(per_epoch, config.trainer.limit_train_batches)  # Lightning ends each epoch there
    if 0 < steps <= per_epoch * epochs:
        return steps
    log.info(
        "trainer.max_epochs=%d: %d optimizer steps an epoch (%d training records, data.batch_size=%d): training "
        "ends after step %d",
        epochs,
        per_epoch,
        dm.train_records,
        dm.batch_size,
        per_epoch * epochs,
    )
    return per_epoch * epochs


def check_resumable(config: ONNConfig, dm: TextDataModule, steps: int, ckpt: Path | None) -> int:
    """The step a resumed run starts at (0 from the start), checked before fit, where Lightning would train nothing
    without a word (a run that ends before it) or bury the data stream's sentence under its own teardown error ("Please
    call iter(combined_loader) first"): the streamed file and data.num_workers are the checkpoint's."""
    if ckpt is None:
        return 0
    meta = read_meta(ckpt)
    done = int(meta.get("global_step") or 0)
    if steps < done:
        trainer = config.trainer
        key = f"trainer.max_steps={trainer.max_steps}"
        if steps != trainer.max_steps:
            key = f"trainer.max_epochs={trainer.max_epochs} ({steps} optimizer steps)"
        raise UserError(
            f"{key} ends the run before step {done}, where ckpt={ckpt} was written: give trainer.max_steps={done} or "
            "more to train on from it, or leave out ckpt= to train a new run."
        )
    states = meta.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader") or []
    for state in states:
        if isinstance(state, dict) and "onn_workers" in state:  # a streamed run's loader (StreamLoader)
            if dm.stream is None:
                raise UserError(
                    f"ckpt={ckpt} streamed data.source (data.streaming) and this run holds it in memory: resume "
                    "with data.streaming=true."
                )
            check_resume(state, dm.stream, dm.cfg.num_workers)
    return done


def keep_resumed(ckpt: Path, step: int, target: Path) -> None:
    """A resumed run that had nothing left to train (its checkpoint at the step where it ends) says so, and its run
    folder gets the checkpoint it resumed as its last.ckpt, which is that run's state (the data stream's position
    included; a save after fit would not hold it): metrics.json's `checkpoint` names a checkpoint that exists. Copied
    beside and renamed into place, as every checkpoint is written."""
    log.warning(
        "nothing left to train: ckpt=%s was written at step %d, where this run ends, and is copied to %s (raise "
        "trainer.max_steps, or trainer.max_epochs, to train further)",
        ckpt,
        step,
        target,
    )
    if target.exists():  # a sweep's job resumed in its own folder: the checkpoint is there already
        return
    partial = target.with_name(target.name + ".tmp")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(ckpt, partial)
        for name in partial.iterdir():  # on the disk before the rename makes them the checkpoint
            with open(name, "rb") as f:
                os.fsync(f.fileno())
        partial.rename(target)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise write_refused(e, target, None, "checkpoints (hydra.run.dir)") from None


def exact_match_after_training(job: Job, fit, module: CausalLM, dm: TextDataModule, tokenizer, writes: bool):
    """val/exact_match of the trained model on task.exact_match_samples held-out answers; rank 0 answers, or every
    rank where the forward is a collective (else rank 0 would wait for the others)."""
    config = job.config
    samples = config.task.exact_match_samples if writes or forward_is_collective(fit) else 0
    if not samples or not any(p for p, _ in dm.val_examples):
        return {}
    if dm.max_answer_tokens > SHORT_ANSWER_TOKENS:
        log.info("answers run to %d tokens: skipping exact match after training; run task=eval", dm.max_answer_tokens)
        return {}
    try:
        new = answer_room(module, dm, tokenizer, samples, dm.max_answer_tokens + 2, auto=True)
    except UserError as e:  # a held-out prompt fills the context: the trained model is kept, exact match is not run
        log.warning("skipping exact match after training: %s", e)
        return {}
    with gathered(module):  # ZeRO-3's partitioned weights, whole for generation
        return held_out_scores(job, module, dm, tokenizer, samples, new)


def answer_room(module: CausalLM, dm: TextDataModule, tokenizer, samples: int, new: int, auto: bool) -> int:
    """The new tokens exact match generates after the first `samples` held-out prompts: `new`, cut (`auto`) to what
    the longest prompt leaves of the model's context, as infer cuts task.max_new_tokens=auto; a set length that
    passes the context is one sentence (generate.check_context)."""
    prompts = [p for p, _ in dm.val_examples[:samples]]
    places = [f"held-out {where}" for where in dm.val_where[:samples]]
    prompter = dm.prompter
    room = check_context(
        module.model, tokenizer, prompts, places, new, prompter.add_special_tokens, auto, prompter.starts_with_bos
    )
    needed = answer_tokens(tokenizer, dm.val_examples[:samples])  # `new` has a margin on top: it may be cut into
    if room < needed:  # every longer answer is cut: a final "#### N" past the cut scores 0 without a word
        why = (
            "what the longest held-out prompt leaves of the model's context; use a model with a longer context or "
            "shorter prompts"
            if room < new
            else f"auto's most ({MAX_AUTO_NEW_TOKENS})"
            if auto
            else f"task.max_new_tokens={new}; raise it, or set auto"
        )
        log.warning(
            "exact match generates %d new tokens, fewer than the %d the longest reference answer needs, so answers "
            "cut there score as not found: %s",
            room,
            needed,
            why,
        )
    return room


def held_out_scores(job: Job, module: CausalLM, dm: TextDataModule, tokenizer, samples: int, new: int):
    """val/exact_match and how the answers were read, on `samples` held-out prompts, as training encoded them."""
    module.model.to(job.device)  # Lightning's teardown left it on the CPU
    scores = answer_scores(
        module.model,
        tokenizer,
        dm.val_examples,
        job.config.data.answer_pattern,
        samples,
        new,
        engine=module.engine,
        batch_size=generate_batch(job.plan, samples),
        add_special_tokens=dm.prompter.add_special_tokens,
        turn_end=dm.prompter.answer_end,
        bos=dm.prompter.starts_with_bos,
    )
    return {f"val/{k}": v for k, v in scores.items()}


def train(job: Job) -> dict[str, Any]:
    config, plan, run_dir, ckpt = trained_seed(job.config, job.ckpt), job.plan, job.run_dir, job.ckpt
    if ckpt is not None:  # the optimizer's state in the checkpoint belongs to its settings
        config = dataclasses.replace(config, optim=resumed_optim(config.optim, ckpt))
    saves = StepCheckpoint(run_dir / "checkpoints", config.checkpoint.every_n_steps)  # checked before the builds
    early = early_tokenizer(config.model, config.paths.cache)
    dm = datamodule(config, early) if early is not None else None  # a data mistake costs a second, not a store build
    module, tokenizer = build(config, plan)
    if ckpt is not None and saved_config(ckpt).get("held_out_rule") != HELD_OUT_RULE:
        del module.onn_config["held_out_rule"]  # it trained on an earlier ONN's split: its checkpoints say so too
    check_positions(config, module)
    trainable = parameter_count(module)  # before fit: FSDP's ranks hold shards of them after it
    check_tbptt(config, module)
    if ckpt is not None:  # before Lightning restores it: a checkpoint of another model is one sentence
        check_state(module, state_shapes(ckpt), ckpt, loads_frozen=module.strict_loading)
        check_random_base(ckpt, module.random_base)
    dm = dm or datamodule(config, tokenizer)
    # in the checkpoint's config: infer and serve prompt as the model learned (chat messages without a chat
    # template: role lines)
    module.onn_config["prompt_layout"] = dm.prompter.layout_name
    module.max_steps = run_steps(config, dm)
    done = check_resumable(config, dm, module.max_steps, ckpt)
    config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, max_steps=module.max_steps))
    clock = StepClock()  # RandomState: dropout draws after a resume what it would have drawn
    callbacks = [saves, RandomState(), clock, ResourceMonitor(config.trainer.log_every_n_steps)]
    if config.data.trace:
        callbacks.append(SampleTrace(config.data.trace, tokenizer))
    fit = trainer(config, plan, run_dir, callbacks, steps_per_epoch=dm.steps_per_epoch)
    validated_before = validated_first(config, ckpt)
    module.onn_config["validated_before"] = validated_before  # in every checkpoint: a resumed run reads it
    writes = is_rank_zero()  # the other processes of a multi-process run trained the same weights
    with PeakMemory(job.device) as peak:
        if ckpt is None and config.task.validate_before:
            fit.validate(module, datamodule=dm, verbose=False)
        module.train()  # from_pretrained returns eval mode, and Lightning keeps the mode it is given
        fit.fit(module, datamodule=dm, ckpt_path=str(ckpt) if ckpt else None)
        if module.val_at_step != fit.global_step:
            fit.validate(module, datamodule=dm, verbose=False)
    if writes and getattr(module.model, "peft_config", None) and config.checkpoint.save_peft_adapter:
        # PEFT's own format: adapter_config.json + safetensors
        module.model.save_pretrained(str(run_dir / "adapter"))
        tokenizer.save_pretrained(str(run_dir / "adapter"))
    loss_initial, loss_final = summarize_losses(module.train_losses)
    metrics = {
        "steps": fit.global_step,
        "train/loss_initial": loss_initial,
        "train/loss_final": loss_final,
        "train/loss_curve": [round(x, 5) for x in module.train_losses],
        # before training: the validation task.validate_before runs (a resumed run's is in its checkpoint)
        "val/loss_initial": module.val_losses[0] if module.val_losses and validated_before else None,
        "val/loss_final": module.val_losses[-1] if module.val_losses else None,
        "val/perplexity": math.exp(min(module.val_losses[-1], 50)) if module.val_losses else None,
        "samples_per_s": clock.samples_per_s(),
        "peak_memory_mb": round(peak.peak_mb, 1),
        "params_trainable": trainable,
        "train/oom_backoffs": module.oom_backoffs,  # each halving of the micro-batch after out-of-memory
        "checkpoint": str(run_dir / "checkpoints" / "last.ckpt"),
        "resumed_from": str(ckpt) if ckpt else None,
    }
    if ckpt is not None and fit.global_step == done and writes:  # nothing trained: no last.ckpt was written here
        keep_resumed(ckpt, done, run_dir / "checkpoints" / "last.ckpt")
    metrics.update(data_metrics(dm))
    if module.engine is not None:  # what the streaming engine did to its blocks' activations
        metrics["streaming/mlps_sliced"] = module.engine.tiled_mlps
        metrics["streaming/norms_recomputed"] = module.engine.recomputed_norms
        metrics["streaming/dropout_replayed"] = module.engine.dropout
        # the frozen weights the losses (and an export) are of: a lossy store's, not model.source's
        metrics["streaming/store_dtype"] = module.engine.store.dtype
    metrics.update(exact_match_after_training(job, fit, module, dm, tokenizer, writes))
    if writes and config.export.name != "none":
        model, engine = module.model, module.engine
        export_after_training(
            metrics, run_dir, lambda: export_for_run(config, model, run_dir, tokenizer=tokenizer, engine=engine)
        )
    return metrics


def evaluate(job: Job) -> dict[str, Any]:
    config, plan, ckpt = trained_seed(job.config, job.ckpt), job.plan, job.ckpt
    module, tokenizer = build(config, plan)
    check_positions(config, module)
    if ckpt is not None:
        load_weights(module, ckpt, config.task.name)
    else:
        log.warning("task=eval without ckpt: evaluating the model as loaded from model.source")
    dm = datamodule(config, tokenizer, stage="validate", trained_layout=trained_layout(ckpt))
    task = config.task
    answers = any(p for p, _ in dm.val_examples)
    if answers:  # checked before the validation pass: a set length past the context is said now
        new = new_tokens(task, tokenizer, dm.val_examples[: task.max_samples])
        new = answer_room(module, dm, tokenizer, task.max_samples, new, auto=task.max_new_tokens == "auto")
    trainer(config, plan, job.run_dir, [], loggers=False).validate(module, datamodule=dm, verbose=False)
    loss = module.val_losses[-1]
    metrics = {
        "val/loss": loss,
        "val/perplexity": math.exp(min(loss, 50)),
        "checkpoint": str(ckpt) if ckpt else None,
        "params_trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
    }
    metrics.update(data_metrics(dm))
    if answers:
        metrics.update(held_out_scores(job, module, dm, tokenizer, task.max_samples, new))
    print(
        f"val loss {loss:.4f}  perplexity {metrics['val/perplexity']:.3f}  "
        f"exact match {metrics.get('val/exact_match', float('nan')):.3f} "
        f"({metrics.get('val/answer_extraction', 'no answers')})"
    )
    return metrics


def new_tokens(task: EvalTask | InferTask, tokenizer, examples: list[tuple[str, str]]) -> int:
    """task.max_new_tokens, or for `auto` room for the longest reference answer (GSM8K's worked answers run
    to ~200 tokens, and their `#### N` line comes last); with no references (infer), the most auto gives."""
    setting = task.max_new_tokens
    if setting == "auto":
        return (
            min(MAX_AUTO_NEW_TOKENS, answer_tokens(tokenizer, examples) + AUTO_NEW_TOKENS_MARGIN)
            if examples
            else MAX_AUTO_NEW_TOKENS
        )
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise UserError(f"task.max_new_tokens={setting!r}: give a whole number, 1 or more, or auto.")
    return setting


def data_metrics(dm: TextDataModule) -> dict[str, Any]:
    """What the data turned into: how many records, the layout chosen and what wraps the prompts."""
    layout = dm.prompter.layout
    return {
        "data/train_records": dm.train_records,
        "data/val_records": len(dm.val_examples),
        "data/streamed": dm.stream is not None,
        "data/layout": layout.name if layout else None,
        "data/mapping": layout.describe() if layout else None,
        "data/prompt_format": dm.prompter.prompt_format,
    }


def language_model(job: Job, checked: bool = True) -> LanguageModel:
    """The model ready to generate, as task=infer and task=serve use it: the checkpoint's weights (`checked`: refused
    when they hold NaN or inf), layer-streamed when the plan streams (each chunk load then serves every sequence,
    per token), and the prompt format the model was trained with (or its chat template)."""
    config, plan = job.config, job.plan
    module, tokenizer = build(config, plan)
    if job.ckpt is not None:
        load_weights(module, job.ckpt, config.task.name if checked else None)
    model, engine = module.model, None
    if settings := streaming_settings(config, plan, generate=True):
        engine = build_engine(model, settings, module.store, job.device, micro_batch=None)
    model.to(job.device)  # streamed: what is left after the blocks' frozen weights went to the store
    model.eval()
    prompter = Prompter(config.data, tokenizer, trained_layout(job.ckpt))
    return LanguageModel(model, tokenizer, prompter, engine)


def trained_layout(ckpt: Path | None) -> str | None:
    """The prompt layout the checkpoint's model learned (its saved prompt_layout): eval, infer and serve build
    prompts in it. None without a checkpoint, or for one written before prompt_layout was saved."""
    return saved_config(ckpt).get("prompt_layout") if ckpt is not None else None


def serving(job: Job) -> LanguageModel:
    """What task=serve answers with: language_model's model, whose KV cache continuous batching shares out."""
    lm = language_model(job, checked=False)  # serve's startup checks every served model, ckpt or model.source
    if getattr(lm.model, "carries_state", False):
        raise UserError(
            f"task=serve decodes requests together through a KV cache, and model '{job.config.model.name}' is "
            "recurrent (it carries a state instead): generate with task=infer."
        )
    return lm


def infer(job: Job) -> dict[str, Any]:
    config, task = job.config, job.config.task
    if not task.input and not config.prompt:
        raise UserError('task=infer needs prompt="..." or task.input=prompts.jsonl.')
    # checked before the model loads and generates; prompt= streams to the terminal and writes task.output if given
    output = predictions_path(job) if task.input or task.output else None
    lm = language_model(job)
    try:
        return _infer(job, lm, output)
    finally:  # a streamed model's loader threads and read buffers: not needed past the task
        if lm.engine is not None:
            lm.engine.close()


def _infer(job: Job, lm: LanguageModel, output: Path | None) -> dict[str, Any]:
    """task=infer's generation with the model built: task.input's prompts to `output`, or the one prompt streamed
    (and written to `output`, task.output, when given)."""
    config, task = job.config, job.config.task
    model, tokenizer, engine, prompter = lm.model, lm.tokenizer, lm.engine, lm.prompter

    def wrap(text: str, row: dict[str, Any] | None = None, where: str = "prompt") -> str:
        return prompter.render(text, row, where) if task.template else text

    special = prompter.add_special_tokens if task.template else True  # as training encoded the prompts it wraps
    bos = prompter.starts_with_bos and task.template  # plain text: BOS first, as training began every text
    gen = {
        "max_new_tokens": new_tokens(task, tokenizer, []),
        "temperature": task.temperature,
        "top_p": task.top_p,
        "add_special_tokens": special,
        "bos": bos,
        "turn_end": prompter.answer_end,  # how the model was trained ended its answers: serve stops there too
    }
    # the sampling draws from task.seed, as diffusion's images do: the same checkpoint, prompt and seed, the same text
    torch.manual_seed(task.seed)
    auto = task.max_new_tokens == "auto"
    said = {"infer/prompt_format": prompter.prompt_format if task.template else "none (task.template=false)"}
    if task.input:
        rows = read_prompts(task.input)
        prompts = [wrap(prompter.row_prompt(r, w) or prompt_of(r), r, w) for r, w in zip(rows, rows.where)]
        places = [f"task.input {w}" for w in rows.where]
        gen["max_new_tokens"] = check_context(
            model, tokenizer, prompts, places, gen["max_new_tokens"], special, auto, bos
        )
        completions = complete(model, tokenizer, prompts, engine=engine, **gen)
        write_jsonl(prediction_rows(rows, completions, task.input), output)
        print(f"wrote {len(rows)} completions to {output}")
        empty = sum(not c.strip() for c in completions)
        if empty:
            log.warning(
                "%d of %d completions are empty or blank (%s)",
                empty,
                len(rows),
                EMPTY_HINT,
            )
        return {
            **said,
            "infer/prompts": len(rows),
            "infer/output": str(output),
            "infer/empty_completions": empty,
        }
    text = wrap(str(config.prompt))
    gen["max_new_tokens"] = check_context(
        model, tokenizer, [text], ["prompt"], gen["max_new_tokens"], special, auto, bos
    )
    completion = stream(model, tokenizer, text, engine=engine, **gen)
    if not completion.strip():
        log.warning("the completion is empty or blank (%s)", EMPTY_HINT)
    metrics = {
        **said,
        "infer/prompt": config.prompt,
        "infer/model_input": text,
        "infer/completion": completion,
        "infer/empty_completions": int(not completion.strip()),
    }
    if output is not None:  # task.output: the record task.input's rows get, for the one prompt
        write_jsonl([{"prompt": str(config.prompt), "completion": completion}], output)
        print(f"wrote the completion to {output}")
        metrics["infer/output"] = str(output)
    if engine is None:  # a resident model reads the whole text in one pass; a streamed one would load every block
        from onn.modalities.text.picture import token_probabilities, write_picture

        picture = job.run_dir / "tokens.png"
        write_picture(*token_probabilities(model, tokenizer, text, completion, special, bos), picture)
        print(f"wrote {picture}: each token coloured by the probability the model gave it")
        metrics["infer/picture"] = str(picture)
    return metrics


def prediction_rows(rows: list[dict[str, Any]], completions: list[str], source: str) -> list[dict[str, Any]]:
    """Each input row with its generation as `completion`; a `completion` the row already held (a reference
    answer) moves to `reference_completion` rather than being overwritten, with one warning for the file. A row
    that already has a `reference_completion` (an earlier run's predictions.jsonl) keeps it: its `completion` was
    that run's generation, dropped, where moving it overwrote the real reference."""
    out = []
    for row, completion in zip(rows, completions):
        row = dict(row)
        if "completion" in row and "reference_completion" not in row:
            row["reference_completion"] = row.pop("completion")
        out.append({**row, "completion": completion})
    if any("completion" in row for row in rows):
        log.warning(
            "task.input %s has a 'completion' field: predictions keep it as 'reference_completion' (a row that "
            "already has a 'reference_completion', an earlier run's predictions, keeps that one and its old "
            "'completion' is replaced) and write the generated text as 'completion'",
            source,
        )
    return out


def predictions_path(job: Job) -> Path:
    """Where task=infer writes its completions: task.output (~ expanded), else predictions.jsonl in the run folder.
    A folder there is refused now, not after every completion was generated."""
    task = job.config.task
    output = Path(task.output).expanduser() if task.output else job.run_dir / "predictions.jsonl"
    if output.is_dir():
        raise UserError(
            f"task.output={task.output} is a folder: give the file to write the completions to, e.g. "
            f"task.output={output / 'predictions.jsonl'}."
        )
    return output


def export(job: Job) -> dict[str, Any]:
    """task=export: the trained model from `ckpt` (built as it was trained, adapters and layer store
    included), or without one the model as model.source gives it."""
    config, plan = job.config, job.plan
    if job.ckpt is None:
        model, tokenizer = load(config.model, dtype=weights_dtype(config, plan), cache_dir=config.paths.cache)
        return export_for_run(config, model, job.run_dir, tokenizer=tokenizer)
    module, tokenizer = build(config, plan)
    load_weights(module, job.ckpt, config.task.name)
    engine = None
    if settings := streaming_settings(config, plan):
        settings.mlp_tiles = 1  # the exported graph computes each MLP whole
        engine = build_engine(module.model, settings, module.store, "cpu", micro_batch=None)
    try:
        return export_for_run(config, module.model, job.run_dir, tokenizer=tokenizer, engine=engine)
    finally:  # its loader threads and read buffers: not needed past the export
        if engine is not None:
            engine.close()
