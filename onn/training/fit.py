"""Plan -> objects -> Trainer: the train, eval and infer tasks."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from onn.errors import UserError

log = logging.getLogger("onn")
SHORT_ANSWER_TOKENS = 32  # exact match after training only where generating answers is cheap
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build(config: dict[str, Any], plan: dict[str, Any]):
    """The LightningModule and tokenizer the plan describes (weights loaded, strategy applied)."""
    from onn.models.layers import discover
    from onn.models.load import load
    from onn.strategies.lora import apply
    from onn.training.lm import CausalLM

    torch.manual_seed(int(config.get("seed", 0)))
    model_cfg = config["model"]
    dtype = weights_dtype(config, plan)
    settings = streaming_settings(config, plan)
    loaded = None
    if settings and settings["store"] == "disk":  # a model larger than memory: block by block into the store
        from onn.models.load import load_into_store
        from onn.strategies.lightning_strategy import layer_store

        loaded = load_into_store(
            model_cfg, dtype, config["paths"]["cache"], layer_store(settings, _store_root(config))
        )
    model, tokenizer = loaded or load(model_cfg, dtype=dtype, cache_dir=config["paths"]["cache"])
    layer_map = discover(model, (model_cfg.get("layer_map") or {}).get("blocks"))
    model = apply(model, plan["strategy"], config["strategy"], layer_map, plan.get("sparse_layers"))
    if plan.get("gradient_checkpointing") and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Save what rebuilds this exact model into every checkpoint: the planned strategy, not "auto".
    strategy = {**config["strategy"], "name": plan["strategy"], "micro_batch": plan["micro_batch"]}
    if plan.get("sparse_layers") is not None:
        strategy["layers"] = plan["sparse_layers"]
    onn_config = {"model": model_cfg, "strategy": strategy, "data": config["data"]}
    module = CausalLM(model, config["optim"], int(config["trainer"]["max_steps"]), onn_config, plan["micro_batch"],
                      int(config["strategy"].get("min_micro_batch") or 1))  # fmt: skip
    return module, tokenizer


def weights_dtype(config: dict[str, Any], plan: dict[str, Any]) -> torch.dtype:
    """model.dtype, or the plan's choice when it is auto."""
    dtype = config["model"].get("dtype", "auto")
    return DTYPES[plan["weights_dtype"] if dtype in (None, "auto") else dtype]


def streaming_settings(config: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any] | None:
    """The streaming engine's settings: the config's, with `auto` filled in from the plan; None when not streaming."""
    if config["strategy"].get("lightning") != "streaming" or plan["strategy"] != "sparse_lora":
        return None
    planned = plan.get("streaming") or {}
    settings = dict(config["strategy"].get("streaming") or {})
    from onn.hardware.plan import STREAMING_KEYS

    for key in STREAMING_KEYS:
        if settings.get(key) in (None, "auto"):
            settings[key] = planned[key]
    return settings


def _store_root(config: dict[str, Any]) -> Path:
    from onn.models.load import model_fingerprint

    return Path(config["paths"]["cache"]) / "stores" / model_fingerprint(config["model"])


def _device(plan: dict[str, Any]) -> str:
    return "cuda" if plan["hardware"]["accelerator"] == "cuda" else "cpu"


def _datamodule(config: dict[str, Any], plan: dict[str, Any], tokenizer):
    from onn.data.module import TextDataModule

    # Whole macro-batches: the module splits them into micro-batches itself.
    dm = TextDataModule(
        config["data"], tokenizer, int(config["data"]["batch_size"]), seed=int(config.get("seed", 0))
    )
    dm.setup()
    return dm


def _trainer(
    config: dict[str, Any], plan: dict[str, Any], run_dir: Path, callbacks: list, with_loggers: bool = True
):
    import lightning as L
    from hydra.utils import instantiate

    from onn.training.checkpoint_io import SafetensorsCheckpointIO

    kwargs = dict(config["trainer"])
    streaming = streaming_settings(config, plan)
    kwargs["precision"] = (
        plan["precision"] if kwargs.get("precision") in (None, "auto") else kwargs["precision"]
    )
    # The training stream is endless and a batch is a whole optimizer step, so validation is scheduled in steps.
    if isinstance(kwargs.get("val_check_interval"), int):
        kwargs["val_check_interval"] = min(kwargs["val_check_interval"], kwargs["max_steps"])
    loggers = (
        [instantiate(c, save_dir=str(run_dir)) for c in (config.get("tracking") or {}).get("loggers", [])]
        if with_loggers
        else []
    )
    strategy = config["strategy"].get("lightning", "auto") or "auto"
    if streaming:
        from onn.strategies.lightning_strategy import LayerStreamingStrategy

        strategy = LayerStreamingStrategy(
            streaming, _store_root(config), plan["micro_batch"], device=_device(plan)
        )
        kwargs["accelerator"] = _device(plan)
        kwargs["devices"] = 1
    elif strategy == "streaming":
        strategy = "auto"  # sparse_lora that the plan did not choose to stream
    return L.Trainer(default_root_dir=str(run_dir), logger=loggers or False, callbacks=callbacks, plugins=[SafetensorsCheckpointIO()],
                     strategy=strategy, enable_checkpointing=any(_is_ckpt_cb(c) for c in callbacks), **kwargs)  # fmt: skip


