"""Models and export review 11: a folder whose tokenizer gained tokens its model was not resized for loads with its
embeddings resized (an IndexError at the first batch before, a device-side assert on a GPU); the zoo's picture and
clip networks and export's sample input take a one-element image size as a square; an export killed half-way leaves
no temporary folder the next export keeps, and an earlier export it had moved aside is put back."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from conftest import compose, tiny_llama

from onn.errors import UserError
from onn.export.folders import MARKER, STARTED, sweep_leftovers, write_atomically
from onn.export.onnx_export import export_onnx, run_onnx, sample_inputs
from onn.models.load import load, load_4bit
from onn.models.tokenizer import byte_tokenizer
from onn.models.zoo.audio_cnn import AudioCNN
from onn.models.zoo.registry import build_zoo
from onn.models.zoo.v28 import V28CNN
from onn.models.zoo.video3d import C3DTiny


def outgrown_folder(folder):
    """A tiny Llama of 259 embeddings saved with a byte tokenizer that gained two tokens (ids 259, 260), and the
    model config that loads the folder with its own tokenizer."""
    saved = tiny_llama(vocab_size=259)
    saved.save_pretrained(folder)
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(folder)
    cfg = compose("model=llama_tiny", f"model.source={folder}", "model.architecture=null", "model.tokenizer=null")
    return saved, cfg.model


def test_a_folder_whose_tokenizer_gained_tokens_loads_resized_and_trains(tmp_path):
    """Tokens added to a folder's tokenizer (ids 259, 260) past its model's 259 embeddings: the folder loads with its
    embeddings resized, the same rows each load, its own rows kept, and text with those tokens trains."""
    saved, cfg = outgrown_folder(tmp_path)
    model, tokenizer = load(cfg)
    again, _ = load(cfg)
    rows = model.get_input_embeddings().weight
    assert rows.shape[0] >= 261 and torch.equal(rows, again.get_input_embeddings().weight)
    assert torch.equal(rows[:259], saved.get_input_embeddings().weight)
    batch = tokenizer(["<think> two </think>", "<think> one"], return_tensors="pt", padding=True)
    assert batch["input_ids"].max() == 260
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_zoo_networks_take_one_side_as_a_square():
    """image_size=[32] (data.image_size's one-element form) built V28CNN from a failed unpacking and C3DTiny and
    AudioCNN from an IndexError; it is the square [32, 32]. Another length is one sentence."""
    for network, square in ((V28CNN, (2, 3, 32, 32)), (AudioCNN, (2, 1, 32, 32)), (C3DTiny, (2, 3, 4, 32, 32))):
        kwargs = {"in_channels": square[1], "frames": 4} if network is C3DTiny else {"in_channels": square[1]}
        one, two = network(image_size=[32], **kwargs), network(image_size=[32, 32], **kwargs)
        assert [p.shape for p in one.parameters()] == [p.shape for p in two.parameters()]
        assert one.pretrained_cfg["input_size"] == two.pretrained_cfg["input_size"]
        assert one.eval()(torch.randn(square)).shape == (2, 10)
    with pytest.raises(UserError, match=r"zoo:v28_cnn: image_size=\[32, 32, 3\] is not \[H, W\]"):
        build_zoo("v28_cnn", image_size=[32, 32, 3])


def test_an_export_sample_of_one_side_is_a_square_picture():
    """sample_inputs(image_size=[24]) ("one side of a square", as its docstring says) made a [2, 3, 24] tensor,
    which the network then failed on."""
    model = V28CNN(image_size=24).eval()
    sample = sample_inputs(model, batch_size=2, image_size=[24])
    assert sample["pixel_values"].shape == (2, 3, 24, 24)
    assert model(*sample.values()).shape == (2, 10)


def ended_process() -> int:
    """The id of a process that has ended, as an export killed half-way has."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_killed_exports_temporary_folder_is_removed_by_the_next_export(tmp_path):
    """A killed ONNX export left .model.onnx.tmp-PID-... beside the output, with the weights in it, for good; the next
    export removes it, and leaves alone the temporary folder of an export still running (this test's parent)."""
    output = tmp_path / "model.onnx"
    dead = tmp_path / f".model.onnx.tmp-{ended_process()}-k1ll3d"
    dead.mkdir()
    (dead / "model.onnx.0123456789ab.data").write_bytes(b"\0" * 4096)
    running = tmp_path / f".model.onnx.tmp-{os.getppid()}-alive"
    running.mkdir()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    x = torch.randn(2, 4)
    export_onnx(model, output, {"x": x})
    assert not dead.exists() and running.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.onnx", running.name])
    got = run_onnx(output, {"x": x.numpy()})
    assert torch.allclose(torch.from_numpy(next(iter(got.values()))), model(x).detach(), atol=1e-5)


def test_an_earlier_export_moved_aside_by_a_killed_export_is_put_back(tmp_path):
    """Killed between moving the earlier folder export aside (.hf.old-PID) and renaming the new one in (.hf.tmp-PID),
    the export left no folder at its output: the next export, even one that fails, puts the earlier one back."""
    output, pid = tmp_path / "hf", ended_process()
    earlier = tmp_path / f".hf.old-{pid}"
    earlier.mkdir()
    (earlier / MARKER).write_text(json.dumps({"written_by": "onn", "kind": "hf", "model": "m"}))
    (earlier / "model.safetensors").write_bytes(b"earlier")
    (tmp_path / f".hf.tmp-{pid}").mkdir()

    def fails(folder):
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        write_atomically(output, "hf", fails, "m")
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert (output / "model.safetensors").read_bytes() == b"earlier"
    write_atomically(output, "hf", lambda folder: (folder / "model.safetensors").write_bytes(b"new"), "m")
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert (output / "model.safetensors").read_bytes() == b"new"


def test_a_bart_folder_loads_with_its_lm_head(tmp_path):
    """A BartForConditionalGeneration folder (config.json's architectures) loaded as the bare BartModel: its LM head
    dropped (final_logits_bias "unexpected"), hidden states where logits were meant, and an export of those."""
    import transformers as tf

    config = tf.BartConfig(
        vocab_size=259,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        decoder_start_token_id=257,
    )
    torch.manual_seed(0)
    saved = tf.BartForConditionalGeneration(config).eval()
    saved.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    cfg = compose(
        "model=llama_tiny", f"model.source={tmp_path}", "model.architecture=null", "model.tokenizer=null"
    ).model
    model, tokenizer = load(cfg)
    assert isinstance(model, tf.BartForConditionalGeneration)
    batch = tokenizer(["a bart"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model.eval()(**batch).logits, saved(**batch).logits)


def ended_pid() -> int:
    """The id of a process that has ended."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_an_export_still_writing_in_this_process_keeps_its_temporary_folder(tmp_path):
    """The sweep counted this process's own temporaries as an ended export's: omny's writer swept away the traced
    graph's folder onnx_export still had open. A dead process's is swept, this one's kept."""
    output = tmp_path / "model.omny"
    mine = tmp_path / f".model.omny.tmp-{os.getpid()}-abc"
    dead = tmp_path / f".model.omny.tmp-{ended_pid()}-x"
    mine.mkdir()
    dead.mkdir()
    sweep_leftovers(output)
    assert mine.is_dir() and not dead.exists()


def test_a_qlora_base_of_a_folder_whose_tokenizer_gained_tokens_is_resized(tmp_path):
    """strategy=qlora's 4-bit base of such a folder kept its 259 rows: the first added token failed in the
    embedding (IndexError on a CPU, a device assert on a GPU); it is resized as load() resizes it."""
    pytest.importorskip("bitsandbytes")
    _, cfg = outgrown_folder(tmp_path)
    model, tokenizer = load_4bit(cfg, torch.float32, tmp_path / "cache")
    assert model.get_input_embeddings().num_embeddings >= 261
    batch = tokenizer(["<think> two"], return_tensors="pt")
    assert torch.isfinite(model(**batch).logits).all()


def test_a_leftover_named_with_this_process_id_from_before_it_started_is_swept(tmp_path):
    """A container starts each run with the same process id: a killed run's `.model.tmp-PID` was this process's
    own by its name, kept, and the next export's mkdir of that name failed (FileExistsError)."""
    output = tmp_path / "model.omny"
    earlier = tmp_path / f".model.omny.tmp-{os.getpid()}-x"
    earlier.mkdir()
    os.utime(earlier, (STARTED - 60, STARTED - 60))
    sweep_leftovers(output)
    assert not earlier.exists()
