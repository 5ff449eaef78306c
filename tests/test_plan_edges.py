"""The profile and the planner at their edges, as a review of them found them (2026-12-05): an empty layer list that
trained every block, a container's CPU quota and memory limit unseen, streaming block counts and a micro-batch past
what the model and batch have, precisions Lightning or the machine lacks, a zero budget read as none, a preset GPU on
a machine without one, and a streaming reason left at the model's step after the blocks were timed."""

from __future__ import annotations

import pytest
from conftest import compose

from onn.errors import UserError
from onn.hardware.profile import resolve
from onn.planning.plan import make_plan
from onn.planning.spec import model_spec


def plan_for(tmp_path, *overrides: str):
    cfg = compose(*overrides, f"paths.cache={tmp_path}", root=tmp_path)
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    return make_plan(cfg, hw, model_spec(cfg.model, cfg.strategy.lora.r))


@pytest.mark.parametrize(
    "overrides, sentence",
    [
        (("strategy=sparse_lora", "strategy.layers=[]"), r"strategy\.layers=\[\]: give all, or a list of block"),
        (("strategy=sparse_lora", "strategy.streaming.cache_blocks=-3"), r"cache_blocks=-3: give a whole number"),
        (("strategy=sparse_lora", "strategy.streaming.cache_blocks=lots"), r"cache_blocks='lots': give a whole"),
        (("model=llama_small", "strategy=sparse_lora", "strategy.streaming.cache_blocks=1000"), r"has 8 blocks"),
        (("model=phi4", "strategy=sparse_lora", "strategy.streaming.chunk_size=1000"), r"chunk_size=1000: this mod"),
        # a ValueError from int("abc") at the run; -7, 2.5 and true (one token a pass) planned
        (("strategy=sparse_lora", "strategy.streaming.eval_tokens=abc"), r"eval_tokens='abc': give a whole number"),
        (("strategy=sparse_lora", "strategy.streaming.eval_tokens=true"), r"eval_tokens=True: give a whole number"),
        (("strategy=sparse_lora", "strategy.streaming.eval_tokens=2.5"), r"eval_tokens=2.5: give a whole number"),
        (("data.batch_size=4", "strategy.micro_batch=64"), r"micro_batch=64 is more than data\.batch_size=4"),
        (("strategy.precision=fp8",), r"strategy\.precision='fp8': give auto, or one of 32-true"),
        (("strategy.precision=16-mixed",), r"float16 autocast is for GPUs; on a CPU give bf16-mixed"),
        (("hardware=gtx1650_4gb", "strategy.precision=bf16-mixed"), r"GeForce GTX 1650 has no bf16"),
        (("hardware.budget_mb=0",), r"hardware\.budget_mb=0 MB is below what the run holds"),
        # planned for the full memory (min(total, nan) is total), or for this machine without a word
        (("hardware.budget_mb=nan",), r"hardware\.budget_mb=nan: give a number of MB"),
        (("hardware.host_memory_mb=1000",), r"hardware\.host_memory_mb=1000\.0: hardware=auto measures this machine"),
        (("hardware.accelerator=cuda",), r"hardware\.accelerator=cuda: hardware=auto measures this machine"),
        # a TypeError in the planner, a plan for a made-up device, a plan for no cores
        (("hardware.measure=false",), r"hardware=auto is a preset \(measure: false\) without accelerator, host_memory"),
        (("hardware=cpu_16gb", "hardware.accelerator=tpu"), r"hardware\.accelerator=tpu: give one of cpu, cuda, mps"),
        (("hardware=cpu_16gb", "hardware.cpu_cores=0"), r"hardware\.cpu_cores=0 in hardware=cpu_16gb: give a number"),
        # planned (lora), or refused for a block index past the 2 recurrent blocks (sparse_lora's default layers)
        (("model=char_lstm", "strategy=lora"), r"strategy=lora: the blocks of model char_lstm hold no linear layer"),
        (("model=char_lstm", "strategy=sparse_lora"), r"strategy=sparse_lora: the blocks of model char_lstm hold no"),
        # r=0 was said to be blocks without a linear layer (LSTM or GRU), r=-2 in peft's words, alpha=-1 trained
        (("strategy=lora", "strategy.lora.r=0"), r"strategy\.lora\.r=0: give the adapters' rank, a whole number 1 or"),
        (("strategy=lora", "strategy.lora.r=-2"), r"strategy\.lora\.r=-2: give the adapters' rank"),
        (("strategy=lora", "strategy.lora.alpha=-1"), r"strategy\.lora\.alpha=-1: give a number above 0"),
        # a negative all-reduce time, a step predicted shorter than its compute
        (("hardware.count=2", "hardware.interconnect_gb_s=-1"), r"hardware\.interconnect_gb_s=-1\.0: give the link's"),
        (("hardware.network_gb_s=0",), r"hardware\.network_gb_s=0\.0: give the link's speed in GB/s, a number above 0"),
    ],
)
def test_settings_that_cannot_work_are_one_sentence_at_plan_time(tmp_path, overrides, sentence):
    """Each was planned, then trained another thing (every block, for an empty layer list), failed at the run,
    or was read as something else (a zero budget as no budget)."""
    with pytest.raises(UserError, match=sentence):
        plan_for(tmp_path, *overrides)


