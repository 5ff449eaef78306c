"""The planner: sizes from the meta-device model, choices by the rules of the [core] issue."""

import pytest
from conftest import compose

from onn.hardware.profile import resolve
from onn.planning.plan import make_plan
from onn.planning.spec import model_spec


def plan_for(*overrides, tmp_path):
    cfg = compose(*overrides, root=tmp_path)
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    spec = model_spec(cfg.model, cfg.strategy.lora.r)
    return make_plan(cfg, hw, spec), spec


def test_phi4_on_a_4gb_gpu_streams_under_4gb(tmp_path):
    plan, spec = plan_for("model=phi4", "hardware=gtx1650_4gb", "strategy=auto", tmp_path=tmp_path)
    assert 14.5e9 < spec.params < 15e9 and spec.n_blocks == 40  # Phi-4's real size, from the meta device
    assert plan.strategy == "sparse_lora"
    assert plan.predicted_peak_memory_mb + plan.context_mb < 4096
    assert plan.precision == "16-mixed"  # Turing: no bf16
    assert not plan.candidates["lora"]["fits"] and not plan.candidates["qlora"]["fits"]
    assert plan.streaming.chunk_size >= 1


def test_another_lightning_strategy_sizes_sparse_lora_resident(tmp_path):
    """Under ddp (or fsdp) nothing streams: Phi-4 on a 4 GB card fits no candidate resident, strategy=auto takes the
    smallest and says why, and an explicit sparse_lora is sized as the resident LoRA it trains, over the budget."""
    plan, _ = plan_for(
        "model=phi4", "hardware=gtx1650_4gb", "strategy=auto", "strategy.lightning=ddp", tmp_path=tmp_path
    )
    smallest = min(("lora", "qlora", "sparse_lora"), key=lambda s: plan.candidates[s]["peak_mb"])
    assert plan.streaming is None and plan.strategy == smallest
    assert any("sized resident: Lightning strategy 'ddp'" in r for r in plan.reasons)
    assert not any(plan.candidates[s]["fits"] for s in ("lora", "qlora", "sparse_lora"))
    plan, _ = plan_for("model=phi4", "hardware=gtx1650_4gb", "strategy=sparse_lora", "strategy.lightning=ddp",
                       tmp_path=tmp_path)  # fmt: skip
    assert plan.streaming is None and plan.predicted_peak_memory_mb > 4096
    assert any(r.startswith("WARNING: predicted") for r in plan.reasons)


def test_a_cpu_plan_counts_the_extra_pass_of_slices_asked_for(tmp_path):
    """On a CPU the plan keeps each gated MLP whole; slices asked for (strategy.streaming.mlp_tiles=2) cost one
    more forward of the MLP's matmuls in each backward (2/3 of a Llama block's), which its predicted step counts."""
    common = ("model=llama_small", "strategy=sparse_lora", "hardware=cpu_16gb")
    whole = plan_for(*common, tmp_path=tmp_path)[0].streaming
    sliced = plan_for(*common, "strategy.streaming.mlp_tiles=2", tmp_path=tmp_path)[0].streaming
    assert (whole.mlp_tiles, sliced.mlp_tiles) == (1, 2)
    assert 0.1 < sliced.predicted_compute_s / whole.predicted_compute_s - 1 < 0.5


@pytest.mark.parametrize("hardware", ["a100_80gb", "h100_80gb"])
def test_phi4_on_80gb_picks_lora(tmp_path, hardware):
    plan, _ = plan_for("model=phi4", f"hardware={hardware}", tmp_path=tmp_path)
    assert plan.strategy == "lora" and plan.precision == "bf16-mixed"  # pretrained weights fit: LoRA, never full


