"""task=bench_overhead with a micro-batch smaller than the batch: ONN's module cuts each batch into
strategy.micro_batch pieces, and the plain loop ran the whole batch in one forward, so overhead/ratio counted the
micro-batching as runner overhead. Now the plain loop cuts the batch as the module does: the same forwards a step."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import compose


def _job(tmp_path: Path, *overrides: str):
    """A job as app.run hands it to a task: the composed config, its plan and profile, its own run folder."""
    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.modalities.base import Job

    config = compose(
        "model=llama_tiny",
        "hardware=cpu_16gb",
        "tracking=none",
        f"paths.outputs={tmp_path}",
        f"paths.cache={tmp_path / 'cache'}",
        *overrides,
    )
    hardware = resolve(config.hardware, tmp_path / "cache", tmp_path)
    plan, spec = get("text").plan(config, hardware, use_tuned=False)
    (tmp_path / "run").mkdir()
    return Job(config, tmp_path / "run", get("text"), hardware, plan, spec)


@pytest.mark.slow
def test_both_sides_of_the_overhead_bench_run_the_same_micro_batches(tmp_path):
    """A real bench_overhead run at strategy.micro_batch=2 of data.batch_size=8: each side's model (one per side,
    told apart by identity) is called 4 times a step, 3 steps a side, and the two sides' losses agree."""
    from transformers import PreTrainedModel

    from onn.bench import overhead

    sizes = ["data.builtin.train_size=16", "data.max_length=32", "task.steps=2", "task.warmup=1", "task.repeats=1"]
    sizes.append("model.architecture.num_hidden_layers=2")
    job = _job(tmp_path, "task=bench_overhead", "strategy=full", "strategy.micro_batch=2", "data.batch_size=8", *sizes)
    assert job.plan.micro_batch == 2
    calls: Counter[int] = Counter()

    def count(module: torch.nn.Module, args, output) -> None:
        if isinstance(module, PreTrainedModel) and hasattr(module, "lm_head"):  # the whole model, not its parts
            calls[id(module)] += 1

    hook = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        metrics = overhead.run(job)  # round 0 runs the plain side first, then ONN's
    finally:
        hook.remove()
    plain, onn = calls.values()
    assert (plain, onn) == (3 * 4, 3 * 4), calls
    assert metrics["overhead/micro_batch"] == 2
    assert metrics["overhead/max_loss_gap"] < 1e-5, metrics["overhead/max_loss_gap"]


def test_the_plain_loops_micro_batches_make_the_whole_batchs_loss_and_gradient():
    """The plain loop's accumulation, CausalLM's weighting: pieces of a padded batch (one of them without a target
    token, which is skipped) add up to the whole batch's mean loss and gradient, one forward per piece that learns."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from onn.bench.overhead import _accumulate
    from onn.training.micro_batches import split

    torch.manual_seed(0)
    arch = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    model = LlamaForCausalLM(LlamaConfig(**arch, num_key_value_heads=1))
    lengths, answers = [10, 4, 7, 10, 3, 6], [5, 2, 0, 6, 1, 3]  # row 2 has no answer token: its piece is skipped
    ids = torch.randint(0, 64, (6, 10))
    mask = (torch.arange(10) < torch.tensor(lengths)[:, None]).long()
    labels = torch.full_like(ids, -100)
    for row, (length, answer) in enumerate(zip(lengths, answers)):
        labels[row, length - answer : length] = ids[row, length - answer : length]
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    whole = model(**batch).loss
    whole.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss = _accumulate(model, split(batch, 1, None), scaler, torch.device("cpu"), None)
    hook.remove()
    assert len(forwards) == 5
    assert float(loss) == pytest.approx(float(whole), abs=1e-5)
    for got, want in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
