"""A linear probe's cached features (what training and task=eval score) were the backbone's of the raw pixels
(Classifier.prepare of a features module only casts), where task=infer, serve and export run the backbone on the
batch normalised with data.mean/std: a probe that learned scored chance in infer (0.33 against eval's 0.79)."""

from __future__ import annotations

import torch
from conftest import compose
from safetensors.torch import save_file
from test_vision_train import make_images

from onn.hardware.profile import resolve


def test_a_probes_cached_features_are_its_backbones_of_the_batch_infer_runs(tmp_path):
    from onn.modalities import classification, get
    from onn.models.zoo.registry import build_zoo

    source = make_images(tmp_path / "src", train=4, test=2, size=8)
    torch.manual_seed(0)
    weights = tmp_path / "v28.safetensors"
    save_file(build_zoo("v28_cnn", in_channels=3, num_classes=3, image_size=8).state_dict(), weights)
    cfg = compose(
        *("model=v28_cnn", "data=image", "hardware=cpu_16gb", "strategy=linear_probe", f"model.weights={weights}"),
        *(f"data.source={source}", f"paths.cache={tmp_path / 'cache'}", "data.mean=[0.4]", "data.std=[0.25]"),
    )
    image = get("image")
    plan = image.plan(cfg, resolve(cfg.hardware, "/tmp", "/tmp"))[0]
    dm = classification.setup_data(image, cfg, "cpu")
    module = classification.build(image, cfg, plan, classification.data_inputs(image, cfg, dm))
    stored = dm.splits["test"].inputs.clone()  # uint8 pixels, as infer decodes task.input
    cached = classification.features(module, dm, cfg).splits["test"].inputs
    runs = classification.on_data(module).eval()  # as task=infer, serve and export run the checkpoint
    with torch.no_grad():
        wanted = runs.model.backbone(runs.prepare(stored, train=False)).flatten(1)
        logits = runs(runs.prepare(stored, train=False))
    assert cached.shape == wanted.shape == (6, 256)
    assert torch.allclose(cached, wanted, rtol=1e-4, atol=1e-6)  # the raw pixels' were others
    assert torch.allclose(runs.model.head(cached), logits, rtol=1e-4, atol=1e-6)  # the head eval scores = infer's
