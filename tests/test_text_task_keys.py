"""Task keys a text run ignored without a word: a classifier's task.mixup, label_smoothing, adapt_norm, monitor and
early_stopping ended 'train ok' (val/acc, task.monitor's default, is never logged by a language model), and
task=infer with prompt= never wrote task.output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import execute_run, run_cli

from onn.errors import UserError

QUICK = ("trainer.max_steps=1", "task.validate_before=false", "task.exact_match_samples=0")


@pytest.mark.parametrize(
    "override, sentence",
    [
        ("task.mixup=0.5", r"^task\.mixup=0\.5 is read by image, audio and video classifiers only"),
        ("task.label_smoothing=0.3", r"^task\.label_smoothing=0\.3 is read by image, audio and video"),
        ("task.adapt_norm=true", r"^task\.adapt_norm=True is read by .* drop task\.adapt_norm\.$"),
        ("task.monitor=val/loss", r"^task\.monitor='val/loss' is read by .* a text run would ignore it"),
        ("task.early_stopping.patience=5", r"^task\.early_stopping=\{'patience': 5, 'min_delta': 0\.0\} is read"),
    ],
)
def test_a_classifiers_task_key_is_refused_by_a_text_run(tmp_path: Path, override: str, sentence: str):
    """Before: the run trained and said 'train ok'. Now one sentence before anything is planned or written."""
    with pytest.raises(UserError, match=sentence):
        execute_run(tmp_path, tmp_path / "cache", *QUICK, override)
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.slow  # a process of its own: 10 s and more on a busy CPU
def test_the_reviews_command_line_ends_in_the_sentence_not_train_ok(tmp_path: Path):
    """The review's `python run.py model=llama_tiny task.mixup=0.5 ...`, through run.py: exit 1 with the sentence."""
    done = run_cli(
        "model=llama_tiny",
        "hardware=cpu_16gb",
        "tracking=none",
        *QUICK,
        "task.mixup=0.5",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    said = done.stdout + done.stderr
    assert done.returncode == 1, said[-4000:]
    assert "task.mixup=0.5 is read by image, audio and video classifiers only" in said
    assert "train ok" not in said and "Traceback" not in said


def test_infer_with_a_prompt_writes_its_completion_to_task_output(tmp_path: Path):
    """Before: 'infer ok' and no file. Now the one completion in task.input's record layout (prompt, completion)."""
    output = tmp_path / "answers" / "preds.jsonl"
    metrics = execute_run(
        tmp_path,
        tmp_path / "cache",
        "task=infer",
        "prompt=What is 2+3?",
        f"task.output={output}",
        "task.max_new_tokens=1",
        "model.architecture.num_hidden_layers=1",  # the file is the point, not the model
        name="infer",
    )
    rows = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    assert rows == [{"prompt": "What is 2+3?", "completion": metrics["infer/completion"]}]
    assert metrics["infer/output"] == str(output)
