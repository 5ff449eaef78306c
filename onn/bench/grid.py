"""A multirun sweep's jobs side by side: grid.csv, grid.md and grid.png in the sweep folder.

Each job folder Hydra makes holds `.hydra/overrides.yaml` and `metrics.json` from its start (see
onn/app.py and onn/tasks/record.py): `running` with a heartbeat, then `ok` or `failed`. A `running`
record whose process is gone (SIGKILL, the OOM killer) is shown as crashed, and a job without
metrics.json never started. Rows are labelled by the overrides that vary across the sweep, which is
what tells the jobs apart.

`GridCallback` writes the grid when a multirun ends:
    hydra.callbacks.grid._target_: onn.bench.grid.GridCallback
"""

from __future__ import annotations

import csv
import json
import logging
import math
import statistics
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from onn.bench.suite import STEP_TIME_TARGET
from onn.tasks.record import planned_jobs, state

log = logging.getLogger("onn")

NUMBERED_SUBDIR = "${hydra.job.num}"  # Hydra's default hydra.sweep.subdir (and conf/config.yaml's)

BENCH_KEYS = [
    "bench/step_s",
    "bench/samples_per_s",
    "bench/tokens_per_s",
    "bench/io_s",
    "bench/compute_s",
    "bench/peak_memory_mb",
    "bench/predicted_memory_mb",
    "bench/memory_error",
    "bench/predicted_step_s",
    "bench/plan_predicted_step_s",
    "bench/step_time_error",
    "bench/learned",
    "bench/learned_p",
    "bench/quality",
    "bench/loss_curve",
    "bench/cpu_share_planned",
    "bench/cpu_share_measured",
    "bench/steal_cores",
]
SCORE_KEYS = ["score/efficiency", "score/speed", "score/memory", "score/overall"]
COLUMNS = [
    "job",
    "label",
    "status",
    "error",
    "task",
    "model",
    "data",
    "strategy",
    "hardware",
    "params_total",
    "predicted_peak_memory_mb",
    *BENCH_KEYS,
    *SCORE_KEYS,
    "wall_s",
    "overrides",
]
SCORE_NAMES = {
    "score/efficiency": "efficiency",
    "score/speed": "speed",
    "score/memory": "memory",
    "score/overall": "overall",
}
ERROR_CHARS = 80

EXPLANATION = (
    "One row per job of the sweep, best `overall` score first; still running, failed, crashed (killed without a "
    "record: SIGKILL, out of memory) and missing (never started) jobs last. "
    "`job` lists the overrides that differ between the sweep's jobs, `dir` is "
    "the job's folder. *samples/s* is the measured training throughput. *step s* and *peak MB* are "
    "measured next to the planner's predictions (pred.) for the shapes the job's steps had: its memory as "
    "planned, its step time from the model's blocks timed between the steps (the plan's own step time, made "
    "before the job ran, is `bench/plan_predicted_step_s` in its metrics.json); "
    "*err %* is measured / predicted - 1, so +10% means the job took 10% more than predicted. "
    "*learned* says whether the loss fell significantly (p-value in brackets), *quality* is the bench's "
    "quality figure. Scores, higher is better: efficiency = quality / parameters x 1e10, "
    "speed = samples_per_s / batch_size x 100, memory = available / peak x 100, "
    "overall = weighted mean of the three."
)
SPREAD_EXPLANATION = (
    "Each job that ran under more than one seed (`seed=0,1,2` runs the grid once per seed, a seed's pass after "
    "the last): step s and peak MB as the median over its successful runs (the range in brackets), and each "
    "run's error against its prediction (pred. above), in the order the runs went."
)


