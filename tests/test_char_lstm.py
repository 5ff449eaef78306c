"""The recurrent byte-level language model (model=char_lstm, onn/models/zoo/recurrent_lm.py) through the text
modality: truncated backpropagation through time stops the gradient at a chunk boundary and the loss still falls;
padding never changes a row's outputs and generation carries the state; recipe=char_lstm trains, resumes exactly
from last.ckpt, evaluates, generates (with its picture) and exports to ONNX; sequences longer than data.max_length
are said in one warning."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from conftest import compose

from onn.errors import UserError
from onn.modalities.text.module import CausalLM
from onn.models.zoo.recurrent_lm import RecurrentLMConfig, RecurrentLMForCausalLM

SPECIAL = {"bos_token_id": 61, "eos_token_id": 62, "pad_token_id": 63}
SGD = compose("optim.name=sgd", "optim.lr=0.1", "optim.schedule=constant", "optim.warmup_steps=0").optim


def tiny_lm(cell: str = "lstm", dropout: float = 0.0) -> RecurrentLMForCausalLM:
    torch.manual_seed(0)
    return RecurrentLMForCausalLM(
        RecurrentLMConfig(vocab_size=64, hidden_size=16, cell=cell, dropout=dropout, **SPECIAL)
    )


def fit(module: CausalLM, batches: list[dict[str, torch.Tensor]]) -> None:
    trainer = L.Trainer(
        max_steps=len(batches),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))


def chunked_batch() -> dict[str, torch.Tensor]:
    """Three chunks of 4 tokens: ids 10-39 in the first two, 50-59 in the third, targets only inside the third
    (labels at positions 9-11: positions 8-10 predict them). One row is padded from position 10 on."""
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randint(10, 40, (3, 8), generator=g), torch.randint(50, 60, (3, 4), generator=g)], dim=1)
    mask = torch.ones_like(ids)
    mask[2, 10:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :9] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_truncated_backpropagation_stops_at_the_chunk_boundary(cell):
    """Loss only on the third chunk: with task.tbptt_steps=4 the embeddings of the tokens of the first two chunks
    get no gradient (they reach the third chunk only through the detached state), and without it they do. The
    forward is the same either way: the first step's loss is equal."""
    batch = chunked_batch()
    early = batch["input_ids"][:, :8].unique()
    moved = {}
    for steps in (4, 0):
        module = CausalLM(tiny_lm(cell), SGD, max_steps=1, onn_config={}, micro_batch=3, tbptt_steps=steps)
        before = module.model.embed.weight.detach().clone()
        fit(module, [batch])
        moved[steps] = (module.model.embed.weight.detach() - before)[early].abs().amax().item(), module.train_losses
    assert moved[4][0] == 0.0 and moved[0][0] > 1e-4
    assert moved[4][1] == pytest.approx(moved[0][1], rel=1e-5)


