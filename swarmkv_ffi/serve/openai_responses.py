"""OpenAI's Responses API (`POST /v1/responses`) on the chat engine.

A Responses request is read (`ResponsesRequest`, every field acted on or refused with a
400 naming it), turned into the one internal request type, a chat completion request
(`to_chat`: `instructions` and `input` items become chat messages, `text.format` a
`response_format`, function tools chat tools), and run exactly as chat completions run:
the same template, grammar, pool and prefix sharing. Only the answer's shape differs
(`ResponsesShape`): a `response` object with output items, or its stream of events.

`store` (on by default, as OpenAI's) keeps the conversation under the response's id for
`previous_response_id` (stored.py: per key, bounded, expiring); the next turn's prompt is
that conversation plus the new input, so it starts with the tokens the pool kept and
forks them.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator

from . import dialects, telemetry
from .calls import Call, Choice
from .dialects import Block, Blocks, Reader, Reply
from .errors import Refused, validated
from .responses import sse_event
from .schemas import STRICT, ChatRequest, FunctionDef, JsonObjectFormat, JsonSchemaSpec, TextFormat
from .stored import StoredResponses

NOT_IMAGES = "image input is not supported: this server runs text models"
#: The header naming a stored response in its answer (the Ray ingress routes its next turn by it).
RESPONSE_HEADER = "x-swarmkv-response"


class InputText(BaseModel):
    """A text part of an input message (`input_text`), or of an earlier answer sent back
    (`output_text`, with the annotations and logprobs it was given)."""
    model_config = STRICT
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class Refusal(BaseModel):
    model_config = STRICT
    type: Literal["refusal"]
    refusal: str


class Unsupported(BaseModel):
    """A part or item of a type this server cannot take: a 400 that says why."""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, value):
        kind = value.get("type") if isinstance(value, dict) else None
        if kind in ("input_image", "input_file", "input_audio", "image", "document"):
            raise ValueError(NOT_IMAGES)
        raise ValueError(f"the type {kind!r} is not supported here (docs/serve.md lists what is)")


def _part_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else None
    return {"refusal": "refusal", "input_text": "text", "output_text": "text"}.get(kind, "unsupported")


Part = Annotated[Union[Annotated[InputText, Tag("text")], Annotated[Refusal, Tag("refusal")],
                       Annotated[Unsupported, Tag("unsupported")]], Discriminator(_part_kind)]


class InputMessage(BaseModel):
    """A message item: `{"role": ..., "content": ...}`, or an earlier output message."""
    model_config = STRICT
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[Part]]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, InputText) else p.refusal for p in self.content)


class FunctionCallItem(BaseModel):
    """A function call the model made, sent back in the conversation."""
    model_config = STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(BaseModel):
    """What a function call returned."""
    model_config = STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputText]]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else "message"
    return kind if kind in ("message", "function_call", "function_call_output") else "unsupported"


Item = Annotated[Union[Annotated[InputMessage, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                       Annotated[FunctionCallOutput, Tag("function_call_output")],
                       Annotated[Unsupported, Tag("unsupported")]], Discriminator(_item_kind)]


class FunctionTool(FunctionDef):
    """A function tool: chat completions' function, flat, with its type."""
    type: Literal["function"]


class NamedFunction(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: str


class JsonSchema(JsonSchemaSpec):
    """chat completions' json_schema, flat, with its type; the schema required."""
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class TextConfig(BaseModel):
    model_config = STRICT
    format: Union[TextFormat, JsonObjectFormat, JsonSchema] = Field(
        default_factory=lambda: TextFormat(type="text"), discriminator="type")


class ResponsesRequest(BaseModel):
    """The fields of `POST /v1/responses` this server acts on; any other is a 400."""
    model_config = STRICT
    model: str | None = None
    input: Union[str, list[Item]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)                          # llama-server's extras, as on chat completions
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None             # llama-server's extra (checked as chat's)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None                     # nothing to include: any entry is refused
    truncation: Literal["disabled"] | None = None        # "auto" (dropping the conversation's start) is refused
    metadata: dict[str, str] | None = None               # kept on the response, not acted on
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None                  # every prefix is cached anyway, per key
    keep_alive: Union[float, str, None] = None           # Ollama's, as on chat completions
    timings_per_token: bool = False                      # llama-server's telemetry (telemetry.py)
    return_progress: bool = False

    @field_validator("include")
    @classmethod
    def _nothing_included(cls, v):
        if v:
            raise ValueError(f"this server has nothing to include for {v[0]!r}")
        return v

    def items(self) -> list:
        return [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input


def conversation(items: list) -> list[dict]:
    """Input items as chat messages (OpenAI's dicts): a run of function calls becomes one
    assistant message's tool_calls, each output a tool message."""
    out: list[dict] = []
    for item in items:
        if isinstance(item, InputMessage):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def to_chat(body: ResponsesRequest, model: str, earlier: list[dict]) -> tuple[ChatRequest, list[dict]]:
    """(the chat request this Responses request runs as, its conversation without the
    instructions: what a stored response keeps). `earlier`: the stored conversation of
    previous_response_id."""
    turns = earlier + conversation(body.items())
    if not turns:
        raise Refused(400, "input: give at least one message", None, "input")
    head = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = dict(model=model, messages=head + turns, temperature=body.temperature, top_p=body.top_p,
                                top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=body.stop,
                                stream=body.stream, keep_alive=body.keep_alive, return_progress=body.return_progress,
                                timings_per_token=body.timings_per_token)
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    if body.tool_choice is not None:
        choice = body.tool_choice
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, JsonObjectFormat):
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, JsonSchema):
        spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    return validated(ChatRequest, chat), turns


