"""The modality registry: what each modality brings, data=auto, and a new modality that needs no other change."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, compose, read_metrics, run_cli
from PIL import Image

from onn.errors import UserError
from onn.modalities.base import Job, Modality
from onn.modalities.registry import REGISTRY, detect, get, register


def test_every_modality_names_configs_that_exist():
    assert {"text", "image"} <= set(REGISTRY)
    for modality in REGISTRY.values():
        assert (ROOT / "conf" / "data" / f"{modality.default_data}.yaml").is_file(), modality
        assert (ROOT / "conf" / "model" / f"{modality.default_model}.yaml").is_file(), modality
        data = compose(f"data={modality.default_data}", "data.source=/nowhere").data
        assert data.modality == modality.name and isinstance(data, modality.data_schema)


def image_folder(root: Path) -> Path:
    for c in ("cats", "dogs"):
        (root / c).mkdir(parents=True)
        for i in range(6):
            Image.fromarray((torch.rand(8, 8, 3) * 255).to(torch.uint8).numpy()).save(root / c / f"{i}.png")
    return root


def test_detect_reads_the_content_not_the_name(tmp_path):
    images = image_folder(tmp_path / "photos")
    records = tmp_path / "data.dat"  # no telling extension: JSON lines inside
    records.write_text('{"input": "1+1", "output": "2"}\n{"input": "2+2", "output": "4"}\n')
    disguised = tmp_path / "notes.txt"  # a PNG named .txt
    disguised.write_bytes((images / "cats" / "0.png").read_bytes())
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    assert detect(images)[0].name == "image"
    assert detect(records)[0].name == "text" and "jsonl" in detect(records)[1]
    assert detect(disguised)[0].name == "image"
    assert detect("builtin:math")[0].name == "text"
    with pytest.raises(UserError, match="no modality recognises"):
        detect(binary)
    with pytest.raises(UserError, match="not a regular file or folder"):
        detect("/dev/zero")
    with pytest.raises(UserError, match="does not exist"):
        detect(tmp_path / "missing")


@pytest.mark.slow
def test_data_auto_picks_the_modality_its_data_config_and_default_model(tmp_path, outputs):
    images = image_folder(tmp_path / "photos")
    records = tmp_path / "qa.jsonl"
    records.write_text("".join(json.dumps({"input": f"{i}+1", "output": str(i + 1)}) + "\n" for i in range(40)))
    for source, modality, model, given in (
        (images, "image", "v28_cnn", []),
        (records, "text", "phi4_tiny", []),
        (records, "text", "llama_tiny", ["model=llama_tiny"]),
    ):
        run_dir = outputs / f"{modality}-{model}"
        proc = run_cli(
            "data=auto",
            f"data.source={source}",
            "task=plan",
            *given,
            f"paths.outputs={outputs}",
            f"hydra.run.dir={run_dir}",
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert f"data=auto: {source} holds" in proc.stdout
        metrics = read_metrics(run_dir)
        assert (metrics["modality"], metrics["model"], metrics["data_source"]) == (
            modality,
            model,
            str(source),
        )


class Echo(Modality):
    """A modality defined outside ONN's package: registering it is all app needs."""

    name, default_data, default_model, description = "echo", "text", "phi4_tiny", "a test modality"

    def plan(self, config, hardware, use_tuned=True):
        from onn.planning.plan import make_network_plan
        from onn.planning.spec import network_spec

        with torch.device("meta"):
            spec = network_spec(torch.nn.Linear(4, 2), torch.empty(1, 4), "echo", pretrained=False)
        full = dataclasses.replace(config, strategy=dataclasses.replace(config.strategy, name="full"))
        return make_network_plan(full, hardware, spec), spec

    def train(self, job: Job) -> dict:
        return {"echo/task": job.config.task.name, "echo/run_dir": str(job.run_dir)}


def test_a_new_modality_needs_only_registering(tmp_path):
    from onn.app import execute

    register(Echo())
    try:
        config = compose(
            "data.modality=echo",
            "tracking=none",
            f"paths.outputs={tmp_path}",
            f"paths.cache={tmp_path / 'cache'}",
        )
        metrics = execute(config, tmp_path / "run")
        assert metrics["modality"] == "echo" and metrics["echo/task"] == "train"
        with pytest.raises(UserError, match="task=infer is not available for echo data"):
            execute(dataclasses.replace(config, task=compose("task=infer").task), tmp_path / "infer")
    finally:
        REGISTRY.pop("echo")
    with pytest.raises(UserError, match="data.modality='echo' is not one of"):
        get("echo")


