"""What makes the host wait for a GPU, op by op. A value read back, a blocking copy or an output sized by its
values waits for every kernel queued before it, so the host cannot queue the next step while the GPU runs this
one. DeviceOps counts a step's ops and waits at the dispatcher, on any device (recipe=bench_vision's device
work, and the tests that check a step does not wait)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# ops that read values to the host: a number (.item(), float(), bool()), or an output's size that depends on them
READ_VALUES = frozenset(
    {
        aten._local_scalar_dense.default,
        aten.is_nonzero.default,
        aten.nonzero.default,
        aten.bincount.default,
        aten.masked_select.default,
        aten._unique2.default,
        aten.unique_dim.default,
        aten.unique_consecutive.default,
        aten.equal.default,  # a bool on the host, as torch.allclose's
        aten.allclose.default,
    }
)
# ops that write through indices: a boolean mask among them is turned into positions (nonzero) first
INDEX_PUT = frozenset({aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default})


def _by_mask(indices) -> bool:
    """Whether an index list holds a boolean mask, whose positions the op counts on the host."""
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _fills_by_mask(args: tuple, kwargs: dict) -> bool:
    """index_put_'s own shortcut to masked_fill_, which waits for nothing: one mask on the tensor's device, one
    value on the host (as `x[mask] = 0.0` gives it on a GPU), not accumulated."""
    target, indices, values = args[:3]
    accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
    masks = [i for i in indices if i is not None]
    one_mask = len(masks) == 1 and masks[0].device == target.device
    return not accumulate and one_mask and values.numel() == 1 and values.device.type == "cpu"


def makes_the_host_wait(func, args: tuple, kwargs: dict, on_cpu: bool) -> bool:
    """Whether the op waits for the GPU: it reads values (READ_VALUES) or indexes by a boolean mask on the device,
    or copies between the host and the device without non_blocking, either way. `on_cpu`: a CPU run, where
    nothing waits, counts what would wait on a GPU as far as the dispatcher shows it (a copy between host and
    device is no op there)."""

    def on_device(t: torch.Tensor) -> bool:
        return on_cpu or t.device.type != "cpu"

    if func in READ_VALUES:
        return on_device(args[0])
    if func is aten.index.Tensor:  # a boolean mask's indexing is sized by the mask
        return on_device(args[0]) and _by_mask(args[1])
    if func in INDEX_PUT:  # x[mask] = values: the mask's positions first, unless it is a masked fill
        return on_device(args[0]) and _by_mask(args[1]) and not _fills_by_mask(args, kwargs)
    if func is aten.repeat_interleave.Tensor:  # sized by the repeats' sum, unless output_size gives it
        return on_device(args[0]) and kwargs.get("output_size") is None
    blocking = not kwargs.get("non_blocking", args[2] if func is aten.copy_.default and len(args) > 2 else False)
    if func is aten._to_copy.default:
        to = kwargs.get("device")
        return blocking and to is not None and (to.type == "cpu") != (args[0].device.type == "cpu")
    if func is aten.copy_.default:
        return blocking and (args[0].device.type == "cpu") != (args[1].device.type == "cpu")
    return False


class DeviceOps(TorchDispatchMode):
    """Counts the aten ops dispatched under it, views aside (they launch nothing), and the ops among them that
    make the host wait for the device (makes_the_host_wait) on a run on `device`. Tensors made under inference
    mode never reach a dispatch mode: a Trainer it watches needs inference_mode=False (ONN's have it)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.on_cpu = device.type == "cpu"
        self.ops = self.waits = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view:
            self.ops += 1
            self.waits += makes_the_host_wait(func, args, kwargs, self.on_cpu)
        return out
