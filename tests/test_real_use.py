"""Issue 14's malformed and hostile inputs, one generated equivalent per kind (items 7-11): each is handled
correctly or ends in one sentence. tests/hostile_corpus.py runs the same kinds through the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import compose, read_metrics, run_cli
from hostile_corpus import (
    enriched,
    images,
    label_csv,
    link_loops,
    qa_rows,
    quoted_csv,
    ragged_csv,
    rewrite_document,
    tar_with_absolute_member,
    write_jsonl,
)

from onn.errors import UserError
from onn.modalities.text.formats import read_records
from onn.modalities.text.prompts import Prompter
from onn.models.tokenizer import byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FIELDS = compose("data=text", "data.source=unused.jsonl").data  # fields auto, template {prompt}, chat_template auto


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # one hardware profile for the module's runs


def execute(tmp: Path, cache: Path, *overrides: str, text: bool = True) -> dict:
    from onn.app import execute as run

    groups = (
        ["model=llama_tiny", "data=text"]
        if text
        else ["model=v28_cnn", "data=image", "trainer.max_epochs=1", "trainer.max_steps=-1", "data.batch_size=4"]
    )
    if text and not any(o.startswith("task=") for o in overrides):
        groups += ["task.validate_before=false", "task.exact_match_samples=0"]
    cfg = compose(
        *groups,
        "tracking=none",
        "trainer.enable_progress_bar=false",
        "trainer.max_steps=2" if text else "optim.warmup_steps=0",
        f"paths.outputs={tmp / 'outputs'}",
        f"paths.cache={cache}",
        *overrides,
    )
    run_dir = tmp / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run(cfg, run_dir, {o.split("=", 1)[0] for o in overrides})  # the keys the "command line" set


def image_data(tmp: Path, cache: Path, source: Path, *overrides: str):
    from onn.modalities import get

    cfg = compose("model=v28_cnn", "data=image", f"data.source={source}", f"paths.cache={cache}", *overrides)
    dm = get("image").datamodule(cfg, "cpu")
    dm.setup()
    return dm


# --- 7. silent wrong data -------------------------------------------------------------------------------


def test_a_csv_with_quoted_newlines_and_doubled_quotes_reads_as_csv_does(tmp_path):
    rows = read_records(quoted_csv(tmp_path / "q.csv"))
    assert len(rows) == 20  # was 41 lines of text
    assert rows[3] == {"input": "Write a poem about 3", "output": 'Roses are red,\nviolets are "blue" 3'}
    assert rows.where[3].endswith("q.csv row 4 (line 8)")


def test_a_ragged_csv_names_its_row_instead_of_training_on_its_header(tmp_path):
    with pytest.raises(UserError, match=r"r.csv row 6 \(line 7\) has 3 cells but the header has 2"):
        read_records(ragged_csv(tmp_path / "r.csv"))


def test_null_answers_are_named_by_line(tmp_path):
    rows = qa_rows()
    rows[3]["output"] = None
    records = read_records(write_jsonl(tmp_path / "n.jsonl", rows))
    with pytest.raises(UserError, match=r"n.jsonl line 4: 'output' \(data.fields.output\) is null"):
        Prompter(FIELDS, byte_tokenizer()).examples(records)


@pytest.mark.slow  # 14-28 s on 2 cores (ci133, ci135)
def test_settings_that_silently_did_the_wrong_thing_are_refused(tmp_path, cache):
    source = write_jsonl(tmp_path / "d.jsonl", qa_rows())
    for override, said in [
        ("data.max_length=0", r"data.max_length=0: give a whole number, 2"),
        ("optim.warmup_steps=-5", r"optim.warmup_steps=-5: give a whole number, 0 or more"),
        (
            "hardware.budget_mb=100",
            r"hardware.budget_mb=100 MB is below what the run holds before any model is built",
        ),
    ]:
        with pytest.raises(UserError, match=said):
            execute(tmp_path, cache, f"data.source={source}", override)


def test_classes_given_in_another_order_keep_each_image_under_its_name(tmp_path, cache):
    dm = image_data(tmp_path, cache, images(tmp_path / "img", {"a": 30, "b": 220}), "data.classes=[b,a]")
    assert dm.classes == ["b", "a"]
    for split in dm.splits.values():
        assert all(name.split("/")[-2] == dm.classes[label] for name, label in zip(split.names, split.labels.tolist()))


def test_classes_given_in_another_order_keep_each_streamed_image_under_its_name(tmp_path, cache):
    source = images(tmp_path / "img", {"a": 30, "b": 220})  # each class its own red level
    overrides = ("data.classes=[b,a]", "data.resident=false", "data.num_workers=0", "data.batch_size=2")
    dm = image_data(tmp_path, cache, source, *overrides)
    assert dm.classes == ["b", "a"] and dm.streamed
    seen = [
        (dm.classes[label], {30: "a", 220: "b"}[int(image[0, 0, 0])])
        for loader in (dm.train_dataloader(), dm.val_dataloader())
        for batch, labels in loader
        for image, label in zip(batch, labels.tolist())
    ]
    held = {split: [items.names[i] for i in index] for split, (items, index) in dm.streamed.items()}
    assert sorted(held["train"] + held["val"]) == [f"{c}/{i}.png" for c in "ab" for i in range(8)]  # each once
    # all of val, and training's whole batches (it drops a last part-batch): the hashed split decides the counts
    assert len(seen) == len(held["val"]) + len(held["train"]) // 2 * 2
    assert all(named == drawn for named, drawn in seen), seen


def test_image_labels_that_are_no_class(tmp_path, cache):
    with pytest.raises(UserError, match=r"labels.csv row 12 has label 'cat', but the other labels are numbers"):
        image_data(tmp_path, cache, label_csv(tmp_path / "mixed", ["0", "1"] * 5 + ["cat"] + ["1", "0"] * 2))
    dm = image_data(tmp_path, cache, tar_with_absolute_member(tmp_path / "abs.tar"), "data.max_bad_fraction=0.1")
    assert dm.classes == ["a", "b"] and any("/etc/evil/x.png: an absolute path" in s for s in dm.skipped)
    with pytest.raises(UserError, match=r"has label 'dog' \(class 2 of 3 names: bird, cat, dog\), outside \[0, 2\)"):
        image_data(tmp_path, cache, label_csv(tmp_path / "names", ["cat", "dog", "bird"] * 4), "data.num_classes=2")


# --- 8. checkpoint identity ------------------------------------------------------------------------------


@pytest.mark.slow
def test_eval_takes_the_architecture_from_the_checkpoint_and_the_data_from_the_command_line(tmp_path, outputs, cache):
    trained = execute(
        tmp_path / "text",
        cache,
        f"data.source={write_jsonl(tmp_path / 'train.jsonl', qa_rows(40))}",
        "data.val_split=0.1",
    )
    new = write_jsonl(tmp_path / "new.jsonl", [{"input": f"Say {i}", "output": f"{i}{i}"} for i in range(30)])
    common = [
        "tracking=none",
        f"paths.outputs={outputs}",
        f"paths.cache={cache}",
        "trainer.enable_progress_bar=false",
    ]
    proc = run_cli(
        "task=eval",
        f"ckpt={trained['checkpoint']}",
        f"data.source={new}",
        "model=phi4_tiny",
        "task.max_samples=2",
        *common,
        f"hydra.run.dir={outputs / 'eval'}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = read_metrics(outputs / "eval")
    assert (
        m["model"] == "llama_tiny" and m["data"] == "text" and m["data_source"] == str(new)
    )  # not phi4_tiny, not math
    assert m["data/val_records"] == 30 and m["from_checkpoint"] == {  # all of NEW is scored
        "model": "checkpoint",
        "strategy": "checkpoint",
        "data": "checkpoint, with data.source from the command line",
    }
    assert "the command line is not used" in proc.stderr + proc.stdout  # model=phi4_tiny: said, not silently dropped
    picture = execute(
        tmp_path / "img", cache, f"data.source={images(tmp_path / 'pics', {'a': 30, 'b': 220})}", text=False
    )
    proc = run_cli("task=eval", f"ckpt={picture['checkpoint']}", "data=text", f"data.source={new}", *common)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout
    assert "holds a model of image data, but data=text is text data" in proc.stderr + proc.stdout


# --- 9. hangs --------------------------------------------------------------------------------------------


def test_folders_with_link_loops_and_dev_zero_end(tmp_path, cache):
    from onn.modalities import detect

    dm = image_data(tmp_path, cache, link_loops(tmp_path / "loops"))
    assert dm.classes == ["a", "b"] and sum(len(s) for s in dm.splits.values()) == 12  # each image once
    with pytest.raises(UserError, match="/dev/zero is a character device"):
        detect("/dev/zero")
    with pytest.raises(UserError, match="/dev/zero is a character device"):
        read_records("/dev/zero")
    with pytest.raises(UserError, match="/dev/zero is a character device"):
        image_data(tmp_path, cache, Path("/dev/zero"))


# --- 10. tracebacks where a sentence belongs --------------------------------------------------------------


def test_text_files_in_other_encodings(tmp_path):
    rows = qa_rows(3)
    utf16 = tmp_path / "u16.jsonl"
    utf16.write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode("utf-16"))
    assert read_records(utf16) == rows
    latin = tmp_path / "l1.txt"
    latin.write_bytes("caf\xe9 au lait\nnum\xe9ro deux\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"l1.txt is not UTF-8 text: byte 0xe9 on line 1 \(Latin-1"):
        read_records(latin)
    binary = tmp_path / "weights.jsonl"
    binary.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(UserError, match=r"weights.jsonl is a binary file, not text"):
        read_records(binary)
    bare = tmp_path / "utf16_no_bom.jsonl"
    bare.write_bytes(json.dumps(rows[0]).encode("utf-16-le"))
    with pytest.raises(UserError, match=r"looks like UTF-16 without a byte-order mark"):
        read_records(bare)


def text_data(source: Path, *overrides: str):
    """A text run's data, read as its first step does (data=text, the byte tokenizer)."""
    from onn.modalities.text.datamodule import TextDataModule

    data = compose("data=text", f"data.source={source}", "data.val_split=0.2", *overrides).data
    dm = TextDataModule(data, byte_tokenizer(), 4)
    dm.setup()
    return dm


