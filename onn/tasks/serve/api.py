"""The HTTP API: OpenAI's routes for a language model, /v1/classify for a classifier, a web page at `/`.

Every error is OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, with a 4xx status
for whatever a client can get wrong (malformed JSON, wrong types, unknown model or route, too large); a
request that is refused never reaches the model. `Guard` (plain ASGI, in front of everything) checks the
key and bounds the body before any route reads it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import re
import secrets
import string
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException as StarletteHTTPException

from onn.config.task import ServeConfig
from onn.errors import UserError
from onn.modalities.text.generate import prompt_ids
from onn.models.load import context_length
from onn.tasks.serve.batching import Sampling, Scheduler, Sequence

log = logging.getLogger("onn")
OPEN_PATHS = ("/health", "/", "/favicon.ico")  # no key needed: the page holds no model data, and asks for the key
UPLOAD_OVERHEAD = 64 * 1024  # multipart boundaries and headers around an upload
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1  # OpenAI's range (a 64-bit integer)
RANDOM_SEED = -1  # llama.cpp's default and vLLM's: no seed (each answer drawn afresh), not a fixed one
UNIMPLEMENTED = {  # fields this server does not compute: refused, not silently ignored
    "logprobs": "returns no log-probabilities",
    "top_logprobs": "returns no log-probabilities",
    "echo": "does not echo the prompt",
    "frequency_penalty": "applies no frequency penalty",
    "presence_penalty": "applies no presence penalty",
    "logit_bias": "applies no logit bias",
    "response_format": "has no JSON mode or structured output",
    "tools": "calls no tools",
    "tool_choice": "calls no tools",
    "functions": "calls no functions",
    "function_call": "calls no functions",
    "n": "generates one completion per request",
    "best_of": "generates one completion per request",
    "suffix": "inserts no text after the completion",
    "modalities": "answers in text only",
    "audio": "returns no audio",
    "top_k": "applies no top-k cut (top_p is honoured)",
    "min_p": "applies no min-p cut (top_p is honoured)",
    "typical_p": "applies no typical-p cut (top_p is honoured)",
    "repetition_penalty": "applies no repetition penalty",
    "repeat_penalty": "applies no repetition penalty",
    "min_tokens": "has no minimum length (max_tokens is honoured)",
    "ignore_eos": "always stops at the end-of-sequence token",
    # other servers' fields that OpenAI clients send (vLLM's, llama.cpp's): each would change the answer
    "guided_json": "has no JSON mode or structured output",
    "guided_regex": "has no structured output",
    "guided_choice": "has no structured output",
    "guided_grammar": "has no grammar-constrained output",
    "structured_outputs": "has no structured output",
    "grammar": "has no grammar-constrained output",
    "json_schema": "has no JSON mode or structured output",
    "stop_token_ids": "stops at the end-of-sequence token and the stop strings only",
    "bad_words": "bans no words",
    "allowed_token_ids": "restricts no tokens",
    "use_beam_search": "does no beam search",
    "length_penalty": "does no beam search",
    "include_stop_str_in_output": "leaves the stop string out of the text",
    "skip_special_tokens": "always leaves special tokens out of the text",
    "prompt_logprobs": "returns no log-probabilities",
    "n_probs": "returns no log-probabilities",
    "return_tokens_as_token_ids": "returns text, not token ids",
    "truncate_prompt_tokens": "truncates no prompt (one over serve.max_prompt_tokens is refused)",
    "add_generation_prompt": "always ends the chat with the assistant's turn",
    "continue_final_message": "answers the last message rather than continuing it",
    "chat_template": "uses the model's own prompt format",
    "chat_template_kwargs": "passes nothing to the chat template",
    "n_predict": "takes the length as max_tokens",
    "max_new_tokens": "takes the length as max_tokens",
    "num_return_sequences": "generates one completion per request",
    "mirostat": "applies no Mirostat sampling (temperature and top_p are honoured)",
    "tfs_z": "applies no tail-free sampling (temperature and top_p are honoured)",
    "dynatemp_range": "applies no dynamic temperature (temperature is honoured)",
    "xtc_probability": "applies no XTC sampling (temperature and top_p are honoured)",
    "dry_multiplier": "applies no DRY repetition penalty",
    "samplers": "has no sampler chain to order (temperature and top_p are honoured)",
    "web_search_options": "searches no web",
    "reasoning_effort": "has no reasoning to set an effort for",
}
NEUTRAL = (None, False, 0, {}, [])  # a value of those fields that asks for nothing this server lacks
NEUTRAL_OWN = {
    "response_format": {"type": "text"},
    "tool_choice": "none",
    "n": 1,
    "best_of": 1,
    "modalities": ["text"],
    "top_k": -1,
    "typical_p": 1,
    "repetition_penalty": 1,
    "repeat_penalty": 1,
    "length_penalty": 1,
    "num_return_sequences": 1,
    "tfs_z": 1,
    "reasoning_effort": "none",
}
TRUE_BY_DEFAULT = ("skip_special_tokens", "add_generation_prompt")  # false asks for something: only true is neutral
ASKS_WHEN_GIVEN = ("web_search_options",)  # {} asks for a search with OpenAI's defaults: only null is neutral
ZERO_MAPS = ("logit_bias",)  # a map whose every value is 0 biases nothing: {"50": 0} asks for nothing
UNION_MEMBER = re.compile(r"str|int|bool|float|list\[.+\]")  # pydantic's name for one type of a field of several
SEVERAL_TYPES = {  # such a field's error: what it takes, in one sentence (pydantic says why each type did not fit)
    "content": 'give a string, or a list of text parts {"type": "text", "text": ...}; this server takes no image, '
    "audio or file parts",
    "prompt": "give a string, or a list of strings; this server takes no token ids",
    "stop": "give a string, or a list of strings",
}


class ApiError(Exception):
    """A request the server refuses, as OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


