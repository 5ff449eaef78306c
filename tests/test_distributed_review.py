"""The distributed review's second round: DeepSpeed's checkpoint copied to the host by the rank that writes it only,
and AdaBN (task.adapt_norm) combined over DDP's ranks and measured under the evaluation's precision."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import ROOT
from test_training_review2 import OPTIM, image_batches, pooled_cnn  # noqa: F401 -- the ranks' script imports them from here


def norm_statistics(network: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in network.state_dict().items() if "running_" in k or "num_batches" in k}


def two_ranks(script: str, *args: str, env: dict[str, str] | None = None) -> list[dict]:
    """`script` run by two CPU processes in one gloo group (rank as its first argument); each one's last line, read
    as JSON. Both go on even if one fails, so a hang is bounded by the timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r), *args],
            env={**base, **(env or {}), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [r.communicate(timeout=180) for r in ranks]
    for r, (stdout, stderr) in zip(ranks, outs):
        assert r.returncode == 0 and stdout.strip(), stderr[-3000:]
    return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outs]


_DEEPSPEED_RANK = """
import json, os, resource, sys
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment

rank, folder = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2)
import deepspeed
from onn.training.checkpoint_io import SafetensorsCheckpointIO
from onn.training.distributed import ShardedDeepSpeed

torch.manual_seed(0)
with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "train_batch_size": 2}):
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(32)])  # 128 MB, partitioned
environment = LightningEnvironment()
environment.set_world_size(2)
environment.set_global_rank(rank)
strategy = ShardedDeepSpeed(stage=3, cluster_environment=environment)
strategy._lightning_module = model  # what Lightning's Trainer attaches
strategy.checkpoint_io = SafetensorsCheckpointIO()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
strategy.save_checkpoint({"state_dict": {}, "epoch": 1}, os.path.join(folder, "weights.ckpt"))
rise_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
dist.barrier()
print(json.dumps({"rank": rank, "rise_mb": rise_mb}))
dist.destroy_process_group()
"""


@pytest.mark.slow  # two fresh interpreters import deepspeed and set up a process group: ~15 s on two shared cores
@pytest.mark.skipif(not find_spec("deepspeed"), reason="ZeRO-3's partitioned weights need deepspeed")
def test_deepspeed_checkpoint_copies_the_whole_weights_to_the_host_on_rank_0_only(tmp_path: Path):
    """ShardedDeepSpeed.save_checkpoint gathered every weight whole at once and copied it to the host on every rank,
    though rank 0 alone writes it: 8 GPUs on a node, 8 host copies of the model (a 14B model: 8 x 28 GB). Each
    weight is gathered in turn and only rank 0 keeps a copy: two gloo processes on the CPU (DeepSpeed's CPU
    accelerator: a gathered weight lives in host memory), ZeRO-3 over a 128 MB model; rank 1's peak host memory
    rises by a weight or two, not by the model, and rank 0 writes the whole weights."""
    from onn.training.checkpoints import load

    # MALLOC_MMAP_THRESHOLD_: freed weights go back to the system at once, so the peak is what was held together
    env = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "MALLOC_MMAP_THRESHOLD_": "65536"}
    outs = two_ranks(_DEEPSPEED_RANK, str(tmp_path), env=env)
    model_mb = 32 * (1024 * 1024 + 1024) * 4 / 2**20
    assert outs[1]["rise_mb"] < model_mb / 4, outs  # gathering all at once and copying: about the model's 128 MB
    torch.manual_seed(0)
    want = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(32)]).state_dict()
    saved = load(tmp_path / "weights.ckpt")
    assert saved["epoch"] == 1 and set(saved["state_dict"]) == set(want)
    for key, value in want.items():
        assert torch.equal(saved["state_dict"][key], value), key


_ADABN_RANK = """
import json, sys
import torch
import torch.distributed as dist
sys.path.insert(0, "tests")
from test_distributed_review import OPTIM, image_batches, norm_statistics, pooled_cnn
from onn.training.classifier import Classifier

rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
network = pooled_cnn()
batches = image_batches([4, 4, 4, 4, 4])[rank::2]  # rank 0 three batches, rank 1 two, as a sampler shares them out
seen = Classifier(network, ["a", "b"], OPTIM, {}).adapt_batch_norm(batches)
print(json.dumps({"seen": seen, **{k: v.tolist() for k, v in norm_statistics(network).items()}}))
dist.destroy_process_group()
"""


@pytest.mark.slow  # two fresh interpreters import torch and Lightning and set up a process group: ~15 s
def test_adabn_under_ddp_gives_every_rank_the_statistics_of_all_batches():
    """Under DDP each rank measured AdaBN's statistics on its own share of the test batches, so each rank evaluated
    a different model (and rank 0 saved its own alone). After measuring, the ranks' statistics are combined: both
    ranks hold what one process measuring all five batches holds, rank 0's three weighing as three."""
    from onn.training.classifier import Classifier

    outs = two_ranks(_ADABN_RANK)
    network = pooled_cnn()
    assert Classifier(network, ["a", "b"], OPTIM, {}).adapt_batch_norm(image_batches([4, 4, 4, 4, 4])) == 20
    for key, want in norm_statistics(network).items():
        for out in outs:
            torch.testing.assert_close(torch.tensor(out[key], dtype=want.dtype), want, msg=key)
    assert [out["seen"] for out in outs] == [20, 20]  # the samples measured by both ranks


class Measured(L.Callback):
    """The norms' statistics AdaBN measured, read as the test ends (before the module puts the trained ones back)."""

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.statistics = norm_statistics(pl_module.model)


def test_adabn_measures_under_the_evaluations_precision():
    """AdaBN ran outside Lightning's precision context: under bf16-mixed its convolution ran in float32 while the
    test's ran in bf16 under autocast, so the norms normalised inputs other than those they were measured on. It
    measures through the precision plugin's forward context now: the first norm's statistics are the means of the
    autocast convolution's outputs, not of float32's."""
    from onn.training.classifier import Classifier

    network = pooled_cnn()
    batches = image_batches([16, 16, 16], shift=20.0)
    measured = Measured()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        callbacks=[measured],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Classifier(network, ["a", "b"], OPTIM, {}, adapt_norm=True)
    trainer.test(module, dataloaders=torch.utils.data.DataLoader(batches, batch_size=None), verbose=False)

    def means(autocast: bool) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return torch.stack([network[0](x).float().mean((0, 2, 3)) for x, _ in batches]).mean(0)

    got = measured.statistics["1.running_mean"]
    in_autocast, in_float32 = means(autocast=True), means(autocast=False)
    assert (in_autocast - in_float32).abs().max() > 1e-3  # bf16's rounding shows in the statistics
    torch.testing.assert_close(got, in_autocast, rtol=0, atol=1e-4)
