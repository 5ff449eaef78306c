"""Review 6: image classification on real CIFAR-10 JPEGs (odd pictures mixed in, the class mapping on another
machine's folder) and the safetensors export as Hugging Face, timm and safetensors users load it: a LoRA adapter
on a tied head or embedding, a timm network's folder, a compiled network, the training's label names and mean/std."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA, compose

from onn.errors import UserError

CIFAR = SHARED_DATA / "cifar10" / "cifar10-jpeg.tar.gz"


def lora_llama(tmp: Path, target: str):
    """llama_tiny with tied embeddings and a LoRA adapter on `target` (and q_proj), every adapter weight random (a
    fresh adapter adds nothing, and its merge would be a no-op)."""
    from onn.hardware.profile import resolve
    from onn.modalities.text.tasks import build
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec

    cfg = compose(
        "model=llama_tiny",
        "hardware=cpu_16gb",
        "tracking=none",
        "strategy=lora",
        "model.architecture.tie_word_embeddings=true",
        f"strategy.lora.target_modules=[q_proj,{target}]",
        root=tmp,
    )
    plan = make_plan(cfg, resolve(cfg.hardware, tmp / "cache", tmp), model_spec(cfg.model, 8))
    module, tokenizer = build(cfg, plan)
    g = torch.Generator().manual_seed(1)
    for name, p in module.model.named_parameters():
        if "lora_B" in name or "lora_embedding_B" in name:
            p.data.normal_(0, 0.1, generator=g)
    return module.model.eval(), tokenizer


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_an_adapter_on_a_tied_weight_is_exported_untied_and_computes_what_onn_does(tmp_path, target):
    """An adapter on a tied lm_head (or on the embeddings it is tied to) changes one of the two in the live model. The
    export wrote the shared weight once, unmerged (the head's adapter) or merged into both (the embedding's), and
    kept tie_word_embeddings: transformers tied them again, and the folder computed other logits than ONN (by 1.4)."""
    from transformers import AutoModelForCausalLM

    from onn.export.hf import merged_model, save_folder

    model, tokenizer = lora_llama(tmp_path, target)
    save_folder(model, tokenizer, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        torch.testing.assert_close(loaded(ids).logits, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(merged_model(model)(ids).logits, want, atol=1e-5, rtol=0)  # the ONNX exporter's
    assert model.get_base_model().config.tie_word_embeddings  # the live model is left as it was


def test_an_adapter_on_blocks_that_share_weights_keeps_the_heads_tie(tmp_path):
    """Two blocks sharing one module (ALBERT's, Zamba2's shared block) with LoRA on it, the head tied to the
    embeddings: the shared block's two names counted as an adapted weight tied to another, so the folder was untied
    while lm_head.weight, a tied copy, was left out: from_pretrained drew the head at random."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from onn.export.hf import save_folder
    from onn.models.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=259,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    base = LlamaForCausalLM(config)
    base.model.layers[1] = base.model.layers[0]  # one block, run twice
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).eval()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)
    save_folder(model, byte_tokenizer(), tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()  # (its second block: a Llama's own)
    embeddings = model.get_base_model().model.embed_tokens.weight
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    torch.testing.assert_close(loaded.lm_head.weight, embeddings, atol=0, rtol=0)


def timm_network(*overrides: str, classes: int = 3, size: tuple[int, int] = (32, 32)):
    from onn.models.vision import build_classifier

    cfg = compose("model=resnet18", *overrides)
    torch.manual_seed(0)
    return cfg, build_classifier(cfg.model, 3, classes, list(size)).eval()


def onn_config(cfg, classes: list[str], size=(32, 32)) -> dict:
    from onn.config import as_dict

    inputs = {"classes": classes, "input_shape": [3, *size], "seed": 0, "mean": [0.49, 0.48, 0.45], "std": [0.25] * 3}
    return {"model": as_dict(cfg.model), "inputs": inputs, "modality": "image"}


@pytest.mark.parametrize("source", ["timm:test_resnet", "timm:test_vit"])
def test_a_timm_networks_export_loads_in_timm_with_the_training_labels_and_statistics(tmp_path, source):
    """The export's config.json held ONN's keys alone: timm.create_model("local-dir:...") failed on its missing
    `architecture`, and neither timm's label_names nor Hugging Face's id2label/label2id were there."""
    import timm
    from timm.data import resolve_data_config

    from onn.export.hf import save_network

    classes = ["airplane", "cat", "ship"]
    size = (32, 32) if source.endswith("resnet") else (48, 48)  # test_vit: built for 160 px, given its img_size
    cfg, network = timm_network(f"model.source={source}", "model.small_input=false", size=size)
    save_network(network, tmp_path, onn_config(cfg, classes, size))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["id2label"] == {"0": "airplane", "1": "cat", "2": "ship"}
    assert config["label2id"] == {"airplane": 0, "cat": 1, "ship": 2}
    assert config["label_names"] == classes and config["num_classes"] == 3 and config["dtype"] == "float32"
    assert config["inputs"]["classes"] == classes and config["modality"] == "image"  # what ONN reads back

    loaded = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    assert loaded.pretrained_cfg["label_names"] == classes
    data = resolve_data_config({}, model=loaded)
    assert tuple(data["mean"]) == (0.49, 0.48, 0.45) and tuple(data["std"]) == (0.25, 0.25, 0.25)
    assert tuple(data["input_size"]) == (3, *size) and data["crop_pct"] == 1.0
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), network(x), atol=1e-5, rtol=0)


