"""`task=bench`: a short, fixed training protocol on this machine, measured against the plan's predictions.

Protocol: held-out loss on `task.val_batches` batches; `task.warmup_steps + task.steps` real
training steps through the same Lightning path as `task=train` (strategy, streaming, precision);
held-out loss again. Warm-up steps train but are not timed.

The steps run in a fresh interpreter so every job of a grid is measured on equal terms: no
memory left over from an earlier job, and a job the OS kills for memory fails alone. The
process's baseline (Python, torch, Lightning, transformers imported; nothing built) is measured
there first; the prediction is the planner's allocation for the shapes the batches had plus that
baseline (on GPUs: the allocation alone, against torch.cuda.max_memory_allocated).

Figures (beside the [core] keys): bench/step_s, samples_per_s, tokens_per_s, io_s and compute_s
(streaming), peak_memory_mb, predicted_memory_mb, memory_error = measured / predicted - 1,
memory_growth_error (the same for the growth above the baseline: the stricter figure),
predicted_step_s (the model's blocks timed between the run's steps, timing_windows times), step_time_error
(with timed_after_step_s where it exceeds STEP_TIME_TARGET: the blocks timed
again after the steps), learned, learned_p, loss_curve, quality and the score/* keys;
on CPUs cpu_share_measured (the run's CPU time over wall time and threads) and steal_cores (the cores the
hypervisor took meanwhile), which say when the machine, not the plan, made a step slow;
see onn/bench/scores.py for how learning, quality and the scores are decided.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import itertools
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L

from onn.bench import child
from onn.bench.scores import equitable, learned, loss_fall
from onn.config import ONNConfig, as_dict
from onn.config.strategy import StreamingConfig
from onn.config.task import BenchTask
from onn.errors import UserError
from onn.hardware.profile import Profile
from onn.planning.plan import Plan, make_plan
from onn.planning.streaming import STREAMING_KEYS
from onn.training.callbacks import batch_rows

log = logging.getLogger("onn")


QUALITY = ("loss_fall", "exact_match")
SCORES = ("efficiency", "speed", "memory")  # task.score_weights' keys: the scores score/overall weighs
STEP_TIME_TARGET = 0.25  # |step_time_error| the plan is held to (the equitable grid's bound)
STEPS_PER_WINDOW = 5  # the run's timed steps between two timings of the blocks


def check_settings(task: BenchTask) -> None:
    """The task's own values, checked before anything is profiled, planned or loaded: a value the figures cannot
    use would otherwise give them wrong or empty, with `status: ok`."""
    if task.quality not in QUALITY:
        raise UserError(f"task.quality={task.quality} is not one of {', '.join(QUALITY)}.")
    for key in ("steps", "val_batches"):
        if getattr(task, key) < 1:
            raise UserError(f"task.{key}={getattr(task, key)}: the benchmark needs a whole number of at least 1.")
    if task.warmup_steps < 0:
        raise UserError(f"task.warmup_steps={task.warmup_steps}: give a whole number, 0 or more.")
    if task.quality == "exact_match" and task.exact_match_samples < 1:
        raise UserError(
            f"task.exact_match_samples={task.exact_match_samples}: task.quality=exact_match scores that many held-out "
            "answers; give 1 or more, or task.quality=loss_fall."
        )
    if not 0 < task.learned_p < 1:
        raise UserError(
            f"task.learned_p={task.learned_p}: bench/learned needs a significance level between 0 and 1 (e.g. 0.05)."
        )
    check_score_weights(task.score_weights)


def check_score_weights(weights: dict[str, float]) -> None:
    """task.score_weights: the three scores' names (a misspelt one would be left out of score/overall without a
    word), weights 0 or more, at least one above 0."""
    for name, weight in weights.items():
        if name not in SCORES:
            close = difflib.get_close_matches(name, SCORES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserError(f"task.score_weights.{name} is not one of {', '.join(SCORES)}{hint}; fix its name.")
        if not weight >= 0:
            raise UserError(f"task.score_weights.{name}={weight}: give a weight of 0 or more.")
    if not sum(weights.values()) > 0:
        raise UserError(
            f"task.score_weights={dict(weights)}: score/overall is the scores' mean by these weights; give at least "
            "one weight above 0."
        )


def run(job) -> dict[str, Any]:
    from onn.modalities.text.calibrate import WINDOW_S, is_large, refine

    check_settings(job.config.task)
    timed = job.plan.step_time_source == "timed"
    timings = [0]
    predicted: list[Plan] = []  # the step predicted for the shapes of the run's timed steps, before they ran
    between = None
    if timed and not is_large(job.spec):
        # The blocks timed between the steps: back to back for as long as the next STEPS_PER_WINDOW steps will take,
        # before each such span of the run's timed steps, in this process while the run waits. This shared host's
        # speed moves by a third in spells of seconds (a 3 s timing just before 20 steps missed them by 25-43% in
        # 1 or 2 of a grid's 18 runs, the timing just after agreeing with the run); timings spread over the run
        # meet its spells. They time the shapes the child drew from its data before its first step.
        window = min(WINDOW_S, STEPS_PER_WINDOW * float(job.plan.predicted_step_s))

        def between(shapes: list[int] | None, pauses: Iterator[None]) -> None:
            config, plan = _at_shapes(job, shapes)
            windows = (window for _ in _counted(pauses, timings))
            predicted.append(refine(plan, config, job.hardware, job.spec, windows=windows))

    elif timed:  # a large model's copies: timed once, while the run waits before its first timed step

        def between(shapes: list[int] | None, pauses: Iterator[None]) -> None:
            for _ in pauses:
                predicted.append(_time_blocks(job, *_at_shapes(job, shapes)))
                return

    raw = measure_isolated(job.config, job.plan, job.run_dir, between)
    out = summarize(job.config, job.plan, job.hardware, job.spec, raw, predicted[0] if predicted else None)
    out["bench/timing_windows"] = timings[0]
    error = out["bench/step_time_error"]
    if predicted and error is not None and abs(error) > STEP_TIME_TARGET:
        # A miss: the blocks timed once more, at once, at the shapes of the prediction. Near the run's step, the
        # host's speed changed between the timing before and the steps (a 700-step run went from 0.175 to 0.233 s
        # a step between two steps, and stayed there); near the timing before, the plan mis-modelled the step.
        out["bench/timed_after_step_s"] = _time_blocks(job, *_at_shapes(job, raw["timed_shapes"])).predicted_step_s
    return out


def _at_shapes(job, shapes: list[int] | None) -> tuple[ONNConfig, Plan]:
    """The config and plan replanned at `shapes` (the timed steps' mean width and rows, drawn from the data before
    they ran), or the job's own where the data could not be drawn ahead (streamed data: at data.max_length)."""
    if shapes is None:
        return job.config, job.plan
    width, rows = shapes
    return _replanned(job.config, job.plan, job.hardware, job.spec, width, int(job.plan.micro_batch), rows)


