"""Generation with transformers' generate: streamed tokens for one prompt, batches for many."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from onn.errors import UserError
from onn.modalities.text.datamodule import extract, extract_answer, prompt_ids
from onn.modalities.text.formats import read_records
from onn.modalities.text.prompts import Prompter
from onn.models.load import context_length

log = logging.getLogger("onn")


@dataclass
class LanguageModel:
    """A causal LM ready to generate (task=infer, task=serve): resident, or layer-streamed by `engine`."""

    model: Any
    tokenizer: Any
    prompter: Prompter
    engine: Any = None  # a StreamingEngine when the blocks' frozen weights live in a layer store

    @property
    def device(self) -> torch.device:
        return _device(self.model, self.engine)

    @property
    def eos_ids(self) -> set[int]:
        """Tokens that end a completion: the tokenizer's end of text, the model's (a chat model's end of turn) and,
        where prompts go through the chat template, the token training ended its answers with (answer_end)."""
        turn = self.prompter.answer_end if self.prompter is not None else []
        return set(end_ids(self.model, self.tokenizer, turn))

    def new_cache(self):
        from transformers import DynamicCache

        config = getattr(self.model, "config", None)
        return DynamicCache(config=config) if config is not None else DynamicCache()

    @torch.no_grad()
    def step(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache,
        last: bool = False,
    ) -> torch.Tensor:
        """One forward of a batch with a KV cache: the last position's logits (batch x vocab, float32).
        Streamed, every chunk load serves every row."""
        if self.engine is not None:
            return self.engine.decode_step(input_ids, attention_mask, position_ids, cache, last=last)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float()


def end_ids(model, tokenizer, turn_end: list[int] | tuple[int, ...] = ()) -> list[int]:
    """Tokens that end a completion, the tokenizer's end of text first, then the model's own (its generation_config:
    a chat model's end of turn, Gemma's <end_of_turn>), then the first of `turn_end`, what the chat template ends an
    assistant's turn with where prompts go through it (Llama 3's <|eot_id|> beside a base model's <|end_of_text|>:
    training ends answers with it, Prompter.answer_end): infer and eval stop where serve stops, by how the model was
    trained, whatever the prompt. A plain text model, or data.chat_template=false, gives no `turn_end`: it learned that
    token as text, and goes on past it."""
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [tokenizer.eos_token_id, *(config_eos if isinstance(config_eos, list) else [config_eos]), *turn_end[:1]]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def prompt_batch(tokenizer, texts: list[str], add_special_tokens: bool = True, bos: bool = False):
    """Prompts tokenized (see prompt_ids) and padded on the tokenizer's padding side, as tensors."""
    if not bos:
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens)
    rows = [prompt_ids(tokenizer, text, bos=True) for text in texts]
    return tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")


# model.generate's other warpers, penalties and beam search, off: transformers fills what a call leaves unset from the
# model's generation_config and then its own defaults (top_k=50), while a layer-streamed model and task=serve sample
# through temperature and top-p alone (engine._pick) and decode one path. The same checkpoint and settings sample from
# one distribution (a checkpoint's num_beams=4 searched beams resident, and refused task=infer's streamer).
NO_PENALTIES = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "num_beams": 1}
ONLY_TEMPERATURE_AND_TOP_P = {"top_k": 0, "min_p": 0.0, "typical_p": 1.0, **NO_PENALTIES}
# below it generation is greedy (infer, eval and serve alike): the distribution is the top token's alone anyway, and a
# temperature under float32's range (1e-40) made every score infinite and the draw a crash on NaN probabilities
GREEDY_BELOW = 1e-4


def greedy(temperature: float, top_p: float) -> bool:
    """Whether generation takes the likeliest token at every step: the rule _sampling documents, which task=infer,
    task=eval, the layer-streamed engine and task=serve's scheduler all follow."""
    return temperature < GREEDY_BELOW or top_p == 0


