"""Graph datasets for Lightning: graphs held in memory, batched by torch_geometric's `Batch`.

level=graph: every split is a list of graphs; a training batch is `Batch.from_data_list` of batch_size graphs in
a seeded shuffled order (onn.data.resident.ResidentBatches' order and its mid-epoch resume: a run killed
mid-epoch goes on from the batch after its last one). level=node: one graph, and each split is that graph with
the indices of the split's nodes; every step sees the whole graph, the loss and metrics only the split's nodes.
The graph is collated once and held on the compute device, its tensors shared by the three splits: collated
and copied at every step, a graph of 500,000 nodes took 60 ms of host time a step before any copy.

Batches are (Batch, labels): what the shared classifier (onn.training.classifier) takes apart as (x, labels).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator

import lightning as L
import torch

from onn.config.data import GraphData
from onn.data.files import same_path
from onn.data.resident import (
    ResidentBatches,
    class_order,
    epoch_generator,
    evaluated_ranks,
    held_out_indices,
    held_out_share,
    relabelled,
    split_of,
    trainer_ranks,
    untrained_classes,
)
from onn.errors import UserError
from onn.modalities.graph.builtin import COMMUNITIES, PRIMITIVES, communities, primitive_graphs
from onn.modalities.graph.read import HELP, Graphs, read_source

log = logging.getLogger("onn")
NODE_SPLITS = ("train", "val", "test")


class GraphSplit:
    """One split's graphs (as ResidentBatches reads a Split: its length and, per batch, an index), and for a
    node-level split its one batch, collated and on the compute device (`resident`)."""

    def __init__(self, graphs: list, names: list[str], resident: tuple | None = None):
        self.graphs, self.names, self.resident = graphs, names, resident

    def __len__(self) -> int:
        return len(self.graphs)

    def subset(self, index: torch.Tensor) -> GraphSplit:
        return GraphSplit([self.graphs[i] for i in index.tolist()], [self.names[i] for i in index.tolist()])


def node_labels(y: torch.Tensor, where: str) -> torch.Tensor:
    """A node-level graph's y as int64 class numbers, -1 for a node without a label (as infer reads it)."""
    if y.is_floating_point() or y.is_complex():
        raise UserError(
            f"{where}: its y is {str(y.dtype).removeprefix('torch.')}; data.level=node needs integer class numbers "
            "(0, 1, ..., and -1 for a node without a label): save y as int64."
        )
    y = y.long().reshape(-1)
    if (y < -1).any():
        i = int((y < -1).nonzero()[0])
        raise UserError(
            f"{where}: node {i} has y {int(y[i])}; give class numbers 0, 1, ... and -1 for a node without a label."
        )
    return y


def every_graph(found: dict[str, Graphs]) -> Graphs:
    """Every split of a source as one: task=eval scores all of a data.source the command line gives (it sets
    data.val_source to it: onn.app.score_all_given), its train/ and test/ folders alike, as resident.every_split
    joins an image source's. Its skipped files are counted with data.source's own read."""
    parts = list(found.values())
    return Graphs([g for p in parts for g in p.graphs], parts[0].classes, [n for p in parts for n in p.names], [])


def as_batch(graphs: list) -> tuple:
    """(Batch, labels) of graphs and their graph labels (a node-level split's batch is made once: _setup_nodes)."""
    from torch_geometric.data import Batch

    batch = Batch.from_data_list(graphs)
    return batch, batch.y.view(-1)