def test_latin1_training_text_names_the_byte_and_the_iconv_fix(tmp_path):
    latin = tmp_path / "l1.txt"
    latin.write_bytes(b"caf\xe9 au lait\n" * 50)
    binary = tmp_path / "weights.txt"
    binary.write_bytes(bytes(range(256)) * 64)
    for streaming in ("auto", "true"):
        with pytest.raises(
            UserError, match=r"^data.source \S*l1.txt is not UTF-8 text: byte 0xe9 on line 1 .*iconv -f latin1 -t utf-8"
        ):
            text_data(latin, f"data.streaming={streaming}")
        with pytest.raises(UserError, match=r"^data.source \S*weights.txt is a binary file, not text"):
            text_data(binary, f"data.streaming={streaming}")


def test_plain_text_training_with_question_answer_validation_reads_each_by_its_layout(tmp_path):
    train = tmp_path / "train.txt"
    train.write_text("".join(f"plain line {i}\n" for i in range(30)))
    val = write_jsonl(tmp_path / "val.jsonl", [{"question": f"{i}+{i}?", "answer": str(2 * i)} for i in range(3)])
    want = [("0+0?", "0"), ("1+1?", "2"), ("2+2?", "4")]
    for overrides in ([], ["data.streaming=true"], ["data.fields.input=question"]):
        dm = text_data(train, f"data.val_source={val}", *overrides)
        assert dm.val_examples == want, overrides
        assert dm.prompter.layout.name == "text" and dm.train_records == 30
    assert dm.train_examples[0] == ("", "plain line 0")  # plain text: loss on every token


