"""Random weights drawn block by block from a seed, so a streamed network never has to fit in memory whole.

A network of random weights (a recurrent stack, a DiT trained from scratch with its blocks streamed) is built
with empty weights; then each block is drawn from its own seed (the run's seed and the block's index), its frozen
weights written to the layer store and emptied, one block in memory at a time, and every module outside the
blocks is drawn from a seed of its name. The same draws without a store give the same values in memory, which is
how task=eval, infer and export rebuild a streamed run's frozen weights. Weights are drawn by torch's own
`reset_parameters` of each module that holds them; a network with a weight no module can draw again is built
whole from the seed instead, in memory (the engine then moves its blocks to the store), and the same in both cases.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from onn.models.layers import discover
from onn.models.load import block_seed, edge_seed, seeded_draw
from onn.streaming.store import LayerStore, build_progress, stored_name

# Every draw is seeded inside seeded_draw, on the host: the run's own generator (dropout, shuffles) is given back as
# seed= set it, whatever the number of blocks drawn.
CPU = torch.device("cpu")


def _holds_weights(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def drawable(network: nn.Module) -> bool:
    """Whether every weight belongs to a module that draws it again (torch's `reset_parameters`)."""
    return all(hasattr(m, "reset_parameters") for m in network.modules() if _holds_weights(m))


def empty_network(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """`build()`'s network with its weights on the meta device (its buffers real), for `draw` to fill; where a
    weight could not be drawn again, the network built whole from `seed`."""
    from accelerate import init_empty_weights

    with seeded_draw(seed, CPU), init_empty_weights(include_buffers=False):
        network = build()
    if drawable(network):
        return network
    with seeded_draw(seed, CPU):
        return build()


def draw(network: nn.Module, seed: int, blocks_path: str | None = None, store: LayerStore | None = None) -> None:
    """Fill `empty_network`'s weights from `seed`. With a store, each block's frozen weights (requires_grad off)
    go to it (where it lacks them) and stay behind as empty placeholders, one block in memory at a time; without
    one, every weight stays in memory, with the same values."""
    layer_map = discover(network, blocks_path)
    streamed = store is not None and any(p.is_meta for p in network.parameters())
    frozen = [[n for n, p in b.named_parameters() if not p.requires_grad] for b in layer_map.blocks]
    if streamed:
        _draw_blocks_into(store, layer_map, seed, frozen)
    else:
        for i, block in enumerate(layer_map.blocks):
            _draw(block, block_seed(seed, i))
    blocks, inside = set(layer_map.block_paths), tuple(p + "." for p in layer_map.block_paths)
    for name, module in network.named_modules():
        if name not in blocks and not name.startswith(inside):
            _draw(module, edge_seed(seed, name), recurse=False)


def _draw_blocks_into(store: LayerStore, layer_map, seed: int, frozen: list[list[str]]) -> None:
    """Every block drawn (so its trainable weights are the same as in memory), its frozen weights written where the
    store lacks them and left empty placeholders, which the engine fills from the store. The store's folder is held
    throughout: another process building the same store waits, then finds these blocks whole."""
    shapes = {
        i: {stored_name(n): list(b.get_parameter(n).shape) for n in frozen[i]} for i, b in enumerate(layer_map.blocks)
    }
    with store.building():
        missing = store.missing(shapes)  # the disk's room is checked here, before anything is written
        with build_progress(store, missing, shapes):
            for i, block in enumerate(layer_map.blocks):
                _draw(block, block_seed(seed, i))
                params = dict(block.named_parameters())
                if i in missing:
                    store.write(i, {stored_name(n): params[n].data for n in frozen[i]})
                for n in frozen[i]:
                    params[n].data = torch.empty(0, dtype=params[n].dtype)


def _draw(module: nn.Module, seed: int, recurse: bool = True) -> None:
    """Draw the module's meta weights from `seed` on the host; a module with none left on meta is untouched."""
    owners = [m for m in (module.modules() if recurse else [module]) if _holds_weights(m)]
    meta = [m for m in owners if any(p is not None and p.is_meta for p in m._parameters.values())]
    if not meta:
        return
    for owner in meta:
        for leaf, p in list(owner._parameters.items()):
            if p is not None and p.is_meta:
                setattr(owner, leaf, nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad))
    with seeded_draw(seed, CPU):
        for owner in meta:
            owner.reset_parameters()
