"""Malformed and hostile inputs, one generated case per kind of issue 14 (items 7-11), run through the real CLI.

    python tests/hostile_corpus.py                      # this checkout; a table of kind, verdict, last line
    python tests/hostile_corpus.py --root OTHER_CHECKOUT --json out.json

Every case builds its input in a scratch folder (nothing real, nothing downloaded), runs `run.py` (or
`python -m onn.export.omny`) and classifies the outcome:

    handled     exit 0 and the result is right (the check says so)
    sentence    a non-zero exit with one error line and no traceback
    WRONG       exit 0 with a wrong result, or an error where the input is valid
    TRACEBACK   a Python traceback
    HANG        still running after the case's time limit

The tests (tests/test_real_use.py) check the same kinds in-process, where that is cheaper; this file is
the slow, whole-CLI view that gives the before/after table.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
RUN = [
    "model=llama_tiny",
    "tracking=none",
    "trainer.max_steps=2",
    "task.validate_before=false",
    "task.exact_match_samples=0",
    "trainer.enable_progress_bar=false",
]
TEXT = [*RUN, "data.val_split=0.2"]
IMAGE = [
    "model=v28_cnn",
    "data=image",
    "tracking=none",
    "trainer.max_epochs=1",
    "trainer.max_steps=-1",
    "data.batch_size=4",
    "data.val_split=0.25",
    "trainer.enable_progress_bar=false",
    "optim.warmup_steps=0",
]


# Hydra's own messages for a bad override: a few lines naming the key, before ONN runs
HYDRA_CONFIG_ERRORS = (
    "Error merging override",
    "Could not override",
    "Error parsing override",
    "could not be converted",
)


# --- generated inputs ----------------------------------------------------------------------------------


def qa_rows(n: int = 20) -> list[dict]:
    return [{"input": f"What is {i} + {i}?", "output": str(2 * i)} for i in range(n)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def quoted_csv(path: Path, n: int = 20) -> Path:
    """A valid CSV whose quoted fields hold newlines and doubled quotes (Python's csv writes it so)."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["input", "output"])
    for i in range(n):
        writer.writerow([f"Write a poem about {i}", f'Roses are red,\nviolets are "blue" {i}'])
    path.write_text(buf.getvalue())
    return path


def ragged_csv(path: Path) -> Path:
    lines = ["input,output"] + [f"q{i},a{i}" for i in range(20)]
    lines[6] = "q5,a5,extra"
    path.write_text("\n".join(lines) + "\n")
    return path


def images(root: Path, classes: dict[str, int], n: int = 8, size: int = 12) -> Path:
    """Folders of PNGs; each class one grey level (so labels can be told apart by pixel)."""
    from PIL import Image

    for name, level in classes.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.new("RGB", (size, size), (level, level, (level + 7 * i) % 256)).save(folder / f"{i}.png")
    return root


def png_bytes(level: int, size: int = 12) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), (level, level, level)).save(buf, format="PNG")
    return buf.getvalue()


def tar_with_absolute_member(path: Path) -> Path:
    with tarfile.open(path, "w") as tf:
        for cls, level in (("a", 30), ("b", 220)):
            for i in range(6):
                data = png_bytes(level + i)
                info = tarfile.TarInfo(f"{cls}/{i}.png")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        data = png_bytes(128)
        info = tarfile.TarInfo("/etc/evil/x.png")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return path


