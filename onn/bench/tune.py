"""`task=tune`: short timed trials of the settings the planner would otherwise guess, cached.

Searched: chunk_size x micro-batch x store_dtype for layer streaming; micro-batch x gradient
checkpointing for the other strategies. The first trial is the planner's own guess; then one
setting at a time is varied around the best so far (micro-batch, then chunk size, then store
dtype), skipping what the planner predicts will not fit, until the axes are done or
`tune.time_budget_s` is spent. A trial is the `task=bench` protocol, shortened (onn/bench/suite.py), in a process of
its own: one that runs out of memory (a MemoryError, CUDA's OutOfMemoryError, or the kernel's OOM killer) or fails
is recorded and the search goes on, unless it is the planner's own guess that fails (a data or model error no
neighbour mends: one sentence).
The fastest trial whose measured peak fits the budget wins; if it is not the planner's guess, the
two are measured again head to head, alternating, each side's rate taken over all its rounds (its rows over its
seconds); the guess stays unless the candidate's is higher, and `tune/speedup_over_plan` is their ratio.

The result is cached under paths.cache/tune, keyed by (hardware fingerprint, model fingerprint,
strategy, sequence length, batch size, and the strategy's precision, layers, LoRA and Lightning
strategy); afterwards the plan takes `auto` settings from it and says so. The hardware is the machine the trials
ran on (onn/planning/tuned.py): with a preset, this machine beside the preset's figures, and the result says its
speeds are this machine's (`measured_on`, `planned_for`), not the preset's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from onn.bench import child
from onn.bench.suite import fixed_streaming, measure
from onn.config import ONNConfig, as_dict
from onn.config.task import BenchTask, TuneConfig
from onn.errors import UserError
from onn.hardware.disk import write_text_atomically
from onn.hardware.memory import is_out_of_memory
from onn.planning.plan import Plan, make_plan, micro_batch_sizes
from onn.planning.streaming import chunk_sizes, store_dtypes
from onn.planning.tuned import cache_path, measured_on

log = logging.getLogger("onn")
TRIAL_LOG = "trial.log"  # a trial's output, in its folder: the traceback of one that failed
TRIAL_LEAST_LIMIT_S = 600  # a trial's time at most: twice tune.time_budget_s, and never less than this


class _Trials:
    """The settings tried, each timed once: a trial asked for again is the one already run."""

    def __init__(self, job, tune: TuneConfig, streaming: bool):
        self.job, self.tune, self.streaming = job, tune, streaming
        self.rows: list[dict[str, Any]] = []

    def timed(self, settings: dict[str, Any], folder: Path) -> dict[str, Any]:
        job = self.job
        cfg = _with_settings(job.config, settings, self.streaming)
        trial_plan = make_plan(cfg, job.hardware, job.spec, use_tuned=False)
        row: dict[str, Any] = {"settings": settings, "predicted_mb": trial_plan.predicted_peak_memory_mb}
        if not trial_plan.candidates[job.plan.strategy]["fits"]:
            return {**row, "status": "predicted not to fit"}
        return {**row, **_time(cfg, trial_plan, folder, self.tune)}

    def __call__(self, settings: dict[str, Any]) -> dict[str, Any]:
        for t in self.rows:
            if t["settings"] == settings:
                return t
        row = self.timed(settings, self.job.run_dir / "trials" / str(len(self.rows)))
        self.rows.append(row)
        log.info("tune: trial %d %s -> %s", len(self.rows) - 1, settings, _samples_per_s(row) or row["status"])
        return row

    def usable(self, row: dict[str, Any]) -> bool:
        """A trial that ran and whose measured growth fits what the budget leaves beside the context (the process's
        baseline, or the CUDA context): the growth is measured above it, and the whole budget let any trial pass."""
        return row["status"] == "ok" and row["peak_growth_mb"] <= headroom_mb(self.job.plan)


def headroom_mb(plan: Plan) -> float:
    """The budget less the context: what a trial's growth may reach (the plan sizes the same share)."""
    return plan.budget_mb - plan.context_mb


def check_settings(config: ONNConfig) -> None:
    """tune.* in one sentence before anything is profiled: a value no search can use would end it in a traceback
    after every trial (confirm_rounds=0 divides by its zero rounds)."""
    tune = config.tune
    for key, least in (("steps", 1), ("warmup_steps", 0), ("time_budget_s", 0), ("confirm_rounds", 1)):
        if getattr(tune, key) < least:
            raise UserError(f"tune.{key}={getattr(tune, key)}: give a number, {least} or more.")


