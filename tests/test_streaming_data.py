"""Text datasets larger than memory (data.streaming): bounded memory, exact resume after kill -9, the
auto choice in the plan, and files cut off mid-record."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, compose, read_metrics, run_cli

from onn.config import as_dict
from onn.config.data import TextData
from onn.errors import UserError

STREAM = [
    "model=llama_tiny",
    "data=text",
    "data.streaming=true",
    "tracking=none",
    "task.exact_match_samples=0",
    "task.validate_before=false",
    "data.max_length=64",
]


def write_jsonl(path, rows: int, filler: str = "") -> None:
    with open(path, "w") as f:
        for i in range(rows):
            f.write(
                json.dumps({"question": f"record {i}: {filler}what is {i % 7}+{i % 5}?", "answer": str(i % 7 + i % 5)})
                + "\n"
            )


def data_cfg(source, **over) -> TextData:
    cfg = compose("data=text", f"data.source={source}").data
    return dataclasses.replace(cfg, **{"streaming": True, **over})


def module(cfg):
    from onn.modalities.text.datamodule import TextDataModule
    from onn.models.tokenizer import byte_tokenizer

    dm = TextDataModule(cfg, byte_tokenizer(), cfg.batch_size, seed=0)
    dm.setup()
    return dm


def texts_of(batch) -> list[str]:
    """Each sample's text, decoded as data.trace writes it."""
    from onn.models.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    return [
        tok.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"])
    ]


def ids_of(loader) -> list[int]:
    from onn.models.tokenizer import byte_tokenizer

    tok, out = byte_tokenizer(), []
    for batch in loader:
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            out.append(int(re.search(r"record (\d+)", tok.decode(ids[mask.bool()].tolist())).group(1)))
    return out


MEASURE = """
import json, sys
import onn.modalities.text.stream_loader  # imports (torch, torchdata) before the baseline
from onn.hardware.memory import PeakMemory, anon_rss_mb
from onn.config import typed
from onn.config.data import TextData
from onn.modalities.text.datamodule import TextDataModule
from onn.models.tokenizer import byte_tokenizer
cfg = typed(TextData, json.loads(sys.argv[1]), "data")
tokenizer, seen = byte_tokenizer(), 0
base = anon_rss_mb()
with PeakMemory("cpu", interval_s=0.005) as peak:
    dm = TextDataModule(cfg, tokenizer, cfg.batch_size, seed=0)
    dm.setup()  # counts the records, holds the validation split
    for batch in dm.train_dataloader():
        seen += batch["input_ids"].shape[0]
print(json.dumps({"growth_mb": peak.peak_mb - base, "seen": seen, "rows": dm.train_records,
                  "streamed": dm.stream is not None}))
"""


@pytest.mark.slow
def test_a_file_4x_the_budget_streams_a_whole_epoch_within_it(tmp_path):
    """A JSONL file of 4x data.resident_max_mb (its decoded size far more) is counted, its validation split
    held and all the rest tokenised and batched, while the process's anonymous memory grows by less than the
    budget (read whole, the same file takes ~110 MB). In a subprocess, so no other test's allocations count."""
    source = tmp_path / "big.jsonl"
    budget = 4
    write_jsonl(source, 28500, filler="lorem ipsum dolor sit amet " * 20)
    assert source.stat().st_size >= 4 * budget * 2**20
    cfg = data_cfg(source, streaming="auto", resident_max_mb=budget, shuffle_buffer=256, max_length=128, val_split=0.01)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, json.dumps(as_dict(cfg))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    # seed 0 draws 298 of these records under val_split=0.01 (sources.record_share): they are held out
    assert found["streamed"] and found["seen"] == found["rows"] == 28500 - 298
    print(f"peak anonymous RSS growth {found['growth_mb']:.2f} MB for a budget of {budget} MB")
    assert found["growth_mb"] < budget, found