def test_a_network_onn_changed_for_small_images_is_not_described_as_timms_own(tmp_path):
    """resnet18 at 32 px has ONN's 3x3 stem and no stem pool: timm's resnet18 by name has other shapes, so the folder
    carries no timm architecture (that would build a 7x7 stem and fail on the weights); its labels are still there,
    and the weights load into the network ONN builds."""
    from safetensors.torch import load_model

    from onn.export.hf import save_network

    cfg, network = timm_network("model.small_input=true")
    save_network(network, tmp_path, onn_config(cfg, ["a", "b", "c"]))
    config = json.loads((tmp_path / "config.json").read_text())
    assert "architecture" not in config and "pretrained_cfg" not in config
    assert config["id2label"] == {"0": "a", "1": "b", "2": "c"}
    _, rebuilt = timm_network("model.small_input=true")
    rebuilt.apply(lambda m: [p.data.zero_() for p in m.parameters(recurse=False)])
    load_model(rebuilt, str(tmp_path / "model.safetensors"))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), network(x), atol=0, rtol=0)


def test_a_compiled_networks_export_holds_the_networks_own_names(tmp_path):
    """model.compile=true: the export saved the torch.compile wrapper, every name prefixed `_orig_mod.`, which
    neither model.weights nor timm nor load_model into the network could take back."""
    from safetensors.torch import load_file

    from onn.export.hf import save_network
    from onn.models.vision import load_weights

    cfg, network = timm_network("model.source=timm:test_resnet", "model.small_input=false")
    save_network(torch.compile(network), tmp_path, onn_config(cfg, ["a", "b", "c"]))
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert names == set(network.state_dict()) and not any(n.startswith("_orig_mod") for n in names)
    assert json.loads((tmp_path / "config.json").read_text())["architecture"] == "test_resnet"
    _, rebuilt = timm_network("model.source=timm:test_resnet", "model.small_input=false")
    load_weights(rebuilt, tmp_path / "model.safetensors")  # model.weights=.../model.safetensors
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(x), network(x))


class _Module:
    """What input_stats reads of a data module: its training images, resident."""

    streamed = False

    def __init__(self, images: torch.Tensor):
        from onn.data.resident import Split

        self.splits = {"train": Split(images, torch.zeros(len(images), dtype=torch.long), [])}
        self.input_shape = tuple(images.shape[1:])


def test_a_given_mean_or_std_is_kept_beside_a_measured_one_and_a_single_number_is_one_value(tmp_path):
    """data.mean=[...] with data.std=auto measured both, the given mean replaced without a word; data.mean=0.5 (one
    number) was a TypeError traceback."""
    from onn.modalities.image.dataset import input_stats

    images = torch.full((4, 3, 2, 2), 51, dtype=torch.uint8)  # every value 0.2: mean 0.2, std 0 (clamped: 0.001)
    images[:, 1] = 102  # channel 1: 0.4
    dm = _Module(images)

    def stats(*overrides: str):
        return input_stats(compose("model=v28_cnn", "data=image", *overrides), dm)

    assert stats() == ([0.2, 0.4, 0.2], [0.001] * 3)
    assert stats("data.mean=[0.5,0.5,0.5]") == ([0.5, 0.5, 0.5], [0.001] * 3)
    assert stats("data.std=[0.3,0.3,0.3]") == ([0.2, 0.4, 0.2], [0.3, 0.3, 0.3])
    assert stats("data.mean=0.5", "data.std=0.25") == ([0.5] * 3, [0.25] * 3)  # one number: every channel's
    with pytest.raises(UserError, match=r"^data\.mean='dark': give auto, one number, or 3 numbers"):
        stats("data.mean=dark")
    with pytest.raises(UserError, match=r"^data\.std=\[0\.2, 0\.3\]: give auto, one number, or 3 numbers"):
        stats("data.std=[0.2,0.3]")  # two numbers for three channels broadcast nowhere


# --- real CIFAR-10 JPEGs --------------------------------------------------------------------------------------


CLASSES = ["airplane", "automobile", "frog", "ship"]


