"""Text data and language models at their edges: records the streamed and resident readers must agree on, files
named for what they hold, a GGUF cache shared by runs of different dtypes, a model prompted as it was trained,
contexts and lengths that do not fit, and the ids that end a completion."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import compose, execute_run
from conftest import tiny_llama as conftest_llama

from onn.config.data import TextFields
from onn.errors import UserError
from onn.modalities.text import generate
from onn.modalities.text.formats import Records, read_records
from onn.modalities.text.prompts import Prompter
from onn.modalities.text.streaming import open_reader
from onn.models.tokenizer import byte_tokenizer

TEXT = compose("data=text", "data.source=unused.jsonl").data
CHAT = (  # ChatML, as SmolLM2's GGUF ships it, on ONN's byte tokenizer
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def streamed(path: Path) -> tuple[list[dict], list[str]]:
    reader = open_reader(path, "auto")
    out = list(reader.records(reader.start))
    return [record for _, _, record, _ in out], [where for _, _, _, where in out]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # one hardware profile for the module's runs


execute = execute_run


# ---- reading files ----------------------------------------------------------------------------------------------


def test_a_streamed_csv_holds_the_records_the_resident_reader_reads(tmp_path):
    """A bare quote inside a field (`The 40" model`) is no field's opening quote: the streaming reader joined lines
    until the file's quotes paired up and kept the first row of what it joined, so 40 rows streamed as 20."""
    rows = ["prompt,response"] + [f'Which TV is {i} inches?,The {i}" model' for i in range(40, 80)]
    rows.insert(5, '"A question\nover two lines, quoted",An answer with ""doubled"" quotes')
    path = tmp_path / "tv.csv"
    path.write_text("\n".join(rows) + "\n")
    resident = read_records(path)
    records, where = streamed(path)
    assert len(resident) == 41 and records == list(resident) and where == resident.where
    assert records[4]["prompt"] == "A question\nover two lines, quoted" and records[5]["response"] == 'The 44" model'
    reader = open_reader(path, "auto")
    refs = [ref for ref, _, _, _ in reader.records(reader.start)]
    assert [r for r, _ in reader.fetch(refs[3:7])] == records[3:7]  # a resumed buffer re-reads the same records
    assert reader.count(reader.start) == 41
    cut = tmp_path / "cut.csv"
    cut.write_text('prompt,response\na,b\nc,"never closed\nd,e\n')
    with pytest.raises(UserError, match=r"cut.csv line 3 opens a quoted field that the file never closes"):
        open_reader(cut, "auto").count([16, 1, 0])


def test_text_lines_split_at_newlines_only_as_streamed(tmp_path):
    """str.splitlines() also broke a line at U+2028, NEL and a form feed: read whole, one line of a .txt file
    became several samples, and line numbers after it no longer matched an editor's (or the streamed reader's)."""
    path = tmp_path / "corpus.txt"
    path.write_text("one\u2028still one\r\ntwo\x85still two\n\nthree\x0cstill three\n", encoding="utf-8")
    resident = read_records(path)
    assert [r["text"] for r in resident] == ["one\u2028still one", "two\x85still two", "three\x0cstill three"]
    assert resident.where[2].endswith("corpus.txt line 4")
    assert streamed(path) == (list(resident), resident.where)


