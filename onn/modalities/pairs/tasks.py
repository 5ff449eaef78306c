"""plan, train, eval, infer and export of a dual encoder on paired data.

plan    both towers sized on the meta device, one network plan for the pair (onn.planning)
train   epochs over the resident pairs; retrieval recall on the held-out pairs every validation;
        best.ckpt by val/recall@1 beside last.ckpt; resume with the history
eval    the retrieval recall of a checkpoint on its own held-out pairs, or on every pair of a data.source given now
infer   a query (task.input: a file or folder, or prompt="..." for text) against task.gallery, a
        folder of the other side: the ranked matches as JSONL, scored a block of queries at a time
export  safetensors (the whole dual encoder + config.json), or each tower to ONNX (stored batch ->
        unit embedding), checked in onnxruntime

In a multi-process run (trainer.devices=2, torchrun) every process trains and validates, and rank 0 alone writes
what the run leaves (matches.jsonl, exports, the best checkpoint a resumed run copies in).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from onn.config import ONNConfig, as_dict, typed
from onn.config.data import PairsData, eval_batch
from onn.config.export import OnnxExport, SafetensorsExport
from onn.config.model import DualEncoderConfig
from onn.config.task import InferTask
from onn.data.files import existing_source, walk_files, write_jsonl
from onn.data.resident import HELD_OUT_RULE, drawn_by_name
from onn.errors import UserError
from onn.export.write import export_after_training
from onn.hardware.cluster import is_rank_zero
from onn.hardware.memory import PeakMemory
from onn.hardware.profile import Profile
from onn.modalities.base import Job, PairSide
from onn.modalities.pairs.data import PairData, identity
from onn.modalities.pairs.detect import SNIFF_FILES, Entry, find_pairs
from onn.modalities.pairs.module import KS, MONITOR, DualEncoder, block_rows, ranks
from onn.modalities.pairs.sides import STATS_USED, TEXT, build_side, modality_of, saved_side, side_config
from onn.planning.costs import MB
from onn.planning.plan import Plan, make_plan
from onn.planning.spec import network_spec
from onn.training.callbacks import StepClock, run_callbacks
from onn.training.checkpoints import check_finite, check_state, resumed_optim, saved_config, shared_best, state_shapes
from onn.training.checkpoints import load as load_checkpoint
from onn.training.classifier import evaluation_autocast, to_device
from onn.training.trainer import build_trainer, optimizer_steps

log = logging.getLogger("onn")
READ_CHUNK = 1024  # gallery items decoded at a time by embed_all: 1,024 pictures of 224 px are 150 MB of pixels


def modalities(config: ONNConfig) -> tuple[str, str]:
    """data.modalities, or (auto) the two that data.source pairs most."""
    data: PairsData = config.data
    if data.modalities not in (None, "auto"):
        a, b = data.modalities
        return str(a), str(b)
    if not data.source:
        raise UserError(
            "data.modalities=auto finds the sides in data.source, which is not set; set data.source "
            "(or data.modalities=[image, text] to plan without data)."
        )
    return find_pairs(data.source, "auto", data.text_column, limit=SNIFF_FILES).modalities


def sides_of(config: ONNConfig, ckpt: Path | None = None) -> dict[str, PairSide]:
    """The two sides, from the side configs a checkpoint saved or from this config."""
    if ckpt is not None:
        where = f"ckpt {ckpt}"
        sides = saved_config(ckpt, "pairs")["sides"]
        return {name: build_side(name, saved_side(name, side, where)) for name, side in sides.items()}
    return {name: build_side(name, side_config(name, config)) for name in modalities(config)}


def build(config: ONNConfig, sides: dict[str, PairSide], strategy: str = "full") -> DualEncoder:
    """The dual encoder of config.model over the sides' encoders; its onn_config (saved in every checkpoint,
    plain values) rebuilds it."""
    torch.manual_seed(config.seed)
    model: DualEncoderConfig = config.model
    names = list(sides)
    onn_config = {
        "model": as_dict(model),
        "strategy": {**as_dict(config.strategy), "name": strategy},
        "modality": "pairs",
        "seed": config.seed,
        "held_out_rule": HELD_OUT_RULE,  # how the seed draws the held-out pairs: an earlier ONN's checkpoint lacks it
        "data": {**as_dict(config.data), "modalities": names},
        "optim": as_dict(config.optim),  # what a resumed run's optimizer state belongs to (resumed_optim)
        "sides": {n: {**as_dict(s.config), STATS_USED: True} for n, s in sides.items()},
    }
    return DualEncoder(
        {n: s.encoder(model.feature_dim) for n, s in sides.items()},
        model.feature_dim,
        model,
        config.optim,
        onn_config,
    )


def plan(modality, config: ONNConfig, hardware: Profile, use_tuned: bool = True):
    """One network plan for both towers: their parameters, FLOPs and saved activations per pair, added."""
    sides = sides_of(config)
    width = config.model.feature_dim
    specs = []
    for name, side in sides.items():
        with torch.device("meta"):
            tower = side.encoder(width)
        # the network's input is the transform's output (a spectrogram, normalised pixels)
        x = tower.prepare(side.sample(1), train=False).to("meta")
        specs.append(network_spec(tower.network, x, name, pretrained=False))
    a, b = specs
    dim = config.model.embed_dim
    # both towers' memory-bound traffic, or none where one could not be counted (the planner then falls back)
    step_bytes = a.sample_step_bytes + b.sample_step_bytes if a.sample_step_bytes and b.sample_step_bytes else 0
    spec = replace(
        a,
        name=f"{config.model.name} ({' + '.join(sides)})",
        params=a.params + b.params + 2 * width * dim,
        block_params=a.block_params + b.block_params,
        prefix_params=a.prefix_params + b.prefix_params,
        suffix_params=a.suffix_params + b.suffix_params,
        lora_params_per_block=[0] * (a.n_blocks + b.n_blocks),
        linear_params_per_block=[0] * (a.n_blocks + b.n_blocks),
        layer_map=f"{a.name}: {a.layer_map}; {b.name}: {b.layer_map}",
        sample_activation_bytes=a.sample_activation_bytes + b.sample_activation_bytes,
        sample_flops=a.sample_flops + b.sample_flops,
        sample_step_bytes=step_bytes,
        head_params=0,
    )
    return make_plan(config, hardware, spec, use_tuned=use_tuned), spec


def load_trained(config: ONNConfig, ckpt: Path) -> DualEncoder:
    """The dual encoder of the checkpoint, for task=eval, infer and export (training resumes through Lightning):
    weights that hold NaN or inf are refused here, before any item is embedded as NaN."""
    saved = saved_config(ckpt, "pairs")
    model = typed(DualEncoderConfig, saved["model"], f"ckpt {ckpt}: model")
    module = build(replace(config, model=model), sides_of(config, ckpt))
    check_state(module, state_shapes(ckpt), ckpt)  # names and shapes, before torch's traceback would
    missing, unexpected = module.load_state_dict(load_checkpoint(ckpt)["state_dict"], strict=False)
    if missing or unexpected:
        raise UserError(
            f"ckpt {ckpt} does not match the dual encoder it names: missing {missing[:3]}, unexpected {unexpected[:3]}."
        )
    check_finite(module, f"ckpt {ckpt}", config.task.name)
    return module


def _callbacks(config: ONNConfig, run_dir: Path) -> list:
    return run_callbacks(config, run_dir, MONITOR, "max")


def score_budget(plan: Plan) -> float:
    """Bytes of the plan's memory budget its context leaves: what blocks of scores are sized from (block_rows)."""
    return (plan.budget_mb - plan.context_mb) * MB


