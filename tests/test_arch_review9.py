"""Review of the diffusion denoiser's moving average (EMA): kept in float32 under strategy.precision=bf16-true (in
bf16 its updates of 0.005 x the difference were rounded away), through a checkpoint and a resume; and val/loss
measuring the weights the samples are drawn from, in training and in task=eval."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import compose
from test_diffusion import TINY_UNET, run, write_images

from onn.modalities.diffusion.module import DiffusionModule
from onn.modalities.diffusion.tasks import build

SHAPE = [1, 8, 8]


def tiny_module(decay: float) -> DiffusionModule:
    """The tiny UNet of the diffusion tests, as task=train builds it, with a moving average of `decay`."""
    config = compose("data=diffusion", *TINY_UNET, f"model.ema_decay={decay}", "optim.warmup_steps=0", "optim.lr=3e-3")
    return build(config, {"input_shape": SHAPE, "classes": ["a"], "seed": 0})


def loader(count: int = 32) -> torch.utils.data.DataLoader:
    """uint8 images (a bright top half, some noise) and their labels, as the image datamodule gives them."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 40, (count, *SHAPE), generator=generator, dtype=torch.uint8)
    images[:, :, :4] += 200
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, torch.zeros(count, dtype=torch.long)), 8)


def trainer(precision: str, steps: int, callbacks: list | None = None) -> L.Trainer:
    return L.Trainer(
        precision=precision,
        max_steps=steps,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks or [],
    )


class WeightsAfterEachStep(L.Callback):
    """The denoiser's weights (in float32) after every optimizer step, when the moving average has taken them."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.steps.append([p.detach().float().clone() for p in module.denoiser.parameters()])


def test_the_moving_average_stays_float32_and_moves_under_bf16_true():
    """Lightning casts the whole module to bf16 under bf16-true, and the average with it: a step's update of
    0.005 x (weights - average) was below bf16's resolution, so after 8 steps the average had barely left the first
    weights. It now moves as a float32 average of the same (bf16) weights does, and is sampled in bf16."""
    module, recorded = tiny_module(0.995), WeightsAfterEachStep()
    trainer("bf16-true", 8, [recorded]).fit(module, train_dataloaders=loader())
    assert next(module.denoiser.parameters()).dtype == torch.bfloat16  # the weights compute in bf16
    averaged = [p.detach() for p in module.ema.module.parameters()]
    expected = [w.clone() for w in recorded.steps[0]]  # the first update copies the weights
    for weights in recorded.steps[1:]:
        expected = [torch.lerp(e, w, 1 - 0.995) for e, w in zip(expected, weights)]
    first = torch.cat([w.flatten() for w in recorded.steps[0]])
    moved = torch.cat([a.float().flatten() for a in averaged]) - first
    should_move = torch.cat([e.flatten() for e in expected]) - first
    assert should_move.norm() > 0
    assert (moved - should_move).norm() <= 0.01 * should_move.norm(), (moved.norm(), should_move.norm())
    assert {p.dtype for p in averaged} == {torch.float32}
    sampled = module.sampling_denoiser()  # what samples are drawn from: the average, in the weights' dtype
    for mine, average in zip(sampled.parameters(), averaged):
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, average.to(torch.bfloat16))


def test_val_loss_measures_the_weights_samples_are_drawn_from():
    """val/loss was the trained weights' loss while the samples (and task=eval's figures beside it) came from the
    moving average: one report, two models. It is the averaged weights' loss now, as measured with them in place."""
    module = tiny_module(0.5)
    fit = trainer("32-true", 6)
    fit.fit(module, train_dataloaders=loader())
    fit.validate(module, dataloaders=loader(16), verbose=False)
    reported = module.last_metrics["val/loss"]

    averaged, trained = module.ema.module, module.denoiser
    module.ema = None  # no average: val/loss is the loss of whatever module.denoiser holds
    fit.validate(module, dataloaders=loader(16), verbose=False)
    of_trained = module.last_metrics["val/loss"]
    module.denoiser = averaged
    fit.validate(module, dataloaders=loader(16), verbose=False)
    of_averaged = module.last_metrics["val/loss"]
    module.denoiser = trained
    assert of_averaged != of_trained  # two models, told apart by the figure
    assert reported == pytest.approx(of_averaged, rel=1e-6)


@pytest.mark.slow
def test_a_resumed_bf16_run_keeps_the_float32_average_of_an_unbroken_one(tmp_path):
    """Through the runner under bf16-true: the checkpoint holds the average in float32, and a run resumed from it
    averages on as the unbroken run does (its count and float32 values restored, not restarted or rounded)."""
    from onn.training.checkpoints import load

    images = write_images(tmp_path / "pictures")
    common = (*TINY_UNET, f"data.source={images}", "model.ema_decay=0.9", "strategy.precision=bf16-true")
    # a constant learning rate: a cosine one over max_steps=3 is another schedule than over 6
    common = (*common, "optim.schedule=constant", "trainer.val_check_interval=3", "task.samples=1")
    _, unbroken = run(tmp_path, *common, "trainer.max_steps=6", name="unbroken")
    _, first = run(tmp_path, *common, "trainer.max_steps=3", name="first")
    given = {"ckpt", "trainer.max_steps"}
    _, resumed = run(tmp_path, *common, f"ckpt={first}", "trainer.max_steps=6", name="resumed", given=given)
    states = [load(d / "checkpoints" / "last.ckpt")["state_dict"] for d in (unbroken, resumed)]
    averaged = [k for k in states[0] if k.startswith("ema.module.") and states[0][k].is_floating_point()]
    assert averaged and {states[0][k].dtype for k in averaged} == {torch.float32}
    assert int(states[1]["ema.n_averaged"]) == int(states[0]["ema.n_averaged"]) == 6
    exact = 2e-3 if torch.cuda.is_available() else 0.0  # a GPU's convolutions are not deterministic by default
    for key in averaged:
        torch.testing.assert_close(states[1][key], states[0][key], rtol=0, atol=exact, msg=key)


@pytest.mark.slow
def test_eval_names_the_weights_its_loss_and_samples_describe(tmp_path):
    """task=eval's val/loss is the loss of the weights its samples are drawn from (the moving average), the same
    figure as the training's last validation, and the report says which weights those are."""
    images = write_images(tmp_path / "pictures", per_class=6)
    short = (f"data.source={images}", "trainer.max_steps=3", "trainer.val_check_interval=3", "task.samples=2")
    trained, run_dir = run(tmp_path, *TINY_UNET, *short, name="train")
    judge = ("model=v28_cnn", "data=image", f"data.source={images}", "data.batch_size=8", "trainer.max_steps=2")
    _, judge_dir = run(tmp_path, *judge, name="judge")
    given = {"ckpt", "task", "task.classifier", "data.source", "task.samples"}
    evaluate = (f"ckpt={run_dir}", "task=eval", f"task.classifier={judge_dir}", f"data.source={images}")
    judged, _ = run(tmp_path, *TINY_UNET, *evaluate, "task.samples=2", name="eval", given=given)
    assert judged["weights"] == "moving average of the weights (model.ema_decay=0.5)"
    assert judged["val/loss"] == round(trained["val/loss_final"], 5)
