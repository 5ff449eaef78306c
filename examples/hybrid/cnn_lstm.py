"""A hybrid network ONN has no zoo entry for: a CNN encoder whose feature columns feed an LSTM, with its own loss.

    python run.py recipe=fsdd_audio_cnn model.name=cnn_lstm model.source=examples/hybrid/cnn_lstm.py:build \
        model.loss=examples/hybrid/cnn_lstm.py:focal_loss task.adapt_norm=false export=onnx

ONN calls `build` with the data's in_channels, num_classes and image_size (here the spectrogram's [mels,
frames]) where its signature names them, plus model.kwargs; `focal_loss(outputs, labels)` replaces
cross-entropy for training and validation. Checkpoints, resume, tracking, eval, infer and export are the
runner's, as for any classifier.
"""

import torch
import torch.nn.functional as F
from torch import nn


class CNNLSTM(nn.Module):
    """Two conv blocks pool the frequency axis away; each time step's column of features is one LSTM input."""

    def __init__(self, in_channels: int, num_classes: int, mels: int, width: int = 32, hidden: int = 64):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d((2, 1)),
            nn.Conv2d(width, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d((2, 1)),
        )
        self.lstm = nn.LSTM(width * (mels // 4), hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, mels, frames]
        features = self.encoder(x)  # [B, width, mels / 4, frames]
        sequence = features.flatten(1, 2).transpose(1, 2)  # [B, frames, width * mels / 4]
        if sequence.is_cuda:  # CUDA autocast runs cuDNN's LSTM in float16, and bf16-mixed scales no loss: float32
            with torch.autocast("cuda", enabled=False):
                outputs, _ = self.lstm(sequence.float())
        else:
            outputs, _ = self.lstm(sequence)
        return self.head(outputs.mean(dim=1))


def build(in_channels: int, num_classes: int, image_size: list[int], width: int = 32, hidden: int = 64) -> nn.Module:
    return CNNLSTM(in_channels, num_classes, image_size[0], width, hidden)


def focal_loss(outputs: torch.Tensor, labels: torch.Tensor, gamma: float = 2.0) -> torch.Tensor:
    """Focal loss (Lin et al. 2017): cross-entropy weighted towards the items the network still gets wrong."""
    log_p = F.log_softmax(outputs.float(), dim=-1).gather(1, labels.unsqueeze(1)).squeeze(1)
    return (-((1 - log_p.exp()) ** gamma) * log_p).mean()
