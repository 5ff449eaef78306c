"""Lightning checkpoints without pickle: tensors in model.safetensors, everything else in meta.json.

A checkpoint "file" is a folder `NAME.ckpt/` holding the two files. The JSON keeps the nested
structure of Lightning's checkpoint dict with every tensor replaced by {"__tensor__": key} and
tuples by {"__tuple__": [...]}, so loading rebuilds exactly what was saved and executes nothing.
The folder is written under a temporary name and renamed into place, so a run killed while
saving never leaves a half-written checkpoint where a good one was.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from onn.config import OptimConfig, as_dict, typed
from onn.errors import UserError, disk_error, write_refused
from onn.hardware import failpoints
from onn.hardware.cluster import is_rank_zero

log = logging.getLogger("onn")
TENSORS, META = "model.safetensors", "meta.json"


def flatten(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """Replace tensors by references into `tensors`; return a JSON-able structure. A tensor is named by its
    '/'-joined path, which two places can share ({1: a, "1": b}, {"a/b": a, "a": {"b": b}}): the second is refused
    rather than stored over the first, which loaded back in both places."""
    if isinstance(obj, torch.Tensor):
        key = path or "tensor"
        if key in tensors:
            raise ValueError(f"checkpoint tensor name {key!r} is taken by another tensor of the checkpoint")
        tensors[key] = obj
        return {"__tensor__": key}
    if isinstance(obj, dict):
        for k in obj:
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise TypeError(f"checkpoint key {k!r} at {path or '<root>'} is not JSON-able")
        return {"__dict__": [[k, flatten(v, tensors, f"{path}/{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [flatten(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [flatten(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and getattr(obj, "shape", None) == ():  # numpy scalars
        return obj.item()
    raise TypeError(f"checkpoint value at {path or '<root>'} has type {type(obj).__name__}, which ONN does not store")


def unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [unflatten(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(unflatten(v, tensors) for v in obj["__tuple__"])
        if "__dtype__" in obj:
            return getattr(torch, obj["__dtype__"])
        if "__dict__" in obj:
            return {k: unflatten(v, tensors) for k, v in obj["__dict__"]}
    return obj


def save(checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Write `checkpoint` as path/ {model.safetensors, meta.json}, atomically replacing an older one."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    meta = flatten(checkpoint, tensors)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_file(_unshare(tensors), str(tmp / TENSORS))
        (tmp / META).write_text(json.dumps(meta))
        _synced(tmp)
    except (OSError, SafetensorError) as e:  # a full or read-only disk: the previous checkpoint stays as it was
        shutil.rmtree(tmp, ignore_errors=True)
        refused = disk_error(e)
        if refused is None:
            raise
        needed = sum(t.numel() * t.element_size() for t in tensors.values())
        raise write_refused(refused, path, needed, "checkpoints (hydra.run.dir)") from None
    failpoints.reached("checkpoint_write")
    _swap_in(tmp, path)


def _synced(folder: Path) -> None:
    """A checkpoint's files on the disk before a rename makes them the checkpoint."""
    for name in (TENSORS, META):
        with open(folder / name, "rb") as f:
            os.fsync(f.fileno())


def _swap_in(staged: Path, path: Path) -> None:
    """Rename the whole checkpoint `staged` to `path`, the one there first set aside as NAME.ckpt.old and removed
    after: a kill at any step leaves a whole checkpoint at `path` or, between the renames, at its .old (`whole`)."""
    old = path.with_name(path.name + ".old")
    if path.exists():  # an .old beside a complete checkpoint is a save that was killed while tidying up
        shutil.rmtree(old, ignore_errors=True)
    with _signals_held():  # SIGTERM / SIGINT between the two renames would leave no checkpoint at `path`
        if path.exists():
            path.rename(old)
        staged.rename(path)
        shutil.rmtree(old, ignore_errors=True)


