"""Review fixes: a graph checkpoint whose class folders macOS wrote decomposed resumes on the same data; task=eval
reads the decoded cache its training wrote; the plan sizes a Mamba's LoRA without the out_proj peft refuses."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import soundfile as sf
from conftest import compose
from test_audio import tone

from onn.data.labelled import kept_class_folder
from onn.modalities.audio.dataset import READER
from onn.modalities.classification import in_checkpoint_order
from onn.modalities.graph.dataset import GraphDataModule
from onn.modalities.graph.read import EDGE_SUFFIXES
from onn.planning.spec import model_spec, targeted_linears

CAFE_NFD = "cafe\u0301"  # "café" as macOS names a folder: e and a combining accent


def test_a_graph_checkpoint_of_decomposed_class_folders_resumes_on_the_same_data(tmp_path):
    """Graph folders keep their names as written (NFD) while the checkpoint's classes are compared as NFC: the
    unchanged data was refused as lacking its own class café. Now the same data resumes as it is."""
    for cls in (CAFE_NFD, "tea"):
        for i in range(6):
            f = tmp_path / "graphs" / cls / f"g{i}{EDGE_SUFFIXES[0]}"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text("0 1\n1 2\n" + ("2 3\n" if cls == "tea" else ""))
    cfg = compose("data=graph", f"data.source={tmp_path / 'graphs'}")
    dm = GraphDataModule(cfg.data)
    dm.setup()
    assert CAFE_NFD in dm.classes  # the data as graph/read.py names it
    assert in_checkpoint_order(None, cfg, dm, {"classes": list(dm.classes)}, "cpu") is dm


def _keys(root: Path, known: tuple[str, ...]) -> list[str]:
    """The decoded-cache entries after reading `root` through the audio reader with `known` classes."""
    cfg = compose("data=audio", f"data.source={root}").data
    READER.read_cached(str(root), cfg, root.parent / "cache", known=known)
    return sorted(p.name for p in (root.parent / "cache").rglob("*") if p.is_file())


def test_eval_of_a_checkpoint_reads_the_decoded_cache_its_training_wrote(tmp_path):
    """task=eval knows the checkpoint's classes, which went into the cache key: it decoded the whole source again
    and stored a second copy. They change the listing only for a lone top folder of a known class, and only then
    the key; such a folder gets its own entry."""
    root = tmp_path / "clips"
    for name, freq in {"ant": 300.0, "bee": 900.0}.items():
        (root / name).mkdir(parents=True)
        for i in range(3):
            sf.write(root / name / f"{i}.wav", tone(freq, 0.2, seed=i), 8000)
    trained = _keys(root, ())
    assert trained and _keys(root, ("ant", "bee")) == trained  # eval adds no entry
    lone = tmp_path / "lone" / "bee" / "s1"
    lone.mkdir(parents=True)
    sf.write(lone / "0.wav", tone(900.0, 0.2, seed=0), 8000)
    assert kept_class_folder(tmp_path / "lone", frozenset(READER.suffixes), ["bee"]) == "bee"
    assert kept_class_folder(tmp_path / "lone", frozenset(READER.suffixes), ["ant"]) is None


def test_the_plan_sizes_a_mamba_models_lora_without_the_out_proj_peft_refuses(tmp_path):
    """all-linear on Mamba: training leaves out the mixer's out_proj (peft refuses it), the plan sized adapters on
    it too (31% more adapter weights than trained). Now the plan's targets are training's."""
    arch = {
        "model_type": "mamba",
        "architectures": ["MambaForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 16,
        "state_size": 4,
        "num_hidden_layers": 2,
    }
    base = compose("model=llama_tiny").model
    model_cfg = dataclasses.replace(base, architecture=arch, name="tiny-mamba")
    spec = model_spec(model_cfg, 8)
    targeted = targeted_linears(spec, "all-linear")
    names = {name.rsplit(".", 1)[-1] for block in targeted for name, _, _ in block}
    assert names == {"in_proj", "x_proj", "dt_proj"}
    assert spec.lora_params_per_block == [8 * sum(i + o for _, i, o in block) for block in targeted]
    assert spec.lora_refused == ["out_proj"]


def test_a_folder_that_will_not_sync_after_the_rename_leaves_the_file_written_with_a_warning(
    tmp_path, monkeypatch, caplog
):
    """The rename put the file in place before its folder's fsync failed (EIO): that was reported as a write the
    disk refused, though the file was there whole. Now it is a warning, and the file holds the new text."""
    import errno
    import os
    import stat

    from onn.hardware.disk import write_text_atomically

    real_fsync = os.fsync

    def folder_fails(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", folder_fails)
    path = tmp_path / "profile.json"
    with caplog.at_level("WARNING", logger="onn.hardware.disk"):
        write_text_atomically(path, '{"a": 1}')
    assert path.read_text() == '{"a": 1}'
    assert "could not be synced" in caplog.text