def collect(sweep_dir: Path | str, job_count: int | None = None) -> list[dict[str, Any]]:
    """One row per job folder (a direct subfolder with .hydra/overrides.yaml), in job order. With job_count (the
    sweep's number of jobs, where known), a folder numbered past it is an earlier sweep's job in the same folder
    (a failed one lets a shorter sweep in: record.other_sweep), not one of this sweep's, and is left out."""
    sweep_dir = Path(sweep_dir)
    jobs = sorted((d for d in sweep_dir.iterdir() if _is_job(d) and _of_sweep(d, job_count)), key=_job_order)
    overrides = {d.name: _read_overrides(d) for d in jobs}
    labels = _labels(overrides)
    rows = []
    for d in jobs:
        metrics, status, error = _read_metrics(d)
        given = overrides[d.name]
        row: dict[str, Any] = dict.fromkeys(COLUMNS)
        row.update(metrics)
        row.update(job=d.name, label=labels[d.name], status=status, error=error, overrides=" ".join(given.values()))
        for group in ("task", "model", "data", "strategy", "hardware"):
            if row[group] is None and group in given:  # a missing job still says what it was
                row[group] = given[group].split("=", 1)[1]
        rows.append(row)
    return rows


def write_grid(sweep_dir: Path | str, job_count: int | None = None) -> list[Path]:
    """grid.csv, grid.md and grid.png in sweep_dir (of the first job_count jobs, where given: collect); a broken plot
    still leaves the csv and md."""
    paths, _ = _write_grid(Path(sweep_dir), job_count)
    return paths