def copy_in(source: Path, path: Path) -> None:
    """Copy checkpoint `source` to `path` as save() writes one: staged beside it, then swapped in, so a kill leaves
    no half checkpoint there. A write the disk refuses is one sentence (copytree's shutil.Error kept no errno),
    with the staged copy removed."""
    staged = path.with_name(path.name + ".tmp")
    shutil.rmtree(staged, ignore_errors=True)
    needed = sum((source / name).stat().st_size for name in (TENSORS, META))
    try:
        staged.mkdir(parents=True)
        for name in (TENSORS, META):
            shutil.copy2(source / name, staged / name)
        _synced(staged)
    except OSError as e:
        shutil.rmtree(staged, ignore_errors=True)
        if e.filename2 is None and e.filename is not None and Path(e.filename).parent == source:
            raise  # opening the earlier checkpoint failed, not writing this one (a copy's error names both files)
        raise write_refused(e, path, needed, "checkpoints (hydra.run.dir)") from None
    _swap_in(staged, path)


HELD_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT that arrive inside the block reach the handlers they were for when it ends (the run's
    record then stops the run as usual). A signal mask cannot hold them: it is one thread's, so the kernel hands
    the signal to another thread (the record's heartbeat, torch's pool) and Python still runs the handler in the
    main thread, between the renames. So the block sets handlers that only note the signal."""
    previous = {signum: signal.getsignal(signum) for signum in HELD_SIGNALS}
    if threading.current_thread() is not threading.main_thread() or None in previous.values():
        yield  # another thread is never interrupted by a handler; None: a handler not set from Python (no way back)
        return
    caught: list[tuple[int, Any]] = []
    for signum in HELD_SIGNALS:
        signal.signal(signum, lambda number, frame: caught.append((number, frame)))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum, frame in caught:
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)  # the run's handler raises Interrupted here, after the block
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)  # what the signal would have done: end the process


def load(path: str | os.PathLike, map_location: Any = None) -> dict[str, Any]:
    path = Path(path)
    if path.is_file():
        raise UserError(
            f"{path} is a file, not an ONN checkpoint folder; pickle checkpoints (.ckpt/.pt/.bin) are never loaded."
        )
    if not (path / META).is_file() or not (path / TENSORS).is_file():
        raise UserError(f"{path} is not a complete ONN checkpoint (needs {META} and {TENSORS}).")
    device = str(map_location) if isinstance(map_location, (str, torch.device)) else "cpu"
    meta = _read_json(path)
    try:
        tensors = load_file(str(path / TENSORS), device=device)
    except (SafetensorError, OSError) as e:
        raise UserError(
            f"checkpoint {path}: {TENSORS} is damaged (truncated or not safetensors: {e}); "
            "use another checkpoint of the run, or train again."
        ) from None
    try:
        return _rebuilt(meta, tensors, path)
    except KeyError as e:
        raise UserError(
            f"checkpoint {path}: {META} names the tensor {e.args[0]!r}, which {TENSORS} lacks "
            "(its tensors come from another checkpoint?); use the run's own files."
        ) from None


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights, views): give each its own storage."""
    out, seen = {}, set()
    for key, t in tensors.items():
        t = t.detach().cpu()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if (
            ptr is not None
            and ptr in seen
            or not t.is_contiguous()
            or (t.numel() and t.untyped_storage().nbytes() != t.numel() * t.element_size())
        ):
            t = t.clone().contiguous()
        if ptr is not None:
            seen.add(ptr)
        out[key] = t
    return out