def test_weights_of_the_wrong_shape_or_truncated(tmp_path, cache):
    import torch
    from safetensors.torch import save_file

    from onn.models.load import load

    cfg = compose("model=llama_tiny").model
    state = load(cfg)[0].state_dict()
    save_file(
        {k: torch.zeros([max(1, v.shape[0] - 1), *v.shape[1:]]) for k, v in state.items()},
        str(tmp_path / "w.safetensors"),
    )
    with pytest.raises(UserError, match=r"w.safetensors does not match model.architecture: wrong shapes"):
        load(dataclasses.replace(cfg, source=str(tmp_path / "w.safetensors")))
    model, tokenizer = load(cfg)
    model.save_pretrained(str(tmp_path / "hf"))
    tokenizer.save_pretrained(str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "intermediate_size": 100}))
    with pytest.raises(UserError, match=r"hf: its weights do not have the shapes its config.json describes"):
        load(dataclasses.replace(cfg, source=str(tmp_path / "hf"), architecture=None, tokenizer=None))
    from onn.models.vision import build_classifier

    net = build_classifier(compose("model=v28_cnn").model, 3, 2, [12, 12])
    save_file(net.state_dict(), str(tmp_path / "v28.safetensors"))
    data = (tmp_path / "v28.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"model.weights .*cut.safetensors is not a readable safetensors file"):
        execute(
            tmp_path,
            cache,
            f"data.source={images(tmp_path / 'img', {'a': 30, 'b': 220})}",
            f"model.weights={tmp_path / 'cut.safetensors'}",
            text=False,
        )


@pytest.mark.slow  # 12-32 s in ci137's fast suite, which took 646 s
def test_damaged_checkpoints_are_one_sentence(tmp_path, cache):
    m = execute(tmp_path, cache, f"data.source={write_jsonl(tmp_path / 'd.jsonl', qa_rows())}")
    good = Path(m["checkpoint"])
    network = execute(
        tmp_path / "img", cache, f"data.source={images(tmp_path / 'pics', {'a': 30, 'b': 220})}", text=False
    )

    def damaged(name: str, change) -> Path:
        ckpt = tmp_path / name / "checkpoints" / "last.ckpt"
        shutil.copytree(good, ckpt)
        change(ckpt)
        return ckpt

    def cut(ckpt: Path) -> None:
        data = (ckpt / "model.safetensors").read_bytes()
        (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])

    for name, change, said in [
        (
            "corrupt",
            lambda c: (c / "meta.json").write_text('{"__dict__": [["state_dict", '),
            r"meta.json is not valid JSON",
        ),
        (
            "list",
            lambda c: (c / "meta.json").write_text("[1, 2, 3]"),
            r"meta.json does not hold an ONN checkpoint's structure",
        ),
        ("cut", cut, r"model.safetensors is damaged \(truncated"),
        (
            "other",
            lambda c: shutil.copy(Path(network["checkpoint"]) / "model.safetensors", c / "model.safetensors"),
            r"names the tensor .* which model.safetensors lacks",
        ),
    ]:
        with pytest.raises(UserError, match=said):
            # data=text needs a source to compose; the checkpoint's data config is used, with this (its own) file
            execute(
                tmp_path,
                cache,
                "task=eval",
                f"ckpt={damaged(name, change)}",
                f"data.source={tmp_path / 'd.jsonl'}",
            )
    assert (good / "meta.json").is_file()  # the run's own checkpoint is untouched