def run(job) -> dict[str, Any]:
    config, plan, run_dir, hw, spec = job.config, job.plan, job.run_dir, job.hardware, job.spec
    tune = config.tune
    streaming = bool(plan.streaming)
    guess = _settings_of(plan)
    axes = {"micro_batch": micro_batch_sizes(config.data.batch_size)}
    if streaming:
        axes["chunk_size"] = chunk_sizes(spec.n_blocks)
        axes["store_dtype"] = store_dtypes(hw, plan.precision)
    else:
        axes["gradient_checkpointing"] = [False, True]
    started = time.perf_counter()
    trials = _Trials(job, tune, streaming)
    best = trials(guess)
    if best["status"].startswith("failed"):
        raise UserError(f"task=tune stopped at the planner's own settings {guess}, which {best['status']}")
    if not trials.usable(best):
        log.warning("tune: the planner's own settings did not run within budget (%s)", best["status"])
    for axis, values in axes.items():  # one axis at a time, from the best so far, within the time budget
        for value in values:
            if time.perf_counter() - started > tune.time_budget_s:
                break
            row = trials({**best["settings"], axis: value})
            if trials.usable(row) and (not trials.usable(best) or row["samples_per_s"] > best["samples_per_s"]):
                best = row
    if not trials.usable(best):
        table = _table(
            {
                "strategy": plan.strategy,
                "sequence_length": plan.sequence_length,
                "settings": {},
                "samples_per_s": None,
                "plan_settings": guess,
                "plan_samples_per_s": None,
                "speedup_over_plan": None,
                "trials": trials.rows,
            }
        )
        (run_dir / "tune.md").write_text(table + "\n")
        raise UserError(
            f"task=tune: no setting of {plan.strategy} ran within the {headroom_mb(plan):,.0f} MB the budget leaves "
            f"beside the {plan.context_mb:,.0f} MB context (the planner's own: {_outcome(trials.rows[0])}); "
            f"see {run_dir / 'tune.md'}."
        )
    result = _confirmed(trials, best, guess, tune)
    result["time_s"] = round(time.perf_counter() - started, 1)
    return _save(job, result, len(trials.rows))


