"""A chat's messages through the model's own chat template, as llama-server --jinja does.

The GGUF's template (`tokenizer.chat_template`) is a Jinja template written for
transformers; it runs in jinja2's immutable sandbox with the globals transformers gives
it (raise_exception, strftime_now, bos/eos tokens), so a crafted template can read no
file and call no method that changes state. A model without one (the Gemma 3 270M GGUF)
or with one jinja2 cannot run falls back to libllama's built-in templates
(Model.apply_chat_template).

Tool messages: a template that knows tools gets `tools` and the messages as OpenAI sends
them (assistant `tool_calls`, `role: tool`). For one that does not (SmolLM2's, Gemma's),
the messages are rewritten first, as llama.cpp's generic handler and transformers'
polyfills do: an assistant's tool calls become its content, written in the JSON form
the grammar makes the model answer in (structured.py), and a tool's result becomes a
user message saying which tool answered what.

Control tokens (`<|im_start|>`) are read as such only in the template's own text
(`tokens`): written in a message, by a user or a tool, the same characters stay text,
so no message can open a turn of another role. Tokens are otherwise llama-server's
(libllama's tokenizer on the rendered text, special tokens parsed).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import re
import secrets
import threading
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..model import builtin_templates


class TemplateError(ValueError):
    """The conversation cannot be rendered (the template raised, or rejects its shape)."""


@dataclasses.dataclass(frozen=True)
class Builtin:
    """One of libllama's built-in templates, by name (--chat-template llama3): rendered
    by llama_chat_apply_template, text messages only, as llama-server renders it."""
    name: str


def chosen(value: str | None, path=None) -> "str | Builtin | None":
    """The template that replaces the model's own: --chat-template's value (a built-in's
    name, else a Jinja template's text) or --chat-template-file's text; None for the
    model's own. A ValueError says why a value cannot be used."""
    if path is not None:
        return read_file(path)
    if value is None:
        return None
    if value in builtin_templates():
        return Builtin(value)
    if _compiled(value) is None or "{" not in value:
        raise ValueError(f"--chat-template {value[:80]!r}: neither a built-in template "
                         f"({', '.join(builtin_templates())}) nor a Jinja template jinja2 can compile")
    return value


def tokens(model, messages: list[dict], tools: list[dict] | None = None,
           template: "str | Builtin | None" = None, variables: dict | None = None) -> list[int]:
    """The prompt for `messages` as tokens, a control token's text in a message kept as
    text. When no message holds one (nearly always) this is the rendered text tokenized
    with special tokens parsed, as llama-server does; else the text is rendered with each
    message's text between markers only this call knows, and split at the control tokens
    outside them, each piece tokenized as text (llama.cpp splits at the same places).
    `template`: a template instead of the model's own (chosen()); `variables`: the
    template's own variables (render())."""
    controls = control_tokens(model)
    if controls is not None:
        refuse_controls_outside_content(messages, tools, controls[0])
    if controls is None or not any(controls[0].search(t) for t in message_texts(messages)):
        return [int(t) for t in model.tokenize(render(model, messages, tools, template=template, variables=variables),
                                               add_special=True, parse_special=True)]
    nonce = secrets.token_hex(8)
    opening, closing = f"q{nonce}o", f"q{nonce}c"
    marked = render(model, messages, tools, mark=lambda text: opening + text + closing, template=template,
                    variables=variables)
    out = [model.bos] if model.add_bos and model.bos >= 0 else []
    for text, control in _split(marked, opening, closing, controls[0]):
        if text:
            out += [int(t) for t in model.tokenize(text, add_special=False, parse_special=False)]
        if control is not None:
            out.append(controls[1][control])
    return out


def _split(marked: str, opening: str, closing: str, pattern: re.Pattern) -> list[tuple[str, str | None]]:
    """(text, control token's text or None) pieces of the rendered `marked`: split at the
    control tokens outside the markers, the markers taken out."""
    pieces, text, inside = [], [], False
    for part in re.split(f"({re.escape(opening)}|{re.escape(closing)})", marked):
        if part in (opening, closing):
            if inside == (part == opening):
                raise TemplateError("the model's chat template rewrites message text in a way that cannot "
                                    "keep a control token written in a message apart; remove it from the message")
            inside = part == opening
        elif inside:
            text.append(part)
        else:
            at = 0
            for found in pattern.finditer(part):
                text.append(part[at:found.start()])
                pieces.append(("".join(text), found.group()))
                text, at = [], found.end()
            text.append(part[at:])
    if inside:
        raise TemplateError("the model's chat template cut a message's text; remove the control token from it")
    return pieces + [("".join(text), None)]


def refuse_controls_outside_content(messages: list[dict], tools: list[dict] | None, pattern: re.Pattern) -> None:
    """A control token's text in a call's id or name, or in the tools offered, is refused:
    templates render those fields outside the marked text (many by `tojson`, some raw), so
    it would become the control token itself: a forged turn (issue 63)."""
    for where, text in _outside_content(messages, tools):
        if found := pattern.search(text):
            raise TemplateError(f"{where} holds the control token {found.group()!r}; only a message's text "
                                "may carry one (as text)")


def _outside_content(messages: list[dict], tools: list[dict] | None):
    """(field, text) the template renders besides the messages' texts."""
    for i, m in enumerate(messages):
        if isinstance(m.get("tool_call_id"), str):
            yield f"messages.{i}.tool_call_id", m["tool_call_id"]
        for j, call in enumerate(m.get("tool_calls") or []):
            yield f"messages.{i}.tool_calls.{j}.id", str(call.get("id") or "")
            yield f"messages.{i}.tool_calls.{j}.function.name", call["function"]["name"]
    for k, tool in enumerate(tools or []):
        yield f"tools.{k}", json.dumps(tool, ensure_ascii=False)


def message_texts(messages: list[dict]):
    """The text the messages carry: contents, reasoning and tool calls' arguments."""
    for m in messages:
        if isinstance(m.get("content"), str):
            yield m["content"]
        if m.get("reasoning_content"):
            yield m["reasoning_content"]
        for call in m.get("tool_calls") or []:
            yield call["function"]["arguments"]


_VOCABULARIES: dict[str, tuple] = {}
_VOCABULARIES_LOCK = threading.Lock()


def _vocabulary(model) -> tuple:
    """(control tokens as control_tokens() gives them, the most bytes one token spells),
    read once per model file: a control token renders as nothing unless asked for its
    special text."""
    key = str(model.path)
    with _VOCABULARIES_LOCK:
        if key not in _VOCABULARIES:
            texts: dict[str, int] = {}
            longest = 1
            for t in range(model.n_vocab):
                plain, special = model.token_bytes(t), model.token_bytes(t, special=True)
                longest = max(longest, len(plain), len(special))
                if special and not plain:
                    texts.setdefault(special.decode("utf-8", "replace"), t)
            pattern = "|".join(re.escape(x) for x in sorted(texts, key=len, reverse=True))
            _VOCABULARIES[key] = ((re.compile(pattern), texts) if texts else None, longest)
        return _VOCABULARIES[key]


def control_tokens(model) -> tuple[re.Pattern, dict[str, int]] | None:
    """(a pattern matching any control token's text, longest first as llama.cpp tries
    them; text -> token), or None for a vocabulary without one."""
    return _vocabulary(model)[0]


def longest_token(model) -> int:
    """The most characters one token of the model spells: text longer than this times the
    context cannot fit, whatever it says, and need not be tokenized to be refused."""
    return _vocabulary(model)[1]


def render(model, messages: list[dict], tools: list[dict] | None = None, mark=None,
           template: "str | Builtin | None" = None, variables: dict | None = None) -> str:
    """The prompt for `messages` (OpenAI's dicts), ending with the assistant's opener;
    mark(text), if given, wraps each message's text (tokens()); `template`: a template
    instead of the model's own (chosen()); `variables`: more for the
    template (enable_thinking, a request's chat_template_kwargs; add_generation_prompt
    false leaves the assistant's opener out), never one of those render() gives itself
    (a TemplateError names it)."""
    variables = dict(variables or {})
    opener = variables.pop("add_generation_prompt", True)
    messages, continued = continuation(messages, opener, variables.pop("continue_final_message", None))
    if continued is not None:
        opener = True
        continued = mark(continued) if mark is not None else continued
    source = source_of(model, template)
    builtin = template.name if isinstance(template, Builtin) else None
    template = _compiled(source) if source else None
    if template is None or not knows_tools(source):
        messages = plain_messages(messages)
    elif OBJECT_ARGUMENTS.search(source):
        messages = [_object_arguments(m) for m in messages]
    if mark is not None:
        messages = [_marked(m, mark) for m in messages]
    if template is None:
        return model.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                         add_assistant=opener, template=builtin) + (continued or "")
    given = dict(messages=messages, tools=tools if knows_tools(source) else None, add_generation_prompt=opener,
                 bos_token=special_text(model, model.bos), eos_token=special_text(model, model.eos))
    if clash := sorted(set(variables) & set(given)):
        raise TemplateError(f"chat_template_kwargs may not set {', '.join(clash)}: the server renders those")
    try:
        named = functions(given["tools"]) if "functions" in source else {}     # only firefunction's reads it
        return template.render(**{**today(), **named, **variables}, **given) + (continued or "")
    except TemplateError:
        raise
    except Exception as exc:       # whatever the template's own code trips on
        raise TemplateError(f"the model's chat template cannot render these messages: {exc}") from None


