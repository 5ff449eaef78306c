"""Run records, checkpoints and the OCR / bench edges a second review reproduced: Lightning's "`weights_only` was
not set" line after training, Hydra's .hydra/ files cut short by a refused write (with a traceback), OCR lines cut
at 32 tokens without a word, bench_omny running task.repeats<=0 once, and task=serve's n=2 refused in pydantic's
words."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, compose
from test_pipelines_review2 import _export
from test_serve import MODEL, client, serve_job, start
from test_vision_train import make_images, run

from onn.errors import UserError


# -- 1. testing the best checkpoint --------------------------------------------------------------------------------
def test_testing_the_best_checkpoint_restores_it_with_no_weights_only_line(tmp_path, caplog, capfd):
    """The final last.ckpt was saved without saying what it holds, and Lightning logged "`weights_only` was not set,
    defaulting to `False`" in every classifier's run (ONN's checkpoints are safetensors: nothing is unpickled). The
    validation after training reads the best epoch's weights: at lr 2.0 the first epoch is the best by far (which
    epoch is best depends on which items data.val_split's hash holds out: at lr 0.5 the last one was)."""
    images = make_images(tmp_path / "images", train=8, test=4)
    for split in (images / "test").iterdir():  # no test split: the best checkpoint is validated again
        for file in split.iterdir():
            file.unlink()
        split.rmdir()
    (images / "test").rmdir()
    caplog.set_level(logging.INFO)
    # Lightning's logger may not propagate (it does not where the root had no handler when lightning was imported:
    # its own StreamHandler then holds whichever stderr it saw, an earlier test's capture): heard here directly
    lightning = logging.getLogger("lightning.pytorch")
    lightning.addHandler(caplog.handler)
    try:
        metrics, _ = run(tmp_path, f"data.source={images}", "task.monitor=val/loss", "optim.lr=2.0")
    finally:
        lightning.removeHandler(caplog.handler)
    losses = [h["val/loss"] for h in metrics["val/history"]]
    best = min(range(len(losses)), key=losses.__getitem__)
    assert best != len(losses) - 1 and losses[-1] > losses[best] * 1.05, losses  # the last epoch is not the best
    assert metrics["val/loss"] == pytest.approx(losses[best], rel=1e-3), (metrics["val/loss"], losses)
    said = caplog.text + "".join(capfd.readouterr())
    assert "Restoring states from the checkpoint path" in said  # the best checkpoint was loaded
    assert "weights_only" not in said


# -- 2. Hydra's .hydra/ files on a disk that refuses the write -----------------------------------------------------
def _file_size_limit(limit: int):
    """In the child, before it runs: writes past `limit` bytes fail with EFBIG (as a full disk fails them)."""

    def limited() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel ends the process at the write
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return limited


@pytest.mark.slow  # 14-28 s on 2 cores (ci133, ci135)
def test_a_refused_write_of_hydras_files_is_one_sentence_and_leaves_no_cut_file(tmp_path):
    """Hydra wrote .hydra/config.yaml with a plain open(): a refused write left the file cut short and ended in
    Hydra's traceback. Now each file is written whole or not at all and the refusal is one sentence naming it."""
    resource = pytest.importorskip("resource")
    if not hasattr(resource, "RLIMIT_FSIZE"):
        pytest.skip("no RLIMIT_FSIZE on this system: a refused write cannot be provoked")
    run_dir = tmp_path / "run"
    argv = [sys.executable, str(ROOT / "run.py"), "task=plan", "model=llama_tiny", "hardware=cpu_16gb",
            f"paths.outputs={tmp_path / 'outputs'}", f"hydra.run.dir={run_dir}"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(  # config.yaml is some 3 KB: over the limit
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, preexec_fn=_file_size_limit(2048)
    )
    assert proc.returncode == 1, proc.stderr
    config = run_dir / ".hydra" / "config.yaml"
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: cannot write {config}: File too large; write the run (hydra.run.dir) elsewhere."
    ), proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == []  # no cut-short file, no temporary one


# -- 3. OCR lines cut at the token limit ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trocr(tmp_path_factory):
    return _export("trocr_mini", tmp_path_factory.mktemp("trocr"))


def _page(path: Path) -> Path:
    from PIL import Image, ImageDraw, ImageFont

    page = Image.new("RGB", (500, 200), "white")
    draw = ImageDraw.Draw(page)
    for k, line in enumerate(("A line of print", "and a second one.")):
        draw.text((30, 30 + 90 * k), line, fill="black", font=ImageFont.load_default(size=30))
    page.save(path)
    return path


def test_ocr_records_its_token_limit_and_says_which_lines_reached_it(trocr, tmp_path, caplog):
    """Every line stopped at a fixed 32 tokens and the answer said nothing. The export now records the limit (the
    decoder's position table bounds it), and a line that reaches it is flagged in the answer and in a warning."""
    from onn.export.pipelines import Request, run_pipeline

    model, path = trocr
    doc = json.loads(path.read_text())
    assert doc["settings"]["max_new_tokens"] == model.config.decoder.max_position_embeddings - 2  # 62: under 128
    doc["settings"]["max_new_tokens"] = 2
    path.write_text(json.dumps(doc))
    page = _page(tmp_path / "page.png")
    with caplog.at_level(logging.WARNING, logger="onn"):
        read = run_pipeline(path, Request(page, tmp_path / "page.result.png"))
    assert len(read["lines"]) == 2
    for line in read["lines"]:  # the untrained decoder writes no end-of-text token in its first two steps
        assert len(line["token_ids"]) == 2 and line["cut_at_max_new_tokens"] is True, line
    assert "line(s) 1, 2 reached settings.max_new_tokens=2" in caplog.text
    assert json.loads(Path(read["json"]).read_text())["lines"][0]["cut_at_max_new_tokens"] is True

    doc["settings"]["max_new_tokens"] = 0
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError, match=r"settings.max_new_tokens=0: give a whole number, 1 or more"):
        run_pipeline(path, Request(page, tmp_path / "page.result.png"))


# -- 4. bench_omny's repeats ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("repeats", [0, -2])
def test_bench_omny_refuses_repeats_below_one_in_one_sentence(tmp_path, repeats):
    """task.repeats=0 ran the pipeline once and reported its time as the best of 0 runs."""
    from onn.app import execute

    config = compose("task=bench_omny", "export=omny", "model=llama_tiny", "tracking=none", "hardware=cpu_16gb",
                     f"paths.outputs={tmp_path}", f"task.repeats={repeats}")  # fmt: skip
    with pytest.raises(UserError, match=rf"^task.repeats={repeats}: give a whole number, 1 or more.$"):
        execute(config, tmp_path / "run")


# -- 5. task=serve's n ---------------------------------------------------------------------------------------------
def test_serve_refuses_n_over_one_as_it_refuses_other_fields(tmp_path):
    """n=2 was "n: Input should be less than or equal to 1", pydantic's words; now it is said as best_of is."""
    ask = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with start(serve_job(tmp_path, f"model={MODEL}", "strategy=full")) as lm, client(lm, key=None) as http:
        response = http.post("/v1/chat/completions", json={**ask, "n": 2})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error == {**error, "param": "n", "code": "unsupported_parameter"}, error
        assert error["message"] == "n: this server generates one completion per request; leave n out."
        assert http.post("/v1/chat/completions", json={**ask, "n": 1}).status_code == 200
        zero = http.post("/v1/chat/completions", json={**ask, "n": 0})
        assert zero.status_code == 400 and zero.json()["error"]["param"] == "n", zero.text
