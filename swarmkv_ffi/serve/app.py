"""The HTTP front: OpenAI's routes on FastAPI, with no engine logic.

POST /v1/chat/completions and /v1/completions turn a body into one Job per choice
(engine.py) and the jobs' tokens into a response or server-sent events; GET /v1/models
and /health say what is served. Every error is OpenAI's JSON error shape with its status:
400 a malformed body, a bad field or a prompt over the context (with the numbers), 401 a
missing or wrong key, 404 an unknown model or route, 413 a body over --max-body-bytes,
429 a key over its share, 503 a server that is full or stopping.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ..errors import SwarmKVError
from .engine import Job, Refused, ServeEngine
from .keys import Keys
from .schemas import ChatRequest, CompletionRequest, Sampling
from .text import TextStream

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object: a response's body, or an event in a stream that has begun."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status)


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return (f"{where}: {first['msg']}" if where else first["msg"]), where or None


class Choice:
    """One choice as it is produced: its text so far, logprobs, how it ended."""

    def __init__(self, index: int, stream: TextStream):
        self.index, self.text = index, stream
        self.logprobs: list[dict] = []
        self.logprobs_sent = 0            # entries already streamed
        self.run, self.error = None, None

    def finish_reason(self) -> str:
        if self.text.stopped or self.run.stopped_on_eog:
            return "stop"
        return "length"


class Call:
    """One request's choices, run on threads of their own (the engine blocks), their
    events handed to the event loop through a queue."""

    def __init__(self, engine: ServeEngine, principal: int, body: Sampling, prompts: list[list[int]],
                 max_tokens: int, loop: asyncio.AbstractEventLoop):
        self.engine, self.principal, self.body = engine, principal, body
        self.prompts, self.max_tokens = prompts, max_tokens
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.choices: list[Choice] = []
        self.jobs: list[Job] = []

    def start(self) -> None:
        n = self.body.n
        self.engine.admit(self.principal, n * len(self.prompts))
        for p, tokens in enumerate(self.prompts):
            for k in range(n):
                choice = Choice(p * n + k, TextStream(self.engine.model, self.body.stops()))
                job = Job(self.principal, tokens, self.max_tokens, self._on_token(choice),
                          sampling=self.body.settings(k), top_logprobs=self.body.ranked())
                self.choices.append(choice)
                self.jobs.append(job)
                threading.Thread(target=self._run, args=(choice, job), daemon=True,
                                 name=f"serve-choice-{choice.index}").start()

    def _on_token(self, choice: Choice):
        """Runs on the scheduler's thread, between two steps: it wakes the event loop only
        for a stream (on two cores, a thread woken per token slows every step)."""
        stream = self.body.stream

        def on_token(token: int, ranked) -> bool:
            piece = choice.text.feed(token)
            if ranked is not None:
                choice.logprobs.append(self._logprob_entry(token, ranked))
            if stream:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, ("text", choice, piece))
            return not choice.text.stopped
        return on_token

    def _logprob_entry(self, token: int, ranked) -> dict:
        model = self.engine.model
        lp, top = ranked

        def item(t: int, p: float) -> dict:
            raw = model.token_bytes(t)
            return {"token": raw.decode("utf-8", "replace"), "logprob": p, "bytes": list(raw)}
        return {**item(token, lp), "top_logprobs": [item(t, p) for t, p in top]}

    def _run(self, choice: Choice, job: Job) -> None:
        try:
            choice.run = self.engine.run(job)
            tail = choice.text.flush()
            if self.body.stream:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, ("text", choice, tail))
        except BaseException as exc:     # reported to the client, not raised on a thread
            choice.error = exc
        finally:
            self.engine.leave(self.principal, 1)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ("end", choice, None))

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancelled.set()

    async def events(self):
        """(kind, choice, text) until every choice has ended: 'text' pieces, then 'end'."""
        left = len(self.choices)
        while left:
            kind, choice, text = await self.queue.get()
            left -= kind == "end"
            yield kind, choice, text

    def usage(self) -> dict:
        n = self.body.n
        firsts = [c for c in self.choices if c.index % n == 0 and c.run is not None]
        prompt = sum(len(p) for p in self.prompts)
        done = sum(len(c.run.generated) for c in self.choices if c.run is not None)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": sum(c.run.cached for c in firsts)}}


async def capped_body(request: Request, max_body_bytes: int) -> bytes:
    """The request's body, or 413 as soon as it is known to be over the cap (its
    Content-Length, else the bytes read so far): a huge body is never held whole."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_body_bytes:
        raise Refused(413, f"the body is {size} bytes; the server takes at most {max_body_bytes} "
                      "(--max-body-bytes)", "body_too_large")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_body_bytes:
            raise Refused(413, f"the body is over {max_body_bytes} bytes (--max-body-bytes)", "body_too_large")
    return bytes(raw)


