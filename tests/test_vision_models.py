"""Image classifiers: the zoo's v28 CNN, timm models adapted to small inputs, weights, feature widths, the grid."""

from __future__ import annotations

import logging

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from onn.config.model import NetworkConfig
from onn.errors import UserError
from onn.modalities.image import pictures as grid
from onn.models.layers import discover
from onn.models.vision import build_classifier as build_network
from onn.models.vision import feature_extractor
from onn.models.zoo.registry import build_zoo
from onn.models.zoo.v28 import ConvBlock


def build_classifier(model: dict, in_channels: int, num_classes: int, image_size: list[int]):
    """The network of a model config holding these keys (the schema's defaults for the rest)."""
    return build_network(NetworkConfig(name="test", **model), in_channels, num_classes, image_size)


TIMM = ["resnet18", "resnet34", "vgg16_bn", "mobilenetv2_100", "efficientnet_b0"]


def _forward_backward(model, shape, classes=10):
    model.train()
    x = torch.randn(shape, requires_grad=False)
    logits = model(x)
    assert logits.shape == (shape[0], classes)
    logits.logsumexp(1).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads), "every parameter gets a gradient"
    return logits


@pytest.mark.parametrize("shape", [(2, 3, 32, 32), (2, 1, 28, 28), (2, 3, 96, 96)])
def test_v28_runs_and_discovers_its_conv_blocks(shape):
    model = build_classifier({"source": "zoo:v28_cnn"}, shape[1], 7, list(shape[2:]))
    _forward_backward(model, shape, classes=7)
    side = shape[2] // 8  # three max pools: 28 -> 14 -> 7 -> 3
    assert model.classifier.fc0.in_features == 128 * side * side
    assert model.pretrained_cfg["input_size"] == shape[1:]
    lmap = discover(model)
    assert lmap.block_paths == ["features.0", "features.1", "features.2"]
    assert all(type(b) is ConvBlock for b in lmap.blocks)
    assert [n for n, _ in lmap.prefix] == [] and [n for n, _ in lmap.suffix] == ["flatten", "classifier"]
    assert [b[0].out_channels for b in lmap.blocks] == [32, 64, 128]
    assert sum(isinstance(m, torch.nn.Conv2d) for m in lmap.blocks[0]) == 2


def test_v28_layout_follows_kwargs():
    model = build_zoo("v28_cnn", in_channels=1, num_classes=5, image_size=[28, 28], convs_per_block=3, hidden=(64,))
    assert sum(isinstance(m, torch.nn.Conv2d) for m in model.features[0]) == 3
    assert [m.out_features for m in model.classifier if isinstance(m, torch.nn.Linear)] == [64, 5]


@pytest.mark.slow
@pytest.mark.parametrize("name", TIMM)
def test_timm_models_train_on_small_images(name):
    for shape in [(2, 3, 32, 32), (2, 1, 28, 28)]:
        model = build_classifier({"source": f"timm:{name}"}, shape[1], 10, list(shape[2:]))
        _forward_backward(model, shape)


@pytest.mark.parametrize("size", [32, 28])
def test_resnet_stem_keeps_a_4x4_map(size):
    model = build_classifier({"source": "timm:resnet18"}, 3, 10, [size, size])
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert model.pretrained_cfg["input_size"] == (3, size, size) and model.pretrained_cfg["first_conv"] == "conv1"
    assert model.forward_features(torch.randn(2, 3, size, size)).shape == (2, 512, 4, 4)
    big = build_classifier({"source": "timm:resnet18", "small_input": "auto"}, 3, 10, [128, 128])
    assert big.conv1.kernel_size == (7, 7)  # auto leaves larger images alone
    kept = build_classifier({"source": "timm:resnet18", "small_input": False}, 3, 10, [32, 32])
    assert kept.eval().forward_features(torch.randn(1, 3, 32, 32)).shape == (1, 512, 1, 1)


def test_efficientnet_stem_stride_and_features():
    model = build_classifier({"source": "timm:efficientnet_b0"}, 3, 10, [32, 32])
    assert model.conv_stem.stride == (1, 1)
    assert model.forward_features(torch.randn(2, 3, 32, 32)).shape[-2:] == (2, 2)
    backbone, width = feature_extractor(model)
    assert width == 1280 and backbone(torch.randn(2, 3, 32, 32)).shape == (2, 1280)


