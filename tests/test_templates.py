"""Chat templates (serve/templates.py) on the real SmolLM2 model: a tool loop rendered
through a template that does not know tools (the call and its result become text the
model reads), one that does (it gets `tools` and the messages as OpenAI sends them), the
built-in fallback, and a crafted template that the sandbox stops."""
from __future__ import annotations

import json

import pytest

from swarmkv_ffi.serve import templates

CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup_section", "arguments": '{"section": 2}'}}
LOOP = [{"role": "user", "content": "What does section 2 say?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Grant of Copyright License"}]
TOOLS = [{"type": "function", "function": {"name": "lookup_section", "parameters": {"type": "object"}}}]


class WithTemplate:
    """The real model, its chat template replaced (None: the GGUF has none)."""

    def __init__(self, model, source: str | None):
        self._model, self._source = model, source

    def meta(self, key: str):
        return self._source if key == "tokenizer.chat_template" else self._model.meta(key)

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_a_tool_loop_through_a_template_without_tools(smol):
    text = templates.render(smol, LOOP, TOOLS)
    assert '{"tool_calls": [{"name": "lookup_section", "arguments": {"section": 2}}]}' in text
    assert json.dumps({"tool_response": {"tool": "lookup_section", "content": "Grant of Copyright License"}}) in text
    assert text.index("section 2 say") < text.index("tool_calls") < text.index("tool_response")
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_that_knows_tools_gets_them_as_sent(smol):
    source = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
              "{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}"
              "{{ m.tool_calls[0].function.arguments }}{% else %}{{ m.content }}{% endif %}"
              "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<assistant>{% endif %}")
    text = templates.render(WithTemplate(smol, source), LOOP, TOOLS)
    assert text == ('[tool lookup_section]<user>What does section 2 say?<assistant>lookup_section{"section": 2}'
                    '<tool>Grant of Copyright License#call_1<assistant>')


def test_a_model_without_a_template_uses_libllamas_built_in(smol):
    text = templates.render(WithTemplate(smol, None), LOOP, TOOLS)
    assert "tool_response" in text and "Grant of Copyright License" in text


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",            # reach Python's classes
    "{{ messages.append(1) }}",                                   # change the request's state
    "{{ raise_exception('this template refuses tool turns') }}",  # the template's own refusal
])
def test_a_crafted_or_refusing_template_is_a_template_error(smol, source):
    with pytest.raises(templates.TemplateError):
        templates.render(WithTemplate(smol, source), LOOP, TOOLS)