def label_csv(folder: Path, labels: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = ["path,label"]
    for i, label in enumerate(labels):
        (folder / f"{i}.png").write_bytes(png_bytes(20 * (i % 10)))
        rows.append(f"{i}.png,{label}")
    (folder / "labels.csv").write_text("\n".join(rows) + "\n")
    return folder / "labels.csv"


def link_loops(root: Path) -> Path:
    images(root, {"a": 30, "b": 220}, n=6)
    os.symlink("..", root / "a" / "up")  # a/up -> root: a cycle
    os.symlink(str(root), root / "b" / "again")  # an absolute link back to the root: a second cycle
    return root


def tiny_onnx(path: Path, weights: str = "initializer") -> Path:
    """x -> 4 x (MatMul + Relu) -> y, its [16, 16] weights stored as initializers or made by ConstantOfShape."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, prev = [], [], "x"
    rng = np.random.default_rng(0)
    for k in range(4):
        w = f"w{k}"
        if weights == "initializer":
            inits.append(numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32) * 0.3, w))
        else:  # onnx's light_* test models build weights like this: a shape, filled with one value
            inits.append(numpy_helper.from_array(np.array([16, 16], np.int64), f"shape{k}"))
            value = helper.make_tensor("value", TensorProto.FLOAT, [1], [0.01 * (k + 1)])
            nodes.append(helper.make_node("ConstantOfShape", [f"shape{k}"], [w], value=value))
        nodes.append(helper.make_node("MatMul", [prev, w], [f"m{k}"]))
        nodes.append(helper.make_node("Relu", [f"m{k}"], [f"r{k}"]))
        prev = f"r{k}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="corpus", ir_version=10)
    onnx.save(model, str(path))
    return path


def enriched(path: Path, root: Path) -> Path:
    """An .omny of tiny_onnx made by the checkout under test (enrich_onnx's Python API exists in every version)."""
    src = tiny_onnx(path.with_suffix(".onnx"))
    code = (
        "import numpy as np; from onn.export.omny import enrich_onnx; "
        f"enrich_onnx({str(src)!r}, {str(path)!r}, {{'x': np.ones((1, 16), np.float32)}})"
    )
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, capture_output=True)
    return path


def _rename_first_cut(doc: dict) -> None:
    """The first cut point names a tensor the graph lacks, and its block says so too: a consistent document
    (FORMAT_SPEC: blocks[i].cut_after names the cut point after block i) whose tensor validate must miss."""
    doc["cut_points"][0]["name"] = doc["blocks"][0]["cut_after"] = "no_such_tensor"


def rewrite_document(path: Path, change: Callable[[dict], None]) -> Path:
    import onnx

    model = onnx.load(str(path))
    prop = next(p for p in model.metadata_props if p.key == "onn.omny")
    doc = json.loads(prop.value)
    change(doc)
    prop.value = json.dumps(doc)
    onnx.save(model, str(path))
    return path


def truncated(src: Path, dst: Path) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 2])
    return dst


# --- cases ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    kind: str  # the words for it
    item: str  # the item number
    make: Callable[[Path, dict], list[str]]  # scratch folder, shared artefacts -> run.py arguments
    expect: str  # "error" (one sentence, non-zero exit), "ok" (exit 0, then `check`) or "either"
    check: Callable[[Path, str], str | None] | None = None  # (scratch, output) -> what is wrong, or None
    command: str = "run"  # run | omny
    timeout: int = 300
    needs: list[str] = field(default_factory=list)  # shared artefacts built first


def metrics_of(tmp: Path) -> dict:
    found = sorted(tmp.glob("outputs/**/metrics.json"))
    return json.loads(found[-1].read_text()) if found else {}


