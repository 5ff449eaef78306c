"""The .omny shard planner: exact against brute force on small cases, limits, proportions, errors, the bench."""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys

import pytest
from conftest import ROOT, compose

from onn.errors import UserError
from onn.export.shards import MB, Block, bench, largest_remainder, plan_nodes, plan_shards, shard_memory


def mb_blocks(*specs: tuple[float, float]) -> list[Block]:
    """Blocks from (weight MB, activation MB) pairs, named like a decoder's layers."""
    return [Block(f"model.layers.{i}", int(w * MB), int(a * MB)) for i, (w, a) in enumerate(specs)]


def memory(blocks: list[Block], start: int, end: int, headroom_mb: float, batch_size: int) -> tuple[int, float]:
    """(weight bytes, total bytes) of [start, end), computed directly from the blocks."""
    weight = sum(b.weight_bytes for b in blocks[start:end])
    activation = max(b.activation_bytes for b in blocks[start:end]) * batch_size
    return weight, weight + activation + headroom_mb * MB


def partitions(n: int, k: int):
    """Every split of blocks 0..n-1 into k non-empty contiguous ranges."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        yield [[bounds[i], bounds[i + 1]] for i in range(k)]


def assert_cover(ranges: list[list[int]], n: int) -> None:
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for (s, e), (s2, _) in zip(ranges, ranges[1:]):
        assert s < e == s2
    assert ranges[-1][0] < ranges[-1][1]


def random_blocks(rng: random.Random, n: int) -> list[Block]:
    return [Block(f"b{i}", rng.randint(1, 40) * MB // 10, rng.randint(0, 10) * MB // 10) for i in range(n)]


# --- plan_shards -------------------------------------------------------------------------------------


def test_balanced_plans_match_brute_force_and_obey_both_limits() -> None:
    rng = random.Random(0)
    checked = infeasible = 0
    for _ in range(400):
        n = rng.randint(1, 8)
        blocks = random_blocks(rng, n)
        max_w, vram = rng.choice([2.0, 3.5, 6.0, 100.0]), rng.choice([3.0, 5.0, 8.0, 100.0])
        headroom, batch = rng.choice([0.0, 0.5, 1.0]), rng.choice([1, 2])
        best = {}  # k -> smallest possible largest shard weight, over partitions that fit both limits
        for k in range(1, n + 1):
            for ranges in partitions(n, k):
                sizes = [memory(blocks, s, e, headroom, batch) for s, e in ranges]
                if all(w <= max_w * MB and t <= vram * MB for w, t in sizes):
                    best[k] = min(best.get(k, math.inf), max(w for w, _ in sizes))
        if not best:
            with pytest.raises(UserError, match=r"^block \d+ 'b\d+' .* MB too big"):
                plan_shards(blocks, max_w, vram, headroom, batch)
            infeasible += 1
            continue
        plans = plan_shards(blocks, max_w, vram, headroom, batch, max_configs=n)
        assert [p["shards"] for p in plans] == sorted(best)  # exactly the feasible counts
        for plan in plans:
            ranges = plan["ranges"]
            assert len(ranges) == plan["shards"]
            assert_cover(ranges, n)
            sizes = [memory(blocks, s, e, headroom, batch) for s, e in ranges]
            for w, t in sizes:
                assert w <= max_w * MB and t <= vram * MB
            assert max(w for w, _ in sizes) == best[plan["shards"]]  # balanced: optimal largest shard
            assert plan["weight_mb"] == [round(w / MB, 1) for w, _ in sizes]
            assert plan["total_mb"] == [round(t / MB, 1) for _, t in sizes]
        # Default max_configs: the first 8 feasible counts.
        assert [p["shards"] for p in plan_shards(blocks, max_w, vram, headroom, batch)] == sorted(best)[:8]
        checked += 1
    assert checked > 150 and infeasible > 20  # both branches really ran


def test_weights_blocks_share_count_once_in_a_shard_and_plans_match_brute_force() -> None:
    """A tied embedding is stored by the prefix and the head; a shard holding both stores it once (as its extracted
    ONNX does), so the whole model fits one shard that the blocks' summed weights would not."""
    tied = mb_blocks((100, 1), (10, 1), (10, 1), (100, 1))
    shared = [(0, 3, 100 * MB)]
    plans = plan_shards(tied, max_shard_size_mb=130, min_vram_mb=200, headroom_mb=0, shared=shared)
    assert plans[0]["ranges"] == [[0, 4]] and plans[0]["weight_mb"] == [120.0] and plans[0]["total_mb"] == [121.0]
    assert plan_nodes(tied, [125], headroom_mb=0, shared=shared)["total_mb"] == [121.0]
    rng = random.Random(2)
    checked = 0
    for _ in range(400):
        n = rng.randint(2, 7)
        blocks = random_blocks(rng, n)
        every = [(a, b) for a in range(n) for b in range(a + 1, n)]
        pairs = sorted(rng.sample(every, min(len(every), rng.randint(1, 3))))
        shared = [(a, b, rng.randint(1, min(blocks[a].weight_bytes, blocks[b].weight_bytes))) for a, b in pairs]

        def stored(s, e, shared=shared, blocks=blocks):
            return sum(b.weight_bytes for b in blocks[s:e]) - sum(x for a, b, x in shared if s <= a and b < e)

        best = {}
        for k in range(1, n + 1):
            for ranges in partitions(n, k):
                weights = [stored(s, e) for s, e in ranges]
                totals = [w + max(b.activation_bytes for b in blocks[s:e]) for w, (s, e) in zip(weights, ranges)]
                if max(weights) <= 3 * MB and max(totals) <= 5 * MB:
                    best[k] = min(best.get(k, math.inf), max(weights))
        if not best:
            with pytest.raises(UserError, match="MB too big"):
                plan_shards(blocks, 3, 5, 0, shared=shared)
            continue
        plans = plan_shards(blocks, 3, 5, 0, shared=shared, max_configs=n)
        assert [p["shards"] for p in plans] == sorted(best)
        for plan in plans:
            assert_cover(plan["ranges"], plan["ranges"][-1][1])
            assert max(stored(s, e) for s, e in plan["ranges"]) == best[plan["shards"]]
            assert plan["weight_mb"] == [round(stored(s, e) / MB, 1) for s, e in plan["ranges"]]
        checked += 1
    assert checked > 80  # feasible cases (the rest are refused, above)


