"""Checkpoints are safetensors + JSON, round-trip exactly, and never need pickle."""

import json

import pytest
import torch

from onn.errors import UserError
from onn.training.checkpoints import load, resolve, save, saved_config


def test_round_trip_nested_state(tmp_path):
    shared = torch.randn(4, 3)
    state = {
        "state_dict": {"a.weight": shared, "b.weight": shared, "view": shared[1:]},  # tied weights and a view
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
                "param_groups": [{"betas": (0.9, 0.95), "lr": 1e-3, "params": [0]}],
            }
        ],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}},
        "dtype": torch.bfloat16,
        "none": None,
    }
    save(state, tmp_path / "x.ckpt")
    assert sorted(p.name for p in (tmp_path / "x.ckpt").iterdir()) == ["meta.json", "model.safetensors"]
    back = load(tmp_path / "x.ckpt")
    assert torch.equal(back["state_dict"]["a.weight"], shared) and torch.equal(back["state_dict"]["view"], shared[1:])
    opt = back["optimizer_states"][0]
    assert 0 in opt["state"] and opt["param_groups"][0]["betas"] == (0.9, 0.95)  # int keys and tuples survive
    assert back["dtype"] is torch.bfloat16 and back["none"] is None and back["loops"] == state["loops"]
    json.loads((tmp_path / "x.ckpt" / "meta.json").read_text())  # plain JSON


def test_overwrite_is_atomic_and_bad_paths_are_refused(tmp_path):
    save({"x": torch.zeros(1)}, tmp_path / "last.ckpt")
    save({"x": torch.ones(1)}, tmp_path / "last.ckpt")
    assert load(tmp_path / "last.ckpt")["x"].item() == 1.0
    assert not any(p.name.endswith((".tmp", ".old")) for p in tmp_path.iterdir())
    (tmp_path / "model.pt").write_bytes(b"\x80\x04pickle")
    with pytest.raises(UserError, match="pickle"):
        resolve(str(tmp_path / "model.pt"), tmp_path)
    with pytest.raises(UserError, match="no checkpoint"):
        resolve("last", tmp_path / "empty")


def test_a_save_killed_while_tidying_up_does_not_block_the_next(tmp_path):
    """SIGKILL during the removal of the replaced checkpoint leaves part of last.ckpt.old behind: the
    resumed run's next save replaces it (it failed with 'Directory not empty' on the bench's kill -9)."""
    save({"x": torch.zeros(1)}, tmp_path / "last.ckpt")
    leftover = tmp_path / "last.ckpt.old"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half-deleted")
    save({"x": torch.ones(1)}, tmp_path / "last.ckpt")
    assert load(tmp_path / "last.ckpt")["x"].item() == 1.0
    assert not leftover.exists()


def test_a_checkpoint_of_another_modality_is_refused_in_one_sentence(tmp_path):
    """eval/infer of a diffusion or pairs run names the modality it needs, for another modality's checkpoint and
    for one another tool wrote alike; without a modality the saved config is read as it is."""
    config = {"modality": "image", "seed": 3, "model": {}, "strategy": {}, "data": {}}  # what every run's holds
    save({"onn": {"config": config}, "x": torch.zeros(1)}, tmp_path / "image.ckpt")
    save({"x": torch.zeros(1)}, tmp_path / "foreign.ckpt")
    assert saved_config(tmp_path / "image.ckpt")["seed"] == 3 and saved_config(tmp_path / "foreign.ckpt") == {}
    assert saved_config(tmp_path / "image.ckpt", "image")["modality"] == "image"
    for name in ("image", "foreign"):
        with pytest.raises(UserError, match=rf"ckpt .*{name}.ckpt was not written by a diffusion run; it cannot"):
            saved_config(tmp_path / f"{name}.ckpt", "diffusion")


def test_resolve_last_picks_newest(tmp_path):
    import os
    import time

    for name in ("a", "b"):
        save({"x": torch.zeros(1)}, tmp_path / name / "checkpoints" / "last.ckpt")
        time.sleep(0.01)
    os.utime(tmp_path / "a" / "checkpoints" / "last.ckpt" / "meta.json")
    assert resolve("last", tmp_path) == tmp_path / "a" / "checkpoints" / "last.ckpt"
    assert resolve(str(tmp_path / "b"), tmp_path) == tmp_path / "b" / "checkpoints" / "last.ckpt"


def test_no_pickle_in_the_package():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for path in [root / "run.py", *(root / "onn").rglob("*.py")]:
        text = path.read_text()
        assert "import pickle" not in text and "import joblib" not in text and "joblib.load" not in text, path
        for line in text.splitlines():
            if "torch.load(" in line and "weights_only=True" not in line and "st.save_file" not in line:
                pytest.fail(f"{path}: {line.strip()}")
