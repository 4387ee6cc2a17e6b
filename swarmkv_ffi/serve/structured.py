"""What a request's output must be, and reading it back: response_format, tools, grammar.

- `response_format` json_object / json_schema: the output is that JSON (grammar.py
  compiles the schema), streamed as it comes, as content.
- `tools` with `tool_choice` "required", a named function or "auto": the model answers in
  one JSON form, llama.cpp's generic one, which any model can be made to write under a
  grammar whatever its template:
      {"tool_calls": [{"name": "lookup", "arguments": {...}}, ...]}
  or, with "auto" only, {"response": "..."} to answer in words. The grammar makes each
  call name a tool the request offers, with arguments valid against that tool's
  `parameters`; `read` turns the JSON into message.tool_calls (with ids made here) or
  content. The tools and this form are told to the model in the system message, so 16
  agents with the same tools and document still share one prefix.
- `grammar` (llama-server's extra): a GBNF or Lark grammar, as content.

A template in another dialect (dialects.py: Hermes' `<tool_call>`) tells the model its
tools itself, and the grammar makes it call them in that form instead, after any words
under "auto"; a thinking template's thoughts are split off the answer either way.

Compiling is bounded (issue 63: a 72 KiB GBNF of 3,000 chained rules took 4.4 s, a 4 MiB
enum 1 GB): a grammar of at most MAX_GRAMMAR_CHARS characters and MAX_GRAMMAR_RULES
rules, a schema (the response format, or the tools' form) of at most MAX_SCHEMA_BYTES as
JSON, each past it a 400 naming the limit; plan() runs on a worker thread (routes.py),
never on the event loop that streams every key's tokens.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from llguidance.gbnf_to_lark import any_to_lark

from .. import grammar as grammars
from . import dialects
from .dialects import CALL_CLOSE, CALL_OPEN, MISTRAL_OPEN, Dialect, Reader, Reply, split_thought
from .errors import Refused

MAX_GRAMMAR_CHARS = 32 << 10
MAX_GRAMMAR_RULES = 1024
MAX_SCHEMA_BYTES = 128 << 10
#: A rule's head: GBNF's `name ::=`, or Lark's `name:` / `?name:` at a line's start.
RULE = re.compile(r"::=|^\s*[?!]?[A-Za-z_][\w.]*(\.\d+)?\s*:(?!:)", re.MULTILINE)

FORM = ('Answer with JSON only: {"tool_calls": [{"name": <a tool\'s name>, "arguments": <its arguments>}]} '
        'to call tools')
FORM_AUTO = FORM + ', or {"response": <your answer>} to answer without them.'


@dataclass
class Structure:
    """grammar: what the output must follow (None: free text). tools: what the system
    message tells the model (None: nothing). enveloped: the output is in the `dialect`'s
    tool-call form (calls or words), read back whole (`read`) or as it streams
    (`reader`). opened: the prompt opens a thought (dialects.opens_thought) the answer
    goes on."""
    grammar: str | None = None
    tools: list[dict] | None = None
    auto: bool = False
    enveloped: bool = False
    response_is_json: bool = False
    parallel: bool = False        # several calls may be made at once
    param: str = "grammar"        # the field the grammar comes from, named when it fails
    compiled: object = None       # grammar.Compiled for the model, once checked (routes.check_grammar)
    dialect: Dialect = Dialect()
    opened: bool = False

    def messages(self, messages: list[dict], template_knows_tools: bool) -> list[dict]:
        """The messages with the tools and the answer form told in the system message
        (a template in a dialect that tells them itself gets them as they are)."""
        if not self.tools or self.dialect.tells_tools:
            return messages
        note = FORM_AUTO if self.auto else FORM + "."
        if not template_knows_tools:
            note = "You can call these tools:\n" + json.dumps(self.tools) + "\n" + note
        if messages and messages[0]["role"] in ("system", "developer"):
            first = dict(messages[0], content=f"{messages[0]['content'] or ''}\n\n{note}")
            return [first] + messages[1:]
        return [{"role": "system", "content": note}] + messages

    def read(self, text: str) -> Reply:
        """The whole answer `text` as its thought, content or tool calls; text that is
        not a whole call (cut by max_tokens or a stop string) stays content."""
        thought = None
        if self.dialect.thinks or self.opened:
            thought, text = split_thought(text, self.opened)
        reply = dialects.read(self.dialect, text) if self.enveloped else Reply(text)
        reply.reasoning = thought
        return reply

    @property
    def shown(self) -> frozenset[int]:
        """Control tokens the answer's text shows (as their text) for the reader: the
        dialect's opener of calls, when the answer may hold calls."""
        return frozenset({self.dialect.opener} if self.enveloped and self.dialect.opener is not None else ())

    def reader(self) -> Reader:
        """A stream's reader of one choice's answer (dialects.Reader)."""
        return Reader(self.dialect, tools=self.enveloped, opened=self.opened)


