"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the chat engine.

As with the Responses API (openai_responses.py), a Messages request is read
(`MessagesRequest`: every field acted on or refused with a 400 naming it), turned into
the one internal request type, a chat completion request (`to_chat`), and run as chat
completions run; `MessagesShape` writes the answer as a `message` with content blocks,
or as the events the `anthropic` SDK reads (`event:` lines: message_start,
content_block_start, content_block_delta with text_delta, thinking_delta or
input_json_delta as the answer is generated, content_block_stop, message_delta with
stop_reason and usage, message_stop, ping).

Usage follows Anthropic's split: `input_tokens` are the prompt tokens not read from
cache, `cache_read_input_tokens` those forked from the key's cached cells (or restored
from host RAM or disk), `cache_creation_input_tokens` 0 (every prompt is kept as cache
here, and nothing is charged for writing it). Their sum is what `count_tokens` says.

Errors take Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`):
errors.py writes it for every route under /v1/messages.
"""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from .calls import Call, Choice
from .dialects import Blocks, Part, Reader
from .errors import Refused, anthropic_error_body, validated
from .openai_responses import Unsupported
from .responses import sse_event
from .schemas import MAX_STOP, ChatRequest

#: cache_control, citations: hints about Anthropic's own cache and citations, accepted on
#: any block (this server caches every prefix anyway).
BLOCK = ConfigDict(extra="forbid")

class TextBlock(BaseModel):
    model_config = BLOCK
    type: Literal["text"]
    text: str
    cache_control: dict | None = None
    citations: list | None = None


class ToolUseBlock(BaseModel):
    model_config = BLOCK
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict | None = None


class ToolResultBlock(BaseModel):
    model_config = BLOCK
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[Annotated[Union[Annotated[TextBlock, Tag("text")],
                                             Annotated[Unsupported, Tag("unsupported")]],
                                       Discriminator(lambda v: "text" if isinstance(v, dict) and v.get("type") == "text"
                                                     else "unsupported")]], None] = None
    is_error: bool | None = None
    cache_control: dict | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(BaseModel):
    """An earlier answer's thinking, sent back: the assistant message's reasoning_content,
    which a thinking model's template renders where it belongs (and drops from earlier
    turns, as Anthropic does) and other templates leave out, as llama-server does."""
    model_config = BLOCK
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


def _block_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("thinking", "redacted_thinking"):
        return "thinking"
    return kind if kind in ("text", "tool_use", "tool_result") else "unsupported"


Block = Annotated[Union[Annotated[TextBlock, Tag("text")], Annotated[ToolUseBlock, Tag("tool_use")],
                        Annotated[ToolResultBlock, Tag("tool_result")], Annotated[ThinkingBlock, Tag("thinking")],
                        Annotated[Unsupported, Tag("unsupported")]], Discriminator(_block_kind)]


class Message(BaseModel):
    model_config = BLOCK
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class Tool(BaseModel):
    """A client tool. Anthropic's server tools (bash, web search, ...) carry a `type` of
    their own and are refused: this server runs none."""
    model_config = BLOCK
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, value):
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"{kind!r} is one of Anthropic's server tools, which this server does not run; "
                             "give a client tool (name, description, input_schema)")
        return value


class ToolChoice(BaseModel):
    model_config = BLOCK
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    """Extended thinking: a thinking model's template gets enable_thinking by its type
    (Qwen3's and DeepSeek R1's then think or close the thought at once); its thought is
    the answer's first block. `budget_tokens` is accepted and not enforced."""
    model_config = BLOCK
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)


class JsonOutput(BaseModel):
    model_config = BLOCK
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Structured output: the answer is JSON following `format.schema`, under the grammar."""
    model_config = BLOCK
    format: JsonOutput | None = None


class Metadata(BaseModel):
    model_config = BLOCK
    user_id: str | None = None


class CountTokensRequest(BaseModel):
    """What a prompt is made of: the fields of `count_tokens`, and of a message request."""
    model_config = BLOCK
    model: str | None = None
    messages: list[Message]
    system: Union[str, list[TextBlock], None] = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    """The fields of `POST /v1/messages` this server acts on; any other is a 400."""
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP)
    stream: bool = False
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    cache_control: dict | None = None                  # every prefix is cached anyway, per key
    keep_alive: Union[float, str, None] = None         # Ollama's, as on chat completions


def system_text(system) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    return "\n".join(b.text for b in system if b.text) or None


def conversation(body: CountTokensRequest) -> list[dict]:
    """The system prompt and messages as chat messages (OpenAI's dicts): tool_use blocks
    become the assistant's tool_calls, each tool_result a tool message (before the user's
    own text, as Anthropic orders them); thinking blocks the assistant's reasoning_content
    (redacted thinking, opaque, is dropped)."""
    text = system_text(body.system)
    out = [{"role": "system", "content": text}] if text else []
    for m in body.messages:
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        said = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if m.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            thought = "".join(b.thinking or "" for b in blocks if isinstance(b, ThinkingBlock) and b.type == "thinking")
            out.append({"role": "assistant", "content": said or None, **({"tool_calls": calls} if calls else {}),
                        **({"reasoning_content": thought} if thought else {})})
            continue
        out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                for b in blocks if isinstance(b, ToolResultBlock)]
        if said or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append({"role": "user", "content": said})
    if not any(m["role"] != "system" for m in out):
        out.append({"role": "user", "content": ""})     # llama-server answers an empty list too
    return out


def to_chat(body: CountTokensRequest, model: str) -> ChatRequest:
    """The chat request this Messages request (or count_tokens' body) runs as."""
    chat: dict[str, Any] = dict(model=model, messages=conversation(body))
    if isinstance(body, MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stop=body.stop_sequences, stream=body.stream,
                    temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, keep_alive=body.keep_alive)
        if body.output_config is not None and body.output_config.format is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": body.output_config.format.schema_}}
    if getattr(body, "thinking", None) is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": body.thinking.type == "enabled"}
    choice = body.tool_choice
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                           **({"description": t.description} if t.description else {})}}
                         for t in body.tools]
        if choice is not None and choice.disable_parallel_tool_use is not None:
            chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if choice is not None and (body.tools or choice.type != "none"):
        if choice.type == "tool" and not choice.name:
            raise Refused(400, "tool_choice: a choice of type 'tool' names the tool", None, "tool_choice.name")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
    return validated(ChatRequest, chat)


STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


class MessagesShape:
    """A call's one choice as Anthropic's `message`, whole or as its stream of events."""

    def __init__(self, model: str):
        self.model, self.id = model, f"msg_{uuid.uuid4().hex[:24]}"
        self._read: Reader | None = None     # a stream's reader of the answer, and its blocks
        self._stream = Blocks()

    def _usage(self, call: Call) -> dict:
        u = call.usage()
        cached = u.prompt_tokens_details.cached_tokens
        return {"input_tokens": u.prompt_tokens - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": u.completion_tokens}

    @staticmethod
    def _stop(choice: Choice, reply) -> tuple[str, str | None]:
        reason = STOP_REASONS[choice.finish_reason(reply)]
        if reason == "end_turn" and choice.text.stopped:
            return "stop_sequence", choice.text.stop_string
        return reason, None

    @staticmethod
    def _blocks(reply) -> list[dict]:
        """A thought (a thinking model's, dialects.py) first, then the words, then the calls."""
        blocks = [{"type": "thinking", "thinking": reply.reasoning, "signature": ""}] if reply.reasoning else []
        if reply.content or not reply.tool_calls:
            blocks.append({"type": "text", "text": reply.content or ""})
        for t in reply.tool_calls:
            blocks.append({"type": "tool_use", "id": f"toolu_{t.id.removeprefix('call_')}", "name": t.name,
                           "input": json.loads(t.arguments)})
        return blocks

    def whole(self, call: Call) -> dict:
        choice = call.choices[0]
        reply = call.structure.read(choice.text.sent)
        reason, sequence = self._stop(choice, reply)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self._blocks(reply), "stop_reason": reason, "stop_sequence": sequence,
                "usage": self._usage(call)}

    def opening(self, call: Call):
        prompt = sum(len(p) for p in call.prompts)
        usage = {"input_tokens": prompt, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                 "output_tokens": 0}
        yield sse_event("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}})
        yield sse_event("ping", {"type": "ping"})

    def piece(self, call: Call, choice: Choice, text: str):
        """The blocks as the reader splits the answer (dialects.Blocks): a thinking block,
        text, each tool_use, each started when its first part is generated."""
        if text:
            for event in self._stream.feed(self._reader(call).feed(text)):
                yield from self._streamed(event)

    def _reader(self, call: Call) -> Reader:
        if self._read is None:
            self._read = call.structure.reader()
        return self._read

    def ending(self, call: Call, choice: Choice):
        events = self._stream.feed(self._reader(call).finish())
        if not self._stream.blocks:              # nothing said: an empty text block
            events += self._stream.feed([Part("content", "")])
        for event in events + self._stream.close():
            yield from self._streamed(event)
        reason, sequence = self._stop(choice, self._stream.reply())
        usage = self._usage(call)
        yield sse_event("message_delta", {"type": "message_delta", "usage": usage,
                                          "delta": {"stop_reason": reason, "stop_sequence": sequence}})
        yield sse_event("message_stop", {"type": "message_stop"})

    @staticmethod
    def _streamed(event: tuple):
        """The Messages events of one block event: content_block_start, _delta, _stop."""
        what, block = event[0], event[1]
        if what == "open":
            started = {"content": {"type": "text", "text": ""}, "reasoning": {"type": "thinking", "thinking": ""},
                       "call": {"type": "tool_use", "id": f"toolu_{block.id.removeprefix('call_')}",
                                "name": block.name, "input": {}}}[block.kind]
            yield sse_event("content_block_start", {"type": "content_block_start", "index": block.index,
                                                    "content_block": started})
        elif what == "delta":
            delta = {"content": {"type": "text_delta", "text": event[2]},
                     "reasoning": {"type": "thinking_delta", "thinking": event[2]},
                     "call": {"type": "input_json_delta", "partial_json": event[2]}}[block.kind]
            yield sse_event("content_block_delta", {"type": "content_block_delta", "index": block.index,
                                                    "delta": delta})
        else:
            yield sse_event("content_block_stop", {"type": "content_block_stop", "index": block.index})

    def closing(self, call: Call):
        return ()

    def error(self, exc: Refused) -> str:
        return sse_event("error", anthropic_error_body(exc.status, str(exc)))