@pytest.mark.parametrize(
    "overrides, sentence",
    [
        # IndexError ("no such group") after the whole evaluation, or re.error there
        (("task=eval", "data.answer_pattern='[0-9]+'"), r"data\.answer_pattern='\[0-9\]\+' has no group: put the"),
        (("task=eval", "data.answer_pattern='####([0-9]+'"), r"answer_pattern='####\(\[0-9\]\+' is not a regular expr"),
        # greedy, and a top_p above 1 used, both without a word
        (("task=infer", "task.temperature=-1"), r"task\.temperature=-1\.0: give 0 \(greedy\) or more"),
        (("task=infer", "task.top_p=1.5"), r"task\.top_p=1\.5: give a share of the probability from 0 \(greedy\) to 1"),
    ],
)
def test_text_generation_settings_that_cannot_work_are_one_sentence_before_the_run(overrides, sentence):
    with pytest.raises(UserError, match=sentence):
        get("text").check(compose(*overrides))


@pytest.mark.parametrize("model", ["grounding_dino_mini", "grounded_sam2_mini", "trocr_mini", "clip_tiny"])
def test_a_model_that_is_only_exported_is_refused_by_every_task_but_export_and_plan(model):
    """These read text as a part of a picture model (or not as a causal LM) and failed inside the training step
    with a raw TypeError, ValueError or AttributeError; SAM2 (model.tokenizer=none) was already one sentence."""
    from onn.export.pipelines import PIPELINES
    from onn.modalities.text.modality import EXPORT_ONLY

    assert {p.model_class for p in PIPELINES.values()} <= EXPORT_ONLY
    for task in ("train", "eval", "infer"):
        with pytest.raises(UserError, match=rf"model '{model}' is a \w+, not a causal language model: it can be plan"):
            get("text").check(compose(f"model={model}", f"task={task}"))
    for task in ("export", "plan"):
        get("text").check(compose(f"model={model}", f"task={task}"))


@pytest.mark.parametrize(
    "model, data",
    [
        ("pointnet", "data=mesh"),
        ("text_encoder", "data=pairs"),
        ("gcn", "data=graph"),
        ("ddpm_unet", "data=diffusion"),
        ("dual_encoder", "data=pairs"),
        ("video_c3d_tiny", "data=video"),
        ("audio_lstm", "data=audio"),
        ("v28_cnn", "data=cifar10"),
    ],
)
def test_a_model_given_text_is_pointed_at_its_own_data(model, data):
    """Every model that is no language model was told to use classification data (data=cifar10), which a point
    cloud network, a graph network, a denoiser or a dual encoder refuses in turn."""
    with pytest.raises(
        UserError, match=rf"pick a language model \(e\.g\. model=phi4_tiny\) for text, or .*\((e\.g\. )?{data}\) for"
    ):
        get("text").check(compose(f"model={model}"))


def test_grounded_sam2_counts_the_parameters_of_both_its_models(tmp_path):
    """params_total (metrics.json, the plan) counted the detector alone: Grounded SAM2 exports SAM2 with it."""
    from onn.hardware.profile import resolve

    def params(model: str) -> int:
        config = compose(f"model={model}", "task=plan", "hardware=cpu_16gb", root=tmp_path)
        return get("text").plan(config, resolve(config.hardware, tmp_path / "cache", tmp_path))[1].params

    assert params("grounded_sam2_mini") == params("grounding_dino_mini") + params("sam2_mini") > 200_000


@pytest.mark.slow  # ~25 s of runs through the app: the fast suite stays under 10 minutes on 2 cores
def test_val_loss_initial_is_null_when_no_validation_ran_before_training(tmp_path):
    """With task.validate_before=false, val/loss_initial was the first validation during training (the same
    number as val/loss_final in a short run), though it says "before training"."""
    done = run_cli(
        "model=llama_tiny",
        "trainer.max_steps=2",
        "task.validate_before=false",
        "task.exact_match_samples=0",
        "tracking=none",
        f"paths.outputs={tmp_path}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    m = read_metrics(tmp_path / "run")
    assert m["val/loss_initial"] is None and m["val/loss_final"] > 0


def test_exact_match_leaves_out_references_it_cannot_read_and_refuses_when_none_are():
    """A reference data.answer_pattern could not read became "", which every generation without a number matched:
    a 2-step random model scored val/exact_match 1.0, strict too."""
    from onn.modalities.text.generate import readable_references

    gsm8k = "####\\s*(-?[0-9][0-9,\\.]*)"
    with pytest.raises(UserError, match=r"^data\.answer_pattern=.* reads no answer out of the 2 references"):
        readable_references([("1+1?", "2"), ("2+2?", "4")], gsm8k)
    kept, left_out = readable_references([("1+1?", "so #### 2"), ("2+2?", "4")], gsm8k)
    assert kept == [("1+1?", "so #### 2")] and left_out == 1
    with pytest.raises(UserError, match=r"^exact match found empty the 1 references"):
        readable_references([("say nothing", "\n")], None)
