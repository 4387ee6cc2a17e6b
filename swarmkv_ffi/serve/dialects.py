"""How a model family writes tool calls and thoughts, told by its chat template (as
llama.cpp's chat parser tells it: by the markers the template names).

- Generic (any template): the tool-call JSON form structured.py describes,
      {"tool_calls": [{"name": "lookup", "arguments": {...}}]}   or   {"response": "..."}
  told to the model in the system message.
- Hermes (Qwen 2.5 and 3, Hermes 2/3, and other templates that name `<tool_call>`): the
  template tells the tools itself, and the model calls them after any words as
      <tool_call>
      {"name": "lookup", "arguments": {...}}
      </tool_call>
- Llama 3.x (templates with an `ipython` turn): the template tells the tools, and the
  model answers either in words or with one call, the whole answer
      {"name": "lookup", "parameters": {...}}
- Mistral (templates that name `[TOOL_CALLS]`: Mistral 7B v0.3, Nemo, Small 3.x): the
  template tells the tools, and the model answers either in words or with its calls, the
  whole answer
      [TOOL_CALLS][{"name": "lookup", "arguments": {...}}, ...]
  `[TOOL_CALLS]` is a control token of their vocabulary: the grammar makes the model
  write that token (not its text), and the stream shows it as text for the reader. Call
  ids are nine letters and digits, the only ids these templates accept.
- Thoughts: a template that names `<think>` or `</think>` (Qwen3, QwQ, DeepSeek R1 and its distills)
  marks a thinking model; what it writes between <think> and </think> (or from the start
  of its answer to </think>, when the prompt itself opens the thought) is the message's
  reasoning_content, not its content, as llama-server's default `--reasoning-format`
  splits it.

Two ways to read an answer: `read` (whole, strict: a call cut short stays text) and a
`Reader` fed the text as it is generated, which yields `Part`s — words, thoughts, a call
opened by name, a piece of a call's arguments — so a stream sends a call's arguments as
they are written, not at the end.
"""
from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN = "[TOOL_CALLS]"
#: the start of a call object in either form, name first, as the grammars write it
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
LLAMA3_MARK = "<|start_header_id|>ipython<|end_header_id|>"   # the tool results' turn, as llama.cpp detects it
HEAD_MAX = 200          # characters past which a call's name is no longer looked for
ENVELOPE = '{"tool_calls": ['   # the generic form's opening, as its grammar writes it


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str          # JSON text, as OpenAI sends it


@dataclass
class Reply:
    """An answer read back: its content, the tools it calls, its thoughts."""
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None


@dataclass
class Part:
    """A piece of an answer as it streams: kind "content" or "reasoning" (text), "call"
    (a call opens: index, id, name in text) or "arguments" (more of call `index`'s)."""
    kind: str
    text: str
    index: int = 0
    id: str = ""


def call_id(calls: str = "generic") -> str:
    """A new call's id: OpenAI's shape, or nine letters and digits for Mistral's templates
    (which raise on any other)."""
    if calls == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Dialect:
    """A template's tool-call form ("generic", "hermes", "llama3" or "mistral") and
    whether it thinks. opener: the vocabulary's control token that opens the calls
    (Mistral's `[TOOL_CALLS]`), None where the form's marker is plain text."""
    calls: str = "generic"
    thinks: bool = False
    opener: int | None = None

    @property
    def tells_tools(self) -> bool:
        """Does the template tell the model the tools and their form itself?"""
        return self.calls != "generic"

    def with_vocabulary(self, controls: dict[str, int]) -> "Dialect":
        """This dialect for a vocabulary whose control tokens are `controls` (text -> id):
        Mistral's opener is the token where the vocabulary has one."""
        if self.calls != "mistral":
            return self
        return dataclasses.replace(self, opener=controls.get(MISTRAL_OPEN))


def detect(source: str | None) -> Dialect:
    """The dialect of a chat template's source (None: libllama's built-in, generic). A
    template names its call form only where it also renders calls (`tool_calls`), as
    templates.knows_tools asks: one that does not is told the generic form instead."""
    source = source or ""
    renders = "tool_calls" in source
    calls = "generic"
    if renders and CALL_OPEN in source:
        calls = "hermes"
    elif renders and LLAMA3_MARK in source:
        calls = "llama3"
    elif renders and MISTRAL_OPEN in source and "[ARGS]" not in source:   # not Ministral 3's name[ARGS]{...}
        calls = "mistral"
    return Dialect(calls=calls,
                   thinks=THINK_OPEN in source or THINK_CLOSE in source)


def opens_thought(prompt_tail: str) -> bool:
    """Does a rendered prompt (its last characters) leave a thought open for the answer?"""
    return prompt_tail.rfind(THINK_OPEN) > prompt_tail.rfind(THINK_CLOSE)


