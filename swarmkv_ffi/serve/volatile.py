"""Text that changes on every request at the head of a prompt, dropped before templating.

A prefix cache matches a prompt token by token from the start, so one token that differs
near the top makes everything after it a miss. Claude-Code-style clients open their
system prompt with a billing line whose `cch=` value changes on every request:

    x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;

(alone on its line, or with the prompt's first sentence right after the last `;`). It
tells the model nothing, and left in, every turn of such a conversation would prefill
its whole document again. So a line of that form at the very top of the first system
message is dropped (`--keep-billing-header` keeps it), on every API the server speaks.
docs/serve.md says which other per-request text defeats sharing and what to do about it.
"""
from __future__ import annotations

import re

#: The header and its `key=value;` fields, then spaces and one line break if present.
BILLING_HEADER = re.compile(r"\Ax-anthropic-billing-header:(?:[ \t]*[A-Za-z0-9_.-]+=[^;\n]*;)*[ \t]*(?:\r?\n)?")


def drop_billing_header(text: str) -> str:
    """`text` without a billing header at its very start (else as it is)."""
    return BILLING_HEADER.sub("", text, count=1)


def steady(messages: list[dict]) -> list[dict]:
    """The messages (OpenAI's dicts, as the template takes them) with the first one's
    billing header dropped when it is a system or developer message."""
    if not messages or messages[0].get("role") not in ("system", "developer"):
        return messages
    first = messages[0]
    content = first.get("content")
    if not isinstance(content, str) or not content.startswith("x-anthropic-billing-header:"):
        return messages
    return [dict(first, content=drop_billing_header(content))] + messages[1:]