class GridCallback(Callback):
    """Writes the grid when a multirun ends; a broken job folder never fails the sweep."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            if config.task.name != "bench":
                return  # training and other sweeps have no bench figures to put side by side
            sweep_dir = Path(config.hydra.sweep.dir)
            if not sweep_dir.is_dir():
                log.warning("grid: sweep folder %s does not exist; no grid written", sweep_dir)
                return
            jobs = planned_jobs(config)  # None for another sweeper: its folder is checked as a whole (other_sweep)
            # job folders are numbered (and a number past the count an earlier sweep's) only under Hydra's default
            # subdir (what an unset one is): a user's ${data.batch_size} names them 32, 64, 128, all this sweep's
            subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir", NUMBERED_SUBDIR)
            numbered = subdir == NUMBERED_SUBDIR
            paths, rows = _write_grid(sweep_dir, len(jobs) if jobs is not None and numbered else None)
            log.info("grid: %s", ", ".join(str(p) for p in paths))
            spread = spread_table(rows)
            print(markdown_table(rows) + ("" if spread is None else f"\n\n{spread}"), flush=True)
        except Exception as e:  # the sweep's results are on disk either way; the grid is a convenience
            log.warning("grid: could not write the sweep's grid: %s: %s", type(e).__name__, e)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The jobs as a markdown table, best overall score first, failed/missing last."""
    header = ["job", "status", "samples/s", "step s", "step s pred.", "step err %", "peak MB", "peak MB pred.",
              "memory err %", "learned", "quality", "efficiency", "speed", "memory", "overall", "dir",
              "error"]  # fmt: skip
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if h in ("job", "status", "dir", "error") else "--:" for h in header) + "|",
    ]
    for r in ranked(rows):
        cells = [
            r["label"],
            r["status"],
            _num(r["bench/samples_per_s"]),
            _num(r["bench/step_s"]),
            _num(r["bench/predicted_step_s"]),
            _pct(r["bench/step_time_error"]),
            _num(r["bench/peak_memory_mb"]),
            _num(r["bench/predicted_memory_mb"]),
            _pct(r["bench/memory_error"]),
            _learned(r["bench/learned"], r["bench/learned_p"]),
            _num(r["bench/quality"]),
            *(_num(r[k]) for k in SCORE_KEYS),
            r["job"],
            _short(r["error"]),
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def spread_table(rows: list[dict[str, Any]]) -> str | None:
    """The jobs that differ only in their seed (`seed=0,1,2`: the same grid run again), one row each: how far
    measured step time and peak memory moved between the runs, and how far from the plan each run came. None
    when no job ran under two seeds."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(" ".join(o for o in r["label"].split() if not o.startswith("seed=")), []).append(r)
    groups = {label: runs for label, runs in groups.items() if len(runs) > 1}
    if not groups:
        return None
    header = ["job", "runs ok", "step s", "step err % per run", "peak MB", "memory err % per run", "learned"]
    lines = ["| " + " | ".join(header) + " |", "|---|--:|--:|---|--:|---|--:|"]
    for label, runs in groups.items():
        ok = [r for r in runs if r["status"] == "ok"]
        cells = [
            label or "(every job)",
            f"{len(ok)} of {len(runs)}",
            _spread([r["bench/step_s"] for r in ok]),
            ", ".join(_pct(r["bench/step_time_error"]) or "-" for r in ok),
            _spread([r["bench/peak_memory_mb"] for r in ok]),
            ", ".join(_pct(r["bench/memory_error"]) or "-" for r in ok),
            f"{sum(r['bench/learned'] is True for r in ok)} of {len(ok)}",
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    runs = [r for group in groups.values() for r in group if r["status"] == "ok"]
    summary = [
        _within_text(runs, "bench/step_time_error", STEP_TIME_TARGET, "step time"),
        _within_text(runs, "bench/memory_error", 0.15, "peak memory"),
        *_slow_runs(runs, STEP_TIME_TARGET),
    ]
    return "\n".join([*lines, "", *summary])


def _slow_runs(runs: list[dict[str, Any]], target: float) -> list[str]:
    """The runs whose step time missed the plan, each with its step against the predictions (timed between its steps,
    or just before them where the bench timed no windows: a large model's, timed again just after them, and the plan's
    when the job started: which side a slow spell hit) and the cores it had where it measured them (CPU runs): a
    shared machine's neighbours and its hypervisor (steal) take cores for tens of seconds, which no prediction made
    before the run sees."""
    lines = []
    for r in runs:
        error = _finite(r["bench/step_time_error"])
        if error is None or abs(error) <= target:
            continue
        step, before = _finite(r.get("bench/step_s")), _finite(r.get("bench/predicted_step_s"))
        timed = ""
        if step and before:
            planned_s = _finite(r.get("bench/plan_predicted_step_s"))
            after_s = _finite(r.get("bench/timed_after_step_s"))
            between = bool(_finite(r.get("bench/timing_windows")))  # suite.run times a large model's just before
            when = f", {_num(after_s)} timed just after {'them' if between else 'it'}" if after_s else ""
            when += f", {_num(planned_s)} when the job was planned" if planned_s else ""
            how = "timed between its steps" if between else "timed just before it"
            timed = f" ({_num(step)} s a step against {_num(before)} {how}{when})"
        share, planned = _finite(r.get("bench/cpu_share_measured")), _finite(r.get("bench/cpu_share_planned"))
        steal = _finite(r.get("bench/steal_cores"))
        had = f"; its threads ran {share:.0%} of the time" if share is not None else ""
        had += f" (planned {planned:.0%})" if share is not None and planned is not None else ""
        took = f"; the hypervisor took {steal:.2f} cores meanwhile (steal)" if steal is not None else ""
        lines.append(f"- {r['label']}: {_pct(error)}{timed}{had}{took}.")
    return (
        ["", f"Outside {target:.0%}: each run's step against its predictions, and the cores it had:", *lines]
        if lines
        else []
    )


def _spread(values: list[Any]) -> str:
    """The median, and the range when the runs differ: 0.231 (0.214-0.262)."""
    finite = sorted(f for v in values if (f := _finite(v)) is not None)
    if not finite:
        return ""
    median = statistics.median(finite)
    return _num(median) if finite[0] == finite[-1] else f"{_num(median)} ({_num(finite[0])}-{_num(finite[-1])})"


def _within_text(runs: list[dict[str, Any]], key: str, target: float, what: str) -> str:
    errors = [f for r in runs if (f := _finite(r[key])) is not None]
    if not errors:
        return f"No run measured its {what} against the plan."
    worst = max(errors, key=abs)
    inside = sum(abs(e) <= target for e in errors)
    return (
        f"{what.capitalize()} within {target:.0%} of the plan in {inside} of {len(errors)} runs (worst {_pct(worst)})."
    )


def ranked(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ok jobs by overall score (descending, unscored after scored), then failed, then missing."""

    def key(item: tuple[int, dict[str, Any]]) -> tuple:
        i, r = item
        overall = _finite(r["score/overall"])
        status_rank = {"ok": 0, "running": 1, "failed": 2, "crashed": 2, "missing": 3}.get(r["status"], 2)
        return (status_rank, overall is None, -(overall or 0.0), i)

    return [r for _, r in sorted(enumerate(rows), key=key)]


def _write_grid(sweep_dir: Path, job_count: int | None) -> tuple[list[Path], list[dict[str, Any]]]:
    rows = collect(sweep_dir, job_count)
    paths = [_write_csv(sweep_dir / "grid.csv", rows), _write_md(sweep_dir / "grid.md", sweep_dir, rows)]
    try:
        paths.append(_write_png(sweep_dir / "grid.png", sweep_dir, rows))
    except Exception as e:
        log.warning("grid: could not draw grid.png: %s: %s", type(e).__name__, e)
    return paths, rows


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    columns = list(COLUMNS)
    for r in rows:  # whatever else the jobs reported goes after the known columns
        columns += [k for k in r if k not in columns]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: _csv_value(r.get(k)) for k in columns})
    return path