# ---- whole answers ------------------------------------------------------------------------

def split_thought(text: str, opened: bool) -> tuple[str | None, str]:
    """(the thought, the rest) of an answer; opened: the prompt opened the thought."""
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return None, text
        text = stripped[len(THINK_OPEN):]
    thought, closed, rest = text.partition(THINK_CLOSE)
    return (thought.strip(), rest.lstrip()) if closed else (thought.strip(), "")


def read_generic(text: str) -> Reply:
    """The JSON form as calls or words; text that is not the whole form stays content."""
    try:
        answer = json.loads(text)
    except ValueError:
        return Reply(text)
    if not isinstance(answer, dict):
        return Reply(text)
    if "tool_calls" in answer:
        return Reply(None, [ToolCall(call_id(), c["name"], json.dumps(c["arguments"])) for c in answer["tool_calls"]])
    response = answer.get("response")
    return Reply(response if isinstance(response, str) else json.dumps(response))


def read_llama3(text: str) -> Reply:
    """One call as the whole answer, or words."""
    try:
        call = json.loads(text)
        return Reply(None, [ToolCall(call_id(), call["name"], json.dumps(call["parameters"]))])
    except (ValueError, KeyError, TypeError):
        return Reply(text)


def read_mistral(text: str) -> Reply:
    """[TOOL_CALLS] and a list of calls as the whole answer, or words."""
    stripped = text.strip()
    if not stripped.startswith(MISTRAL_OPEN):
        return Reply(text)
    try:
        calls = json.loads(stripped[len(MISTRAL_OPEN):])
        return Reply(None, [ToolCall(call_id("mistral"), c["name"], json.dumps(c["arguments"])) for c in calls])
    except (ValueError, KeyError, TypeError):
        return Reply(text)


def read(dialect: Dialect, text: str) -> Reply:
    """A whole answer in the dialect's call form."""
    return {"hermes": read_hermes, "llama3": read_llama3, "mistral": read_mistral}.get(
        dialect.calls, read_generic)(text)


def read_hermes(text: str) -> Reply:
    """Words, then <tool_call> blocks; a block cut short or not JSON leaves it all text."""
    head, opened, rest = text.partition(CALL_OPEN)
    if not opened:
        return Reply(text)
    calls = []
    for block in (CALL_OPEN + rest).split(CALL_OPEN)[1:]:
        body, closed, after = block.partition(CALL_CLOSE)
        try:
            call = json.loads(body)
            calls.append(ToolCall(call_id(), call["name"], json.dumps(call["arguments"])))
        except (ValueError, KeyError, TypeError):
            return Reply(text)
        if not closed or after.strip():
            return Reply(text)
    return Reply(head.strip() or None, calls)


# ---- answers as they stream ---------------------------------------------------------------

