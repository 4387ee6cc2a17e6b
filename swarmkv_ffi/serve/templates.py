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
"""
from __future__ import annotations

import datetime
import json
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The conversation cannot be rendered (the template raised, or rejects its shape)."""


def render(model, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt for `messages` (OpenAI's dicts), ending with the assistant's opener."""
    source = model.meta("tokenizer.chat_template")
    template = _compiled(source) if source else None
    if template is None or not knows_tools(source):
        messages = plain_messages(messages)
    if template is None:
        return model.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages])
    try:
        return template.render(messages=messages, tools=tools if knows_tools(source) else None,
                               add_generation_prompt=True, bos_token=_special(model, model.bos),
                               eos_token=_special(model, model.eos))
    except TemplateError:
        raise
    except Exception as exc:       # whatever the template's own code trips on
        raise TemplateError(f"the model's chat template cannot render these messages: {exc}") from None


def knows_tools(source: str | None) -> bool:
    """Does the template render tool calls itself? (It names them.)"""
    return bool(source) and "tool_calls" in source


def model_knows_tools(model) -> bool:
    return knows_tools(model.meta("tokenizer.chat_template"))


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
            out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"] or ""})
    return out


def _arguments(text: str):
    """An assistant's tool-call arguments as JSON, or as the text sent if not JSON."""
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def _special(model, token: int) -> str:
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