def test_equal_blocks_split_evenly_and_counts_start_at_the_fewest_that_fit() -> None:
    blocks = mb_blocks(*[(100, 0)] * 12)
    plans = plan_shards(blocks, max_shard_size_mb=400, min_vram_mb=1500, headroom_mb=0)
    assert [p["shards"] for p in plans] == list(range(3, 11))  # 4 blocks per shard at most; 8 configs
    assert plans[0]["ranges"] == [[0, 4], [4, 8], [8, 12]]
    five = next(p for p in plans if p["shards"] == 5)
    assert max(five["weight_mb"]) == 300.0 and sorted(e - s for s, e in five["ranges"]) == [2, 2, 2, 3, 3]
    # Activations peak (blocks run one after another); they do not add up.
    blocks = mb_blocks((100, 50), (100, 10), (100, 30))
    assert shard_memory(blocks, 0, 3, 256, 2) == {
        "weight_mb": 300.0,
        "activation_mb": 100.0,
        "total_mb": 656.0,
    }
    assert plan_shards(blocks, 1200, 656, 256, batch_size=2)[0]["ranges"] == [[0, 3]]
    assert plan_shards(blocks, 1200, 655.9, 256, batch_size=2)[0]["shards"] == 2


def test_explicit_counts_must_be_feasible() -> None:
    blocks = mb_blocks(*[(100, 0)] * 12)
    assert [p["shards"] for p in plan_shards(blocks, 400, headroom_mb=0, counts=[6, 4, 6])] == [4, 6]
    with pytest.raises(
        UserError, match=r"^export.shard_counts has 2, which is not feasible: .* need at least 3 shards"
    ):
        plan_shards(blocks, 400, headroom_mb=0, counts=[2, 4])
    with pytest.raises(
        UserError, match=r"^export.shard_counts has 13, which is not feasible: the model has only 12 blocks"
    ):
        plan_shards(blocks, 400, headroom_mb=0, counts=[13])
    with pytest.raises(UserError, match=r"^export.shard_counts has 0, "):
        plan_shards(blocks, 400, headroom_mb=0, counts=[0])
    with pytest.raises(UserError, match=r"^export.max_configs is 0;"):
        plan_shards(blocks, 400, headroom_mb=0, max_configs=0)


