"""The training step itself: micro-batch accumulation and out-of-memory back-off (injected errors)."""

from __future__ import annotations

import copy
import csv
import gc
import json
import math
import weakref

import lightning as L
import pytest
import torch
from conftest import compose, tiny_llama

from onn.errors import UserError
from onn.modalities.text.module import CausalLM
from onn.training.micro_batches import OutOfMemoryFloor

OPTIM = compose("optim.name=sgd", "optim.lr=0.1", "optim.schedule=constant", "optim.warmup_steps=0").optim


def tiny_module(micro_batch: int, min_micro_batch: int = 1) -> CausalLM:
    return CausalLM(
        tiny_llama(vocab_size=64),
        OPTIM,
        max_steps=3,
        onn_config={},
        micro_batch=micro_batch,
        min_micro_batch=min_micro_batch,
    )


def batches(steps: int = 3, rows: int = 8, width: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (rows, width), generator=g)
        mask = torch.ones_like(ids)
        mask[::3, width - 4 :] = 0  # some right padding, cut per micro-batch
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def inject_oom(module: CausalLM, above: int) -> list[int]:
    """Make the model fail like an exhausted allocator on micro-batches larger than `above` rows."""
    seen, forward = [], module.model.forward

    def failing(*args, **kwargs):
        rows = kwargs["input_ids"].shape[0]
        seen.append(rows)
        if rows > above:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return forward(*args, **kwargs)

    module.model.forward = failing
    return seen


def fit(module: CausalLM, data: list[dict[str, torch.Tensor]]) -> None:
    trainer = L.Trainer(
        max_steps=len(data),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))


def test_out_of_memory_halves_the_micro_batch_and_retries_the_same_step():
    reference = tiny_module(micro_batch=8)  # the run as planned, had memory sufficed
    fit(reference, batches())
    module = tiny_module(micro_batch=8)
    seen = inject_oom(module, above=2)
    fit(module, batches())
    assert module.micro_batch == 2
    assert module.oom_backoffs == [{"step": 0, "from": 8, "to": 4}, {"step": 0, "from": 4, "to": 2}]
    assert seen[:3] == [8, 4, 2] and set(seen[3:]) == {2}  # the first step retried, later steps start small
    # The macro-batch is unchanged (more micro-batches accumulate, weighted by their target tokens):
    # the result equals the run that never ran out of memory.
    assert module.train_losses == pytest.approx(reference.train_losses, rel=1e-5)
    for (name, p), q in zip(module.model.named_parameters(), reference.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_failed_pass_has_let_its_memory_go_when_the_back_off_starts():
    """The error's traceback holds the failed pass's frames and what they had allocated (on a GPU: activations and
    a chunk's weights, which the retry needs the room of). The back-off starts without them, the garbage
    collector off: nothing but reference counts frees them."""
    module = tiny_module(micro_batch=8)
    forward, held, alive = module.model.forward, [], []

    def failing(*args, **kwargs):
        if kwargs["input_ids"].shape[0] > 4:
            activations = torch.empty(4096)  # what the pass held when it ran out
            held.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return forward(*args, **kwargs)

    back_off = module._back_off

    def watched(error):
        alive.append(held[-1]() is not None)
        back_off(error)

    module.model.forward, module._back_off = failing, watched
    gc.disable()
    try:
        fit(module, batches(steps=1))
    finally:
        gc.enable()
    assert module.oom_backoffs == [{"step": 0, "from": 8, "to": 4}] and alive == [False]


def test_out_of_memory_below_the_floor_is_one_clear_error():
    module = tiny_module(micro_batch=8, min_micro_batch=2)
    inject_oom(module, above=1)
    with pytest.raises(OutOfMemoryFloor, match=r"micro-batch 2, the floor \(strategy.min_micro_batch=2\)"):
        fit(module, batches())


def test_other_errors_are_not_mistaken_for_out_of_memory():
    module = tiny_module(micro_batch=4)
    before = copy.deepcopy(module.micro_batch)

    def broken(*args, **kwargs):
        raise ValueError("a bug")

    module.model.forward = broken
    with pytest.raises(ValueError, match="a bug"):
        fit(module, batches(steps=1))
    assert module.micro_batch == before and not module.oom_backoffs


def test_accumulated_micro_batches_equal_one_whole_batch():
    """Padded rows of different lengths and micro-batches that do not divide the batch: the same update."""
    data = batches(steps=2, rows=8)
    data[0]["labels"][:3] = -100  # a micro-batch with no target tokens at all
    results = []
    for micro_batch in (8, 3, 1):
        module = tiny_module(micro_batch=micro_batch)
        fit(module, data)
        results.append(module)
    whole = results[0]
    for other in results[1:]:
        assert other.train_losses == pytest.approx(whole.train_losses, rel=1e-5)
        for p, q in zip(other.model.parameters(), whole.model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_resource_monitor_logs_memory_and_cpu_to_the_loggers(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from onn.training.callbacks import ResourceMonitor

    module = tiny_module(micro_batch=4)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path, name="csv", version=""),
        callbacks=[ResourceMonitor(every_n_steps=1)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        log_every_n_steps=1,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches(), batch_size=None))
    rows = list(csv.DictReader((tmp_path / "csv" / "metrics.csv").open()))
    rss = [float(r["resource/process_rss_mb"]) for r in rows if r.get("resource/process_rss_mb")]
    assert len(rss) >= 2 and all(x > 50 for x in rss)
    assert all(float(r["resource/host_available_mb"]) > 0 for r in rows if r.get("resource/host_available_mb"))
    assert any(r.get("resource/cpu_percent") for r in rows)


def test_validation_ignores_micro_batches_without_targets():
    data = batches(steps=1, rows=8)[0]
    data["labels"][:4] = -100  # the first micro-batch of 4 has nothing to score
    losses = []
    for micro_batch in (8, 4):
        module = tiny_module(micro_batch=micro_batch)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
        )
        trainer.validate(module, dataloaders=torch.utils.data.DataLoader([data], batch_size=None), verbose=False)
        losses.append(module.val_losses[-1])
    assert math.isfinite(losses[1]) and losses[1] == pytest.approx(losses[0], rel=1e-5)


