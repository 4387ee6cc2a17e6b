"""Both sides of `swarmkv bench serve` as agents meet them: the two servers on loopback
ports, and a request through the official `openai` client."""
from __future__ import annotations

import sys

from .peer import HttpServer, Server


def ours(args, cells: int | None, exact: bool = False, extra: tuple[str, ...] = (),
         models: tuple[str, ...] | None = None) -> HttpServer:
    """`swarmkv serve` on a free loopback port serving `models` (default: --model; none:
    `extra` names them, --models-dir): a pool
    of `cells` each (at least the 512 it takes) and 128 sequences, or (None) its own
    defaults for both; `extra` flags after."""
    size = [] if cells is None else ["--ctx-size", str(max(512, cells)), "--parallel", "128"]
    chosen = [x for m in (models if models is not None else (args.model,)) for x in ("--model", m)]
    return HttpServer(lambda port: [sys.executable, "-m", "swarmkv_ffi.cli", "serve", *chosen,
                                    "--port", str(port), "--threads", str(args.threads), *size]
                      + (["--exact"] if exact else []) + list(extra), "swarmkv serve")


def scrape(server, key: str | None = None) -> list:
    """Every sample of one scrape of our server's /metrics with `key` (a server without
    keys, or its --metrics-key, shows all; another key its own figures)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    request = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def by_label(server, name: str, by: str = "model", key: str | None = None, **labels: str) -> dict[str, float]:
    """{its `by` label: value} of the samples of one scrape (with `key`) called `name`
    whose other labels are `labels`."""
    return {s.labels[by]: s.value for s in scrape(server, key)
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())}


def metrics_of(server) -> dict:
    """One scrape of a server hosting one model: {(name, its label other than `model`,
    or ""): value}."""
    return {(s.name, next((v for k, v in s.labels.items() if k != "model"), "")): s.value for s in scrape(server)}


def theirs(args, slots: int, cells_per_slot: int, jinja: bool = False) -> Server:
    return Server(args.server, args.model_path, args.threads,
                  ["-np", str(slots), "--kv-unified", "-c", str(slots * cells_per_slot)] + (["--jinja"] if jinja else []))


def openai_client(server, key: str = "none"):
    """The official client on `server`, as agents use it (no retries, an hour's patience)."""
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=3600)


def client_of(server, model: str):
    """openai_client, warmed by a 1-token request to `model`."""
    client = openai_client(server)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                   temperature=0)
    return client


def ask(client, model: str, messages: list[dict], gen: int):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=gen, temperature=0)


def cached_of(usage) -> int | None:
    details = getattr(usage, "prompt_tokens_details", None)
    return getattr(details, "cached_tokens", None) if details is not None else None
