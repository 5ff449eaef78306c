"""What a benchmark's raw figures mean: did it learn, how good is it, and the equitable scores.

learned   A one-sided permutation test (scipy.stats.permutation_test) on the per-step training
          losses: under "nothing was learned", the steps of the first and the last fifth of the run
          are exchangeable, so the fall of the mean loss between them is compared with its
          distribution over every relabelling of those steps (all of them when there are at most
          20,000, else 20,000 seeded draws). `bench/learned` is true when p < 0.05 (task.learned_p) and the
          loss fell; `bench/learned_p` is the p-value.
quality   In [0, 1]. Language modelling: the relative fall of held-out loss over the run,
          (before - after) / before, floored at 0 (task.quality=loss_fall), or the exact-match
          rate of greedy answers on held-out data that has answers (task.quality=exact_match).
scores    ONN's equitable scores: efficiency = quality / parameters x 1e10,
          speed = samples_per_s / batch_size x 100, memory = available / peak x 100,
          overall = the weighted mean of those three (task.score_weights).
"""

from __future__ import annotations

from typing import Any

MAX_RELABELLINGS = 20_000


def learned(losses: list[float], alpha: float = 0.05) -> tuple[bool, float | None]:
    """(learned, p) for a run's per-step losses; (False, None) with fewer than 10 steps, or where the fifths
    compared hold a loss that is not finite (a run that diverged): scipy gives a NaN statistic a p of 0.

    scipy's permutation test of the first fifth's mean against the last fifth's, one-sided: every
    relabelling when there are at most MAX_RELABELLINGS, else that many seeded draws."""
    import numpy as np
    from scipy.stats import permutation_test

    fifth = len(losses) // 5
    if fifth < 2:
        return False, None
    first, last = np.asarray(losses[:fifth], dtype=float), np.asarray(losses[-fifth:], dtype=float)
    if not (np.isfinite(first).all() and np.isfinite(last).all()):
        return False, None
    result = permutation_test(
        (first, last),
        lambda a, b, axis: a.mean(axis=axis) - b.mean(axis=axis),
        permutation_type="independent",
        alternative="greater",
        vectorized=True,
        n_resamples=MAX_RELABELLINGS,
        rng=np.random.default_rng(0),
    )
    p = float(result.pvalue)
    return bool(result.statistic > 0 and p < alpha), p


def loss_fall(before: float | None, after: float | None) -> float | None:
    if before is None or after is None or not before > 0:
        return None
    return min(1.0, max(0.0, (before - after) / before))


def equitable(
    quality: float | None,
    params: int,
    samples_per_s: float | None,
    batch_size: int,
    available_mb: float | None,
    peak_mb: float | None,
    weights: dict[str, float],
) -> dict[str, Any]:
    """The four `score/*` keys (None where a figure is missing)."""
    scores = {
        "score/efficiency": quality / params * 1e10 if quality is not None and params else None,
        "score/speed": samples_per_s / batch_size * 100 if samples_per_s else None,
        "score/memory": available_mb / peak_mb * 100 if available_mb and peak_mb else None,
    }
    parts = [(float(weights.get(k.split("/")[1], 0.0)), v) for k, v in scores.items()]
    if any(v is None for w, v in parts if w) or not sum(w for w, _ in parts):
        scores["score/overall"] = None
    else:
        scores["score/overall"] = sum(w * v for w, v in parts if w) / sum(w for w, _ in parts)
    return {k: (round(v, 3) if v is not None else None) for k, v in scores.items()}