def continuation(messages: list[dict], opener: bool, asked: bool | None) -> tuple[list[dict], str | None]:
    """The messages to render and, when the request continues the assistant's last message
    (a prefill), that message's text, which the prompt ends with after the assistant's
    opener (text parts a blank line apart), as llama-server does: by default whenever the
    last message is the assistant's, or as `continue_final_message` (vLLM's and
    transformers' name) says. Refused as there:
    two assistant messages at the end, continuing with the opener also asked for, a message
    with tool calls, or one that is not the assistant's."""
    last = messages[-1] if messages else {}
    if asked is None:
        if last.get("role") != "assistant":
            return messages, None
        if len(messages) >= 2 and messages[-2].get("role") == "assistant":
            raise TemplateError("Cannot have 2 or more assistant messages at the end of the list")
    elif not asked:
        return messages, None
    elif opener:
        raise TemplateError("Cannot set both add_generation_prompt and continue_final_message to true")
    elif last.get("role") != "assistant":
        raise TemplateError("continue_final_message continues the last message, which must be the assistant's")
    if last.get("tool_calls"):
        raise TemplateError("Cannot continue an assistant message that contains tool calls")
    if "content_parts" in last:       # llama.cpp's render_content(): parts of a prefill, a blank line apart
        return messages[:-1], "\n\n".join(last["content_parts"])
    return messages[:-1], last.get("content") or ""


