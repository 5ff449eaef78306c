"""Image, audio and video input a user plausibly has, run through the real readers, models and training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MODALITY_HARDWARE, compose
from PIL import Image
from safetensors.torch import save_file

from onn.config.model import NetworkConfig
from onn.errors import UserError
from onn.modalities.image.formats import read_splits
from onn.models.vision import build_classifier


def run(tmp: Path, *overrides: str, name: str = "run") -> dict:
    """A short run of `python run.py OVERRIDES` in this process, its outputs and cache under tmp (with ckpt=, the
    overrides given take the checkpoint's place)."""
    from onn.app import execute, given_keys

    cfg = compose(
        MODALITY_HARDWARE,
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp / 'outputs'}",
        f"paths.cache={tmp / 'cache'}",
        "optim.warmup_steps=0",
        *overrides,
    )
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.ckpt:
        from onn.training.checkpoints import resolve

        cfg.ckpt = str(resolve(cfg.ckpt, cfg.paths.outputs))
    return execute(cfg, run_dir, given_keys(list(overrides)))


def gray16_folder(root: Path, per_class: int = 4) -> Path:
    """Two classes of 16-bit greyscale PNGs (a scanner's or a microscope's), one dark and one bright."""
    for c, level in (("dark", 12_000), ("bright", 50_000)):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.full((8, 8), level + 100 * i, np.uint16)
            Image.fromarray(pixels).save(root / c / f"{i}.png")
    return root


def test_16_bit_grey_images_read_in_colour_keep_their_levels(tmp_path):
    """data.channels=3 on 16-bit (and 32-bit, float) grey pictures: PIL's convert("RGB") clips them to white (or black
    for float), so a colour model trained on them saw blank images; they are scaled to 8 bits first."""
    root = gray16_folder(tmp_path / "scans")
    grey = read_splits(root, channels=1)["all"]
    colour = read_splits(root, channels=3)["all"]
    assert grey.images.shape[1] == 1 and colour.images.shape[1] == 3
    assert torch.equal(colour.images, grey.images.expand_as(colour.images))
    assert colour.images.float().mean() < 200  # the dark class: 12000 >> 8 = 46, not 255
    float_tiff = tmp_path / "float" / "x" / "a.tif"
    float_tiff.parent.mkdir(parents=True)
    Image.fromarray(np.full((4, 4), 0.5, np.float32)).save(float_tiff)
    assert read_splits(float_tiff.parent.parent, channels=3)["all"].images.unique().tolist() == [128]


def vit(**model: object) -> NetworkConfig:
    return NetworkConfig(name="vit", source="timm:vit_tiny_patch16_224", kwargs={"depth": 1}, **model)


def test_a_vision_transformer_is_built_for_the_data_s_image_size(tmp_path):
    """timm's ViT, DeiT and Swin are built for 224 px and assert the input size in their forward: on 32 px images
    the first step was a raw AssertionError. They are built with img_size of the data, and ImageNet weights' position
    embeddings are interpolated to that grid (as timm does for its own pretrained weights)."""
    net = build_classifier(vit(), 3, 10, [32, 48])
    assert net(torch.zeros(2, 3, 32, 48)).shape == (2, 10)
    imagenet = build_classifier(vit(), 3, 1000, [224, 224])
    weights = tmp_path / "vit.safetensors"
    save_file({k: v.contiguous() for k, v in imagenet.state_dict().items()}, str(weights))
    loaded = build_classifier(vit(weights=str(weights)), 3, 10, [32, 32])
    assert loaded.pos_embed.shape[1] == 1 + 2 * 2
    assert torch.equal(loaded.pos_embed[0, 0], imagenet.pos_embed[0, 0])  # the class token's, kept
    assert torch.equal(loaded.blocks[0].attn.qkv.weight, imagenet.blocks[0].attn.qkv.weight)
    assert loaded(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


def test_a_vision_transformer_trains_on_small_images(tmp_path):
    root = gray16_folder(tmp_path / "scans")
    metrics = run(
        tmp_path,
        "model=resnet18",
        "model.source=timm:vit_tiny_patch16_224",
        "+model.kwargs={depth: 1}",
        "data=image",
        f"data.source={root}",
        "data.image_size=[16,16]",
        "data.resize=resize",
        "data.batch_size=4",
        "trainer.max_steps=2",
    )
    assert metrics["steps"] == 2 and np.isfinite(metrics["train/loss_final"])


@pytest.mark.parametrize(
    ("override", "said"), [("data.motion.size=25", "25x25"), ("data.motion.codec=h264_nope", "h264_nope")]
)
def test_builtin_motion_says_which_setting_the_encoder_refused(tmp_path, override, said):
    """An odd data.motion.size (H.264 in yuv420p needs even sides) or an encoder PyAV lacks was PyAV's raw
    ExternalError ('Generic error in an external library') or UnknownCodecError, with a half-written folder left."""
    with pytest.raises(UserError, match=f"data.motion.codec=.*{said}"):
        run(
            tmp_path,
            "recipe=video_motion",
            "data.motion.train_per_class=2",
            "data.motion.test_per_class=2",
            override,
            "trainer.max_steps=1",
        )
    assert not list((tmp_path / "cache" / "builtin").glob("motion-*"))


def noise_folder(root: Path, shape: tuple[int, ...]) -> Path:
    """Two classes of random pictures of one shape ([H, W]: greyscale, [H, W, 3]: colour)."""
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 256, shape, np.uint8)).save(root / c / f"{i}.png")
    return root