def py(root: Path, code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    return proc.stdout.strip() if proc.returncode == 0 else "error: " + (proc.stderr.strip().splitlines() or ["?"])[-1]


def text_case(source_of: Callable[[Path], Path], *extra: str):
    def make(tmp: Path, shared: dict) -> list[str]:
        return [*TEXT, "data=text", f"data.source={source_of(tmp)}", *extra]

    return make


def image_case(source_of: Callable[[Path], Path], *extra: str):
    def make(tmp: Path, shared: dict) -> list[str]:
        return [*IMAGE, f"data.source={source_of(tmp)}", *extra]

    return make


def quoted_check(root: Path):
    def check(tmp: Path, out: str) -> str | None:
        got = py(
            root,
            "from onn.modalities.text.formats import read_records as r; rows = r({!r}); "
            "print(len(rows), repr(rows[3]['input']), repr(rows[3]['output']))".format(str(tmp / "q.csv")),
        )
        first = "Write a poem about 3"
        second = 'Roses are red,\nviolets are "blue" 3'
        want = f"20 {first!r} {second!r}"
        return None if got == want else f"read as {got[:90]}"

    return check


def image_labels_check(root: Path, source: str, *overrides: str, want_classes: list[str]):
    """Compose the image config, read the data as a run does, and check classes and every item's label by its name."""

    def check(tmp: Path, out: str) -> str | None:
        code = f"""
import sys; sys.path.insert(0, {str(root / "tests")!r})
from conftest import compose
from onn.modalities import get
cfg = compose('model=v28_cnn', 'data=image', 'data.source={tmp / source}', 'paths.outputs={tmp / "py"}',
              {", ".join(repr(o) for o in overrides)})
dm = get('image').datamodule(cfg, 'cpu'); dm.setup()
bad = [(n, dm.classes[int(l)]) for s in dm.splits.values() for n, l in zip(s.names, s.labels.tolist())
       if n.split('/')[-2] != dm.classes[int(l)]]
print(dm.classes, len(bad), bad[:2])
"""
        got = py(root, code)
        return None if got == f"{want_classes} 0 []" else f"classes/labels: {got[:120]}"

    return check


def said_device(tmp: Path, out: str) -> str | None:
    return None if "character device" in out or "not a regular file" in out else "does not say it is a device"


def said_loop(tmp: Path, out: str) -> str | None:
    return None if "link loop" in out else "does not say it is a link loop"


def build_cases(root: Path) -> list[Case]:
    def jsonl(name: str, rows: list) -> Callable[[Path], Path]:
        return lambda tmp: write_jsonl(tmp / name, rows)

    def text_file(name: str, data: bytes) -> Callable[[Path], Path]:
        def make(tmp: Path) -> Path:
            (tmp / name).write_bytes(data)
            return tmp / name

        return make

    null_rows = qa_rows()
    null_rows[3]["output"] = None
    missing_rows = qa_rows()
    del missing_rows[6]["output"]  # line 7
    cases = [
        # 7. silent wrong data
        Case(
            "CSV with quoted newlines and doubled quotes",
            "7",
            text_case(lambda t: quoted_csv(t / "q.csv")),
            "ok",
            quoted_check(root),
        ),
        Case("ragged CSV", "7", text_case(lambda t: ragged_csv(t / "r.csv")), "error"),
        Case("null answers", "7", text_case(jsonl("n.jsonl", null_rows)), "error"),
        Case("data.max_length=0", "7", text_case(jsonl("m.jsonl", qa_rows()), "data.max_length=0"), "error"),
        Case(
            "data.classes in another order than the folders",
            "7",
            image_case(lambda t: images(t / "img", {"a": 30, "b": 220}), "data.classes=[b,a]"),
            "ok",
            image_labels_check(root, "img", "data.classes=[b,a]", want_classes=["b", "a"]),
        ),
        Case(
            "string label among integer labels in a CSV",
            "7",
            image_case(lambda t: label_csv(t / "csvimg", ["0", "1"] * 5 + ["cat"] + ["1", "0"] * 2)),
            "error",
        ),
        Case(
            "absolute-path tar member",
            "7",
            image_case(lambda t: tar_with_absolute_member(t / "abs.tar")),
            "either",
            image_labels_check(root, "abs.tar", want_classes=["a", "b"]),
        ),
        Case("negative warm-up (text)", "7", text_case(jsonl("w.jsonl", qa_rows()), "optim.warmup_steps=-5"), "error"),
        Case(
            "negative warm-up (image)",
            "7",
            image_case(lambda t: images(t / "img", {"a": 30, "b": 220}), "optim.warmup_steps=-5"),
            "error",
        ),
        Case(
            "memory budget below the baseline",
            "7",
            text_case(jsonl("b.jsonl", qa_rows()), "hardware.budget_mb=100"),
            "error",
        ),
        # 8. checkpoint identity
        Case(
            "eval ckpt=X data.source=NEW evaluates NEW",
            "8",
            lambda t, s: [
                "task=eval",
                f"ckpt={s['text_ckpt']}",
                f"data.source={write_jsonl(t / 'new.jsonl', qa_rows(30))}",
                "tracking=none",
                "task.max_samples=2",
                "task.max_new_tokens=2",
            ],
            "ok",
            lambda t, out: (
                None
                if (metrics_of(t).get("data_source"), metrics_of(t).get("data")) == (str(t / "new.jsonl"), "text")
                else f"metrics say data={metrics_of(t).get('data')!r} (trained on text), "
                f"data_source={metrics_of(t).get('data_source')!r}"
            ),
            needs=["text_ckpt"],
        ),
        Case(
            "text eval of an image checkpoint",
            "8",
            lambda t, s: [
                "task=eval",
                f"ckpt={s['image_ckpt']}",
                "data=text",
                f"data.source={write_jsonl(t / 'x.jsonl', qa_rows())}",
                "tracking=none",
            ],
            "error",
            needs=["image_ckpt"],
        ),
        # 9. hangs
        Case(
            "image folder with two symlink loops", "9", image_case(lambda t: link_loops(t / "loops")), "ok", timeout=180
        ),
        Case(
            "data.source=/dev/zero (data=auto)",
            "9",
            lambda t, s: [*RUN, "data=auto", "data.source=/dev/zero"],
            "error",
            said_device,
            timeout=120,
        ),
        Case(
            "data.source=/dev/zero (data=text)",
            "9",
            lambda t, s: [*TEXT, "data=text", "data.source=/dev/zero"],
            "error",
            said_device,
            timeout=120,
        ),
        Case(
            "data.source=/dev/zero (data=image)",
            "9",
            lambda t, s: [*IMAGE, "data.source=/dev/zero"],
            "error",
            said_device,
            timeout=120,
        ),
        # 10. tracebacks
        Case(
            "UTF-16 text with a BOM (should be read)",
            "10",
            text_case(text_file("u16.jsonl", "".join(json.dumps(r) + "\n" for r in qa_rows()).encode("utf-16"))),
            "ok",
        ),
        Case(
            "Latin-1 text",
            "10",
            text_case(text_file("l1.txt", "".join(f"caf\xe9 num\xe9ro {i}\n" for i in range(20)).encode("latin-1"))),
            "error",
        ),
        Case("binary file as text data", "10", text_case(text_file("bin.jsonl", bytes(range(256)) * 64)), "error"),
        Case(
            "safetensors with the wrong shapes",
            "10",
            lambda t, s: [
                *TEXT,
                "data=text",
                f"data.source={write_jsonl(t / 'd.jsonl', qa_rows())}",
                f"model.source={s['wrong_shapes']}",
            ],
            "error",
            needs=["wrong_shapes"],
        ),
        Case(
            "checkpoint with corrupt meta.json",
            "10",
            lambda t, s: ["task=eval", f"ckpt={s['bad_meta']}", "tracking=none"],
            "error",
            needs=["bad_meta"],
        ),
        Case(
            "checkpoint with wrong-shaped meta.json",
            "10",
            lambda t, s: ["task=eval", f"ckpt={s['list_meta']}", "tracking=none"],
            "error",
            needs=["list_meta"],
        ),
        Case(
            "checkpoint with truncated tensors",
            "10",
            lambda t, s: ["task=eval", f"ckpt={s['cut_tensors']}", "tracking=none"],
            "error",
            needs=["cut_tensors"],
        ),
        Case(
            "checkpoint with another model's tensors",
            "10",
            lambda t, s: ["task=eval", f"ckpt={s['other_tensors']}", "tracking=none"],
            "error",
            needs=["other_tensors"],
        ),
        Case(
            "model.weights truncated",
            "10",
            lambda t, s: [
                *IMAGE,
                f"data.source={images(t / 'img', {'a': 30, 'b': 220})}",
                f"model.weights={s['cut_weights']}",
            ],
            "error",
            needs=["cut_weights"],
        ),
        Case("a folder with one class", "10", image_case(lambda t: images(t / "one", {"only": 90})), "error"),
        Case(
            "data.source is a symlink loop (image)",
            "10",
            lambda t, s: [*IMAGE, f"data.source={loop_link(t)}"],
            "error",
            said_loop,
        ),
        Case(
            "data.source is a symlink loop (text)",
            "10",
            lambda t, s: [*TEXT, "data=text", f"data.source={loop_link(t)}"],
            "error",
            said_loop,
        ),
        Case("optim.lr=-1", "10", text_case(jsonl("d.jsonl", qa_rows()), "optim.lr=-1"), "error"),
        Case(
            "optim.lr=-1 (image)",
            "10",
            image_case(lambda t: images(t / "img", {"a": 30, "b": 220}), "optim.lr=-1"),
            "error",
        ),
        Case("trainer.max_steps=-5", "10", text_case(jsonl("d.jsonl", qa_rows()), "trainer.max_steps=-5"), "error"),
        Case(
            "trainer.max_steps=-5 (image)",
            "10",
            image_case(lambda t: images(t / "img", {"a": 30, "b": 220}), "trainer.max_steps=-5"),
            "error",
        ),
        Case("trainer.max_steps=abc", "10", text_case(jsonl("d.jsonl", qa_rows()), "trainer.max_steps=abc"), "error"),
        Case(
            "strategy.streaming.chunk_size=0",
            "10",
            text_case(jsonl("d.jsonl", qa_rows()), "strategy=sparse_lora", "strategy.streaming.chunk_size=0"),
            "error",
        ),
        Case(
            "unknown optim.schedule",
            "10",
            text_case(jsonl("d.jsonl", qa_rows()), "optim.schedule=warmup_cosine"),
            "error",
        ),
        Case(
            "unknown optim.schedule (image)",
            "10",
            image_case(lambda t: images(t / "img", {"a": 30, "b": 220}), "optim.schedule=warmup_cosine"),
            "error",
        ),
        Case(
            "run directory that is an existing file",
            "10",
            lambda t, s: [
                *TEXT,
                "data=text",
                f"data.source={write_jsonl(t / 'd.jsonl', qa_rows())}",
                f"hydra.run.dir={file_at(t / 'rundir')}",
            ],
            "error",
        ),
        Case(
            "cache directory under a file",
            "10",
            lambda t, s: [
                *TEXT,
                "data=text",
                f"data.source={write_jsonl(t / 'd.jsonl', qa_rows())}",
                f"paths.cache={file_at(t / 'cachefile')}/cache",
            ],
            "error",
        ),
        # 11. messages that mislead
        Case(
            "missing field on line 7",
            "11",
            text_case(jsonl("f.jsonl", missing_rows)),
            "error",
            lambda t, out: None if "line 7" in out else "does not say line 7",
        ),
        Case(
            "bare JSON number",
            "11",
            text_case(text_file("n.json", b"42\n")),
            "error",
            lambda t, out: None if "number" in out.lower() else "does not say it is a JSON number",
        ),
        Case(
            "string label named by its number",
            "11",
            image_case(lambda t: label_csv(t / "names", ["cat", "dog", "bird"] * 4), "data.num_classes=2"),
            "error",
            lambda t, out: None if "label 'dog'" in out else "does not name the label 'dog'",
        ),
        Case(
            "data.image_size=[0,0]",
            "11",
            image_case(lambda t: images(t / "img", {"a": 30, "b": 220}), "data.image_size=[0,0]", "data.resize=resize"),
            "error",
            lambda t, out: None if "data.image_size" in out else "does not name data.image_size",
        ),
        Case(
            ".omny validate names the file",
            "11",
            lambda t, s: [
                "validate",
                str(rewrite_document(enriched(t / "m.omny", root), lambda d: d["blocks"][0].pop("weight_bytes"))),
            ],
            "error",
            lambda t, out: None if str(t / "m.omny") in out else "does not name the file",
            command="omny",
        ),
        Case(
            ".omny cut points naming tensors the graph lacks",
            "11",
            lambda t, s: [
                "validate",
                str(rewrite_document(enriched(t / "c.omny", root), _rename_first_cut)),
            ],
            "error",
            command="omny",
        ),
    ]
    return cases


def loop_link(tmp: Path) -> Path:
    os.symlink(tmp / "loop_b", tmp / "loop_a")
    os.symlink(tmp / "loop_a", tmp / "loop_b")
    return tmp / "loop_a"


def file_at(path: Path) -> Path:
    path.write_text("not a folder\n")
    return path


# --- shared artefacts (trained once) -------------------------------------------------------------------


def build_shared(root: Path, scratch: Path, names: set[str], env: dict) -> dict:
    shared: dict[str, Path] = {}
    out = scratch / "shared"
    out.mkdir(parents=True, exist_ok=True)

    def cli(*args: str) -> None:
        proc = subprocess.run(
            [sys.executable, str(root / "run.py"), *args, f"paths.outputs={out / 'outputs'}"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode:
            raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])

    def copy_ckpt(name: str) -> Path:
        import shutil

        dst = out / name / "checkpoints" / "last.ckpt"
        shutil.copytree(shared["text_ckpt"] / "checkpoints" / "last.ckpt", dst)
        return dst

    if names & {"text_ckpt", "bad_meta", "list_meta", "cut_tensors", "other_tensors"}:
        cli(
            *TEXT,
            "data=text",
            f"data.source={write_jsonl(out / 'train.jsonl', qa_rows(40))}",
            f"hydra.run.dir={out / 'text_run'}",
        )
        shared["text_ckpt"] = out / "text_run"
    if names & {"image_ckpt", "other_tensors", "cut_weights"}:
        cli(
            *IMAGE,
            f"data.source={images(out / 'img', {'a': 30, 'b': 220})}",
            f"hydra.run.dir={out / 'image_run'}",
        )
        shared["image_ckpt"] = out / "image_run"
    if "bad_meta" in names:
        (copy_ckpt("bad_meta") / "meta.json").write_text('{"__dict__": [["state_dict", ')
        shared["bad_meta"] = out / "bad_meta"
    if "list_meta" in names:
        (copy_ckpt("list_meta") / "meta.json").write_text("[1, 2, 3]")
        shared["list_meta"] = out / "list_meta"
    if "cut_tensors" in names:
        tensors = copy_ckpt("cut_tensors") / "model.safetensors"
        truncated(tensors, tensors)
        shared["cut_tensors"] = out / "cut_tensors"
    if "other_tensors" in names:
        import shutil

        dst = copy_ckpt("other_tensors") / "model.safetensors"
        shutil.copy(shared["image_ckpt"] / "checkpoints" / "last.ckpt" / "model.safetensors", dst)
        shared["other_tensors"] = out / "other_tensors"
    if "cut_weights" in names:
        from safetensors.torch import load_file, save_file

        state = load_file(str(shared["image_ckpt"] / "checkpoints" / "last.ckpt" / "model.safetensors"))
        state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        save_file(state, str(out / "v28.safetensors"))
        shared["cut_weights"] = truncated(out / "v28.safetensors", out / "v28_cut.safetensors")
    if "wrong_shapes" in names:
        import torch
        from safetensors.torch import save_file

        # llama_tiny's tensor names with every matrix one row short
        code = (
            "import yaml, json; from onn.models.load import load; "
            f"m, _ = load(yaml.safe_load(open({str(root / 'conf/model/llama_tiny.yaml')!r}))); "
            "print(json.dumps({k: list(v.shape) for k, v in m.state_dict().items()}))"
        )
        shapes = json.loads(py(root, code))
        save_file(
            {k: torch.zeros([max(1, s[0] - 1), *s[1:]]) for k, s in shapes.items()},
            str(out / "wrong.safetensors"),
        )
        shared["wrong_shapes"] = out / "wrong.safetensors"
    return shared


# --- running -------------------------------------------------------------------------------------------


def classify(case: Case, proc: subprocess.CompletedProcess | None, tmp: Path, seconds: float) -> tuple[str, str]:
    if proc is None:
        return "HANG", f"still running after {case.timeout} s"
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.strip().splitlines() if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
    said = next((ln for ln in reversed(lines) if "[ERROR]" in ln or ln.startswith("error:")), None)
    last = (said or (lines[-1] if lines else "")).split("[ERROR] - ")[-1].strip()[:160]
    if "Traceback (most recent call last)" in out:
        return "TRACEBACK", last
    if "HYDRA_FULL_ERROR" in out and not any(m in out for m in HYDRA_CONFIG_ERRORS):
        return "TRACEBACK", f"(an exception Hydra printed without its trace) {last}"
    if case.expect == "either" and proc.returncode != 0:
        return "sentence", last
    if case.expect == "error":
        if proc.returncode == 0:
            return "WRONG", f"exit 0: {(lines[-1] if lines else '')[:150]}"
        problem = case.check(tmp, out) if case.check else None
        return ("sentence", last) if not problem else ("WRONG", f"exit {proc.returncode}, {problem}: {last}")
    if proc.returncode != 0:
        return "WRONG", f"exit {proc.returncode}: {last}"
    problem = case.check(tmp, out) if case.check else None
    return ("handled", f"exit 0 in {seconds:.0f} s") if not problem else ("WRONG", f"exit 0, {problem}")


def run_case(case: Case, root: Path, scratch: Path, shared: dict, env: dict) -> tuple[str, str]:
    tmp = Path(tempfile.mkdtemp(dir=scratch))
    args = case.make(tmp, shared)
    if case.command == "omny":
        cmd = [sys.executable, "-m", "onn.export.omny", *args]
    else:
        cmd = [sys.executable, str(root / "run.py"), *args, f"paths.outputs={tmp / 'outputs'}"]
        if not any(a.startswith("hydra.run.dir=") for a in args):
            cmd.append(f"hydra.run.dir={tmp / 'outputs' / 'run'}")
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            cwd=tmp,
            env={**env, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
            timeout=case.timeout,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        proc = None
    return classify(case, proc, tmp, time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=HERE, help="the ONN checkout to run (default: this one)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--only", help="run the cases whose kind contains this text")
    args = parser.parse_args()
    root = args.root.resolve()
    cases = [c for c in build_cases(root) if not args.only or args.only in c.kind]
    scratch = Path(tempfile.mkdtemp(prefix="onn_corpus_"))
    cache = scratch / "cache"  # one hardware profile for every case
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
        "ONN_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
    }
    shared = build_shared(root, scratch, {n for c in cases for n in c.needs}, env)
    results = []
    for case in cases:
        verdict, detail = run_case(case, root, scratch, shared, env)
        results.append({"item": case.item, "kind": case.kind, "verdict": verdict, "detail": detail})
        print(f"{case.item:>3}  {verdict:<10} {case.kind:<50} {detail}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
