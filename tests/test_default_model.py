"""An explicit data config with no model named (on the command line or by a recipe) runs its modality's default
model, as data=auto does: `data=mesh` alone composed conf/config.yaml's phi4_tiny and was refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import MODALITY_HARDWARE, ROOT, run_cli
from omegaconf import DictConfig, open_dict

from onn.app import compose_chosen, to_config
from onn.config import register
from onn.modalities import get

CKPT = ROOT / "tests" / "data" / "mesh_b6b1dee.ckpt"  # a PointNet on builtin:primitives


def composed(*overrides: str) -> tuple[DictConfig, list[str], dict[str, str]]:
    """What run() starts from for `python run.py OVERRIDES`: the composed config, the overrides and the choices."""
    from hydra import compose

    register()
    given = [f"paths.root={ROOT}", *overrides]
    cfg = compose("config", overrides=given, return_hydra_config=True)
    choices = {str(k): str(v) for k, v in cfg.hydra.runtime.choices.items() if v is not None}
    with open_dict(cfg):
        del cfg["hydra"]  # run() gets the config without it
    return cfg, given, choices


@pytest.fixture
def conf():
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        yield


def test_mesh_without_model_composes_pointnet(conf, capsys) -> None:
    cfg, overrides, choices = composed("data=mesh", "data.source=builtin:primitives", "task=plan", MODALITY_HARDWARE)
    assert cfg.model.name == "phi4_tiny"  # what conf/config.yaml composes: the mesh modality refused it
    cfg = compose_chosen(cfg, overrides, choices)
    assert "data=mesh names no model, so model=pointnet" in capsys.readouterr().out
    assert choices["model"] == "pointnet"
    config = to_config(cfg, choices)
    assert config.model.name == "pointnet"
    get("mesh").check(config)  # refused phi4_tiny: "is not a point-cloud network"


@pytest.mark.parametrize(
    ("overrides", "model"),
    [
        (("data=graph", "data.source=builtin:communities"), "gin"),
        (("data=video", "data.source=builtin:motion"), "video_c3d_tiny"),
        (("data=cifar10", "data.source=x.tar.gz"), "v28_cnn"),  # a data config built on image.yaml
        (("data=fsdd", "data.source=recordings"), "audio_cnn"),
        (("data=diffusion", "data.source=pictures"), "ddpm_unet"),
        (("data=pairs", "data.source=pairs"), "dual_encoder"),
    ],
)
def test_each_modality_composes_its_default_model(conf, overrides: tuple[str, ...], model: str) -> None:
    cfg, given, choices = composed(*overrides)
    assert compose_chosen(cfg, given, choices).model.name == model


@pytest.mark.parametrize(
    "overrides",
    [
        (),  # the default job: data=math, phi4_tiny
        ("data=gsm8k",),  # text data: its default model is conf/config.yaml's own
        ("data=mesh", "data.source=builtin:primitives", "model=gin"),  # a model named stays
        ("recipe=mesh_gnn", "data=mesh"),  # the recipe's model (gin) stays
        ("data=mesh", "task=eval", f"ckpt={CKPT}"),  # the model is the checkpoint's
    ],
)
def test_named_or_default_model_is_not_replaced(conf, overrides: tuple[str, ...]) -> None:
    cfg, given, choices = composed(*overrides)
    assert compose_chosen(cfg, given, choices) is None
    assert choices["model"] == cfg.model.name  # unchanged: what Hydra composed


@pytest.mark.slow
def test_cli_mesh_without_model_plans_pointnet(tmp_path: Path) -> None:
    """`python run.py data=mesh data.source=builtin:primitives task=plan` plans PointNet, end to end (it was refused:
    model=phi4_tiny is not a point-cloud network)."""
    done = run_cli(
        "data=mesh", "data.source=builtin:primitives", "task=plan", MODALITY_HARDWARE, f"paths.outputs={tmp_path}"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "data=mesh names no model, so model=pointnet" in done.stdout
    assert "ONN plan: pointnet" in done.stdout
    (plan,) = tmp_path.glob("plan/*/plan.yaml")
    assert "PointBlock" in yaml.safe_load(plan.read_text())["model"]["layer_map"]
    assert plan.parent.name.endswith("_pointnet_auto")  # the folder names the model that runs, not phi4_tiny