def _counted(items: Iterator[None], count: list[int]) -> Iterator[None]:
    for item in items:
        count[0] += 1
        yield item


def _time_blocks(job, config: ONNConfig, plan: Plan) -> Plan:
    """`plan` with its step time from the model's blocks timed now at its shapes, for about as long as the steps
    take."""
    from onn.modalities.text.calibrate import refine

    window_s = job.config.task.steps * float(job.plan.predicted_step_s)
    return refine(plan, config, job.hardware, job.spec, window_s=window_s)


def measure_isolated(
    config: ONNConfig,
    plan: Plan,
    run_dir: Path,
    between: Callable[[list[int] | None, Iterator[None]], Any] | None = None,
) -> dict[str, Any]:
    """`measure` in a process of its own (`child.start`: forked from a warm interpreter); its output goes to
    run_dir/bench.log. `between`: called in this process while the child runs, with the mean width and rows of the
    child's timed steps (drawn from its data before its first step; None where they cannot be) and an iterator that
    yields before every STEPS_PER_WINDOW-th of the child's timed steps, the first included, which waits until the
    next item is asked for (or `between` returns)."""
    import multiprocessing

    log = run_dir / "bench.log"
    log.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        request = {"config": as_dict(config), "plan": plan.as_dict(), "run_dir": str(run_dir), "result": str(result)}
        ours, theirs = multiprocessing.Pipe() if between else (None, None)
        proc = child.start("onn.bench.suite", [], log, json.dumps(request), link=theirs)
        if ours is not None:
            theirs.close()
            try:
                shapes = _message(ours, proc)
                if shapes is not None:  # the child lived to draw them: its steps follow
                    pauses = _pauses(ours, proc, config.task.warmup_steps)
                    between(shapes[1], pauses)
                    for _ in pauses:  # the pauses `between` left: the run goes on through them
                        pass
            finally:
                ours.close()  # a child still waiting reads the end of the pipe and fails
        proc.join()
        if result.is_file():
            raw = json.loads(result.read_text())
            if "error" in raw:  # the child's UserError, in its own words
                raise UserError(raw["error"])
            return raw
    if proc.exitcode < 0:
        raise UserError(f"the benchmark process was killed by signal {-proc.exitcode} (out of memory?); see {log}.")
    tail = [line for line in log.read_text(errors="replace").strip().splitlines() if line.strip()]
    raise RuntimeError(f"the benchmark process failed: {tail[-1] if tail else proc.exitcode}; see {log}")