def test_a_block_too_big_for_a_shard_is_named_with_its_excess() -> None:
    blocks = mb_blocks((100, 5), (200, 5), (300, 5), (1400, 30), (100, 5))
    with pytest.raises(UserError) as err:
        plan_shards(blocks, headroom_mb=200)
    assert str(err.value).startswith(
        "block 3 'model.layers.3' has 1400.0 MB of weights but export.max_shard_size_mb is 1200: 200.0 MB too big;"
    )
    with pytest.raises(UserError) as err:
        plan_shards(blocks, max_shard_size_mb=1500, min_vram_mb=1500, headroom_mb=200)
    assert str(err.value).startswith(
        "block 3 'model.layers.3' needs 1630.0 MB (weights 1400.0 + activations 30.0 + headroom 200.0) but "
        "export.min_vram_mb is 1500: 130.0 MB too big; raise export.min_vram_mb"
    )
    with pytest.raises(UserError, match="export.headroom_mb"):
        plan_shards(blocks, min_vram_mb=1500, headroom_mb=1500)


def test_the_figures_of_a_block_too_big_add_up_as_printed() -> None:
    """Every figure is rounded up alike (0.1 MB, or two significant digits below 1 MB), so the weights less the
    limit are the excess, the weights are what to raise the limit to, and the parts add up to the total."""
    import random
    import re

    rng = random.Random(0)
    for _ in range(200):
        weight, activation = rng.uniform(0.01, 3000), rng.uniform(0, 50)
        limit, headroom = round(rng.uniform(0.001, 1) * weight, rng.choice([0, 1, 2, 4])) or 0.001, rng.uniform(0, 9)
        blocks = [Block("b", int(weight * MB), int(activation * MB))]
        with pytest.raises(UserError) as err:
            plan_shards(blocks, max_shard_size_mb=limit, min_vram_mb=1e9, headroom_mb=0)
        has, given, over, least = re.match(
            r"block 0 'b' has ([\d.]+) MB of weights but export.max_shard_size_mb is ([\d.e-]+): ([\d.]+) MB too big; "
            r"raise export.max_shard_size_mb to at least ([\d.]+)\.$",
            str(err.value),
        ).groups()
        assert float(has) == float(least) >= weight and float(given) == limit
        assert float(has) - float(given) == pytest.approx(float(over), abs=1e-9) and float(over) > 0
        vram = round(weight + activation + headroom, 2) * 0.9
        with pytest.raises(UserError) as err:
            plan_shards(blocks, max_shard_size_mb=1e9, min_vram_mb=vram, headroom_mb=headroom)
        total, *parts, over = re.match(
            r"block 0 'b' needs ([\d.]+) MB \(weights ([\d.]+) \+ activations ([\d.]+) \+ headroom ([\d.]+)\) but "
            r"export.min_vram_mb is [\d.e-]+: ([\d.]+) MB too big;",
            str(err.value),
        ).groups()
        assert float(total) == pytest.approx(sum(map(float, parts)), abs=1e-9)
        assert float(total) - vram == pytest.approx(float(over), abs=1e-6) and float(over) > 0
    with pytest.raises(
        UserError, match=re.escape("has 0.84 MB of weights but export.max_shard_size_mb is 0.3: 0.54 MB")
    ):
        plan_shards([Block("b", int(0.84 * MB), 0)], max_shard_size_mb=0.3, headroom_mb=0)


def test_a_thousand_blocks_plan() -> None:
    blocks = [Block(f"b{i}", (20 + i % 7) * MB, MB) for i in range(1000)]
    plans = plan_shards(blocks)
    assert len(plans) == 8
    for plan in plans:
        assert_cover(plan["ranges"], 1000)
        assert max(plan["weight_mb"]) <= 1200 and max(plan["total_mb"]) <= 1500


# --- plan_nodes --------------------------------------------------------------------------------------