def watched_trainer(max_steps: int = -1, precision: str = "32-true", **kwargs) -> L.Trainer:
    """A quiet CPU Trainer a dispatch mode can watch: no inference mode, as ONN's (see device_waits); `kwargs` are
    more Trainer arguments, or others than these."""
    settings = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        precision=precision,
        inference_mode=False,
        **{**settings, **kwargs},
    )


def device_waits(skip: list | None = None):
    """A dispatch mode that lists the operators run under it which, on a GPU, wait for the device: reading a
    value to the host, or an output whose size depends on the values (bincount, unique, nonzero). Nothing is
    recorded while `skip` is not empty, nor inside F.one_hot on a CPU tensor (it checks its indices' range on the
    host on a CPU only; on CUDA a device assert does). Tensors made under inference mode never reach a dispatch
    mode: a Trainer the counter watches needs inference_mode=False (ONN's trainers have it)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from onn.hardware.waits import READ_VALUES as waits

    in_cpu_check: list = []

    class CpuOnlyChecks(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is not torch.nn.functional.one_hot or args[0].device.type != "cpu":
                return func(*args, **(kwargs or {}))
            in_cpu_check.append(True)
            try:
                return func(*args, **(kwargs or {}))
            finally:
                in_cpu_check.pop()

    class Waits(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list = []
            self.checks = CpuOnlyChecks()

        def __enter__(self):
            self.checks.__enter__()
            return super().__enter__()

        def __exit__(self, *exc):
            super().__exit__(*exc)
            self.checks.__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in waits and not skip and not in_cpu_check:
                self.seen.append(func)
            return func(*args, **(kwargs or {}))

    return Waits()


def test_validation_is_the_mean_per_target_token_and_no_step_reads_the_device():
    """The validation loss is the mean over every target token of the set (the pieces of a batch and batches with
    fewer targets weigh by their tokens), and no validation step reads a value from the device: on a GPU each read
    is a wait, and torchmetrics' MeanMetric read each update's weight and NaN check. (The model's own forward is
    transformers': its attention mask utilities read the mask.)"""
    from onn.modalities.text.datamodule import HOST_ROWS, IGNORE

    in_model = []
    reads = device_waits(skip=in_model)
    data = batches(steps=2, rows=8)
    data[1]["labels"][:, :8] = IGNORE  # the second batch has fewer targets
    module = tiny_module(micro_batch=4)
    module.model.register_forward_pre_hook(lambda *_: in_model.append(True))
    module.model.register_forward_hook(lambda *_: in_model.clear())
    step = module.validation_step

    def counted(batch, batch_idx):
        batch[HOST_ROWS] = (batch["attention_mask"].sum(1).tolist(), (batch["labels"][:, 1:] != IGNORE).sum(1).tolist())
        with reads:
            return step(batch, batch_idx)

    module.validation_step = counted
    trainer = watched_trainer()
    trainer.validate(module, dataloaders=torch.utils.data.DataLoader(data, batch_size=None), verbose=False)
    total = tokens = 0
    with torch.no_grad():
        for batch in data:
            for a in (0, 4):
                piece = {k: v[a : a + 4] for k, v in batch.items() if k != HOST_ROWS}
                n = int((piece["labels"][:, 1:] != IGNORE).sum())
                total, tokens = total + float(module.model(**piece).loss) * n, tokens + n
    assert reads.seen == [] and module.val_losses[-1] == pytest.approx(total / tokens, rel=1e-5)


def test_a_text_step_without_padding_gives_transformers_no_mask_to_read():
    """A resident micro-batch whose rows the host counted at its full width reaches the model without its attention
    mask: given one, transformers reads it back from the device at every call (on a GPU, a wait for every kernel
    queued) only to find no row padded. A step of such micro-batches reads nothing from the device. A micro-batch
    with a padded row keeps its mask, which the model reads; either way the step's loss is the masked batch's."""
    from onn.hardware.waits import DeviceOps
    from onn.modalities.text.datamodule import HOST_ROWS, IGNORE

    def first_step(padded: bool) -> tuple[int, float, float]:
        data = batches(steps=2, rows=8)
        for batch in data:
            if not padded:
                batch["attention_mask"].fill_(1)
            targets = (batch["labels"][:, 1:] != IGNORE).sum(1).tolist()
            batch[HOST_ROWS] = (batch["attention_mask"].sum(1).tolist(), targets)
        module = tiny_module(micro_batch=2)  # padded: rows 0, 3 and 6 (batches()); rows 4 and 5 go unmasked
        with torch.no_grad():  # the whole first batch, its mask given: the mean loss over its target tokens
            want = float(copy.deepcopy(module.model)(**{k: v for k, v in data[0].items() if k != HOST_ROWS}).loss)
        counter, step = DeviceOps(torch.device("cpu")), module.training_step

        def counted(batch, batch_idx):
            with counter:
                return step(batch, batch_idx)

        module.training_step = counted
        trainer = watched_trainer(max_steps=2)
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
        return counter.waits, module.train_losses[0], want

    waits, loss, want = first_step(padded=False)
    assert waits == 0 and loss == pytest.approx(want, rel=1e-5)
    waits, loss, want = first_step(padded=True)
    assert waits > 0 and loss == pytest.approx(want, rel=1e-5)


def test_classifier_evaluation_figures_wait_for_the_device_only_at_the_end():
    """A classifier's validation and test add their loss (per sample), accuracies and confusion matrix up on the
    device and read them once, when the evaluation ends: torchmetrics' MeanMetric read each batch's NaN check,
    and its confusion matrix's bincount the batch's largest and smallest index (on a GPU, each a wait). The
    figures are still the whole set's, its last smaller batch weighing by its samples."""
    from onn.training.classifier import Classifier

    torch.manual_seed(0)
    x, y = torch.randn(70, 4), torch.randint(0, 3, (70,))
    data = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 70, 32)]  # 32, 32 and 6 samples
    module = Classifier(torch.nn.Linear(4, 3), ["a", "b", "c"], OPTIM, {})
    reads = device_waits()
    step = module.test_step

    def counted(batch, batch_idx):
        with reads:
            return step(batch, batch_idx)

    module.test_step = counted
    trainer = watched_trainer()
    figures = trainer.test(module, dataloaders=torch.utils.data.DataLoader(data, batch_size=None), verbose=False)[0]
    with torch.no_grad():
        logits = module.model(x)
    predicted = logits.argmax(1)
    expected = torch.zeros(3, 3, dtype=torch.long)
    for true, guess in zip(y.tolist(), predicted.tolist()):
        expected[true, guess] += 1
    assert reads.seen == []
    assert figures["test/loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-5)
    assert figures["test/acc"] == pytest.approx(float((predicted == y).float().mean()), rel=1e-6)
    assert torch.equal(module.confusion["test"], expected)


@pytest.mark.parametrize("reader", [None, "logger", "progress bar", "monitor"])
def test_a_training_step_reads_its_loss_only_when_something_reads_it(tmp_path, reader):
    """A logging step reads its loss to the host (on a GPU, a wait for every kernel queued). With no logger, no
    progress bar and nothing monitoring train/loss nobody reads it, and no step waits. With a reader the first step
    logs (the progress bar's first figure) and so does each step after which Lightning writes to the loggers, so
    that each row the logger writes holds its own step's loss."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from onn.training.classifier import Classifier

    torch.manual_seed(0)
    x, y = torch.randn(96, 4), torch.randint(0, 3, (96,))
    data = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 96, 16)]
    module = Classifier(torch.nn.Linear(4, 3), ["a", "b", "c"], OPTIM, {})
    reads, step = device_waits(), module.training_step
    waited: list[int] = []

    def counted(batch, batch_idx):
        before = len(reads.seen)
        with reads:
            loss = step(batch, batch_idx)
        waited.append(len(reads.seen) - before)
        return loss

    module.training_step = counted
    checkpoint = ModelCheckpoint(tmp_path / "ckpt", monitor="train/loss", every_n_train_steps=2)
    trainer = L.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path, name="csv", version="") if reader == "logger" else False,
        callbacks=[checkpoint] if reader == "monitor" else [],
        enable_checkpointing=reader == "monitor",
        enable_progress_bar=reader == "progress bar",
        enable_model_summary=False,
        inference_mode=False,
        log_every_n_steps=2,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    if reader is None:
        assert waited == [0] * 6
        return
    if reader == "monitor":  # a monitor reads train/loss whenever it runs: every step logs its own (logs_now)
        assert all(w > 0 for w in waited)
    else:
        assert [w > 0 for w in waited] == [True, True, False, True, False, True]  # steps 0, 1, 3 and 5
    assert float(trainer.callback_metrics["train/loss"]) == pytest.approx(float(module.train_losses[5]))
    if reader == "logger":
        rows = [r for r in csv.DictReader((tmp_path / "csv" / "metrics.csv").open()) if r.get("train/loss")]
        assert [int(r["step"]) for r in rows] == [1, 3, 5]
        for r in rows:  # each row its own step's loss (logged at 0, 2, 4, row 1 held step 0's)
            assert float(r["train/loss"]) == pytest.approx(float(module.train_losses[int(r["step"])]))
    if reader == "monitor":
        assert checkpoint.best_model_score is not None


def test_a_text_runs_logged_loss_is_its_own_steps(tmp_path):
    """A language model's step logged its loss after optimizer.step() had moved global_step on: the step logged
    was the one before each step Lightning writes, so the CSV row of step 2 held step 1's loss."""
    from lightning.pytorch.loggers import CSVLogger

    module = tiny_module(micro_batch=8)
    module.max_steps = 6
    trainer = L.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path, name="csv", version=""),
        log_every_n_steps=3,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches(steps=6), batch_size=None))
    rows = [r for r in csv.DictReader((tmp_path / "csv" / "metrics.csv").open()) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [2, 5]
    for r in rows:
        assert float(r["train/loss"]) == pytest.approx(module.train_losses[int(r["step"])], rel=1e-6)


def test_lightnings_hook_names_are_set_without_nn_modules_setattr():
    """Lightning sets the module's `_current_fx_name` before and after every hook, 44 times a training step. ONN's
    modules set it as a plain attribute (onn/training/module.py), not through nn.Module.__setattr__'s checks for
    parameters, buffers and submodules: in four steps no such call is made (the old code made 44 a step), and a
    callback's hook still reads the name Lightning set. Every LightningModule of ONN's (the bench's bare module,
    plain Lightning on purpose, aside) derives from ONNModule."""
    import importlib

    from onn.training.classifier import Classifier
    from onn.training.module import ONNModule

    through_module: list[str | None] = []
    setattr_ = torch.nn.Module.__setattr__

    def spied(self, name, value):
        if name == "_current_fx_name":
            through_module.append(value)
        setattr_(self, name, value)

    seen_in_hooks: list[str] = []

    class Names(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            seen_in_hooks.append(pl_module._current_fx_name)

    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    data = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    module = Classifier(torch.nn.Linear(4, 3), ["a", "b", "c"], OPTIM, {})
    trainer = watched_trainer(max_steps=4)
    trainer.callbacks.append(Names())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.Module, "__setattr__", spied)
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    assert through_module == []
    assert seen_in_hooks == ["on_train_batch_end"] * 4
    for name in ("onn.modalities.text.module", "onn.modalities.diffusion.module", "onn.modalities.pairs.module"):
        importlib.import_module(name)
    found, stack = [], [L.LightningModule]
    while stack:
        for cls in stack.pop().__subclasses__():
            stack.append(cls)
            if cls.__module__.startswith("onn.") and not cls.__module__.startswith("onn.bench."):
                found.append(cls)
    assert {c.__name__ for c in found} >= {"Classifier", "CausalLM", "DiffusionModule", "DualEncoder"}
    assert [c for c in found if not issubclass(c, ONNModule)] == []


@pytest.mark.slow  # 18-31 s on 2 cores (ci133)
def test_onns_trainer_wraps_no_hook_in_a_profiler_unless_trainer_profiler_names_one(tmp_path):
    """Lightning's default profiler records nothing, yet wraps every hook in its generator-based context (17 a
    step, and each callback's). ONN's Trainer hands back one shared empty context instead: in four steps no hook
    goes through Lightning's `Profiler.profile` (the old code: 117 in setup and four steps). `trainer.profiler=simple`
    gets Lightning's SimpleProfiler, which times the training step; an unknown name is one sentence."""
    from lightning.pytorch.profilers import Profiler

    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.training.classifier import Classifier
    from onn.training.trainer import build_trainer, check

    profiled: list[str] = []
    profile = Profiler.profile

    def counted(self, action_name: str):
        profiled.append(action_name)
        return profile(self, action_name)

    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    data = torch.utils.data.DataLoader([(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)], batch_size=None)
    cfg = compose("trainer.max_steps=4", "trainer.enable_progress_bar=false", f"paths.cache={tmp_path / 'cache'}")
    plan, _ = get("text").plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path))
    runs = {}
    for name in (None, "simple"):
        cfg.trainer.profiler = name
        trainer = build_trainer(cfg, plan, tmp_path / str(name), [], loggers=False, steps_per_epoch=4)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Profiler, "profile", counted)
            trainer.fit(Classifier(torch.nn.Linear(4, 3), ["a", "b", "c"], OPTIM, {}), train_dataloaders=data)
        runs[name], profiled[:] = (trainer, list(profiled)), []
    assert runs[None][1] == [] and runs[None][0].global_step == 4
    simple, hooks = runs["simple"]
    assert hooks.count("[Strategy]SingleDeviceStrategy.training_step") == 4
    assert len(simple.profiler.recorded_durations["[Strategy]SingleDeviceStrategy.training_step"]) == 4
    cfg.trainer.profiler = "fast"
    with pytest.raises(UserError, match=r"^trainer.profiler='fast': give one of Lightning's profilers"):
        check(cfg.trainer)


