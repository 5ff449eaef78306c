"""Sixth review of paired data: task=infer and validation rank by blocks of queries (the whole score matrix of
100,000 queries against 100,000 items is 40 GB), ties and all as one matrix ranked them; a diverged model's NaN
scores retrieve nothing rather than everything; and in a multi-process run rank 0 alone writes the run's files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import compose
from test_pairs_review5 import SMALL
from test_pairs_review5 import run as pairs_run

from onn.errors import UserError
from onn.modalities.pairs.demo import write_shapes

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def run(tmp: Path, *overrides: str, name: str = "run") -> tuple[dict, Path]:
    """The run `python run.py data=pairs model=dual_encoder OVERRIDES` makes in float32, in tmp/name."""
    return pairs_run(tmp, *overrides, name=name, fixed=("strategy.precision=32-true",))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A dual encoder trained one epoch on 12 shapes (16x16): (its run folder, the shapes)."""
    tmp = tmp_path_factory.mktemp("trained")
    shapes = write_shapes(tmp / "shapes", 12, seed=0, size=16)
    _, run_dir = run(tmp, f"data.source={shapes}", "data.batch_size=4", *SMALL, name="train")
    return run_dir, shapes


def alike(rows: int, dim: int, seed: int) -> torch.Tensor:
    """Vectors of -0.5, 0 and 0.5: their dot products are exact in any summation order (and under TF32), so a
    block of rows scores bit for bit as the whole matrix does, and many scores are equal."""
    return torch.randint(-1, 2, (rows, dim), generator=torch.Generator().manual_seed(seed)).float() / 2


def one_shot(q: torch.Tensor, g: torch.Tensor, partners: dict[int, int], k: int):
    """What task=infer computed before: the whole score matrix, sorted stably, and the partners ranked in it."""
    from onn.modalities.pairs.module import ranks

    scores = q @ g.T
    order = scores.sort(dim=1, descending=True, stable=True)
    known = torch.tensor(list(partners), dtype=torch.long)
    placed = ranks(scores[known], torch.tensor(list(partners.values()), dtype=torch.long))
    return order.values[:, :k], order.indices[:, :k], placed


@pytest.mark.parametrize("device", DEVICES)
def test_infer_ranks_blocks_of_queries_as_the_whole_matrix_did_ties_included(device):
    """task=infer made the whole [queries, gallery] score matrix at once (100,000 x 100,000: 40 GB, then as much
    again on the host). Scored a block of queries at a time, each block's top matches found by torch.topk, the
    matches, their order among equal scores (the lower gallery index first) and the partners' ranks are the one
    matrix's, whatever the block."""
    from onn.modalities.pairs.tasks import ranked

    q, g = alike(23, 6, 0), alike(40, 6, 1)
    g[10:20] = g[0]  # ten copies of one item: ties across the k-th place
    partners = {r: (7 * r) % 40 for r in range(0, 23, 2)}
    for k in (5, 40):
        values, columns, placed = one_shot(q, g, partners, k)
        if k < 40:  # the k-th and the next score are equal in some rows: which tied item is kept matters
            kth_ties = (q @ g.T).sort(dim=1, descending=True).values[:, k - 1 : k + 1]
            assert bool((kth_ties[:, 0] == kth_ties[:, 1]).any())
        for rows in (1, 3, 7, 23, 100):
            got = ranked(q.to(device), g.to(device), partners, k, rows)
            assert all(t.device.type == "cpu" for t in got)
            assert torch.equal(got[0], values) and torch.equal(got[1], columns) and torch.equal(got[2], placed), rows