def _is_ckpt_cb(cb) -> bool:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return isinstance(cb, ModelCheckpoint)


def _load_weights(module, ckpt: Path) -> None:
    from onn.training.checkpoint_io import load

    state = load(ckpt)["state_dict"]
    missing, unexpected = module.load_state_dict(state, strict=False)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    if unexpected or (set(missing) & trainable):
        raise UserError(
            f"ckpt {ckpt} does not match the model it names: missing {sorted(set(missing) & trainable)[:3]}, unexpected {unexpected[:3]}."
        )


def train(config: dict[str, Any], plan: dict[str, Any], run_dir: Path, ckpt: Path | None) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from onn.hardware.memory import PeakMemory
    from onn.infer.generate import exact_match
    from onn.training.callbacks import ResourceMonitor, StepClock
    from onn.training.lm import summarize_losses

    module, tokenizer = build(config, plan)
    dm = _datamodule(config, plan, tokenizer)
    ckpt_cfg = config.get("checkpoint") or {}
    checkpointer = ModelCheckpoint(dirpath=str(run_dir / "checkpoints"), every_n_train_steps=int(ckpt_cfg.get("every_n_steps", 50)),
                                   save_top_k=0, save_last=True)  # fmt: skip
    clock = StepClock()
    monitor = ResourceMonitor(int(config["trainer"].get("log_every_n_steps", 10)))
    trainer = _trainer(config, plan, run_dir, [checkpointer, clock, monitor])
    accelerator = plan["hardware"]["accelerator"]
    with PeakMemory("cuda" if accelerator == "cuda" else "cpu") as peak:
        if ckpt is None and config["task"].get("validate_before", True):
            trainer.validate(module, datamodule=dm, verbose=False)
        module.train()  # from_pretrained returns eval mode, and Lightning keeps the mode it is given
        trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt) if ckpt else None)
        last = run_dir / "checkpoints" / "last.ckpt"
        trainer.save_checkpoint(str(last), weights_only=False)  # the final state, whatever the save interval
        if module.val_at_step != trainer.global_step:
            trainer.validate(module, datamodule=dm, verbose=False)
    if getattr(module.model, "peft_config", None) and ckpt_cfg.get("save_peft_adapter", True):
        # PEFT's own format: adapter_config.json + safetensors
        module.model.save_pretrained(str(run_dir / "adapter"))
        tokenizer.save_pretrained(str(run_dir / "adapter"))
    loss_initial, loss_final = summarize_losses(module.train_losses)
    metrics = {
        "steps": trainer.global_step,
        "train/loss_initial": loss_initial,
        "train/loss_final": loss_final,
        "train/loss_curve": [round(x, 5) for x in module.train_losses],
        "val/loss_initial": module.val_losses[0] if module.val_losses else None,
        "val/loss_final": module.val_losses[-1] if module.val_losses else None,
        "val/perplexity": math.exp(min(module.val_losses[-1], 50)) if module.val_losses else None,
        "samples_per_s": clock.samples_per_s(int(config["data"]["batch_size"])),
        "peak_memory_mb": round(peak.peak_mb, 1),
        "params_trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "checkpoint": str(last),
        "resumed_from": str(ckpt) if ckpt else None,
    }
    samples = int(config["task"].get("exact_match_samples", 0) or 0)
    if samples and any(p for p, _ in dm.val_examples) and dm.max_answer_tokens > SHORT_ANSWER_TOKENS:
        log.info(
            "answers run to %d tokens: skipping exact match after training; run task=eval for it",
            dm.max_answer_tokens,
        )
    elif samples and any(p for p, _ in dm.val_examples):
        metrics["val/exact_match"] = exact_match(module.model, tokenizer, dm.val_examples, config["data"].get("answer_pattern"), samples,
                                                 max_new_tokens=dm.max_answer_tokens + 2, engine=module.engine)  # fmt: skip
    if (config.get("export") or {}).get("name") not in (None, "none"):
        metrics.update(export_trained(config, module.model, tokenizer, run_dir, module.engine))
    return metrics