# -- request bodies (strict: a string is no number, a number no boolean) ---------------------------------
class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as OpenAI returned them
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None  # a tool message: the function's name (some chat templates write it)

    def text(self) -> str:
        """The content as one text, its parts joined by newlines as vLLM joins them: joined by nothing, the last
        word of one part ran into the first of the next ("Summarize:" and "The cat" read "Summarize:The cat")."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as transformers' chat templates read it: OpenAI's developer message is the system message of
        newer models; an assistant's tool calls (their arguments a JSON object, as templates write them with tojson)
        and a tool message's call id and name go with it, not dropped (an empty assistant turn)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        if self.role == "tool":
            out.update({k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name)) if v is not None})
        return out


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool = False  # a last chunk with the token counts


class Generation(BaseModel):
    """What chat completions and completions share."""

    model_config = ConfigDict(strict=True, extra="allow")  # other fields (user, metadata...) are ignored
    model: str = Field(max_length=256)
    stream: bool | None = False  # null: not streamed, as OpenAI takes it
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)  # 0: greedy (generate._sampling)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    n: int | None = Field(default=None, ge=1)  # more than 1: refused in words (UNIMPLEMENTED)
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    echo: bool | None = None


class ChatRequest(Generation):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(Generation):
    prompt: str | list[str]


class ClassifyForm(BaseModel):
    """/v1/classify's multipart form. Form values are strings, so the types are lax ("2", "true")."""

    model_config = ConfigDict(extra="ignore")
    file: UploadFile = Field(description="the file, as multipart/form-data")
    model: str | None = None
    top_k: int | None = None
    picture: bool = False