def test_a_block_of_scores_is_a_share_of_the_plans_memory():
    """The rows a block holds come from the memory the plan leaves the run, not a constant: 100,000 queries
    against 100,000 items in blocks of a few thousand rows on an 80 GB card, a few hundred on a 4 GB one, at least
    one row however little there is."""
    from onn.modalities.pairs.module import SCORE_BYTES, SCORE_SHARE, block_rows

    gib = 2.0**30
    for budget in (4 * gib, 80 * gib):
        rows = block_rows(100_000, budget)
        assert 100 < rows < 100_000
        assert rows * 100_000 * SCORE_BYTES <= SCORE_SHARE * budget < (rows + 1) * 100_000 * SCORE_BYTES
    assert block_rows(100_000, 80 * gib) > 10 * block_rows(100_000, 4 * gib)
    assert block_rows(100_000, 0.0) == block_rows(100_000, -1.0) == 1


def test_infer_runs_in_blocks_sized_by_the_plan_and_ranks_as_one_block(trained, tmp_path, monkeypatch):
    """Twelve captions against the twelve pictures, in blocks of 5 queries: the matches and the partners' ranks
    are those of one block; the block's rows were sized from the plan's budget less its context."""
    from onn.modalities.pairs import tasks

    run_dir, shapes = trained
    queries = tmp_path / "queries"
    queries.mkdir()
    for caption in shapes.glob("*.txt"):
        shutil.copy(caption, queries / caption.name)
    common = ("task=infer", f"ckpt={run_dir}", f"task.input={queries}", f"task.gallery={shapes}", "task.top_k=4")
    whole, _ = run(tmp_path, *common, name="whole")
    asked, blocks, found = [], [], tasks.top_matches

    def five_rows(columns: int, budget: float) -> int:
        asked.append((columns, budget))
        return 5

    def counted(scores, k):
        blocks.append(len(scores))
        return found(scores, k)

    monkeypatch.setattr(tasks, "block_rows", five_rows)
    monkeypatch.setattr(tasks, "top_matches", counted)
    out, block_dir = run(tmp_path, *common, name="blocks")
    assert blocks == [5, 5, 2]
    plan = yaml.safe_load((block_dir / "plan.yaml").read_text())
    assert asked == [(12, (plan["budget_mb"] - plan["context_mb"]) * 2**20)]
    rows, one = ([json.loads(line) for line in Path(o["infer/output"]).read_text().splitlines()] for o in (out, whole))
    assert [r["query"] for r in rows] == [f"{i:04d}.txt" for i in range(12)]
    assert [r["partner"] for r in rows] == [f"{i:04d}.png" for i in range(12)]
    assert [(r["partner_rank"], [m["name"] for m in r["matches"]]) for r in rows] == [
        (r["partner_rank"], [m["name"] for m in r["matches"]]) for r in one
    ]
    assert all(len(r["matches"]) == 4 for r in rows)
    assert {k: v for k, v in out.items() if k.startswith("infer/recall")} == {
        k: v for k, v in whole.items() if k.startswith("infer/recall")
    }


def test_validation_ranks_and_scores_its_loss_by_blocks_as_one_matrix(monkeypatch):
    """Validation made the whole held-out [n, n] similarity, its group mask and the masks ranking makes of them at
    once (30,000 held-out pairs: about 20 GB), and the loss's logits besides. By blocks of rows sized from the
    plan (module.score_budget) the recall figures are the one matrix's, ties and shared files included, and the
    loss is the same cross-entropy."""
    import lightning as L

    from onn.modalities.pairs import module as pairs_module
    from onn.modalities.pairs.module import DualEncoder, retrieval_metrics

    a, b = alike(11, 4, 2), alike(11, 4, 3)
    b[5] = b[6] = a[5]  # ties, and a partner tied with an earlier item
    groups = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 5, 5, 6])
    for by in (None, groups):
        whole = retrieval_metrics(a, b, ("image", "text"), "val", by)
        for rows in (1, 2, 5):
            assert retrieval_metrics(a, b, ("image", "text"), "val", by, rows) == whole, rows

    cfg = compose("data=pairs", "model=dual_encoder", "optim.warmup_steps=0")
    torch.manual_seed(0)
    encoder = DualEncoder({"image": torch.nn.Linear(8, 6), "text": torch.nn.Linear(8, 6)}, 6, cfg.model, cfg.optim, {})
    x, y = torch.randn(9, 8), torch.randn(9, 8)
    unit = [encoder.embed(n, v).detach() for n, v in (("image", x), ("text", y))]
    torch.testing.assert_close(encoder.loss(*unit, rows=2), encoder.loss(*unit), rtol=1e-6, atol=1e-6)

    seen, ranked = [], pairs_module.partner_ranks

    def counted(a, b, rows, groups=None, backward=False):
        seen.append(rows)
        return ranked(a, b, rows, groups, backward)

    monkeypatch.setattr(pairs_module, "partner_ranks", counted)
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 9, 4)]
    figures = []
    for budget in (None, 1.0):  # one block; one row a block
        encoder.score_budget = budget
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        trainer.validate(encoder, dataloaders=torch.utils.data.DataLoader(batches, None), verbose=False)
        figures.append(dict(encoder.last_metrics))
    assert seen == [9, 9, 1, 1]
    loss_whole, loss_blocks = (f.pop("val/loss") for f in figures)
    assert figures[0] == figures[1] and loss_blocks == pytest.approx(loss_whole, rel=1e-6)