def test_feature_extractor_widths():
    for source, width in [("zoo:v28_cnn", 256), ("timm:resnet18", 512), ("timm:mobilenetv2_100", 1280)]:
        backbone, got = feature_extractor(build_classifier({"source": source}, 1, 10, [28, 28]))
        assert got == width and backbone.eval()(torch.randn(2, 1, 28, 28)).shape == (2, width), source
    with pytest.raises(UserError, match="linear probe"):
        feature_extractor(torch.nn.Linear(3, 3))


@pytest.mark.slow
def test_vgg_head_is_exact_and_its_width_is_4096(tmp_path):
    import timm

    ref = timm.create_model("vgg16_bn", pretrained=False, num_classes=1000).eval()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "vgg.safetensors")
    model = build_classifier({"source": "timm:vgg16_bn", "weights": str(tmp_path / "vgg.safetensors")}, 3, 10, [32, 32])
    assert model.pre_logits.fc1.kernel_size == (1, 1)  # timm's 7x7 conv on an up-sampled 1x1 map, collapsed
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = ref.forward_head(ref.forward_features(x), pre_logits=True)
        got = model.eval().forward_head(model.forward_features(x), pre_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    backbone, width = feature_extractor(model)
    assert width == 4096 and backbone(x).shape == (2, 4096)


def test_weights_load_with_another_head_and_channel_count(tmp_path, caplog):
    import timm

    ref = timm.create_model("resnet18", pretrained=False, num_classes=1000)
    path = tmp_path / "r18.safetensors"
    save_file(ref.state_dict(), path)
    cfg = {"source": "timm:resnet18", "weights": str(path), "small_input": False}
    model = build_classifier(cfg, 3, 10, [32, 32])
    assert torch.equal(model.layer3[1].conv2.weight, ref.layer3[1].conv2.weight)
    assert torch.equal(model.conv1.weight, ref.conv1.weight) and model.fc.out_features == 10
    gray = build_classifier(cfg, 1, 10, [28, 28])  # timm's adapt_input_conv: 1 channel sums the 3
    torch.testing.assert_close(gray.conv1.weight, ref.conv1.weight.sum(1, keepdim=True))
    with caplog.at_level(logging.WARNING, logger="onn"):
        small = build_classifier({**cfg, "small_input": "auto"}, 3, 10, [32, 32])
    assert torch.equal(small.layer1[0].conv1.weight, ref.layer1[0].conv1.weight)
    assert "conv1.weight kept a fresh init" in caplog.text  # the 7x7 stem cannot become the 3x3 one


def test_weights_of_another_architecture_are_refused(tmp_path):
    import timm

    save_file(timm.create_model("resnet18", pretrained=False).state_dict(), tmp_path / "r18.safetensors")
    with pytest.raises(UserError, match=r"does not fit this ResNet: missing \(\d+\): layer1\.2\."):
        build_classifier({"source": "timm:resnet34", "weights": str(tmp_path / "r18.safetensors")}, 3, 10, [32, 32])
    save_file(build_zoo("v28_cnn", image_size=32).state_dict(), tmp_path / "v28.safetensors")
    with pytest.raises(
        UserError, match=r"wrong shapes \(1\): classifier\.fc0\.weight \(512, 2048\) vs \(512, 1152\)\. "
    ):
        build_classifier({"source": "zoo:v28_cnn", "weights": str(tmp_path / "v28.safetensors")}, 3, 10, [28, 28])
    with pytest.raises(UserError, match="pickle"):
        build_classifier({"source": "zoo:v28_cnn", "weights": str(tmp_path / "w.pt")}, 3, 10, [32, 32])
    with pytest.raises(UserError, match="not an existing .safetensors"):
        build_classifier({"source": "zoo:v28_cnn", "weights": str(tmp_path / "no.safetensors")}, 3, 10, [32, 32])


def test_zoo_weights_round_trip(tmp_path):
    src = build_zoo("v28_cnn", in_channels=3, num_classes=100, image_size=32)
    save_file(src.state_dict(), tmp_path / "v28.safetensors")
    model = build_classifier({"source": "zoo:v28_cnn", "weights": str(tmp_path / "v28.safetensors")}, 1, 10, [32, 32])
    assert torch.equal(model.classifier.fc1.weight, src.classifier.fc1.weight)
    torch.testing.assert_close(model.features[0][0].weight, src.features[0][0].weight.sum(1, keepdim=True))
    assert model.classifier.head.out_features == 10


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"cell": "rnn"}, r"model\.kwargs does not build zoo:audio_rnn: cell='rnn': use one of lstm, gru\.$"),
        ({"reference": "foo"}, r"model\.kwargs does not build zoo:audio_rnn: reference='foo': use one of band"),
        ({"frequency_mean": True}, r"model\.kwargs does not build zoo:audio_rnn: frequency_mean .* give conv_widths"),
        ({"hiden": 8}, r"model\.kwargs does not fit zoo:audio_rnn: .*'hiden' \(it takes in_channels, .*hidden"),
    ],
)
def test_zoo_constructor_refusals_name_model_kwargs(kwargs, match):
    """The zoo constructors' own checks (ValueError) and unknown keys reach the user as one sentence."""
    with pytest.raises(UserError, match=match):
        build_zoo("audio_rnn", in_channels=1, num_classes=3, image_size=[16, 20], **kwargs)


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"source": "timm:resnet19"}, r"timm has no model 'resnet19'; close names: .*resnet18"),
        ({"source": "zoo:v29"}, r"no such zoo model; the zoo has: .*v28_cnn"),
        ({"source": "resnet18"}, r"zoo:NAME .* timm:NAME .* or file\.py:function"),
        ({"source": "zoo:v28_cnn", "kwargs": {"widht": 3}}, r"model\.kwargs does not fit zoo:v28_cnn"),
        (
            {"source": "timm:resnet18", "kwargs": {"num_classes": 3}},
            r"model\.kwargs\.num_classes is set by ONN",
        ),
        (
            {"source": "timm:resnet18", "small_input": "maybe"},
            r"model\.small_input must be auto, true or false",
        ),
        (
            {"source": "zoo:v28_cnn", "kwargs": {"widths": [8, 8, 8, 8, 8, 8]}},
            r"too small for 6 pooling blocks",
        ),
    ],
)
def test_config_mistakes_are_user_errors(cfg, match):
    with pytest.raises(UserError, match=match):
        build_classifier(cfg, 3, 10, [32, 32])