def _confirmed(trials: _Trials, best: dict[str, Any], guess: dict[str, Any], tune: TuneConfig) -> dict[str, Any]:
    """The best trial against the planner's guess head to head, alternating (drift hits both alike); a
    gain that does not hold up, or a round that fails (out of memory, ...), keeps the guess."""
    plan_row = trials.rows[0]
    # a guess over the budget is no baseline: a speedup over it would credit the tuner with the budget's cut
    plan_sps = _samples_per_s(plan_row) if trials.usable(plan_row) else None
    best_sps = best["samples_per_s"]
    head_to_head = None
    if best is not plan_row and trials.usable(plan_row):
        rounds: dict[str, list] = {"plan": [], "candidate": []}
        for _ in range(tune.confirm_rounds):
            for row, name in ((plan_row, "plan"), (best, "candidate")):
                rounds[name].append(_samples_per_s(trials.timed(row["settings"], trials.job.run_dir / "confirm")))
        head_to_head = {
            "settings": best["settings"],
            "plan_samples_per_s": rounds["plan"],
            "samples_per_s": rounds["candidate"],
        }
        if None in rounds["plan"] + rounds["candidate"]:
            best, best_sps = plan_row, plan_sps
        else:
            plan_sps, best_sps = pooled_samples_per_s(rounds["plan"]), pooled_samples_per_s(rounds["candidate"])
            if plan_sps >= best_sps:
                best, best_sps = plan_row, plan_sps
    speedup = best_sps / plan_sps if plan_sps else None
    plan = trials.job.plan
    return {
        "strategy": plan.strategy,
        "sequence_length": plan.sequence_length,
        "settings": best["settings"],
        "samples_per_s": round(best_sps, 3),
        "plan_settings": guess,
        "plan_samples_per_s": round(plan_sps, 3) if plan_sps else None,
        "speedup_over_plan": round(speedup, 3) if speedup else None,
        "trials": trials.rows,
        "head_to_head": head_to_head,
        "tuned_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def pooled_samples_per_s(rates: list[float]) -> float:
    """One side's samples/s over its head-to-head rounds: its rows over its seconds. Every round trains the same
    rows (the same steps of the same batches), so that is the harmonic mean of the rounds' rates; their plain mean
    let one fast round outweigh a slow one and chose a setting that took longer over its rounds."""
    return statistics.harmonic_mean(rates)


def _outcome(row: dict[str, Any]) -> str:
    """A trial's status, with its growth where it ran: why it was not used, in a few words."""
    return f"grew {row['peak_growth_mb']:,.1f} MB" if row["status"] == "ok" else row["status"]


def _samples_per_s(row: dict[str, Any]) -> float | None:
    """A trial's throughput; None for one that did not run (no fit, out of memory, an error)."""
    return row["samples_per_s"] if row["status"] == "ok" else None


def _save(job, result: dict[str, Any], trial_count: int) -> dict[str, Any]:
    """The result into the tuner's cache (later runs take it) and tune.md; the run's figures. It names the machine
    its trials ran on and, under a preset, the preset that sized them: the speeds are this machine's."""
    hw = job.hardware
    result = {**result, "measured_on": measured_on(hw), "planned_for": None if hw.fingerprint else hw.name}
    path = cache_path(job.config, hw, result["strategy"], result["sequence_length"])
    write_text_atomically(path, json.dumps(result, indent=2))
    table = _table(result)
    (job.run_dir / "tune.md").write_text(table + "\n")
    print(table, flush=True)
    return {
        "tune/settings": result["settings"],
        "tune/plan_settings": result["plan_settings"],
        "tune/samples_per_s": result["samples_per_s"],
        "tune/plan_samples_per_s": result["plan_samples_per_s"],
        "tune/speedup_over_plan": result["speedup_over_plan"],
        "tune/trials": trial_count,
        "tune/time_s": result["time_s"],
        "tune/cache": str(path),
        "tune/measured_on": result["measured_on"],
        "tune/planned_for": result["planned_for"],
    }


def _settings_of(plan: Plan) -> dict[str, Any]:
    settings = {"micro_batch": plan.micro_batch}
    if plan.streaming:
        settings.update(chunk_size=plan.streaming.chunk_size, store_dtype=plan.streaming.store_dtype)
    else:
        settings["gradient_checkpointing"] = bool(plan.gradient_checkpointing)
    return settings


def _with_settings(config: ONNConfig, settings: dict[str, Any], streaming: bool) -> ONNConfig:
    cfg = copy.deepcopy(config)
    cfg.strategy.micro_batch = settings["micro_batch"]
    if streaming:
        fixed = {"chunk_size": settings["chunk_size"], "store_dtype": settings["store_dtype"]}
        cfg.strategy.streaming = fixed_streaming(cfg.strategy.streaming, fixed)
    else:
        cfg.strategy.gradient_checkpointing = settings["gradient_checkpointing"]
    return cfg


def _time(config: ONNConfig, plan: Plan, run_dir: Path, tune: TuneConfig) -> dict[str, Any]:
    """One trial: the bench protocol with a few steps, in a process of its own (a trial scores no answers and runs
    no learning test). Its own process: the OOM killer ends the trial, not the search, and no trial's memory is
    left to the next one's reading. Its output goes to run_dir/TRIAL_LOG."""
    protocol = BenchTask(
        name="tune",
        warmup_steps=tune.warmup_steps,
        steps=tune.steps,
        val_batches=1,
        quality="loss_fall",
        exact_match_samples=0,
        learned_p=0.05,
    )
    config = dataclasses.replace(config, task=protocol)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_file = run_dir / TRIAL_LOG
    log_file.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        request = {"config": as_dict(config), "plan": plan.as_dict(), "run_dir": str(run_dir), "result": str(result)}
        proc = child.start("onn.bench.tune", [], log_file, json.dumps(request))
        limit_s = max(TRIAL_LEAST_LIMIT_S, 2 * tune.time_budget_s)
        proc.join(limit_s)
        if proc.is_alive():  # a hung trial (a stuck loader, a deadlock) would hold the search past its budget
            proc.kill()
            proc.join()
            return {"status": f"failed: it ran past {limit_s:.0f} s and was stopped; see {log_file}"}
        if result.is_file():
            return json.loads(result.read_text())
    if proc.exitcode == -signal.SIGKILL:  # what the kernel's OOM killer sends
        return {"status": f"out of memory (its process was killed by SIGKILL; see {log_file})"}
    if proc.exitcode < 0:
        return {"status": f"failed: its process was killed by {signal.Signals(-proc.exitcode).name}; see {log_file}"}
    lines = [line for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
    return {"status": f"failed: {lines[-1] if lines else f'exit code {proc.exitcode}'}; see {log_file}"}


def _trial_outcome(config: ONNConfig, plan: Plan, run_dir: Path) -> dict[str, Any]:
    """The trial's figures, or why it has none: out of memory (a setting that does not fit), or failed with the
    error in its own words (its traceback is in the trial's log)."""
    warmup = config.task.warmup_steps
    try:
        raw = measure(config, plan, run_dir)
    except UserError as e:
        return {"status": f"failed: {e}"}
    except Exception as e:  # noqa: BLE001 - any error is this trial's outcome, told in the table
        if isinstance(e, MemoryError) or is_out_of_memory(e):
            return {"status": "out of memory"}
        traceback.print_exc()
        first_line = (str(e).strip().splitlines() or [""])[0]
        return {"status": f"failed: {type(e).__name__}: {first_line}; see {run_dir / TRIAL_LOG}"}
    if raw["oom_backoffs"]:
        return {"status": "out of memory"}
    timed = raw["step_s"][warmup:]
    return {
        "status": "ok",
        "samples_per_s": round(sum(raw["rows"][warmup:]) / sum(timed), 3),  # the rows its steps had
        "peak_growth_mb": round(raw["peak_mb"] - raw["baseline_mb"], 1),
    }


def _main() -> None:
    """A trial's process (`_time`): a JSON request on stdin, its outcome to request['result']."""
    request = json.loads(sys.stdin.read())
    # Everything a run imports, imported before the baseline is read: it belongs to the process, not the model.
    import lightning  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import onn.modalities.text.tasks  # noqa: F401

    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    config = child.config_from_dict(request["config"], BenchTask, "task=tune's trial process")
    outcome = _trial_outcome(config, Plan.from_dict(request["plan"]), Path(request["run_dir"]))
    Path(request["result"]).write_text(json.dumps(outcome))


def _table(result: dict[str, Any]) -> str:
    keys = list(result["plan_settings"])
    lines = [
        f"# task=tune: {result['strategy']}, sequence length {result['sequence_length']}",
        "",
        "| # | " + " | ".join(keys) + " | samples/s | growth MB (measured) | predicted MB | status |",
        "|---|" + "---|" * len(keys) + "--:|--:|--:|---|",
    ]
    for i, t in enumerate(result["trials"]):
        mark = " (plan)" if i == 0 else ""
        mark += " **best**" if t["settings"] == result["settings"] else ""
        cells = [str(t["settings"][k]) for k in keys]
        lines.append(
            f"| {i}{mark} | "
            + " | ".join(cells)
            + f" | {t.get('samples_per_s', '')} | {t.get('peak_growth_mb', '')} | "
            f"{t['predicted_mb']} | {t['status']} |"
        )
    if not result["settings"]:
        lines += ["", "no setting ran within the memory budget"]
        return "\n".join(lines)
    duel = result["head_to_head"]
    plan_row = result["trials"][0]
    if result["plan_samples_per_s"] is None:
        how = f"it did not run within the budget: {_outcome(plan_row)}"
    elif duel is None:
        how = "no trial beat it"
    else:
        kept = "kept" if result["settings"] == result["plan_settings"] else "beaten"
        how = (
            f"re-measured head to head, alternating, against {duel['settings']}: {duel['plan_samples_per_s']} vs "
            f"{duel['samples_per_s']} samples/s, so the guess was {kept}"
        )
    lines += [
        "",
        f"best: {result['settings']} at {result['samples_per_s']} samples/s; "
        f"the planner's guess {result['plan_settings']} "
        f"at {result['plan_samples_per_s']} samples/s ({how}): speedup over plan {result['speedup_over_plan']}",
        "Growth is each trial's peak in its own process above what that process held before building the model "
        "(resident memory on a CPU, allocated memory on a GPU), beside the planner's prediction of the same.",
    ]
    if result.get("planned_for"):
        preset = result["planned_for"]
        lines.append(
            f"Measured on this machine ({result['measured_on']}) with the trials sized by hardware={preset}'s "
            f"figures: the speeds are this machine's, not a {preset}'s."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    _main()