def test_a_diverged_models_nan_embeddings_retrieve_nothing():
    """NaN scores compare below nothing, so every partner ranked first: a diverged dual encoder scored recall@1
    1.0 in validation, and best.ckpt (the highest val/recall@1) was the diverged one."""
    from onn.modalities.pairs.module import ranks, retrieval_metrics

    nan = float("nan")
    similarity = torch.tensor([[0.9, 0.1, 0.2], [nan, nan, nan], [0.1, 0.3, 0.2], [0.5, nan, 0.1]])
    assert ranks(similarity, torch.tensor([0, 1, 2, 1])).tolist() == [0, 3, 1, 3]  # a NaN partner: past the last
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    figures = retrieval_metrics(torch.full_like(a, nan), b, ("image", "text"), "val")
    assert figures["val/recall@1"] == figures["val/recall@5"] == 0.0


def test_infer_with_a_checkpoint_that_embeds_nan_says_so(trained, tmp_path):
    """A checkpoint whose weights diverged (NaN) ranked its gallery by NaN scores and wrote them as matches without
    a word; it is one sentence naming the checkpoint and a NaN weight, said before anything is embedded."""
    from safetensors.torch import load_file, save_file

    run_dir, shapes = trained
    diverged = shutil.copytree(run_dir, tmp_path / "diverged")
    for tensors in (diverged / "checkpoints").glob("*.ckpt/model.safetensors"):
        weights = load_file(str(tensors))
        poisoned = {k: torch.full_like(v, float("nan")) if "projections." in k else v for k, v in weights.items()}
        assert poisoned.keys() == weights.keys() and any("projections." in k for k in weights)
        save_file(poisoned, str(tensors))
    with pytest.raises(UserError, match=r"^ckpt .*diverged.* cannot be used for task=infer: its weight projections\."):
        run(tmp_path, "task=infer", f"ckpt={diverged}", f"task.gallery={shapes}", "prompt=a red square")


def test_a_process_of_rank_one_writes_no_matches_and_no_export(trained, tmp_path, monkeypatch):
    """Every process of a torchrun launch ran task=infer and task=export in full and wrote matches.jsonl and the
    export folder, each over the others' files; rank 0 alone writes them, and the others still rank alike."""
    run_dir, shapes = trained
    common = ("task=infer", f"ckpt={run_dir}", f"task.gallery={shapes}", "prompt=a red square on the left")
    monkeypatch.setenv("RANK", "1")
    out, _ = run(tmp_path, *common, name="infer1")
    assert out["infer/gallery"] == 12 and not Path(out["infer/output"]).exists()
    exported, other_export = run(tmp_path, "task=export", "export=safetensors", f"ckpt={run_dir}", name="export1")
    assert exported.get("export/path") is None and not (other_export / "export").exists()
    monkeypatch.delenv("RANK")
    first, _ = run(tmp_path, *common, name="infer0")
    assert Path(first["infer/output"]).is_file() and first["infer/gallery"] == out["infer/gallery"]
    exported, _ = run(tmp_path, "task=export", "export=safetensors", f"ckpt={run_dir}", name="export0")
    assert (Path(exported["export/path"]) / "model.safetensors").is_file()