def create_app(engine: ServeEngine, model_name: str, keys: Keys, max_body_bytes: int = 8 << 20,
               default_max_tokens: int = 1024) -> FastAPI:
    app = FastAPI(title="swarmkv serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(Refused)
    async def refused(_request, exc: Refused):
        return error_response(exc.status, str(exc), exc.code, exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(SwarmKVError)
    async def library_error(_request, exc: SwarmKVError):      # e.g. a model with no chat template
        return error_response(500, str(exc), "server_error")

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        return error_response(400, *validation_message(exc))

    def principal_of(request: Request) -> int:
        who = keys.principal(request.headers.get("authorization"))
        if who is None:
            raise Refused(401, "Incorrect API key provided", "invalid_api_key")
        return who

    async def read_body(request: Request, schema):
        raw = await capped_body(request, max_body_bytes)
        try:
            return schema.model_validate(json.loads(raw))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise Refused(400, f"the body is not valid JSON: {exc}", "invalid_json") from None
        except ValidationError as exc:
            raise Refused(400, *validation_message(exc)) from None

    def check_model(name: str) -> None:
        if name != model_name:
            raise Refused(404, f"The model `{name}` does not exist; this server serves `{model_name}`",
                          "model_not_found", "model")

    def budget(body: Sampling, prompts: list[list[int]], asked: int | None, what: str) -> int:
        """max_tokens for the request: as asked, or what the context leaves (at most
        default_max_tokens); 400 with the numbers when the prompt does not fit."""
        longest, room = max(len(p) for p in prompts), engine.max_context
        if asked is None:
            asked = min(default_max_tokens, room - longest)
        if longest + asked > room or asked < 1:
            raise Refused(400, f"This model's maximum context length is {room} tokens. However, you "
                          f"requested {longest + asked} tokens ({longest} in the {what}, {asked} in the "
                          "completion). Please reduce the length of the messages or completion.",
                          "context_length_exceeded", "messages" if what == "messages" else "prompt")
        return asked

    async def answer(request: Request, call: Call, shape):
        call.start()
        if call.body.stream:
            return StreamingResponse(stream_events(call, shape), media_type="text/event-stream")
        watcher = asyncio.create_task(watch_disconnect(request, call))
        try:
            async for _ in call.events():
                pass
        finally:
            watcher.cancel()
        failed = next((c.error for c in call.choices if c.error is not None), None)
        if failed is not None:
            raise failed if isinstance(failed, Refused) else Refused(503, f"the request failed: {failed}")
        return shape.whole(call)

    async def watch_disconnect(request: Request, call: Call) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.1)
        call.cancel()        # the client left: its choices roll back, the others go on

    async def stream_events(call: Call, shape):
        finished = False
        try:
            for chunk in shape.opening(call):
                yield sse(chunk)
            async for kind, choice, text in call.events():
                if choice.error is not None and kind == "end":
                    exc = choice.error
                    status = exc.status if isinstance(exc, Refused) else 503
                    yield sse(error_body(status, str(exc), getattr(exc, "code", None)))
                    continue
                chunk = shape.piece(call, choice, text) if kind == "text" else shape.ending(call, choice)
                if chunk is not None:
                    yield sse(chunk)
            if call.body.usage_in_stream:
                yield sse({**shape.header(call), "choices": [], "usage": call.usage()})
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                call.cancel()

    @app.get("/health")
    async def health():
        if engine.stopping:
            return error_response(503, "the server is stopping", "server_stopping")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        principal_of(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "swarmkv"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        who = principal_of(request)
        body = await read_body(request, ChatRequest)
        check_model(body.model)
        tokens = await asyncio.to_thread(chat_tokens, engine.model, body)
        call = Call(engine, who, body, [tokens], budget(body, [tokens], body.limit(), "messages"),
                    asyncio.get_running_loop())
        return await answer(request, call, ChatShape(model_name))

    @app.post("/v1/completions")
    async def completions(request: Request):
        who = principal_of(request)
        body = await read_body(request, CompletionRequest)
        check_model(body.model)
        if body.echo or body.suffix:
            raise Refused(400, "echo and suffix are not supported", "unsupported_parameter",
                          "echo" if body.echo else "suffix")
        prompts = await asyncio.to_thread(
            lambda: [[int(t) for t in engine.model.tokenize(p, add_special=True)] for p in body.prompts()])
        if not all(prompts):
            raise Refused(400, "the prompt is empty", "empty_prompt", "prompt")
        call = Call(engine, who, body, prompts, budget(body, prompts, body.limit(), "prompt"),
                    asyncio.get_running_loop())
        return await answer(request, call, CompletionShape(model_name))

    return app


def chat_tokens(model, body: ChatRequest) -> list[int]:
    """The messages through the model's chat template, as tokens (off the event loop: a
    body of megabytes takes a while)."""
    text = model.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
    return [int(t) for t in model.tokenize(text, add_special=True, parse_special=True)]


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


class ChatShape:
    """chat.completion and chat.completion.chunk objects."""

    def __init__(self, model: str):
        self.model, self.id = model, f"chatcmpl-{uuid.uuid4().hex}"

    def header(self, call: Call) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model, "system_fingerprint": None}

    def whole(self, call: Call) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text.sent},
                    "logprobs": {"content": c.logprobs} if call.body.ranked() is not None else None,
                    "finish_reason": c.finish_reason()} for c in call.choices]
        return {"id": self.id, "object": "chat.completion", "created": int(time.time()), "model": self.model,
                "system_fingerprint": None, "choices": choices, "usage": call.usage()}

    def _chunk(self, call: Call, choice: Choice, delta: dict, finish=None, logprobs=None) -> dict:
        out = {**self.header(call), "choices": [{"index": choice.index, "delta": delta, "logprobs": logprobs,
                                                 "finish_reason": finish}]}
        if call.body.usage_in_stream:
            out["usage"] = None
        return out

    def opening(self, call: Call):
        for c in call.choices:
            yield self._chunk(call, c, {"role": "assistant", "content": ""})

    def piece(self, call: Call, choice: Choice, text: str):
        fresh = choice.logprobs[choice.logprobs_sent:]
        if not text and not fresh:
            return None
        choice.logprobs_sent = len(choice.logprobs)
        return self._chunk(call, choice, {"content": text},
                           logprobs={"content": fresh} if call.body.ranked() is not None else None)

    def ending(self, call: Call, choice: Choice):
        return self._chunk(call, choice, {}, finish=choice.finish_reason())