def answered(reply: Reply) -> list[dict]:
    """The answer as chat messages, for the stored conversation."""
    thought = {"reasoning_content": reply.reasoning} if reply.reasoning else {}
    if reply.tool_calls:
        return [{"role": "assistant", "content": None, **thought,
                 "tool_calls": [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                                for t in reply.tool_calls]}]
    return [{"role": "assistant", "content": reply.content or "", **thought}]


class ResponsesShape:
    """A call's one choice as a `response` object, or as the events the SDKs accumulate:
    response.created, response.in_progress, then per output item ...output_item.added,
    (a message) content_part.added, output_text.delta..., output_text.done,
    content_part.done, (a function call) function_call_arguments.delta and .done,
    ...output_item.done; last response.completed, or response.incomplete when
    max_output_tokens cut the answer (OpenAI's status `incomplete`). Every event carries
    its `sequence_number`. A stream reads the answer as it comes (dialects.Reader): a
thinking model's thought is a reasoning item, then the words, then each call, each item
opened when its first part is generated."""

    def __init__(self, body: ResponsesRequest, model: str, owner: int, store: StoredResponses | None,
                 turns: list[dict]):
        self.body, self.model, self.owner, self.store, self.turns = body, model, owner, store, turns
        self.id = f"resp_{uuid.uuid4().hex}"
        self.headers = {RESPONSE_HEADER: self.id} if body.store and store is not None else None
        self.created = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.sequence = 0
        self._read: Reader | None = None          # a stream's reader of the answer, and its blocks
        self._blocks = Blocks()
        self._ids: dict[int, str] = {}             # a block's item id

    # ---- the response object ----

    def _response(self, call: Call, status: str, output: list[dict], usage: dict | None) -> dict:
        body = self.body
        fmt = body.text.format.model_dump(by_alias=True) if body.text is not None else {"type": "text"}
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": call.structure.parallel if tools else True,
            "previous_response_id": body.previous_response_id, "reasoning": None, "store": body.store,
            "temperature": body.temperature, "text": {"format": fmt}, "tool_choice": choice or "auto",
            "tools": tools, "top_p": body.top_p, "truncation": "disabled", "usage": usage,
            "user": body.user, "metadata": body.metadata or {},
        }

    def _usage(self, call: Call) -> dict:
        u = call.usage()
        return {"input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
                "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.total_tokens}

    def _message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [self._part(text)] if status != "in_progress" else []}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def _function_call(call_id: str, name: str, arguments: str, status: str) -> dict:
        return {"type": "function_call", "id": f"fc_{call_id.removeprefix('call_')}", "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    def _output(self, reply: Reply) -> list[dict]:
        """A thought as a reasoning item (a thinking model's, dialects.py), the words, the calls."""
        out = [self._reasoning(f"rs_{self.id.removeprefix('resp_')}", reply.reasoning)] if reply.reasoning else []
        if reply.content or not reply.tool_calls:
            out.append(self._message(reply.content or "", "completed"))
        return out + [self._function_call(t.id, t.name, t.arguments, "completed") for t in reply.tool_calls]

    @staticmethod
    def _reasoning(item_id: str, text: str) -> dict:
        return {"type": "reasoning", "id": item_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def _final(self, call: Call, streamed: Blocks | None = None) -> tuple[dict, str]:
        """(the finished response, its status), kept in the store when asked: the answer
        read whole, or the items a stream sent."""
        choice = call.choices[0]
        reply = call.structure.read(choice.text.sent) if streamed is None else streamed.reply()
        status = "incomplete" if choice.finish_reason(reply) == "length" else "completed"
        output = self._output(reply) if streamed is None else [self._item(b, "completed") for b in streamed.blocks]
        response = self._response(call, status, output, self._usage(call))
        if self.body.store and self.store is not None:
            self.store.put(self.owner, self.id, self.turns + answered(reply), response)
        return response, status

    def whole(self, call: Call) -> dict:
        return self._final(call)[0]

    # ---- the stream ----

    def _event(self, kind: str, **fields) -> str:
        self.sequence += 1
        return sse_event(kind, {"type": kind, "sequence_number": self.sequence - 1, **fields})

    def opening(self, call: Call):
        started = self._response(call, "in_progress", [], None)
        yield self._event("response.created", response=started)
        yield self._event("response.in_progress", response=started)

    def piece(self, call: Call, choice: Choice, text: str):
        """The items as the reader splits the answer (dialects.Blocks): each opened when
        its first part comes, its text, thought or arguments as they are generated."""
        yield from self.progress(call, choice)
        if text:
            for event in self._blocks.feed(self._reader(call).feed(text)):
                yield from self._streamed(event, self._timings(call, choice))

    def progress(self, call: Call, choice: Choice, read: int | None = None):
        """llama-server's return_progress: a response.in_progress event per report due
        (telemetry.progress); `read`: the prompt's tokens in cells, None once all read."""
        if not call.progress_asked:
            return
        for report, spent in telemetry.progress(call, choice, read):
            yield self._event("response.in_progress", response=self._response(call, "in_progress", [], None),
                              prompt_progress=report, **({"timings": spent} if self.body.timings_per_token else {}))

    def _reader(self, call: Call) -> Reader:
        if self._read is None:
            self._read = call.structure.reader()
        return self._read

    def _timings(self, call: Call, choice: Choice) -> dict:
        return {"timings": telemetry.timings(call, choice)} if self.body.timings_per_token else {}

    def ending(self, call: Call, choice: Choice):
        events = self._blocks.feed(self._reader(call).finish())
        if not self._blocks.blocks:              # nothing said: an empty message
            events += self._blocks.feed([dialects.Part("content", "")])
        for event in events + self._blocks.close():
            yield from self._streamed(event, {})
        response, status = self._final(call, self._blocks)
        yield self._event(f"response.{status}", response=response, timings=telemetry.timings(call, choice))

    def _item_id(self, block: Block) -> str:
        if block.kind == "call":
            return f"fc_{block.id.removeprefix('call_')}"
        if block.index not in self._ids:
            first = block.kind == "content" and self.message_id not in self._ids.values()
            self._ids[block.index] = self.message_id if first else f"{'msg' if block.kind == 'content' else 'rs'}_" \
                f"{uuid.uuid4().hex}"
        return self._ids[block.index]

    def _item(self, block: Block, status: str) -> dict:
        """The output item a block is, as the response holds it (`status` for its state)."""
        item_id = self._item_id(block)
        if block.kind == "call":
            return self._function_call(block.id, block.name, block.text, status)
        if block.kind == "reasoning":
            return self._reasoning(item_id, block.text)
        return dict(self._message(block.text, status), id=item_id)

    def _streamed(self, event: tuple, timings: dict):
        """The Responses events of one block event: an item opened, a piece, closed."""
        what, block = event[0], event[1]
        where = dict(item_id=self._item_id(block), output_index=block.index)
        if what == "open":
            item = self._item(block, "in_progress")
            if block.kind != "call":
                item = dict(item, content=[])      # its parts come as they are generated
            yield self._event("response.output_item.added", output_index=block.index, item=item)
            if block.kind == "content":
                yield self._event("response.content_part.added", **where, content_index=0, part=self._part(""))
        elif what == "delta":
            kind = {"content": "response.output_text.delta", "reasoning": "response.reasoning_text.delta",
                    "call": "response.function_call_arguments.delta"}[block.kind]
            extra = dict(content_index=0, logprobs=[], **timings) if block.kind == "content" else \
                dict(content_index=0) if block.kind == "reasoning" else {}
            yield self._event(kind, **where, delta=event[2], **extra)
        else:
            item = self._item(block, "completed")
            if block.kind == "content":
                yield self._event("response.output_text.done", **where, content_index=0, text=block.text, logprobs=[])
                yield self._event("response.content_part.done", **where, content_index=0, part=self._part(block.text))
            elif block.kind == "reasoning":
                yield self._event("response.reasoning_text.done", **where, content_index=0, text=block.text)
            else:
                yield self._event("response.function_call_arguments.done", **where, name=block.name,
                                  arguments=block.text)
            yield self._event("response.output_item.done", output_index=block.index, item=item)

    def closing(self, call: Call):
        return ()

    def error(self, exc: Refused) -> str:
        return self._event("error", code=exc.code, message=str(exc), param=exc.param)