@pytest.mark.slow
def test_qlora_trains_lora_on_a_4bit_base_also_after_a_validation(tmp_path):
    """strategy=qlora loads the base through transformers' BitsAndBytesConfig (NF4) on this device, and
    its adapters keep learning after an eval-mode forward (bitsandbytes would repack the 4-bit weights
    for inference on CPUs with AVX512-BF16, and gradients through them would then be zero)."""
    import bitsandbytes as bnb

    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.modalities.text.tasks import build

    cfg = compose("model=llama_tiny", "strategy=qlora", f"paths.cache={tmp_path / 'cache'}", "optim.lr=1e-2")
    hardware = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    plan, _ = get("text").plan(cfg, hardware)
    assert plan.strategy == "qlora" and plan.candidates["qlora"]["fits"]
    module, _ = build(cfg, plan)
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in module.model.modules()) == 8 * 7  # every block linear
    device = module.model.get_input_embeddings().weight.device  # the GPU the plan loaded the base on, if any
    batch = {k: v.to(device) for k, v in batches(steps=1)[0].items()}
    module.eval()
    with torch.no_grad():
        module.model(**batch)  # a validation pass
    module.train()
    module.model(**batch).loss.backward()
    grads = [p.grad for n, p in module.model.named_parameters() if "lora_B" in n]  # lora_A gets none while B is 0
    assert grads and all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0