def test_truncated_backpropagation_still_learns():
    """Twenty steps of chunks of 4 tokens over padded rows of 14: the loss falls well below where it started."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 8, (6, 14), generator=g)
    ids[:, 1::2] = ids[:, ::2] + 8  # every second token follows from the one before: learnable across chunks
    mask = torch.ones_like(ids)
    mask[::2, 11:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    optim = compose("optim.lr=0.02", "optim.schedule=constant", "optim.warmup_steps=0").optim
    module = CausalLM(tiny_lm(), optim, max_steps=20, onn_config={}, micro_batch=4, tbptt_steps=4)
    fit(module, [dict(batch) for _ in range(20)])
    assert module.train_losses[-1] < 0.5 * module.train_losses[0]


def test_padding_and_batching_leave_each_rows_outputs_and_generation_alone():
    """A row's logits are the same alone, right-padded or left-padded in a batch (eval, packed when generating);
    generation with the carried state picks what re-reading the whole text would."""
    model = tiny_lm().eval()
    short, long = torch.tensor([[5, 6, 7]]), torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        alone = model(input_ids=short).logits[0]
        for side in ("right", "left"):
            pad = torch.zeros(1, 3, dtype=torch.long)
            row = torch.cat([short, pad], 1) if side == "right" else torch.cat([pad, short], 1)
            mask = (torch.arange(6) < 3) if side == "right" else (torch.arange(6) >= 3)
            both = torch.stack([mask.long(), torch.ones(6, dtype=torch.long)])
            batch = {"input_ids": torch.cat([row, long]), "attention_mask": both}
            for use_cache in (None, True):
                logits = model(**batch, use_cache=use_cache).logits[0][mask]
                torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)
        generated = model.generate(
            torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.cat([short, long[:, :3]])], 1),
            attention_mask=torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]]),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=63,
        )[0, 6:]
        text = short
        for _ in range(6):
            text = torch.cat([text, model(input_ids=text).logits[:, -1:].argmax(-1)], 1)
    assert generated.tolist() == text[0, 3:].tolist()


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_the_scanned_recurrence_is_torchs_own(cell):
    """recurrence (the scan export traces) gives nn.LSTM's / nn.GRU's outputs and last state, from zeros and from a
    given state; a stack or a bidirectional RNN, which it does not run, is refused."""
    from onn.models.zoo.recurrent import CELLS, recurrence

    torch.manual_seed(0)
    rnn = CELLS[cell](5, 7, batch_first=True)
    x = torch.randn(3, 9, 5)
    h = torch.randn(1, 3, 7)
    for hx in (None, (h, torch.randn(1, 3, 7)) if cell == "lstm" else h):
        with torch.no_grad():
            (out, last), (want, want_last) = recurrence(rnn, x, hx), rnn(x, hx)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        for got, expected in zip(last if cell == "lstm" else (last,), want_last if cell == "lstm" else (want_last,)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one-layer, one-direction"):
        recurrence(CELLS[cell](5, 7, batch_first=True, bidirectional=True), x)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_the_exported_lm_reads_texts_of_any_length(tmp_path, cell):
    """Traced with 6 tokens, the ONNX graph (each recurrence an ONNX Scan) reads 1, 6 and 23 tokens, a padded row
    among them, as PyTorch does: torch.export on its own unrolls nn.LSTM and fixes the length it traced."""
    import numpy as np

    from onn.export.onnx_export import export_onnx, run_onnx

    model = tiny_lm(cell).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 60, (2, 6), generator=g)
    result = export_onnx(model, tmp_path / "lm.onnx", {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert result["export/fixed_axes"] == []
    for length in (1, 6, 23):
        ids, mask = torch.randint(0, 60, (3, length), generator=g), torch.ones(3, length, dtype=torch.long)
        mask[0, (length + 1) // 2 :] = 0
        got = run_onnx(tmp_path / "lm.onnx", {"input_ids": ids, "attention_mask": mask})["logits"]
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask).logits.numpy()
        keep = mask.numpy().astype(bool)
        np.testing.assert_allclose(got[keep], want[keep], atol=1e-5)


def test_tbptt_with_a_transformer_is_one_sentence(tmp_path):
    from onn.app import execute

    cfg = compose(
        "model=llama_tiny",
        "task.tbptt_steps=8",
        "trainer.max_steps=1",
        "tracking=none",
        f"paths.outputs={tmp_path / 'outputs'}",
    )
    with pytest.raises(UserError, match=r"task.tbptt_steps=8: .*model 'llama_tiny' carries none"):
        execute(cfg, tmp_path / "run")
    with pytest.raises(UserError, match="task.tbptt_steps=-1"):
        from onn.modalities import get

        get("text").check(compose("recipe=char_lstm", "task.tbptt_steps=-1"))


def test_sequences_longer_than_max_length_are_said_in_one_warning(tmp_path, caplog):
    from onn.modalities.text.datamodule import TextDataModule
    from onn.models.tokenizer import byte_tokenizer

    text = tmp_path / "lines.txt"
    text.write_text("short line\n" * 30 + "a much longer line than the others, " * 4 + "\n")
    cfg = compose("recipe=char_lstm", "data=text", f"data.source={text}", "data.max_length=32", "data.val_split=0.1")
    with caplog.at_level(logging.WARNING, logger="onn"):
        dm = TextDataModule(cfg.data, byte_tokenizer(), 4)
        dm.setup()
    said = [r.getMessage() for r in caplog.records if "data.max_length=32" in r.getMessage()]
    assert len(said) == 1 and "1 of" in said[0] and f"{text} line 31" in said[0] and "has 146" in said[0]
    assert max(len(ids) for ids, _ in dm.train_set + dm.val_set) == 32


def tiny_recipe(tmp_path, *overrides: str):
    return compose(
        "recipe=char_lstm",
        "data=math",
        "data.source=builtin:math",
        "data.builtin.train_size=200",
        "data.builtin.val_size=16",
        "data.max_length=40",
        "data.batch_size=8",
        "model.architecture.hidden_size=32",
        "task.tbptt_steps=16",
        "optim.schedule=constant",  # a run stopped at step 10 then has the uninterrupted run's learning rates
        "optim.warmup_steps=0",
        "checkpoint.every_n_steps=10",
        "trainer.val_check_interval=10",
        "tracking=csv",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
        *overrides,
    )


@pytest.mark.modalities
@pytest.mark.slow
def test_char_lstm_trains_resumes_exactly_evaluates_generates_and_exports(tmp_path):
    """recipe=char_lstm on built-in word problems with chunks of 16 bytes: the validation loss falls, ONNX agrees
    with PyTorch, a run stopped at step 10 and resumed from its last.ckpt ends where the uninterrupted one does,
    task=eval of the checkpoint gives its validation loss, task=infer continues a prompt and draws it, and task=serve
    (a KV cache's continuous batching) is refused in one sentence."""
    from onn.app import execute

    whole = execute(tiny_recipe(tmp_path, "trainer.max_steps=20", "export=onnx"), tmp_path / "whole")
    assert whole["val/loss_final"] < whole["val/loss_initial"] and whole["export/max_abs_diff"] < 1e-4
    execute(tiny_recipe(tmp_path, "trainer.max_steps=10"), tmp_path / "first")
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    resumed = execute(tiny_recipe(tmp_path, "trainer.max_steps=20", f"ckpt={last}"), tmp_path / "resumed")
    assert resumed["steps"] == 20 and resumed["train/loss_curve"] == pytest.approx(whole["train/loss_curve"], abs=1e-6)
    assert resumed["val/loss_final"] == pytest.approx(whole["val/loss_final"], abs=1e-6)
    ckpt = tmp_path / "whole" / "checkpoints" / "last.ckpt"
    common = [f"paths.outputs={tmp_path / 'outputs'}", "tracking=none", f"ckpt={ckpt}"]
    evaluated = execute(compose(*common, "task=eval", "task.max_samples=0"), tmp_path / "eval")
    assert evaluated["val/loss"] == pytest.approx(whole["val/loss_final"], rel=1e-5)
    infer = compose(*common, "task=infer", "prompt=What is 2 + 3?", "task.max_new_tokens=12")
    out = execute(infer, tmp_path / "infer")
    assert out["infer/completion"] and (tmp_path / "infer" / "tokens.png").is_file()
    with pytest.raises(UserError, match="model 'char_lstm' is recurrent"):
        execute(compose(*common, "task=serve", "serve.port=0"), tmp_path / "serve")


def test_a_one_layer_lm_trains_and_bad_architecture_keys_are_one_sentence(tmp_path):
    """One LSTM layer is a model (its LayerMap a list of one block); no layers, no width or an unknown cell is one
    sentence naming its model.architecture key, not advice about LoRA or a traceback from inside nn.LSTM."""
    from conftest import MODALITY_HARDWARE

    from onn.app import execute

    one = ("model.architecture.num_hidden_layers=1", "trainer.max_steps=2", "trainer.val_check_interval=2")
    metrics = execute(tiny_recipe(tmp_path, *one, "tracking=none", MODALITY_HARDWARE), tmp_path / "one")
    assert metrics["steps"] == 2 and metrics["val/loss_final"] > 0
    assert "1 x RecurrentBlock at 'layers'" in (tmp_path / "one" / "plan.yaml").read_text()
    for key, value, said in (
        ("num_hidden_layers", 0, "give a whole number, 1 or more"),
        ("num_hidden_layers", -2, "give a whole number, 1 or more"),
        ("hidden_size", 0, "give a whole number, 1 or more"),
        ("cell", "rnn", "use one of lstm, gru"),
        ("dropout", 1.5, r"give a number in \[0, 1\)"),
    ):
        shown = repr(value) if isinstance(value, str) else value
        with pytest.raises(UserError, match=rf"^model\.architecture\.{key}={shown}: {said}"):
            execute(tiny_recipe(tmp_path, f"model.architecture.{key}={value}", MODALITY_HARDWARE), tmp_path / key)


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_an_omny_of_a_recurrent_lm_validates_every_plan(tmp_path):
    """An LSTM's Scan body reads the layer's weights from the graph around it. onnx's extractor follows node inputs
    only, so every shard of char_lstm's .omny lost them and validate called the export INVALID (1 shard too)."""
    from test_export_omny import SMALL

    from onn.export import omny
    from onn.export.write import export_model

    model = tiny_lm("lstm").eval()
    ids = torch.randint(0, 60, (2, 6), generator=torch.Generator().manual_seed(0))
    settings = compose("export=omny", *(f"export.{k}={v}" for k, v in SMALL.items())).export
    metrics = export_model(
        model, tmp_path / "lm.omny", {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, settings
    )
    lines: list[str] = []
    assert metrics["export/cut_points"] >= 1
    assert omny.validate(tmp_path / "lm.omny", echo=lines.append), "\n".join(lines)
    assert sum("max abs diff against the whole model" in line for line in lines) >= 2  # a plan of several shards too