def _write_md(path: Path, sweep_dir: Path, rows: list[dict[str, Any]]) -> Path:
    summary = _counts_text(rows) + "."
    text = f"# Benchmark grid: {sweep_dir.name}\n\n{summary}\n\n{EXPLANATION}\n\n{markdown_table(rows)}\n"
    spread = spread_table(rows)
    if spread is not None:
        text += f"\n## The same jobs under each seed\n\n{SPREAD_EXPLANATION}\n\n{spread}\n"
    path.write_text(text)
    return path


def _write_png(path: Path, sweep_dir: Path, rows: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display; set before pyplot is imported
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig = plt.figure(figsize=(14, 6))
    try:
        if ok:
            left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.3]})
            _scatter(left, ok)
            _score_bars(right, ranked(rows))
            fig.suptitle(f"Benchmark grid: {sweep_dir.name}  ({_counts_text(rows)})")
            fig.tight_layout()
        else:
            fig.text(0.5, 0.55, "no successful jobs", ha="center", va="center", fontsize=24)
            fig.text(0.5, 0.42, _counts_text(rows), ha="center", va="center", fontsize=13, color="dimgray")
            fig.suptitle(f"Benchmark grid: {sweep_dir.name}")
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return path


def _scatter(ax: Any, ok: list[dict[str, Any]]) -> None:
    points = [
        (x, y, r)
        for r in ok
        if (x := _finite(r["bench/peak_memory_mb"])) is not None
        and (y := _finite(r["bench/samples_per_s"])) is not None
    ]
    ax.set_xlabel("peak memory, measured (MB)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title("Throughput against peak memory (up and left is better)")
    ax.grid(True, alpha=0.3)
    if not points:
        ax.text(
            0.5,
            0.5,
            "no job measured both\nthroughput and peak memory",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        return
    strategies = sorted({str(r["strategy"] or "unknown") for _, _, r in points})
    palette = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666"]
    colours = {s: palette[i % len(palette)] for i, s in enumerate(strategies)}  # Dark2, unlike the score bars
    for s in strategies:
        mine = [(x, y) for x, y, r in points if str(r["strategy"] or "unknown") == s]
        ax.scatter(
            [x for x, _ in mine],
            [y for _, y in mine],
            s=60,
            color=colours[s],
            label=s,
            zorder=3,
            edgecolor="black",
            linewidth=0.5,
        )
    ax.margins(x=0.15, y=0.2)
    if ax.get_xlim()[0] < 0:  # neither memory nor throughput goes below zero
        ax.set_xlim(left=0)
    if ax.get_ylim()[0] < 0:
        ax.set_ylim(bottom=0)
    _annotate(ax, [(x, y, _point_label(r)) for x, y, r in points])
    ax.legend(title="strategy", fontsize=9, loc="best")


def _point_label(row: dict[str, Any]) -> str:
    """The row's label without the strategy, which the point's colour already shows."""
    shown = [o for o in row["label"].split() if not o.startswith("strategy=")]
    return " ".join(shown) or row["label"]


def _annotate(ax: Any, points: list[tuple[float, float, str]]) -> None:
    """Labels beside their points, each at the first of a few places that overlaps no label placed before it."""
    renderer = ax.figure.canvas.get_renderer()
    middle = sum(ax.get_xlim()) / 2
    placed: list[Any] = []
    for x, y, text in sorted(points, key=lambda p: -p[1]):
        side = -1 if x > middle else 1  # point inwards, so labels stay inside the axes
        for dx, dy in ((7, 5), (7, -12), (7, 16), (7, -23), (7, 27)):
            note = ax.annotate(
                text,
                (x, y),
                xytext=(side * dx, dy),
                textcoords="offset points",
                ha="left" if side > 0 else "right",
                fontsize=8,
                alpha=0.85,
            )
            box = note.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                break
            note.remove()
        else:
            note = ax.annotate(
                text,
                (x, y),
                xytext=(side * 7, 5),
                textcoords="offset points",
                ha="left" if side > 0 else "right",
                fontsize=8,
                alpha=0.85,
            )
        placed.append(note.get_window_extent(renderer))


def _score_bars(ax: Any, rows: list[dict[str, Any]]) -> None:
    n = len(rows)
    width = 0.8 / len(SCORE_KEYS)
    values = [v for r in rows for k in SCORE_KEYS if (v := _finite(r[k])) is not None]
    positive = [v for v in values if v > 0]
    log_scale = bool(positive) and len(positive) == len(values) and max(positive) / min(positive) > 100
    for j, key in enumerate(SCORE_KEYS):
        xs, hs = [], []
        for i, r in enumerate(rows):
            if r["status"] == "ok" and (v := _finite(r[key])) is not None:
                xs.append(i + (j - (len(SCORE_KEYS) - 1) / 2) * width)
                hs.append(v)
        if not hs:
            continue
        bars = ax.bar(xs, hs, width=width, label=SCORE_NAMES[key], color=f"C{j}", zorder=3)
        if n <= 8:
            ax.bar_label(bars, labels=[_num(h) for h in hs], fontsize=7, rotation=90, padding=2)
    if log_scale:
        ax.set_yscale("log")
    if not values:
        ax.text(0.5, 0.85, "no job reported scores", ha="center", va="center", transform=ax.transAxes, color="dimgray")
    ax.set_ylim(top=ax.get_ylim()[1] * (3 if log_scale else 1.15))  # room for the bar labels
    for i, r in enumerate(rows):
        note = (
            r["status"]
            if r["status"] != "ok"
            else ("no scores" if values and all(_finite(r[k]) is None for k in SCORE_KEYS) else None)
        )
        if note:
            ax.axvspan(i - 0.4, i + 0.4, color="lightgray", alpha=0.35, zorder=1)
            ax.text(
                i,
                0.5,
                note,
                ha="center",
                va="center",
                rotation=90,
                fontsize=11,
                color="firebrick" if r["status"] != "ok" else "dimgray",
                transform=ax.get_xaxis_transform(),
            )
    ax.set_xticks(range(n))
    ax.set_xticklabels([r["label"].replace(" ", "\n") for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylabel("score (higher is better)" + (", log scale" if log_scale else ""))
    ax.set_title("Scores per job, best overall first")
    ax.grid(True, axis="y", alpha=0.3, zorder=0)
    if values:
        ax.legend(fontsize=9, ncols=4, loc="upper right")


def _read_overrides(job: Path) -> dict[str, str]:
    """Override key -> the override as written (`model=phi4_tiny`); empty when unreadable."""
    try:
        items = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []
        if not isinstance(items, list):
            raise ValueError(f"expected a list, found {type(items).__name__}")
    except Exception as e:
        log.warning("grid: unreadable %s: %s", job / ".hydra" / "overrides.yaml", e)
        return {}
    return {str(o).split("=", 1)[0]: str(o) for o in items}


def _read_metrics(job: Path) -> tuple[dict[str, Any], str, str | None]:
    path = job / "metrics.json"
    if not path.is_file():
        return {}, "missing", "no metrics.json: the job never started"
    try:
        metrics = json.loads(path.read_text())
        if not isinstance(metrics, dict):
            raise ValueError(f"expected an object, found {type(metrics).__name__}")
    except Exception as e:
        log.warning("grid: unreadable %s: %s", path, e)
        return {}, "missing", f"unreadable metrics.json: {e}"
    status = state(metrics)
    metrics.pop("status", None)
    error = metrics.pop("error", None)
    if status == "crashed":  # a `running` record whose process is gone: SIGKILL, out of memory, a machine down
        step = metrics["steps"]
        error = (
            f"crashed: the job stopped without a record{f' after step {step}' if step else ''} (killed?); "
            "a resumed sweep runs it again"
        )
    return metrics, status, error


def _labels(overrides: dict[str, dict[str, str]]) -> dict[str, str]:
    """Each job's overrides that differ across the sweep; all of them when none differ."""
    keys = {k for given in overrides.values() for k in given}
    varying = {k for k in keys if len({given.get(k) for given in overrides.values()}) > 1}
    labels = {}
    for job, given in overrides.items():
        shown = [o for k, o in given.items() if k in varying] if varying else list(given.values())
        labels[job] = " ".join(shown) or job
    return labels


def _is_job(d: Path) -> bool:
    try:
        return d.is_dir() and (d / ".hydra" / "overrides.yaml").is_file()
    except OSError as e:  # e.g. a folder we may not read: leave it out, keep the others
        log.warning("grid: unreadable %s: %s", d, e)
        return False


def _of_sweep(d: Path, job_count: int | None) -> bool:
    """Whether a job folder may be this sweep's: any when its count is unknown, or the folder is not named by number."""
    return job_count is None or not d.name.isdigit() or int(d.name) < job_count


def _job_order(d: Path) -> tuple:
    return (0, int(d.name), "") if d.name.isdigit() else (1, 0, d.name)


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _num(v: Any) -> str:
    """Three significant figures or so, thousands separated: 0.514, 15.6, 612, 1,548."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if not isinstance(v, float):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _pct(v: Any) -> str:
    f = _finite(v)
    return "" if f is None else f"{f * 100:+.1f}%"


def _learned(learned: Any, p: Any) -> str:
    if learned is None:
        return ""
    text = _num(learned) if isinstance(learned, bool) else str(learned)
    return text if _finite(p) is None else f"{text} (p={_finite(p):.2g})"


def _short(text: Any) -> str:
    if text is None:
        return ""
    text = " ".join(str(text).split())
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 1] + "…"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _csv_value(v: Any) -> Any:
    if isinstance(v, list | dict):
        return json.dumps(v)
    return "" if v is None else v


def _counts_text(rows: list[dict[str, Any]]) -> str:
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "running", "failed", "crashed", "missing")}
    parts = [f"{n} {s}" for s, n in counts.items() if n or s in ("ok", "failed", "missing")]
    return f"{len(rows)} job{'' if len(rows) == 1 else 's'}: " + ", ".join(parts)