def _message(link, proc) -> Any:
    """The child's next message, or None where it ended without one."""
    while not link.poll(0.2):
        if not proc.is_alive():
            return None
    try:
        return link.recv()
    except EOFError:
        return None


def _pauses(link, proc, warmup: int) -> Iterator[None]:
    """Yields as the child's run is about to take every STEPS_PER_WINDOW-th timed step (after `warmup`), and lets
    the step start when the next item is asked for; ends when the run's steps do, or the child does."""
    count = 0
    while _message(link, proc) not in (None, "done"):
        timed = count >= warmup and (count - warmup) % STEPS_PER_WINDOW == 0
        if timed:
            yield
        count += 1
        link.send("timed" if timed else "go")


class Pauses(L.Callback):
    """The child's side of `measure_isolated(between=...)`: before each training step, waits until the parent
    lets it start (after timing its copies, every STEPS_PER_WINDOW-th step). `waited_s`: the time spent waiting,
    which is not the run's."""

    def __init__(self, link):
        self.link, self.waited_s = link, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        begin = time.perf_counter()
        self.link.send("step")
        timed = self.link.recv() == "timed"
        self.waited_s += time.perf_counter() - begin
        cores = getattr(getattr(pl_module, "engine", None), "cores", None)
        if cores is not None and (timed or batch_idx == 0):
            # The parent's timing just now, or its copies built while this run set up, is no load the run should
            # leave its cores to. Only then: a restart at every step would keep the watch from ever looking.
            cores.restart()

    def on_train_end(self, trainer, pl_module) -> None:
        self.link.send("done")


def bench_exact_match(config: ONNConfig, module: Any, tokenizer: Any, dm: Any) -> dict[str, float]:
    """task.quality=exact_match: the held-out answers the trained model writes, scored as eval scores them."""
    from onn.modalities.text.generate import exact_match

    if not any(p for p, _ in dm.val_examples):
        raise UserError(f"task.quality=exact_match needs data with answers; data '{config.data.name}' has none.")
    return exact_match(
        module.model,
        tokenizer,
        dm.val_examples,
        config.data.answer_pattern,
        config.task.exact_match_samples,
        max_new_tokens=dm.max_answer_tokens + 2,
        engine=module.engine,
        add_special_tokens=dm.prompter.add_special_tokens,
        turn_end=dm.prompter.answer_end,
        bos=dm.prompter.starts_with_bos,
    )