def test_resume_from_loader_state_continues_on_the_same_sample(tmp_path):
    """The loader's state (what Lightning stores in the checkpoint) through JSON and into a fresh loader:
    the rest of the epoch and the next epoch are exactly the uninterrupted order."""
    source = tmp_path / "d.jsonl"
    write_jsonl(source, 203)
    cfg = data_cfg(source, shuffle_buffer=16, batch_size=4, val_split=0.01)
    whole_loader = module(cfg).train_dataloader()
    whole = ids_of(whole_loader) + ids_of(whole_loader)
    assert (
        sorted(whole[: len(whole) // 2]) == sorted(set(whole)) and whole[: len(whole) // 2] != whole[len(whole) // 2 :]
    )
    loader = module(cfg).train_dataloader()
    first, it = [], iter(loader)
    from onn.models.tokenizer import byte_tokenizer

    for _ in range(13):
        batch = next(it)
        first += [
            int(re.search(r"record (\d+)", byte_tokenizer().decode(i[m.bool()].tolist())).group(1))
            for i, m in zip(batch["input_ids"], batch["attention_mask"])
        ]
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = module(cfg).train_dataloader()
    resumed.load_state_dict(state)
    rest = ids_of(resumed) + ids_of(resumed)
    assert first + rest == whole


def test_trainer_max_epochs_ends_a_text_run_resident_or_streamed(tmp_path):
    """trainer.max_epochs was ignored on resident text (one endless shuffled stream), and a streamed run that its
    epoch limit ended sized its schedule's warm-up and decay for trainer.max_steps all the same."""
    from onn.modalities.text.tasks import run_steps

    source = tmp_path / "d.jsonl"
    write_jsonl(source, 40)
    for streaming in (False, True):
        dm = module(data_cfg(source, streaming=streaming, batch_size=8, val_split=0.2))  # 4 batches of 8 an epoch
        assert dm.train_records == 32
        for steps, epochs, expected in ((20, 1, 4), (20, -1, 20), (3, 2, 3), (-1, 2, 8)):
            config = compose(f"trainer.max_steps={steps}", f"trainer.max_epochs={epochs}")
            assert run_steps(config, dm) == expected, (streaming, steps, epochs)


@pytest.mark.slow
@pytest.mark.parametrize("streaming", [False, True])
def test_a_text_run_ends_at_its_epoch_limit_with_its_schedule_run_out(tmp_path, streaming):
    """What run_steps counts is what trains: two epochs of 16 records in batches of 8 are 4 steps, and the cosine
    schedule, sized for them, has decayed to 0 at the end (sized for trainer.max_steps=20, it stood at 90% of
    optim.lr)."""
    source = tmp_path / "d.jsonl"
    write_jsonl(source, 20)
    run_dir = tmp_path / "run"
    proc = run_cli(
        *STREAM, f"data.streaming={str(streaming).lower()}", f"data.source={source}", "data.val_split=0.2",
        "trainer.max_steps=20", "trainer.max_epochs=2", "optim.warmup_steps=0", f"hydra.run.dir={run_dir}",
        f"paths.outputs={tmp_path / 'outputs'}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_metrics(run_dir)["steps"] == 4
    from onn.training.checkpoints import load

    group = load(run_dir / "checkpoints" / "last.ckpt")["optimizer_states"][0]["param_groups"][0]
    assert group["lr"] == pytest.approx(0.0, abs=1e-12)


def _trace(path) -> list[tuple[int, list[str]]]:
    return [(r["step"], r["samples"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.slow
def test_kill_9_mid_epoch_resumes_on_the_exact_sample(tmp_path, outputs):
    """run.py killed with SIGKILL after a mid-epoch checkpoint, resumed with ckpt=: the samples trained on,
    step by step (data.trace), are those of an uninterrupted pass of the same loader, across epoch boundaries
    too. A resume that restarted the epoch, reshuffled or skipped a batch would differ."""
    source = tmp_path / "d.jsonl"
    write_jsonl(source, 90)
    steps, epoch = 30, 11  # 84 training records (6 drawn under val_split) in batches of 8: the run spans 3 epochs
    args = [
        *STREAM,
        f"data.source={source}",
        "data.shuffle_buffer=16",
        "data.batch_size=8",
        f"trainer.max_steps={steps}",
        "checkpoint.every_n_steps=1",
        "trainer.val_check_interval=1000",
        f"paths.outputs={outputs}",
    ]
    # the uninterrupted run's samples, step by step: the same loader, in-process, epoch after epoch
    cfg, whole = data_cfg(source, shuffle_buffer=16, batch_size=8, max_length=64), []
    loader = module(cfg).train_dataloader()
    while len(whole) < steps:
        whole += [texts_of(batch) for batch in loader]
    whole = list(enumerate(whole[:steps]))
    killed, trace = outputs / "killed", tmp_path / "killed.jsonl"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *args, f"data.trace={trace}", f"hydra.run.dir={killed}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    meta = killed / "checkpoints" / "last.ckpt" / "meta.json"
    deadline, step = time.time() + 300, 0
    while time.time() < deadline and proc.poll() is None and step < epoch + 3:  # into the second epoch
        try:
            found = re.search(r'"global_step", (\d+)', meta.read_text())
            step = int(found.group(1)) if found else 0
        except OSError:
            pass
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = int(re.search(r'"global_step", (\d+)', meta.read_text()).group(1))
    assert epoch < saved < steps and saved % epoch, f"no mid-epoch checkpoint to resume from (step {saved})"
    resumed = tmp_path / "resumed.jsonl"
    proc = run_cli(*args, f"ckpt={killed}", f"data.trace={resumed}", f"hydra.run.dir={outputs / 'resumed'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = [s for s in _trace(trace) if s[0] < saved]
    after = _trace(resumed)
    assert after[0][0] == saved and [s for s, _ in before] == list(range(saved))
    assert before + after == whole
    assert read_metrics(outputs / "resumed")["steps"] == steps


def test_auto_streams_over_the_budget(tmp_path):
    source = tmp_path / "d.jsonl"
    write_jsonl(source, 3000, filler="lorem ipsum " * 10)  # ~0.5 MB on disk
    from onn.modalities.text.streaming import streaming_choice

    over, reason = streaming_choice(data_cfg(source, streaming="auto", resident_max_mb=1))
    assert over is True and re.fullmatch(
        r"data: streamed from d\.jsonl: about \d+ MB decoded \(3,000 records\) is over "
        r"data\.resident_max_mb=1 \(data\.streaming=auto\)",
        reason,
    )
    held, reason = streaming_choice(data_cfg(source, streaming="auto", resident_max_mb=500))
    assert held is False and reason.startswith("data: held in memory: about")
    assert module(data_cfg(source, streaming="auto", resident_max_mb=1)).stream is not None
    assert module(data_cfg(source, streaming="auto", resident_max_mb=500)).stream is None


def test_auto_reads_utf16_and_utf32_text_whole(tmp_path):
    """A UTF-16/32 file with its byte-order mark (which formats.py reads) was refused under the default
    data.streaming=auto: estimating its size opened a streaming reader, which walks UTF-8 bytes only."""
    from onn.modalities.text.streaming import streaming_choice

    for codec, fmt in (("utf-16", "jsonl"), ("utf-32", "jsonl"), ("utf-16", "csv")):
        source = tmp_path / f"d_{codec}.{fmt}"
        rows = [{"question": f"what is {i}+1?", "answer": str(i + 1)} for i in range(40)]
        text = "".join(json.dumps(r) + "\n" for r in rows)
        if fmt == "csv":
            text = "question,answer\n" + "".join(f"{r['question']},{r['answer']}\n" for r in rows)
        source.write_bytes(text.encode(codec))
        held, reason = streaming_choice(data_cfg(source, streaming="auto"))
        assert held is False and f"is {codec.upper()} text, which is not streamed" in reason, reason
        dm = module(data_cfg(source, streaming="auto", val_split=0.1))
        assert dm.stream is None and dm.train_records + len(dm.val_examples) == 40
        assert ("what is 0+1?", "1") in dm.train_examples + dm.val_examples
    with pytest.raises(UserError, match=r"is UTF-16 text of 0 MB, over data\.resident_max_mb=0, and only UTF-8"):
        streaming_choice(data_cfg(tmp_path / "d_utf-16.jsonl", streaming="auto", resident_max_mb=0.0001))
    with pytest.raises(UserError, match=r"is UTF-16 text, which is not streamed: save it as UTF-8, or set"):
        module(data_cfg(tmp_path / "d_utf-16.jsonl", streaming=True))


@pytest.mark.slow
def test_the_plan_says_when_auto_streams(tmp_path):
    source = tmp_path / "d.jsonl"
    write_jsonl(source, 3000, filler="lorem ipsum " * 10)
    over = run_cli(
        "task=plan",
        "model=llama_tiny",
        "data=text",
        f"data.source={source}",
        "data.resident_max_mb=1",
        "tracking=none",
        f"paths.outputs={tmp_path / 'out'}",
    )
    assert over.returncode == 0, over.stderr[-3000:]
    assert re.search(
        r"data: streamed from d\.jsonl: about \d+ MB decoded \(3,000 records\) is over data\.resident_max_mb=1",
        over.stdout,
    )


def test_formats_stream_as_their_resident_records(tmp_path):
    """CSV (a quoted field across lines), parquet (several row groups) and txt: streamed records are the
    resident reader's, formatted by the same Prompter."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": f'record {i}: say "{i}",\nplease', "answer": str(i)} for i in range(40)]
    csv_path = tmp_path / "d.csv"
    import csv

    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, ["question", "answer"])
        w.writeheader()
        w.writerows(rows)
    pq_path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), pq_path, row_group_size=7)
    txt = tmp_path / "d.txt"
    txt.write_text("".join(f"record {i}: plain line\n\n" for i in range(40)))
    for path in (csv_path, pq_path, txt):
        resident = module(data_cfg(path, streaming=False, val_split=0.05))
        streamed = module(data_cfg(path, shuffle_buffer=5, val_split=0.05, batch_size=3))
        texts = set()
        from onn.models.tokenizer import byte_tokenizer

        for batch in streamed.train_dataloader():
            texts |= {
                byte_tokenizer().decode(i[m.bool()].tolist(), skip_special_tokens=True)
                for i, m in zip(batch["input_ids"], batch["attention_mask"])
            }
        trained = {p + a for p, a in resident.train_examples}  # both hold out the records drawn under val_split
        assert texts == trained and len(texts) == streamed.train_records, path


def test_a_file_cut_mid_record_is_one_sentence(tmp_path):
    source = tmp_path / "cut.jsonl"
    write_jsonl(source, 50)
    data = source.read_bytes()
    source.write_bytes(data[: len(data) - 9])
    with pytest.raises(UserError, match=r"cut\.jsonl line 50 is cut off mid-record"):
        module(data_cfg(source))
    pq_path = tmp_path / "cut.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": f"q{i}", "answer": "a"} for i in range(100)]), pq_path)
    pq_path.write_bytes(pq_path.read_bytes()[:-100])
    with pytest.raises(UserError, match=r"cut\.parquet is not a readable parquet file"):
        module(data_cfg(pq_path, format="parquet"))
    csv_path = tmp_path / "cut.csv"
    csv_path.write_text('question,answer\n"q1",a\n"q2, cut')
    with pytest.raises(UserError, match=r"cut\.csv line 3 opens a quoted field"):
        module(data_cfg(csv_path))


@pytest.mark.slow
def test_a_cut_file_ends_a_run_in_one_sentence(tmp_path):
    source = tmp_path / "cut.jsonl"
    write_jsonl(source, 50)
    source.write_bytes(source.read_bytes()[:-9])
    proc = run_cli(*STREAM, f"data.source={source}", "trainer.max_steps=2", f"paths.outputs={tmp_path / 'o'}")
    assert proc.returncode != 0 and "line 50 is cut off mid-record" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_streamed_images_resume_mid_epoch_from_the_checkpointed_loader_state(tmp_path):
    """Media data streamed (data.resident=false): the training loader's state, through ONN's checkpoint
    encoding (JSON + tensors), resumes the epoch and the next one in the uninterrupted order (2 workers)."""
    from test_vision_train import make_images

    from onn.modalities.image.dataset import ImageDataModule
    from onn.training.checkpoints import flatten, unflatten

    root = make_images(tmp_path / "images", train=24, test=4)

    def loader():
        data = compose(
            "data=image",
            f"data.source={root}",
            "data.resident=false",
            "data.num_workers=2",
            "data.batch_size=4",
            "data.mean=[0.5,0.5,0.5]",
            "data.std=[0.25,0.25,0.25]",
        ).data
        dm = ImageDataModule(data, str(tmp_path / "cache"))
        dm.setup()
        return dm.train_dataloader()

    def sums(batches) -> list[float]:
        return [round(float(x.float().sum()), 2) for x, _ in batches]

    whole_loader = loader()
    whole = sums(whole_loader) + sums(whole_loader)
    assert whole[: len(whole) // 2] != whole[len(whole) // 2 :]  # each epoch is shuffled anew
    first_loader = loader()
    it = iter(first_loader)
    first = sums(next(it) for _ in range(3))
    tensors: dict = {}
    meta = json.loads(json.dumps(flatten(first_loader.state_dict(), tensors)))
    resumed = loader()
    resumed.load_state_dict(unflatten(meta, tensors))
    assert first + sums(resumed) + sums(resumed) == whole