def test_a_containers_cpu_quota_and_memory_limit_are_the_machine(tmp_path, monkeypatch):
    """Nothing read the cgroup: a container limited to 1 core and 1 GB planned for the host's cores and memory, and
    its profile was the host's (the fingerprint counted os.cpu_count and the host's memory)."""
    from onn.hardware import profile

    before = (profile.usable_cores(), profile.host_memory_mb(), profile.machine_fingerprint())
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    (tmp_path / "memory.max").write_text(f"{1024 * 2**20}\n")
    (tmp_path / "memory.current").write_text(f"{256 * 2**20}\n")
    monkeypatch.setattr(profile, "CGROUP", tmp_path)
    assert profile.usable_cores() == 1 and profile.host_memory_mb() == min(1024, before[1])
    assert profile.available_memory_mb() <= 768 and profile.machine_fingerprint() != before[2]
    (tmp_path / "memory.stat").write_text(f"anon 100\ninactive_file {512 * 2**20}\n")  # cache it can reclaim
    assert 768 < profile.available_memory_mb() <= 1280
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "memory.max").write_text("max\n")
    assert (profile.usable_cores(), profile.host_memory_mb()) == before[:2]


def test_the_streaming_reason_says_the_timed_step_after_calibration(tmp_path, monkeypatch):
    """The summary said the timed step (0.335 s) while the streaming line still said the model's (0.25 s)."""
    from onn.modalities.text import calibrate

    cfg = compose("model=llama_small", "strategy=sparse_lora", f"paths.cache={tmp_path}")
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    spec = model_spec(cfg.model, cfg.strategy.lora.r)
    plan = make_plan(cfg, hw, spec)
    assert plan.streaming is not None
    costs = {"below": 2.0, "lora": 3.0, "frozen": 2.0, "block": 2.0, "rest": 1.0}  # seconds: far from the model's
    monkeypatch.setattr(calibrate, "block_times", lambda *args, **kwargs: costs)
    timed = calibrate.refine(plan, cfg, hw, spec)
    line = next(r for r in timed.reasons if r.startswith("streaming:"))
    assert f"predicted {timed.streaming.predicted_step_s:.2f} s/step" in line
    assert timed.streaming.predicted_step_s != plan.streaming.predicted_step_s


def test_a_gpu_preset_on_a_machine_without_one_is_one_sentence_at_the_trainer(tmp_path):
    """hardware=gtx1650_4gb task=train on a CPU machine ended in Lightning's MisconfigurationException."""
    import torch

    from onn.training.trainer import build_trainer

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the preset's accelerator is there")
    cfg = compose("hardware=gtx1650_4gb", "model=llama_tiny", f"paths.cache={tmp_path}")
    plan = make_plan(cfg, resolve(cfg.hardware, tmp_path, tmp_path), model_spec(cfg.model, cfg.strategy.lora.r))
    with pytest.raises(UserError, match=r"hardware=gtx1650_4gb plans for a CUDA GPU and this machine has none"):
        build_trainer(cfg, plan, tmp_path / "run", [], loggers=False)


