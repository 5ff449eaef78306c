"""The ONN zoo's recurrent networks: a stack of LSTM or GRU layers over variable-length sequences.

`RecurrentLayer` is one layer of a stack: an LSTM (or GRU) reading each sequence up to its own length,
and, bidirectional, a second one reading it backwards from its own last step. Sequences are packed
(torch.nn.utils.rnn.pack_padded_sequence), so no step of padding reaches a recurrence. While
torch.export traces the network (ONNX export cannot trace packing), or the planner sizes it on the meta
device, the same recurrences run over the padded batch: a forward recurrence's outputs up to a sequence's
length do not depend on what follows, and the backward one reads a copy of each sequence reversed within its
own length, so the outputs match. torch.export unrolls nn.LSTM's recurrence step by step, which fixes the number
of steps to the traced one: right for a clip, whose frames its features fix, and twice as fast to export as a
scan here. The language model (recurrent_lm.py), whose texts are of any length, runs `recurrence`: the same
equations as a scan, which exports as an ONNX Scan of any length.

`AudioRNN` classifies log-mel spectrograms with such a stack: it finds where each clip's sound is (the
store pads recordings with silence around them), takes those frames as one sequence each (or, `whole_clip`,
every frame of the clip), normalises them, optionally runs a small convolutional front-end over them (a CRNN),
runs the stack, pools the outputs over each sequence's length and classifies.
The stack is a ModuleList of identical layers: LayerMap discovery finds its blocks (onn/models/layers.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

CELLS = {"lstm": nn.LSTM, "gru": nn.GRU}
FLOOR_MARGIN_DB = 1e-3  # a frame whose every band is within this of the clip's minimum is silence
REFERENCES = ("band", "instance")  # SoundSpan's statistics: the sound's own, or the whole clip's


def reversed_within(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, steps] indices that reverse each sequence within its own length and keep the padding in place
    (applying them twice gives the sequence back)."""
    position = torch.arange(steps, device=lengths.device).unsqueeze(0)
    last = (lengths - 1).unsqueeze(1)
    return torch.where(position <= last, last - position, position)