def plan(body, parallel_default: bool = False, dialect: Dialect = Dialect()) -> Structure:
    """The Structure a request asks for; a 400 naming the field when its parts clash or
    a schema or grammar cannot be compiled (checked against the vocabulary later).

    parallel_tool_calls, when the request leaves it out, is `parallel_default`: whether
    the model's template renders several calls, as llama-server decides it. A model
    taught the calls only by the system message (the generic form) and offered an open
    list of calls tends to repeat one call until max_tokens (SmolLM2 under the Agents
    SDK did), so it is offered one call unless the client asks for more."""
    raw = getattr(body, "grammar", None)
    fmt = getattr(body, "response_format", None)
    tools = getattr(body, "tools", None) or []
    choice = getattr(body, "tool_choice", None)
    if raw is not None:
        if tools or (fmt is not None and fmt.type != "text") or getattr(body, "json_schema", None) is not None:
            raise Refused(400, "grammar cannot be combined with tools or a JSON response_format",
                          "invalid_request_error", "grammar")
        return Structure(grammar=_lark(raw), dialect=dialect)
    if choice is not None and not tools:
        raise Refused(400, "tool_choice is only allowed when tools are specified", None, "tool_choice")
    response = _response_schema(fmt, getattr(body, "json_schema", None))
    if not tools or choice == "none":
        return Structure(grammar=None if response is None else _compile(response, "response_format"),
                         response_is_json=response is not None, param="response_format", dialect=dialect)
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools]
    offered = [t["function"] for t in tool_dicts]
    named = not isinstance(choice, (str, type(None)))
    if named:
        offered = [f for f in offered if f["name"] == choice.function.name]
        if not offered:
            raise Refused(400, f"tool_choice names {choice.function.name!r}, which is not in tools",
                          None, "tool_choice")
    auto = choice in (None, "auto")
    parallel = parallel_default if body.parallel_tool_calls is None else body.parallel_tool_calls
    parallel = parallel and not named
    if dialect.calls == "hermes":
        grammar = hermes_grammar(offered, auto, parallel, response)
    elif dialect.calls == "llama3":
        parallel = False          # the form has one call, as llama.cpp's handler has it
        grammar = llama3_grammar(offered, auto, response)
    elif dialect.calls == "mistral":
        grammar = mistral_grammar(offered, auto, parallel, response, dialect.opener)
    else:
        grammar = _compile(envelope(offered, auto=auto, parallel=parallel, response=response), "tools")
    return Structure(grammar=grammar, tools=tool_dicts, auto=auto, enveloped=True, dialect=dialect,
                     response_is_json=response is not None, parallel=parallel, param="tools")


def llama3_grammar(functions: list[dict], auto: bool, response: dict | None) -> str:
    """The Lark grammar of Llama 3.x's call: the whole answer one JSON object with the
    tool's name and its `parameters`; `auto` also allows words (JSON by `response`, when
    given) that do not open an object."""
    call = _bounded(grammars.json_rule({"anyOf": [_call_schema(f, "parameters") for f in functions]}))
    return _calls_or_words("call", [f"call: {call}"], auto, response, "\\{")


def mistral_grammar(functions: list[dict], auto: bool, parallel: bool, response: dict | None,
                    opener: int | None) -> str:
    """The Lark grammar of Mistral's calls: the whole answer `[TOOL_CALLS]` (the control
    token `opener`, where the vocabulary has it) and a JSON list of one call (or,
    `parallel`, more); `auto` also allows words (JSON by `response`, when given) that do
    not open the calls."""
    call = _bounded(grammars.json_rule({"anyOf": [_call_schema(f) for f in functions]}))
    marker = f"<[{opener}]>" if opener is not None else json.dumps(MISTRAL_OPEN)
    more = ' (", " call)*' if parallel else ""
    rules = [f'calls: {marker} " "? "[" call{more} "]"', f"call: {call}"]
    return _calls_or_words("calls", rules, auto, response, re.escape(MISTRAL_OPEN))


def _calls_or_words(calls: str, rules: list[str], auto: bool, response: dict | None, opens: str) -> str:
    """A grammar whose whole answer is rule `calls` or, `auto`, words (JSON by `response`,
    when given) that do not begin as calls do (the regex `opens`, after any whitespace)."""
    if not auto:
        start = f"start: {calls}"
    elif response is not None:
        start = f"start: {calls} | answer"
        rules = rules + [f"answer: {grammars.json_rule(response)}"]
    else:
        start = f"start: {calls} | WORDS"
        rules = rules + [f"WORDS: /(.|\\n)+/ & ~/\\s*{opens}(.|\\n)*/"]
    return _tools_lark([start] + rules)


