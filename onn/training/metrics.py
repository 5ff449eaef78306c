"""Evaluation figures kept where the batches are until the evaluation ends, then read once.

On a GPU, reading a value to the host waits for every kernel queued before it, so a validation batch that read
anything could not be queued while the previous one computes. torchmetrics' MeanMetric reads each update's NaN
check (and with nan_strategy="disable" drops the weights, torchmetrics 1.9), and its confusion matrix's bincount
reads the batch's smallest and largest index; these figures add on the device instead.
"""

from __future__ import annotations

import torch
from torch import nn
from torchmetrics import SumMetric


class WeightedMean(nn.Module):
    """The mean of values weighted by counts (a loss per token, per sample) over an evaluation, over every
    process: the weighted values summed on their device, the counts (known on the host) summed on the host."""

    def __init__(self):
        super().__init__()
        self.total = SumMetric(nan_strategy="disable")
        self.count = SumMetric(nan_strategy="disable")
        self._count = 0.0

    def update(self, mean: torch.Tensor, count: float) -> None:
        """`mean`: the mean of `count` values (a batch's mean loss), wherever it is computed; in float32 before it is
        weighted (a half-precision mean times thousands of tokens would round, or overflow)."""
        if self.total.device != mean.device:  # DeepSpeed's ZeRO-3 offload leaves a module's metrics on the CPU
            self.total.to(mean.device)
        self.total.update(mean.detach().float() * count)
        self._count += count

    def compute(self, device: torch.device, processes: int = 1) -> float | None:
        """The mean over every process, read once (None when nothing was counted); the sums start again. With
        several `processes` each must call it, also one whose share was empty: compute() reduces across them."""
        mean = None
        if self._count or processes > 1:
            total, count = self.total.to(device), self.count.to(device)
            total.update(torch.zeros((), device=device))  # a share without values adds nothing
            count.update(torch.tensor(float(self._count), device=device))
            summed, counted = float(total.compute()), float(count.compute())
            mean = summed / counted if counted else None
        self.total.reset()
        self.count.reset()
        self._count = 0.0
        return mean


class ClassPairs(nn.Module):
    """Each evaluated sample's (true class, predicted class), kept on the device until the evaluation ends and
    then counted into torchmetrics' confusion matrix at once (one read instead of one per batch)."""

    def __init__(self, num_classes: int):
        super().__init__()
        from torchmetrics.classification import MulticlassConfusionMatrix

        self.matrix = MulticlassConfusionMatrix(num_classes, validate_args=False)
        self._targets: list[torch.Tensor] = []
        self._predicted: list[torch.Tensor] = []

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        self._predicted.append(logits.detach().argmax(1))
        self._targets.append(targets.detach())

    def compute(self) -> torch.Tensor:
        """The confusion matrix over every process (rows: true class, columns: predicted), on the host."""
        if self._targets:
            predicted = torch.cat(self._predicted)
            self.matrix.to(predicted.device).update(predicted, torch.cat(self._targets))
        self._targets, self._predicted = [], []
        counts = self.matrix.compute().cpu()
        self.matrix.reset()
        return counts


def ranked(probs: torch.Tensor, k: int) -> torch.return_types.topk:
    """The k most probable classes, highest first, and of tied classes the earlier in the model's order first: the
    class torch.argmax (task=eval's accuracy) takes. topk orders ties as it likes, and under bf16 autocast two
    classes' logits often round to one value: infer named the other class of such a tie than eval counted."""
    values, indices = probs.sort(dim=-1, descending=True, stable=True)
    return torch.return_types.topk((values[..., :k], indices[..., :k]))
