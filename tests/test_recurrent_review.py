"""The recurrent language model (onn/models/zoo/recurrent_lm.py) as a transformers causal LM beyond greedy decoding
and plain backpropagation: beam search reorders the carried state with its beams, and strategy.gradient_checkpointing
recomputes each recurrent block in the backward with the same gradients, through the runner too."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import MODALITY_HARDWARE, compose

from onn.models.zoo.recurrent_lm import RecurrentLMConfig, RecurrentLMForCausalLM

SPECIAL = {"bos_token_id": 61, "eos_token_id": 62, "pad_token_id": 63}


def tiny_lm(cell: str = "lstm", dropout: float = 0.0) -> RecurrentLMForCausalLM:
    torch.manual_seed(0)
    return RecurrentLMForCausalLM(
        RecurrentLMConfig(vocab_size=64, hidden_size=16, cell=cell, dropout=dropout, **SPECIAL)
    )


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_beam_search_carries_each_beams_own_state(cell):
    """num_beams=3 over two prompts of different lengths (left-padded): each returned sequence's score (length
    penalty 0: its summed log-probabilities) is what re-reading the whole text gives, so every beam went on from its
    own state (a beam that ends at the end id is scored up to it). transformers refused beam search after the first
    token while the state could not be reordered."""
    model = tiny_lm(cell).eval()
    prompts = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    new = 8
    out = model.generate(
        prompts,
        attention_mask=mask,
        max_new_tokens=new,
        num_beams=3,
        do_sample=False,
        length_penalty=0.0,
        pad_token_id=0,
        eos_token_id=63,
        output_scores=True,
        return_dict_in_generate=True,
    )
    for row in range(2):
        tokens = out.sequences[row, -new:].tolist()
        tokens = tokens[: tokens.index(63) + 1] if 63 in tokens else tokens  # a beam that ended, then padding
        text = torch.cat([prompts[row][mask[row].bool()], torch.tensor(tokens)])
        start = int(mask[row].sum())
        with torch.no_grad():
            logp = model(input_ids=text[None]).logits[0].log_softmax(-1)
        reread = logp[torch.arange(start - 1, len(text) - 1), text[start:]].sum()
        assert out.sequences_scores[row].item() == pytest.approx(reread.item(), abs=1e-4)


def chunked_grads(model: RecurrentLMForCausalLM) -> list[torch.Tensor]:
    """Gradients of two chunks' losses, the state carried (detached) from the first to the second, as task.tbptt_steps
    trains; dropout's draws seeded alike."""
    ids = torch.randint(0, 60, (3, 8), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    first = model(input_ids=ids[:, :4], labels=ids[:, :4], use_cache=True)
    state = tuple(s.detach() for s in first.past_key_values)
    second = model(input_ids=ids[:, 4:], labels=ids[:, 4:], past_key_values=state, use_cache=True)
    (first.loss + second.loss).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_gradient_checkpointing_recomputes_each_block_with_the_same_gradients(cell):
    """With gradient checkpointing each block's recurrence runs again in the backward, and the gradients (dropout
    included, the state carried between chunks) are those of the plain backward. The model refused it."""
    plain = chunked_grads(tiny_lm(cell, dropout=0.2).train())
    model = tiny_lm(cell, dropout=0.2).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    runs = []
    model.layers[0].rnn.register_forward_hook(lambda *_: runs.append(torch.is_grad_enabled()))
    checkpointed = chunked_grads(model)
    assert len(runs) == 4  # two chunks, each run forward and again in the backward
    for got, want in zip(checkpointed, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_char_lstm_trains_with_gradient_checkpointing(tmp_path):
    """recipe=char_lstm with strategy.gradient_checkpointing=true trains (a raw ValueError from transformers
    before), its truncated backpropagation included."""
    from onn.app import execute

    cfg = compose(
        "recipe=char_lstm",
        "data=math",
        "data.source=builtin:math",
        "data.builtin.train_size=32",
        "data.builtin.val_size=8",
        "data.max_length=40",
        "data.batch_size=8",
        "model.architecture.hidden_size=32",
        "task.tbptt_steps=16",
        "strategy.gradient_checkpointing=true",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "tracking=none",
        MODALITY_HARDWARE,
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = execute(cfg, tmp_path / "run")
    assert metrics["steps"] == 2 and len(metrics["train/loss_curve"]) == 2
    # transformers 5 calls gradient_checkpointing_enable deprecated: a FutureWarning in every such run's console
    assert not [w for w in caught if "checkpointing_enable" in str(w.message)]
    assert all(loss == loss and loss > 0 for loss in metrics["train/loss_curve"])  # finite, not NaN
