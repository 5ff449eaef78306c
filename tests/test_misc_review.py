"""Left-over defects across the graph picture, LoRA placement, task=tune, bench_gpu's units, the pairs gallery and
the recurrent LM's generation, each checked on the real code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import HostReads, compose, tiny_llama

from onn.errors import UserError


def _graph(edges: list[tuple[int, int]], nodes: int, classes: int = 3):
    """A graph as the graph reader makes it (make_graph), each node's features a one-hot class."""
    from onn.modalities.graph.read import make_graph

    x = torch.nn.functional.one_hot(torch.arange(nodes) % classes, classes).float()
    return make_graph(x, torch.tensor(edges, dtype=torch.long).t(), None, 10**6)


def test_a_graph_is_drawn_at_its_positions_and_never_at_its_features():
    """layout() drew any graph of 3 or more features at its first two: one-hot classes put every node on one of
    three points. Positions come from `pos` alone; other graphs get a layout of their edges."""
    from onn.modalities.graph.picture import layout

    ring = _graph([(i, (i + 1) % 12) for i in range(12)], 12)
    xy = layout(ring)
    assert xy.shape == (12, 2) and len(np.unique(xy.round(3), axis=0)) == 12  # spread, not three one-hot corners
    assert not np.allclose(xy, ring.x[:, :2].numpy())
    ring.pos = torch.randn(12, 3)
    assert np.allclose(layout(ring), ring.pos[:, :2].numpy())


def test_a_large_graph_is_laid_out_by_its_edges_component_by_component():
    """Above SPRING_MAX_NODES the first two features were the positions; now a spectral layout of each connected
    component, the components apart (a spectral layout of the whole graph puts a component at one point)."""
    from onn.modalities.graph.picture import SPRING_MAX_NODES, layout

    side = 30  # two 30 x 30 grids: 1,800 nodes
    grid = [(r * side + c, r * side + c + 1) for r in range(side) for c in range(side - 1)]
    grid += [(r * side + c, (r + 1) * side + c) for r in range(side - 1) for c in range(side)]
    nodes = side * side
    graph = _graph(grid + [(a + nodes, b + nodes) for a, b in grid], 2 * nodes)
    assert graph.num_nodes > SPRING_MAX_NODES
    xy = layout(graph)
    assert len(np.unique(xy.round(4), axis=0)) == graph.num_nodes
    first, second = xy[:nodes], xy[nodes:]
    apart = (first.max(0) < second.min(0)) | (second.max(0) < first.min(0))
    assert apart.any()  # the two components' boxes do not overlap


def _lora_error(target: object, strategy: str = "lora", layers: list[int] | None = None) -> str:
    from onn.models.layers import discover
    from onn.training.lora import apply

    model = tiny_llama()
    cfg = compose("strategy=lora").strategy
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, target_modules=target))
    with pytest.raises(UserError) as e:
        apply(model, strategy, cfg, discover(model), layers)
    return str(e.value)


@pytest.mark.parametrize(
    ("target", "strategy", "layers", "said"),
    [
        (["nope_proj"], "lora", None, "matches no module of LlamaForCausalLM:"),
        (["nope_proj"], "sparse_lora", [1], "matches no module of LlamaForCausalLM in the layers strategy.layers"),
        ("q_proj", "lora", None, "(a string is a regular expression over whole module names)"),
        (["input_layernorm"], "lora", None, "matches 2 modules of LlamaForCausalLM that are not linear layers"),
        (["model.layers.0.mlp"], "lora", None, "(e.g. model.layers.0.mlp (LlamaMLP))"),
    ],
)
def test_lora_targets_that_fit_nothing_are_one_sentence_naming_the_key_and_the_linear_layers(
    target, strategy, layers, said
):
    """peft's own message came inside ONN's: several lines, a whole MLP printed, its list of supported types."""
    message = _lora_error(target, strategy, layers)
    assert message.startswith(f"strategy.lora.target_modules={target!r} ") and said in message, message
    assert "e.g. [down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj], or all-linear." in message
    assert "\n" not in message and "Currently, only" not in message and "Please check" not in message


def _tune_trials(tmp_path: Path, budget_mb: int):
    """task=tune's trial book over a real plan of the tiny Llama at hardware.budget_mb."""
    from onn.bench.tune import _Trials
    from onn.hardware.profile import resolve
    from onn.modalities.base import Job
    from onn.modalities.registry import get
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec

    overrides = ("task=tune", "hardware=cpu_16gb", f"hardware.budget_mb={budget_mb}", "model=llama_tiny")
    cfg = compose(*overrides, "strategy=sparse_lora", "data.max_length=40", f"paths.cache={tmp_path}", root=tmp_path)
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    spec = model_spec(cfg.model, 8, cache_dir=cfg.paths.cache)
    plan = make_plan(cfg, hw, spec, use_tuned=False)
    job = Job(config=cfg, run_dir=tmp_path, modality=get("text"), hardware=hw, plan=plan, spec=spec)
    return _Trials(job, cfg.tune, streaming=True), plan


def test_a_trial_is_judged_against_the_budget_less_the_context(tmp_path):
    """A trial's growth is measured above the process's baseline (the CUDA context on a GPU), yet it was held to
    the whole budget, context included: at hardware.budget_mb=640 (40 MB beside 600), a trial that grew 600 MB
    passed, and its setting was cached as the fastest within the budget."""
    trials, plan = _tune_trials(tmp_path, 640)
    room = plan.budget_mb - plan.context_mb
    assert 0 < room < plan.budget_mb
    assert trials.usable({"status": "ok", "peak_growth_mb": room})
    assert not trials.usable({"status": "ok", "peak_growth_mb": room + 1})


