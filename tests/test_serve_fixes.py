"""task=serve defects a review reproduced: stop strings cut at the first to appear, a sliding-window model's batch
survives a row that finishes first, sampled rows draw without reading the device back, completions' logprobs=0
is refused."""

from __future__ import annotations

import queue
import warnings
from types import SimpleNamespace

import pytest
import torch
from test_serve import KEY, MODEL, client, serve_job, start


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A random-init tiny Llama (byte tokenizer), resident, with a key."""
    with start(
        serve_job(tmp_path_factory.mktemp("serve"), f"model={MODEL}", "strategy=full", f"serve.api_key={KEY}")
    ) as running:
        yield running


def complete(http, prompt: str, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_the_text_ends_at_the_first_stop_string_to_appear_whichever_the_request_listed_first(lm):
    """stop=["yz", "xyz"]: both complete with the token "z", and the text ended before "yz" (the first listed),
    keeping the "x" that begins "xyz". OpenAI's and llama.cpp's servers cut at the earliest stop string."""
    with client(lm) as http:
        for prompt in ("hello", "a", "x y", "the cat sat on", "1+1="):  # a random model's text: one with an "xyz"
            text = complete(http, prompt)["text"]
            starts = [
                i for i in range(len(text) - 2) if text.find(text[i : i + 3]) == i < text.find(text[i + 1 : i + 3])
            ]
            if starts:
                break
        assert starts, "no greedy completion has three characters to stop at"
        at = starts[0]
        stopped = complete(http, prompt, stop=[text[at + 1 : at + 3], text[at : at + 3]])
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == text[:at]


def test_a_sliding_window_models_batch_goes_on_when_one_row_finishes_first(tmp_path):
    """A model whose KV cache keeps a sliding window (Mistral, Gemma, Qwen2) decodes a batch admitted together; the
    row that finished first took the cache's columns with it by the mask's numbering, and the others failed with
    "IndexError: index out of range". Each row now gets what it gets alone."""
    from onn.tasks.serve.batching import Sampling, Scheduler, Sequence

    job = serve_job(
        tmp_path,
        f"model={MODEL}",
        "strategy=full",
        "model.architecture.model_type=mistral",
        "model.architecture.architectures=[MistralForCausalLM]",
        "+model.architecture.sliding_window=8",
    )
    served = job.modality.serving(job)
    scheduler = Scheduler(served, slots=4)
    requests = [("hello world, a prompt longer than the window", 4), ("hi", 20), ("abc", 9)]

    def generate(batch: list[tuple[str, int]]) -> list[tuple[str, str]]:
        events = [queue.Queue() for _ in batch]
        seqs = [
            Sequence(served.tokenizer(prompt)["input_ids"], Sampling(most), q.put)
            for (prompt, most), q in zip(batch, events)
        ]
        with scheduler.lock:  # admitted in one step: one wave
            for seq in seqs:
                scheduler.submit(seq)
        out = []
        for q in events:
            text, event = "", q.get(timeout=120)
            while "text" in event:
                text, event = text + event["text"], q.get(timeout=120)
            out.append((text, event.get("error") or event["finish"]))
        return out

    try:
        assert type(served.new_cache().layers[0]).__name__ == "DynamicSlidingWindowLayer"
        alone = [generate([request])[0] for request in requests]
        assert generate(requests) == alone
        assert scheduler.widest == len(requests)
    finally:
        scheduler.close()


def sampled_row(seed: int, device: str) -> SimpleNamespace:
    from onn.tasks.serve.batching import Sampling

    return SimpleNamespace(
        sampling=Sampling(max_tokens=4, temperature=0.8, top_p=0.9),
        generator=torch.Generator(device=device).manual_seed(seed),
    )


def test_a_sampled_draw_is_the_seeds_multinomial_draw():
    """The draw without torch.multinomial is multinomial's own: the same token for the same seed."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    from onn.tasks.serve.batching import _pick

    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(0))
    scores = TopPLogitsWarper(0.9)(None, TemperatureLogitsWarper(0.8)(None, logits - logits.max()))
    for seed in range(20):
        expected = torch.multinomial(torch.softmax(scores, -1), 1, generator=torch.Generator().manual_seed(seed))
        assert _pick(logits, [sampled_row(seed, "cpu")]) == [int(expected)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_sampled_rows_wait_for_the_device_once_a_step():
    """torch.multinomial checks its probabilities with two reads back to the host: two waits for the device per
    sampled row and step. A step of four sampled rows now waits once, for the tokens' one copy."""
    from onn.tasks.serve.batching import _pick

    logits = torch.randn(4, 300, device="cuda")
    rows = [sampled_row(seed, "cuda") for seed in range(4)]
    _pick(logits, rows)  # warm: kernels loaded
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            tokens = _pick(logits, rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert all(0 <= token < 300 for token in tokens)


def test_completions_logprobs_zero_is_refused_not_ignored(lm):
    """/v1/completions' logprobs is a number, and 0 asks for the chosen tokens' log-probabilities: it was taken as
    "none" and answered without them."""
    with client(lm) as http:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "logprobs": 0}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "logprobs"
        assert response.json()["error"]["code"] == "unsupported_parameter"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": False}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200


def _tokenizers(lm) -> list:
    """The served model's byte tokenizer, and SmolLM2's (a BPE with byte fallback) where it has been fetched."""
    from pathlib import Path

    found = [lm.app.state.scheduler.tokenizer]
    gguf = Path.home() / ".cache/onn/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
    if gguf.exists():
        from transformers import AutoTokenizer

        found.append(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
    return found


def _llama2_style():
    """A SentencePiece-style BPE as Llama 2's and Mistral's: "▁" for spaces, byte fallback, the leading space
    stripped at decode, and an added special token (a tool call's marker)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for piece in ("▁", "▁Hello", "▁world", "▁,", "."):
        vocab[piece] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    strip = decoders.Strip(" ", 1, 0)
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), strip])
    bpe.add_special_tokens([AddedToken("<|tool|>", special=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tool = tokenizer.convert_tokens_to_ids("<|tool|>")
    ids = [vocab["▁Hello"], tool, vocab["▁world"], vocab["▁,"], tool, tool, vocab["▁world"], vocab["."]]
    return tokenizer, ids + tokenizer("café 東京 🙂", add_special_tokens=False)["input_ids"]


def test_a_streamed_completion_decodes_only_its_new_tokens_and_reads_as_the_whole_decode(lm, monkeypatch):
    """Each token decoded the whole completion again (n^2 / 2 token decodes for n tokens: 1 ms a step and row at
    4,000). The text is now the last few text tokens decoded with their context, and the events read, token by
    token, as the whole completion decoded: spaces, accents, CJK and an emoji split over several tokens, and a
    special token between two words of a tokenizer that strips a leading space (as context it decoded to
    nothing, and " world" lost its space)."""
    from onn.tasks.serve.batching import Sampling, Sequence, special_ids

    scheduler = lm.app.state.scheduler
    words = "Hello  world, café naïve 東京 🙂 done.\n  x" * 8
    cases = [(t, t(words, add_special_tokens=False)["input_ids"]) for t in _tokenizers(lm)] + [_llama2_style()]
    monkeypatch.setattr(scheduler, "eos", set())
    for tokenizer, ids in cases:
        widths: list[int] = []
        decode = tokenizer.decode

        def counted(ids, widths=widths, decode=decode, **kw):
            widths.append(len(ids))
            return decode(ids, **kw)

        monkeypatch.setattr(scheduler, "tokenizer", SimpleNamespace(decode=counted))
        monkeypatch.setattr(scheduler, "special", special_ids(tokenizer))
        sent: list[str] = []
        seq = Sequence([], Sampling(len(ids)), emit=lambda event, sent=sent: sent.append(event.get("text", "")))
        final = decode(ids, skip_special_tokens=True)
        for n, token in enumerate(ids, 1):
            scheduler._advance(seq, token)
            whole = decode(ids[:n], skip_special_tokens=True)
            assert final.startswith("".join(sent)), n  # what was sent stands
            assert "\ufffd" in whole or seq.text == whole, n  # (a character still arriving shows as U+FFFD)
        assert "".join(sent) == final and max(widths) <= 8, max(widths)
