"""Text: prompt/answer records and plain text for causal language models.

The text modality: JSONL, JSON, CSV, parquet and plain-text files (format read from the
content) and `builtin:` generators (onn/modalities/text/formats.py, sources.py), causal LMs from any
source (onn/models/load.py) trained resident or layer-streamed, generation, and exact match.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from onn.config.data import TextData
from onn.config.model import LanguageModelConfig, NetworkConfig
from onn.config.run import ONNConfig
from onn.config.task import InferTask, TrainTask
from onn.errors import UserError
from onn.hardware.profile import Profile
from onn.modalities.base import Modality


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
        from onn.models.load import source_kind

        model, data = config.model, config.data
        if not isinstance(model, LanguageModelConfig):
            raise UserError(
                f"model={model.name} is "
                f"{'a classifier network' if isinstance(model, NetworkConfig) else 'no language model'} "
                f"but data={data.name} is text: pick a language model "
                "(e.g. model=phi4_tiny) for text, or classification data for this model (e.g. data=cifar10)."
            )
        if not model.tokenizer and source_kind(model.source) in ("random", "safetensors"):
            raise UserError(
                f"model '{model.name}' has no tokenizer: a model.source of {model.source or 'random'} carries none; "
                "set model.tokenizer to a folder with one, or model.tokenizer=byte."
            )
        if model.tokenizer == "none" and config.task.name not in ("export", "plan", "bench_omny"):
            raise UserError(
                f"model '{model.name}' reads no text (model.tokenizer=none): it can be planned and exported "
                f"(task=export export=omny), not given to task={config.task.name}."
            )
        for key, value, least in (("max_length", data.max_length, 2), ("batch_size", data.batch_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                said = "2 (a prompt token and an answer token)" if least == 2 else "1"
                raise UserError(f"data.{key}={value!r}: give a whole number, {said} or more.")
        tbptt = config.task.tbptt_steps if isinstance(config.task, TrainTask) else 0
        if isinstance(tbptt, bool) or not isinstance(tbptt, int) or tbptt < 0:
            raise UserError(f"task.tbptt_steps={tbptt!r}: give a whole number of tokens per chunk, or 0 for none.")
        check_generation(config)
        steps, by_epochs = config.trainer.max_steps, config.task.name == "train" and config.trainer.max_epochs >= 1
        if config.task.name in ("train", "bench", "tune") and steps < 1 and not (steps == -1 and by_epochs):
            raise UserError(
                f"trainer.max_steps={steps}: a language model trains for a number of optimizer steps; give 1 or more"
                + (", or -1 with trainer.max_epochs set." if config.task.name == "train" else ".")
            )

    def plan(self, config: ONNConfig, hardware: Profile, use_tuned: bool = True):
        from onn.modalities.text.calibrate import refine
        from onn.modalities.text.streaming import streaming_choice
        from onn.planning.plan import make_plan
        from onn.planning.scale import scale_plan
        from onn.planning.spec import model_spec

        lora = config.strategy.lora
        lora_rank = lora.r if lora is not None else 8  # full training sizes LoRA at the default rank
        spec = model_spec(config.model, lora_rank, cache_dir=config.paths.cache)
        plan = make_plan(config, hardware, spec, use_tuned=use_tuned)
        plan.scale = scale_plan(config, hardware, spec)  # several devices or nodes: DDP, ZeRO, FSDP
        if config.task.name not in (
            "plan",
            "export",
            "bench_omny",
        ):  # timing blocks imports torch; exports train nothing
            plan = refine(plan, config, hardware, spec)
        plan.data_streamed, reason = streaming_choice(config.data)
        plan.reasons.append(reason)
        return plan, spec


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
        if not 0 < task.top_p <= 1:
            raise UserError(f"task.top_p={task.top_p}: give a share of the probability above 0, at most 1.")