#: a template that writes a call's arguments as JSON itself (Qwen, Hermes, Llama 3.x; Mistral
#: writes the whole function) wants them as an object, as transformers passes them, not
#: OpenAI's JSON text (llama.cpp's chat handler tells the same by rendering both)
OBJECT_ARGUMENTS = re.compile(r"(arguments|function)\s*\|\s*tojson")


def today() -> dict:
    """The date as llama.cpp gives it to every template (Llama 3.x's `date_string`,
    firefunction's `datetime`); a request's chat_template_kwargs may set them."""
    now = datetime.datetime.now()
    return {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y")}


def functions(tools: list[dict] | None) -> dict:
    """firefunction's `functions`, which its template writes into the system prompt: the
    tools as JSON (as llama.cpp and the model's own card give it), empty without tools; a
    request's chat_template_kwargs may set it."""
    return {"functions": json.dumps(tools, indent=2) if tools else ""}


def knows_tools(source: str | None) -> bool:
    """Does the template render tool calls itself? (It names them.)"""
    return bool(source) and "tool_calls" in source


def source_of(model, template: "str | Builtin | None" = None) -> str | None:
    """The Jinja template a chat renders with: `template` (--chat-template's), else the
    GGUF's; None for a built-in one."""
    if isinstance(template, Builtin):
        return None
    return template or model.meta("tokenizer.chat_template")


def shown(model, template: "str | Builtin | None" = None) -> str:
    """The template as /props shows it: its text, or a built-in's name."""
    if isinstance(template, Builtin):
        return template.name
    return source_of(model, template) or model.chat_template or ""


def model_knows_tools(model, template: "str | Builtin | None" = None) -> bool:
    return knows_tools(source_of(model, template))


def read_file(path) -> str:
    """A chat template file's text (--chat-template-file), or a ValueError saying why it
    cannot be used: unreadable, not UTF-8, or not a template jinja2 compiles."""
    try:
        source = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template-file {path}: {exc}") from None
    if _compiled(source) is None:
        raise ValueError(f"--chat-template-file {path}: not a Jinja template jinja2 can compile")
    return source


def plain_messages(messages: list[dict]) -> list[dict]:
    """Messages a tool-less template renders: system, user and assistant, text content."""
    names = {c["id"]: c["function"]["name"] for m in messages for c in (m.get("tool_calls") or [])}
    out = []
    for m in messages:
        if m["role"] == "tool":
            result = {"tool_response": {"tool": names.get(m.get("tool_call_id"), ""), "content": m["content"]}}
            out.append({"role": "user", "content": json.dumps(result)})
        elif m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls})})
        else:
            out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"] or "",
                        **({"reasoning_content": m["reasoning_content"]} if m.get("reasoning_content") else {})})
    return out