def data_metrics(dm: PairData) -> dict[str, Any]:
    listing = dm.listing
    return {
        "pairs/modalities": list(dm.sides),
        "pairs/found": listing.summary(),
        "pairs/complete": listing.complete,
        "pairs/orphans": listing.orphan_count,
        "pairs/orphans_by_modality": {m: len(v) for m, v in listing.orphans.items()},
        "pairs/left_out": len(listing.left_out),
        "pairs/unreadable": listing.complete - len(dm.splits["train"]) - len(dm.splits["val"]),
        "pairs/train": len(dm.splits["train"]),
        "pairs/held_out": len(dm.splits["val"]),
    }


def train(job: Job) -> dict[str, Any]:
    config, plan_, run_dir, ckpt = job.config, job.plan, job.run_dir, job.ckpt
    if ckpt is not None:  # a resumed run keeps its sides, its held-out split and the optimizer its state belongs to
        config = replace(config, seed=int(saved_config(ckpt, "pairs")["seed"]), optim=resumed_optim(config.optim, ckpt))
    sides = sides_of(config, ckpt)
    dm = PairData(config, sides, job.device)
    dm.setup()
    module = build(config, sides, plan_.strategy)
    if ckpt is not None and not drawn_by_name(saved_config(ckpt, "pairs"), ckpt, draws=not config.data.val_source):
        del module.onn_config["held_out_rule"]  # it trained on an earlier ONN's split: its checkpoints say so too
    module.held_out_groups = dm.val_groups
    module.score_budget = score_budget(plan_)
    callbacks = _callbacks(config, run_dir)
    clock = next(c for c in callbacks if isinstance(c, StepClock))
    steps_per_epoch = len(dm.train_dataloader())  # one rank's share: PairData counts the processes the config starts
    trainer = build_trainer(config, plan_, run_dir, callbacks, steps_per_epoch=steps_per_epoch)
    module.optimizer_steps = optimizer_steps(trainer, steps_per_epoch, per_process=True)
    with PeakMemory(job.device) as peak:
        trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt) if ckpt else None)
        trainer.save_checkpoint(str(run_dir / "checkpoints" / "last.ckpt"), weights_only=False)  # said: no log line
    # the whole run's, resumed too: rank 0 copies a resumed run's earlier best.ckpt in, and every rank validates it
    # once that is done (the broadcast waits for rank 0)
    writes = is_rank_zero()
    best = shared_best(trainer, ckpt, run_dir, MONITOR, "max")[0]
    metrics: dict[str, Any] = {
        **data_metrics(dm),
        "epochs": trainer.current_epoch,
        "steps": trainer.global_step,
        "train/loss_initial": float(module.train_losses[0]) if module.train_losses else None,
        "train/loss_final": module.final_loss(),
        "val/history": module.history,
        "samples_per_s": clock.samples_per_s(skip=min(2, len(clock.step_s) - 1)),
        "peak_memory_mb": round(peak.peak_mb, 1),
        "params_total": sum(p.numel() for p in module.parameters()),
        "checkpoint": str(run_dir / "checkpoints" / "last.ckpt"),
        "checkpoint_best": best,
        "resumed_from": str(ckpt) if ckpt else None,
    }
    # the figures of the best checkpoint
    trainer.validate(module, datamodule=dm, ckpt_path=best, verbose=False)
    metrics.update({k: round(v, 5) for k, v in module.last_metrics.items()})
    metrics["val/recall@1_over_chance"] = round(metrics["val/recall@1"] / metrics["val/recall@1_chance"], 2)
    log.info(
        "held-out retrieval: recall@1 %.4f (chance %.4f), recall@5 %.4f",
        metrics["val/recall@1"],
        metrics["val/recall@1_chance"],
        metrics["val/recall@5"],
    )
    if writes and config.export.name != "none":
        export_after_training(metrics, run_dir, lambda: export_module(config, module, run_dir))
    return metrics