# -- the guard -----------------------------------------------------------------------------------------
class Guard:
    """Key and body size, before any route: 401 without the key (every path but OPEN_PATHS), 413 for a body
    over the limit (read to its end at most that far; the route then gets it from memory). A route's bug is
    answered here too, and logged once."""

    def __init__(self, app, api_key: str | None, max_body: int, max_upload: int, stats: Stats):
        self.app, self.api_key, self.max_body, self.max_upload, self.stats = (
            app,
            api_key,
            max_body,
            max_upload,
            stats,
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started: dict[str, Any] = {}  # the response's start message, once sent

        async def watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started.update(message)
            await send(message)

        try:
            await self._guarded(scope, receive, watched)
        except Exception as e:
            await self._answer_bug(e, scope, receive, send, started)

    async def _answer_bug(self, error: Exception, scope, receive, send, started: dict[str, Any]) -> None:
        """A bug's one log record and its answer: a 500 with OpenAI's error object, or in a stream already under way
        its error event and [DONE]. Left to Starlette, its ServerErrorMiddleware answers with the app's handler and
        raises the error again for uvicorn, which logs it a second time."""
        self.stats.add(refused=1)  # an error answered, as every other
        said = f"internal error: {_short(error)}"
        if not started:
            log.exception("serve: %s %s failed", scope["method"], scope["path"])
            return await error_response(500, said, "server_error")(scope, receive, send)
        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in started["headers"])
        if not sse:  # a body half sent cannot be ended well: uvicorn logs the error (once) and closes the connection
            raise error
        log.exception("serve: %s %s failed mid-stream", scope["method"], scope["path"])
        end = _sse(error_body(said, "server_error")) + "data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": end.encode(), "more_body": False})

    async def _guarded(self, scope, receive, send) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
                self.stats.add(refused=1)
                response = error_response(
                    401,
                    "missing or wrong API key: send `Authorization: Bearer KEY`",
                    "authentication_error",
                    code="invalid_api_key",
                )
                return await response(scope, receive, send)
        limit = self.max_upload + UPLOAD_OVERHEAD if scope["path"] == "/v1/classify" else self.max_body
        length = headers.get("content-length")
        number = length is not None and length.isascii() and length.isdigit()  # ("²".isdigit(): int() refuses it)
        if length is not None and (not number or int(length) > limit):
            status, what = (413, f"the request body is over {limit} bytes") if number else (400, "a bad Content-Length")
            self.stats.add(refused=1)
            return await error_response(status, what, code="request_too_large" if status == 413 else None)(
                scope, receive, send
            )
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                self.stats.add(refused=1)
                return await error_response(413, f"the request body is over {limit} bytes", code="request_too_large")(
                    scope, receive, send
                )
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # then the client's disconnect, when it goes away

        return await self.app(scope, replay, send)


# -- the app -------------------------------------------------------------------------------------------
class Stats:
    """metrics.json's counts: requests answered (a client that left midway included) and refused (an error
    answered, a stream's error event included). The tokens generated are the Scheduler's."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = self.refused = 0

    def add(self, **counts: int) -> None:
        with self.lock:
            for key, value in counts.items():
                setattr(self, key, getattr(self, key) + value)


def create_app(served: Any, settings: ServeConfig, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app for a LanguageModel (`served.step`) or a classifier Predictor (`served.classify`). A language
    model's Scheduler starts with it; `app.state.stop()` ends its requests (without waiting), `app.state.close()`
    stops it."""
    app = FastAPI(title="ONN", docs_url=None, redoc_url=None, openapi_url=None)  # docs would fetch from a CDN
    server = Server(served, settings, model_name)
    app.state.stats, app.state.scheduler = server.stats, server.scheduler
    app.state.close = server.scheduler.close if server.scheduler else (lambda: None)
    app.state.stop = server.scheduler.stop if server.scheduler else (lambda: None)
    app.state.kind = "classifier" if server.classifier else "language model"
    app.add_middleware(
        Guard,
        api_key=api_key,
        max_body=settings.max_body_bytes,
        max_upload=settings.max_upload_bytes,
        stats=server.stats,
    )
    # outside the Guard: a browser's preflight (OPTIONS, which carries no key) is answered, and every answer, a 401
    # too, tells a page of any origin it may read it, as llama.cpp's and vLLM's servers do (the key guards the rest)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    _answer_errors(app, server.stats)
    for path, methods, handler in (
        ("/health", ("GET", "HEAD"), server.health),  # HEAD: uptime monitors' probe (a 405 read as down)
        ("/", ("GET", "HEAD"), server.index),
        ("/favicon.ico", ("GET",), server.favicon),
        ("/v1/models", ("GET",), server.models),
        ("/v1/models/{name:path}", ("GET",), server.model),
        ("/v1/chat/completions", ("POST",), server.chat),
        ("/v1/completions", ("POST",), server.completions),
        ("/v1/classify", ("POST",), server.classify),
    ):
        app.add_api_route(path, handler, methods=list(methods))
        app.add_api_route(path, _options(methods), methods=["OPTIONS"], include_in_schema=False)
    return app


def _options(methods: tuple[str, ...]) -> Callable[[], Any]:
    """A plain OPTIONS (no CORS preflight, which CORSMiddleware answers before any route): 204 with the route's
    methods in Allow, as HTTP servers answer it (RFC 9110, 9.3.7), rather than a 405 method_not_allowed."""
    allow = ", ".join([*methods, "OPTIONS"])

    async def options() -> Response:
        return Response(status_code=204, headers={"Allow": allow})

    return options