def resolve(ckpt: str, outputs: str | os.PathLike) -> Path:
    """`last` (newest last.ckpt under outputs), a run dir, a checkpoints dir, or a checkpoint path."""
    if str(ckpt) == "last":
        found = [whole_last(folder) for folder in Path(outputs).glob("**/checkpoints")]
        found = [p for p in found if p is not None]
        if not found:
            raise UserError(f"ckpt=last: no checkpoint under {outputs}; train first, or give ckpt=PATH.")
        return max(found, key=lambda p: (p / META).stat().st_mtime)
    path = Path(str(ckpt)).expanduser()
    for candidate in (path, path / "checkpoints" / "last.ckpt", path / "last.ckpt", *_renamed(path, ".ckpt")):
        # NAME.ckpt.old alone: a save killed (SIGKILL) between its two renames left the previous checkpoint there
        for found in (candidate, *_renamed(candidate, ".old")):
            if (found / META).is_file():
                return found
    if path.suffix in (".pt", ".bin", ".pth", ".pkl") or path.is_file():
        raise UserError(
            f"ckpt={ckpt} is a file, not an ONN checkpoint folder; "
            "pickle checkpoints are never loaded (ONN writes NAME.ckpt/ folders)."
        )
    raise UserError(
        f"ckpt={ckpt}: no ONN checkpoint there (looked for {META} in it, its checkpoints/last.ckpt and last.ckpt)."
    )


def _renamed(path: Path, suffix: str) -> list[Path]:
    """`path` with `suffix` added to its name; none for `.` (the run folder a user stands in) and `/`, which have no
    name (pathlib's with_name raised ValueError for them)."""
    return [path.with_name(path.name + suffix)] if path.name else []


def whole(folder: Path, name: str, tensors: bool = True) -> Path | None:
    """A checkpoints folder's checkpoint `name` (last.ckpt, best.ckpt), or its NAME.old where a save killed between
    its two renames left only that (an .old beside a whole NAME is the older one); None when it holds neither whole.
    `tensors=False`: its meta.json alone decides, so a newest checkpoint that lost its tensors is found, and load()
    says so, rather than an older run's being taken in its place."""
    for found in (folder / name, folder / f"{name}.old"):
        if (found / META).is_file() and (not tensors or (found / TENSORS).is_file()):
            return found
    return None


def whole_last(folder: Path) -> Path | None:
    """A checkpoints folder's last.ckpt, found by its meta.json (see `whole`)."""
    return whole(folder, "last.ckpt", tensors=False)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON part of a checkpoint (config, loop state) without reading its tensors."""
    return _rebuilt(_read_json(Path(path)), _NoTensors(), Path(path))


SAVED_KEYS = {"model", "strategy", "data", "modality"}  # what every ONN run's checkpoint config holds


def saved_config(path: str | os.PathLike, modality: str | None = None) -> dict[str, Any]:
    """The ONN run config a checkpoint carries (model, strategy, data, modality, ...): {} when it has none.
    With `modality`, a checkpoint another modality's run wrote (or another tool) is refused in one sentence."""
    damaged = f"checkpoint {path}: {META} holds a damaged ONN run config; use a checkpoint folder ONN wrote."
    match read_meta(path):
        case {"onn": {"config": dict() as config}} if not config.keys() >= SAVED_KEYS:  # an edited meta.json
            raise UserError(damaged)
        case {"onn": {"config": dict() as config}} if modality is None or modality == config["modality"]:
            return in_todays_form(config)
        case _ if modality is not None:
            raise UserError(f"ckpt {path} was not written by a {modality} run; it cannot be used with {modality} data.")
        case {"onn": _}:
            raise UserError(damaged)
        case _:
            return {}  # a checkpoint another tool wrote