def evaluate(job: Job) -> dict[str, Any]:
    config = job.config
    if job.ckpt is None:
        raise UserError("task=eval on paired data needs ckpt=RUN_DIR (a trained dual encoder).")
    module = load_trained(config, job.ckpt)
    saved = saved_config(job.ckpt, "pairs")
    data = config.data if config.data.source else typed(PairsData, saved["data"], f"ckpt {job.ckpt}: data")
    # a data.source the command line gives is scored whole (app.from_checkpoint sets data.val_source to it); without
    # one, the seed the run held its pairs out with gives the same held-out pairs
    given = config.data.val_source
    if given:
        data = replace(data, source=given)
    run = replace(config, seed=int(saved["seed"]), data=replace(data, modalities=list(module.names)))
    drawn_by_name(saved, job.ckpt, draws=not data.val_source)
    dm = PairData(run, sides_of(config, job.ckpt), job.device, whole=bool(given))
    dm.setup()
    module.held_out_groups = dm.val_groups
    module.score_budget = score_budget(job.plan)
    trainer = build_trainer(config, job.plan, job.run_dir, [], loggers=False, steps_per_epoch=1)
    trainer.validate(module, datamodule=dm, verbose=False)
    metrics = {
        "checkpoint": str(job.ckpt),
        **data_metrics(dm),
        **{k: round(v, 5) for k, v in module.last_metrics.items()},
    }
    if is_rank_zero():
        print("  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float)))
    return metrics


# ---------------------------------------------------------------------------------------------------------
# infer: a query against a gallery


def files_of(path: Path, key: str) -> dict[str, list[tuple[str, Path]]]:
    """The files of a file or folder by modality (as the registered sniffers see their suffixes), each with its name
    under the folder (a1/0001.png: matches.jsonl names it so, beside a2/0001.png)."""
    path = existing_source(path, key)
    found = [(rel, full) for rel, full in walk_files(path)] if path.is_dir() else [(path.name, path)]
    kinds: dict[str, str | None] = {}
    out: dict[str, list[tuple[str, Path]]] = {}
    for rel, full in sorted(found):
        suffix = full.suffix.lower()
        if suffix not in kinds:
            kinds[suffix] = modality_of(suffix, full)
        if kinds[suffix] is not None:
            out.setdefault(kinds[suffix], []).append((rel, full))
    return out


def partners_of(queries: list[tuple[str, Path | str]], gallery: list[tuple[str, Path]]) -> dict[int, int]:
    """{query position: its partner's gallery position} for the file queries whose partner the gallery holds: the
    file of the query's stem in the same folder (the pairs convention), else of its name's stem under the two
    folders (a copied tree: queries/a/0001.png, gallery/a/0001.txt), else of its bare stem when one gallery file
    has it. A bare stem that several subfolders share names no partner rather than a wrong one."""
    beside: dict[Path, int] = {}
    under: dict[str, int] = {}
    stems: dict[str, list[int]] = {}
    for j, (rel, full) in enumerate(gallery):
        beside.setdefault(full.resolve().with_suffix(""), j)
        under.setdefault(str(Path(rel).with_suffix("")), j)
        stems.setdefault(Path(rel).stem, []).append(j)
    partners = {}
    for r, (rel, item) in enumerate(queries):
        if not isinstance(item, Path):  # a prompt has no partner
            continue
        only = stems.get(Path(rel).stem, [])
        found = [beside.get(item.resolve().with_suffix("")), under.get(str(Path(rel).with_suffix("")))]
        found = [j for j in (*found, only[0] if len(only) == 1 else None) if j is not None]
        if found:
            partners[r] = found[0]
    return partners


def embed_all(
    module: DualEncoder,
    name: str,
    side: PairSide,
    items: list,
    device: torch.device,
    batch: int,
    chunk: int = READ_CHUNK,
    autocast: contextlib.AbstractContextManager | None = None,
) -> tuple[torch.Tensor, list[int], list[str]]:
    """Unit embeddings of the items that decode, their positions, and the skips. The items are decoded `chunk` at
    a time (rounded to whole batches), so a gallery of 100,000 pictures holds one chunk's pixels on the host, not
    all of them. Each batch goes to the device from pinned memory (to_device), so the host queues the next while
    the GPU embeds this one. The chunks are of even sizes (in whole batches), not full ones and a short rest: a
    side's read refuses a set of which nothing decodes, as a rest of one unreadable picture would be. `autocast`:
    the mixed precision validation embeds under (evaluation_autocast), around the network only, not the reading."""
    count = max(1, -(-len(items) // chunk))
    even = max(1, -(-len(items) // count))
    chunk = -(-even // batch) * batch
    embedded, index, skipped = [], [], []
    for start in range(0, len(items), chunk):
        stored, placed, bad = side.read(items[start : start + chunk])
        index += [start + i for i in placed]
        skipped += [f"{_label(items[start + i])}: {reason}" for i, reason in bad]
        for i in range(0, len(stored), batch):
            x = to_device(stored[i : i + batch], device)
            with torch.no_grad(), autocast or contextlib.nullcontext():
                embedded.append(module.embed(name, x))
    dim = module.projections[name].out_features
    return (torch.cat(embedded) if embedded else torch.zeros(0, dim, device=device)), index, skipped


def infer(job: Job) -> dict[str, Any]:
    config = job.config
    task: InferTask = config.task
    if job.ckpt is None:
        raise UserError("task=infer on paired data needs ckpt=RUN_DIR (a trained dual encoder).")
    if not task.gallery:
        raise UserError(
            "task=infer on paired data needs task.gallery=FOLDER (the files to rank) and a query: "
            "task.input=FILE|FOLDER, "
            'or prompt="..." for a text query.'
        )
    module = load_trained(config, job.ckpt)
    names = list(module.names)
    sides = sides_of(config, job.ckpt)
    if task.input:
        queries = {m: f for m, f in files_of(Path(task.input).expanduser(), "task.input").items() if m in names}
        if not queries:
            raise UserError(f"task.input={task.input} holds no {' or '.join(names)} files this dual encoder reads.")
        query = max(queries, key=lambda m: len(queries[m]))
        query_files: list[tuple[str, Path | str]] = list(queries[query])
    elif config.prompt and TEXT in names:
        query, query_files = TEXT, [(str(config.prompt), str(config.prompt))]
    else:
        raise UserError(
            f"task=infer needs a query: task.input=FILE|FOLDER of {' or '.join(names)} files"
            f"{', or prompt=... (this model has a text side)' if TEXT in names else ''}."
        )
    other = next(n for n in names if n != query)
    gallery = files_of(Path(task.gallery).expanduser(), "task.gallery").get(other, [])
    if not gallery:
        raise UserError(f"task.gallery={task.gallery} holds no {other} files to rank against the {query} queries.")
    device = torch.device(job.device)
    module = module.to(device).eval()
    batch = eval_batch(config.data)
    # under the plan's mixed precision, as validation embeds the held-out pairs: a bf16 tower puts close calls
    # otherwise than float32 would, and infer's ranks and recall would not be task=eval's
    mixed = evaluation_autocast(config, job.plan, device)
    q, q_index, q_skipped = embed_all(
        module, query, sides[query], [f for _, f in query_files], device, batch, autocast=mixed
    )
    g, g_index, g_skipped = embed_all(
        module, other, sides[other], [f for _, f in gallery], device, batch, autocast=mixed
    )
    for skipped in (q_skipped, g_skipped):
        if skipped:
            log.warning("infer: %d items could not be read and are left out: %s", len(skipped), "; ".join(skipped[:3]))
    if not len(q) or not len(g):
        raise UserError("task=infer: no query or no gallery item could be read (see the warnings above).")
    if not bool(torch.isfinite(q).all() & torch.isfinite(g).all()):
        raise UserError(
            f"ckpt {job.ckpt}: the dual encoder embeds some items as NaN or inf (its weights diverged, or overflow "
            "under mixed precision), so no ranking means anything; use an earlier checkpoint or strategy.precision="
            "32-true."
        )
    top_k = min(task.top_k, len(g))
    column = {i: c for c, i in enumerate(g_index)}  # a gallery file's column among those that decoded
    partners = {r: column[j] for r, j in partners_of([query_files[i] for i in q_index], gallery).items() if j in column}
    asked = [query_files[i][0] for i in q_index]
    keys = answer_keys(query, [query_files[i][1] for i in q_index], other, [gallery[i][1] for i in g_index], partners)
    rows_at_once = block_rows(len(g), score_budget(job.plan))
    scores, columns, partner_ranks = ranked(q, g, partners, top_k, rows_at_once, keys)
    rows = matches(scores, columns, partner_ranks, asked, query, [gallery[i][0] for i in g_index], partners)
    output = Path(task.output).expanduser() if task.output else job.run_dir / "matches.jsonl"
    if is_rank_zero():  # every process of a torchrun launch ranks alike: one writes
        write_jsonl(rows, output)
        print(f"wrote the top {top_k} of {len(g)} {other} items for {len(rows)} {query} queries to {output}")
    metrics: dict[str, Any] = {
        "infer/queries": len(rows),
        "infer/gallery": len(g),
        "infer/output": str(output),
    }
    if len(partner_ranks):
        metrics.update({f"infer/recall@{k}": round(float((partner_ranks < k).float().mean()), 5) for k in KS})
    return metrics


def answer_keys(
    query: str, queries: list[Path | str], other: str, gallery: list[Path], partners: dict[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a query's partner_rank counts right, as task=eval does (data.side_keys): per query and per gallery item
    a number shared by the items that are one answer (a text's words, else the file), and per gallery item its
    partner query's number (-1: none). With repeated captions infer's recall was the exact partner's, eval's not."""

    def numbers(name: str, items: list[Path | str]) -> torch.Tensor:
        seen: dict[tuple[str, str], int] = {}
        entries = [Entry(str(i.resolve()), path=i) if isinstance(i, Path) else Entry(i, text=i) for i in items]
        return torch.tensor([seen.setdefault(identity(name, e), len(seen)) for e in entries], dtype=torch.long)

    q_keys, g_keys = numbers(query, queries), numbers(other, gallery)
    g_query = torch.full((len(gallery),), -1, dtype=torch.long)
    for r, c in partners.items():
        g_query[c] = q_keys[r]
    return q_keys, g_keys, g_query


def top_matches(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k highest scores and their columns, best first and equal scores in column order: a stable
    descending sort's first k, as validation breaks ties (module.ranks). torch.topk finds the k-th score; its own
    order among equal scores is unspecified, so the columns tied at the k-th score are taken in column order."""
    kth = scores.topk(k, dim=1).values[:, -1:]
    above, tied = scores > kth, scores == kth
    room = k - above.sum(1, keepdim=True)  # the places the tied columns fill, the first of them in column order
    chosen = above | (tied & (tied.cumsum(1, dtype=torch.int32) <= room))
    picked = chosen.nonzero()[:, 1].view(len(scores), k)  # k a row, in column order
    values = scores.gather(1, picked)
    order = values.sort(dim=1, descending=True, stable=True).indices
    return values.gather(1, order), picked.gather(1, order)


def ranked(
    q: torch.Tensor,
    g: torch.Tensor,
    partners: dict[int, int],
    top_k: int,
    rows: int,
    keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query's top_k gallery columns with their scores, and the ranks of the partners the gallery holds (by
    query, in query order), from the scores q @ g.T made `rows` queries at a time (block_rows): 100,000 queries
    against 100,000 items are 40 GB of scores at once. On the host once, at the end. `keys` (answer_keys): the
    columns as right as a query's partner, which rank as one (module.ranks' `same`); None: the partner alone."""
    if keys is not None:
        q_keys, g_keys, g_query = (k.to(q.device) for k in keys)
    partner = torch.full((len(q),), -1, dtype=torch.long)
    partner[torch.tensor(list(partners), dtype=torch.long)] = torch.tensor(list(partners.values()), dtype=torch.long)
    partner = partner.to(q.device)
    values, columns, placed = [], [], []
    for start in range(0, len(q), rows):
        scores = q[start : start + rows] @ g.T
        best, picked = top_matches(scores, top_k)
        values.append(best)
        columns.append(picked)
        known = partner[start : start + rows] >= 0
        right = partner[start : start + rows][known]
        same = None
        if keys is not None:  # the partner's equals, and the partners of the query's equals (data.side_keys)
            asked = q_keys[start : start + rows][known]
            same = (g_keys[right].unsqueeze(1) == g_keys.unsqueeze(0)) | (asked.unsqueeze(1) == g_query.unsqueeze(0))
        placed.append(ranks(scores[known], right, same))
    return torch.cat(values).cpu(), torch.cat(columns).cpu(), torch.cat(placed).cpu()


def matches(
    scores: torch.Tensor,
    columns: torch.Tensor,
    partner_ranks: torch.Tensor,
    queries: list[str],
    modality: str,
    gallery: list[str],
    partners: dict[int, int],
) -> list[dict[str, Any]]:
    """matches.jsonl's rows: each query's top gallery items by their names (ranked), and where the gallery holds the
    query's partner (partners_of), its place: of the best scored item as right as it (answer_keys: a repeated
    caption's twin), as task=eval counts. Equal scores go to the lower gallery index, in the matches and the ranks
    alike: a gallery of alike items ranks a partner by its place, not first."""
    place = dict(zip(sorted(partners), partner_ranks.tolist()))
    rows = []
    for r, (name, values, picked) in enumerate(zip(queries, scores.tolist(), columns.tolist())):
        row = {
            "query": name,
            "modality": modality,
            "matches": [{"name": gallery[j], "score": round(v, 5)} for v, j in zip(values, picked)],
        }
        if r in partners:  # the gallery holds the query's partner (same stem): where does it rank?
            row["partner"], row["partner_rank"] = gallery[partners[r]], place[r] + 1
        rows.append(row)
    return rows


def _label(item: Path | str) -> str:
    return item.name if isinstance(item, Path) else str(item)


# ---------------------------------------------------------------------------------------------------------
# export


class Tower(torch.nn.Module):
    """One side of a trained dual encoder as a standalone model: stored batch -> unit embedding."""

    def __init__(self, module: DualEncoder, name: str):
        super().__init__()
        self.tower, self.projection = module.towers[name], module.projections[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(self.projection(self.tower(x)), dim=-1)


def export(job: Job) -> dict[str, Any]:
    if job.ckpt is None:
        raise UserError("task=export on paired data needs ckpt=RUN_DIR (a trained dual encoder).")
    if not is_rank_zero():  # the other processes of a torchrun launch: rank 0 writes the one export
        return {}
    return export_module(job.config, load_trained(job.config, job.ckpt), job.run_dir)


def export_module(config: ONNConfig, module: DualEncoder, run_dir: Path) -> dict[str, Any]:
    """safetensors: the dual encoder's state dict and config.json; onnx/omny: one file per tower, in a folder as a
    pipeline's pieces are: export.output=DIR/NAME.onnx (or .omny, or DIR/NAME) is DIR/NAME/ (write.pipeline_folder).
    The folder is written beside its place and replaces it whole once every tower passed its check, so a failed
    export leaves the earlier one as it was, never towers of two trainings side by side."""
    from onn.export.folders import write_atomically
    from onn.export.write import pipeline_folder

    settings: SafetensorsExport | OnnxExport = config.export
    folder = Path(settings.output).expanduser() if settings.output else run_dir / "export"
    if settings.output and settings.name != "safetensors":
        folder = pipeline_folder(settings.output, folder)
    module = module.cpu().eval()
    if settings.name == "safetensors":
        from safetensors.torch import save_model

        def write(staged: Path) -> None:
            save_model(module, str(staged / "model.safetensors"), metadata={"format": "pt"})
            (staged / "config.json").write_text(json.dumps(module.onn_config, indent=2, default=str))

        write_atomically(folder, "dual_encoder", write, config.model.name)
        return {"export/format": "safetensors", "export/path": str(folder)}
    return write_atomically(
        folder, "dual_encoder", lambda staged: _export_towers(config, module, staged, folder), config.model.name
    )


def _export_towers(config: ONNConfig, module: DualEncoder, staged: Path, folder: Path) -> dict[str, Any]:
    """Each tower as ONNX (or .omny) in `staged`, the metrics naming the files where they will be, in `folder`."""
    from onn.export.write import export_model

    settings: OnnxExport = config.export
    metrics: dict[str, Any] = {}
    batch = settings.sample.batch_size
    suffix = {"onnx": ".onnx", "omny": ".omny"}[settings.name]
    sides = {n: build_side(n, saved_side(n, c, "the dual encoder")) for n, c in module.onn_config["sides"].items()}
    for name, side in sides.items():
        stored = side.sample(batch)  # zeros: black pixels, points at the centre, NUL bytes
        generator = torch.Generator().manual_seed(config.seed)
        if stored.is_floating_point():  # random values check the graph better than zeros
            stored = torch.randn(stored.shape, generator=generator)
        elif stored.dtype == torch.uint8:
            stored = torch.randint(0, 256, stored.shape, dtype=torch.uint8, generator=generator)
        try:
            result = export_model(
                Tower(module, name),
                staged / f"{name}{suffix}",
                {"input": stored},
                settings,
                model_name=config.model.name,
            )
        except UserError as e:  # named where the tower was to go, not the folder it was staged in
            raise UserError(str(e).replace(str(staged), str(folder))) from e
        for key, value in result.items():
            if isinstance(value, str) and Path(value).parent == staged:
                value = str(folder / Path(value).name)
            metrics[f"{key}/{name}" if key.startswith("export/") else key] = value
    return metrics