def test_pairs_fractions_and_the_evaluation_batch_are_checked_before_any_pair_is_read(tmp_path):
    """data.val_split=0 was said once every pair was decoded; data.max_bad_fraction=-0.1 failed a folder of
    readable pairs as "0 of 12 pairs cannot be read"; data.eval_batch_size=-1 embedded nothing. Each is one sentence
    before the source is even looked at (it does not exist here)."""
    for key, said in (
        ("data.val_split=0", r"data.val_split=0.0: give the fraction of the pairs held out"),
        ("data.max_bad_fraction=-0.1", r"data.max_bad_fraction=-0.1: give a fraction from 0 to 1"),
        ("data.eval_batch_size=-1", r"data.eval_batch_size=-1: give a number of pairs, 1 or more"),
    ):
        with pytest.raises(UserError, match=rf"^{said}"):
            run(tmp_path, "data.source=/nowhere", key)


_TRAIN_RANK = """
import json, sys
from pathlib import Path
sys.path.insert(0, "tests")
import torch.distributed as dist
from conftest import compose
from onn.app import execute
from onn.modalities.pairs import tasks
from onn.training import checkpoints

rank, source, folder = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
calls = []


def spied(name, real):
    def called(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)
    return called


tasks.export_module = spied("export", tasks.export_module)  # what writes export/
checkpoints.run_best = spied("run_best", checkpoints.run_best)  # what copies a resumed run's best.ckpt in
config = compose(
    "data=pairs", "model=dual_encoder", "hardware=cpu_16gb", "tracking=none", "trainer.enable_progress_bar=false",
    f"data.source={source}", f"paths.cache={folder / 'cache'}", f"paths.outputs={folder / 'outputs'}",
    "data.batch_size=2", "data.eval_batch_size=4", "data.val_split=0.25", "trainer.max_steps=-1",
    "trainer.max_epochs=1", "trainer.val_check_interval=1.0", "optim.warmup_steps=0", "strategy.precision=32-true",
    "trainer.devices=2", "strategy.timeout_s=60", "export=safetensors", "data.sides.image.image_size=[16,16]",
    "data.sides.text.max_length=32", "model.feature_dim=16", "model.embed_dim=8",
)
metrics = execute(config, folder / "run")
if dist.is_initialized():
    dist.destroy_process_group()
print(json.dumps({"calls": calls, "best": metrics["checkpoint_best"], "recall": metrics["val/recall@1"],
                  "export": metrics.get("export/path")}))
"""


@pytest.mark.slow  # two fresh interpreters form a gloo group and train an epoch: ~30 s
def test_two_processes_train_and_rank_zero_alone_writes_the_export(tmp_path: Path):
    """trainer.devices=2: both processes exported the dual encoder into one folder (each staged it and swapped it in
    over the other's) and both ran run_best, which copies a resumed run's best.ckpt over the one the other is
    copying. Rank 0 alone does; both validate the best checkpoint it names, with the same figures."""
    from test_distributed_review import two_ranks

    shapes = write_shapes(tmp_path / "shapes", 12, seed=0, size=16)
    zero, one = two_ranks(_TRAIN_RANK, str(shapes), str(tmp_path))
    assert zero["calls"] == ["run_best", "export"] and one["calls"] == []
    assert zero["best"] == one["best"] and Path(zero["best"]).is_dir() and zero["recall"] == one["recall"]
    assert (Path(zero["export"]) / "model.safetensors").is_file() and one["export"] is None
    assert not [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".export")]  # nothing staged left
