"""`swarmkv serve` as a user starts it: a subprocess on a free loopback port, and the
official `openai` client pointed at it."""
from __future__ import annotations

import sys
from pathlib import Path

from swarmkv_ffi.bench import servers
from swarmkv_ffi.bench.peer import HttpServer

MODEL = "smollm2-135m"


class Serve(HttpServer):
    """Its output goes to `log`, shown in the error if it never answers /health."""

    def __init__(self, *flags: str, log: Path):
        try:
            super().__init__(lambda port: [sys.executable, "-m", "swarmkv_ffi.cli", "serve", "--port", str(port),
                                           "--threads", "2", *flags], "swarmkv serve", log=open(log, "w"))
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}:\n{log.read_text()}") from None

    def client(self, key: str = "none"):
        from openai import OpenAI
        return OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=300)


def scrape(server, key: str | None) -> dict:
    """{(name, labels as a sorted tuple): value} of one scrape with `key` (the `model`
    label left out: these servers host one)."""
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model"))): s.value
            for s in servers.scrape(server, key)}


def chat(doc: str, question: str) -> list[dict]:
    """A system message holding the document, then the question."""
    return [{"role": "system", "content": doc}, {"role": "user", "content": question}]


def ask(client, messages, max_tokens=16, **kw):
    """A greedy chat completion of MODEL."""
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                          temperature=0, **kw)