def _sampling(max_new_tokens: int, temperature: float, top_p: float, tokenizer, ends: list[int]) -> dict[str, Any]:
    """model.generate's settings: sampled through temperature and top-p alone, or greedy (`greedy`) at a temperature
    under GREEDY_BELOW or at top_p 0. top_p 0 is a nucleus of the likeliest token alone, as OpenAI's API and serve's
    `top_p` read it; passed on, transformers' TopPLogitsWarper(0) kept that token only through its
    min_tokens_to_keep, and the draw still took from the random generator."""
    kwargs = {
        "max_new_tokens": max_new_tokens,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": ends or None,
    }
    if not greedy(temperature, top_p):
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, **ONLY_TEMPERATURE_AND_TOP_P)
    else:
        kwargs.update(do_sample=False, **NO_PENALTIES)
    return kwargs


@contextmanager
def _ends_only(model) -> Iterator[None]:
    """The model's generation_config reduced to its token ids while model.generate runs: generate fills every field
    a call leaves unset from it, so its suppress_tokens, bad_words_ids, min_new_tokens, stop_strings, top_h... applied
    resident and not layer-streamed or served (the ids that end a completion come from end_ids, in every path).
    A peft model's generate copies its config onto the base model: both are cut and both restored (else a LoRA
    run's export, after exact_match, wrote the cut config)."""
    from transformers import GenerationConfig

    holders = [model, *([model.get_base_model()] if hasattr(model, "get_base_model") else [])]
    saved = [(m, m.generation_config) for m in holders if getattr(m, "generation_config", None) is not None]
    if not saved:  # a model without one: generate's own defaults, nothing of the checkpoint's to leave out
        yield
        return
    own = saved[0][1]
    ids = {k: getattr(own, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")}
    for m, _ in saved:
        m.generation_config = GenerationConfig(**ids)
    try:
        yield
    finally:
        for m, kept in saved:
            m.generation_config = kept


def _generate(
    model, engine, tokenizer, inputs, max_new_tokens, temperature, top_p, streamer=None, turn_end=()
) -> torch.Tensor:
    """New tokens for a left-padded batch: layer-streamed when an engine is given, else model.generate. Each row
    ends at the first of end_ids (the model's end of turn too, and `turn_end`), as model.generate and serve end it."""
    if max_new_tokens < 1:  # nothing to generate: model.generate refuses 0, the engine has no token to stack
        return inputs["input_ids"][:, :0]
    ends = end_ids(model, tokenizer, turn_end)
    if greedy(temperature, top_p):  # the engine is greedy at temperature 0
        temperature = 0.0
    if engine is None:
        sampling = _sampling(max_new_tokens, temperature, top_p, tokenizer, ends)
        with _ends_only(model):
            out = model.generate(**inputs, streamer=streamer, **sampling)
        return out[:, inputs["input_ids"].shape[1] :]
    ended = []  # a streamed row shows nothing after its end id (the engine repeats the first for a finished row)
    on_token = None
    if streamer is not None:

        def on_token(token: torch.Tensor) -> None:
            token = token.cpu()
            if not ended:
                streamer.put(token)
            ended.extend(i for i in token.tolist() if i in ends)

    out = engine.generate(
        inputs["input_ids"],
        inputs["attention_mask"],
        max_new_tokens,
        eos_token_id=ends or None,
        temperature=temperature,
        top_p=top_p,
        on_token=on_token,
    )
    if streamer is not None:
        streamer.end()
    return _cut_after_end(out, ends, tokenizer.pad_token_id)


def _cut_after_end(new: torch.Tensor, ends: list[int], pad: int | None) -> torch.Tensor:
    """Each row's tokens after its first end id replaced by padding, as model.generate pads a finished row."""
    if len(ends) < 2 or pad is None:
        return new
    is_end = torch.isin(new, torch.tensor(ends, device=new.device))
    after = (is_end.long().cumsum(1) - is_end.long()) > 0
    return new.masked_fill(after, pad)


@torch.no_grad()
def stream(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    engine=None,
    add_special_tokens: bool = True,
    bos: bool = False,
    turn_end: list[int] | tuple[int, ...] = (),
) -> str:
    """Print the completion token by token as it is generated; return it. `add_special_tokens`: as training
    encoded prompts (Prompter.add_special_tokens: False where a chat template wrote them); `bos`: BOS first, as a
    model that learned plain text saw every text begin (Prompter.starts_with_bos); `turn_end`: what training ended
    its answers with (Prompter.answer_end), a stop too, as serve stops there."""
    from transformers import TextStreamer

    model.eval()
    inputs = prompt_batch(tokenizer, [prompt], add_special_tokens, bos).to(_device(model, engine))
    streamer = TextStreamer(tokenizer, skip_prompt=engine is None, skip_special_tokens=True)
    new = _generate(model, engine, tokenizer, inputs, max_new_tokens, temperature, top_p, streamer, turn_end)
    return tokenizer.decode(new[0], skip_special_tokens=True)


@torch.no_grad()
def complete(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 16,
    engine=None,
    add_special_tokens: bool = True,
    bos: bool = False,
    turn_end: list[int] | tuple[int, ...] = (),
) -> list[str]:
    """Completions for many prompts in left-padded batches (with an engine, every chunk load serves the whole batch).
    `add_special_tokens`: as training encoded prompts (Prompter.add_special_tokens), so no second BOS; `bos`: BOS
    first (Prompter.starts_with_bos); `turn_end`: what training ended answers with (Prompter.answer_end)."""
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    results = []
    try:
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            inputs = prompt_batch(tokenizer, batch, add_special_tokens, bos).to(_device(model, engine))
            new = _generate(model, engine, tokenizer, inputs, max_new_tokens, temperature, top_p, turn_end=turn_end)
            results += tokenizer.batch_decode(new, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return results


def answer_scores(
    model,
    tokenizer,
    examples: list[tuple[str, str]],
    pattern: str | None,
    max_samples: int,
    max_new_tokens: int,
    engine=None,
    batch_size: int = 16,
    add_special_tokens: bool = True,
    turn_end: list[int] | tuple[int, ...] = (),
    bos: bool = False,
) -> dict[str, Any]:
    """Exact match of greedy answers against the references, and how the answers were extracted.

    With data.answer_pattern (GSM8K's `#### N`), the reference's answer is the pattern's group 1. A
    generated answer is the pattern's group 1 where the model wrote it, else the last number in its text:
    `exact_match` counts both, `exact_match_strict` only the first, `answer_pattern_found` is the share
    of generations that wrote the pattern. Without a pattern, both answers are their first line.
    `batch_size` prompts generate together (with an engine: every chunk load serves all of them);
    `add_special_tokens`, `turn_end`, `bos`: the datamodule's Prompter.add_special_tokens, answer_end and
    starts_with_bos, as its training samples were encoded and ended (a chat model stops at its end of turn, not at
    max_new_tokens; a plain-text model's prompt starts with BOS, as task=infer's does)."""
    examples, unreadable = readable_references(examples[:max_samples], pattern)
    if not examples:
        return {"exact_match": float("nan")}
    outputs = complete(
        model,
        tokenizer,
        [p for p, _ in examples],
        max_new_tokens=max_new_tokens,
        engine=engine,
        batch_size=batch_size,
        add_special_tokens=add_special_tokens,
        bos=bos,
        turn_end=turn_end,
    )
    hits = strict = found = 0
    for output, (_, answer) in zip(outputs, examples):
        want = extract_answer(answer, pattern)
        got, how = extract(output, pattern, last_number=True)
        hits += got == want
        strict += got == want and how != "last number"
        found += how == "pattern"
    n = len(examples)
    scores: dict[str, Any] = {
        "exact_match": hits / n,
        "exact_match_samples": n,
        "unreadable_references": unreadable,
        "max_new_tokens": max_new_tokens,
    }
    if pattern:
        scores.update(
            {
                "exact_match_strict": strict / n,
                "answer_pattern_found": found / n,
                "answer_extraction": f"group 1 of data.answer_pattern {pattern}; where a generation lacks it, "
                "its last number",
            }
        )
    else:
        scores["answer_extraction"] = "the first line of the answer, numbers normalised"
    return scores


def readable_references(examples: list[tuple[str, str]], pattern: str | None) -> tuple[list[tuple[str, str]], int]:
    """The examples whose reference holds an answer to compare, and how many do not: a reference the pattern
    cannot read (or an empty one) gave "", which any generation without a number matched, so a random model
    scored 1.0. None readable is one sentence; some, a warning."""
    readable = [(p, a) for p, a in examples if extract(a, pattern)[0] != ""]
    left_out = len(examples) - len(readable)
    if examples and not readable:
        where = f"data.answer_pattern={pattern!r} reads no answer out of" if pattern else "exact match found empty"
        raise UserError(
            f"{where} the {len(examples)} references exact match scores (the first: {examples[0][1][:60]!r}): "
            "give a pattern they hold, or data.answer_pattern=null to compare their first lines."
        )
    if left_out:
        log.warning(
            "exact match: %d of %d references hold no answer to compare; they are left out", left_out, len(examples)
        )
    return readable, left_out


def exact_match(
    model,
    tokenizer,
    examples: list[tuple[str, str]],
    pattern: str | None,
    max_samples: int,
    max_new_tokens: int,
    engine=None,
    add_special_tokens: bool = True,
    turn_end: list[int] | tuple[int, ...] = (),
    bos: bool = False,
) -> float:
    """The share of greedy answers equal to the reference (see answer_scores)."""
    return answer_scores(
        model,
        tokenizer,
        examples,
        pattern,
        max_samples,
        max_new_tokens,
        engine,
        add_special_tokens=add_special_tokens,
        turn_end=turn_end,
        bos=bos,
    )["exact_match"]


def answer_tokens(tokenizer, examples: list[tuple[str, str]]) -> int:
    """The longest reference answer in tokens (the room a generated answer needs)."""
    return max((len(tokenizer(a, add_special_tokens=False)["input_ids"]) for _, a in examples), default=0)


PROMPT_FIELDS = ("prompt", "question", "instruction", "input")


def read_prompts(path: str):
    """Rows of a prompts JSONL file (Records: each knows its line); each needs a field of PROMPT_FIELDS."""
    rows = read_records(path, "jsonl", key="task.input")
    for row, where in zip(rows, rows.where):
        field = next((k for k in PROMPT_FIELDS if k in row), None)
        if field is None:
            raise UserError(f"task.input {where} has no 'prompt' field; its fields are {sorted(row)}.")
        if row[field] is None or not str(row[field]).strip():  # null would be generated from as the text "None"
            raise UserError(f"task.input {where}: its {field!r} is empty; give it a prompt, or remove the line.")
        if isinstance(row[field], dict | list):  # would be generated from as its Python repr, "{'text': ...}"
            kind = "object" if isinstance(row[field], dict) else "list"
            raise UserError(f"task.input {where}: its {field!r} is a JSON {kind}, not text; give the prompt's text.")
    return rows


def check_context(
    model,
    tokenizer,
    prompts: list[str],
    where: list[str],
    max_new_tokens: int,
    add_special_tokens: bool = True,
    auto: bool = False,
    bos: bool = False,
) -> int:
    """Each prompt and its new tokens within the model's context (max_position_embeddings), as task=serve holds
    them: past it, positions the model never learned give text without a word said (transformers only warns).
    Returns the new tokens to generate: max_new_tokens, or for task.max_new_tokens=auto (`auto`) at most what
    the longest prompt leaves of the context, as serve's default length is cut. Prompts are counted as
    generation encodes them (`add_special_tokens`, `bos`)."""
    room = context_length(model)
    if room is None:
        return max_new_tokens
    counts = [len(prompt_ids(tokenizer, text, add_special_tokens, bos)) for text in prompts]
    if auto and counts:
        max_new_tokens = max(1, min(max_new_tokens, room - max(counts)))
    for n, place in zip(counts, where):
        if n + max_new_tokens > room:
            raise UserError(
                f"{place}: the prompt's {n} tokens and task.max_new_tokens={'auto' if auto else max_new_tokens} "
                f"pass the model's context of {room} tokens; shorten the prompt"
                f"{'' if auto else ' or lower task.max_new_tokens'}."
            )
    return max_new_tokens


def prompt_of(row: dict[str, Any]) -> str:
    """A prompts file row's prompt: its first field of PROMPT_FIELDS."""
    return str(next(row[k] for k in PROMPT_FIELDS if k in row))


def _device(model, engine=None) -> torch.device:
    return engine.device if engine is not None else next(model.parameters()).device