def take_steps(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, T, F] at the steps index [B, T] names, per sequence."""
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def step_mask(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, steps] True at the steps inside each sequence."""
    return torch.arange(steps, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def recurrence(
    rnn: nn.LSTM | nn.GRU, x: torch.Tensor, hx: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """`rnn(x, hx)` of a one-layer, one-direction, batch-first nn.LSTM or nn.GRU (the same arguments and
    results), computed as a scan over the steps, for torch.export: it traces nn.LSTM by unrolling its
    decomposition, which fixes the number of steps to the traced length, where a scan exports as an ONNX Scan,
    which takes any length. The equations and gate order are PyTorch's (tests/test_char_lstm.py compares the
    two, eagerly and in onnxruntime)."""
    from torch._higher_order_ops.scan import scan  # torch's scan, which torch.onnx exports as ONNX Scan

    if rnn.num_layers != 1 or rnn.bidirectional or not rnn.batch_first or getattr(rnn, "proj_size", 0):
        raise ValueError(f"recurrence runs a one-layer, one-direction, batch-first RNN without projection; got {rnn}")
    lstm = isinstance(rnn, nn.LSTM)
    if hx is None:
        zeros = x.new_zeros(1, x.shape[0], rnn.hidden_size)
        hx = (zeros, zeros.clone()) if lstm else zeros
    state = tuple(s.squeeze(0) for s in hx) if lstm else (hx.squeeze(0),)
    b_ih, b_hh = getattr(rnn, "bias_ih_l0", None), getattr(rnn, "bias_hh_l0", None)  # none with bias=False
    inputs = nn.functional.linear(x, rnn.weight_ih_l0, b_ih).transpose(0, 1)  # [T, B, gates]
    w_hh = rnn.weight_hh_l0

    def lstm_step(carry, gx):
        h, c = carry
        i, f, g, o = (gx + nn.functional.linear(h, w_hh, b_hh)).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (h, c), h.clone()

    def gru_step(carry, gx):
        (h,) = carry
        xr, xz, xn = gx.chunk(3, dim=-1)
        hr, hz, hn = nn.functional.linear(h, w_hh, b_hh).chunk(3, dim=-1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        h = (1 - z) * torch.tanh(xn + r * hn) + z * h
        return (h,), h.clone()

    last, out = scan(lstm_step if lstm else gru_step, state, inputs)
    last = tuple(s.unsqueeze(0) for s in last)
    return out.transpose(0, 1), last if lstm else last[0]


class RecurrentLayer(nn.Module):
    """One layer of a recurrent stack: [B, T, in] and lengths [B] -> [B, T, hidden x directions], zero past
    each sequence's length. A residual connection joins its input where the widths agree."""

    def __init__(
        self, in_features: int, hidden: int, cell: str = "lstm", bidirectional: bool = True, dropout: float = 0.0
    ):
        super().__init__()
        rnn = CELLS[cell]
        self.forward_rnn = rnn(in_features, hidden, batch_first=True)
        self.backward_rnn = rnn(in_features, hidden, batch_first=True) if bidirectional else None
        self.out_features = hidden * (2 if bidirectional else 1)
        self.residual = in_features == self.out_features
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        """`packing`: how the batch packs (a stack works it out once for all its layers), else worked out here."""
        steps = x.shape[1]
        if packing is None and packs(x):
            packing = Packing.of(lengths)
        out = self._run(self.forward_rnn, x, packing)
        if self.backward_rnn is not None:
            flip = reversed_within(lengths, steps)
            back = self._run(self.backward_rnn, take_steps(x, flip), packing)
            out = torch.cat([out, take_steps(back, flip)], dim=-1)
        out = self.dropout(out)
        if self.residual:
            out = out + x
        return out * step_mask(lengths, steps).unsqueeze(-1).to(out.dtype)

    @staticmethod
    def _run(rnn: nn.Module, x: torch.Tensor, packing: Packing | None) -> torch.Tensor:
        if packing is None:  # each sequence's outputs inside its length do not depend on the padding after it
            return rnn(x)[0]
        with in_float32(rnn, x) as x:
            ordered = x.index_select(0, packing.order)
            packed = nn.utils.rnn.pack_padded_sequence(ordered, packing.lengths, batch_first=True)
            out = nn.utils.rnn.pad_packed_sequence(rnn(packed)[0], batch_first=True, total_length=x.shape[1])[0]
            return out.index_select(0, packing.inverse)


def packs(x: torch.Tensor) -> bool:
    """Whether a recurrence over `x` packs its sequences (reading their lengths on the host): not while export
    traces it or the planner sizes it on the meta device, which run the padded batch."""
    return not (torch.compiler.is_exporting() or x.is_meta)


@dataclass(frozen=True, eq=False)  # tensors: no field-wise ==
class Packing:
    """A batch's sequences longest first, as packing takes them: `order` and its `inverse` on the batch's device,
    the sorted `lengths` on the host. PyTorch's own unsorting (pack_padded_sequence with enforce_sorted=False)
    reads its device-held inverse order back at every pad_packed_sequence, a wait for the GPU per recurrence;
    here the lengths are read once and sorted on each side (ties may order differently: their lengths are equal)."""

    order: torch.Tensor
    inverse: torch.Tensor
    lengths: torch.Tensor

    @staticmethod
    def of(lengths: torch.Tensor) -> Packing:
        order = torch.argsort(lengths, descending=True, stable=True)
        return Packing(order, torch.argsort(order), lengths.cpu().sort(descending=True).values)


@contextlib.contextmanager
def in_float32(rnn: nn.Module, x: torch.Tensor):
    """`x` as `rnn` takes it: on CUDA, where its weights are float32, in float32 with autocast off. Under autocast
    PyTorch casts cuDNN's RNNs to float16 whatever autocast's dtype (its AutocastRNN), and a bf16-mixed run scales
    no loss, so a float16 recurrence's small gradients would flush to zero. Likewise on a CPU under float16
    autocast, where oneDNN has no float16 LSTM (`could not create a primitive descriptor`). Elsewhere (a CPU in
    float32 or bfloat16; weights streamed in the compute dtype), as it comes."""
    device = x.device.type
    float16_cpu = (
        device == "cpu" and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    )
    if (device != "cuda" and not float16_cpu) or any(p.dtype != torch.float32 for p in rnn.parameters()):
        yield x
        return
    with torch.autocast(device, enabled=False):
        yield x.float()


class SoundSpan(nn.Module):
    """Log-mels in dB [B, C, n_mels, frames] -> the frames of each clip's sound, moved to the start, as a
    sequence [B, frames, C x n_mels], normalised, and the sequences' lengths [B]. Silence (every band at the
    clip's minimum: the padding the store puts around a recording, and the silence of a recording's own edges)
    is not part of the sound. `reference` names the statistics: `band` removes each band's mean over the sound
    and scales by its deviation; `instance` uses the whole clip's, silence included (each band's mean, one
    deviation: the values data.features.normalize=instance gives the audio CNN), which keeps how far each band
    of the sound stands above the silence. A held-out voice is recognised far better from `instance`.
    `whole_clip` takes every frame instead, silence included: the clip as the audio CNN sees it."""

    def __init__(self, reference: str = "band", whole_clip: bool = False):
        super().__init__()
        if reference not in REFERENCES:
            raise ValueError(f"reference={reference!r}: use one of {', '.join(REFERENCES)}")
        self.reference, self.whole_clip = reference, whole_clip

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, c, mels, frames = x.shape
        seq = x.permute(0, 3, 1, 2).reshape(b, frames, c * mels)
        if self.whole_clip:  # every frame, silence included, as the audio CNN sees a clip
            sound = torch.ones(b, frames, dtype=torch.bool, device=x.device)
        else:  # [B, frames]: a frame with any band above the clip's floor
            sound = (seq > seq.amin(dim=(1, 2), keepdim=True) + FLOOR_MARGIN_DB).any(dim=-1)
        position = torch.arange(frames, device=x.device).unsqueeze(0)
        first = torch.where(sound, position, frames).amin(dim=1).clamp(max=frames - 1)
        last = torch.where(sound, position, -1).amax(dim=1)
        lengths = (last - first + 1).clamp(min=1)
        if self.reference == "instance":  # the whole clip's statistics, before the silence is cut away
            mean = seq.mean(dim=1, keepdim=True)
            std = (seq - mean).std(dim=(1, 2), keepdim=True)
        seq = take_steps(seq, (first.unsqueeze(1) + position).clamp(max=frames - 1))
        mask = step_mask(lengths, frames).unsqueeze(-1).to(seq.dtype)
        if self.reference == "band":  # the sound's own statistics
            count = lengths.view(b, 1, 1).to(seq.dtype)
            mean = (seq * mask).sum(dim=1, keepdim=True) / count
            centred = (seq - mean) * mask
            std = ((centred * centred).sum(dim=(1, 2), keepdim=True) / (count * c * mels)).sqrt()
        return (seq - mean) * mask / std.clamp_min(1e-3), lengths


class SpectralConv(nn.Module):
    """A convolutional front-end over each sequence's frames: [B, T, C x mels] and lengths -> [B, T', features]
    and the new lengths. Each stage is convs_per_stage x (3x3 conv over frequency x time -> BatchNorm -> ReLU),
    then a max pool of 2 over frequency, so a voice's formants a band higher or lower give nearly the same
    features, and (time_pool) of 2 over time, each sequence then half as long (rounded up). `frequency_mean`
    averages the last stage over frequency, as the audio CNN's global pooling does, so each step's features say
    what was heard, not in which band. The frames past each sequence's length are zeroed before every pooling,
    so what a conv or a pooling reads there is the zero padding it would read at the end of the clip: padding
    changes nothing."""

    def __init__(
        self,
        in_channels: int,
        mels: int,
        widths: list[int],
        time_pool: bool = False,
        convs_per_stage: int = 1,
        frequency_mean: bool = False,
    ):
        super().__init__()
        stages: list[nn.Module] = []
        channels = in_channels
        for width in widths:
            for _ in range(convs_per_stage):
                stages += [
                    nn.Conv2d(channels, width, 3, padding=1, bias=False),
                    nn.BatchNorm2d(width),
                    nn.ReLU(inplace=True),
                ]
                channels = width
            stages.append(nn.MaxPool2d((2, 2 if time_pool else 1), ceil_mode=True))
            mels = (mels + 1) // 2
        self.in_channels, self.time_pool, self.frequency_mean = in_channels, time_pool, frequency_mean
        # one flat Sequential (no run of same-typed blocks), so LayerMap discovery keeps the recurrent stack
        self.stages = nn.Sequential(*stages)
        self.out_features = channels if frequency_mean else channels * mels

    def forward(self, seq: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, steps, _ = seq.shape
        x = seq.reshape(b, steps, self.in_channels, -1).permute(0, 2, 3, 1)  # [B, C, mels, T]
        for stage in self.stages:
            x = stage(x)
            if isinstance(stage, nn.ReLU):  # zero past each length before pooling: a pooled frame never reads past it
                x = x * step_mask(lengths, x.shape[-1]).view(b, 1, 1, -1).to(x.dtype)
            elif isinstance(stage, nn.MaxPool2d) and self.time_pool:
                lengths = torch.div(lengths + 1, 2, rounding_mode="floor")
        if self.frequency_mean:  # the audio CNN's global pooling over frequency: where a voice's formants sit fades
            return x.mean(dim=2).transpose(1, 2), lengths
        return x.permute(0, 3, 1, 2).reshape(b, x.shape[-1], -1), lengths


class AudioRNN(nn.Module):
    """Spectrogram -> the sound's frames (whole_clip: every frame) as a sequence -> (conv_widths) a convolutional
    front-end over its frames (frequency_mean: averaged over frequency) -> a stack of (bi)LSTM or GRU layers ->
    the mean and the maximum of its outputs over each sequence -> dropout -> classes. Takes log-mels in dB (or
    affinely scaled dB: data.features.normalize none or dataset), where silence is the clip's minimum."""

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int | list[int] = 64,
        hidden: int = 128,
        layers: int = 2,
        cell: str = "lstm",
        bidirectional: bool = True,
        dropout: float = 0.3,
        batch_norm: bool = False,
        conv_widths: list[int] | tuple[int, ...] = (),
        time_pool: bool = False,
        convs_per_stage: int = 1,
        frequency_mean: bool = False,
        reference: str = "band",
        whole_clip: bool = False,
    ):
        super().__init__()
        if cell not in CELLS:
            raise ValueError(f"cell={cell!r}: use one of {', '.join(CELLS)}")
        for key, value in (("hidden", hidden), ("layers", layers)):  # range(0) would build no recurrence at all
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r}: give a whole number, 1 or more")
        if frequency_mean and not conv_widths:
            raise ValueError("frequency_mean averages the conv front-end's features: give conv_widths too")
        mels = image_size if isinstance(image_size, int) else int(image_size[0])
        self.span = SoundSpan(reference, whole_clip)
        self.conv = (
            SpectralConv(in_channels, mels, list(conv_widths), time_pool, convs_per_stage, frequency_mean)
            if conv_widths
            else None
        )
        frame_features = self.conv.out_features if self.conv is not None else in_channels * mels
        self.project = nn.Linear(frame_features, hidden * (2 if bidirectional else 1))
        width = self.project.out_features
        # the projected features' statistics over the batch: a held-out voice's own with task.adapt_norm (AdaBN)
        self.norm = nn.BatchNorm1d(width) if batch_norm else None
        self.layers = nn.ModuleList(
            RecurrentLayer(width, hidden, cell, bidirectional, dropout if i < layers - 1 else 0.0)
            for i in range(layers)
        )
        self.classifier = nn.Sequential()
        self.classifier.add_module("drop", nn.Dropout(dropout))
        self.classifier.add_module("head", nn.Linear(2 * width, num_classes))
        self.num_classes, self.num_features = num_classes, 2 * width
        self.pretrained_cfg = {"classifier": "classifier.head"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, lengths = self.span(x)
        if self.conv is not None:
            seq, lengths = self.conv(seq, lengths)
        seq = self.project(seq)
        if self.norm is not None:
            seq = self.norm(seq.transpose(1, 2)).transpose(1, 2)
        packing = Packing.of(lengths) if packs(seq) else None  # once for every layer
        for layer in self.layers:
            seq = layer(seq, lengths, packing)
        mask = step_mask(lengths, seq.shape[1]).unsqueeze(-1)
        mean = seq.sum(dim=1) / lengths.unsqueeze(1).to(seq.dtype)
        peak = seq.masked_fill(~mask, torch.finfo(seq.dtype).min).amax(dim=1)
        return self.classifier(torch.cat([mean, peak], dim=-1))

    def reset_classifier(self, num_classes: int = 0) -> None:
        """timm's contract: a new head for num_classes, or none (the model returns pooled features) for 0."""
        self.num_classes = num_classes
        self.classifier.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
