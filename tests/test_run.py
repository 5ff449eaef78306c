"""The real CLI, end to end: train -> checkpoint -> eval -> infer, resume, sweeps, recipes, bad input."""

import json
import re
import subprocess
import sys

import pytest
import yaml
from conftest import compose, read_metrics, run_cli

TINY = [
    "model=llama_tiny",
    "data.builtin.train_size=400",
    "data.builtin.val_size=40",
    "tracking=none",
    "task.exact_match_samples=8",
]


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.modalities
def test_train_eval_infer(outputs, tmp_path):
    run_dir = outputs / "train_run"
    ok(
        run_cli(
            *TINY,
            "trainer.max_steps=40",
            "checkpoint.every_n_steps=20",
            f"paths.outputs={outputs}",
            f"hydra.run.dir={run_dir}",
        )
    )
    m = read_metrics(run_dir)
    for key in (
        "status",
        "error",
        "task",
        "model",
        "data",
        "strategy",
        "hardware",
        "steps",
        "train/loss_initial",
        "train/loss_final",
        "val/loss_initial",
        "val/loss_final",
        "samples_per_s",
        "peak_memory_mb",
        "predicted_peak_memory_mb",
        "params_total",
        "params_trainable",
        "wall_s",
        "val/exact_match",
    ):
        assert key in m, key
    assert m["status"] == "ok" and m["steps"] == 40 and m["strategy"] == "full"  # random init -> full
    assert m["train/loss_final"] < 0.7 * m["train/loss_initial"] and m["val/loss_final"] < m["val/loss_initial"]
    assert (
        (run_dir / "plan.yaml").is_file()
        and (run_dir / "config.yaml").is_file()
        and (run_dir / ".hydra" / "config.yaml").is_file()
    )
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "model.safetensors"]

    ev_dir = outputs / "eval_run"
    proc = ok(
        run_cli(
            "task=eval",
            f"ckpt={run_dir}",
            "task.max_samples=8",
            f"paths.outputs={outputs}",
            f"hydra.run.dir={ev_dir}",
        )
    )
    ev = read_metrics(ev_dir)
    # rebuilt from the checkpoint's config, and metrics.json names what was used (not the default phi4_tiny)
    assert (
        ev["model"] == "llama_tiny"
        and ev["data"] == "math"
        and ev["checkpoint_used"] == str(run_dir / "checkpoints" / "last.ckpt")
    )
    assert ev["val/loss"] == pytest.approx(m["val/loss_final"], rel=1e-4)
    assert (
        ev["val/perplexity"] == pytest.approx(2.718281828 ** ev["val/loss"], rel=1e-4)
        and 0 <= ev["val/exact_match"] <= 1
    )

    proc = ok(
        run_cli(
            "task=infer",
            "ckpt=last",
            "prompt=What is 2 + 2?",
            "task.max_new_tokens=5",
            f"paths.outputs={outputs}",
            f"hydra.run.dir={outputs / 'infer_one'}",
        )
    )
    completion = read_metrics(outputs / "infer_one")["infer/completion"]
    if completion.strip():  # streamed to the terminal
        assert completion.strip() in proc.stdout
    else:  # a tiny model may end its answer at once (which batches of 400 problems it saw decides): said so
        assert "the completion is empty or blank" in proc.stdout + proc.stderr
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 1 + 1?", "id": 1}\n{"prompt": "What is 3 * 3?", "id": 2}\n')
    ok(
        run_cli(
            "task=infer",
            "ckpt=last",
            f"task.input={prompts}",
            "task.max_new_tokens=4",
            f"paths.outputs={outputs}",
            f"hydra.run.dir={outputs / 'infer_many'}",
        )
    )
    rows = [json.loads(line) for line in (outputs / "infer_many" / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [1, 2] and all("completion" in r for r in rows)


@pytest.mark.slow  # 12-32 s in ci137's fast suite, which took 646 s
def test_sparse_lora_trains_only_its_layers_and_peft_loads_the_adapter(outputs):
    run_dir = outputs / "sparse"
    ok(
        run_cli(
            *TINY,
            "strategy=sparse_lora",
            "strategy.layers=[0,-1]",
            "optim.lr=1e-2",
            "trainer.max_steps=20",
            "task.exact_match_samples=0",
            "strategy.streaming.store=disk",
            "strategy.streaming.chunk_size=3",
            "strategy.streaming.mlp_tiles=2",  # each block's MLP (176 features) in slices of 128 and 48
            "strategy.micro_batch=2",
            f"paths.outputs={outputs}",
            f"hydra.run.dir={run_dir}",
        )
    )
    m = read_metrics(run_dir)
    assert m["strategy"] == "sparse_lora" and m["train/loss_final"] < m["train/loss_initial"]
    assert yaml.safe_load((run_dir / "plan.yaml").read_text())["streaming"]["mlp_tiles"] == 2
    assert m["streaming/mlps_sliced"] == 8 and m["streaming/norms_recomputed"] == 0  # norms: on a GPU only
    assert m["val/loss_final"] < m["val/loss_initial"]
    # the frozen blocks went to the disk store: one safetensors file and marker per block
    stores = list((outputs / ".cache" / "stores").glob("*/float32"))
    assert len(stores) == 1 and len(list(stores[0].glob("block_*.safetensors"))) == 8 == len(
        list(stores[0].glob("*.done"))
    )
    proc = ok(
        run_cli(
            "task=infer",
            f"ckpt={run_dir}",
            "prompt=What is 2 + 2?",
            "task.max_new_tokens=4",
            f"paths.outputs={outputs}",
            f"hydra.run.dir={outputs / 'infer_streamed'}",
        )
    )
    plan = yaml.safe_load((outputs / "infer_streamed" / "plan.yaml").read_text())
    assert plan["strategy"] == "sparse_lora" and plan["streaming"]  # generated through the layer-streaming engine
    assert read_metrics(outputs / "infer_streamed")["infer/completion"] in proc.stdout
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["layers_to_transform"] == [0, 7] and config["peft_type"] == "LORA"
    # peft itself loads the adapter onto a freshly built base and gives the trained model's outputs
    import torch
    from peft import PeftModel

    from onn.models.load import load
    from onn.training.checkpoints import load as load_ckpt

    base, _ = load(compose("model=llama_tiny").model)
    peft_model = PeftModel.from_pretrained(base, str(run_dir / "adapter")).eval()
    state = load_ckpt(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    assert state and all("lora_" in k for k in state)  # LoRA checkpoints hold the adapters only
    ids = torch.tensor([[10, 20, 30, 40]])
    lora_b = peft_model.base_model.model.model.layers[7].self_attn.q_proj.lora_B["default"].weight
    assert lora_b.abs().sum() > 0  # adapters moved away from their zero init
    key = next(k for k in state if "layers.7.self_attn.q_proj.lora_B" in k)
    assert torch.equal(lora_b, state[key])
    assert peft_model(ids).logits.isfinite().all()


@pytest.mark.slow
def test_multirun_sweep_over_strategies(outputs):
    ok(
        run_cli(
            "-m",
            *TINY,
            "strategy=full,lora,sparse_lora",
            "trainer.max_steps=3",
            "task.validate_before=false",
            "task.exact_match_samples=0",
            f"paths.outputs={outputs}",
            f"hydra.sweep.dir={outputs / 'sweep'}",
        )
    )
    jobs = sorted((outputs / "sweep").glob("*/metrics.json"))
    assert len(jobs) == 3
    assert sorted(json.loads(j.read_text())["strategy"] for j in jobs) == ["full", "lora", "sparse_lora"]
    assert all(json.loads(j.read_text())["status"] == "ok" for j in jobs)


@pytest.mark.slow  # a sweep whole, then killed in its job and run again: about 90 s on two busy cores
def test_a_resumed_sweep_resumes_its_killed_job_from_the_checkpoint_it_left(outputs, monkeypatch):
    """A sweep killed inside its job's second checkpoint write (step 4), then run again into its folder: the job
    trained again from step 1 (resumed_from null) and wrote over the step-2 checkpoint it had left. It resumes from
    that checkpoint, as a requeued SLURM job does, and ends with the weights and loss curve of a sweep never killed."""
    import torch

    from onn.training.checkpoints import load

    sweep, whole = outputs / "sweep", outputs / "whole"
    command = ["-m", "seed=0", *TINY, "task.exact_match_samples=0", "task.validate_before=false",
               "trainer.max_steps=4", "checkpoint.every_n_steps=2", f"paths.outputs={outputs}"]  # fmt: skip
    ok(run_cli(*command, f"hydra.sweep.dir={whole}"))
    command.append(f"hydra.sweep.dir={sweep}")
    monkeypatch.setenv("ONN_FAILPOINT", "checkpoint_write:2")  # SIGKILL inside the step-4 checkpoint's write
    assert run_cli(*command).returncode != 0
    job = sweep / "0"
    left = load(job / "checkpoints" / "last.ckpt")
    assert left["global_step"] == 2 and read_metrics(job)["status"] == "running"  # what the kill left
    monkeypatch.delenv("ONN_FAILPOINT")
    proc = ok(run_cli(*command))
    assert f"resuming job from {job / 'checkpoints' / 'last.ckpt'}" in proc.stdout + proc.stderr
    m = read_metrics(job)
    assert m["status"] == "ok" and m["steps"] == 4 and m["resumed_from"] == str(job / "checkpoints" / "last.ckpt")
    assert m["train/loss_curve"] == read_metrics(whole / "0")["train/loss_curve"]
    resumed, never = (load(run / "checkpoints" / "last.ckpt")["state_dict"] for run in (job, whole / "0"))
    assert resumed.keys() == never.keys() and all(torch.equal(resumed[k], never[k]) for k in never)


def test_recipe_and_plan_from_any_directory(tmp_path):
    proc = ok(
        run_cli(
            # the recipe's rank-16 adapters on a 4 GB card need 4.1 GB (the plan refuses); a 12 GB card streams it
            "recipe=phi4_math_sparse_lora",
            "model=phi4",
            "hardware=rtx3060_12gb",
            "task=plan",
            cwd=tmp_path,
        )
    )
    assert "strategy: sparse_lora" in proc.stdout
    plans = list((tmp_path / "outputs" / "plan").glob("*/plan.yaml"))
    assert len(plans) == 1 and json.loads((plans[0].parent / "metrics.json").read_text())["status"] == "ok"


@pytest.mark.slow  # 12-32 s in ci137's fast suite, which took 646 s
def test_bad_input_is_one_clear_line_and_keeps_earlier_runs(tmp_path, outputs):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "1+1", "output": "2"}\nnot json\n')
    earlier = outputs / "earlier"
    earlier.mkdir(parents=True)
    (earlier / "metrics.json").write_text('{"status": "ok"}')
    for args, message in [
        (["data=text", f"data.source={bad}"], f"{bad} line 2 is not valid JSON"),
        (["model.source=nobody/not-cached", "task=train"], "not in the local Hugging Face cache"),
        (["task=eval", f"ckpt={bad}"], "pickle checkpoints are never loaded"),
    ]:
        proc = run_cli(*args, "tracking=none", f"paths.outputs={outputs}")
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert message in proc.stderr + proc.stdout
        assert "Traceback" not in proc.stderr + proc.stdout
    assert (earlier / "metrics.json").read_text() == '{"status": "ok"}'
    failed = [json.loads(p.read_text()) for p in outputs.glob("*/*/metrics.json")]
    assert len(failed) == 3 and all(m["status"] == "failed" and m["error"] for m in failed)


def test_deepspeeds_notes_stay_off_the_console_when_it_is_imported_after_the_run_starts(capsys):
    """DeepSpeed sets its logger's level when it is imported, which a run does after quiet_console (a QLoRA
    run's first build writes its model with save_pretrained, which imports it): on a machine without a GPU
    its import printed "[WARNING] Setting accelerator to CPU" on the console."""
    import logging

    from onn.app import quiet_console

    quiet_console()
    pytest.importorskip("deepspeed")  # its first import here warns as a run's did
    from deepspeed.utils.logging import LoggerFactory

    logger = LoggerFactory.create_logger(name="DeepSpeed")  # what deepspeed's import does: level WARNING again
    try:
        logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        logger.error("a DeepSpeed error")
    finally:
        for handler in logger.handlers[:]:
            if getattr(handler, "stream", None) is sys.stdout:
                logger.removeHandler(handler)
    console = capsys.readouterr().out
    assert "Setting accelerator" not in console and "a DeepSpeed error" in console
    assert logging.getLogger("DeepSpeed").level == logging.WARNING  # the level was reset: the filter held


@pytest.mark.slow  # the default job in a run.py process (~20 s); .ci/run runs it too, checking its console
def test_the_default_run_prints_the_plan_a_progress_bar_and_the_result_and_no_warnings(outputs):
    """A newcomer's first run: nothing a user cannot act on (library deprecations, bitsandbytes' optional
    kernels, Lightning's tips and checkpoint advice), and no line printed twice."""
    proc = ok(
        run_cli(
            "trainer.max_steps=4",
            "trainer.val_check_interval=2",
            "data.builtin.train_size=64",
            "data.builtin.val_size=16",
            f"paths.outputs={outputs}",
            f"hydra.run.dir={outputs / 'default'}",
            python_warnings="default",
        )
    )
    console = proc.stdout + proc.stderr
    assert "ONN plan: phi4_tiny" in console and "train ok:" in console
    assert "Epoch 0" in console and "Epoch 0/-" not in console  # max_steps ends the run: no epoch total
    # Lightning prints its own warnings as "file.py:LINE: message", without the word
    noisy = [line for line in console.splitlines() if re.search(r"warn|deprecat|tip:|\.py:\d+: ", line, re.I)]
    assert not noisy, noisy
    lines = [
        line.strip()
        for line in console.splitlines()
        if line.strip() and "━" not in line and not line.startswith(("│", "┃", "└", "┏", "┡"))
    ]
    assert len(lines) == len(set(lines)), [line for line in lines if lines.count(line) > 1]