def test_one_class_and_link_loop_sources(tmp_path, cache):
    with pytest.raises(UserError, match=r"has 1 class \(only\): a classifier needs two or more"):
        image_data(tmp_path, cache, images(tmp_path / "one", {"only": 90}))
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    for call in (
        lambda: read_records(tmp_path / "loop_a"),
        lambda: image_data(tmp_path, cache, tmp_path / "loop_a"),
    ):
        with pytest.raises(UserError, match=r"loop_a is a symbolic link loop"):
            call()


@pytest.mark.parametrize("text", [True, False], ids=["text", "image"])
def test_bad_numbers_in_settings(tmp_path, cache, text):
    source = write_jsonl(tmp_path / "d.jsonl", qa_rows()) if text else images(tmp_path / "img", {"a": 30, "b": 220})
    cases = [
        ("optim.lr=-1", r"optim.lr=-1.0: give a number 0 or more"),
        ("trainer.max_steps=-5", r"trainer.max_steps=-5: give a whole number, 1 or more, or -1"),
        ("optim.schedule=warmup_cosine", r"optim.schedule='warmup_cosine' is not one of cosine"),
    ]
    if text:
        cases += [
            ("strategy.streaming.chunk_size=0", r"strategy.streaming.chunk_size=0: give a whole number of blocks"),
            ("strategy.streaming.mlp_tiles=0", r"strategy.streaming.mlp_tiles=0: give a whole number of slices"),
        ]
    for override, said in cases:
        extra = ["strategy=sparse_lora"] if "streaming" in override else []
        with pytest.raises(UserError, match=said):
            execute(tmp_path, cache, f"data.source={source}", *extra, override, text=text)