def test_random_init_trains_everything_and_explicit_choice_wins(tmp_path):
    plan, _ = plan_for("model=phi4_tiny", "hardware=cpu_16gb", tmp_path=tmp_path)
    assert plan.strategy == "full" and "random init" in plan.reasons[0]
    plan, _ = plan_for("model=phi4_tiny", "hardware=cpu_16gb", "strategy=sparse_lora", tmp_path=tmp_path)
    assert plan.strategy == "sparse_lora" and plan.sparse_layers == [0, 1, 2, 3, 36, 37, 38, 39]


def test_memory_grows_with_micro_batch_and_breakdown_adds_up(tmp_path):
    small, _ = plan_for(
        "model=phi4", "hardware=a100_80gb", "strategy=lora", "strategy.micro_batch=1", tmp_path=tmp_path
    )
    big, _ = plan_for("model=phi4", "hardware=a100_80gb", "strategy=lora", "strategy.micro_batch=8", tmp_path=tmp_path)
    assert big.candidates["lora"]["activations_mb"] > 4 * small.candidates["lora"]["activations_mb"]
    c = big.candidates["lora"]
    # one micro-batch per step: gradients are allocated as activations are freed, the peak holds the larger
    parts = sum(c[k] for k in ("weights_mb", "optimizer_mb", "workspace_mb"))
    assert parts + max(c["trainable_mb"], c["activations_mb"]) == pytest.approx(c["peak_mb"], abs=1)
    # micro-batches accumulating: the first one's gradients outlive its backward, the peak holds both
    a = small.candidates["lora"]
    parts = sum(a[k] for k in ("weights_mb", "optimizer_mb", "workspace_mb", "trainable_mb", "activations_mb"))
    assert small.accumulate == 8 and parts == pytest.approx(a["peak_mb"], abs=1)


def test_a_busy_profile_is_measured_again_when_quiet_but_not_at_every_quiet_moment(tmp_path, monkeypatch):
    """A profile measured on busy cores is kept for half an hour, then measured again once the cores are free:
    on a machine busy in bursts (a sweep, a test suite), every quiet moment used to measure it again."""
    import json
    import os

    from onn.hardware import profile as hardware

    auto = compose("hardware=auto").hardware  # the session's profile (conftest), written as if measured on busy cores
    busy = {**resolve(auto, tmp_path / "cache", tmp_path).as_dict(), "busy_while_measuring": 1.5}
    cache = tmp_path / "hardware" / f"{busy['fingerprint']}.json"
    cache.parent.mkdir()
    cache.write_text(json.dumps({k: v for k, v in busy.items() if k in hardware.Profile.__dataclass_fields__}))
    monkeypatch.setattr(hardware, "cpu_busy_cores", lambda seconds=0.5: 0.0)  # the cores are free now

    class MeasuredAgain(Exception):
        pass

    def measure(*args):
        raise MeasuredAgain

    monkeypatch.setattr(hardware, "measure", measure)
    mine = compose("hardware=auto", f"hardware.cache={cache.parent}").hardware
    assert resolve(mine, tmp_path / "cache", tmp_path).source.startswith("cache")  # measured minutes ago
    an_hour_ago = cache.stat().st_mtime - 3600
    os.utime(cache, (an_hour_ago, an_hour_ago))
    with pytest.raises(MeasuredAgain):
        resolve(mine, tmp_path / "cache", tmp_path)


def test_torch_never_runs_more_threads_than_this_machine_has():
    """A plan for a preset machine of more cores than this one (hardware=cpu_16gb: 8) runs on this one's cores."""
    import os

    import torch

    from onn.hardware.profile import use_threads

    before = use_threads(4 * (os.cpu_count() or 1))
    try:
        assert 1 <= torch.get_num_threads() <= len(os.sched_getaffinity(0))
    finally:
        use_threads(before)
    assert torch.get_num_threads() == before