def test_eval_of_another_source_decodes_images_as_the_model_was_trained(tmp_path):
    """task=eval ckpt=RUN data.source=OTHER decoded OTHER by the data config (channels auto, no image_size): colour
    20 px pictures for a model trained on grey 12 px ones were a conv's raw channel error. They are read as the model
    was trained (grey, 12 px), as task=infer reads them and as audio and video decode for their checkpoints."""
    grey = noise_folder(tmp_path / "grey", (12, 12))
    colour = noise_folder(tmp_path / "colour", (20, 20, 3))
    common = ["model=v28_cnn", "data=image", "data.batch_size=8", "+model.kwargs.widths=[8,16]"]
    trained = run(tmp_path, *common, f"data.source={grey}", "trainer.max_steps=2")
    assert trained["steps"] == 2
    evaluated = run(tmp_path, "task=eval", f"ckpt={tmp_path / 'run'}", f"data.source={colour}", name="eval")
    assert 0 <= evaluated["val/acc"] <= 1 and np.isfinite(evaluated["val/loss"])


class LargestTensor:
    """The most bytes one tensor that torch made inside `with LargestTensor() as seen:` held (seen.bytes)."""

    def __enter__(self) -> LargestTensor:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self
        self.bytes = 0

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, tuple | list) else (out,):
                    if isinstance(t, torch.Tensor):
                        outer.bytes = max(outer.bytes, t.numel() * t.element_size())
                return out

        self._mode = Record()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def test_measuring_the_normalisation_of_large_images_takes_chunks_of_a_fixed_size(tmp_path):
    """data.mean=auto measured 500 images at a time in float64, whatever their size: 110 MB a copy for STL-10's
    96 px, 3 GB for 512 px photos, on the GPU beside the resident data. Chunks now hold a fixed number of values, and
    the figures stay those of the pixels."""
    from onn.modalities.image.dataset import input_stats
    from onn.modalities.registry import get

    rng = np.random.default_rng(0)
    n = 600
    pixels = rng.integers(0, 256, (n, 3, 96, 96), np.uint8)
    (tmp_path / "train_X.bin").write_bytes(pixels.transpose(0, 1, 3, 2).tobytes())  # STL-10 stores columns first
    (tmp_path / "train_y.bin").write_bytes((np.arange(n) % 2 + 1).astype(np.uint8).tobytes())
    config = compose("model=v28_cnn", "data=image", f"data.source={tmp_path}", f"paths.cache={tmp_path / 'cache'}")
    dm = get("image").datamodule(config, "cpu")
    dm.setup()
    images = dm.splits["train"].inputs
    with LargestTensor() as seen:
        mean, std = input_stats(config, dm)
    assert seen.bytes < 64 * 2**20  # 500 x 3 x 96 x 96 float64 values are 110 MB
    expected = images.double().div(255)
    assert mean == pytest.approx(expected.mean(dim=(0, 2, 3)).tolist(), abs=1e-4)
    assert std == pytest.approx(expected.std(dim=(0, 2, 3)).tolist(), abs=1e-3)


def test_kinetics_weights_load_into_a_video_resnet_for_greyscale_clips(tmp_path):
    """data.channels=1 with a torchvision video ResNet's weights: timm's adapt_input_conv takes 4-D weights only, so the
    3-D stem's were a raw NotImplementedError; they are summed over RGB, as a 2-D network's are."""
    import torchvision.models.video as video

    from onn.models.video import build_video_classifier

    kinetics = video.mc3_18(weights=None, num_classes=400)
    weights = tmp_path / "mc3_18.safetensors"
    save_file({k: v.contiguous() for k, v in kinetics.state_dict().items()}, str(weights))
    model_cfg = NetworkConfig(name="mc3", source="torchvision:mc3_18", weights=str(weights))
    grey = build_video_classifier(model_cfg, 1, 5, 4, [32, 32]).eval()
    assert torch.allclose(grey.stem[0].weight[:, 0], kinetics.stem[0].weight.sum(1))
    assert torch.equal(grey.layer1[0].conv1[0].weight, kinetics.layer1[0].conv1[0].weight)
    assert grey(torch.zeros(1, 1, 4, 32, 32)).shape == (1, 5)


def test_a_txt_list_of_image_paths_and_labels_trains_with_data_auto(tmp_path):
    """data=auto took a `path label` .txt list (ImageNet's val.txt, Caltech's lists) for image data, and then the image
    reader could not tell its format; it reads it as the csv it is, space-separated."""
    from onn.modalities.registry import detect

    for i in range(8):
        Image.new("RGB", (8, 8), (30 * i, 0, 0)).save(tmp_path / f"img {i}.png")
    lines = ["path label"] + [f'"img {i}.png" {"red" if i % 2 else "dark"}' for i in range(8)]
    table = tmp_path / "labels.txt"
    table.write_text("\n".join(lines) + "\n")
    assert detect(table)[0].name == "image"  # what data=auto composes
    metrics = run(
        tmp_path, "model=v28_cnn", "data=image", f"data.source={table}", "data.batch_size=4", "trainer.max_steps=1"
    )
    assert metrics["steps"] == 1 and metrics["modality"] == "image"