def test_largest_remainder_proportions() -> None:
    # 12 x 2048/7680 = 3.2, 12 x 1536/7680 = 2.4, 12 x 4096/7680 = 6.4: floors 3+2+6 = 11, and the last block
    # goes to a remainder of 0.4, tied (exactly: floats would say 0.40000000000000036 vs 0.3999999999999999)
    # between nodes 1 and 2: the larger node takes it.
    assert largest_remainder(12, [2048, 1536, 4096]) == [3, 2, 7]
    plan = plan_nodes(mb_blocks(*[(10, 1)] * 12), [2048, 1536, 4096])
    assert plan["method"] == "largest_remainder"
    assert plan["ranges"] == [[0, 3], [3, 5], [5, 12]]
    assert plan["nodes_mb"] == [2048, 1536, 4096]
    assert plan["weight_mb"] == [30.0, 20.0, 70.0] and plan["total_mb"] == [287.0, 277.0, 327.0]
    assert plan["utilisation"] == [round(287 / 2048, 3), round(277 / 1536, 3), round(327 / 4096, 3)]
    assert largest_remainder(10, [1, 1, 1]) == [4, 3, 3]  # an all-way tie: the earliest node
    assert largest_remainder(7, [3, 1]) == [5, 2]  # 5.25 and 1.75: the remainder .75 wins
    assert largest_remainder(100, [1] * 100) == [1] * 100


def test_every_node_gets_at_least_one_block() -> None:
    # 5 x 100000/100002 rounds to 5 blocks for node 0 and none for the others; each then takes one from it.
    assert largest_remainder(5, [100000, 1, 1]) == [3, 1, 1]
    plan = plan_nodes(mb_blocks(*[(10, 0)] * 5), [100000, 300, 300])
    assert plan["ranges"] == [[0, 3], [3, 4], [4, 5]] and plan["method"] == "largest_remainder"
    with pytest.raises(UserError, match=r"^export.nodes lists 3 nodes but the model has only 2 blocks"):
        plan_nodes(mb_blocks((10, 0), (10, 0)), [2048, 1536, 4096])
    with pytest.raises(UserError, match=r"^export.nodes\[1\] is -5"):
        plan_nodes(mb_blocks((10, 0), (10, 0)), [2048, -5])


def test_a_huge_head_falls_back_to_the_capacity_plan() -> None:
    blocks = mb_blocks(*[(50, 10)] * 11, (1000, 10))
    nodes = [2048, 1536, 1300]
    # Proportions give [5, 4, 3]: the last node would hold two blocks and the head, 1366 MB of its 1300.
    assert largest_remainder(12, nodes) == [5, 4, 3]
    plan = plan_nodes(blocks, nodes)
    assert plan["method"] == "capacity"
    # The head alone on the last node; the other cut stays where the proportions put it (node 1 from block 5).
    assert plan["ranges"] == [[0, 5], [5, 11], [11, 12]]
    for (s, e), mem in zip(plan["ranges"], nodes):
        assert memory(blocks, s, e, 256, 1)[1] <= mem * MB
    brute = min(
        max(memory(blocks, s, e, 256, 1)[1] / (mem * MB) for (s, e), mem in zip(ranges, nodes))
        for ranges in partitions(12, 3)
    )
    assert max(plan["utilisation"]) == round(brute, 3)


def test_the_capacity_plan_is_exact_to_the_byte() -> None:
    # [0,1] [1,5] leaves node 1 five bytes under 10000 MB; [0,2] [2,5] fills it exactly (and is the nearer cut
    # to the proportional [3, 2]): utilisations 1e-9 apart, closer than the bisection resolves alone.
    weights = [5000 * MB + 1, 5000 * MB - 1, 2000 * MB - 2, 1000 * MB - 2, 2000 * MB]
    blocks = [Block(f"b{i}", w, 0) for i, w in enumerate(weights)]
    plan = plan_nodes(blocks, [10000, 10000], headroom_mb=0)
    assert plan["method"] == "capacity"
    assert plan["ranges"] == [[0, 1], [1, 5]]