def test_a_watch_restarted_runs_on_its_threads_again():
    """Load a watch restarts past (a benchmark's harness working while its run waited) no longer holds the run to
    fewer threads: the thread count it led to goes back to the plan's."""
    import torch

    from onn.hardware.profile import CoreWatch

    before = torch.get_num_threads()
    try:
        watch = CoreWatch(2, every_s=0.0)
        if watch.last is None:
            pytest.skip("no /proc/stat here: the watch never looks")
        every_core = float(watch.ticks * watch.cores)  # a second ago: every core busy with another process
        watch.last = tuple(a - b for a, b in zip(watch._read(), (every_core, every_core, 0.0, 1.0)))
        assert watch.look() == 1 and torch.get_num_threads() == 1
        watch.restart()
        assert watch.threads == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_runs_started_together_measure_the_profile_once(tmp_path, monkeypatch):
    """A run that finds another measuring waits for it and reads its profile (a sweep's jobs, test workers): each
    measuring on cores the others keep busy took tens of seconds of every core and measured their load."""
    import json
    import threading

    from onn.hardware import profile as hardware
    from onn.hardware.locks import held

    measured = resolve(compose("hardware=auto").hardware, tmp_path / "cache", tmp_path)  # the session's (conftest)
    cache = tmp_path / "hardware" / f"{measured.fingerprint}.json"
    cache.parent.mkdir()
    monkeypatch.setattr(hardware, "measure", lambda *args: pytest.fail("measured while another run was measuring"))
    mine = compose("hardware=auto", f"hardware.cache={cache.parent}").hardware
    got = []
    with held(cache.parent, name=hardware.MEASURE_LOCK):  # another run, measuring
        waiting = threading.Thread(target=lambda: got.append(resolve(mine, tmp_path / "cache", tmp_path)))
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive()  # it waits for the measurement
        cache.write_text(json.dumps({**measured.as_dict(), "busy_while_measuring": 0.0}))
    waiting.join()
    assert got[0].source.startswith("cache") and got[0].matmul_tflops == measured.matmul_tflops


def test_a_damaged_profile_cache_is_measured_again(tmp_path, monkeypatch):
    """A cache file cut short (a run killed while writing it, a full disk) is measured again, not a traceback in
    every later run until someone deletes it by hand."""
    import json

    from onn.hardware import profile as hardware

    measured = resolve(compose("hardware=auto").hardware, tmp_path / "cache", tmp_path)  # the session's (conftest)
    cache = tmp_path / "hardware" / f"{measured.fingerprint}.json"
    cache.parent.mkdir()
    cache.write_text(json.dumps(measured.as_dict())[:100])
    monkeypatch.setattr(hardware, "measure", lambda *args: hardware.replace(measured))
    again = resolve(compose("hardware=auto", f"hardware.cache={cache.parent}").hardware, tmp_path / "cache", tmp_path)
    assert again.source == "measured" and json.loads(cache.read_text())["matmul_tflops"] == measured.matmul_tflops
    assert not list(cache.parent.glob("*.tmp"))  # no temporary file left beside it


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_measured_profile_is_cached(tmp_path):
    # its own cache folder, not the session's (conftest): this profile is measured here
    auto = compose("hardware=auto", "hardware.disk_probe_mb=16", f"hardware.cache={tmp_path / 'hardware'}").hardware
    first = resolve(auto, tmp_path / "cache", tmp_path)
    assert first.source == "measured" and first.matmul_tflops > 0 and first.disk_read_mb_s > 0
    assert first.accelerator in ("cpu", "cuda", "mps") and first.cpu_cores >= 1
    assert set(first.block_call_s) >= {"forward", "full", "lora"} and first.disk_free_mb > 0
    assert 0 < first.cpu_share <= 1 and first.cpu_busy_cores >= 0  # measured every run, not cached
    if first.accelerator == "cpu":
        assert {"256", "4096"} == set(first.matmul_gflops) and first.decode_gvalues_s["int8->bfloat16"] > 0
    second = resolve(auto, tmp_path / "cache", tmp_path)
    if first.busy_while_measuring < 0.5:  # a profile measured on busy cores is measured again when they are free
        assert second.source.startswith("cache") and second.matmul_tflops == first.matmul_tflops