def measure(config: ONNConfig, plan: Plan, run_dir: Path) -> dict[str, Any]:
    """Run the protocol (config.task, a BenchTask) in this process and return the raw figures (per-step times,
    losses, peak memory)."""
    import gc

    from onn.hardware.cluster import use_own_gpu
    from onn.hardware.memory import PeakMemory, anon_rss_mb, cap_gpu_memory
    from onn.hardware.profile import steal_s, use_threads
    from onn.modalities.text.tasks import build, datamodule, trainer
    from onn.training.callbacks import ResourceMonitor, StepClock

    use_threads(plan.threads)  # the fresh process runs on the threads the plan sized to the free cores
    use_own_gpu()  # before the cap and the memory readings, which act on the current device
    task: BenchTask = config.task
    warmup, steps = task.warmup_steps, task.steps
    config = copy.deepcopy(config)
    config.trainer = dataclasses.replace(
        config.trainer,
        max_steps=warmup + steps,
        val_check_interval=warmup + steps,
        limit_val_batches=task.val_batches,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    clock = StepClock()
    pauses = [Pauses(child.link)] if child.link is not None else []  # before the clock: its waits are not the step's
    fit = trainer(config, plan, run_dir, [*pauses, clock, ResourceMonitor(config.trainer.log_every_n_steps)])
    gc.collect()
    cuda = plan.hardware["accelerator"] == "cuda"
    if cuda and config.hardware.budget_mb:  # held to the budget as a run is (onn/app.py)
        cap_gpu_memory(plan.budget_mb - plan.context_mb)
    baseline = 0.0 if cuda else anon_rss_mb()
    with PeakMemory("cuda" if cuda else "cpu") as peak:
        module, tokenizer = build(config, plan)
        dm = datamodule(config, tokenizer)
        shapes = timed_shapes(dm, warmup, steps)
        if child.link is not None:  # the parent times the blocks at these shapes, before the steps it predicts
            child.link.send(("shapes", shapes))
        fit.validate(module, datamodule=dm, verbose=False)
        module.train()
        cpu0, wall0, steal0 = time.process_time(), time.perf_counter(), steal_s()
        fit.fit(module, datamodule=dm)
        cpu_s, wall_s, steal1 = time.process_time() - cpu0, time.perf_counter() - wall0, steal_s()
        wall_s -= sum(p.waited_s for p in pauses)  # the run's own time: not the parent's timing
    exact = bench_exact_match(config, module, tokenizer, dm) if task.quality == "exact_match" else None
    return {
        "step_s": clock.step_s,
        "tokens": clock.tokens,
        "widths": clock.widths,
        "rows": clock.rows,
        "io_s": clock.io_s,
        "compute_s": clock.compute_s,
        "losses": module.train_losses,
        "val_losses": module.val_losses,
        "peak_mb": peak.peak_mb,
        "baseline_mb": baseline,
        "micro_batch": module.micro_batch,
        "oom_backoffs": module.oom_backoffs,
        "timed_shapes": shapes,
        "exact_match": exact,
        # the cores the training actually got: CPU time over wall time and threads
        "cpu_share": cpu_s / wall_s / max(1, int(plan.threads or 1)) if not cuda else None,
        # the cores the hypervisor took from the machine meanwhile: a slow run a prediction made before it cannot see
        "steal_cores": (steal1 - steal0) / wall_s if steal0 is not None and steal1 is not None else None,
    }


def timed_shapes(dm, warmup: int, steps: int) -> list[int] | None:
    """The mean width and rows of the run's timed steps, from the batches its loader gives them (a seeded order,
    drawn here again, in this process: no workers): the shapes its step is predicted at before it runs. None for
    streamed data, which cannot be drawn twice."""
    if dm.stream is not None:
        return None
    loader = dm.train_dataloader()
    drawn = itertools.islice(loader.batch_sampler, warmup + steps)
    batches = [loader.collate_fn([loader.dataset[i] for i in indices]) for indices in drawn][warmup:]
    width = statistics.mean(int(b["input_ids"].shape[1]) for b in batches)
    return [round(width), round(statistics.mean(batch_rows(b) for b in batches))]


def summarize(
    config: ONNConfig, plan: Plan, hardware: Profile, spec, raw: dict[str, Any], predicted: Plan | None = None
) -> dict[str, Any]:
    """The bench/* and score/* keys from the raw figures and the planner's predictions for the same shapes.
    `predicted`: the step predicted before the steps ran (the model's blocks timed at their shapes), where it was
    timed; else the planner's step for the shapes they had."""
    task: BenchTask = config.task
    warmup = task.warmup_steps
    batch_size = config.data.batch_size
    timed = raw["step_s"][warmup:]
    step_s = sum(timed) / len(timed)
    io = raw["io_s"][warmup:]
    cuda = hardware.accelerator == "cuda"
    widths = raw["widths"][warmup:]
    rows = raw["rows"][warmup:]  # data smaller than a batch, or a short last batch: fewer than data.batch_size
    mb = raw["micro_batch"]
    _, at_peak = _replanned(config, plan, hardware, spec, max(raw["widths"]), mb, max(raw["rows"]))
    predicted_alloc = at_peak.predicted_peak_memory_mb
    if predicted is None:
        _, predicted = _replanned(
            config, plan, hardware, spec, round(statistics.mean(widths)), mb, round(statistics.mean(rows))
        )
    predicted_step = predicted.predicted_step_s
    predicted_mem = predicted_alloc + raw["baseline_mb"]
    peak = raw["peak_mb"]
    is_learned, p = learned(raw["losses"], task.learned_p)
    val = raw["val_losses"]
    quality = (
        raw["exact_match"]
        if task.quality == "exact_match"
        else loss_fall(val[0] if val else None, val[-1] if val else None)
    )
    available = (hardware.device_memory_mb if cuda else hardware.host_memory_available_mb) or hardware.host_memory_mb
    samples_per_s = sum(rows) / sum(timed)
    out = {
        "bench/steps_timed": len(timed),
        "bench/step_s": round(step_s, 4),
        "bench/step_s_median": round(statistics.median(timed), 4),
        "bench/samples_per_s": round(samples_per_s, 3),
        "bench/tokens_per_s": round(sum(raw["tokens"][warmup:]) / sum(timed), 1),
        "bench/io_s": round(sum(io) / len(io), 4) if io else None,
        "bench/compute_s": round(sum(raw["compute_s"][warmup:]) / len(io), 4) if io else None,
        "bench/peak_memory_mb": round(peak, 1),
        "bench/baseline_memory_mb": round(raw["baseline_mb"], 1),
        "bench/predicted_memory_mb": round(predicted_mem, 1),
        "bench/memory_error": round(peak / predicted_mem - 1, 4),
        "bench/memory_growth_error": round((peak - raw["baseline_mb"]) / predicted_alloc - 1, 4)
        if predicted_alloc
        else None,
        "bench/predicted_step_s": round(predicted_step, 4),
        "bench/step_time_error": round(step_s / predicted_step - 1, 4) if predicted_step else None,
        # the plan's prediction, made before the benchmark's own timing of the blocks
        "bench/plan_predicted_step_s": plan.predicted_step_s,
        "bench/plan_step_time_error": round(step_s / plan.predicted_step_s - 1, 4) if plan.predicted_step_s else None,
        "bench/sequence_length": max(raw["widths"]),
        "bench/micro_batch": raw["micro_batch"],
        "bench/oom_backoffs": raw["oom_backoffs"],
        "bench/learned": is_learned,
        "bench/learned_p": round(p, 5) if p is not None else None,
        "bench/loss_curve": [round(x, 5) for x in raw["losses"]],
        "bench/val_loss_before": val[0] if val else None,
        "bench/val_loss_after": val[-1] if len(val) > 1 else None,
        "bench/quality": round(quality, 4) if quality is not None else None,
        "bench/quality_metric": task.quality,
        "bench/threads": plan.threads,
        "bench/cpu_share_planned": hardware.cpu_share,
        "bench/cpu_share_measured": round(raw["cpu_share"], 3) if raw["cpu_share"] is not None else None,
        "bench/steal_cores": round(raw["steal_cores"], 3) if raw["steal_cores"] is not None else None,
    }
    out.update(equitable(quality, spec.params, samples_per_s, batch_size, available, peak, task.score_weights))
    _print(out)
    return out


def _replanned(
    config: ONNConfig, plan: Plan, hardware: Profile, spec, seq: int, micro_batch: int, rows: int
) -> tuple[ONNConfig, Plan]:
    """The config and the planner's plan for the settings this run used (the micro-batch it ended at, after any
    out-of-memory halving), at the sequence length and the rows its batches had. Its step time is the planner's
    model: the model's own blocks are timed only before the steps (run), never after them for their prediction."""
    cfg = copy.deepcopy(config)
    cfg.data.max_length, cfg.data.batch_size = seq, rows
    strategy = cfg.strategy
    strategy.name, strategy.micro_batch, strategy.precision = plan.strategy, min(micro_batch, rows), plan.precision
    strategy.gradient_checkpointing = bool(plan.gradient_checkpointing)
    if plan.streaming:
        strategy.streaming = fixed_streaming(
            strategy.streaming, {k: getattr(plan.streaming, k) for k in STREAMING_KEYS}
        )
    if plan.sparse_layers is not None:
        strategy.layers = plan.sparse_layers
    return cfg, make_plan(cfg, hardware, spec, use_tuned=False)


def fixed_streaming(streaming: StreamingConfig | None, values: dict[str, Any]) -> StreamingConfig:
    """strategy.streaming with `values` fixed. Without a streaming block (strategy=auto, whose plan chose
    sparse_lora) every other setting is the planner's: auto, and the prefetch it assumes then."""
    if streaming is None:
        streaming = StreamingConfig(**dict.fromkeys(STREAMING_KEYS, "auto"), prefetch=True)
    return dataclasses.replace(streaming, **values)


def _print(out: dict[str, Any]) -> None:
    def pct(x):
        return f"{x:+.1%}" if x is not None else "n/a"

    lines = [
        f"bench: {out['bench/samples_per_s']:.2f} samples/s, "
        f"{out['bench/step_s']:.3f} s/step measured vs {out['bench/predicted_step_s']:.3f} predicted "
        f"({pct(out['bench/step_time_error'])})",
        f"       peak {out['bench/peak_memory_mb']:,.0f} MB measured vs {out['bench/predicted_memory_mb']:,.0f} MB "
        f"predicted ({pct(out['bench/memory_error'])}); "
        f"baseline {out['bench/baseline_memory_mb']:,.0f} MB",
        f"       learned: {out['bench/learned']} (p={out['bench/learned_p']}), "
        f"quality {out['bench/quality']} ({out['bench/quality_metric']}), scores: "
        + ", ".join(f"{k.split('/')[1]} {v:,.1f}" for k, v in out.items() if k.startswith("score/") and v is not None),
    ]
    print("\n".join(lines), flush=True)


def _main() -> None:
    """Child side of measure_isolated: a JSON request on stdin, the raw figures to request['result']."""
    request = json.loads(sys.stdin.read())
    # Everything a run imports, imported before the baseline is read: it belongs to the process, not the model.
    import lightning  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import onn.modalities.text.tasks  # noqa: F401

    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    try:
        config = child.config_from_dict(request["config"], BenchTask, "task=bench's measuring process")
        raw = measure(config, Plan.from_dict(request["plan"]), Path(request["run_dir"]))
    except UserError as e:
        raw = {"error": str(e)}
    Path(request["result"]).write_text(json.dumps(raw))


if __name__ == "__main__":
    _main()