def test_an_apple_preset_trains_on_its_gpu_or_is_one_sentence_at_the_trainer(tmp_path):
    """hardware=macbook_m2_16gb trained on the CPU (every accelerator but cuda became "cpu"), with Lightning's
    warning that fp16 autocast is not for CPUs, while the plan and plan.yaml said an M2 in 16-mixed."""
    import torch

    from onn.training.trainer import build_trainer

    cfg = compose("hardware=macbook_m2_16gb", "model=llama_tiny", f"paths.cache={tmp_path}")
    plan = make_plan(cfg, resolve(cfg.hardware, tmp_path, tmp_path), model_spec(cfg.model, cfg.strategy.lora.r))
    assert plan.hardware["accelerator"] == "mps"
    if torch.backends.mps.is_available():
        assert (
            type(build_trainer(cfg, plan, tmp_path / "run", [], loggers=False).accelerator).__name__ == "MPSAccelerator"
        )
        return
    with pytest.raises(UserError, match=r"^hardware=macbook_m2_16gb plans for an Apple GPU \(MPS\) and this machine"):
        build_trainer(cfg, plan, tmp_path / "run", [], loggers=False)
    cfg = compose("trainer.accelerator=mps", "model=llama_tiny", "hardware=cpu_16gb", f"paths.cache={tmp_path}")
    with pytest.raises(UserError, match=r"^trainer.accelerator=mps asks for an Apple GPU \(MPS\) and this machine"):
        build_trainer(cfg, plan, tmp_path / "run", [], loggers=False)


def test_trainer_precision_is_strategy_precisions_or_one_sentence_before_the_plan(tmp_path):
    """trainer.precision=bf16-mixed trained in bf16 while the plan, plan.yaml and the streamed compute dtype said
    32-true, with memory sized for fp32: the plan reads strategy.precision, which the sentence names. Lightning's
    short names for the same precision pass."""
    hw = resolve(compose("hardware=cpu_16gb").hardware, tmp_path, tmp_path)

    def planned(*overrides: str):
        cfg = compose("hardware=cpu_16gb", "model=llama_tiny", f"paths.cache={tmp_path}", *overrides)
        return make_plan(cfg, hw, model_spec(cfg.model, cfg.strategy.lora.r))

    with pytest.raises(
        UserError,
        match=r"^trainer.precision=bf16-mixed differs from strategy.precision=auto, which the plan sizes memory .* "
        r"give strategy.precision=bf16-mixed and leave trainer.precision at auto",
    ):
        planned("trainer.precision=bf16-mixed")
    with pytest.raises(UserError, match=r"^trainer.precision=32 differs from strategy.precision=bf16-mixed"):
        planned("trainer.precision=32", "strategy.precision=bf16-mixed")
    assert planned("trainer.precision=bf16", "strategy.precision=bf16-mixed").precision == "bf16-mixed"
    assert planned("strategy.precision=bf16-mixed").precision == "bf16-mixed"


STREAMED_DIT = (
    "data=diffusion",
    "model=dit_small",
    "model.kwargs={num_layers: 4, num_attention_heads: 4, attention_head_dim: 16, patch_size: 2, norm_num_groups: 4}",
    "data.image_size=[8,8]",
    "data.channels=1",
    "hardware=cpu_16gb",
    "strategy=sparse_lora",
    "strategy.layers=[3]",
    "strategy.streaming.store=disk",
)


def network_plan(tmp_path, *overrides: str):
    from onn.modalities import get

    cfg = compose(*STREAMED_DIT, *overrides)
    return get("diffusion").plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path))[0]


def test_a_streamed_network_plans_the_store_settings_the_config_fixes_and_says_which_do_not_apply(tmp_path):
    """A network's plan took a float32 store, no cached blocks and device activations whatever the config fixed, and
    said nothing; the engine streams any store dtype and caches blocks for any network. They are planned as given,
    the store counted at its dtype; edges and eval_tokens, which a network's engine does not use, are said not to
    apply."""
    plain = network_plan(tmp_path)
    plan = network_plan(
        tmp_path,
        "strategy.streaming.store_dtype=int8",
        "strategy.streaming.cache_blocks=2",
        "strategy.streaming.activations=host",
        "strategy.streaming.edges=stream",
        "strategy.streaming.eval_tokens=100",
    )
    s = plan.streaming
    assert (s.store, s.store_dtype, s.cache_blocks, s.activations) == ("disk", "int8", 2, "host")
    assert plain.streaming.store_dtype == "float32" and plain.streaming.cache_blocks == 0
    assert s.store_gb < plain.streaming.store_gb / 3.5  # a byte a value, not four
    assert s.predicted_disk_read_gb < plain.streaming.predicted_disk_read_gb / 3.5  # and the cached blocks not read
    reasons = "\n".join(plan.reasons)
    assert "store of int8 (2 blocks cached in memory)" in reasons
    assert "strategy.streaming.edges=stream does not apply" in reasons and s.edges == "resident"
    assert "strategy.streaming.eval_tokens=100 does not apply" in reasons
    assert "stored as int8 and computed in float32" in reasons
    assert not any("does not apply" in r or "stored as" in r for r in plain.reasons)