@pytest.mark.slow  # a run.py process (~20 s loaded); test_config_review11 checks the sentence fast
def test_a_value_of_the_wrong_type_is_one_sentence_naming_the_key(tmp_path):
    proc = run_cli("trainer.max_steps=abc", f"paths.outputs={tmp_path}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "error: trainer.max_steps=abc: trainer.max_steps takes a whole number, and 'abc' is not one; fix the value."
    )


# --- 11. messages that mislead ----------------------------------------------------------------------------


def test_messages_name_what_the_user_wrote(tmp_path, cache):
    rows = qa_rows()
    del rows[6]["output"]
    with pytest.raises(UserError, match=r"m.jsonl line 7 has no field 'output'"):  # not the row it had after shuffling
        execute(tmp_path, cache, f"data.source={write_jsonl(tmp_path / 'm.jsonl', rows)}")
    (tmp_path / "n.json").write_text("42\n")
    with pytest.raises(UserError, match=r"n.json holds a bare JSON number \(42\), not records"):
        read_records(tmp_path / "n.json")
    with pytest.raises(UserError, match=r"data.image_size=\[0, 0\]: give \[height, width\] in pixels"):
        execute(
            tmp_path,
            cache,
            f"data.source={images(tmp_path / 'img', {'a': 30, 'b': 220})}",
            "data.image_size=[0,0]",
            "data.resize=resize",
            text=False,
        )


def test_omny_validate_names_the_file_and_checks_the_documents_tensors(tmp_path, capsys):
    from onn.export.omny.cli import main

    bad = rewrite_document(enriched(tmp_path / "m.omny", ROOT), lambda d: d["blocks"][0].pop("weight_bytes"))
    assert main(["validate", str(bad)]) == 2
    assert f"{bad}: the .omny document is invalid at blocks/0" in capsys.readouterr().err

    def rename(doc: dict) -> None:  # the cut point and the block it ends both name it, as the reader requires
        doc["cut_points"][0]["name"] = doc["blocks"][0]["cut_after"] = "no_such_tensor"

    lying = rewrite_document(enriched(tmp_path / "c.omny", ROOT), rename)
    assert main(["validate", str(lying)]) == 1
    assert "names tensors the graph does not have: no_such_tensor" in capsys.readouterr().out
