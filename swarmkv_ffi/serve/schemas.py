"""The OpenAI API's shapes that the server takes and gives, as pydantic types.

Requests: every field is either acted on or refused with a 400 naming it (extra="forbid":
a field this server does not act on, such as the legacy `functions`, is refused rather
than silently ignored, so an agent learns at once that it would not get what it asked). The few fields that are metadata by nature (`user`, `metadata`, `store`) are
accepted. Values are checked here, so a bad one is a 400 naming the field before any
work starts.

Responses: chat.completion, chat.completion.chunk, text_completion, the model list and
the error object, as OpenAI writes them: a field OpenAI leaves out when it has nothing
to say (a chunk's `usage` unless the client asked for it, a delta's role) is left out
when it was not given, not sent as null.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from .lineup import keep_alive_seconds

MAX_N = 16
MAX_STOP = 4
#: OpenAI's pattern for a function's name: what a tool, a tool call or a tool choice names.
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
#: Characters in one stop string: an agent's stop marker is a line at most; a longer one
#: only costs the decode thread (issue 63).
MAX_STOP_CHARS = 512
MAX_LOGIT_BIAS = 300            # OpenAI's own limit on logit_bias entries

STRICT = ConfigDict(extra="forbid")


def check_stops(stop):
    """`stop` as OpenAI takes it (a string or a list), held to MAX_STOP strings of at
    most MAX_STOP_CHARS characters each; a ValueError says which limit."""
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop sequences")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"each stop sequence is at most {MAX_STOP_CHARS} characters")
    return stop


def bad_text(body) -> tuple[str, str] | None:
    """The first string in a parsed JSON body that the server cannot tokenize or render
    whole, as (its field's path, why), or None. A NUL would end the text early in a C
    string below (the rest of the message gone without a word); a lone surrogate
    ("\\ud800" is valid JSON) cannot be encoded as UTF-8. Checked on the raw body, once,
    so every field is covered, names and schemas included; walked with a stack, not by
    recursion, so a body nested as deep as the JSON parser allows cannot overflow it."""
    stack = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            why = _text_fault(value)
            if why:
                return path, why
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        inner = []
        for key, item in items:
            if isinstance(key, str) and _text_fault(key):
                return path, _text_fault(key)
            inner.append((f"{path}.{key}" if path else str(key), item))
        stack.extend(reversed(inner))          # (in order: the first fault is the one named)
    return None


def _text_fault(text: str) -> str | None:
    if "\x00" in text:
        return "holds a NUL character (U+0000)"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a lone surrogate: it is not valid Unicode"
    return None


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=TOOL_NAME)       # rendered by the template outside any content (issue 63)
    arguments: str


class ToolCallIn(BaseModel):
    """An assistant's tool call, as a client sends it back in the conversation."""
    model_config = STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """A message the chat template renders (templates.py): role and text, an assistant's
    tool calls and reasoning (llama-server's `reasoning_content`: a thinking model's
    template renders it, others leave it out), a tool's result (role "tool", with the
    call's id)."""
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _tool_fields_in_place(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only an assistant message has reasoning_content")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only one, has a tool_call_id")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        out = {"role": self.role, "content": self.text()}
        if isinstance(self.content, list):      # a prefill's parts join otherwise (templates.continuation)
            out["content_parts"] = [p.text for p in self.content]
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        return out


class FunctionDef(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None          # always kept: arguments follow `parameters` exactly


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_object"]
    schema_: dict[str, Any] | None = Field(None, alias="schema")    # llama-server's: an object by this schema


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field("response", pattern=TOOL_NAME)      # OpenAI requires it; llama-server does not
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None          # always kept: the output follows the schema exactly


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class Sampling(BaseModel):
    """What both endpoints share."""
    model_config = STRICT
    model: str | None = None                                 # optional where one model is served
    max_tokens: int | None = Field(None, ge=1)
    n_predict: int | None = Field(None, ge=-1)               # llama-server's name for max_tokens (-1: none)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)                              # llama-server's and vLLM's extra
    min_p: float = Field(0.0, ge=0.0, lt=1.0)                # as top_k
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repeat_penalty: float = Field(1.0, gt=0.0)               # llama-server's extra
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None                                  # metadata: accepted, not acted on
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    grammar: str | None = None                               # llama-server's extra: GBNF or Lark
    keep_alive: Union[float, str, None] = None               # Ollama's: the model's idle time after this
    verbose: bool | None = None                              # llama-server's: a whole answer's __verbose

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, v):
        return None if v is None else keep_alive_seconds(v)

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        return check_stops(v)

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, v):
        if v is not None:
            if len(v) > MAX_LOGIT_BIAS:
                raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens")
            if any(not -100.0 <= b <= 100.0 for b in v.values()):
                raise ValueError("each bias must be in -100..100")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def predict(self) -> int | None:
        """llama-server's n_predict, where it sets a limit (not -1 or 0)."""
        return self.n_predict if self.n_predict and self.n_predict > 0 else None

    def settings(self, choice: int, max_tokens: int) -> dict:
        """The Sampler's settings for choice `choice`: each choice its own seed, so n > 1
        with a temperature gives n different draws that a seed reproduces. The penalties
        look back over the whole answer (max_tokens), as OpenAI's do."""
        out: dict = {}
        if self.logit_bias:
            out["logit_bias"] = dict(self.logit_bias)
        if self.presence_penalty or self.frequency_penalty or self.repeat_penalty != 1.0:
            out.update(presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                       repeat_penalty=self.repeat_penalty, penalty_last_n=max_tokens)
        if self.temperature == 0:
            return out
        seed = None if self.seed is None else self.seed + choice
        return {**out, "temp": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "seed": seed}

    def vocabulary_ids(self) -> dict[str, list[int]]:
        """Token ids the body names, by field, for the engine to check against its vocabulary."""
        return {"logit_bias": list(self.logit_bias or {})}

    @property
    def usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: Union[TextFormat, JsonObjectFormat, JsonSchemaFormat, None] = Field(None, discriminator="type")
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None     # None: as the template can (structured.plan)
    json_schema: dict[str, Any] | None = None   # llama-server's: response_format json_schema in one field
    timings_per_token: bool = False             # llama-server's: a `timings` object on every chunk
    return_progress: bool = False               # llama-server's: a chunk with `prompt_progress` once it is read
    id_slot: int | None = None                  # llama-server's slot: there are none here, any runs anywhere
    chat_template_kwargs: dict[str, Any] | None = None   # llama-server's and vLLM's: the template's own variables
    add_generation_prompt: bool = True          # llama-server's: false leaves the assistant's opener out
    continue_final_message: bool | None = None  # vLLM's: continue the assistant's last message (None: if last)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens or self.predict()

    def ranked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Sampling):
    """A prompt as OpenAI takes it: a string, a list of strings, a list of token ids, or a
    list of such lists (each prompt gets `n` choices)."""
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    def limit(self) -> int | None:
        if self.max_tokens is not None or self.n_predict is not None:
            return self.max_tokens or self.predict()
        return 16                           # OpenAI's default here

    def ranked(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def vocabulary_ids(self) -> dict[str, list[int]]:
        ids = [t for p in self.prompts() if isinstance(p, list) for t in p]
        return {**super().vocabulary_ids(), "prompt": ids}


# ---- responses ---------------------------------------------------------------------------

class Shape(BaseModel):
    """A response object; the fields in `omit_unset` are left out unless given."""
    omit_unset: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        out = handler(self)
        return {k: v for k, v in out.items() if k not in self.omit_unset or k in self.model_fields_set}


class CachedTokens(Shape):
    cached_tokens: int


class Usage(Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens


class TopLogprob(Shape):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Shape):
    content: list[TokenLogprob]


class FunctionCallOut(Shape):
    name: str
    arguments: str


class ToolCallOut(Shape):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessage(Shape):
    """reasoning_content: a thinking model's thought (dialects.py), as llama-server and
    vLLM name it; only given when the model thought."""
    omit_unset = frozenset({"tool_calls", "reasoning_content"})
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None


class ChatChoice(Shape):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: str


class ChatCompletion(Shape):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[ChatChoice]
    usage: Usage


class FunctionPiece(Shape):
    omit_unset = frozenset({"name", "arguments"})
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallPiece(Shape):
    """One streamed piece of a tool call: the first has its id, type and name; the
    arguments follow (the client joins them by index)."""
    omit_unset = frozenset({"id", "type"})
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionPiece


class Delta(Shape):
    omit_unset = frozenset({"role", "content", "reasoning_content", "tool_calls"})
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCallPiece]] = None


