"""A Call's choices as OpenAI's response objects (schemas.py), whole or as stream events.

ChatShape writes chat.completion and chat.completion.chunk, CompletionShape
text_completion; both have the same four moments: `whole` (not streamed), `opening`
(the chunks before any text), `piece` (new text of one choice, or None for nothing to
send) and `ending` (the chunks of one choice's finish), and `usage_chunk` for
stream_options. A chat stream reads each choice's answer as it comes (dialects.Reader):
words as content, a thinking model's thought as reasoning_content, and each tool call as
OpenAI streams one (a piece with id, type and name, then its arguments as written).

`Events` turns either into what routes.answer takes from every API's shape (this
module's, openai_responses.py's, anthropic.py's): `whole` (a JSON body), and for a
stream `opening`, `piece`, `ending`, `closing` and `error`, each server-sent events.
"""
from __future__ import annotations

import functools
import json
import time
import uuid

from . import telemetry
from .calls import Call, Choice
from .dialects import Part, Reader
from .errors import Refused, error_body
from .schemas import (ChatChoice, ChatChunk, ChatCompletion, ChatLogprobs, ChatMessage, ChunkChoice, Completion,
                      CompletionChoice, CompletionLogprobs, Delta, FunctionCallOut, FunctionPiece, TokenLogprob,
                      ToolCallOut, ToolCallPiece)


@functools.cache
def fingerprint() -> str:
    """system_fingerprint, as llama-server writes it (b<build>-<commit>): the pin and the
    llama.cpp commit of the library in use."""
    from .. import library
    m = library.read_manifest() or {}
    return f"b{m.get('source', '').rpartition('==')[2] or '0'}-{m.get('llama_cpp_commit') or 'unknown'}"


