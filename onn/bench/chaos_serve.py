"""bench_chaos's server part: `task=serve` in a process of its own, under clients that vanish, time out or send
malformed requests, beside clients whose greedy answers must equal the ones the server gives alone.

Each request's kind is seeded: `drop_share` of them close the stream after its first chunk or give up after
a few milliseconds, `malformed_share` send a body the API must refuse (not JSON, no messages, a wrong type)
and get a 4xx in OpenAI's error shape, the rest must be answered in full and exactly. The server's resident
memory is read after `requests` requests and again after `more_requests` more; when the load ends, /health
must show no row decoding and no request queued (a slot a vanished client left behind would stay).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from onn.bench.serve import PROMPTS
from onn.config.task import ChaosServer
from onn.errors import UserError

RUN_PY = Path(__file__).resolve().parents[2] / "run.py"
MALFORMED = [b"this is not JSON", b'{"messages": "not a list"}', b'{"messages": [], "max_tokens": "four"}']


def run(settings: ChaosServer, folder: Path, seed: int) -> dict[str, Any]:
    import httpx2
    import psutil

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # a line per request otherwise
    server, url = _start(settings, folder)
    try:
        http = httpx2.Client(base_url=url, timeout=120, limits=httpx2.Limits(max_connections=settings.clients + 8))
        name = http.get("/v1/models").json()["data"][0]["id"]
        alone = {p: _answer(http, name, p, settings.max_tokens) for p in PROMPTS}
        rng = random.Random(seed)
        kinds = [_kind(rng, settings) for _ in range(settings.requests + settings.more_requests)]
        first = _load(http, name, kinds[: settings.requests], alone, settings)
        rss_first = psutil.Process(server.pid).memory_info().rss
        more = _load(http, name, kinds[settings.requests :], alone, settings)
        rss_more = psutil.Process(server.pid).memory_info().rss
        left = _idle(http)
        http.close()
    finally:
        stop(server)
    counts = {k: first[k] + more[k] for k in first}
    return {
        "chaos/server/requests": settings.requests + settings.more_requests,
        "chaos/server/clients": settings.clients,
        **{f"chaos/server/{k}": v for k, v in counts.items()},
        "chaos/server/rss_mb_after_first": round(rss_first / 2**20, 1),
        "chaos/server/rss_mb_after_all": round(rss_more / 2**20, 1),
        "chaos/server/rss_growth": round(rss_more / rss_first - 1, 4),
        "chaos/server/left_in_batch": left,
    }


def _start(settings: ChaosServer, folder: Path) -> tuple[subprocess.Popen, str]:
    """The server on a free port; its URL once it says it is serving."""
    folder.mkdir(parents=True, exist_ok=True)
    console = folder / "server.console.txt"
    with open(console, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, str(RUN_PY), "task=serve", "serve.port=0", *settings.overrides, f"hydra.run.dir={folder}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"},
            start_new_session=True,
        )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        said = re.search(r"^serving .* on (http://[^\s:]+:\d+)", console.read_text(errors="replace"), re.M)
        if said:
            return server, said.group(1)
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):  # the whole group: what the server started goes with it
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()
    raise UserError(f"bench_chaos: the server did not start; its console ends: {console.read_text()[-600:]!r}")


def stop(server: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after grace_s: a server that ignored SIGTERM (a stuck
    handler) ended the bench in TimeoutExpired's traceback and was left running."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def _kind(rng: random.Random, settings: ChaosServer) -> str:
    roll = rng.random()
    if roll < settings.malformed_share:
        return "malformed"
    if roll < settings.malformed_share + settings.drop_share:
        return rng.choice(["vanishes", "times out"])
    return rng.choice(["streamed", "whole"])


def _body(name: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": name, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def _answer(http, name: str, prompt: str, max_tokens: int) -> str:
    response = http.post("/v1/chat/completions", json=_body(name, prompt, max_tokens, False))
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def _streamed(http, name: str, prompt: str, max_tokens: int, vanish: bool) -> str | None:
    """The streamed answer's text; None when the client vanished after the first chunk."""
    text = []
    with http.stream("POST", "/v1/chat/completions", json=_body(name, prompt, max_tokens, True)) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if vanish:
                return None  # the with-block closes the connection mid-stream
            if line == "data: [DONE]":
                return "".join(text)
            if line.startswith("data: "):
                choices = json.loads(line[6:])["choices"]
                text.append(choices[0]["delta"].get("content") or "" if choices else "")
    raise RuntimeError("the stream ended without [DONE]")


def _one(http, name: str, kind: str, i: int, alone: dict[str, str], settings: ChaosServer) -> str:
    """What became of one request: answered (right or wrong), refused (a malformed one), or gone."""
    import httpx2

    prompt = PROMPTS[i % len(PROMPTS)]
    if kind == "malformed":
        body = MALFORMED[i % len(MALFORMED)]
        r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        return "refused" if 400 <= r.status_code < 500 and "error" in r.json() else "misrefused"
    if kind == "times out":
        try:
            http.post("/v1/chat/completions", json=_body(name, prompt, 64, False), timeout=0.005)
        except httpx2.TimeoutException:
            return "gone"
        return "gone"  # answered within the deadline after all: still a client that did not wait for more
    if kind == "vanishes":
        _streamed(http, name, prompt, 64, vanish=True)
        return "gone"
    if kind == "streamed":
        text = _streamed(http, name, prompt, settings.max_tokens, vanish=False)
    else:
        text = _answer(http, name, prompt, settings.max_tokens)
    return "right" if text == alone[prompt] else "wrong"


def _load(http, name: str, kinds: list[str], alone: dict[str, str], settings: ChaosServer) -> dict[str, int]:
    counts = {"right": 0, "wrong": 0, "refused": 0, "misrefused": 0, "gone": 0, "errors": 0}
    lock, queue = threading.Lock(), iter(enumerate(kinds))

    def client() -> None:
        while True:
            with lock:
                item = next(queue, None)
            if item is None:
                return
            i, kind = item
            try:
                outcome = _one(http, name, kind, i, alone, settings)
            except Exception:  # noqa: BLE001 - a request that should have been answered and was not
                outcome = "errors"
            with lock:
                counts[outcome] += 1

    with ThreadPoolExecutor(settings.clients) as pool:
        for _ in range(settings.clients):
            pool.submit(client)
    return counts


def _idle(http, wait_s: float = 30.0) -> int:
    """Rows decoding and requests queued once the load is over (0 and 0 unless a slot leaked)."""
    deadline = time.monotonic() + wait_s
    while True:
        health = http.get("/health").json()
        left = int(health["active"]) + int(health["waiting"])
        if left == 0 or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