def _answer_errors(app: FastAPI, stats: Stats) -> None:
    """Every error as the OpenAI API answers one: a JSON body naming the problem (a bug's 500 is the Guard's)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        stats.add(refused=1)
        return error_response(e.status, e.message, e.kind, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        stats.add(refused=1)
        codes = {404: "unknown_url", 405: "method_not_allowed"}
        response = error_response(
            e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=codes.get(e.status_code)
        )
        if "Allow" in (e.headers or {}):  # a 405 names the route's methods (RFC 9110), OPTIONS too (see _options)
            response.headers["Allow"] = f"{e.headers['Allow']}, OPTIONS"
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        stats.add(refused=1)
        first = next(iter(e.errors()), {"msg": "invalid request", "loc": ()})
        return error_response(400, first["msg"], param=".".join(map(str, first["loc"])))


class Server:
    """The routes of one served model: its health and page, the model list, chat and text completions
    (streamed as server-sent events, or whole), and image classification."""

    def __init__(self, served: Any, settings: ServeConfig, model_name: str):
        self.served, self.settings, self.model_name = served, settings, model_name
        self.stats = Stats()
        self.created = int(time.time())
        self.classifier = hasattr(served, "classify")
        self.scheduler = None if self.classifier else Scheduler(served, settings.slots)
        self.page = resources.files("onn.tasks.serve").joinpath("page.html").read_text(encoding="utf-8")

    async def health(self):
        """Liveness, and the batch's occupancy: rows decoding now and requests queued (both 0 when idle)."""
        out = {"status": "ok", "kind": "classifier" if self.classifier else "language model"}
        if self.scheduler is not None:
            out.update(active=len(self.scheduler.active), waiting=self.scheduler.queued())
            trouble = self.scheduler.trouble()
            if trouble is not None:  # a load balancer's probe sees it: a 503 while requests would get one
                return JSONResponse({**out, "status": "unavailable", "error": trouble}, status_code=503)
        return out

    async def index(self):
        return HTMLResponse(self.page, headers={"Cache-Control": "no-cache"})

    async def favicon(self):
        """No icon: a browser asks for one by itself, and a 404 would count as a refused request."""
        return Response(status_code=204)

    async def models(self):
        return {"object": "list", "data": [_model_card(self.model_name, self.created, self.classifier)]}

    async def model(self, name: str):
        if name != self.model_name:
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server has {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return _model_card(self.model_name, self.created, self.classifier)

    async def chat(self, request: Request):
        req = _parse(await request.body(), ChatRequest)
        lm = _language_model(self.served, req, self.model_name)
        messages = [m.for_template() for m in req.messages]
        prompter = lm.prompter
        chat_tokenizer = prompter.tokenizer if prompter.chat_templated and self.settings.template else None
        _refuse_tool_calls(req.messages, chat_tokenizer)
        if not self.settings.template:  # the messages' text as typed, a line each, tokenized as /v1/completions does
            ids = _prompt_ids(lm, "\n".join(m["content"] for m in messages), True, self.settings, "messages")
            return await self._generate(request, req, [ids], "chat.completion")
        try:
            if len(messages) == 1 and messages[0]["role"] == "user":
                text = messages[0]["content"]  # as trained: data.template, then the chat template
                text = prompter.render(text, _record(prompter.template, text))
            else:
                text = prompter.render_messages(messages)
        except Exception as e:  # a chat template's own rule (roles that must alternate...), a template's field
            raise ApiError(
                400, f"the messages do not fit the model's prompt format: {_short(e)}", param="messages"
            ) from None
        # BOS only for a plain-text model, whose prompts never come from the chat template (which writes its own)
        ids = _prompt_ids(lm, text, prompter.add_special_tokens, self.settings, "messages", prompter.starts_with_bos)
        return await self._generate(request, req, [ids], "chat.completion")

    async def completions(self, request: Request):
        req = _parse(await request.body(), CompletionRequest)
        lm = _language_model(self.served, req, self.model_name)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        most = self.settings.max_waiting
        if not 1 <= len(prompts) <= most:  # OpenAI's list of prompts: one choice each, every one a row of the batch
            raise ApiError(400, f"prompt: give 1 to {most} prompts (serve.max_waiting)", param="prompt")
        params = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
        bos = _starts_with_bos(lm, self.settings)
        ids = [_prompt_ids(lm, text, True, self.settings, param, bos) for text, param in zip(prompts, params)]
        return await self._generate(request, req, ids, "text_completion", params)

    async def _generate(
        self, request: Request, req: Generation, prompts: list[list[int]], kind: str, params: list[str] | None = None
    ):
        """Each prompt's completion, one choice each (index in order), whole or streamed."""
        _refuse_unimplemented(req)
        params = params or ["messages" if kind == "chat.completion" else "prompt"]
        room = _context(self.served)
        samplings = [
            _sampling(req, self.settings, _max_tokens(req, self.settings, room, ids, param))
            for ids, param in zip(prompts, params)
        ]
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()  # (choice index, event): None for the client's going away

        def emitter(index: int) -> Callable[[dict[str, Any]], None]:
            return lambda event: loop.call_soon_threadsafe(events.put_nowait, (index, event))

        seqs = [Sequence(ids, sampling, emitter(i)) for i, (ids, sampling) in enumerate(zip(prompts, samplings))]
        if not self.scheduler.admit(seqs, self.settings.max_waiting):  # a client that left holds no place
            raise ApiError(
                429, "too many requests are waiting; try again shortly", "rate_limit_error", code="rate_limit_exceeded"
            )
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(
                self._stream(seqs, events, rid, kind, now, usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self._whole(request, seqs, events, rid, kind, now)

    async def _whole(
        self, request: Request, seqs: list[Sequence], events: asyncio.Queue, rid: str, kind: str, now: int
    ):
        """The whole completions, once every one has finished (499 when the client left meanwhile: its rows leave the
        batch at the next step, as a stream's do, not when max_tokens runs out)."""
        texts: list[list[str]] = [[] for _ in seqs]
        finishes: list[dict[str, Any] | None] = [None] * len(seqs)
        watcher = asyncio.create_task(_put_disconnect(request, events))
        try:
            while None in finishes:
                index, event = await events.get()
                if index is None:  # the client went away
                    self.stats.add(requests=1)
                    return Response(status_code=499)
                if "text" in event:
                    texts[index].append(event["text"])
                    continue
                finishes[index] = event
                if event["finish"] == "error":
                    code = _error_code(event)
                    status = 500 if code == "model_diverged" else 503  # the checkpoint's fault, as /v1/classify's 500
                    raise ApiError(status, f"generation failed: {event['error']}", "server_error", code=code)
        finally:
            watcher.cancel()
            for seq in seqs:  # the client left, a row failed, or all finished: none stays in the batch
                seq.cancel()
        self.stats.add(requests=1)
        choices = []
        for index, (text, finish) in enumerate(zip(texts, finishes)):
            content = "".join(text)
            choices.append(
                {"index": index, "message": {"role": "assistant", "content": content}}
                if kind == "chat.completion"
                else {"index": index, "text": content}
            )
            choices[-1].update(finish_reason=finish["finish"], logprobs=None)
        return {
            "id": rid,
            "object": kind,
            "created": now,
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(finishes),
        }

    async def _stream(self, seqs: list[Sequence], events: asyncio.Queue, rid: str, kind: str, now: int, usage: bool):
        chat, name = kind == "chat.completion", self.model_name
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, text: str | None, finish: str | None, delta: dict | None = None) -> str:
            choice = (
                {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
                if chat
                else {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
            )
            out = {"id": rid, "object": chunk_kind, "created": now, "model": name, "choices": [choice]}
            # with include_usage, OpenAI gives every chunk a usage field, null until the last
            return _sse({**out, "usage": None} if usage else out)

        outcome = "requests"  # a client that left midway was answered
        finishes: list[dict[str, Any] | None] = [None] * len(seqs)
        try:
            if chat:
                yield chunk(0, None, None, {"role": "assistant", "content": ""})
            while None in finishes:
                index, event = await events.get()
                if "text" in event:
                    yield chunk(index, event["text"], None, {"content": event["text"]})
                    continue
                if event["finish"] == "error":
                    outcome = "refused"
                    yield _sse(
                        error_body(f"generation failed: {event['error']}", "server_error", code=_error_code(event))
                    )
                    break
                finishes[index] = event
                yield chunk(index, "", event["finish"], {})
            if usage and None not in finishes:
                yield _sse(
                    {
                        "id": rid,
                        "object": chunk_kind,
                        "created": now,
                        "model": name,
                        "choices": [],
                        "usage": _usage(finishes),
                    }
                )
            yield "data: [DONE]\n\n"
        except Exception:
            outcome = None  # a bug: the Guard answers it, and counts it
            raise
        finally:
            if outcome is not None:
                self.stats.add(**{outcome: 1})
            for seq in seqs:  # the client went away (or the stream ended): the rows leave the batch
                seq.cancel()

    async def classify(self, request: Request):
        if not self.classifier:
            raise ApiError(
                400,
                f"{self.model_name} is a language model: use /v1/chat/completions or /v1/completions",
                code="not_a_classifier",
            )
        try:
            form = await request.form(max_files=1, max_fields=8, max_part_size=self.settings.max_upload_bytes)
        except Exception as e:  # not multipart, a broken body, too many parts
            raise ApiError(
                400, f"send the file as multipart/form-data in the field `file` ({_short(e)})", param="file"
            ) from None
        try:
            return await self._classify(form)
        finally:
            await form.close()

    async def _classify(self, form: FormData) -> dict[str, Any]:
        given: ClassifyForm = _validated(dict(form), ClassifyForm)
        if given.model is not None and given.model != self.model_name:
            raise ApiError(
                404,
                f"the model {given.model!r} does not exist; this server has {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        most, limit = self.settings.top_k, self.settings.max_upload_bytes
        top_k = most if given.top_k is None else given.top_k
        if not 1 <= top_k <= most:
            raise ApiError(400, f"top_k must be a whole number from 1 to {most}", param="top_k")
        upload = given.file
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise ApiError(413, f"the file is over {limit} bytes", param="file", code="request_too_large")
        if not data:
            raise ApiError(400, "the file is empty", param="file")
        labels, image = await run_in_threadpool(
            _run_classifier, self.served, data, upload.filename or "", top_k, given.picture
        )
        self.stats.add(requests=1)  # answered: a refused upload counts as refused alone
        out = {
            "object": "classification",
            "model": self.model_name,
            "filename": upload.filename,
            "labels": [{"label": label, "probability": round(p, 6)} for label, p in labels],
        }
        if image is not None:
            out["picture"] = "data:image/png;base64," + base64.b64encode(image).decode()
        return out


_classify_lock = threading.Lock()


def _run_classifier(served, data: bytes, filename: str, top_k: int, picture: bool) -> tuple[list, bytes | None]:
    """Decode the upload as the modality reads a file (a temporary file of the upload's extension)."""
    suffix = _upload_suffix(filename)
    with tempfile.TemporaryDirectory(prefix="onn-serve-") as folder:
        path = Path(folder) / f"upload{suffix}"
        path.write_bytes(data)
        with _classify_lock:
            try:
                labels, sample = served.classify(path, top_k)
            except UserError as e:  # in the client's terms: its file's name, not the temporary file's
                shown = filename or "the upload"
                said = str(e).replace(str(path), shown)
                if suffix:  # a reader's skip report names the file alone ("upload.png: not an image...")
                    said = said.replace(path.name, shown)
                raise ApiError(400, said, param="file", code="unreadable_file") from None
            except torch.OutOfMemoryError:  # the device's, not the file's: the server answers the next one
                raise ApiError(
                    503,
                    "the model ran out of device memory on this upload; send a smaller file, or again later.",
                    "server_error",
                    code="out_of_memory",
                ) from None
            except Exception as e:  # a decoder's own complaint about a corrupt file
                raise ApiError(
                    400, f"the file could not be decoded: {_short(e)}", param="file", code="unreadable_file"
                ) from None
            if not all(math.isfinite(p) for _, p in labels):  # JSON has no NaN: a 500 "internal error" said less
                raise ApiError(
                    500,
                    "the model's probabilities are not finite numbers (NaN): its weights diverged in training; "
                    "serve a checkpoint from before that, or train again with a lower optim.lr.",
                    "server_error",
                    code="model_diverged",
                )
            image = None
            if picture:
                png = Path(folder) / "picture.png"
                served.picture(sample, labels[0][0], png)
                image = png.read_bytes()
    return labels, image


def _upload_suffix(filename: str) -> str:
    """The upload's extension, which readers choose by: the last two suffixes (.tar.gz), else the last alone
    (a name with dots of its own: "memo 1.2 (edited).wav"), else none."""
    suffixes = [suffix.lower() for suffix in Path(filename).suffixes]
    for suffix in ("".join(suffixes[-2:]), "".join(suffixes[-1:])):
        if re.fullmatch(r"(\.[a-z0-9]{1,8}){1,2}", suffix):
            return suffix
    return ""


async def _put_disconnect(request: Request, events: asyncio.Queue) -> None:
    """A {"gone"} event once the client disconnects: the scheduler sends an event every token, so a check
    between events would never run while the request decodes."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    events.put_nowait((None, {"gone": True}))


def _record(template: str, text: str) -> dict[str, str]:
    """The user's text as a record for data.template, as training filled it: in {prompt} when the template
    names it (no record), else in the first field it names ({instruction} of '{instruction}\\n{input}'), the
    other fields empty, as an optional field a record lacked."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    except ValueError:
        return {}  # Prompter.render says what is wrong with the template
    if not names or "prompt" in names:
        return {}
    return {name: text if name == names[0] else "" for name in names}


def _parse(body: bytes, model: type[BaseModel]) -> Any:
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the body is not valid JSON: {_short(e)}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    return _validated(data, model)


def _validated(data: dict[str, Any], model: type[BaseModel]) -> Any:
    """`data` as `model`, or a 400 naming the first field that does not fit."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        loc, message = errors[0]["loc"], errors[0]["msg"]
        at = next((i for i, part in enumerate(loc) if isinstance(part, str) and UNION_MEMBER.fullmatch(part)), None)
        if at:  # a field of several types (content, prompt, stop): the field the client gave, and what it takes
            loc = loc[:at]
            types = dict.fromkeys(
                str(err["loc"][at]) for err in errors if err["loc"][:at] == loc and len(err["loc"]) > at
            )
            message = SEVERAL_TYPES.get(str(loc[-1]), f"give a value of type {' or '.join(types)}")
        param = ".".join(map(str, loc)) or None
        raise ApiError(400, f"{param}: {message}" if param else message, param=param) from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _language_model(served, req: Generation, model_name: str):
    if hasattr(served, "classify"):
        raise ApiError(400, f"{model_name} is a classifier: POST a file to /v1/classify", code="not_a_language_model")
    if req.model != model_name:
        raise ApiError(
            404,
            f"the model {req.model!r} does not exist; this server has {model_name!r}",
            param="model",
            code="model_not_found",
        )
    return served


def _starts_with_bos(lm, settings: ServeConfig) -> bool:
    """task=infer's rule (task.template there, serve.template here): a model that learned plain text gets BOS first,
    as training began every text; the byte tokenizer, GPT-2's and SmolLM2's add none themselves."""
    return settings.template and lm.prompter is not None and lm.prompter.starts_with_bos


def _prompt_ids(lm, text: str, special: bool, settings: ServeConfig, param: str, bos: bool = False) -> list[int]:
    """The prompt's token ids as training encoded its kind (`bos`: a model that learned plain text gets BOS first)."""
    limit = settings.max_prompt_tokens
    if len(text) > limit * 64:  # no tokenizer packs more than this into a token: refuse before tokenizing
        raise ApiError(400, f"the prompt is longer than {limit} tokens", param=param, code="context_length_exceeded")
    try:
        text.encode("utf-8")  # JSON's escapes can spell half a UTF-16 pair, which no tokenizer takes
    except UnicodeEncodeError:
        raise ApiError(
            400,
            f"{param}: the text holds an unpaired surrogate (a lone \\ud800-\\udfff escape); send valid Unicode.",
            param=param,
        ) from None
    ids = list(prompt_ids(lm.tokenizer, text, special, bos))
    if not ids:
        raise ApiError(400, "the prompt is empty", param=param)
    if len(ids) > limit:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens; this server takes at most {limit} (serve.max_prompt_tokens)",
            param=param,
            code="context_length_exceeded",
        )
    return ids


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's tool call for a chat template: OpenAI sends the arguments as a JSON string, and templates write
    them with `tojson` (a string came out quoted twice), so an object's string is the object, as vLLM passes it."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON (a model's broken call, sent back as it came): the template writes the text
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _refuse_tool_calls(messages: list[Message], chat_tokenizer) -> None:
    """An assistant's tool calls go through the chat template (`chat_tokenizer`) that writes them; without one
    (`role: content` lines, serve.template=false) or with a template that writes none, they would be dropped
    without a word: a 400 naming the message."""
    at = next((i for i, m in enumerate(messages) if m.tool_calls), None)
    if at is None:
        return
    template = ""
    if chat_tokenizer is not None:
        try:
            template = chat_tokenizer.get_chat_template()
        except (ValueError, TypeError):  # several named templates and none the default
            template = ""
    if "tool_calls" not in template:
        raise ApiError(
            400,
            f"messages[{at}].tool_calls: this model's prompt format has no chat template that writes tool calls; "
            "send the call and its result as text content.",
            param=f"messages[{at}].tool_calls",
        )


def _refuse_unimplemented(req: Generation) -> None:
    for name, missing in UNIMPLEMENTED.items():
        value = getattr(req, name, None)  # declared, or one of the body's extra fields
        asks_logprobs = name == "logprobs" and type(value) is int  # /v1/completions' 0 asks for the chosen tokens'
        if name in TRUE_BY_DEFAULT:
            neutral = value is None or value is True
        elif name in ASKS_WHEN_GIVEN:
            neutral = value is None
        elif name in ZERO_MAPS:
            neutral = _neutral(name, value) or (isinstance(value, dict) and all(_is_zero(v) for v in value.values()))
        else:
            neutral = _neutral(name, value)
        if asks_logprobs or not neutral:
            raise ApiError(
                400,
                f"{name}: this server {missing}; leave {name} out.",
                param=name,
                code="unsupported_parameter",
            )
    if req.stream_options is not None and not req.stream:  # OpenAI's 400: usage is then in the answer anyway
        raise ApiError(
            400,
            "stream_options: only allowed when stream is true; set stream to true or leave stream_options out.",
            param="stream_options",
        )


def _neutral(name: str, value: Any) -> bool:
    """Whether `value` of field `name` asks for nothing (NEUTRAL, or the field's own NEUTRAL_OWN): equal, and a bool
    only where the neutral is one (True == 1 and False == 0 passed best_of=true)."""
    same = (n for n in (*NEUTRAL, NEUTRAL_OWN.get(name)) if n is not None)
    return value is None or any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in same)


def _is_zero(value: Any) -> bool:
    """A number equal to 0 and not a bool: false is no bias value, as OpenAI takes it."""
    return type(value) in (int, float) and value == 0


def _max_tokens(req: Generation, settings: ServeConfig, room: int | None, ids: list[int], param: str) -> int:
    """The tokens to generate: what the request asked for, else serve.default_max_tokens cut to the context the
    prompt leaves (a client that asked for no length is not refused for one)."""
    given = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"  # as the client named it
    most, asked = settings.max_tokens, getattr(req, given)
    left = most if room is None else room - len(ids)
    if left < 1:  # the prompt's fault whatever length was asked for: fewer max_tokens would not help
        raise ApiError(
            400,
            f"the prompt's {len(ids)} tokens fill the model's context of {room} tokens; shorten the {param}.",
            param=param,
            code="context_length_exceeded",
        )
    if asked is None:
        return min(settings.default_max_tokens, most, left)
    if asked > most:
        raise ApiError(
            400,
            f"{given}={asked}: this server generates at most {most} (serve.max_tokens)",
            param=given,
        )
    if room is not None and len(ids) + asked > room:
        raise ApiError(
            400,
            f"the prompt's {len(ids)} tokens and {given} {asked} pass the model's context of {room} tokens; ask for "
            f"at most {left} or shorten the {param}.",
            param=given,
            code="context_length_exceeded",
        )
    return asked


def _sampling(req: Generation, settings: ServeConfig, wanted: int) -> Sampling:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > settings.max_stop or any(not s or len(s) > 256 for s in stop):
        raise ApiError(400, f"stop: at most {settings.max_stop} strings of 1 to 256 characters", param="stop")
    temperature = 1.0 if req.temperature is None else req.temperature  # OpenAI's default
    seed = None if req.seed == RANDOM_SEED else req.seed
    return Sampling(wanted, temperature, 1.0 if req.top_p is None else req.top_p, seed, stop)


def _context(lm) -> int | None:
    return context_length(lm.model)


def _error_code(finish: dict[str, Any]) -> str:
    """An error event's code: out_of_memory (this request did not fit beside the others; they went on),
    model_diverged (the model's scores for it were NaN or inf), model_unavailable (the engine could not be reset after
    a failed step), server_shutting_down (the server stopped before it ended: retry elsewhere), else
    generation_failed."""
    return finish.get("code") or "generation_failed"


def _usage(finishes: list[dict[str, Any]]) -> dict[str, int]:
    """The token counts of a request's choices together, as OpenAI counts a list of prompts."""
    p = sum(finish["prompt_tokens"] for finish in finishes)
    c = sum(finish["completion_tokens"] for finish in finishes)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _model_card(name: str, created: int, classifier: bool) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "onn",
        "onn_kind": "classifier" if classifier else "language model",
    }


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _short(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