class CompletionShape:
    """text_completion objects, whole and streamed."""

    def __init__(self, model: str):
        self.model, self.id = model, f"cmpl-{uuid.uuid4().hex}"

    def header(self, call: Call) -> dict:
        return {"id": self.id, "object": "text_completion", "created": int(time.time()), "model": self.model}

    @staticmethod
    def _logprobs(entries: list[dict], offset: int = 0) -> dict:
        offsets, at = [], offset
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    def whole(self, call: Call) -> dict:
        choices = [{"index": c.index, "text": c.text.sent, "finish_reason": c.finish_reason(),
                    "logprobs": self._logprobs(c.logprobs) if call.body.ranked() is not None else None}
                   for c in call.choices]
        return {**self.header(call), "choices": choices, "usage": call.usage()}

    def opening(self, call: Call):
        return []

    def piece(self, call: Call, choice: Choice, text: str):
        if not text:
            return None
        return {**self.header(call), "choices": [{"index": choice.index, "text": text, "finish_reason": None,
                                                  "logprobs": None}]}

    def ending(self, call: Call, choice: Choice):
        lp = self._logprobs(choice.logprobs) if call.body.ranked() is not None else None
        return {**self.header(call), "choices": [{"index": choice.index, "text": "",
                                                  "finish_reason": choice.finish_reason(), "logprobs": lp}]}