def resumed_optim(optim: OptimConfig, ckpt: str | os.PathLike) -> OptimConfig:
    """The optimizer settings a run resumed from `ckpt` trains with: the checkpoint's, as its model and strategy
    are (app.from_checkpoint). Lightning loads the checkpoint's optimizer and schedule state into what the module
    builds from these settings: another optim.name or optim.schedule could not take it (a KeyError mid-fit), and
    another lr or warm-up would be half used. The keys this run's config gives otherwise are said not to be used;
    `ckpt=last` alone resumes a run trained with any optimizer. A checkpoint an earlier ONN wrote, without its
    optim settings, keeps the config's."""
    saved = saved_config(ckpt).get("optim")
    if not isinstance(saved, dict):
        return optim
    given = as_dict(optim)
    kept = {k: v for k, v in saved.items() if k in given}
    changed = [k for k in given if k in kept and given[k] != kept[k]]
    if changed:
        log.warning(
            "ckpt %s: the optimizer and its schedule are the checkpoint's (%s); this run's %s not used",
            ckpt,
            ", ".join(f"optim.{k}={kept[k]}" for k in changed),
            ", ".join(f"optim.{k}={given[k]}" for k in changed) + (" is" if len(changed) == 1 else " are"),
        )
    return typed(OptimConfig, {**given, **kept}, f"ckpt {ckpt}: optim")


def in_todays_form(config: dict[str, Any]) -> dict[str, Any]:
    """A run config an earlier ONN saved, in the form today's config types read: `model.layer_map` became a
    block (`{blocks: null}`), and mesh data gained `batch_groups` (null: off). A dual encoder's sides carry
    their own model and data."""
    config = copy.deepcopy(config)
    parts = [config, *(config["sides"].values() if isinstance(config.get("sides"), dict) else ())]
    for part in parts:
        model, data = part.get("model"), part.get("data")
        if isinstance(model, dict) and "layer_map" in model and model["layer_map"] is None:
            model["layer_map"] = {"blocks": None}
        if isinstance(data, dict) and data.get("modality") == "mesh":
            data.setdefault("batch_groups", None)
    return config