class ChunkChoice(Shape):
    index: int
    delta: Delta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatChunk(Shape):
    omit_unset = frozenset({"usage", "timings", "prompt_progress"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[ChunkChoice]
    usage: Optional[Usage] = None
    timings: Optional[dict] = None     # llama-server's telemetry (timings_per_token)
    prompt_progress: Optional[dict] = None     # ... and return_progress


class CompletionLogprobs(Shape):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Shape):
    index: int
    text: str
    finish_reason: Optional[str]
    logprobs: Optional[CompletionLogprobs]


class Completion(Shape):
    omit_unset = frozenset({"usage"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ModelStatus(Shape):
    """Where the model is, as llama-server's router mode says it (`value`), and why a
    load failed."""
    omit_unset = frozenset({"error"})
    value: Literal["unloaded", "loading", "loaded", "unloading", "failed"]
    pinned: bool = False
    error: Optional[str] = None


class ModelCard(Shape):
    omit_unset = frozenset({"status"})      # the operator's view only (routes.models)
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "swarmkv"
    aliases: list[str] = Field(default_factory=list)   # llama-server's: every id of this model
    tags: list[str] = Field(default_factory=list)      # llama-server's --tags (none here)
    status: Optional[ModelStatus] = None


class ModelList(Shape):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(Shape):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorBody(Shape):
    error: ErrorDetail