def sse(data: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


def sse_event(kind: str, data: dict) -> str:
    """One server-sent event with its name (the Responses and Messages APIs name theirs)."""
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


class Events:
    """A chat or text completion shape's chunks as server-sent events: `data:` lines,
    OpenAI's error object for a choice that failed, the usage chunk when asked, [DONE]."""

    def __init__(self, shape):
        self.shape = shape

    def whole(self, call: Call) -> dict:
        return self.shape.whole(call).model_dump()

    def opening(self, call: Call):
        return [sse(c.model_dump()) for c in self.shape.opening(call)]

    def piece(self, call: Call, choice: Choice, text: str):
        return [sse(c.model_dump()) for c in self.shape.piece(call, choice, text)]

    def progress(self, call: Call, choice: Choice, read: int):
        return [sse(c.model_dump()) for c in self.shape.progress(call, choice, read)]

    def ending(self, call: Call, choice: Choice):
        return [sse(c.model_dump()) for c in self.shape.ending(call, choice) if c is not None]

    def closing(self, call: Call):
        usage = [sse(self.shape.usage_chunk(call).model_dump())] if call.body.usage_in_stream else []
        return usage + ["data: [DONE]\n\n"]

    def error(self, exc: Refused) -> str:
        return sse(error_body(exc.status, str(exc), exc.code, details=exc.details))


class ChatShape:
    def __init__(self, model: str):
        self.model, self.id = model, f"chatcmpl-{uuid.uuid4().hex}"
        self._readers: dict[int, Reader] = {}     # a stream's reader per choice

    def _logprobs(self, call: Call, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        return ChatLogprobs(content=entries) if call.body.ranked() is not None else None

    def whole(self, call: Call) -> ChatCompletion:
        choices = []
        for c in call.choices:
            reply = call.structure.read(c.text.sent)
            calls = [ToolCallOut(id=t.id, function=FunctionCallOut(name=t.name, arguments=t.arguments))
                     for t in reply.tool_calls]
            said = {"tool_calls": calls} if calls else {}
            if reply.reasoning is not None:
                said["reasoning_content"] = reply.reasoning
            choices.append(ChatChoice(index=c.index, message=ChatMessage(content=reply.content, **said),
                                      logprobs=self._logprobs(call, c.logprobs), finish_reason=c.finish_reason(reply)))
        return ChatCompletion(id=self.id, created=int(time.time()), model=self.model, choices=choices,
                              usage=call.usage(), system_fingerprint=fingerprint())

    def _chunk(self, call: Call, choices: list[ChunkChoice], **extra) -> ChatChunk:
        if call.body.usage_in_stream and "usage" not in extra:
            extra["usage"] = None         # every chunk says it, null but the last
        return ChatChunk(id=self.id, created=int(time.time()), model=self.model, choices=choices,
                         system_fingerprint=fingerprint(), **extra)

    @staticmethod
    def _timings(call: Call, choice: Choice) -> dict:
        """llama-server's timings_per_token: the choice's figures so far on its chunks."""
        return {"timings": telemetry.timings(call, choice)} if getattr(call.body, "timings_per_token", False) else {}

    def opening(self, call: Call):
        for c in call.choices:
            yield self._chunk(call, [ChunkChoice(index=c.index, delta=Delta(role="assistant", content=None))])

    def _reader(self, call: Call, choice: Choice) -> Reader:
        if choice.index not in self._readers:
            self._readers[choice.index] = call.structure.reader()
        return self._readers[choice.index]

    def piece(self, call: Call, choice: Choice, text: str) -> list[ChatChunk]:
        """The chunks of new text: its parts as the reader splits them (words, thought,
        a call opened, its arguments), the logprobs so far on the first."""
        progress = self.progress(call, choice)
        fresh = choice.logprobs[choice.logprobs_sent:]
        deltas = [delta(p) for p in self._reader(call, choice).feed(text)] if text else []
        if not deltas and (not fresh or call.structure.enveloped):
            return progress
        choice.logprobs_sent += len(fresh)
        deltas = deltas or [Delta(content="")]
        timings = self._timings(call, choice)
        return progress + [self._chunk(call, [ChunkChoice(index=choice.index, delta=d,
                                                          logprobs=self._logprobs(call, fresh) if i == 0 else None)],
                                       **timings) for i, d in enumerate(deltas)]

    def progress(self, call: Call, choice: Choice, read: int | None = None) -> list[ChatChunk]:
        """llama-server's return_progress: a chunk per report due (telemetry.progress), with
        its `prompt_progress` (and the opening delta, as there); `read`: the prompt's
        tokens in cells, None once it is all read."""
        if not call.progress_asked:
            return []
        timed = getattr(call.body, "timings_per_token", False)
        return [self._chunk(call, [ChunkChoice(index=choice.index, delta=Delta(role="assistant", content=None))],
                            prompt_progress=report, **({"timings": spent} if timed else {}))
                for report, spent in telemetry.progress(call, choice, read)]

    def ending(self, call: Call, choice: Choice) -> list[ChatChunk]:
        """What the reader held back, then the finish: "tool_calls" when it opened any."""
        parts = self._reader(call, choice).finish()
        fresh = choice.logprobs[choice.logprobs_sent:]
        choice.logprobs_sent += len(fresh)
        out = [self._chunk(call, [ChunkChoice(index=choice.index, delta=delta(p),
                                              logprobs=self._logprobs(call, fresh) if i == 0 else None)])
               for i, p in enumerate(parts)]
        called = self._reader(call, choice).n_calls or any(p.kind == "call" for p in parts)
        reason = "tool_calls" if called else choice.finish_reason()
        out.append(self._chunk(call, [ChunkChoice(index=choice.index, delta=Delta(), finish_reason=reason)],
                               **self._timings(call, choice)))
        return out

    def usage_chunk(self, call: Call) -> ChatChunk:
        return self._chunk(call, [], usage=call.usage(), **self._timings(call, call.choices[0]))


def delta(part: Part) -> Delta:
    """A stream's delta for one part of an answer (dialects.Part)."""
    if part.kind == "content":
        return Delta(content=part.text)
    if part.kind == "reasoning":
        return Delta(reasoning_content=part.text)
    if part.kind == "call":
        return Delta(tool_calls=[ToolCallPiece(index=part.index, id=part.id, type="function",
                                               function=FunctionPiece(name=part.text, arguments=""))])
    return Delta(tool_calls=[ToolCallPiece(index=part.index, function=FunctionPiece(arguments=part.text))])


class CompletionShape:
    def __init__(self, model: str):
        self.model, self.id = model, f"cmpl-{uuid.uuid4().hex}"

    @staticmethod
    def progress(call: Call, choice: Choice, read: int) -> list:
        return []         # OpenAI's completions have no return_progress

    @staticmethod
    def _logprobs(call: Call, entries: list[TokenLogprob]) -> CompletionLogprobs | None:
        if call.body.ranked() is None:
            return None
        offsets, at = [], 0
        for e in entries:
            offsets.append(at)
            at += len(e.token)
        return CompletionLogprobs(tokens=[e.token for e in entries], token_logprobs=[e.logprob for e in entries],
                                  top_logprobs=[{t.token: t.logprob for t in e.top_logprobs} for e in entries],
                                  text_offset=offsets)

    def _object(self, choices: list[CompletionChoice], **usage) -> Completion:
        return Completion(id=self.id, created=int(time.time()), model=self.model, choices=choices,
                          system_fingerprint=fingerprint(), **usage)

    def whole(self, call: Call) -> Completion:
        choices = [CompletionChoice(index=c.index, text=c.text.sent, finish_reason=c.finish_reason(),
                                    logprobs=self._logprobs(call, c.logprobs)) for c in call.choices]
        return self._object(choices, usage=call.usage())

    def opening(self, call: Call):
        return []

    def piece(self, call: Call, choice: Choice, text: str) -> list[Completion]:
        if not text:
            return []
        return [self._object([CompletionChoice(index=choice.index, text=text, finish_reason=None, logprobs=None)])]

    def ending(self, call: Call, choice: Choice) -> list[Completion]:
        return [self._object([CompletionChoice(index=choice.index, text="", finish_reason=choice.finish_reason(),
                                               logprobs=self._logprobs(call, choice.logprobs))])]

    def usage_chunk(self, call: Call) -> Completion:
        return self._object([], usage=call.usage())