@pytest.mark.parametrize(
    "model, said",
    [
        ("pointnet", r"model=pointnet \(zoo:pointnet\) does not take images"),
        ("text_encoder", r"model=text_encoder \(zoo:text_encoder\) does not take images"),
        ("gcn", r"model=gcn \(pyg:gcn\) does not take images"),
        ("ddpm_unet", r"model=ddpm_unet \(DenoiserConfig\) does not take images"),
        ("dual_encoder", r"model=dual_encoder \(DualEncoderConfig\) does not take images"),
    ],
)
def test_a_model_that_takes_no_pictures_is_refused_as_an_image_classifier(model, said):
    """With data=cifar10 these failed as a model.kwargs the user never set (image_size, in_channels), or a raw
    AttributeError ('DenoiserConfig' object has no attribute 'source')."""
    from conftest import compose

    with pytest.raises(UserError, match=said + r": image data trains a picture network"):
        build_network(compose(f"model={model}", "data=cifar10").model, 3, 10, [32, 32])


def test_write_grid_png(tmp_path):
    n, h, w, scale, columns = 70, 28, 28, 3, 8
    images = torch.randint(0, 256, (n, 1, h, w), dtype=torch.uint8)
    predicted = ["cat"] * n
    true = ["cat", "dog", None] * 23 + ["cat"]
    path = tmp_path / "sub" / "grid.png"
    grid.write_grid(images, predicted, true, path, columns=columns, scale=scale)
    picture = Image.open(path)
    assert picture.format == "PNG" and picture.mode == "RGB"
    cell_w, cell_h = w * scale + 2 * grid.PAD, h * scale + 2 * grid.LINE + 2 * grid.PAD
    assert picture.size == (columns * cell_w, 8 * cell_h)  # capped at 64 images: 8 rows of 8
    pixels = torch.tensor(list(picture.getdata()), dtype=torch.int32).view(picture.size[1], picture.size[0], 3)

    def caption(i):  # the caption strip under image i
        x, y = (i % columns) * cell_w, (i // columns) * cell_h + grid.PAD + h * scale
        return pixels[y : y + 2 * grid.LINE, x : x + cell_w].reshape(-1, 3)

    def hues(strip):  # (green, red, white) text pixels; anti-aliased edges blend into the black background
        r, g, b = strip.unbind(1)
        return (
            int(((g > r + 60) & (g > b + 60)).sum()),
            int(((r > g + 60) & (r > b + 60)).sum()),
            int(((r > 150) & (g > 150) & (b > 150)).sum()),
        )

    green, red, white = hues(caption(0))  # right
    assert green > 20 and red == 0 and white == 0
    green, red, white = hues(caption(1))  # wrong
    assert red > 20 and green == 0 and white == 0
    green, red, white = hues(caption(2))  # true label unknown
    assert white > 10 and red == 0 and green == 0
    top = pixels[grid.PAD : grid.PAD + h * scale, grid.PAD : grid.PAD + w * scale]  # image 0, upscaled in gray
    want = images[0, 0].repeat_interleave(scale, 0).repeat_interleave(scale, 1).int()
    assert torch.equal(top[..., 0], want) and torch.equal(top[..., 2], want)


def test_meta_device_build_for_the_planner(tmp_path, recwarn):
    path = tmp_path / "v28.safetensors"
    save_file(build_zoo("v28_cnn", in_channels=3, num_classes=100, image_size=32).state_dict(), path)
    for cfg in [{"source": "zoo:v28_cnn", "weights": str(path)}, {"source": "timm:resnet18"}]:
        with torch.device("meta"):
            model = build_classifier(cfg, 3, 10, [32, 32])
        assert all(p.is_meta for p in model.parameters())
        assert model.train()(torch.empty(2, 3, 32, 32, device="meta")).shape == (2, 10)
    assert not [w for w in recwarn if "meta" in str(w.message)]  # the weights file is not copied onto meta


def test_a_linear_probe_of_a_random_network_is_refused_at_plan_time(tmp_path):
    """recipe=oxford_flowers_probe without model.weights cached the features of a random EfficientNet-B0 and
    trained a head on them without a word; the recipe promises a pretrained one."""
    from conftest import compose

    from onn.hardware.profile import resolve
    from onn.modalities import get

    probe = ("recipe=oxford_flowers_probe", "data.source=/nowhere", "hardware=cpu_16gb")
    cfg = compose(*probe)
    with pytest.raises(UserError, match="model.weights=PATH.safetensors, or use strategy=full"):
        get("image").plan(cfg, resolve(cfg.hardware, "/tmp", "/tmp"))
    weights = tmp_path / "efficientnet_b0.safetensors"
    save_file({"unread": torch.zeros(1)}, weights)  # the planner builds on the meta device: no value is read
    cfg = compose(*probe, f"model.weights={weights}")
    assert get("image").plan(cfg, resolve(cfg.hardware, "/tmp", "/tmp"))[0].strategy == "linear_probe"


@pytest.mark.parametrize("groups", [("model=v28_cnn", "data=image"), ("model=audio_cnn", "data=fsdd")])
def test_the_plan_counts_the_head_it_sizes_a_linear_probe_by(groups):
    """Planning read the probe's head width with feature_extractor, which removes the head in place: the spec
    (params_total, FLOPs) then counted a network without it."""
    from conftest import compose

    from onn.hardware.profile import resolve
    from onn.modalities import get

    cfg = compose(*groups, "hardware=cpu_16gb")
    m = get(cfg.data.modality)
    _, spec = m.plan(cfg, resolve(cfg.hardware, "/tmp", "/tmp"))
    network = m.network(cfg.model, m.planned_inputs(cfg))
    assert spec.params == sum(p.numel() for p in network.parameters())
    assert spec.head_params == (network.num_features + 1) * 10  # 10 classes planned
