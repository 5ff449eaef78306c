"""The config and the app entry, as an eleventh review found them (2026-12-07): under hydra.job.chdir=true a relative
data.source (ckpt, task.input, paths.outputs, ...) was read from the job's own folder, not from where `python run.py`
started, and the run said the file did not exist; and a value its key's type refuses (`trainer.max_steps=abc`, one
value of a sweep's `trainer.max_steps=10,abc`) got Hydra's five-line message, a sweep's after its folder was made."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import ROOT, run_cli
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import ConfigCompositionException

from onn.app import from_start_folder, to_config
from onn.config.registry import delete_problem, group_problem, no_recipe, value_problem

CONF = ROOT / "conf"
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def _gsm8k_rows(folder: Path, rows: int) -> Path:
    """The first `rows` GSM8K problems, as a file of the user's folder; skipped where the shared data is absent."""
    if not GSM8K.is_file():
        pytest.skip(f"{GSM8K} is absent")
    lines = GSM8K.read_text().splitlines()[:rows]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gsm.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "gsm.jsonl"


def _composed(start: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=[f"paths.root={start}", *overrides])


def test_relative_paths_are_read_from_where_the_run_started_under_hydra_chdir(tmp_path, monkeypatch):
    """The job runs in its run folder (hydra.job.chdir=true): the user's gsm.jsonl, given relative to where they
    started, was looked for there. What the job reads and ONN's own folders come from the start folder; a hub id,
    ckpt=last and a relative task.output (the job folder's, as chdir asks) stay as given."""
    start = tmp_path / "project"
    source = _gsm8k_rows(start, 5)
    (start / "prompts.jsonl").write_text('{"prompt": "2+2?"}\n')
    cfg = _composed(
        start,
        "task=infer",
        "data=gsm8k",
        "data.source=gsm.jsonl",
        "data.val_source=gsm.jsonl",
        "task.input=prompts.jsonl",
        "task.output=answers.jsonl",
        "ckpt=last",
        "model.source=HuggingFaceTB/SmolLM2-135M",
        "paths.outputs=runs",
    )
    job = start / "runs" / "job"
    job.mkdir(parents=True)
    monkeypatch.chdir(job)
    from_start_folder(cfg, start)
    config = to_config(cfg)
    assert config.data.source == config.data.val_source == str(source)
    assert Path(config.data.source).read_text().startswith('{"question"')  # read from the job's folder
    assert config.task.input == str(start / "prompts.jsonl")
    assert config.paths.outputs == str(start / "runs")
    assert config.paths.cache == str(start / "runs" / ".cache")  # ${paths.outputs}/.cache, resolved from it
    assert (config.ckpt, config.model.source, config.task.output) == (
        "last",
        "HuggingFaceTB/SmolLM2-135M",
        "answers.jsonl",
    )


def test_a_classifier_builder_file_is_read_from_where_the_run_started(tmp_path, monkeypatch):
    """model.source=my_net.py:build names a file beside the user: its file part comes from the start folder."""
    start = tmp_path / "project"
    start.mkdir()
    (start / "my_net.py").write_text("def build(shape, classes):\n    raise NotImplementedError\n")
    job = start / "job"
    job.mkdir()
    monkeypatch.chdir(job)
    cfg = _composed(start, "model=v28_cnn", "data=cifar10", "model.source=my_net.py:build")
    from_start_folder(cfg, start)
    assert cfg.model.source == f"{start / 'my_net.py'}:build"