def evaluated_nodes(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of this process's contiguous share of a node-level evaluation split's n nodes, each node scored
    by one process; fewer nodes than processes: one each (ResidentBatches._evaluated_share's rule)."""
    if n and n < world:  # every process needs a batch: DDP's first evaluation forward syncs its buffers
        return rank % n, rank % n + 1
    return rank * n // world, (rank + 1) * n // world


class GraphBatches(ResidentBatches):
    """ResidentBatches' seeded order and resumable position, over graphs collated by torch_geometric.

    Under DDP, graph-level splits are shared out as ResidentBatches shares samples. A node-level split is one graph:
    every process trains on the whole of it (each must convolve every node for any node's logits, so a share of
    the training nodes' loss would save no work, and DDP's mean of the alike gradients is one process's), and an
    evaluation split's nodes are cut into contiguous shares, each node scored by one process."""

    def __iter__(self) -> Iterator[tuple]:
        graphs = self.split.graphs
        if self.epoch_of is not None:
            self.epoch = self.epoch_of()
        # a restored place holds for the epoch it was saved in only, as ResidentBatches' does
        skip = self._skip if self.epoch == self._skip_epoch else 0
        self._current, self._taken, self._skip = self.epoch, skip, 0
        if self.shuffle:
            generator = epoch_generator(self.seed, self.epoch)
            batches = self._batches(torch.randperm(len(self.split), generator=generator))
            self.epoch += 1
        else:
            start, end = self._evaluated_share()
            batches = list(torch.arange(start, end).split(self.batch_size))
        for index in batches[self._taken :]:
            self._taken += 1
            yield self._resident() if self.split.resident is not None else as_batch([graphs[i] for i in index.tolist()])

    def _resident(self) -> tuple:
        """A node-level split's one batch: whole in training, this process's share of the nodes in evaluation."""
        batch, labels = self.split.resident
        if self.shuffle or self.world == 1:
            return batch, labels
        start, end = evaluated_nodes(len(labels), self.rank, self.world)
        shared = copy.copy(batch)  # the share's nodes beside the graph's shared tensors
        shared.nodes = batch.nodes[start:end]
        return shared, labels[start:end]


class GraphDataModule(L.LightningDataModule):
    """train / val / test graphs of a graph source (the attributes the shared classifier tasks read)."""

    # a classifier learns two classes or more; 1 where a checkpoint's classes are known (task=eval of a folder of
    # some of them: classification.trained_data sets it, as for ClassificationData)
    min_classes = 2
    held_out_by_name = False  # as ClassificationData's: whether setup drew graphs into val by HELD_OUT_RULE

    def __init__(self, data_cfg: GraphData, device: str = "cpu", seed: int = 0, score_all: bool = False):
        """`score_all`: task=eval scores every graph of its given data.source (modality.scores_whole_graph); a
        training run whose data.val_source names data.source validates on its val/ folder alone."""
        super().__init__()
        self.cfg, self.seed, self.device = data_cfg, seed, torch.device(device)
        self.score_all = score_all
        self.batch_size = int(data_cfg.batch_size)
        self.eval_batch_size = int(data_cfg.eval_batch_size or 2 * data_cfg.batch_size)
        self.splits: dict[str, GraphSplit] = {}
        self.classes: list[str] = []
        self.skipped: list[str] = []
        self.streamed = None  # graphs are always held in memory
        self.scored_on_training: list[str] = []  # data.val_source/test_source whose split is the training data

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (int(self.splits["train"].graphs[0].num_node_features),)

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        source = self.cfg.source
        if not source:
            raise UserError(f"data.source is not set: point it at a folder of graphs; {HELP}.")
        if self.cfg.level == "node":
            self._setup_nodes(str(source))
        else:
            self._setup_graphs(str(source))
        if len(self.classes) < self.min_classes:
            raise UserError(
                f"data.source {source} has {len(self.classes)} class ({', '.join(self.classes) or 'none'}): "
                "a classifier needs two or more; add the other classes' folders (or labels)."
            )
        widths: dict[int, str] = {}  # a graph of each width, named: which file differs
        for split in self.splits.values():
            for graph, name in zip(split.graphs, split.names):
                widths.setdefault(graph.num_node_features, name)
        if len(widths) > 1:
            named = ", ".join(f"{name}'s {width}" for width, name in sorted(widths.items()))
            raise UserError(
                f"data.source {source}: its graphs' nodes have different numbers of features ({named}); "
                "every graph needs the same number (x [nodes, features])."
            )
        sizes = ", ".join(f"{k} {len(v)}" for k, v in self.splits.items())
        log.info("data: %s graphs (level=%s), %d classes", sizes, self.cfg.level, len(self.classes))

    def read(self, source: str, key: str) -> dict[str, Graphs]:
        cfg = self.cfg
        if source == PRIMITIVES:
            return primitive_graphs(cfg.builtin, cfg.align, int(cfg.max_nodes), self.seed)
        return read_source(
            source,
            align=cfg.align,
            max_nodes=int(cfg.max_nodes),
            max_bad_fraction=float(cfg.max_bad_fraction),
            key=key,
        )

    def _setup_graphs(self, source: str) -> None:
        sets = self.read(source, "data.source")
        for split, other in (("val", self.cfg.val_source), ("test", self.cfg.test_source)):
            if other:
                found = self.read(str(other), f"data.{split}_source")
                scores_all = split == "val" and self.score_all  # task=eval of a given data.source
                sets[split] = every_graph(found) if scores_all else split_of(found, split)
                # data.source itself, without a split folder of that name: the very graphs trained on
                trained = split_of(found, "train", fallback=False)
                if same_path(str(other), source) and (scores_all or sets[split] is trained):
                    self.scored_on_training.append(f"data.{split}_source")
        train = sets.pop("train", None) or sets.pop("all", None)
        if train is None and self.score_all:  # task=eval of a folder of test/ alone
            train = sets["val"]  # (its classes and node features, as a source without split folders gives)
        if train is None or not train.graphs:
            raise UserError(f"data.source={source} has no training graphs (found splits: {', '.join(sets) or 'none'}).")
        sets["train"] = train
        self.classes = class_order(train.classes, self.cfg)
        self.skipped = [s for v in sets.values() for s in v.skipped]
        for name, found in sets.items():
            key = "data.source" if name == "train" else f"data.{name}_source"
            labels = relabelled(found.labels, found.classes, self.classes, key)
            outside = ((labels < 0) | (labels >= len(self.classes))).nonzero()
            if len(outside):
                i = int(outside[0])
                raise UserError(
                    f"{found.names[i]} in {key} has class number {int(labels[i])}, outside the "
                    f"{len(self.classes)} classes; fix its y or set data.num_classes."
                )
            for graph, label in zip(found.graphs, labels.tolist()):
                graph.y = torch.tensor([label])
            if name in ("train", "val", "test"):
                self.splits[name] = GraphSplit(found.graphs, found.names)
        if "val" not in self.splits:
            self.splits["train"], self.splits["val"] = self._hold_out(self.splits["train"])

    def _hold_out(self, train: GraphSplit) -> tuple[GraphSplit, GraphSplit]:
        """A seeded validation split taken from train: each graph is held out when its held_out_share (a hash of the
        seed and its name) is under data.val_split, so one seed holds out the same graphs however many others are
        added, removed or fail to read (a seeded shuffle of positions re-drew the whole split then: a resumed run or
        task=eval validated on graphs it had trained on), as ClassificationData._held_out holds out files. As there,
        the model trains on every class it is validated on: a class drawn into val whole keeps its highest-drawn
        graph (a class of one graph was, for some seeds, validated on only). At least one graph is held out: when
        none drew under val_split, the lowest-drawn of a class that keeps another; where every class has one graph,
        none can be held out without its class, and the lowest-drawn goes (warned as untrained)."""
        fraction = float(self.cfg.val_split)
        n_val = max(1, round(len(train) * fraction))
        if not 0 < fraction < 1:
            raise UserError(f"data.val_split={fraction}: give a fraction between 0 and 1 that leaves training graphs.")
        if n_val >= len(train):  # one graph: no fraction of it leaves any (the old sentence blamed the fraction)
            raise UserError(
                f"data.source has {len(train)} training graph{'s' if len(train) > 1 else ''} and data.val_split="
                f"{fraction} holds out {n_val} for validation, leaving none to train on: add graphs, give a smaller "
                "data.val_split or a data.val_source (one graph whose nodes are classified: data.level=node)."
            )
        labels = [int(graph.y) for graph in train.graphs]  # the class numbers _setup_graphs gave
        share = [held_out_share(self.seed, name) for name in train.names]
        kept, val = held_out_indices(labels, share, fraction)
        self.held_out_by_name = True
        kept_at, val_at = (torch.tensor(part, dtype=torch.long) for part in (kept, val))
        untrained = untrained_classes(
            self.classes, {"train": torch.tensor(labels)[kept_at], "val": torch.tensor(labels)[val_at]}
        )
        if untrained:  # every class has one graph: the one held out is never trained on
            log.warning(untrained)
        return train.subset(kept_at), train.subset(val_at)

    def _setup_nodes(self, source: str) -> None:
        """One graph with per-node labels y; each split is the graph with its mask (generated where missing)."""
        if source == COMMUNITIES:
            graph, name = communities(self.cfg.builtin, self.seed), COMMUNITIES
        else:
            found = read_source(
                source, align=self.cfg.align, max_nodes=int(self.cfg.max_nodes), max_bad_fraction=0.0, level="node"
            )
            graphs = [(g, n) for s in found.values() for g, n in zip(s.graphs, s.names)]
            if len(graphs) != 1 or "node_y" not in graphs[0][0]:
                raise UserError(
                    f"data.source {source}: data.level=node reads one .safetensors graph with y [nodes] "
                    "(and optional train_mask/val_mask/test_mask); "
                    + (f"it holds {len(graphs)} graphs." if len(graphs) != 1 else f"{graphs[0][1]} holds no y.")
                )
            ((graph, name),) = graphs
            graph.y = node_labels(graph.node_y, f"{name} in data.source")
            del graph.node_y
        found_classes = [str(i) for i in range(int(graph.y.max()) + 1)]
        self.classes = class_order(found_classes, self.cfg)
        if self.cfg.val_source:  # task=eval of a given graph (modality.scores_whole_graph): all its labelled nodes
            labelled = graph.y >= 0
            masks = {"train": labelled, "val": labelled, "test": torch.zeros_like(labelled)}
            if str(self.cfg.val_source) == source or same_path(str(self.cfg.val_source), source):
                self.scored_on_training.append("data.val_source")
        else:
            masks = self._node_masks(graph, f"{name} in data.source")
        for key in ("train_mask", "val_mask", "test_mask"):
            if key in graph:
                del graph[key]
        whole, _ = as_batch([graph])
        whole = whole.to(self.device)
        for split in NODE_SPLITS:
            if masks[split].any():
                # indices, not a mask: selecting by a boolean mask on a GPU reads the mask back at every step
                nodes = masks[split].nonzero().view(-1)
                batch = copy.copy(whole)  # the split's nodes beside the shared tensors
                batch.nodes = nodes.to(self.device)
                self.splits[split] = GraphSplit([graph], [name], resident=(batch, graph.y[nodes].to(self.device)))

    def _node_masks(self, graph, where: str) -> dict[str, torch.Tensor]:
        """Each split's nodes: the graph's own train/val/test masks where it has them; a missing val or test mask
        seeded (data.val_split of the labelled nodes each, drawn from those no given mask holds), a missing train
        mask the labelled rest. A node without a label (y -1) is in no split: it is only convolved."""
        n, labelled = graph.num_nodes, graph.y >= 0
        masks: dict[str, torch.Tensor] = {}
        for split in NODE_SPLITS:
            if f"{split}_mask" in graph:
                mask = graph[f"{split}_mask"].reshape(-1)
                if mask.numel() != n:
                    raise UserError(f"{where}: its {split}_mask has {mask.numel()} entries for its {n} nodes.")
                masks[split] = mask.bool() & labelled
        free = labelled.clone()  # the labelled nodes no mask holds yet
        for mask in masks.values():
            free &= ~mask
        seeded = [split for split in ("val", "test") if split not in masks]
        if seeded:
            fraction = float(self.cfg.val_split)
            if not 0 < fraction < 1:
                raise UserError(
                    f"data.val_split must be between 0 and 1 (got {fraction}): it seeds the {seeded[0]} nodes."
                )
            pool = free.nonzero().view(-1)
            order = pool[torch.randperm(len(pool), generator=torch.Generator().manual_seed(self.seed))]
            n_val = max(1, round(int(labelled.sum()) * fraction))
            for i, split in enumerate(seeded):
                masks[split] = torch.zeros(n, dtype=torch.bool)
                masks[split][order[i * n_val : (i + 1) * n_val]] = True
                free &= ~masks[split]
        masks.setdefault("train", free)
        for split, verb in (("train", "train on"), ("val", "validate on")):
            if not masks[split].any():
                held = " and ".join(f"{s} {int(masks[s].sum())}" for s in NODE_SPLITS if s != split)
                raise UserError(
                    f"{where}: no node is left to {verb}: {int(labelled.sum())} of its {n} nodes have a label "
                    f"(y >= 0) and the other splits take {held} (data.val_split={self.cfg.val_split}); "
                    f"give it a {split}_mask, or a smaller data.val_split."
                )
        return masks

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        """To a GPU from pinned memory, without waiting: Lightning moves a torch_geometric Batch by the Batch's
        own `to`, which copies each of its tensors blocking, and a blocking copy to the GPU waits for every
        kernel queued before it (five or six waits a step)."""
        graphs, labels = batch
        if device.type != "cuda" or labels.device == device:  # a node-level split is there already
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        return graphs.pin_memory().to(device, non_blocking=True), labels.pin_memory().to(device, non_blocking=True)

    # -- loaders ----------------------------------------------------------------------------------
    def train_dataloader(self):
        if self.scored_on_training:  # task=eval of a given data.source sets data.val_source to it, and trains nothing
            log.warning(
                "%s is data.source itself (%s): the model is scored on the %s it trains on, so those figures "
                "measure memorising, not held-out accuracy; unset it to hold out data.val_split of data.source, "
                "or point it at other data",
                " and ".join(self.scored_on_training),
                self.cfg.source,
                "nodes" if self.cfg.level == "node" else "graphs",
            )
            self.scored_on_training = []
        rank, world = trainer_ranks(self.trainer)
        return GraphBatches(
            self.splits["train"],
            self.batch_size,
            shuffle=True,
            seed=self.seed,
            drop_last=self.cfg.level == "graph",
            epoch_of=(lambda: self.trainer.current_epoch) if self.trainer is not None else None,
            rank=rank,
            world=world,
        )

    def val_dataloader(self):
        return self._evaluated("val")

    def test_dataloader(self):
        return self._evaluated("test") if self.has_test() else []

    def _evaluated(self, split: str) -> GraphBatches:
        """A held-out split's batches: under DDP this process's share (graphs, or a node-level split's nodes), each
        scored once, as ClassificationData._evaluated gives; whole on every process under a fraction of the batches
        (trainer.limit_val_batches=0.4), whose count Lightning keeps per process."""
        rank, world = evaluated_ranks(self.trainer, split)
        return GraphBatches(self.splits[split], self.eval_batch_size, shuffle=False, rank=rank, world=world)

    def has_test(self) -> bool:
        return "test" in self.splits