@pytest.mark.slow
def test_a_qlora_model_exports_as_a_dense_folder_that_computes_what_it_computed(tmp_path):
    """export=safetensors of a QLoRA model: its 4-bit weights de-quantized (as its forward uses them) with the
    adapters merged, no quantisation state or config left in the folder, and the loaded folder's logits are the
    trained model's (the merge added a float delta to the packed codes and failed)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from onn.export.hf import save_folder
    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.modalities.text.tasks import build

    cfg = compose("model=llama_tiny", "strategy=qlora", f"paths.cache={tmp_path / 'cache'}")
    plan, _ = get("text").plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path))
    module, tokenizer = build(cfg, plan)
    torch.manual_seed(0)
    for name, p in module.model.named_parameters():
        if "lora_B" in name:  # as after training: the adapters change the output
            p.data.normal_(std=0.05)
    device = module.model.get_input_embeddings().weight.device
    batch = {k: v.to(device) for k, v in batches(steps=1)[0].items() if k != "labels"}
    module.model.eval()
    with torch.no_grad():
        want = module.model(**batch).logits.float().cpu()
    save_folder(module, tokenizer, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    written = set().union(*(safe_open(f, "pt").keys() for f in (tmp_path / "hf").glob("*.safetensors")))
    assert written == set(loaded.state_dict()) - {"lm_head.weight"} or written == set(loaded.state_dict())
    with torch.no_grad():
        got = loaded(**{k: v.cpu() for k, v in batch.items()}).logits
    with torch.no_grad(), module.model.disable_adapter():
        assert not torch.allclose(want, module.model(**batch).logits.float().cpu(), atol=1e-3)  # the adapters count
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_adapt_norm_measures_the_test_domains_statistics_and_keeps_the_trained_ones():
    """AdaBN (task.adapt_norm): a classifier trained where the class is the sign of x, tested where every x
    moved by +6 (a new microphone's level): with the trained statistics it calls everything one class;
    with the test set's own it is right again. The trained statistics are back after the test."""
    from onn.training.classifier import Classifier

    torch.manual_seed(0)
    x = torch.randn(512, 1)
    y = (x[:, 0] > 0).long()
    network = torch.nn.Sequential(torch.nn.BatchNorm1d(1, affine=False), torch.nn.Linear(1, 2))
    optimizer = torch.optim.Adam(network.parameters(), lr=0.05)
    for _ in range(200):
        loss = torch.nn.functional.cross_entropy(network(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    trained = {k: v.clone() for k, v in network[0].state_dict().items()}
    shifted = torch.utils.data.DataLoader(
        [(x[i : i + 64] + 6.0, y[i : i + 64]) for i in range(0, 512, 64)], batch_size=None
    )

    def tested(adapt: bool) -> float:
        module = Classifier(network, ["neg", "pos"], OPTIM, {}, adapt_norm=adapt)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
        )
        return trainer.test(module, dataloaders=shifted, verbose=False)[0]["test/acc"]

    assert tested(adapt=False) == pytest.approx(float((y == 1).float().mean()), abs=0.01)  # all called "pos"
    assert tested(adapt=True) > 0.95
    for key, value in network[0].state_dict().items():
        assert torch.equal(value, trained[key]), key


def test_a_negative_mixup_is_one_sentence():
    from onn.modalities.classification import mixup_alpha

    assert mixup_alpha(compose("task.mixup=0.2").task) == 0.2
    with pytest.raises(UserError, match=r"task.mixup=-1.0: give 0 \(off\) or mixup's Beta parameter"):
        mixup_alpha(compose("task.mixup=-1").task)


def test_samples_per_s_counts_the_rows_each_step_trained_on_not_the_configured_batch():
    """Data smaller than a batch, or a short last batch: samples/s was data.batch_size per step (10 samples
    under a batch of 8 read as 16 a step over two steps, 5 samples under a batch of 1024 as 1024)."""
    from torch.utils.data import DataLoader, TensorDataset

    from onn.training.callbacks import StepClock, batch_rows

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.randn(10, 3), torch.randint(0, 2, (10,)))
    for batch_size, rows in ((8, [8, 2, 8, 2]), (1024, [10, 10])):
        clock = StepClock()
        trainer = L.Trainer(
            max_epochs=len(rows) // (2 if batch_size == 8 else 1), callbacks=[clock], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        )  # fmt: skip
        trainer.fit(Tiny(), DataLoader(data, batch_size=batch_size))
        assert clock.rows == rows
        assert clock.samples_per_s() == pytest.approx(sum(rows) / sum(clock.step_s))
        assert clock.samples_per_s(skip=1) == pytest.approx(sum(rows[1:]) / sum(clock.step_s[1:]))
    tokens = {"input_ids": torch.zeros(3, 7, dtype=torch.long), "attention_mask": torch.ones(3, 7)}
    assert batch_rows(tokens) == 3 and batch_rows((tokens, torch.zeros(3, 4))) == 3


def test_tracking_aim_gives_aims_logger_its_repo_and_the_run_logs_into_it(tmp_path):
    """tracking=aim always crashed: every logger was given `save_dir`, and AimLogger takes `repo` (its YAML sets
    it) and no save_dir. The loggers that take save_dir still write into the run folder."""
    pytest.importorskip("aim")
    from pathlib import Path

    from aim import Repo
    from aim.pytorch_lightning import AimLogger
    from aim.sdk.index_manager import RepoIndexManager
    from lightning.pytorch.loggers import CSVLogger

    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.training.classifier import Classifier
    from onn.training.trainer import build_trainer

    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    data = torch.utils.data.DataLoader([(x[i : i + 16], y[i : i + 16]) for i in range(0, 32, 16)], batch_size=None)
    base = (
        "hardware=cpu_16gb",
        "trainer.max_steps=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
    )
    cfg = compose(*base, "tracking=aim", f"paths.outputs={tmp_path / 'out'}", f"paths.cache={tmp_path / 'cache'}")
    plan, _ = get("text").plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path))
    trainer = build_trainer(cfg, plan, tmp_path / "run", [], steps_per_epoch=2)
    assert [type(logger) for logger in trainer.loggers] == [AimLogger]
    trainer.fit(Classifier(torch.nn.Linear(4, 3), ["a", "b", "c"], OPTIM, {}), train_dataloaders=data)
    assert trainer.global_step == 2
    repo = Repo(str(tmp_path / "out"))  # conf/tracking/aim.yaml's outputs/.aim: `aim up --repo outputs/.aim`
    (run_hash,) = repo.list_all_runs()
    RepoIndexManager.get_index_manager(repo).index(run_hash)  # what `aim up` does in the background
    (run,) = Repo(str(tmp_path / "out")).iter_runs()
    losses = {m.name: list(m.values.values_list()) for m in run.metrics()}["train/loss"]
    assert len(losses) == 2 and not run.active  # a value each step, and the run closed at the end of fit
    csv_cfg = compose(*base, "tracking=csv", f"paths.cache={tmp_path / 'cache'}")
    (logger,) = build_trainer(csv_cfg, plan, tmp_path / "csv_run", [], steps_per_epoch=2).loggers
    assert isinstance(logger, CSVLogger) and Path(logger.log_dir) == tmp_path / "csv_run" / "csv"


