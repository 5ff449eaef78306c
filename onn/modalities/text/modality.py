"""Text: prompt/answer records and plain text for causal language models.

The text modality: JSONL, JSON, CSV, parquet and plain-text files (format read from the
content) and `builtin:` generators (onn/modalities/text/formats.py, sources.py), causal LMs from any
source (onn/models/load.py) trained resident or layer-streamed, generation, and exact match.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, is_dataclass, replace
from pathlib import Path

from onn.config.data import TextData
from onn.config.model import LanguageModelConfig, NetworkConfig
from onn.config.run import ONNConfig
from onn.config.task import InferTask, TrainTask
from onn.dtypes import FLOAT_DTYPES
from onn.errors import UserError
from onn.hardware.profile import Profile
from onn.modalities.base import Modality

# Architectures ONN builds from a text model config but only plans and exports: the pipelines' models
# (onn/export/pipelines: each registered Pipeline's model_class) and CLIP (one graph of two towers).
EXPORT_ONLY = frozenset({"Sam2Model", "GroundingDinoForObjectDetection", "VisionEncoderDecoderModel", "CLIPModel"})
# The data a model that is no language model trains on: by its config's kind, then by its source.
KIND_DATA = {
    "DenoiserConfig": "diffusion data (data=diffusion)",
    "DualEncoderConfig": "paired data (data=pairs)",
    "GraphNetworkConfig": "graph data (data=graph)",
}
SOURCE_DATA = {
    "zoo:pointnet": "point clouds (data=mesh)",
    "zoo:text_encoder": "captions, as model=dual_encoder's text side (data=pairs)",
    "zoo:c3d_tiny": "video data (data=video)",
    "torchvision": "video data (data=video)",
    "zoo:audio_cnn": "audio data (data=audio)",
    "zoo:audio_rnn": "audio data (data=audio)",
}
# task=train's keys that only image, audio and video classifiers read (onn/modalities/classification.py): a text
# run keeps checkpoints/last.ckpt and its step checkpoints, picks no best one and never stops early.
CLASSIFIER_KEYS = ("mixup", "label_smoothing", "adapt_norm", "monitor", "early_stopping")
# The tasks that read data.source's records (task=plan plans the training that reads them); infer, export and serve
# of a checkpoint keep its data.source, which may have moved since.
READS_SOURCE = ("train", "plan", "tune", "bench")


def own_data(model) -> str:
    """What to give a model that is no language model, instead of text."""
    source = str(getattr(model, "source", "") or "")
    found = KIND_DATA.get(type(model).__name__) or SOURCE_DATA.get(source) or SOURCE_DATA.get(source.partition(":")[0])
    return found or "classification data (e.g. data=cifar10)"


class TextModality(Modality):
    name = "text"
    data_schema = TextData
    model_schema = LanguageModelConfig
    implementation = "onn.modalities.text.tasks"
    default_data = "text"
    default_model = "phi4_tiny"
    description = "prompt/answer text for causal language models"
    builtins = ("math",)
    sniff_priority = -1  # any UTF-8 file reads as text: the other modalities ask first

    def sniff(self, path: Path) -> str | None:
        from onn.modalities.text.formats import sniff_text

        return sniff_text(path)

    def check(self, config: ONNConfig) -> None:
        from onn.modalities.text.builtin import check_options
        from onn.models.load import source_kind

        model, data = config.model, config.data
        if not isinstance(model, LanguageModelConfig):
            raise UserError(
                f"model={model.name} is "
                f"{'a classifier network' if isinstance(model, NetworkConfig) else 'no language model'} "
                f"but data={data.name} is text: pick a language model "
                f"(e.g. model=phi4_tiny) for text, or {own_data(model)} for this model."
            )
        if not model.tokenizer and source_kind(model.source) in ("random", "safetensors"):
            raise UserError(
                f"model '{model.name}' has no tokenizer: a model.source of {model.source or 'random'} carries none; "
                "set model.tokenizer to a folder with one, or model.tokenizer=byte."
            )
        architecture = ((model.architecture or {}).get("architectures") or [None])[0]
        if config.task.name not in ("export", "plan", "bench_omny"):
            what = (
                "reads no text (model.tokenizer=none)"
                if model.tokenizer == "none"
                else f"is a {architecture}, not a causal language model"
                if architecture in EXPORT_ONLY
                else None
            )
            if what:
                raise UserError(
                    f"model '{model.name}' {what}: it can be planned and exported (task=export export=omny), "
                    f"not given to task={config.task.name}."
                )
        for key, value, least in (("max_length", data.max_length, 2), ("batch_size", data.batch_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                said = "2 (a prompt token and an answer token)" if least == 2 else "1"
                raise UserError(f"data.{key}={value!r}: give a whole number, {said} or more.")
        if model.dtype not in ("auto", *FLOAT_DTYPES):
            raise UserError(f"model.dtype={model.dtype!r}: give auto or one of {', '.join(FLOAT_DTYPES)}.")
        arch, where = model.architecture or {}, "model.architecture"
        if isinstance(arch.get("text_config"), dict):  # a multimodal model's positions are its text config's
            arch, where = arch["text_config"], "model.architecture.text_config"
        key = "max_position_embeddings" if "max_position_embeddings" in arch else "n_positions"
        check_max_length(config, arch.get(key), f"{where}.{key}")
        tbptt = config.task.tbptt_steps if isinstance(config.task, TrainTask) else 0
        if isinstance(tbptt, bool) or not isinstance(tbptt, int) or tbptt < 0:
            raise UserError(f"task.tbptt_steps={tbptt!r}: give a whole number of tokens per chunk, or 0 for none.")
        check_classifier_keys(config)
        check_generation(config)
        limit = config.trainer.limit_train_batches
        trains = config.task.name in ("train", "bench", "tune")
        if trains and isinstance(limit, float) and limit != 1.0:
            raise UserError(
                f"trainer.limit_train_batches={limit}: a language model's training data is a stream with no length "
                "Lightning can take a fraction of; give a number of batches (a whole number), or null for all."
            )
        steps, by_epochs = config.trainer.max_steps, config.task.name == "train" and config.trainer.max_epochs >= 1
        if config.task.name in ("train", "bench", "tune") and steps < 1 and not (steps == -1 and by_epochs):
            raise UserError(
                f"trainer.max_steps={steps}: a language model trains for a number of optimizer steps; give 1 or more"
                + (", or -1 with trainer.max_epochs set." if config.task.name == "train" else ".")
            )
        if str(data.source or "").startswith("builtin:") and data.builtin is not None:
            check_options(data.builtin.max_operand, data.builtin.operations)

    def plan(self, config: ONNConfig, hardware: Profile, use_tuned: bool = True):
        from onn.config.convert import typed
        from onn.data.files import existing_source
        from onn.modalities.text.calibrate import refine
        from onn.modalities.text.streaming import streaming_choice
        from onn.planning.plan import attach_scale, make_plan
        from onn.planning.scale import scale_plan
        from onn.planning.spec import model_spec

        source = str(config.data.source or "")
        if source and not source.startswith("builtin:") and config.task.name in READS_SOURCE:
            # a plan of a file that is not there said ok: the file was first read when training started
            existing_source(source, "data.source", "a .jsonl, .json, .csv, .parquet or .txt file")
        lora = config.strategy.lora
        lora_rank = lora.r if lora is not None else 8  # full training sizes LoRA at the default rank
        spec = model_spec(config.model, lora_rank, cache_dir=config.paths.cache)
        if config.model.segmenter:  # Grounded SAM2: the detector and SAM2, loaded and exported together
            segmenter = typed(LanguageModelConfig, config.model.segmenter, "model.segmenter")
            more = model_spec(segmenter, lora_rank, cache_dir=config.paths.cache).params
            spec = replace(spec, params=spec.params + more, suffix_params=spec.suffix_params + more)
        plan = make_plan(config, hardware, spec, use_tuned=use_tuned)
        attach_scale(plan, scale_plan(config, hardware, spec))  # several devices or nodes: DDP, ZeRO, FSDP
        if config.task.name not in (
            "plan",
            "export",
            "bench_omny",
        ):  # timing blocks imports torch; exports train nothing
            plan = refine(plan, config, hardware, spec)
        plan.data_streamed, reason = streaming_choice(config.data)
        plan.reasons.append(reason)
        return plan, spec


def check_max_length(config: ONNConfig, positions: object, key: str) -> None:
    """data.max_length within the model's positions, where a task encodes data to it: past them a model with learned
    positions (GPT-2) failed with a bare IndexError in its embedding, and a rotary one learned positions it never
    serves. `key`: where `positions` was read."""
    max_length = config.data.max_length
    if config.task.name not in ("train", "eval", "bench", "tune") or type(positions) is not int:
        return
    if max_length > positions:
        raise UserError(
            f"data.max_length={max_length} is longer than model '{config.model.name}' reads ({key}={positions} "
            f"positions); set data.max_length={positions} or less."
        )


def check_classifier_keys(config: ONNConfig) -> None:
    """A classifier's task key set for text, refused: a text run ignored task.mixup, label_smoothing, adapt_norm,
    monitor and early_stopping without a word (task.monitor=val/acc named a figure it never logs). Set means not
    conf/task/train.yaml's value, where these keys' defaults live."""
    from onn.config.registry import CONF, option_values

    if not isinstance(config.task, TrainTask):
        return
    defaults = option_values(CONF / "task" / "train.yaml")[0]
    for key in CLASSIFIER_KEYS:
        value = getattr(config.task, key)
        value = asdict(value) if is_dataclass(value) else value  # task.early_stopping: a block
        if value != defaults[key]:
            raise UserError(
                f"task.{key}={value!r} is read by image, audio and video classifiers only, and a text run would "
                f"ignore it: drop task.{key}."
            )


def check_generation(config: ONNConfig) -> None:
    """The settings exact match and sampling read, checked before anything runs: a pattern without a group (or no
    regular expression) failed after the whole evaluation with IndexError, a negative temperature sampled
    greedily and a top_p above 1 was used, each without a word."""
    pattern = config.data.answer_pattern
    if pattern:
        try:
            groups = re.compile(pattern).groups
        except re.error as e:
            raise UserError(f"data.answer_pattern={pattern!r} is not a regular expression ({e}): fix it.") from None
        if groups < 1:
            raise UserError(
                f"data.answer_pattern={pattern!r} has no group: put the answer in one, e.g. '####\\s*(-?[0-9.,]+)'."
            )
    task = config.task
    if isinstance(task, InferTask):
        if not (math.isfinite(task.temperature) and task.temperature >= 0):
            raise UserError(f"task.temperature={task.temperature}: give 0 (greedy) or more.")
        if not 0 <= task.top_p <= 1:
            raise UserError(f"task.top_p={task.top_p}: give a share of the probability from 0 (greedy) to 1.")