def _read_json(path: Path) -> Any:
    try:
        return json.loads((path / META).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(
            f"checkpoint {path}: {META} is not valid JSON ({e}); the checkpoint is damaged: "
            "use another checkpoint of the run, or train again."
        ) from None


def _rebuilt(meta: Any, tensors: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """unflatten(meta), checked to be a checkpoint: a dict of Lightning's keys."""
    try:
        checkpoint = unflatten(meta, tensors)
    except (TypeError, ValueError, AttributeError) as e:
        checkpoint = e
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict", {}), dict):
        raise UserError(
            f"checkpoint {path}: {META} does not hold an ONN checkpoint's structure (written by another "
            "tool, or damaged); use a checkpoint folder ONN wrote."
        )
    return checkpoint


def state_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of a checkpoint's state_dict, read from the files' headers (no tensor is loaded)."""
    from safetensors import safe_open

    path = Path(path)
    refs = _rebuilt(_read_json(path), _Refs(), path)["state_dict"]
    try:
        with safe_open(str(path / TENSORS), "pt") as f:
            stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except (SafetensorError, OSError) as e:
        raise UserError(
            f"checkpoint {path}: {TENSORS} is damaged (truncated or not safetensors: {e}); "
            "use another checkpoint of the run, or train again."
        ) from None
    lacking = [ref for ref in refs.values() if ref not in stored]
    if lacking:
        raise UserError(
            f"checkpoint {path}: {META} names the tensor {lacking[0]!r}, which {TENSORS} lacks "
            "(its tensors come from another checkpoint?); use the run's own files."
        )
    return {name: stored[ref] for name, ref in refs.items()}


def check_random_base(ckpt: Path, drawn: str | None) -> None:
    """A LoRA checkpoint's frozen base is drawn again from model.source=random when it is loaded, and the CPU's and
    each GPU's generators give other weights for one seed: adapters on another base would score wrong, silently.
    `drawn`: where this run draws it (models.load.random_base). A checkpoint that records none (a base with
    weights, a full model, an earlier ONN) loads as before."""
    saved = read_meta(ckpt).get("onn", {}).get("random_base")
    if saved is None or drawn is None or saved == drawn:
        return
    # a GPU draws it where the plan puts the layer store in host memory, which it does when the store fits there
    # (a resumed run's strategy comes from the checkpoint, not the command line)
    where = (
        "the CPU"
        if saved == "cpu"
        else f"{saved} with enough free host memory for the model's layer store (the base is drawn on the GPU when "
        "the plan puts the store in host memory, which it does when the store fits)"
    )
    raise UserError(
        f"ckpt {ckpt}: its frozen base was drawn from model.source=random on {saved} and this run would draw it on "
        f"{drawn}, whose generator gives other weights for the same seed; run it on {where}, or train from a "
        "model source with weights (a Hugging Face folder, GGUF or safetensors file)."
    )


def check_state(
    module: torch.nn.Module, shapes: dict[str, tuple[int, ...]], ckpt: Path, loads_frozen: bool = True
) -> None:
    """A checkpoint's tensor shapes against the module they go into: every name known, every shape equal, and
    every weight there (`loads_frozen` False: a LoRA checkpoint holds only what trains)."""
    own = module.state_dict()
    unknown = [k for k in shapes if k not in own]
    wrong = [
        f"{k} {list(shapes[k])} (the model's: {list(own[k].shape)})"
        for k in shapes
        if k in own and tuple(shapes[k]) != tuple(own[k].shape)
    ]
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    missing = [k for k in own if k not in shapes and (loads_frozen or k in trainable)]
    if unknown or wrong or missing:
        said = "; ".join(
            f"{what} {', '.join(keys[:2])}{' ...' if len(keys) > 2 else ''}"
            for what, keys in (("unknown tensors", unknown), ("wrong shapes", wrong), ("missing", missing))
            if keys
        )
        raise UserError(
            f"ckpt {ckpt} does not fit the model its config builds ({said}); it belongs to another model or run."
        )


def check_finite(network: torch.nn.Module, where: str, task: str) -> None:
    """UserError naming `where` (`ckpt PATH`, or `model.source X`) and its first weight that holds NaN or inf: a
    diverged checkpoint gives NaN predictions, null scores, samples or an export full of NaN, or fails every request
    (task=serve), so it is refused before any of that is written. One max and one min per weight, no copy of it,
    read back once per device. Only what is resident is read: a layer-streamed model's frozen blocks live in its
    store (empty placeholders here), which holds model.source's weights, never what a checkpoint trained."""
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    flags: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    # buffers are read for NaN alone: a diverged BatchNorm's running_var predicts NaN, but a mask may hold -inf
    tensors = [(n, t, True) for n, t in network.named_parameters()] + [
        (n, t, False) for n, t in network.named_buffers()
    ]
    with torch.no_grad():
        for name, t, weight in tensors:
            if t.dtype in floats and t.numel() and not t.is_meta:  # (quantized codes, placeholders: nothing to read)
                high, low = t.amax(), t.amin()  # NaN propagates to both
                fine = torch.isfinite(high) & torch.isfinite(low) if weight else ~(high.isnan() | low.isnan())
                flags.setdefault(t.device, []).append((name, fine))
    for named in flags.values():
        ok = torch.stack([finite for _, finite in named]).tolist()
        bad = next((name for (name, _), fine in zip(named, ok) if not fine), None)
        if bad is not None:
            serve = task == "serve"
            use = "be served" if serve else f"be used for task={task}"
            outcome = "every answer would fail" if serve else "all it would give is NaN"
            raise UserError(
                f"{where} cannot {use}: its weight {bad} holds NaN or inf (the training diverged, or the file is "
                f"damaged), so {outcome}; use a checkpoint from before that (ckpt=RUN_DIR/checkpoints/best.ckpt, "
                "kept at the run's best score), or train again with a lower optim.lr."
            )


class _NoTensors(dict):
    def __missing__(self, key: str) -> None:
        return None


class _Refs(dict):
    """Tensor references read as their keys into the safetensors file."""

    def __missing__(self, key: str) -> str:
        return key


def shared_best(trainer, ckpt: Path | None, run_dir: Path, monitor: str, mode: str) -> tuple[str | None, float | None]:
    """run_best on rank 0 alone, its result handed to every rank by the strategy's broadcast: it copies a resumed
    run's best.ckpt in, which every rank copying at once raced, and a rank could test a half-copied one. Its failure
    (a damaged earlier checkpoint, a full disk) reaches every rank through the broadcast too: raised on rank 0 alone,
    the others would wait in the broadcast for good."""
    found, failure, raised = (None, None), None, None
    if trainer.is_global_zero and is_rank_zero():  # (a single-device strategy under a launcher: every rank is "zero")
        try:
            found = run_best(trainer.checkpoint_callback, ckpt, run_dir, monitor, mode)
        except Exception as e:  # every rank raises it, below
            failure, raised = (isinstance(e, UserError), f"{type(e).__name__}: {e}"), e
    found, failure = trainer.strategy.broadcast((found, failure))
    if raised is not None:
        raise raised
    if failure is not None:
        user, message = failure
        raise (UserError if user else RuntimeError)(f"rank 0 could not take the run's best checkpoint: {message}")
    return found


def run_best(callback, ckpt: Path | None, run_dir: Path, monitor: str, mode: str) -> tuple[str | None, float | None]:
    """The whole run's best checkpoint and score (`mode`: min or max of `monitor`). Lightning forgets the best score
    when a resumed run writes to a new folder, so an earlier run's best.ckpt that this run's does not beat is copied
    in: Lightning keeps the first of equal scores, and so a tie goes to the earlier run, as in a run never stopped.
    This run's score is compared as the history records it (5 digits): float32's 0.6 is not the history's 0.6."""
    here = run_dir / "checkpoints"
    path = callback.best_model_path or None
    score = None
    if path and Path(path).parent == here and callback.best_model_score is not None:
        score = float(callback.best_model_score)
    if ckpt is not None:
        history = read_meta(ckpt)["onn"]["history"]  # the run this one resumed from
        old = whole(Path(ckpt).parent, "best.ckpt")  # its best.ckpt.old alone: a kill between a save's renames
        earlier = [h[monitor] for h in history if monitor in h]
        if not earlier and old is not None:  # a figure the history does not keep (train/loss): best.ckpt's own score
            earlier = [saved_score(old, monitor)]
        # a NaN score is never the best, as Lightning ranks it (min and max of a list that holds one are not)
        earlier = [round(s, 5) for s in earlier if s is not None and not math.isnan(s)]
        best = (min if mode == "min" else max)(earlier) if earlier else None
        own = round(score, 5) if score is not None else None
        beaten = own is not None and best is not None and (own < best if mode == "min" else own > best)
        if best is not None and old is not None and not beaten:
            target = here / "best.ckpt"
            if old.resolve() != target.resolve():  # resumed into its own folder (a sweep's job), it is there already
                copy_in(old, target)
            path, score = str(target), float(best)
    return path, score


def saved_score(path: Path, monitor: str) -> float | None:
    """The `monitor` score Lightning's ModelCheckpoint saved in checkpoint `path` as it wrote it (its current_score),
    read from the one tensor that holds it; None where no ModelCheckpoint of `monitor` saved one."""
    from safetensors import safe_open

    states = _rebuilt(_read_json(path), _Refs(), path).get("callbacks") or {}
    refs = [
        state.get("current_score")
        for key, state in states.items()
        if key.startswith("ModelCheckpoint") and isinstance(state, dict) and state.get("monitor") == monitor
    ]
    ref = next((r for r in refs if isinstance(r, str)), None)
    if ref is None:
        return None
    try:
        with safe_open(str(path / TENSORS), "pt") as f:
            return float(f.get_tensor(ref))
    except (SafetensorError, OSError) as e:
        raise UserError(
            f"checkpoint {path}: {TENSORS} is damaged (truncated or not safetensors: {e}); "
            "use another checkpoint of the run, or train again."
        ) from None