def evaluate(
    config: dict[str, Any], plan: dict[str, Any], run_dir: Path, ckpt: Path | None
) -> dict[str, Any]:
    from onn.infer.generate import exact_match

    module, tokenizer = build(config, plan)
    if ckpt is not None:
        _load_weights(module, ckpt)
    else:
        log.warning("task=eval without ckpt: evaluating the model as loaded from model.source")
    dm = _datamodule(config, plan, tokenizer)
    trainer = _trainer(config, plan, run_dir, [], with_loggers=False)
    trainer.validate(module, datamodule=dm, verbose=False)
    loss = module.val_losses[-1]
    task = config["task"]
    metrics = {"val/loss": loss, "val/perplexity": math.exp(min(loss, 50)), "checkpoint": str(ckpt) if ckpt else None,
               "params_trainable": sum(p.numel() for p in module.parameters() if p.requires_grad)}  # fmt: skip
    if any(p for p, _ in dm.val_examples):
        metrics["val/exact_match"] = exact_match(module.model, tokenizer, dm.val_examples, config["data"].get("answer_pattern"),
                                                 int(task.get("max_samples", 100)), int(task.get("max_new_tokens", 24)), engine=module.engine)  # fmt: skip
    print(
        f"val loss {loss:.4f}  perplexity {metrics['val/perplexity']:.3f}  exact match {metrics.get('val/exact_match', float('nan')):.3f}"
    )
    return metrics


def infer(config: dict[str, Any], plan: dict[str, Any], run_dir: Path, ckpt: Path | None) -> dict[str, Any]:
    from onn.infer.generate import complete, read_prompts, stream, write_jsonl

    task = config["task"]
    module, tokenizer = build(config, plan)
    if ckpt is not None:
        _load_weights(module, ckpt)
    model = module.model
    engine = None
    settings = streaming_settings(config, plan)
    if settings:  # generate for models that don't fit: each chunk load serves every sequence, per token
        from onn.strategies.lightning_strategy import build_engine

        engine = build_engine(model, settings, _store_root(config), _device(plan), micro_batch=None)
        model.to(_device(plan))  # what is left after the blocks' frozen weights went to the store
    template = config["data"].get("template") or "{input}"

    def wrap(text: str) -> str:
        return template.replace("{input}", text) if task.get("template", True) else text

    gen = {"max_new_tokens": int(task.get("max_new_tokens", 64)), "temperature": float(task.get("temperature", 0.0)),
           "top_p": float(task.get("top_p", 1.0))}  # fmt: skip
    if task.get("input"):
        rows = read_prompts(task["input"])
        prompts = [str(r.get("prompt", r.get("input", r.get("question")))) for r in rows]
        completions = complete(model, tokenizer, [wrap(p) for p in prompts], engine=engine, **gen)
        output = Path(task.get("output") or run_dir / "predictions.jsonl")
        write_jsonl([{**r, "completion": c} for r, c in zip(rows, completions)], output)
        print(f"wrote {len(rows)} completions to {output}")
        return {"infer/prompts": len(rows), "infer/output": str(output)}
    if not config.get("prompt"):
        raise UserError('task=infer needs prompt="..." or task.input=prompts.jsonl.')
    completion = stream(model, tokenizer, wrap(str(config["prompt"])), engine=engine, **gen)
    return {"infer/prompt": config["prompt"], "infer/completion": completion}


def export(config: dict[str, Any], plan: dict[str, Any], run_dir: Path, ckpt: Path | None) -> dict[str, Any]:
    """task=export: the trained model from `ckpt` (built as it was trained, adapters and layer store
    included), or without one the model as model.source gives it."""
    if ckpt is None:
        from onn.models.load import load

        model, tokenizer = load(
            config["model"], dtype=weights_dtype(config, plan), cache_dir=config["paths"]["cache"]
        )
        return export_trained(config, model, tokenizer, run_dir)
    module, tokenizer = build(config, plan)
    _load_weights(module, ckpt)
    engine = None
    if settings := streaming_settings(config, plan):
        from onn.strategies.lightning_strategy import build_engine

        engine = build_engine(module.model, settings, _store_root(config), "cpu", micro_batch=None)
    return export_trained(config, module.model, tokenizer, run_dir, engine)


def export_trained(config: dict[str, Any], model, tokenizer, run_dir: Path, engine=None) -> dict[str, Any]:
    """Write the model in the `export` group's format (after training, or for task=export)."""
    from onn.export import export_model
    from onn.export.onnx_export import sample_inputs

    settings = dict(config["export"])
    settings["model_name"] = config["model"]["name"]
    kind = settings["name"]
    default = {"safetensors": "hf", "onnx": "model.onnx", "omny": "model.omny"}[kind]
    output = Path(settings.get("output") or run_dir / "export" / default)
    if not settings.get("output"):
        output.parent.mkdir(parents=True, exist_ok=True)
    sample = None
    if kind != "safetensors":
        shape = settings.get("sample") or {}
        sample = sample_inputs(_plain(model), int(shape.get("batch_size", 2)), int(shape.get("sequence_length", 16)),
                               shape.get("image_size"), seed=int(config.get("seed", 0)))  # fmt: skip
    metrics = export_model(model, output, sample, settings, tokenizer=tokenizer, engine=engine)
    log.info("export: %s", {k: v for k, v in metrics.items() if not isinstance(v, (dict, list))})
    return metrics


def _plain(model):
    """The transformers model under peft's wrapper, which is what the sample input is made for."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
