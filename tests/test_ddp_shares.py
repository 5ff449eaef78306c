"""Paired and graph data under DDP, and the classifier's batches per process.

Paired data and graph data are held in memory (ResidentBatches, no DataLoader), so Lightning gave them no
DistributedSampler: every process trained on the same batches (the steps of one process, twice the work) and
scored every held-out graph, so the confusion matrix counted each twice. The classifier counted its training
batches before the trainer existed, as one process holding all the data: trainer.val_check_interval was capped
at twice a process's batches, and a one-epoch run under two processes never validated."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import compose, run_cli
from test_distributed_review import two_ranks
from test_vision_train import make_images

from onn.modalities.graph.dataset import GraphBatches, GraphDataModule
from onn.modalities.pairs.demo import write_shapes

PAIRS = (
    "data=pairs", "model=dual_encoder", "data.batch_size=2", "data.eval_batch_size=4", "data.val_split=0.25",
    "data.sides.image.image_size=[16,16]", "data.sides.text.max_length=32", "model.feature_dim=16",
    "model.embed_dim=8", "optim.warmup_steps=0",
)  # fmt: skip


def pair_data(source: Path, cache: Path, *overrides: str):
    """The paired data of `source` (12 shapes: 8 to train on, 4 held out by their names' draw), set up."""
    from onn.modalities.pairs.data import PairData
    from onn.modalities.pairs.tasks import sides_of

    config = compose(*PAIRS, f"data.source={source}", f"paths.cache={cache}", *overrides)
    dm = PairData(config, sides_of(config), "cpu")
    dm.setup()
    return config, dm


def test_paired_data_counts_one_processs_share_before_the_trainer_exists(tmp_path: Path):
    """The training batches counted before the trainer exists (the val_check_interval cap, the schedule's length)
    are one process's share of the 8 training pairs under trainer.devices=2: 4 pairs, 2 batches of 2 (4 alone)."""
    shapes = write_shapes(tmp_path / "shapes", 12, seed=0, size=16)
    _, one = pair_data(shapes, tmp_path / "cache")
    _, two = pair_data(shapes, tmp_path / "cache", "trainer.devices=2")
    assert len(one.splits["train"]) == 8 and len(one.train_dataloader()) == 4
    loader = two.train_dataloader()
    assert len(loader) == len(list(loader)) == 2


def test_graph_evaluation_shares_score_each_graph_and_each_node_once():
    """Two processes' evaluation batches: the held-out graphs, and a node-level split's nodes, each in one share
    only (together all of them); a node-level graph trains whole on every process."""
    graphs = GraphDataModule(compose("data=graph", "data.source=builtin:primitives").data)
    graphs.setup()
    for split, batch in ((graphs.splits["val"], 2), (graphs.splits["train"], 5)):
        for i, graph in enumerate(split.graphs):
            graph.ident = torch.tensor([i])
        shares = [
            [i for b, _ in GraphBatches(split, batch, False, rank=r, world=2) for i in b.ident.tolist()] for r in (0, 1)
        ]
        assert sorted(shares[0] + shares[1]) == list(range(len(split))) and len(shares[0]) == len(split) // 2
    nodes = GraphDataModule(compose("data=graph", "data.source=builtin:communities", "data.level=node").data)
    nodes.setup()
    held = nodes.splits["val"].resident[0].nodes
    shares = [
        [b.nodes for b, _ in GraphBatches(nodes.splits["val"], 64, shuffle=False, rank=r, world=2)] for r in (0, 1)
    ]
    assert [len(s) for s in shares] == [1, 1]
    assert torch.equal(torch.cat([shares[0][0], shares[1][0]]), held) and 0 < len(shares[0][0]) < len(held)
    trained = [next(iter(GraphBatches(nodes.splits["train"], 64, True, rank=r, world=2)))[0].nodes for r in (0, 1)]
    assert torch.equal(trained[0], nodes.splits["train"].resident[0].nodes) and torch.equal(trained[0], trained[1])


def test_a_streamed_loaders_batches_per_process_are_distributed_samplers():
    """A streamed split's batches per process are those a DataLoader under Lightning's DistributedSampler gives
    each of two processes (drop_last off for a share under a batch, as ClassificationData._loader sets it)."""
    from torch.utils.data import DataLoader, DistributedSampler

    from onn.modalities.classification import process_batches

    for n, batch in ((27, 4), (9, 4), (7, 4)):
        data = list(range(n))
        drop_last = -(-n // 2) >= batch
        sampled = DataLoader(data, batch, sampler=DistributedSampler(data, 2, 0), drop_last=drop_last)
        assert process_batches(DataLoader(data, batch, shuffle=True, drop_last=n >= batch), 2) == len(sampled)


_PAIRS_RANK = """
import json, sys
import lightning as L
import torch
sys.path.insert(0, "tests")
from test_ddp_shares import pair_data
from onn.modalities.pairs.tasks import build
from onn.training.trainer import data_parallel
from conftest import compose

rank, source, cache, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
config, dm = pair_data(source, cache, "trainer.devices=2")
counted = len(dm.train_dataloader())  # before the trainer exists
rows = dm.splits["train"].inputs.flatten(1)


class Seen(L.Callback):
    def __init__(self):
        self.pairs = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        for row in batch[0].flatten(1):
            self.pairs.append(int((rows == row).all(1).nonzero()[0]))


seen = Seen()
trainer = L.Trainer(
    accelerator="cpu", devices=2, max_epochs=1, callbacks=[seen], logger=False, num_sanity_val_steps=0,
    strategy=data_parallel("ddp", compose("strategy=ddp", "trainer.devices=2"), "cpu"),
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
module = build(config, dm.sides)
module.held_out_groups = dm.val_groups
trainer.fit(module, datamodule=dm)
validated = trainer.validate(module, datamodule=dm, verbose=False)[0]
if rank == 0:
    torch.save(module.state_dict(), folder + "/pairs.pt")
print(json.dumps({"counted": counted, "steps": trainer.global_step, "pairs": seen.pairs, "validated": validated}))
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow  # two fresh interpreters set up a gloo group and train an epoch: ~30 s
def test_paired_data_trains_each_process_on_its_own_half_and_validates_as_one(tmp_path: Path):
    """Two processes on 8 training pairs in batches of 2: each trained the same 4 batches (one process's steps);
    now each trains 2 batches of its own half of the epoch (the halves disjoint), as many as counted before the
    trainer existed, and the held-out recall each logs is one process's on the same weights."""
    from onn.modalities.pairs.tasks import build

    shapes = write_shapes(tmp_path / "shapes", 12, seed=0, size=16)
    outs = two_ranks(_PAIRS_RANK, str(shapes), str(tmp_path / "cache"), str(tmp_path))
    assert [out["steps"] for out in outs] == [out["counted"] for out in outs] == [2, 2]
    assert [len(out["pairs"]) for out in outs] == [4, 4] and not set(outs[0]["pairs"]) & set(outs[1]["pairs"])

    config, dm = pair_data(shapes, tmp_path / "cache")
    module = build(config, dm.sides)
    module.held_out_groups = dm.val_groups
    module.load_state_dict(torch.load(tmp_path / "pairs.pt", weights_only=True))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    one = trainer.validate(module, datamodule=dm, verbose=False)[0]
    for out in outs:
        assert out["validated"].keys() == one.keys() and "val/recall@1" in one
        for key, value in one.items():
            assert out["validated"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


_GRAPHS_RANK = """
import json, sys
import lightning as L
import torch
sys.path.insert(0, "tests")
from conftest import compose
from test_ddp_shares import graph_classifier
from onn.training.trainer import data_parallel

rank, folder = int(sys.argv[1]), sys.argv[2]


class Seen(L.Callback):
    def __init__(self):
        self.graphs = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.graphs += batch[0].ident.tolist()


def trainer(callbacks=()):
    return L.Trainer(
        accelerator="cpu", devices=2, max_epochs=1, callbacks=list(callbacks), logger=False, num_sanity_val_steps=0,
        strategy=data_parallel("ddp", compose("strategy=ddp", "trainer.devices=2"), "cpu"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )


out = {}
for level in ("graph", "node"):
    dm, module = graph_classifier(level)
    seen = Seen()
    fitted = trainer([seen] if level == "graph" else [])
    fitted.fit(module, datamodule=dm)
    validated = fitted.validate(module, datamodule=dm, verbose=False)[0]
    if rank == 0:
        torch.save(module.state_dict(), f"{folder}/{level}.pt")
    out[level] = {"steps": fitted.global_step, "graphs": seen.graphs, "validated": validated,
                  "scored": int(module.confusion["val"].sum())}
print(json.dumps(out))
torch.distributed.destroy_process_group()
"""


def graph_classifier(level: str):
    """Set-up graph data (each training graph numbered in `ident`) and a fresh classifier for it."""
    from onn.modalities import get
    from onn.modalities.graph.tasks import GraphClassifier

    source = "builtin:primitives" if level == "graph" else "builtin:communities"
    model = "model=gin" if level == "graph" else "model=gcn"
    cfg = compose("data=graph", f"data.source={source}", f"data.level={level}", model, "model.hidden=8",
                  "data.batch_size=8", "data.eval_batch_size=8")  # fmt: skip
    dm = GraphDataModule(cfg.data)
    dm.setup()
    for i, graph in enumerate(dm.splits["train"].graphs):
        graph.ident = torch.tensor([i])
    torch.manual_seed(0)
    inputs = {"input_shape": dm.input_shape, "classes": dm.classes, "level": level}
    return dm, GraphClassifier(get("graph").network(cfg.model, inputs), dm.classes, cfg.optim, {})


@pytest.mark.slow  # two fresh interpreters set up a gloo group and train two epochs: ~30 s
def test_graph_data_is_shared_over_ddp_processes(tmp_path: Path):
    """Graph-level: each process trains on its own half of the training graphs (every graph of the epoch, padded
    to equal shares, was trained by both), and each held-out graph is scored once (the confusion matrix counted
    each twice). Node-level: each held-out node scored once. The figures are one process's on the same weights."""
    outs = two_ranks(_GRAPHS_RANK, str(tmp_path))
    dm, _ = graph_classifier("graph")
    trained = len(dm.splits["train"])
    graphs = [out["graph"]["graphs"] for out in outs]
    assert [len(g) for g in graphs] == [out["graph"]["steps"] * 8 for out in outs] == [(trained + 1) // 2 // 8 * 8] * 2
    assert not set(graphs[0]) & set(graphs[1])
    for level in ("graph", "node"):
        dm, module = graph_classifier(level)
        module.load_state_dict(torch.load(tmp_path / f"{level}.pt", weights_only=True))
        one = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        figures = one.validate(module, datamodule=dm, verbose=False)[0]
        held = len(dm.splits["val"]) if level == "graph" else len(dm.splits["val"].resident[1])
        assert int(module.confusion["val"].sum()) == held
        for out in outs:
            assert out[level]["scored"] == held
            assert out[level]["validated"]["val/acc"] == pytest.approx(figures["val/acc"])
            assert out[level]["validated"]["val/loss"] == pytest.approx(figures["val/loss"], rel=1e-5)


@pytest.mark.slow  # a 2-process run through the runner (Lightning's launcher runs the command again): ~40 s
def test_two_processes_validate_at_the_end_of_their_share_of_an_epoch(tmp_path: Path):
    """27 training images in batches of 4 under trainer.devices=2: 3 batches a process. val_check_interval=6 was
    capped at the one-process count (6), above a process's 3 batches, so the one-epoch run never validated (no
    history, no best checkpoint); the cap is a process's batches now, and it validates after its 3 steps."""
    images = make_images(tmp_path / "images", train=12, test=4)
    run_dir = tmp_path / "outputs" / "run"
    proc = run_cli(
        "model=v28_cnn", "data=image", f"data.source={images}", "data.batch_size=4", "data.val_split=0.25",
        "trainer.max_epochs=1", "trainer.val_check_interval=6", "trainer.devices=2", "tracking=none",
        "trainer.enable_progress_bar=false", f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}", timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["steps"] == 3
    assert [h["step"] for h in metrics["val/history"]] == [3] and metrics["checkpoint_best"]


def test_a_multi_device_strategy_on_automatic_devices_counts_every_visible_gpu(monkeypatch):
    """strategy=ddp (fsdp, deepspeed) with trainer.devices=auto starts a process per visible GPU (build_trainer leaves
    Lightning its `auto`): counted before the trainer exists as one process, a 4-GPU node's classifier capped its
    validation interval at all the data's batches, four times a process's, and a one-epoch run never validated."""
    from onn.training.trainer import processes

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # a 4-GPU node, as Lightning's `auto` would count it
    assert processes(compose("data=image", "strategy=ddp", "trainer.devices=auto")) == 4
    assert processes(compose("data=image", "strategy=ddp", "trainer.devices=auto", "trainer.num_nodes=2")) == 8
    assert processes(compose("data=image", "strategy=full", "trainer.devices=auto")) == 1  # one process, one device
