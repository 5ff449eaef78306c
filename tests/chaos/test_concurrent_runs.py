"""Faults on purpose: two runs started into the same run folder, and two processes building the same layer
store. The second run is refused in one sentence naming the holder and writes nothing into the folder; the
second build waits for the first and then finds its blocks whole. A holder killed with SIGKILL frees the
folder at once (the kernel drops its lock)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from onn.hardware.locks import try_hold
from onn.streaming.store import LayerStore

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_run_into_a_busy_folder_is_refused_and_a_killed_holder_frees_it(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from onn.hardware.locks import try_hold; "
         "assert try_hold(sys.argv[1]) is not None; print('held', flush=True); time.sleep(600)", str(folder)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.run(
            [sys.executable, "run.py", "task=plan", f"hydra.run.dir={folder}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == 1
        error = second.stderr.strip().splitlines()
        assert error == [
            f"error: hydra.run.dir={folder} is in use by process {holder.pid}, a run still going; wait for it to "
            "end or choose another folder."
        ]
        assert sorted(p.name for p in folder.iterdir()) == [".onn.lock"]  # no config, log or metrics.json written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    fd = try_hold(folder)  # the dead holder's lock is gone with it
    assert fd is not None
    os.close(fd)


def test_a_second_layer_store_build_waits_for_the_first_and_rewrites_nothing(tmp_path, caplog):
    folder = tmp_path / "store"
    blocks = {i: {"w": torch.full((8, 8), float(i))} for i in range(3)}
    first = LayerStore("disk", "bfloat16", folder=folder)
    first.fill(blocks)
    fd = try_hold(folder)  # a first build still going
    second = LayerStore("disk", "bfloat16", folder=folder)
    caplog.set_level(logging.INFO, logger="onn.streaming.store")
    builder = threading.Thread(target=second.fill, args=(blocks,))
    builder.start()
    deadline = time.monotonic() + 60
    while "waiting" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "another process is building it; waiting" in caplog.text and builder.is_alive()
    os.close(fd)  # the first build ends
    builder.join(60)
    assert not builder.is_alive() and second.rebuilt == []
    assert torch.equal(second.read(2)["w"].float(), blocks[2]["w"])
