"""task=tune when a trial does not run: out of memory (a MemoryError, the kernel's OOM killer) or another error.

The model is a user's builder (model.source=file.py:build) whose training forward fails at chosen micro-batch sizes,
as a model too large for those sizes would: each trial runs the real protocol in its own process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import MODALITY_HARDWARE, read_metrics, run_cli

BUILDER = '''
import os
import signal

import transformers as tf

from onn.models.tokenizer import byte_tokenizer

FAILS = {FAILS}


class Picky(tf.LlamaForCausalLM):
    """A Llama whose training forward fails as FAILS says for a micro-batch of so many rows."""

    def forward(self, input_ids=None, **kwargs):
        how = FAILS.get(input_ids.shape[0], FAILS.get("any")) if self.training else None
        if how == "memory":
            raise MemoryError()
        if how == "killed":  # what the kernel's OOM killer does to a process that takes too much
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "error":
            raise ValueError("this model cannot train on so few rows")
        return super().forward(input_ids=input_ids, **kwargs)


def build():
    config = tf.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Picky(config), byte_tokenizer()
'''


def _tune(tmp_path: Path, fails: dict) -> tuple:
    """task=tune with strategy=full (micro-batch 8, 4, 2, 1, then gradient checkpointing) on the picky model."""
    (tmp_path / "picky.py").write_text(BUILDER.replace("{FAILS}", repr(fails)))
    run = tmp_path / "tune"
    proc = run_cli(
        "task=tune",
        MODALITY_HARDWARE,
        "model=llama_tiny",
        f"model.source={tmp_path / 'picky.py'}:build",
        "model.tokenizer=null",
        "model.architecture=null",
        "strategy=full",
        "data.batch_size=8",
        "data.builtin.train_size=64",
        "data.builtin.val_size=8",
        "data.max_length=32",
        "tracking=none",
        "tune.time_budget_s=600",  # every trial runs: the search ends when its axes do
        "tune.warmup_steps=0",
        "tune.steps=1",
        "tune.confirm_rounds=1",
        f"paths.outputs={tmp_path}",
        f"paths.cache={tmp_path / 'cache'}",
        f"hydra.run.dir={run}",
    )
    return proc, run


@pytest.mark.slow
def test_trials_out_of_memory_killed_or_failing_are_recorded_and_the_search_goes_on(tmp_path):
    """A trial's MemoryError (the CPU's allocator) ended task=tune in a traceback, its trials lost and nothing cached;
    a trial the OOM killer took took the whole search with it (trials ran in tune's own process); any other error of
    one neighbour (a setting this model cannot run) ended it too."""
    proc, run = _tune(tmp_path, {4: "memory", 2: "killed", 1: "error"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    (entry,) = (tmp_path / "cache" / "tune").glob("*.json")
    trials = json.loads(entry.read_text())["trials"]
    status = {t["settings"]["micro_batch"]: t["status"] for t in trials}
    assert status[8] == "ok" and status[4] == "out of memory", status
    assert status[2].startswith("out of memory (its process was killed by SIGKILL"), status
    assert status[1].startswith("failed: ValueError: this model cannot train on so few rows; see "), status
    assert read_metrics(run)["tune/settings"]["micro_batch"] == 8
    # each trial's own growth, where in tune's process a trial reused what the ones before it freed (grew 0.0 MB
    # beside a prediction of 28.7), and the budget screened nothing out
    ran = [t for t in trials if t["status"] == "ok"]
    assert ran and all(t["peak_growth_mb"] >= t["predicted_mb"] / 4 for t in ran), ran
    table = (run / "tune.md").read_text()
    assert "| out of memory |" in table and "failed: ValueError" in table


@pytest.mark.slow  # 18-31 s on 2 cores (ci133)
def test_a_failing_guess_stops_the_search_in_one_sentence(tmp_path):
    """The planner's own settings failed with an error no other micro-batch mends: a raw traceback, where the user
    needs the settings and the error in one line (and no neighbours tried in vain)."""
    proc, run = _tune(tmp_path, {"any": "error"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    error = read_metrics(run)["error"]
    assert error.startswith("task=tune stopped at the planner's own settings {'micro_batch': "), error
    assert "failed: ValueError: this model cannot train on so few rows; see " in error, error
    assert error.endswith(f"{run / 'trials' / '0' / 'trial.log'}") and "\n" not in error, error
    assert not (run / "trials" / "1").exists()
