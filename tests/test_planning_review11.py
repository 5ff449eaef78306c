"""Planning review 11: a folder whose own tokenizer outgrew its embeddings is planned with them resized, as load()
builds it (the plan counted config.json's rows); a streamed network's chunk past its blocks is one sentence at plan
time (the engine refused it at the run), and so is a classifier network's strategy.micro_batch (it trains the whole
batch); the several-device table sizes the precision strategy.precision asks for (it sized the machine's default: a
32-true run's gradients at 16 bits)."""

from __future__ import annotations

import pytest
import torch
from conftest import compose, tiny_llama

from onn.app import explain_out_of_memory
from onn.errors import UserError
from onn.hardware.profile import resolve
from onn.models.load import load
from onn.models.tokenizer import byte_tokenizer
from onn.planning.plan import make_plan
from onn.planning.scale import gradient_bytes, scale_plan
from onn.planning.spec import model_spec

STREAMED = ("strategy=sparse_lora", "strategy.layers=all", "model.kwargs.dropout=0")  # an LSTM stack, streamed


def test_a_streamed_networks_chunk_past_its_blocks_is_one_sentence_at_plan_time(tmp_path):
    """strategy.streaming.chunk_size=4 on a 2-block LSTM stack was planned as a chunk of 4 (its memory sized for
    4 blocks), and the streaming engine refused it when the run began."""
    from onn.modalities import get

    cfg = compose(
        "recipe=fsdd_lstm",
        "hardware=cpu_16gb",
        *STREAMED,
        "model.kwargs.layers=2",
        "strategy.streaming.chunk_size=4",
        root=tmp_path,
    )
    with pytest.raises(UserError, match=r"strategy\.streaming\.chunk_size=4: this model has 2 blocks; give 2 or"):
        get("audio").plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path))


def test_the_several_device_table_sizes_the_precision_asked_for(tmp_path):
    """strategy.precision=32-true on two A100s: the run trains fp32, and its gradients (what the all-reduce moves)
    are 4 bytes a weight; the table sized bf16-mixed, the A100's default, with half the gradient bytes."""
    common = ("task=plan", "model=llama_tiny", "hardware=a100_80gb", "hardware.count=2", "data.batch_size=4")
    common += ("hardware.interconnect_gb_s=0.000001", f"paths.cache={tmp_path / 'cache'}")  # 1 kB/s: seconds
    tables = {}
    for precision in ("32-true", "bf16-mixed"):
        cfg = compose(*common, "strategy=full", f"strategy.precision={precision}", root=tmp_path)
        hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
        tables[precision] = scale_plan(cfg, hw, model_spec(cfg.model, 8, cache_dir=str(tmp_path / "cache")))
    fp32, mixed = tables["32-true"], tables["bf16-mixed"]
    assert fp32["precision"] == "32-true" and mixed["precision"] == "bf16-mixed"
    weights = fp32["trainable_params"]  # a ring over 2 devices moves the gradient bytes once, here at 1 kB/s
    assert fp32["links"]["all_reduce_s"] == pytest.approx(4 * weights / 1000, rel=1e-3)
    assert mixed["links"]["all_reduce_s"] == pytest.approx(2 * weights / 1000, rel=1e-3)


def test_a_classifier_networks_micro_batch_is_one_sentence(tmp_path):
    """A classifier network trains each batch in one pass (make_network_streaming_plan checks the same):
    strategy.micro_batch=4 was planned and run as the whole batch of 32 without a word (where a user had lowered it
    to fit memory)."""
    from onn.modalities import get

    cfg = compose("recipe=fsdd_lstm", "hardware=cpu_16gb", "data.batch_size=32", "strategy.micro_batch=4")
    with pytest.raises(UserError, match=r"strategy\.micro_batch=4: this network trains each batch of data\."):
        get("audio").plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path))


def test_a_folder_whose_tokenizer_gained_tokens_is_planned_with_its_embeddings_resized(tmp_path):
    """Two tokens added to a 259-row model's tokenizer: load() resizes its embeddings to 261 rows, and the plan's
    parameters, vocabulary and memory are those of the model the run holds."""
    folder = tmp_path / "model"
    tiny_llama(vocab_size=259, tie_word_embeddings=False).save_pretrained(folder)
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(folder)
    cfg = compose(
        "model=llama_tiny",
        f"model.source={folder}",
        "model.architecture=null",
        "model.tokenizer=null",
        "hardware=cpu_16gb",
        f"paths.cache={tmp_path / 'cache'}",
        root=tmp_path,
    )
    model, _ = load(cfg.model)
    held = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    spec = model_spec(cfg.model, 8, cache_dir=str(tmp_path / "cache"))
    assert model.get_input_embeddings().num_embeddings == spec.vocab == 261
    assert spec.params == held  # (2 x 2 x 32 weights short before: the new rows of the embeddings and the head)
    plan = make_plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path), spec)
    assert plan.model["params"] == held


def test_one_side_of_an_image_size_is_planned_as_a_square(tmp_path):
    """data.image_size=[32] was refused ("give [height, width]") though the decoder and the zoo read one side as a
    square, and planned_inputs built an input of [3, 32], which the network could not take."""
    from onn.modalities import get

    cfg = compose("model=v28_cnn", "data=cifar10", "data.image_size=[32]", "hardware=cpu_16gb", root=tmp_path)
    image = get("image")
    image.check(cfg)
    assert image.planned_inputs(cfg)["input_shape"] == [3, 32, 32]
    image.plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path))  # plans (it was refused at check)


def test_a_classifiers_out_of_memory_advice_leaves_micro_batches_to_language_models():
    """The advice said to lower strategy.micro_batch, which a classifier network now refuses (it trains each batch
    in one pass); a language model's still names it."""
    error = torch.OutOfMemoryError("CUDA out of memory")
    image = explain_out_of_memory(error, compose("model=v28_cnn", "data=cifar10"))
    text = explain_out_of_memory(error, compose("model=llama_tiny"))
    assert "micro_batch" not in image and "strategy.micro_batch lower" in text


def test_gradients_are_two_bytes_in_16_bit_precisions_and_eight_in_64_true():
    """The several-device table sized every precision but a mixed one at 4 bytes a gradient (bf16-true's too)."""
    assert [gradient_bytes(p) for p in ("32-true", "bf16-mixed", "bf16-true", "16-true", "64-true")] == [4, 2, 2, 2, 8]