def test_a_guess_over_the_budget_is_no_baseline_for_the_speedup(tmp_path):
    """The planner's guess ran but grew past the budget, another setting fit: the result gave a speedup over the
    guess that did not fit, and its table said 'no trial beat it' beside a winner that was not the guess."""
    from onn.bench.tune import _confirmed, _settings_of, _table

    trials, plan = _tune_trials(tmp_path, 640)
    room = plan.budget_mb - plan.context_mb
    guess = _settings_of(plan)
    smaller = {**guess, "micro_batch": 1}
    trials.rows = [
        {"settings": guess, "predicted_mb": 1.0, "status": "ok", "samples_per_s": 9.0, "peak_growth_mb": room + 5},
        {"settings": smaller, "predicted_mb": 1.0, "status": "ok", "samples_per_s": 3.0, "peak_growth_mb": 1.0},
    ]
    result = _confirmed(trials, trials.rows[1], guess, trials.tune)
    result["time_s"] = 0.0
    assert result["settings"] == smaller and result["speedup_over_plan"] is None
    assert result["plan_samples_per_s"] is None
    table = _table(result)
    assert "no trial beat it" not in table and f"it did not run within the budget: grew {room + 5:,.1f} MB" in table


def test_bench_gpu_link_figures_are_in_the_gigabytes_their_names_say():
    """gpu/h2d_gb_s divided bytes by 2**30 (GiB/s) and gpu/h2d_gb_s_profile MB/s by 1024: a 55 GB/s link read
    51.2. GB is 1e9 bytes, as NVIDIA quotes its links; the profile's h2d_mb_s is in MB of 2**20 bytes."""
    from onn.bench.gpu import link_figures

    figures = link_figures(copied_bytes=25.6e9, link_bytes_s=55.0e9, profile_mb_s=55.0e9 / 2**20)
    assert figures == {"gpu/copied_gb_per_step": 25.6, "gpu/h2d_gb_s": 55.0, "gpu/h2d_gb_s_profile": 55.0}


class _CountingSide:
    """A pairs side that reads through the real one and records how many items each read decoded."""

    def __init__(self, side):
        self.side, self.sizes = side, []
        self.name, self.config = side.name, side.config

    def read(self, items):
        self.sizes.append(len(items))
        return self.side.read(items)


def test_the_gallery_is_decoded_chunk_by_chunk_with_the_same_embeddings_positions_and_skips(tmp_path):
    """embed_all decoded the whole task.gallery into one tensor first (100,000 pictures: ~15 GB of host memory).
    Chunk by chunk, an undecodable picture in the middle is skipped and named as before, and every other one keeps
    its position and its embedding."""
    from onn.modalities.pairs.demo import write_shapes
    from onn.modalities.pairs.tasks import build, embed_all, sides_of

    folder = write_shapes(tmp_path / "shapes", 11, seed=0, size=16)
    (folder / "0005.png").write_bytes(b"not a picture")
    cfg = compose(
        "data=pairs",
        "model=dual_encoder",
        f"data.source={folder}",
        "data.sides.image.image_size=[16,16]",
        "model.feature_dim=16",
        "model.embed_dim=8",
        f"paths.cache={tmp_path / 'cache'}",
    )
    sides = sides_of(cfg)
    module = build(cfg, sides).eval()
    items = sorted(folder.glob("*.png"))
    counted = _CountingSide(sides["image"])
    whole, whole_index, whole_skipped = embed_all(module, "image", sides["image"], items, torch.device("cpu"), 2, 100)
    chunked, index, skipped = embed_all(module, "image", counted, items, torch.device("cpu"), 2, 4)
    assert max(counted.sizes) <= 4 and sum(counted.sizes) == len(items) == 11
    assert index == whole_index == [i for i in range(11) if i != 5]
    assert skipped == whole_skipped and len(skipped) == 1 and skipped[0].startswith("0005.png")
    assert torch.allclose(chunked, whole, atol=1e-5)


def test_generating_reads_the_device_once_a_token_for_the_stopping_check_alone():
    """Each new token's forward read the mask's lengths back (bool(any())) to decide whether to pack, though a
    generated token is one column, which never needs packing: two waits for the GPU a token where transformers'
    own stopping check takes one. The padded prompt still packs: rows keep their own last states."""
    from onn.models.zoo.recurrent_lm import RecurrentLMConfig, RecurrentLMForCausalLM

    torch.manual_seed(0)
    model = RecurrentLMForCausalLM(RecurrentLMConfig(hidden_size=16, num_hidden_layers=2, dropout=0.0)).eval()
    prompts = torch.tensor([[258, 258, 65, 66], [65, 66, 67, 68]])
    mask = (prompts != 258).long()

    def reads(tokens: int) -> tuple[int, torch.Tensor]:
        with HostReads() as seen:
            out = model.generate(
                input_ids=prompts,
                attention_mask=mask,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=258,
            )
        return len(seen.seen), out

    few, _ = reads(4)
    many, out = reads(12)
    assert many - few <= 8, (few, many)  # one read a token: transformers' check whether every row has stopped
    alone = model.generate(
        input_ids=prompts[:1, 2:], max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=258
    )
    assert torch.equal(out[0, 4:], alone[0, 2:])  # the padded row generates as it does alone
