"""What a run killed mid-epoch needs back to go on exactly: the resident loader's place in its epoch, the random
generators' states, and a schedule whose length is known without setting the data up before a restore (each
found by bench_chaos on image runs, whose resumed weights differed)."""

from __future__ import annotations

import random

import lightning as L
import numpy as np
import torch

from onn.data.resident import ResidentBatches, Split
from onn.training.callbacks import RandomState
from onn.training.trainer import optimizer_steps


def _split(n: int = 20) -> Split:
    return Split(torch.arange(n, dtype=torch.float32)[:, None], torch.arange(n), [str(i) for i in range(n)])


def test_a_resident_loader_resumed_mid_epoch_gives_the_rest_of_that_epoch_in_order():
    whole = ResidentBatches(_split(), batch_size=4, shuffle=True, seed=7)
    epochs = [[x.flatten().tolist() for x, _ in whole] for _ in range(2)]
    first = ResidentBatches(_split(), batch_size=4, shuffle=True, seed=7)
    list(first)  # epoch 0
    taken = iter(first)
    seen = [next(taken)[0].flatten().tolist() for _ in range(2)]  # two batches of epoch 1, then the kill
    state = first.state_dict()
    assert state == {"epoch": 1, "taken": 2} and seen == epochs[1][:2]
    resumed = ResidentBatches(_split(), batch_size=4, shuffle=True, seed=7, epoch_of=lambda: 1)
    resumed.load_state_dict(state)
    assert [x.flatten().tolist() for x, _ in resumed] == epochs[1][2:]
    assert resumed.state_dict() == {"epoch": 2, "taken": 0}  # an epoch given whole: the next one starts


def test_the_random_generators_come_back_when_training_starts():
    keeper = RandomState()
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    state = keeper.state_dict()
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(2), np.random.seed(2), random.seed(2)
    restored = RandomState()
    restored.load_state_dict(state)
    torch.rand(5)  # a resumed run's setup may draw before training starts
    restored.on_train_start(None, None)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.pairs: list[tuple[int | None, int]] = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_start(self):
        self.pairs.append((optimizer_steps(self.trainer, 10), int(self.trainer.estimated_stepping_batches)))
        self.trainer.should_stop = True


def test_the_schedule_length_is_lightnings_own_estimate(tmp_path):
    batches = torch.utils.data.DataLoader(torch.ones(10, 1), batch_size=1)  # 10 steps an epoch
    module = _Tiny()
    for max_steps, max_epochs, accumulate in ((-1, 3, 1), (-1, 3, 4), (7, 3, 1), (50, -1, 1)):
        trainer = L.Trainer(
            max_steps=max_steps,
            max_epochs=max_epochs,
            accumulate_grad_batches=accumulate,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(module, batches)
    assert [ours for ours, _ in module.pairs] == [lightnings for _, lightnings in module.pairs]
    assert [ours for ours, _ in module.pairs] == [30, 9, 7, 50]


def test_a_resident_loader_saved_at_an_epochs_end_resumes_at_the_next_epochs_start():
    whole = ResidentBatches(_split(), batch_size=4, shuffle=True, seed=7)
    epochs = [[x.flatten().tolist() for x, _ in whole] for _ in range(3)]
    first = ResidentBatches(_split(), batch_size=4, shuffle=True, seed=7)
    list(first), list(first)  # epochs 0 and 1, whole: the end of a run of trainer.max_epochs=2
    assert first.state_dict() == {"epoch": 2, "taken": 0}
    resumed = ResidentBatches(_split(), batch_size=4, shuffle=True, seed=7, epoch_of=lambda: 2)
    resumed.load_state_dict(first.state_dict())
    assert [x.flatten().tolist() for x, _ in resumed] == epochs[2]
    # a place within an epoch holds for that epoch only: a loader asked for a later one gives it whole
    later = ResidentBatches(_split(), batch_size=4, shuffle=True, seed=7, epoch_of=lambda: 2)
    later.load_state_dict({"epoch": 1, "taken": 5})
    assert [x.flatten().tolist() for x, _ in later] == epochs[2]


def test_a_graph_loaders_restored_place_holds_for_its_own_epoch_only():
    """GraphBatches restored its place without ResidentBatches' epoch check: a place saved 5 batches into epoch 1
    skipped 5 of epoch 2's batches when the run resumed there."""
    from torch_geometric.data import Data

    from onn.modalities.graph.dataset import GraphBatches, GraphSplit

    graphs = [
        Data(x=torch.full((2, 1), float(i)), edge_index=torch.tensor([[0], [1]]), y=torch.tensor([i]))
        for i in range(20)
    ]
    split = GraphSplit(graphs, [str(i) for i in range(20)])

    def firsts(loader) -> list[list[float]]:
        return [batch.x[::2, 0].tolist() for batch, _ in loader]

    whole = GraphBatches(split, batch_size=4, shuffle=True, seed=7)
    epochs = [firsts(whole) for _ in range(3)]
    later = GraphBatches(split, batch_size=4, shuffle=True, seed=7, epoch_of=lambda: 2)
    later.load_state_dict({"epoch": 1, "taken": 3})
    assert firsts(later) == epochs[2]
    same = GraphBatches(split, batch_size=4, shuffle=True, seed=7, epoch_of=lambda: 1)
    same.load_state_dict({"epoch": 1, "taken": 3})
    assert firsts(same) == epochs[1][3:]