def test_node_plans_match_brute_force() -> None:
    rng = random.Random(1)
    methods = {"largest_remainder": 0, "capacity": 0, "error": 0}
    for _ in range(600):
        n = rng.randint(1, 8)
        m = rng.randint(1, min(n, 4))
        blocks = random_blocks(rng, n)
        if rng.random() < 0.5:  # a big embedding or head, as real models have
            index = rng.choice([0, n - 1])
            blocks[index] = Block("big", rng.randint(20, 80) * MB // 10, MB)
        headroom, batch = rng.choice([0.0, 1.0]), rng.choice([1, 2])
        # Memories in proportion to random shares, the fleet from a bit short of to twice what the model needs.
        shares = [rng.randint(1, 4) for _ in range(m)]
        need = sum(b.weight_bytes for b in blocks) / MB + m * (headroom + batch)
        nodes = [round(need * rng.uniform(0.9, 2.0) * x / sum(shares), 1) for x in shares]

        def utils(ranges, blocks=blocks, headroom=headroom, batch=batch, nodes=nodes):
            return [memory(blocks, s, e, headroom, batch)[1] / (mem * MB) for (s, e), mem in zip(ranges, nodes)]

        fitting = [max(utils(r)) for r in partitions(n, m) if max(utils(r)) <= 1]
        if not fitting:
            with pytest.raises(UserError, match=r"(node \d+ \(|block \d+ ').* MB too big"):
                plan_nodes(blocks, nodes, headroom, batch)
            methods["error"] += 1
            continue
        plan = plan_nodes(blocks, nodes, headroom, batch)
        methods[plan["method"]] += 1
        assert_cover(plan["ranges"], n)
        got = utils(plan["ranges"])
        assert max(got) <= 1
        proportional = largest_remainder(n, nodes)
        if plan["method"] == "largest_remainder":
            assert [e - s for s, e in plan["ranges"]] == proportional
        else:
            starts = list(itertools.accumulate([0, *proportional]))
            assert max(utils([[starts[i], starts[i + 1]] for i in range(m)])) > 1  # the split really broke
            assert math.isclose(max(got), min(fitting), rel_tol=1e-12)  # exact: the least largest utilisation
    assert min(methods.values()) > 40, methods


def test_infeasible_nodes_name_the_node_and_the_block() -> None:
    blocks = mb_blocks((100, 0), (100, 0), (5000, 0), (100, 0))
    with pytest.raises(UserError) as err:
        plan_nodes(blocks, [4096, 2048, 1024])
    assert str(err.value).startswith(
        "block 2 'model.layers.2' needs 5256.0 MB (with export.headroom_mb=256) but the largest node, node 0, "
        "has 4096 MB: 1160.0 MB too big;"
    )
    with pytest.raises(UserError) as err:
        plan_nodes(mb_blocks(*[(100, 0)] * 4), [4096, 300, 4096])
    assert str(err.value).startswith(
        "node 1 (300 MB) must hold at least one block but cannot hold even block 1 'model.layers.1', the smallest "
        "it could start at, which needs 356.0 MB: 56.0 MB too big;"
    )
    with pytest.raises(UserError) as err:
        plan_nodes(mb_blocks(*[(200, 0)] * 4), [600, 600])
    assert str(err.value).startswith(
        "node 1 (600 MB), the last in export.nodes, would have to hold blocks 1-3, which need 856.0 MB: "
        "256.0 MB too big;"
    )


# --- bench and packaging -----------------------------------------------------------------------------


def test_bench_returns_the_metrics() -> None:
    config = compose("recipe=bench_shard_plan", "task.repeats=2", "task.blocks=40")
    assert config.task.name == "bench_shard_plan"
    metrics = bench(config)
    assert metrics["export/plan_blocks"] == 40 and metrics["export/plan_nodes"] == 10
    counts = metrics["export/shard_counts"]
    assert len(counts) > 1 and counts == list(range(counts[0], counts[0] + len(counts)))
    for key in (
        "shard_plan_s",
        "shard_plan_first_s",
        "node_plan_s",
        "node_plan_first_s",
        "shard_plan_every_count_s",
    ):
        assert isinstance(metrics[f"export/{key}"], float)  # timings: read them in the bench, not here
    assert metrics["export/node_plan_method"] in ("largest_remainder", "capacity")
    assert 0 < metrics["export/node_max_utilisation"] <= 1
    default = bench(compose("recipe=bench_shard_plan", "task.repeats=1"))
    assert default["export/plan_blocks"] == 100 and len(default["export/shard_counts"]) == 8


def test_the_planner_does_not_import_torch() -> None:
    code = "import sys, onn.export.shards; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