def _marked(message: dict, mark) -> dict:
    out = dict(message)
    if isinstance(message.get("content"), str) and message["content"]:
        out["content"] = mark(message["content"])
    if message.get("reasoning_content"):
        out["reasoning_content"] = mark(message["reasoning_content"])
    if message.get("tool_calls"):
        out["tool_calls"] = [dict(c, function=dict(c["function"],
                                                   arguments=_marked_json(c["function"]["arguments"], mark)))
                             for c in message["tool_calls"]]
    return out


def _marked_json(value, mark):
    """Arguments marked: JSON text whole, an object (_object_arguments) in every string,
    keys too, so the template's tojson keeps the markers inside its strings."""
    if isinstance(value, str):
        return mark(value)
    if isinstance(value, dict):
        return {mark(k): _marked_json(v, mark) for k, v in value.items()}
    if isinstance(value, list):
        return [_marked_json(v, mark) for v in value]
    return value


def _object_arguments(message: dict) -> dict:
    """The message with its calls' arguments as objects where they are JSON objects."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for c in message["tool_calls"]:
        arguments = _arguments(c["function"]["arguments"])
        calls.append(dict(c, function=dict(c["function"], arguments=arguments)) if isinstance(arguments, dict) else c)
    return dict(message, tool_calls=calls)


def _arguments(text: str):
    """An assistant's tool-call arguments as JSON, or as the text sent if not JSON."""
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def special_text(model, token: int) -> str:
    """A special token's text (BOS, EOS), or "" when the model has none."""
    return model.token_bytes(token, special=True).decode("utf-8", "replace") if token >= 0 else ""


@lru_cache(maxsize=8)
def _compiled(source: str):
    """The template compiled once per source; None if jinja2 cannot compile it."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                 ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError:
        return None


def _raise(message: str):
    raise TemplateError(message)
