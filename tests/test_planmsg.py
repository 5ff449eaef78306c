"""Four messages a new user met: diffusion's data.val_split=1.5 refused only once every image was decoded; a disk
store's size printed after "blocks cached in RAM", read as RAM; a graph data.source that does not exist planned on a
stand-in (in a garbled sentence) before it was refused; `omny run` on a .omny said a raw UTF-8 decode error."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from conftest import compose

from onn.errors import UserError


def test_diffusion_refuses_a_val_split_outside_0_1_before_the_plan(tmp_path):
    """The check that runs before the plan says the data module's sentence, data.source unread (a folder that does
    not exist): the old check passed, and the run refused it once the images were decoded."""
    from onn.modalities.registry import get

    given = ("data=diffusion", "model=ddpm_unet", f"data.source={tmp_path / 'unread'}", "hardware=cpu_16gb")
    with pytest.raises(UserError, match=r"^data\.val_split must be between 0 and 1 \(got 1\.5\): it is the fraction"):
        get("diffusion").check(compose(*given, "data.val_split=1.5"))
    get("diffusion").check(compose(*given, "data.val_split=0.2"))  # a fraction passes


def streaming_line(tmp_path: Path, hardware: str):
    """The plan of `model=phi4 data=math strategy=sparse_lora task=plan hardware=HARDWARE` (Phi-4 on the meta
    device) and its rendered streaming line."""
    from onn.hardware.profile import resolve
    from onn.planning.plan import make_plan, render
    from onn.planning.spec import model_spec

    cfg = compose("model=phi4", "data=math", "strategy=sparse_lora", "task=plan", f"hardware={hardware}", root=tmp_path)
    plan = make_plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path), model_spec(cfg.model, 8))
    (line,) = [r for r in render(plan).splitlines() if r.startswith("streaming:")]
    return plan.streaming, line


def test_a_disk_stores_size_and_its_cached_blocks_size_each_sit_by_what_they_measure(tmp_path):
    """Phi-4 on a 16 GB CPU: a float32 store on disk (50.8 GB) with one block cached; the store's GB was printed
    after "1 of 40 blocks cached in RAM", where it read as RAM. Now the cached blocks carry their own size (one
    block's bytes), and a store in host memory still reads "int8 in host memory (12.7 GB)"."""
    disk, line = streaming_line(tmp_path, "cpu_16gb")
    assert disk.store == "disk" and disk.cache_blocks >= 1  # the case the user met
    cached_gb = disk.cache_blocks * disk.block_mb / 1024
    assert cached_gb < disk.store_gb / 10
    assert (
        f"store {disk.store_dtype} on disk ({disk.store_gb:,.1f} GB), {disk.cache_blocks} of 40 blocks cached in RAM "
        f"({cached_gb:,.1f} GB), edges" in line
    )
    assert f"cached in RAM ({disk.store_gb:,.1f} GB)" not in line

    host, line = streaming_line(tmp_path, "rtx4090_24gb")
    assert host.store == "cpu"
    assert f"store {host.store_dtype} in host memory ({host.store_gb:,.1f} GB), edges" in line
    assert "cached in RAM" not in line


def test_a_graph_source_that_does_not_exist_is_refused_before_the_plan(tmp_path):
    """It was planned on a stand-in graph 'as no file says its size', then refused when the run read it; task=infer
    reads task.input instead and still plans."""
    from onn.hardware.profile import resolve
    from onn.modalities.registry import get

    missing = tmp_path / "does_not_exist"
    config = compose("data=graph", "model=gin", f"data.source={missing}", "hardware=cpu_16gb", "task=plan")
    hardware = resolve(config.hardware, tmp_path / "cache", tmp_path)
    with pytest.raises(UserError, match=rf"^data\.source {missing} does not exist; point it at a dataset file or"):
        get("graph").plan(config, hardware)
    infer = compose("data=graph", "model=gin", f"data.source={missing}", "hardware=cpu_16gb", "task=infer")
    assert get("graph").plan(infer, hardware)[0].strategy == "full"


def test_the_graph_stand_in_says_why_in_a_sentence(tmp_path):
    """An archive (its graphs not sized without decoding) and an unset data.source plan on the stand-in, said in
    words ("a stand-in: no file of data.source says its size unread (meshes, an archive)" was garbled, and named
    meshes and archives for an unset source too)."""
    from onn.modalities.graph.tasks import plan_sample

    archive = tmp_path / "graphs.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("a/0.edges", "0 1\n1 2\n")
    zipped = plan_sample(compose("data=graph", "model=gin", f"data.source={archive}").data)
    assert zipped.source == (
        "a stand-in, as no file of data.source gives its size without being decoded (meshes, an archive)"
    )
    assert plan_sample(compose("data=graph", "model=gin").data).source == "a stand-in, as data.source is not set"


def test_omny_run_on_a_single_omny_says_what_run_takes(tmp_path, capsys):
    """`run x.omny x.jpg` said "... is not a pipeline document (not JSON: 'utf-8' codec can't decode byte 0x88 ...)";
    now one sentence: run takes a pipeline export's pipeline.json, inspect and validate a single .omny."""
    from onn.export.omny.cli import main

    piece = tmp_path / "model.omny"
    piece.write_bytes(b"\x08\x88\x01\x12\x04onnx\xff\xfe")  # the start of a protobuf, as an .omny's bytes are
    assert main(["run", str(piece), str(tmp_path / "x.jpg"), "--text", "a cat."]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {piece} is a single model file: run takes the pipeline.json a pipeline export")
    assert "inspect or validate take a single .omny" in err
    assert "codec" not in err and "0x88" not in err