def _bounded(rule: str) -> str:
    """A tools grammar's JSON rule, refused past MAX_SCHEMA_BYTES (a 400 naming tools)."""
    _check_size(len(rule), "tools")
    return rule


def _check_size(size: int, param: str) -> None:
    """A schema of `size` bytes as JSON past MAX_SCHEMA_BYTES is a 400 naming `param`."""
    if size > MAX_SCHEMA_BYTES:
        raise Refused(400, f"{param}: the schema is {size} bytes as JSON, over this server's limit of "
                      f"{MAX_SCHEMA_BYTES}", "schema_too_large", param)


def _tools_lark(lines: list[str]) -> str:
    try:
        return grammars.lark("\n".join(lines) + "\n")
    except ValueError as exc:
        raise Refused(400, f"tools: {exc}", "invalid_schema", "tools") from None


def hermes_grammar(functions: list[dict], auto: bool, parallel: bool, response: dict | None) -> str:
    """The Lark grammar of calls in Hermes' form: <tool_call>, a call's JSON object, a
    newline and </tool_call>, once or (`parallel`) more times; `auto` also allows words
    (JSON by `response`, when given) instead, or words before the calls."""
    call = _bounded(grammars.json_rule({"anyOf": [_call_schema(f) for f in functions]}))
    opening, closing = json.dumps(CALL_OPEN + "\n"), json.dumps("\n" + CALL_CLOSE)
    more = f' ("\\n" {opening} call {closing})*' if parallel else ""
    rules = [f"calls: call {closing}{more}", f"call: {call}"]
    if not auto:
        start = f"start: {opening} calls"
    elif response is not None:
        start = f"start: {opening} calls | answer"
        rules.append(f"answer: {grammars.json_rule(response)}")
    else:
        start = "start: WORDS | lead calls"
        rules += [f"lead[lazy]: /(.|\\n)*{re.escape(CALL_OPEN)}\\n/",
                  f"WORDS: /(.|\\n)+/ & ~/(.|\\n)*{re.escape(CALL_OPEN)}(.|\\n)*/"]
    return _tools_lark([start] + rules)


def envelope(functions: list[dict], auto: bool, parallel: bool, response: dict | None = None) -> dict:
    """The JSON schema of the tool-call form: one call (or, `parallel`, one or more) of the
    `functions` offered (OpenAI's function dicts), each with arguments by its parameters;
    `auto` also allows {"response": ...} (by `response`, the response_format's schema)."""
    calls = {"type": "array", "items": {"anyOf": [_call_schema(f) for f in functions]}, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    schema = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]}
    if auto:
        answer = {"type": "object", "properties": {"response": response or {"type": "string"}},
                  "required": ["response"]}
        schema = {"anyOf": [schema, answer]}
    return schema


def _response_schema(fmt, extra: dict | None = None) -> dict | None:
    """The answer's schema: response_format's, or llama-server's `json_schema` field."""
    if extra is not None:
        if fmt is not None and fmt.type != "text":
            raise Refused(400, "json_schema and response_format both set the answer's form: give one",
                          "invalid_request_error", "json_schema")
        return extra
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return fmt.schema_ if fmt.schema_ is not None else {"type": "object"}
    return fmt.json_schema.schema_ or {}


def _call_schema(function: dict, key: str = "arguments") -> dict:
    """One call of `function`: its name, and its parameters under `key`."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: parameters},
            "required": ["name", key]}


def _compile(schema: dict, param: str) -> str:
    _check_size(len(json.dumps(schema)), param)
    try:
        return grammars.json_schema(schema)
    except grammars.GrammarError as exc:
        raise Refused(400, f"{param}: {exc}", "invalid_schema", param) from None


def _lark(text: str) -> str:
    """llama-server's `grammar` is GBNF; Lark is taken too (llguidance's own)."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise Refused(400, f"the grammar is {len(text)} characters, over this server's limit of "
                      f"{MAX_GRAMMAR_CHARS}", "grammar_too_large", "grammar")
    rules = len(RULE.findall(text))
    if rules > MAX_GRAMMAR_RULES:
        raise Refused(400, f"the grammar has {rules} rules, over this server's limit of {MAX_GRAMMAR_RULES}",
                      "grammar_too_large", "grammar")
    try:
        return grammars.lark(any_to_lark(text))
    except Exception as exc:      # the converter and compiler raise their own types
        raise Refused(400, f"the grammar cannot be used: {exc}", "invalid_grammar", "grammar") from None
