"""Generation with transformers' generate: streamed tokens for one prompt, batches for many."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from onn.errors import UserError
from onn.modalities.text.datamodule import extract_answer


def _sampling(max_new_tokens: int, temperature: float, top_p: float, tokenizer) -> dict[str, Any]:
    kwargs = {
        "max_new_tokens": max_new_tokens,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    if temperature and temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p)
    else:
        kwargs.update(do_sample=False)
    return kwargs


def _generate(
    model, engine, tokenizer, inputs, max_new_tokens, temperature, top_p, streamer=None
) -> torch.Tensor:
    """New tokens for a left-padded batch: layer-streamed when an engine is given, else model.generate."""
    if engine is not None:
        on_token = (lambda token: streamer.put(token.cpu())) if streamer is not None else None
        out = engine.generate(inputs["input_ids"], inputs["attention_mask"], max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                              temperature=temperature, top_p=top_p, on_token=on_token)  # fmt: skip
        if streamer is not None:
            streamer.end()
        return out
    out = model.generate(
        **inputs, streamer=streamer, **_sampling(max_new_tokens, temperature, top_p, tokenizer)
    )
    return out[:, inputs["input_ids"].shape[1] :]


@torch.no_grad()
def stream(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    engine=None,
) -> str:
    """Print the completion token by token as it is generated; return it."""
    from transformers import TextStreamer

    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt").to(_device(model, engine))
    streamer = TextStreamer(tokenizer, skip_prompt=engine is None, skip_special_tokens=True)
    new = _generate(model, engine, tokenizer, inputs, max_new_tokens, temperature, top_p, streamer)
    return tokenizer.decode(new[0], skip_special_tokens=True)


@torch.no_grad()
def complete(model, tokenizer, prompts: list[str], max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
             batch_size: int = 16, engine=None) -> list[str]:  # fmt: skip
    """Completions for many prompts in left-padded batches (with an engine, every chunk load serves the whole batch)."""
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    results = []
    try:
        for i in range(0, len(prompts), batch_size):
            inputs = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True).to(
                _device(model, engine)
            )
            new = _generate(model, engine, tokenizer, inputs, max_new_tokens, temperature, top_p)
            results += tokenizer.batch_decode(new, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return results


def exact_match(
    model,
    tokenizer,
    examples: list[tuple[str, str]],
    pattern: str | None,
    max_samples: int,
    max_new_tokens: int,
    engine=None,
    batch_size: int = 16,
) -> float:
    """Fraction of greedy answers equal to the reference answer (after extract_answer on both).
    `batch_size` prompts generate together (with an engine: every chunk load serves all of them)."""
    examples = examples[:max_samples]
    if not examples:
        return float("nan")
    outputs = complete(
        model, tokenizer, [p for p, _ in examples], max_new_tokens=max_new_tokens, engine=engine, batch_size=batch_size
    )
    hits = sum(
        extract_answer(o, pattern) == extract_answer(a, pattern) for o, (_, a) in zip(outputs, examples)
    )
    return hits / len(examples)


def read_prompts(path: str) -> list[dict[str, Any]]:
    """Rows of a prompts JSONL file: each needs a "prompt" (or "input"/"question") field."""
    from onn.modalities.text.formats import read_records

    rows = read_records(path, "jsonl", key="task.input")
    for i, row in enumerate(rows, 1):
        if not any(k in row for k in ("prompt", "input", "question")):
            raise UserError(f"task.input {path} row {i} has no 'prompt' field; its fields are {sorted(row)}.")
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _device(model, engine=None) -> torch.device:
    return engine.device if engine is not None else next(model.parameters()).device