@pytest.mark.parametrize(
    "argv, key, value, good",
    [(["-m", "trainer.max_steps=10,abc"], "trainer.max_steps", "'abc'", ["-m", "trainer.max_steps=10,20"]),
     (["optim.lr=fast"], "optim.lr", "'fast'", ["optim.lr=1e-4"]),
     (["-m", "trainer.deterministic=true,maybe"], "trainer.deterministic", "'maybe'",
      ["-m", "trainer.deterministic=true,false"])],
)  # fmt: skip
def test_a_value_its_key_refuses_is_one_sentence(argv, key, value, good):
    """Hydra refuses the value too (the mistake is real), in five lines; the check names the key and the value."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"), pytest.raises(ConfigCompositionException):
        hydra_compose("config", overrides=[f"{key}={value.strip(chr(39))}"])
    problem = value_problem(argv)
    assert problem is not None and problem.startswith(f"{argv[-1]}: {key} takes ")
    assert f"and {value} is not one; fix the value" in problem
    assert value_problem(good) is None
    left_to_hydra = ("trainer.max_steps=${seed}", "trainer.check_val_every_n_epoch=null", "model.kwargs.w=abc")
    assert value_problem([*left_to_hydra, "data.batch_size=range(1,4)", *argv]) == problem  # none of them refused


def test_a_sweep_with_a_bad_value_runs_no_job_and_makes_no_folder(tmp_path):
    """`-m trainer.max_steps=10,abc`: one sentence before any job starts, and no empty sweep folder is left."""
    done = run_cli("-m", "task=plan", "trainer.max_steps=10,abc", cwd=tmp_path, python_warnings="default")
    assert done.returncode == 1
    assert "trainer.max_steps=10,abc: trainer.max_steps takes a whole number, and 'abc' is not one" in done.stderr
    assert "Error merging override" not in done.stderr
    assert not (tmp_path / "outputs").exists()


def test_recipe_null_is_no_recipe_and_a_null_group_is_one_sentence():
    """`recipe=null` (conf/config.yaml's own default, written out) and `data=null` ended in Hydra's bare ValueError
    traceback. recipe=null now composes as no recipe (Hydra's ~recipe); data=null, which no run can take, is one
    sentence naming the options."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        with pytest.raises(ValueError, match="Config group override must be a string"):
            hydra_compose("config", overrides=["data=null"])  # Hydra's own answer, for both
        plain = hydra_compose("config", overrides=["paths.root=/x", "task=plan"])
        dropped = hydra_compose("config", overrides=no_recipe(["paths.root=/x", "recipe=null", "task=plan"]))
    assert dropped == plain
    problem = group_problem(["task=plan", "data=null"], CONF)
    assert problem is not None and problem.startswith("data=null: every run takes a data config, not null; give one")
    assert "gsm8k" in problem


@pytest.mark.slow  # a training run in a run.py process: tens of seconds on 2 cores
def test_a_run_under_hydra_chdir_trains_on_a_relative_data_source(tmp_path):
    """hydra.job.chdir=true data.source=gsm.jsonl: the run said "data.source gsm.jsonl does not exist"; it trains
    on the user's file now, and the loss moves."""
    _gsm8k_rows(tmp_path, 120)
    done = run_cli(
        "model=llama_tiny",
        "data=gsm8k",
        "data.source=gsm.jsonl",
        "data.max_length=64",
        "hardware=cpu_16gb",
        "tracking=none",
        "trainer.max_steps=4",
        "trainer.enable_progress_bar=false",
        "hydra.job.chdir=true",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (record,) = (tmp_path / "outputs" / "train").glob("*/metrics.json")
    metrics = json.loads(record.read_text())
    assert metrics["status"] == "ok" and metrics["data_source"] == str(tmp_path / "gsm.jsonl")
    assert metrics["train/loss_final"] != metrics["train/loss_initial"]
    shutil.rmtree(tmp_path / "outputs")


def test_recipe_null_beside_another_recipe_and_in_a_sweep_is_one_sentence():
    """`recipe=null recipe=char_lstm` silently ran without char_lstm (no_recipe made it ~recipe, which Hydra applies
    whatever the order), and `-m recipe=null,char_lstm` was Hydra's bare ValueError and an empty sweep folder."""
    argv = ["recipe=null", "recipe=char_lstm", "task=plan"]
    assert no_recipe(argv) == argv
    assert "twice" in group_problem(no_recipe(argv), CONF)
    problem = group_problem(["-m", "recipe=null,char_lstm", "task=plan"], CONF)
    assert problem is not None and problem.startswith("recipe=null,char_lstm: a sweep takes recipes by name")


def test_the_omny_bench_and_eval_files_are_read_from_where_the_run_started(tmp_path, monkeypatch):
    """task.image and task.page (bench_omny) and task.classifier (eval's recognition score) were read from the job's
    folder under hydra.job.chdir=true."""
    start = tmp_path / "project"
    start.mkdir()
    for name in ("photo.jpg", "page.png", "clf_run"):
        (start / name).write_bytes(b"x")
    cfg = _composed(start, "task=bench_omny", "task.image=photo.jpg", "task.page=page.png")
    job = start / "runs" / "job"
    job.mkdir(parents=True)
    monkeypatch.chdir(job)
    from_start_folder(cfg, start)
    assert (cfg.task.image, cfg.task.page) == (str(start / "photo.jpg"), str(start / "page.png"))
    cfg = _composed(start, "task=eval", "task.classifier=clf_run")
    from_start_folder(cfg, start)
    assert cfg.task.classifier == str(start / "clf_run")


def test_recipe_null_given_twice_is_no_recipe_once():
    """`recipe=null recipe=null` ran as no recipe before; left unrewritten beside the other null, it was Hydra's
    bare ValueError."""
    assert no_recipe(["recipe=null", "recipe=null", "task=plan"]) == ["~recipe", "task=plan"]
    assert group_problem(["~recipe", "task=plan"], CONF) is None


@pytest.mark.parametrize(("line", "told"), [("~optim.lr", "optim.lr=VALUE"), ("~ckpt", "ckpt=null for none")])
def test_deleting_a_typed_setting_is_one_sentence_saying_to_set_it(line, told):
    """`~optim.lr` is Hydra's five-line "does not support deletion", `~ckpt` its "'ckpt' does not exist": one sentence
    that says how to set it instead. A group's deletion (`~recipe`) and a free-form key's are Hydra's to do."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"), pytest.raises(ConfigCompositionException):
        hydra_compose("config", overrides=["task=plan", line])
    problem = delete_problem(["task=plan", line], CONF)
    assert problem is not None and problem.startswith(f"{line}: {line[1:]} is one of ONN's typed settings")
    assert problem.endswith(f"set it instead ({told}).")
    assert delete_problem(["task=plan", "~recipe", "~model.kwargs.x", "optim.lr=0.1"], CONF) is None
