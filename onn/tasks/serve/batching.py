"""Continuous batching: one thread owns the model and runs one forward per step for every active sequence.

A request that arrives while others decode joins at the next step: its prompt's prefill runs in the same
forward as the others' next token (the step is as wide as the longest new prompt; the running rows are
left-padded, with their padding masked). A layer-streamed model therefore loads each chunk once per step
for all of them. Rows leave when they finish or their client goes away (their slot is free at the next
step), and columns of the KV cache that no row attends to any more are dropped.

Positions come from the attention mask (cumsum), so a row's position ids and rotary embeddings are those
it would have alone; with temperature 0 a request gets the tokens it would get alone.

A step that runs out of device memory is undone (the cache as it was: its forward replaces the cache's tensors,
never writes into them) and costs one request at most: newcomers that joined together go back to the queue's front
and join one by one (the requests behind them join together again once they have); a lone newcomer waits at the
queue's front until fewer rows run (as vLLM and TGI requeue it), and ends with an out-of-memory error only when it
does not fit with no other row running; without newcomers the row admitted last ends with that error.

Admission is first come, first served: while a lone newcomer waits for fewer rows, the requests behind it wait too,
even a smaller one that would fit. The slot it waits for is the next one a finishing row frees; a request behind it
admitted there would take that slot, and under steady load every later one too, so it would never join (vLLM's and
TGI's schedulers stop at the first waiting request that does not fit, for the same reason). The wait is bounded: a
running row ends within its max_tokens.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from onn.modalities.text.generate import greedy

log = logging.getLogger("onn")
SHUTTING_DOWN = "the server is shutting down"
OUT_OF_MEMORY = (
    "the model ran out of device memory on this request; send a shorter prompt or fewer max_tokens, or try again later"
)
DIVERGED = (
    "the model's next-token scores are not finite numbers (NaN or inf): its weights diverged in training, or its "
    "precision overflowed; serve a checkpoint from before that, or train again with a lower optim.lr"
)
UNAVAILABLE = "the model could not be reset after a failed step ({}); restart the server"
RESET_RETRY_S = 5.0  # how often an idle server whose engine could not be reset tries again


@dataclass
class Sampling:
    """What one request asks of its completion."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    """One request's completion. `emit` gets one {"text": delta} event per token (the delta may be empty while
    an incomplete character or a possible stop string waits), then one {"finish": reason, ...}; it is called on
    the scheduler's thread and must not block. Compared and hashed by identity: two requests for the same text
    are two requests (a failed step's handler collects them in a dict)."""

    prompt_ids: list[int]
    sampling: Sampling
    emit: Callable[[dict[str, Any]], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # the completion so far (stop strings cut off)
    sent: int = 0  # characters of `text` emitted
    searched: int = 0  # characters of `text` matched against the stop strings (none of them is in there)
    text_ids: list[int] = field(default_factory=list)  # the tokens that are text: no special tokens
    decoded: str = ""  # the text of text_ids[:read_offset]: whole characters only (see Scheduler._decode)
    prefix_offset: int = 0  # the text ids decoded again before the new ones, for their context
    read_offset: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    generator: torch.Generator | None = None
    requeued: bool = False  # sent back to the queue by a step out of device memory: it joins alone

    def cancel(self) -> None:
        """The client went away: the row leaves the batch at the next step."""
        self.cancelled.set()


class Scheduler:
    """Owns the model: a thread that admits waiting sequences between steps, up to `slots` at once."""

    def __init__(self, lm, slots: int):
        self.lm, self.slots = lm, slots
        self.tokenizer = lm.tokenizer
        self.eos = lm.eos_ids
        self.special = special_ids(self.tokenizer)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos, default=0)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.active: list[Sequence] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # [rows, columns of the cache]: 1 where a row attends
        self.lock = threading.Condition()
        self.stopping = False
        self.plain = True  # the cache holds one column per position in every layer (see _step)
        self.held: Sequence | None = None  # a newcomer out of device memory beside running rows, first in the queue:
        self.held_beside = 0  # no newcomer joins until fewer rows than this run
        self.broken: str | None = None  # why the engine's reset after a failed step failed (tried again each step)
        self.steps = 0
        self.widest = 0  # most rows one step has served
        self.generated = 0  # completion tokens of every request, also one whose client left or that Ctrl-C ended
        self.thread = threading.Thread(target=self._loop, name="onn-serve-decode", daemon=True)
        self.thread.start()

    # -- what the API calls ------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        with self.lock:
            self._enqueue([seq])

    def admit(self, seqs: list[Sequence], most: int) -> bool:
        """Queue all of `seqs`, or none (False) when the queue would then hold more than `most`. Counted and queued
        under one hold of the lock: requests handled at once (on several threads or event loops) could each count
        room for themselves before any of them was queued, and together overfill serve.max_waiting."""
        with self.lock:
            if self._live_waiting() + len(seqs) > most:
                return False
            self._enqueue(seqs)
            return True

    def queued(self) -> int:
        """Requests waiting for a slot whose client is still there."""
        with self.lock:
            return self._live_waiting()

    def _live_waiting(self) -> int:
        """The queue's length once the requests whose client left are dropped from it (the lock held): the loop takes
        waiting requests only into a free slot, so behind a full batch they stayed, and the 429 of serve.max_waiting
        and /health counted them."""
        if any(seq.cancelled.is_set() for seq in self.waiting):
            live = [seq for seq in self.waiting if not seq.cancelled.is_set()]
            self.waiting.clear()
            self.waiting.extend(live)
        return len(self.waiting)

    def _enqueue(self, seqs: list[Sequence]) -> None:
        """Queue `seqs` (the lock held); past the loop's last sweep each is told at once, not left waiting."""
        for seq in seqs:
            if self.stopping:
                _send(seq, {"finish": "error", "error": SHUTTING_DOWN, "code": "server_shutting_down"})
            else:
                self.waiting.append(seq)
        self.lock.notify()

    def trouble(self) -> str | None:
        """Why requests cannot be served now (the engine not reset after a failed step, the loop stopped), or None."""
        if self.broken is not None:
            return UNAVAILABLE.format(self.broken)
        return SHUTTING_DOWN if self.stopping or not self.thread.is_alive() else None

    def stop(self) -> None:
        """Stop after the current step: every sequence still decoding or waiting ends with an error event. It
        does not wait, so a signal handler on the event loop's thread may call it."""
        with self.lock:
            self.stopping = True
            self.lock.notify()

    def close(self) -> None:
        self.stop()
        self.thread.join(timeout=60)

    # -- the thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        """Admit, step, repeat until stop(). However it ends (a bug in it too), every request it holds is told and
        later ones are refused at once: none waits for a thread that is gone."""
        try:
            while self._turn():
                pass
        except Exception:
            log.exception("serve: the decode loop failed")
        finally:
            with self.lock:
                self.stopping = True
                left = [*self.active, *self.waiting]
            for seq in left:
                _send(seq, {"finish": "error", "error": SHUTTING_DOWN, "code": "server_shutting_down"})
            if self.lm.engine is not None:
                try:
                    self.lm.engine.close()
                except Exception as e:  # a load that failed with the step before: the server is stopping anyway
                    log.warning("serve: closing the layer-streaming engine failed: %s: %s", type(e).__name__, e)

    def _turn(self) -> bool:
        """One step for the running rows and those that join now; False once stop() was called."""
        with self.lock:
            while not self.stopping and not self.waiting and not self.active:
                # broken: the reset is retried every RESET_RETRY_S without a request, or an idle server whose /health
                # said 503 (which keeps a load balancer's traffic away) would never try again
                self.lock.wait(RESET_RETRY_S if self.broken is not None else None)
                if self.broken is not None:
                    break
            if self.stopping:
                return False
            joining = []
            # a cache that is not one plain column per position (sliding windows) is never re-laid: new
            # sequences wait for the batch to finish (admission in waves)
            room = self.slots if self.plain or not self.active else 0
            if self.waiting and self.waiting[0].requeued:  # sent back by a step out of memory: one joins
                room = min(room, len(self.active) + 1)
            if self._holding():  # first come, first served: nobody passes it (see the module's docstring)
                room = len(self.active)
            while self.waiting and len(self.active) + len(joining) < room:
                seq = self.waiting.popleft()
                if not seq.cancelled.is_set():
                    joining.append(seq)
        if self.broken is not None and not self._reset():  # still not reset: no step can be trusted
            self._end_all(
                joining, {"finish": "error", "error": UNAVAILABLE.format(self.broken), "code": "model_unavailable"}
            )
            return True
        try:
            self._step(joining)
        except Exception as e:  # a failed step ends its requests with its error; the server goes on
            log.exception("serve: a decode step failed")
            self._reset()  # first: a client told of the error finds /health as the next request will
            self._end_all(joining, {"finish": "error", "error": f"{type(e).__name__}: {e}"})
        return True

    def _end_all(self, joining: list[Sequence], event: dict[str, Any]) -> None:
        """End every running row and newcomer with `event`: the batch and its cache are dropped."""
        for seq in dict.fromkeys([*self.active, *joining]):  # (the newcomers may be active already)
            _send(seq, event)
        self.active, self.cache, self.mask = [], None, None

    def _reset(self) -> bool:
        """Drop the layer-streaming engine's state after a failed step. A reset that fails too (a CUDA error leaves
        the device unusable) is logged, not told to the requests the step failed (they have its first error), and
        tried again before the next step: until one succeeds, requests end with UNAVAILABLE and /health says so."""
        try:
            if self.lm.engine is not None:
                self.lm.engine.reset()
        except Exception as e:
            said = f"{type(e).__name__}: {e}"
            if said != self.broken:  # retried every RESET_RETRY_S while idle: the same failure's traceback once
                log.exception("serve: the layer-streaming engine could not be reset after a failed step")
            self.broken = said
            return False
        self.broken = None
        return True

    def _holding(self) -> bool:
        """Whether the newcomer that ran out of device memory still waits for fewer rows (its client may have left)."""
        if self.held is not None and (self.held.cancelled.is_set() or len(self.active) < self.held_beside):
            self.held = None
        return self.held is not None

    def _step(self, joining: list[Sequence]) -> None:
        gone = [i for i, s in enumerate(self.active) if s.cancelled.is_set()]
        if gone:
            self._keep([i for i in range(len(self.active)) if i not in set(gone)])
        if not self.active and not joining:
            return
        rows, mask, cache = list(self.active), self.mask, _cache_state(self.cache)
        try:
            logits = self._forward(joining)
        except torch.OutOfMemoryError:
            self.active, self.mask = rows, mask
            self.cache = _restored(self.cache, cache)
            self._reset()  # (one that fails is tried again before the next step: the requests hear of memory)
            self._shed(joining)
            return
        self.steps += 1
        self.widest = max(self.widest, len(self.active))
        tokens = _pick(logits, self.active)  # None: the row failed, and was told
        finished = [i for i, seq in enumerate(self.active) if tokens[i] is None or self._advance(seq, tokens[i])]
        if finished:
            self._keep([i for i in range(len(self.active)) if i not in set(finished)])

    def _forward(self, joining: list[Sequence]) -> torch.Tensor:
        """The running rows' next token and the newcomers' prompts in one forward: the last position's logits."""
        device = self.lm.device
        width = max((len(s.prompt_ids) for s in joining), default=1)
        rows_ids, rows_mask = [], []
        for seq in self.active:  # the running rows: their last token at the right, padding before it
            rows_ids.append([self.pad] * (width - 1) + [seq.tokens[-1]])
            rows_mask.append([0] * (width - 1) + [1])
        for seq in joining:  # the new rows: their prompt, left-padded; no past
            pad = width - len(seq.prompt_ids)
            rows_ids.append([self.pad] * pad + seq.prompt_ids)
            rows_mask.append([0] * pad + [1] * len(seq.prompt_ids))
            if seq.sampling.seed is not None:
                seq.generator = torch.Generator(device=device).manual_seed(int(seq.sampling.seed))
        ids = torch.tensor(rows_ids, dtype=torch.long, device=device)
        step_mask = torch.tensor(rows_mask, dtype=torch.long, device=device)
        if self.cache is None:
            self.cache, past = self.lm.new_cache(), torch.zeros(0, 0, dtype=torch.long, device=device)
            self.plain = all(type(layer).__name__ == "DynamicLayer" for layer in getattr(self.cache, "layers", []))
        else:
            past = self.mask
        if joining and past.shape[1]:
            _grow_rows(self.cache, len(joining))
        past = torch.cat([past, past.new_zeros(len(joining), past.shape[1])])
        mask = torch.cat([past, step_mask], dim=1)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
        self.active += joining
        logits = self.lm.step(ids, mask, position_ids, self.cache)
        self.mask = mask
        return logits

    def _shed(self, joining: list[Sequence]) -> None:
        """After a step out of device memory (the batch back as it was before it): newcomers that joined together
        go back to the queue's front and join one by one (requests that came later join together again); a lone
        newcomer beside running rows goes back to the front and waits until fewer rows run; a lone newcomer with no
        other row running, or without one the row admitted last, ends with an out-of-memory error while the others
        go on."""
        if len(joining) > 1 or (joining and self.active):
            with self.lock:
                self.waiting.extendleft(reversed(joining))
                for seq in joining:
                    seq.requeued = True
                if len(joining) == 1:
                    self.held, self.held_beside = joining[0], len(self.active)
            if len(joining) > 1:
                log.warning("serve: out of device memory admitting %d requests: they join one by one", len(joining))
            else:
                log.warning("serve: out of device memory admitting a request beside %d: it waits", len(self.active))
            return
        log.warning("serve: out of device memory: one request ends with an error, the others go on")
        ended = joining[0] if joining else self.active[-1]
        _send(ended, {"finish": "error", "error": OUT_OF_MEMORY, "code": "out_of_memory"})
        if not joining:
            self._keep(list(range(len(self.active) - 1)))

    def _advance(self, seq: Sequence, token: int) -> bool:
        """The row's next token: emit its text; True when the sequence is done."""
        seq.tokens.append(token)  # the end-of-sequence token too: usage counts it, as OpenAI's and vLLM's do
        self.generated += 1
        if token in self.eos:
            self._cut_at_stop(seq, len(seq.text))  # the text is whole now: an unfinished last character too
            return self._finish(seq, "stop")
        if token not in self.special:
            seq.text_ids.append(token)
        seq.text = self._decode(seq)
        last = len(seq.tokens) >= seq.sampling.max_tokens
        # a character still arriving shows as U+FFFD (see _decode): the stop strings are matched up to it (stop="\ufffd"
        # ended the text at the first byte of every accented letter), and over it once the next token has settled it
        # or the completion ends with it (a real U+FFFD, as the whole decode has it, stops)
        settled = len(seq.text) if last else len(seq.text.rstrip("\ufffd"))
        if self._cut_at_stop(seq, settled):
            return self._finish(seq, "stop")
        if last:
            return self._finish(seq, "length")
        # hold back an incomplete character and what could be the start of a stop string
        text, ready = seq.text, settled
        for stop in seq.sampling.stop:
            for k in range(min(len(stop) - 1, ready), 0, -1):
                if text.endswith(stop[:k], 0, ready):  # no copy of the text per k
                    ready -= k
                    break
        # every token is an event, also one whose text waits (the client sees the pace; OpenAI's "content": "")
        _send(seq, {"text": text[seq.sent : ready] if ready > seq.sent else ""})
        seq.sent = max(seq.sent, ready)
        return False

    def _cut_at_stop(self, seq: Sequence, end: int) -> bool:
        """Whether a stop string is in the text's first `end` characters: the text then ends where the first of them
        begins, whichever the request listed first. Each character is searched once (the last searched
        characters again, as the start of a stop string the new ones complete)."""
        text, searched = seq.text, seq.searched
        found = [
            at
            for at in (text.find(stop, max(0, searched - len(stop) + 1), end) for stop in seq.sampling.stop)
            if at >= 0
        ]
        seq.searched = max(searched, end)
        if found:
            seq.text = text[: min(found)]
        return bool(found)

    def _decode(self, seq: Sequence) -> str:
        """The completion's text, decoding only the text ids since the last whole character with the few before them
        (their context: a tokenizer's leading space, a byte sequence's start), as TGI and vLLM stream. Decoding
        every token so far at each step cost a completion of n tokens n^2 / 2 token decodes (1 ms a step at 4,000
        tokens, per row). Special tokens are left out before decoding, as vLLM does: as the context they decode to
        nothing, and a tokenizer that strips a leading space (Llama 2's, Mistral's) dropped the next word's. An
        unfinished character is kept in the text as U+FFFD until its last byte comes."""
        decode, ids = self.tokenizer.decode, seq.text_ids
        before = decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
        now = decode(ids[seq.prefix_offset :], skip_special_tokens=True)
        new = now[len(before) :]
        if now.endswith("\ufffd"):
            return seq.decoded + new
        if len(ids) > seq.read_offset:  # (a special token adds no text id: the context stays where it was)
            seq.decoded += new
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return seq.decoded

    def _finish(self, seq: Sequence, reason: str) -> bool:
        if len(seq.text) > seq.sent:
            _send(seq, {"text": seq.text[seq.sent :]})
            seq.sent = len(seq.text)
        _send(
            seq,
            {"finish": reason, "prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.tokens)},
        )
        return True

    def _keep(self, rows: list[int]) -> None:
        """Only these rows stay in the batch; cache columns no row attends to any more go too."""
        self.active = [self.active[i] for i in rows]
        if not self.active:
            self.cache, self.mask = None, None
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        if not self.plain:  # a sliding window's layer holds its last columns alone: the rows go, every column stays
            self.mask = mask
            _edit_cache(self.cache, lambda t: t.index_select(0, index.to(t.device)))
            return
        columns = mask.any(dim=0).nonzero()[:, 0]
        self.mask = mask.index_select(1, columns)
        _edit_cache(self.cache, lambda t: t.index_select(0, index.to(t.device)).index_select(2, columns.to(t.device)))


def special_ids(tokenizer) -> set[int]:
    """The ids decode(skip_special_tokens=True) leaves out: the named special tokens (bos, eos, pad, ...) and every
    added token marked special (a chat template's <|im_start|>, a tool call's marker)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(getattr(tokenizer, "all_special_ids", [])) | {
        i for i, t in added.items() if getattr(t, "special", False)
    }


def _send(seq: Sequence, event: dict[str, Any]) -> None:
    try:
        seq.emit(event)
    except Exception:  # the client's event loop is gone
        seq.cancel()


def _pick(logits: torch.Tensor, rows: list[Sequence]) -> list[int | None]:
    """Each row's next token, read back in one copy (each read of a GPU value waits for it): greedy where
    generate.greedy says (infer's rule, top_p 0 included), else sampled through transformers' temperature and top-p
    warpers (as model.generate), with the request's own generator when it gave a seed. A row whose scores hold NaN or
    +inf (a diverged checkpoint, a half-precision overflow), or none above -inf, gets None and its model_diverged
    event, greedy or sampled (argmax picked token 0 of an all-NaN row, silently); the others go on."""
    picks = logits.argmax(-1)
    drawable = torch.isfinite(logits.amax(-1))  # NaN propagates to the max; -inf scores beside a finite one are fine
    for i, seq in enumerate(rows):
        if not greedy(seq.sampling.temperature, seq.sampling.top_p):
            picks[i], sampled = _sample(logits[i], seq.sampling, seq.generator)
            drawable[i] &= sampled
    tokens, valid = torch.stack([picks, drawable.long()]).tolist()
    out: list[int | None] = []
    for seq, token, ok in zip(rows, tokens, valid):
        if not ok:  # this row's problem, not the batch's
            log.warning("serve: a row's next-token scores hold NaN or inf: it ends with an error, the others go on")
            _send(seq, {"finish": "error", "error": DIVERGED, "code": "model_diverged"})
        out.append(token if ok else None)
    return out


def _sample(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's draw, and whether its probabilities can be drawn from (finite, not all zero), both on the device:
    torch.multinomial reads the probabilities back twice to check them, two waits per sampled row and step on a GPU.
    The draw is multinomial's own for one sample (argmax of the probabilities over exponential noise): the same
    token for the same generator."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    scores = logits.float()[None]  # in float32 from the top logit down: a small temperature cannot overflow
    scores = TemperatureLogitsWarper(sampling.temperature)(None, scores - scores.max())
    if sampling.top_p < 1.0:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    probs = torch.softmax(scores, dim=-1)[0]
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    drawable = torch.isfinite(probs).all() & (probs.sum() > 0)
    return (probs / noise).argmax(), drawable


def _cache_state(cache) -> list[tuple[Any, dict[str, Any]]] | None:
    """Each cache layer with its attributes (keys, values, lengths): a forward replaces them (torch.cat) and
    never writes into their tensors, so putting them back undoes a step that failed midway."""
    return None if cache is None else [(layer, dict(vars(layer))) for layer in cache.layers]


def _restored(cache, state: list[tuple[Any, dict[str, Any]]] | None):
    """The cache as `_cache_state` saw it (None: there was none)."""
    if state is None:
        return None
    cache.layers[:] = [layer for layer, _ in state]
    for layer, attributes in state:
        vars(layer).clear()
        vars(layer).update(attributes)
    return cache


def _layers(cache) -> list:
    """The cache's per-layer key/value holders that hold something."""
    return [
        layer
        for layer in getattr(cache, "layers", [])
        if getattr(layer, "keys", None) is not None and layer.keys.numel()
    ]


def _edit_cache(cache, edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply `edit` to every layer's keys and values ([batch, heads, columns, head_dim])."""
    for layer in _layers(cache):
        layer.keys, layer.values = edit(layer.keys), edit(layer.values)


def _grow_rows(cache, rows: int) -> None:
    """Room for `rows` new sequences: zero keys and values, which their mask never attends to."""
    _edit_cache(cache, lambda t: torch.cat([t, t.new_zeros(rows, *t.shape[1:])]))