def cifar_folder(root: Path, train: int = 50, test: int = 12) -> Path:
    """The first `train` and `test` JPEGs of four classes, out of the real archive, with what other folders hold
    mixed in: a greyscale and a CMYK JPEG, an RGBA and a 16-bit greyscale PNG, a JPEG stored turned (EXIF
    orientation 6), and a file that is no picture."""
    from PIL import Image

    want = {(split, c): n for split, n in (("train", train), ("test", test)) for c in CLASSES}
    got: dict[tuple[str, str], int] = {}
    with tarfile.open(CIFAR) as archive:
        for member in archive:
            parts = member.name.split("/")
            key = tuple(parts[:2])
            if len(parts) != 3 or not member.isfile() or got.get(key, 0) >= want.get(key, 0):
                continue
            got[key] = got.get(key, 0) + 1
            (root / parts[0] / parts[1]).mkdir(parents=True, exist_ok=True)
            (root / member.name).write_bytes(archive.extractfile(member).read())
            if got == want:
                break
    train_dir = root / "train"
    picture = Image.open(next((train_dir / "frog").glob("*.jpg"))).convert("RGB")
    picture.convert("L").save(train_dir / "frog" / "grey.jpg")
    picture.convert("CMYK").save(train_dir / "frog" / "cmyk.jpg")
    rgba = picture.convert("RGBA")
    rgba.putalpha(100)
    rgba.save(train_dir / "ship" / "rgba.png")
    Image.fromarray(np.asarray(picture.convert("L")).astype(np.uint16) * 257).save(train_dir / "ship" / "grey16.png")
    exif = Image.Exif()
    exif[0x0112] = 6
    picture.save(train_dir / "airplane" / "turned.jpg", exif=exif.tobytes(), quality=95)
    (train_dir / "airplane" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a picture")
    return root


def run(tmp: Path, name: str, *overrides: str) -> tuple[dict, Path]:
    from onn.app import execute
    from onn.training.checkpoints import resolve

    cfg = compose(
        "model=v28_cnn",
        "data=image",
        "hardware=cpu_16gb",
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp / 'outputs'}",
        f"paths.cache={tmp / 'cache'}",
        "data.batch_size=32",
        "trainer.max_steps=-1",
        "optim.warmup_steps=0",
        *overrides,
    )
    if cfg.ckpt:
        cfg.ckpt = str(resolve(cfg.ckpt, cfg.paths.outputs))
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return execute(cfg, run_dir, {o.split("=", 1)[0] for o in overrides}), run_dir


@pytest.fixture(scope="module")
def cifar_run(tmp_path_factory):
    if not CIFAR.is_file():
        pytest.skip(f"{CIFAR} is not here")
    tmp = tmp_path_factory.mktemp("cifar")
    data = cifar_folder(tmp / "data")
    metrics, run_dir = run(tmp, "train", f"data.source={data}", "trainer.max_epochs=2", "export=safetensors")
    return tmp, data, metrics, run_dir


@pytest.mark.slow
def test_real_cifar_jpegs_train_with_odd_pictures_mixed_in_and_export_the_training_label_names(cifar_run):
    tmp, data, metrics, run_dir = cifar_run
    assert metrics["items_skipped"] == 1  # broken.jpg; the grey, CMYK, RGBA, 16-bit and turned pictures train
    folder = Path(metrics["export/path"])
    config = json.loads((folder / "config.json").read_text())
    assert config["inputs"]["classes"] == CLASSES == config["label_names"]
    assert config["id2label"] == {str(i): c for i, c in enumerate(CLASSES)}
    assert config["label2id"] == {c: i for i, c in enumerate(CLASSES)}
    assert config["inputs"]["input_shape"] == [3, 32, 32]
    mean, std = config["inputs"]["mean"], config["inputs"]["std"]  # measured on these photos: not 0.5 or 0
    assert all(0.3 < m < 0.65 for m in mean) and all(0.15 < s < 0.35 for s in std)


@pytest.mark.slow
def test_another_machines_folder_without_a_class_is_scored_and_predicted_by_class_name(cifar_run):
    """Eval and infer of the checkpoint on a folder that lacks `automobile` (its classes then sort to other positions)
    label each picture by its name in the checkpoint's classes: both score the same pictures the same; and a folder
    holding a test/ split alone is scored too (it was refused for having no training data)."""
    tmp, data, _, run_dir = cifar_run
    other = tmp / "other"
    shutil.copytree(data / "test", other / "test")
    shutil.rmtree(other / "test" / "automobile")
    flat = tmp / "flat"
    shutil.copytree(other / "test", flat)
    scored, _ = run(tmp, "eval", "task=eval", f"ckpt={run_dir}", f"data.source={flat}")
    predicted, infer_dir = run(tmp, "infer", "task=infer", f"ckpt={run_dir}", f"task.input={flat}")
    rows = [json.loads(line) for line in (infer_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 36 and {r["true"] for r in rows} == {"airplane", "frog", "ship"}
    assert all(r["predicted"] in CLASSES and sorted(c for c, _ in r["top5"]) == CLASSES for r in rows)
    assert scored["val/acc"] == predicted["infer/acc"] == round(sum(r["true"] == r["predicted"] for r in rows) / 36, 5)
    split, _ = run(tmp, "eval_split", "task=eval", f"ckpt={run_dir}", f"data.source={other}")
    assert split["val/acc"] == scored["val/acc"]