def test_trainer_keys_lightning_refuses_for_onns_modules_are_one_sentence(tmp_path):
    """trainer.gradient_clip_val ended in Lightning's traceback (text: "Automatic gradient clipping is not supported
    for manual optimization"; images: it clashes with ONN's own clipping by optim.clip_grad_norm); a fraction of an
    epoch for trainer.val_check_interval on text data failed with MisconfigurationException once the model was
    built (a stream has no length Lightning can take a fraction of). Image data keeps its fractions."""
    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.training.trainer import build_trainer, check

    with pytest.raises(UserError, match=r"^trainer.gradient_clip_val=0.5: ONN clips .* give optim.clip_grad_norm=0.5"):
        check(compose("trainer.gradient_clip_val=0.5").trainer)
    cfg = compose("hardware=cpu_16gb", "trainer.val_check_interval=0.5", f"paths.cache={tmp_path}")
    check(cfg.trainer)  # a fraction is a value Lightning takes: the data decides
    plan, _ = get("text").plan(cfg, resolve(cfg.hardware, tmp_path, tmp_path))
    with pytest.raises(UserError, match=r"^trainer.val_check_interval=0.5: a language model's training data"):
        build_trainer(cfg, plan, tmp_path / "text", [], loggers=False)
    images = compose("data=cifar10", "trainer.val_check_interval=0.5", f"paths.cache={tmp_path}")
    trainer = build_trainer(images, plan, tmp_path / "images", [], loggers=False, steps_per_epoch=4)
    assert trainer.val_check_interval == 0.5 and trainer.check_val_every_n_epoch == 1


class LinearSteps(L.LightningModule):
    """A linear classifier: the smallest module Lightning's launcher can start in other processes."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RowsToFile(L.Callback):
    """Rank 0's StepClock rows, written where the test process reads them (a spawned process's callbacks stay there)."""

    def __init__(self, clock, path):
        self.clock, self.path = clock, path

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps(self.clock.rows))


@pytest.mark.slow  # two processes started by spawning: about 35 s on two busy cores
def test_samples_per_s_counts_every_process_rows(tmp_path):
    """Under DDP each process times its own share of a step: samples_per_s counted rank 0's rows only, half the
    figure with two processes."""
    from torch.utils.data import DataLoader, TensorDataset

    from onn.training.callbacks import StepClock

    clock, path = StepClock(), tmp_path / "rows.json"
    data = TensorDataset(torch.randn(32, 3), torch.randint(0, 2, (32,)))
    trainer = L.Trainer(
        max_steps=2, strategy="ddp_spawn", devices=2, accelerator="cpu", callbacks=[clock, RowsToFile(clock, path)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(LinearSteps(), DataLoader(data, batch_size=8))  # 8 rows a step in each process
    assert json.loads(path.read_text()) == [16, 16]