def test_json_lines_holding_a_line_separator_are_read_whole_as_streamed(tmp_path):
    """JSON lines written with ensure_ascii=False (ONN's own predictions.jsonl) may hold U+2028 inside a string:
    read whole, the line was split there and refused as "not valid JSON"; streamed, it read fine."""
    path = tmp_path / "u2028.jsonl"
    rows = [{"question": f"q{i}: line one\u2028line two", "answer": f"#### {i}"} for i in range(5)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    resident = read_records(path)
    assert list(resident) == rows and resident.where[4].endswith("u2028.jsonl line 5")
    assert streamed(path) == (rows, resident.where)


def test_a_txt_file_whose_first_line_starts_with_a_bracket_is_text(tmp_path):
    """Lyrics ("[Verse 1]") or notes ("{draft} ...") in a .txt file were sniffed as JSON and refused."""
    lyrics = tmp_path / "lyrics.txt"
    lyrics.write_text("[Verse 1]\nI walked along the river\n[Chorus]\nla la la\n")
    assert [r["text"] for r in read_records(lyrics)][:2] == ["[Verse 1]", "I walked along the river"]
    assert streamed(lyrics)[0] == list(read_records(lyrics))
    notes = tmp_path / "notes.txt"
    notes.write_text("{draft} notes for the talk\nsecond line\n")
    assert read_records(notes)[0] == {"text": "{draft} notes for the talk"}
    lines = tmp_path / "rows.txt"  # JSON lines named .txt are still JSON lines
    lines.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert list(read_records(lines)) == [{"text": "a"}, {"text": "b"}]
    unnamed = tmp_path / "lyrics"  # no name to go by: taken for JSON, and the message says how to read it as text
    unnamed.write_text(lyrics.read_text())
    with pytest.raises(UserError, match=r"lyrics line 1 is not valid JSON .* set data.format=txt\."):
        read_records(unnamed)
    assert read_records(unnamed, "txt")[0] == {"text": "[Verse 1]"}


def test_a_malformed_prompt_format_string_is_one_sentence():
    """data.fields.input='{instruction: {input}' raised a bare ValueError from str.format (or from
    string.Formatter().parse, where data.fields.output is auto)."""
    records = Records(
        [{"instruction": "Add", "input": "2", "output": "5"}] * 4, [f"a.jsonl line {i}" for i in range(4)]
    )
    for answer in ("output", "auto"):
        cfg = dataclasses.replace(TEXT, fields=TextFields(input="{instruction: {input}", output=answer))
        with pytest.raises(UserError, match=r"data.fields.input '\{instruction: \{input\}' is not a format string"):
            Prompter(cfg, byte_tokenizer()).examples(records)


# ---- models ---------------------------------------------------------------------------------------------------


def tiny_gguf(path: Path) -> Path:
    """A one-block Llama in a GGUF file with a byte-level BPE vocabulary of 16 tokens: float32 weights that a bfloat16
    load rounds."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    width, ffn, vocab = 32, 64, ["<s>", "</s>", "ab"] + [chr(ord("a") + i) for i in range(13)]
    writer.add_context_length(64)
    writer.add_embedding_length(width)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_rope_dimension_count(width // 4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([3, 3] + [1] * (len(vocab) - 2))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (len(vocab), width), "output_norm": (width,), "output": (len(vocab), width)}
    for name, shape in [("attn_q", (width, width)), ("attn_k", (width, width)), ("attn_v", (width, width)),
                        ("attn_output", (width, width)), ("ffn_gate", (ffn, width)), ("ffn_up", (ffn, width)),
                        ("ffn_down", (width, ffn)), ("attn_norm", (width,)), ("ffn_norm", (width,))]:  # fmt: skip
        shapes[f"blk.0.{name}"] = shape
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_converted_in_bfloat16_serves_a_later_float32_load_its_own_weights(tmp_path):
    """The conversion cache was keyed by the file alone and kept the first load's dtype: after a bf16 run, a float32
    run read bf16-rounded weights."""
    from onn.models.load import load

    source = str(tiny_gguf(tmp_path / "tiny.gguf"))
    cfg = compose("model=smollm2_135m", f"model.source={source}").model
    direct, _ = load(cfg, dtype=torch.float32, cache_dir=None)
    first, _ = load(cfg, dtype=torch.bfloat16, cache_dir=tmp_path / "cache")  # converts, and keeps the conversion
    assert first.dtype == torch.bfloat16 and len(list((tmp_path / "cache" / "gguf").iterdir())) == 1
    later, _ = load(cfg, dtype=torch.float32, cache_dir=tmp_path / "cache")  # reads the conversion
    want = direct.state_dict()
    assert later.dtype == torch.float32 and all(torch.equal(t, want[k]) for k, t in later.state_dict().items())
    assert not torch.equal(
        want["model.layers.0.self_attn.q_proj.weight"].bfloat16().float(),
        want["model.layers.0.self_attn.q_proj.weight"],
    )


def tiny_llama(max_position_embeddings: int = 64):
    """The byte tokenizer's Llama: its special ids are the tokenizer's."""
    return conftest_llama(
        vocab_size=320,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )


def test_a_model_trained_on_plain_text_is_prompted_as_it_was_trained():
    """Trained on plain text, every sample began with BOS (datamodule.encode) and no chat template; at infer a typed
    prompt went through the tokenizer's chat template, and was tokenized without BOS."""
    from onn.modalities.text.datamodule import encode

    tok = byte_tokenizer()
    tok.chat_template = CHAT
    prompter = Prompter(TEXT, tok, trained_layout="text")  # a checkpoint trained on plain text
    assert prompter.render("Once upon") == "Once upon" and prompter.prompt_format.endswith("no chat template)")
    trained, _ = encode(tok, "", "Once upon a time", 64)
    n = len("Once upon") + 1
    assert trained[0] == tok.bos_token_id
    model, seen = tiny_llama(), []
    model.register_forward_pre_hook(lambda _, args, kw: seen.append(kw["input_ids"][0].tolist()), with_kwargs=True)
    special, bos = prompter.add_special_tokens, prompter.starts_with_bos
    generate.complete(model, tok, ["Once upon"], max_new_tokens=1, add_special_tokens=special, bos=bos)
    generate.stream(model, tok, "Once upon", max_new_tokens=1, add_special_tokens=special, bos=bos)
    assert seen == [trained[:n], trained[:n]]
    assert generate.check_context(model, tok, ["x" * 60], ["prompt"], 3, special, bos=bos) == 3
    with pytest.raises(UserError, match="the prompt's 62 tokens"):  # BOS counted: 62 + 3 > 64
        generate.check_context(model, tok, ["x" * 61], ["prompt"], 3, special, bos=bos)


def test_infer_of_a_checkpoint_trained_on_plain_text_gets_no_chat_template(tmp_path, cache):
    tok = byte_tokenizer()
    tok.chat_template = CHAT
    tok.save_pretrained(str(tmp_path / "chat_tokenizer"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Once upon a time there were {i} bears.\n" for i in range(20)))
    common = (f"model.tokenizer={tmp_path / 'chat_tokenizer'}", "data=text", f"data.source={corpus}")
    trained = execute(tmp_path, cache, *common, "trainer.max_steps=1",
                      "task.validate_before=false", "task.exact_match_samples=0", name="train")  # fmt: skip
    assert trained["data/layout"] == "text"
    m = execute(tmp_path, cache, *common, "task=infer", f"ckpt={tmp_path / 'train'}", "prompt=Once upon",
                "task.max_new_tokens=2", name="infer")  # fmt: skip
    assert m["infer/model_input"] == "Once upon" and m["infer/prompt_format"].endswith("no chat template)")


def test_max_length_past_the_models_positions_is_refused(tmp_path):
    """data.max_length past max_position_embeddings: GPT-2's learned positions failed with a bare IndexError in
    training (a rotary model trained on positions it never serves)."""
    from onn.modalities.registry import get

    text = get("text")
    cfg = compose("model=llama_tiny", "data=text", "data.source=a.jsonl", "data.max_length=1024")
    with pytest.raises(UserError, match=r"data.max_length=1024 .*max_position_embeddings=512 positions"):
        text.check(cfg)
    text.check(compose("model=llama_tiny", "data=text", "data.source=a.jsonl", "data.max_length=512"))
    text.check(compose("model=llama_tiny", "task=infer", "data.max_length=1024"))  # infer encodes no data


def test_a_python_built_models_positions_are_checked_before_training(tmp_path, cache):
    builder = tmp_path / "gpt2b.py"
    builder.write_text(
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "def build():\n"
        "    return GPT2LMHeadModel(GPT2Config(vocab_size=320, n_embd=32, n_layer=1, n_head=2, n_positions=64,\n"
        "                                      bos_token_id=256, eos_token_id=257, pad_token_id=258))\n"
    )
    data = tmp_path / "qa.jsonl"
    rows = [{"question": f"Count to {i}: " + "one two " * 20, "answer": str(i)} for i in range(20)]  # 170 bytes
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = (f"model.source={builder}:build", "model.tokenizer=byte", "model.architecture=null", "data=text",
            f"data.source={data}", "data.max_length=128", "trainer.max_steps=1")  # fmt: skip
    with pytest.raises(UserError, match=r"data.max_length=128 .*max_position_embeddings=64 positions"):
        execute(tmp_path, cache, *args)


def test_eval_generates_no_further_than_the_models_context(tmp_path, cache):
    """task=eval model=llama_tiny data=gsm8k generated 345 new tokens after prompts of ~200 on a model of 512
    positions: max_new_tokens=auto is cut to what the longest prompt leaves, and a set length past it is refused.
    (Here the model has 32 positions, and the answers run to 27 bytes: auto asks for 43 new tokens.)"""
    data = tmp_path / "long.jsonl"
    rows = [{"question": f"Spell {i} out.", "answer": "x" * 20 + f" #### {i}"} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ("task=eval", "data=text", f"data.source={data}", "data.val_split=0.5", "task.max_samples=1",
            "model.architecture.max_position_embeddings=32", "data.max_length=32")  # fmt: skip
    m = execute(tmp_path, cache, *args, "task.max_new_tokens=auto", name="auto")
    prompt = len("Spell 0 out.")  # a byte a token; the byte tokenizer adds no BOS to a prompt
    assert m["val/max_new_tokens"] == 32 - prompt
    with pytest.raises(
        UserError, match=r"held-out .*long.jsonl line \d: the prompt's 12 tokens and task.max_new_tokens=30"
    ):
        execute(tmp_path, cache, *args, "task.max_new_tokens=30", name="set")


def test_infer_refuses_a_folder_for_its_output_before_generating(tmp_path, cache):
    """task.output naming a folder failed with IsADirectoryError after every completion was generated."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match=r"task.output=.*out is a folder"):
        execute(tmp_path, cache, "task=infer", f"task.input={prompts}", f"task.output={tmp_path / 'out'}")


def test_infer_and_eval_stop_at_the_models_end_of_turn_as_serve_does(tmp_path):
    """A chat model's end of turn is in its generation_config (Gemma's <end_of_turn>); serve stopped there, infer and
    eval went on past it with the tokenizer's end of text alone (also when the model is layer-streamed, whose engine
    then cut the output there but decoded every token up to max_new_tokens)."""
    from onn.models.layers import discover
    from onn.streaming.engine import StreamingEngine
    from onn.streaming.store import LayerStore

    tok = byte_tokenizer()
    model = tiny_llama()
    first = int(model(**tok("hi", return_tensors="pt")).logits[0, -1].argmax())
    assert first < 256  # a byte, not one of the special tokens
    model.generation_config.eos_token_id = [tok.eos_token_id, first]
    assert generate.LanguageModel(model, tok, None).eos_ids == {tok.eos_token_id, first}
    ended = tok.decode([first])
    assert generate.complete(model, tok, ["hi", "hi"], max_new_tokens=6) == [ended, ended]
    assert generate.stream(model, tok, "hi", max_new_tokens=6) == ended
    model.requires_grad_(False)  # the engine streams frozen weights
    engine = StreamingEngine(model, discover(model), LayerStore("cpu", "float32"), 1)
    engine.offload()
    steps = []
    decode_step = engine.decode_step
    engine.decode_step = lambda *args, **kwargs: steps.append(1) or decode_step(*args, **kwargs)
    assert generate.complete(model, tok, ["hi", "hi"], max_new_tokens=6, engine=engine) == [ended, ended]
    assert generate.stream(model, tok, "hi", max_new_tokens=6, engine=engine) == ended
    assert len(steps) == 2  # one token each: the engine stops at the end of turn, not at the tokenizer's end alone


# ---- resuming a run -----------------------------------------------------------------------------------------------

STREAMED = ("data=text", "data.streaming=true", "data.shuffle_buffer=4", "data.max_length=48", "data.val_split=0.1",
            "task.validate_before=false", "task.exact_match_samples=0", "checkpoint.every_n_steps=2")  # fmt: skip


def write_sums(path: Path, rows: int = 40) -> None:
    path.write_text("".join(json.dumps({"question": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(rows)))


def test_a_streamed_file_edited_since_the_checkpoint_is_one_sentence_on_resume(tmp_path, cache):
    """A record added at the top of a streamed file between a checkpoint and its resume moved every byte offset the
    checkpoint's position and shuffle buffer name: the resume failed with "line 13 is not valid JSON" (a line the
    file holds whole), buried under Lightning's "Please call iter(combined_loader) first" traceback."""
    source = tmp_path / "sums.jsonl"
    write_sums(source)
    original, stat = source.read_bytes(), source.stat()
    args = (*STREAMED, f"data.source={source}")
    execute(tmp_path, cache, *args, "trainer.max_steps=2", name="first")
    source.write_bytes(json.dumps({"question": "1+1=", "answer": "2"}).encode() + b"\n" + original)
    resume = (*args, f"ckpt={tmp_path / 'first'}", "trainer.max_steps=3")
    with pytest.raises(UserError, match=r"data.source .*sums.jsonl changed since the checkpoint was written"):
        execute(tmp_path, cache, *resume, name="edited")
    with pytest.raises(UserError, match=r"streamed data.source .* resume with data.streaming=true"):
        execute(tmp_path, cache, *resume, "data.streaming=false", name="resident", given={"data.streaming"})
    source.write_bytes(original)  # restored as it was: the run goes on
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert execute(tmp_path, cache, *resume, name="restored")["steps"] == 3


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_a_streamed_file_gone_mid_run_is_one_sentence(tmp_path, fmt):
    """The training file deleted while a streamed run read it: the next epoch's reopening (and a resume's re-read of
    the shuffle buffer) raised a bare FileNotFoundError from inside the data loader."""
    from onn.modalities.text.datamodule import TextDataModule

    source = tmp_path / f"sums.{fmt}"
    rows = [{"question": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
    if fmt == "jsonl":
        write_sums(source)
    elif fmt == "csv":
        source.write_text("question,answer\n" + "".join(f"{r['question']},{r['answer']}\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), source, row_group_size=8)
    cfg = dataclasses.replace(TEXT, source=str(source), streaming=True, shuffle_buffer=4, batch_size=4, val_split=0.1)

    def loader():
        dm = TextDataModule(cfg, byte_tokenizer(), cfg.batch_size)
        dm.setup()
        return dm.train_dataloader()

    first, resumed = loader(), loader()
    assert sum(len(b["input_ids"]) for b in first) == 36  # one whole epoch (4 records held out)
    it = iter(first)
    next(it)
    state = first.state_dict()  # mid-epoch: a buffer of records to re-read on resume
    source.unlink()
    gone = rf"data.source .*sums.{fmt} can no longer be read \(.*No such file or directory"
    with pytest.raises(UserError, match=gone):
        list(first)  # the next epoch opens the file again
    resumed.load_state_dict(state)
    with pytest.raises(UserError, match=gone):
        next(iter(resumed))


def test_a_resume_with_nothing_left_to_train_says_so(tmp_path, cache, caplog):
    """ckpt= a finished run at its own trainer.max_steps said "train ok" and pointed metrics.json's checkpoint at a
    last.ckpt it never wrote; with a smaller trainer.max_steps, Lightning ignored it without a word. The run folder now
    holds the checkpoint it resumed, which a later resume trains on from."""
    import logging

    from onn.training.checkpoints import load

    args = ("data.builtin.train_size=64", "data.builtin.val_size=8", "task.validate_before=false",
            "task.exact_match_samples=0", "checkpoint.every_n_steps=2")  # fmt: skip
    execute(tmp_path, cache, *args, "trainer.max_steps=2", name="first")
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    with caplog.at_level(logging.WARNING, logger="onn"):
        m = execute(tmp_path, cache, *args, f"ckpt={tmp_path / 'first'}", "trainer.max_steps=2", name="same")
    kept = tmp_path / "same" / "checkpoints" / "last.ckpt"
    assert m["steps"] == 2 and m["checkpoint"] == str(kept)
    assert f"nothing left to train: ckpt={ckpt} was written at step 2" in caplog.text
    first, same = load(ckpt), load(kept)
    assert same["global_step"] == 2 and all(
        torch.equal(same["state_dict"][k], v) for k, v in first["state_dict"].items()
    )
    assert (
        execute(tmp_path, cache, *args, f"ckpt={tmp_path / 'same'}", "trainer.max_steps=3", name="more")["steps"] == 3
    )
    with pytest.raises(UserError, match=r"trainer.max_steps=1 ends the run before step 2, where ckpt=.* was written"):
        execute(tmp_path, cache, *args, f"ckpt={tmp_path / 'first'}", "trainer.max_steps=1", name="less")


def test_a_bad_line_read_by_a_dataloader_worker_is_the_readers_sentence(tmp_path, cache):
    """With data.num_workers above 0, the streaming reader runs in a DataLoader worker, and torch re-raises its
    error in the run as "Caught UserError in DataLoader worker process 0. Original Traceback ...": the worker's
    whole traceback was the one line app.run prints."""
    source = tmp_path / "sums.jsonl"
    # setup parses every line (it counts the answered ones), so a worker's own error is its prompt's: line 240 lacks
    # the field data.template names, past the 26 held-out records and the layout's sample of 200 that setup renders
    rows = [{"question": f"{i}+{i}=", "answer": str(2 * i), **({} if i == 239 else {"note": "+"})} for i in range(260)]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = (*STREAMED, f"data.source={source}", "data.num_workers=1", "trainer.max_steps=40")
    args = (*args, "data.template='{prompt} {note}'")
    with pytest.raises(UserError) as raised:
        execute(tmp_path, cache, *args)
    said = str(raised.value)
    assert said.startswith(f"data.template names the field {{note}}, which {source} line 240 does not have")
    assert "Traceback" not in said
    assert said.endswith("(in DataLoader worker process 0)") and "\n" not in said


def test_a_tokenizer_without_an_end_of_sequence_token_is_one_sentence():
    """Every answer ends in the tokenizer's eos id: a tokenizer with a pad token and none (a tokenizer folder's)
    gave [..., None], a TypeError in the collate once training began."""
    from onn.modalities.text.datamodule import encode

    tok = byte_tokenizer()
    tok.eos_token = None
    with pytest.raises(UserError, match="has no end-of-sequence token, which ends every answer: give it an eos_token"):
        encode(tok, "1+1=", "2", 32)


def test_epochs_cut_by_limit_train_batches_end_the_schedule_with_the_run(tmp_path, cache):
    """max_epochs=1 with limit_train_batches=3 trains 3 steps: the cosine schedule spanned the whole epoch's batches
    and the run ended at the start of its decay (the rate barely down from optim.lr)."""
    from onn.training.checkpoints import load

    args = ("trainer.max_epochs=1", "trainer.max_steps=-1", "trainer.limit_train_batches=3", "optim.schedule=cosine")
    metrics = execute_run(tmp_path, cache, *args, "optim.warmup_steps=0")
    assert metrics["steps"] == 3
    saved = load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert saved["lr_schedulers"][0]["_last_lr"] == pytest.approx([0.0], abs=1e-9)  # cosine's end


def test_a_fraction_of_a_language_models_batches_is_one_sentence():
    """Lightning takes no fraction of a stream's batches: it was a MisconfigurationException out of fit."""
    from onn.modalities.registry import get

    with pytest.raises(UserError, match=r"trainer.limit_train_batches=0.5: .*a number of batches"):
        get("text").check(compose("model=llama_tiny", "trainer.limit_train_batches=0.5"))
    get("text").check(compose("model=llama_tiny", "trainer.limit_train_batches=1.0"))
    get("text").check(compose("model=llama_tiny", "task=infer", "trainer.limit_train_batches=0.5"))  # no training


def test_an_eval_of_a_source_encodes_it_once(tmp_path, caplog):
    """task=eval data.source=FILE scores all of FILE (data.val_source is set to it); the data module encoded FILE
    once more as training data, which eval never reads, and warned of its long records twice. Eval sets it up for
    validation (as Lightning's trainer.validate does)."""
    from onn.modalities.text.datamodule import TextDataModule

    source = tmp_path / "test.jsonl"
    rows = [{"prompt": f"q{i}", "answer": "a" * (200 if i == 3 else 4)} for i in range(10)]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = compose("data=text", f"data.source={source}", f"data.val_source={source}", "data.max_length=64").data
    dm = TextDataModule(data, byte_tokenizer(), 4)
    with caplog.at_level("WARNING", logger="onn"):
        dm.setup("validate")
    long_records = [r.getMessage() for r in caplog.records if "longer than data.max_length" in r.getMessage()]
    assert len(long_records) == 1 and "data.val_source" in long_records[0]
    assert len(dm.val_set) == 10 and len(next(iter(dm.train_dataloader()))["input_ids"]) == 4  # training still reads it
