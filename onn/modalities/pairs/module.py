"""The dual-encoder LightningModule: two modality encoders, a symmetric contrastive loss, retrieval recall.

CLIP's recipe (Radford et al. 2021): each side's encoder (its modality's network, base.PairSide)
gives features, a linear projection maps them into one shared space, both are L2-normalised, and the
cosine similarities times a learnable logit scale (1 / temperature, clamped at model.max_logit_scale)
are scored with cross-entropy in both directions: row i of side A must pick row i of side B among
the batch, and the other way round.

Validation embeds every held-out pair and measures recall@1 and recall@5 in both directions over the
whole held-out set: the share of queries whose partner ranks within the first k. Ties go to the
earlier item, so a collapsed model that embeds everything alike scores chance (1 / pairs), not 1.
The scores are made a block of rows at a time (block_rows: a share of the plan's memory), so 30,000
held-out pairs do not hold 30,000 x 30,000 scores and their masks at once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from onn.config.model import DualEncoderConfig
from onn.config.run import OptimConfig
from onn.training.distributed import clip_gradients
from onn.training.module import ONNModule
from onn.training.optim import make_optimizer, make_schedule
from onn.training.record import EpochRecord, log_train_loss

LOOP = "pairs"
KS = (1, 5)
MONITOR = "val/recall@1"  # the mean of both directions' recall@1: picks checkpoints/best.ckpt
# device bytes per query-item score while ranking: the float32 score and the masks and counts made of it (ranks,
# top_matches: about 16), with the allocator's margin
SCORE_BYTES = 24
SCORE_SHARE = 0.25  # of the memory the plan leaves the run: what one block of scores may take, the rest the towers'


def block_rows(columns: int, budget_bytes: float) -> int:
    """How many rows of scores against `columns` items are made at once: SCORE_SHARE of `budget_bytes`, at least
    one row. 100,000 queries against 100,000 items are 40 GB of float32 scores at once, and twice that with the
    masks ranking makes of them."""
    return max(1, int(SCORE_SHARE * budget_bytes) // (max(1, columns) * SCORE_BYTES))


def ranks(
    similarity: torch.Tensor, partners: torch.Tensor | None = None, same: torch.Tensor | None = None
) -> torch.Tensor:
    """Where each row's partner (column partners[i], else column i) ranks among the row's columns, 0 = first;
    ties go to the lower column index, so alike scores rank a partner by its place, not first. Validation and
    task=infer's partner_rank both rank by this rule. `same` [rows, columns]: the columns that are as right as the
    partner (the other captions of its image); the best scored of them stands for it, and none of them counts."""
    rows = torch.arange(similarity.shape[0], device=similarity.device)
    partners = rows if partners is None else partners.to(similarity.device)
    if same is not None:  # the best of the partner's group, the lowest column of equal scores
        partners = similarity.masked_fill(~same, float("-inf")).argmax(1)
    right = similarity[rows, partners].unsqueeze(1)
    index = torch.arange(similarity.shape[1], device=similarity.device)
    ahead = (similarity > right) | ((similarity == right) & (index.unsqueeze(0) < partners.unsqueeze(1)))
    rank = (ahead if same is None else ahead & ~same).sum(1)
    # a partner scored NaN (a diverged model) compares below nothing and ranked first: such a model scored
    # recall@1 1.0 and became best.ckpt. It is found nowhere.
    return rank.masked_fill(right.squeeze(1).isnan(), similarity.shape[1])


def partner_ranks(
    a: torch.Tensor, b: torch.Tensor, rows: int, groups: torch.Tensor | None = None, backward: bool = False
) -> torch.Tensor:
    """ranks() of each row of a among b's rows (backward: of each row of b among a's), from the scores a @ b.T made
    `rows` rows at a time (backward: columns, read as rows), never whole. One block is the one matrix of before."""
    n = len(b) if backward else len(a)
    out = []
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        block = (a @ b[start:stop].T).T if backward else a[start:stop] @ b.T
        same = None if groups is None else alike(groups, start, stop)
        out.append(ranks(block, torch.arange(start, stop, device=block.device), same))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=a.device)


def alike(groups: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """[stop - start, n]: the pairs as right as each row's own partner, for rows start..stop. `groups` [n]: of one
    group (an image's captions); [n, sides]: sharing any side's number (PairData.val_groups: the other partners of
    the query's file, and the pairs of its partner's file), which is no chain (a-x, b-x, b-y: y is not a's)."""
    keys = groups.unsqueeze(1) if groups.dim() == 1 else groups
    return (keys[start:stop].unsqueeze(1) == keys.unsqueeze(0)).any(-1)


def retrieval_metrics(
    a: torch.Tensor,
    b: torch.Tensor,
    names: tuple[str, str],
    prefix: str,
    groups: torch.Tensor | None = None,
    rows: int | None = None,
) -> dict[str, float]:
    """recall@k of both directions and their mean, for aligned normalised embeddings a [n, d] and b [n, d].
    `groups` [n] or [n, sides] (alike): pairs that share a file (an image with several captions), so any caption of
    the image retrieved is right, as COCO's and Flickr30k's retrieval is scored; without, only the pair's own partner
    is.
    `rows`: the scores are made that many rows at a time (block_rows); None: all at once."""
    a, b = a.float(), b.float()
    rows = rows or max(1, len(a))
    out: dict[str, float] = {}
    for direction, backward in ((f"{names[0]}_to_{names[1]}", False), (f"{names[1]}_to_{names[0]}", True)):
        rank = partner_ranks(a, b, rows, groups, backward)
        for k in KS:
            out[f"{prefix}/recall@{k}/{direction}"] = float((rank < k).float().mean())
    for k in KS:
        out[f"{prefix}/recall@{k}"] = sum(v for key, v in out.items() if key.startswith(f"{prefix}/recall@{k}/")) / 2
    right = 1.0  # the items a random pick may hit: the pair's partner, or every item of its group
    if groups is not None:  # (counted `rows` rows at a time, as the scores are)
        right = sum(float(alike(groups, s, min(s + rows, len(a))).sum()) for s in range(0, len(a), rows)) / len(a)
    out[f"{prefix}/recall@1_chance"] = right / len(a)
    return out


def contrastive_loss(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """CLIP's symmetric cross-entropy of float32 unit embeddings a and b, the logits (scale * a) @ b.T made `rows`
    rows (then columns) at a time: each row's and each column's log-sum-exp less its partner's logit, averaged."""
    a = scale * a
    partner = (a * b).sum(1)
    by_row = [torch.logsumexp(a[s : s + rows] @ b.T, 1) for s in range(0, len(a), rows)]
    by_column = [torch.logsumexp(a @ b[s : s + rows].T, 0) for s in range(0, len(b), rows)]
    return ((torch.cat(by_row) - partner).mean() + (torch.cat(by_column) - partner).mean()) / 2


class DualEncoder(EpochRecord, ONNModule):
    loop = LOOP
    describes = "ONN's dual encoder"

    def __init__(
        self,
        towers: dict[str, nn.Module],
        width: int,
        model_cfg: DualEncoderConfig,
        optim: OptimConfig,
        onn_config: dict[str, Any],
    ):
        super().__init__()
        self.optimizer_steps: int | None = None  # the schedule's length, when the runner knows it (optimizer_steps)
        if len(towers) != 2:
            raise ValueError("a dual encoder has two towers")
        self.names = tuple(towers)
        self.towers = nn.ModuleDict(towers)
        dim = model_cfg.embed_dim
        self.projections = nn.ModuleDict({n: nn.Linear(width, dim, bias=False) for n in self.names})
        self.logit_scale = nn.Parameter(
            torch.tensor(math.log(1 / model_cfg.temperature)), requires_grad=model_cfg.learn_temperature
        )
        self.max_log_scale = math.log(model_cfg.max_logit_scale)
        self.optim = optim
        self.onn_config = onn_config  # plain values, stored in every checkpoint: eval/infer/export rebuild from it
        self.train_losses: list[torch.Tensor] = []
        self.history: list[dict[str, float]] = []
        self._held_out: dict[str, list[torch.Tensor]] = {n: [] for n in self.names}
        self.held_out_groups: torch.Tensor | None = None  # per held-out pair, its sides' files (PairData.val_groups)
        self.score_budget: float | None = None  # bytes the plan leaves the run (block_rows); None: one block
        self.last_metrics: dict[str, float] = {}

    # -- embedding ------------------------------------------------------------------------------------
    def embed(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """A stored batch of side `name` -> unit vectors in the shared space [B, embed_dim]."""
        return F.normalize(self.projections[name](self.towers[name](x)).float(), dim=-1)

    def scale(self) -> torch.Tensor:
        return self.logit_scale.clamp(max=self.max_log_scale).exp()

    def loss(self, a: torch.Tensor, b: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """CLIP's symmetric cross-entropy over the similarities of unit embeddings a and b, in float32: bf16-mixed's
        autocast would take the matmul to bf16, whose similarities near 1 are 0.004 apart (0.4 in a logit at
        max_logit_scale 100), and the training loss would not be the float32 one validation reports. `rows` below
        the pairs: the logits made that many rows at a time (contrastive_loss), as validation's whole set is."""
        with torch.autocast(a.device.type, enabled=False):
            if rows is not None and rows < len(a):
                return contrastive_loss(a.float(), b.float(), self.scale().float(), rows)
            logits = self.scale().float() * a.float() @ b.float().T
        target = torch.arange(a.shape[0], device=a.device)
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2

    # -- the steps --------------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x_a, x_b = batch
        loss = self.loss(self.embed(self.names[0], x_a), self.embed(self.names[1], x_b))
        self.record_step(loss, batch)
        # each rank's loss is over its own batch's pairs (no embeddings gathered): the figure is the ranks' mean
        if log_train_loss(self, loss, x_a.shape[0], over_ranks=True):
            # logged on the device, read by the loggers after the step: a float() here was a second wait for the GPU
            # inside the step (beside the loss's), and Lightning copied the number back to the device, blocking
            temperature = 1 / self.scale().detach()
            self.log("train/temperature", temperature, on_step=True, on_epoch=False, batch_size=x_a.shape[0])
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        for name, x in zip(self.names, batch):
            self._held_out[name].append(self.embed(name, x))

    def on_validation_epoch_end(self) -> None:
        a, b = (torch.cat(self._held_out[n]) for n in self.names)
        self._held_out = {n: [] for n in self.names}
        groups = self.held_out_groups  # (the first rows only in Lightning's sanity check)
        groups = None if groups is None else groups[: len(a)].to(a.device)
        rows = None if self.score_budget is None else block_rows(len(b), self.score_budget)
        figures = retrieval_metrics(a, b, self.names, "val", groups, rows)
        with torch.no_grad():
            figures["val/loss"] = float(self.loss(a, b, rows))
        self.last_metrics = figures
        # under DDP every process ranked the whole held-out set (PairData.val_dataloader): the figures are alike on
        # each, so their mean over the processes (sync_dist) is the one-process figure Lightning asks for
        self.log_dict({k: v for k, v in figures.items() if k != MONITOR and not k.endswith("chance")}, sync_dist=True)
        self.log(MONITOR, figures[MONITOR], prog_bar=True, sync_dist=True)
        if not self.trainer.sanity_checking:
            self.record_epoch(figures, [k for k in figures if not k.endswith("chance")])

    def on_before_optimizer_step(self, optimizer) -> None:
        clip_gradients(self, optimizer, self.optim.clip_grad_norm)

    def configure_optimizers(self):
        optimizer = make_optimizer([p for p in self.parameters() if p.requires_grad], self.optim)
        schedule = make_schedule(
            optimizer, self.optim, self.optimizer_steps or int(self.trainer.estimated_stepping_batches), MONITOR
        )
        return {"optimizer": optimizer, "lr_scheduler": schedule}