def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (kept until the next
    piece tells whether they do)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class CallScanner:
    """One call object, `{"name": ..., "arguments": {...}}`, read as it comes: the call
    opens once its name is read, its arguments go out as written, and `feed` returns the
    text past the object's end once it has one. A call whose arguments come before its
    name (no grammar made the model write it our way) is sent whole at its end."""

    def __init__(self, index: int, calls: str = "generic"):
        self.index, self.id = index, call_id(calls)
        self.text, self.at = "", 0
        self.depth, self.in_string, self.escaped = 0, False, False
        self.args_from: int | None = None       # where the arguments begin, once the name is read
        self.args_end: int | None = None
        self.sent = 0                           # of text, arguments sent up to here

    def feed(self, piece: str) -> tuple[list[Part], str | None]:
        """(parts, the text after the object or None while it goes on)."""
        self.text += piece
        parts, end = [], None
        while self.at < len(self.text) and end is None:
            i, ch = self.at, self.text[self.at]
            end = self._step(ch)
            self.at += 1
            if self.args_from is None and i <= HEAD_MAX and not ch.isspace() and (m := HEAD.fullmatch(self.text, 0, i)):
                self.args_from = self.sent = i
                parts.append(Part("call", json.loads(f'"{m.group(1)}"'), self.index, self.id))
        if self.args_from is not None:
            stop = self.args_end if self.args_end is not None else self.at
            if stop > self.sent:
                parts.append(Part("arguments", self.text[self.sent:stop], self.index))
                self.sent = stop
        if end is None:
            return parts, None
        rest, self.text = self.text[end:], self.text[:end]
        return parts + self._whole(), rest

    def _step(self, ch: str) -> int | None:
        """Track strings and nesting; the object's end offset when `ch` closes it."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return None
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.args_from is not None and self.args_end is None and self.depth == 1:
                self.args_end = self.at + 1
            if self.depth == 0:
                return self.at + 1
        return None

    def _whole(self) -> list[Part]:
        """A call never opened by name: open it now from the whole object, if it is one."""
        if self.args_from is not None:
            return []
        try:
            call = json.loads(self.text)
            return [Part("call", call["name"], self.index, self.id),
                    Part("arguments", json.dumps(call.get("arguments", call.get("parameters"))), self.index)]
        except (ValueError, KeyError, TypeError):
            return [Part("content", self.text)]


class Reader:
    """An answer's text, fed as generated, as Parts: thoughts split off first (when the
    dialect thinks), then the rest read by the dialect's call form. `finish` sends what
    was held back (a marker's first characters that never became one)."""

    def __init__(self, dialect: Dialect, tools: bool, opened: bool = False):
        self.dialect, self.tools = dialect, tools
        self.thought = "open" if opened else ("maybe" if dialect.thinks else "none")
        self.thought_said = False  # a piece of the thought has gone out
        self.pending = ""          # text held back: a marker may be forming
        self.state = "text"        # where the calls' reading is (text, call, after, words, envelope, ...)
        self.scanner: CallScanner | None = None
        self.n_calls = 0
        self.whole = ""            # every answer character past the thought (the generic form's fallback)

    def feed(self, text: str) -> list[Part]:
        self.pending += text
        out: list[Part] = []
        if self.thought != "none":
            self._thoughts(out)
        if self.thought == "none":
            rest, self.pending = self.pending, ""
            self._answer(rest, out)
        return [p for p in out if p.text or p.kind == "call"]

    def finish(self) -> list[Part]:
        out: list[Part] = []
        rest, self.pending = self.pending, ""
        if self.thought == "open":
            out.append(Part("reasoning", self._thought(rest.rstrip())))
            return [p for p in out if p.text]
        if self.thought in ("maybe", "closed"):
            self.thought = "none"
        if self.state == "text" or not self.tools:
            out.append(Part("content", rest if rest.strip() or not self.n_calls else ""))
        elif self.state in ("envelope", "held"):
            self.whole += rest
            reply = read_generic(self.whole)
            out += [Part("content", reply.content or "")] if not reply.tool_calls else \
                [p for i, c in enumerate(reply.tool_calls)
                 for p in (Part("call", c.name, i, c.id), Part("arguments", c.arguments, i))]
        return [p for p in out if p.text]

    def _thoughts(self, out: list[Part]) -> None:
        """Split the thought off the pending text: while it may still begin ("maybe"),
        while it is open, and once closed ("closed") pass on to the answer."""
        if self.thought == "maybe":
            stripped = self.pending.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.pending, self.thought = stripped[len(THINK_OPEN):], "open"
            elif not stripped or THINK_OPEN.startswith(stripped):
                return
            else:
                self.thought = "none"
                return
        if self.thought == "closed":          # the answer starts past the whitespace
            self.pending = self.pending.lstrip()
            if self.pending:
                self.thought = "none"
            return
        before, closed, after = self.pending.partition(THINK_CLOSE)
        if closed:
            out.append(Part("reasoning", self._thought(before.rstrip())))
            self.pending, self.thought = after, "closed"
            self._thoughts(out)
            return
        keep = held_back(self.pending, THINK_CLOSE)
        text = self.pending[:len(self.pending) - keep]
        said = text.rstrip()                  # whitespace held: it may be the thought's last
        out.append(Part("reasoning", self._thought(said)))
        self.pending = self.pending[len(said):]

    def _thought(self, text: str) -> str:
        """A piece of the thought, its leading whitespace dropped as the whole read strips it."""
        if not self.thought_said:
            text = text.lstrip()
            self.thought_said = bool(text)
        return text

    def _answer(self, text: str, out: list[Part]) -> None:
        if not self.tools:
            out.append(Part("content", text))
        elif self.dialect.calls == "hermes":
            self._hermes(text, out)
        elif self.dialect.calls == "llama3":
            self._llama3(text, out)
        elif self.dialect.calls == "mistral":
            self._mistral(text, out)
        else:
            self._generic(text, out)

    def _llama3(self, text: str, out: list[Part]) -> None:
        """A call object from the first character, else words."""
        if self.state == "text":
            if not text.strip():
                self.pending = text
                return
            if text.lstrip().startswith("{"):
                self._open_call()
            else:
                self.state = "words"
        if self.state == "words":
            out.append(Part("content", text))
        elif self.state == "call":
            self._scan(text, out, then="done")

    def _mistral(self, text: str, out: list[Part]) -> None:
        """[TOOL_CALLS] from the first character, then a list of calls; else words."""
        if self.state == "text":
            stripped = text.lstrip()
            if not stripped.startswith(MISTRAL_OPEN):
                if not stripped or MISTRAL_OPEN.startswith(stripped):
                    self.pending = text
                    return
                self.state = "words"
            else:
                self.state, text = "list", stripped[len(MISTRAL_OPEN):]
        if self.state == "words":
            out.append(Part("content", text))
            return
        if self.state == "list":
            text = text.lstrip()
            if not text:
                return
            self.state, text = ("between", text[1:]) if text.startswith("[") else ("held_done", "")
        self._calls(text, out)

    def _calls(self, text: str, out: list[Part]) -> None:
        """Calls in a JSON list, past its `[`: each call streamed, the list's end (or
        anything not a call) ends the reading."""
        while text:
            if self.state == "between":
                text = text.lstrip(" \n,")
                if text.startswith("{"):
                    self._open_call()
                elif text:
                    self.state = "held_done"
                    return
            elif self.state == "call":
                text = self._scan(text, out, then="between")
            else:
                return

    def _open_call(self) -> None:
        self.scanner, self.state = CallScanner(self.n_calls, self.dialect.calls), "call"
        self.n_calls += 1

    def _scan(self, text: str, out: list[Part], then: str) -> str | None:
        """Feed the open call; the text past its end (the state then `then`), or None
        while it goes on."""
        parts, rest = self.scanner.feed(text)
        out += parts
        if rest is not None:
            self.state = then
        return rest

    def _hermes(self, text: str, out: list[Part]) -> None:
        """Words until <tool_call>, a call object, its </tool_call>, and so on."""
        while text:
            if self.state == "text":
                before, opened, after = text.partition(CALL_OPEN)
                if not opened:
                    keep = held_back(text, CALL_OPEN)
                    if self.n_calls and not text[:len(text) - keep].strip():
                        keep = len(text)       # only whitespace between calls so far: not words yet
                    out.append(Part("content", text[:len(text) - keep]))
                    self.pending = text[len(text) - keep:]
                    return
                out.append(Part("content", before if before.strip() or not self.n_calls else ""))
                self._open_call()
                text = after
            elif self.state == "call":
                text = self._scan(text, out, then="after")
            else:                          # after a call: its closing tag, then words or more calls
                stripped = text.lstrip()
                if stripped.startswith(CALL_CLOSE):
                    text, self.state = stripped[len(CALL_CLOSE):], "text"
                elif CALL_CLOSE.startswith(stripped):
                    self.pending = text
                    return
                else:
                    self.state = "text"

    def _generic(self, text: str, out: list[Part]) -> None:
        """{"tool_calls": [ call, call ]}: each call streamed; {"response": ...} and text
        not in the form are held to the end (finish)."""
        self.whole += text
        if self.state == "text":
            self.state = "envelope"
            text = self.whole
        if self.state == "envelope":
            if not self.whole.startswith(ENVELOPE):
                if not ENVELOPE.startswith(self.whole):
                    self.state = "held"
                return
            self.state, text = "between", self.whole[len(ENVELOPE):]
        self._calls(text, out)


@dataclass
class Block:
    """One block of a streamed answer: kind "content", "reasoning" or "call"; its text so
    far (a call's: its arguments); `id` and `name` a call's."""
    index: int
    kind: str
    id: str = ""
    name: str = ""
    text: str = ""


class Blocks:
    """An answer's parts as the blocks the Responses and Messages APIs stream (a thought,
    words, each call, in the order written): a part of another kind, or a new call, closes
    the open block and opens the next. Events: ("open", block), ("delta", block, text),
    ("close", block)."""

    def __init__(self):
        self.blocks: list[Block] = []
        self.open: Block | None = None

    def feed(self, parts: list[Part]) -> list[tuple]:
        out = []
        for p in parts:
            kind = "call" if p.kind == "arguments" else p.kind
            if p.kind == "call" or self.open is None or self.open.kind != kind:
                out += self.close()
                self.open = Block(len(self.blocks), kind, p.id, p.text if p.kind == "call" else "")
                self.blocks.append(self.open)
                out.append(("open", self.open))
                if p.kind == "call":
                    continue
            self.open.text += p.text
            out.append(("delta", self.open, p.text))
        return out

    def close(self) -> list[tuple]:
        block, self.open = self.open, None
        return [] if block is None else [("close", block)]

    def reply(self) -> Reply:
        """The answer the blocks streamed, as a whole answer (what a stream's last event
        and a stored response hold)."""
        calls = [ToolCall(b.id, b.name, b.text) for b in self.blocks if b.kind == "call"]
        words = "".join(b.text for b in self.blocks if b.kind == "content")
        thought = "".join(b.text for b in self.blocks if b.kind == "reasoning")
        return Reply(words or (None if calls else ""), calls, thought or None)
