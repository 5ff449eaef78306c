"""task=bench_serve: the server under load, measured through its own HTTP API (recipes/bench_serve.yaml).

serve/batching_speedup      `requests` greedy requests sent at once against the same requests one after
                            another (the time for all to finish); with a layer-streamed model every chunk
                            load serves every sequence of a step, so this nears `requests`
serve/concurrent_over_single  the time for all of them at once against one request alone
serve/ttft_p50_ms, _p99_ms  `clients` clients x `requests_per_client` streamed requests: time to the first token
serve/token_p50_ms, _p99_ms the time between tokens (one chunk per token)
serve/p50_ms, serve/p99_ms  the whole request
serve/errors                requests that did not end in a complete stream (status, [DONE])
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from onn.config import ONNConfig
from onn.config.task import BenchServeTask
from onn.errors import UserError
from onn.modalities import Job
from onn.tasks.serve.task import build_app, model_name
from onn.tasks.serve.task import check as serve_check

log = logging.getLogger("onn")
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def fibonacci(n):", "Roses are red,",
           "The quick brown fox", "In 1969, the first", "To make bread, you"]  # fmt: skip


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank: the ceil(q/100 * n)-th smallest) in ms of values in seconds; None
    without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered) / 100))  # q * n first: 99 / 100 * 100 is 99.00000000000001
    return round(1000 * ordered[min(rank, len(ordered)) - 1], 2)


def check_settings(config: ONNConfig) -> None:
    """serve.* and task.* before the model is built: a count under 1 or more tokens than the server gives failed
    only once the server ran (an IndexError, an HTTP 400, a thread pool's ValueError)."""
    serve_check(config)
    task: BenchServeTask = config.task
    for key in ("requests", "max_tokens", "clients", "requests_per_client", "load_max_tokens"):
        value = getattr(task, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"task.{key}={value!r}: give a whole number, 1 or more.")
    most = config.serve.max_tokens
    for key in ("max_tokens", "load_max_tokens"):
        if getattr(task, key) > most:
            raise UserError(
                f"task.{key}={getattr(task, key)} is over serve.max_tokens={most}, the most the server generates: "
                f"lower task.{key} or raise serve.max_tokens."
            )


class _EngineClock:
    """The streaming engine's weight wait, compute and chunk loads over each phase (none unstreamed)."""

    def __init__(self, engine):
        self.engine, self.figures = engine, {}
        self.mark = self._now()

    def _now(self) -> tuple[float, float, int]:
        t = self.engine.times if self.engine is not None else None
        return (t.io_s, t.compute_s, t.loads) if t is not None else (0.0, 0.0, 0)

    def phase(self, name: str) -> None:
        now = self._now()
        if self.engine is not None:
            self.figures.update(
                {
                    f"serve/{name}_io_wait_s": round(now[0] - self.mark[0], 3),
                    f"serve/{name}_compute_s": round(now[1] - self.mark[1], 3),
                    f"serve/{name}_chunk_loads": now[2] - self.mark[2],
                }
            )
        self.mark = now


def run(job: Job) -> dict[str, Any]:
    import httpx2

    from onn.tasks.serve.server import Running

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # a line per request otherwise
    task: BenchServeTask = job.config.task
    name = model_name(job.config)
    app = build_app(job)
    engine = app.state.scheduler.lm.engine
    with Running(app, "127.0.0.1", 0) as running:
        http = httpx2.Client(base_url=running.url, timeout=600, limits=httpx2.Limits(max_connections=256))
        out = _one_by_one_and_together(http, name, task.requests, task.max_tokens, engine)
        out["serve/widest_batch"] = running.app.state.scheduler.widest
        out.update(_load(http, name, task.clients, task.requests_per_client, task.load_max_tokens))
        http.close()
    out.update(
        {
            "serve/streamed": engine is not None,
            "serve/store": engine.store.kind if engine is not None else None,
        }
    )
    print(
        " ".join(f"{k}={v}" for k, v in out.items() if isinstance(v, int | float) and not isinstance(v, bool)),
        flush=True,
    )
    return out


def _one_by_one_and_together(http, name: str, n: int, tokens: int, engine) -> dict[str, Any]:
    """`n` greedy completions one after another, then all at once: the batching's speedup, and whether each
    text is the one it gives alone."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]

    def complete(prompt: str, max_tokens: int) -> dict[str, Any]:
        body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        response = http.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()

    complete(prompts[0], 2)  # warm-up: the first chunk loads, thread pools start
    clock = _EngineClock(engine)
    start, alone = time.perf_counter(), []
    for p in prompts:
        t = time.perf_counter()
        alone.append(complete(p, tokens))
        alone_s = time.perf_counter() - t
    sequential_s = time.perf_counter() - start
    clock.phase("sequential")
    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        together = list(pool.map(lambda p: complete(p, tokens), prompts))
    concurrent_s = time.perf_counter() - start
    clock.phase("concurrent")
    same = sum(a["choices"][0]["text"] == b["choices"][0]["text"] for a, b in zip(alone, together))
    print(
        f"{n} requests of {tokens} tokens: one by one {sequential_s:.2f} s, together {concurrent_s:.2f} s "
        f"(x{sequential_s / concurrent_s:.2f}); {same}/{n} identical texts",
        flush=True,
    )
    return {
        "serve/batching_speedup": round(sequential_s / concurrent_s, 3),
        "serve/concurrent_over_single": round(concurrent_s / (sequential_s / n), 3),
        "serve/sequential_s": round(sequential_s, 3),
        "serve/concurrent_s": round(concurrent_s, 3),
        "serve/last_alone_s": round(alone_s, 3),
        "serve/requests_together": n,
        "serve/tokens_per_request": tokens,
        "serve/concurrent_tokens": sum(r["usage"]["completion_tokens"] for r in together),
        "serve/identical_to_alone": same,
        **clock.figures,
    }


def _load(http, name: str, clients: int, per_client: int, max_tokens: int) -> dict[str, Any]:
    """`clients` threads, each sending `per_client` streamed chat requests one after another."""
    ttft, gaps, totals, errors = [], [], [], []
    lock = threading.Lock()

    def one(client: int, i: int) -> None:
        body = {
            "model": name,
            "messages": [{"role": "user", "content": f"{PROMPTS[(client + i) % len(PROMPTS)]} #{client}"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        start = last = time.perf_counter()
        first, between, done = None, [], False
        try:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"status {response.status_code}")
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
                    if "content" in delta and "role" not in delta:  # one chunk per token (its text may be empty)
                        now = time.perf_counter()
                        if first is None:
                            first = now - start
                        else:
                            between.append(now - last)
                        last = now
            if not done or first is None:
                raise RuntimeError("the stream ended without a token and [DONE]")
        except Exception as e:
            with lock:
                errors.append(f"{type(e).__name__}: {e}")
            return
        with lock:
            totals.append(time.perf_counter() - start)
            ttft.append(first)
            gaps.extend(between)

    def client_loop(client: int) -> None:
        for i in range(per_client):
            one(client, i)

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client_loop, range(clients)))
    wall = time.perf_counter() - start
    if errors:
        log.warning("bench_serve: %d failed requests, e.g. %s", len(errors), errors[0])
    return {
        "serve/clients": clients,
        "serve/load_requests": clients * per_client,
        "serve/errors": len(errors),
        "serve/ttft_p50_ms": percentile(ttft, 50),
        "serve/ttft_p99_ms": percentile(ttft, 99),
        "serve/token_p50_ms": percentile(gaps, 50),
        "serve/token_p99_ms": percentile(gaps, 99),
        "serve/p50_ms": percentile(totals, 50),
        "serve/p99_ms": percentile(totals, 99),
        "serve/load_s": round(wall, 3),
        "serve/load_requests_per_s": round(len(totals) / wall, 3) if wall else None,
        "serve/mean_ms": round(1000 * statistics.fmean(totals), 2) if totals else None,
    }
