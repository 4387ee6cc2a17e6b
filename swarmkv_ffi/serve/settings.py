"""The server's settings, written once: `swarmkv serve`, `lmxd --http` and each Ray replica.

`Settings` holds every setting of the served model, its pool, its keys and its limits,
with the one default each has; `add_arguments` turns them into flags (`--ctx-size` for
swarmkv serve, `--http-ctx-size` for lmxd, from the same definitions) and `from_args`
reads them back. What only one program has (swarmkv serve's --host/--port/--ray, lmxd's
socket) stays with that program.
"""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from .. import catalog
from ..conductor import MAX_SEQS
from . import lineup, templates
from .keys import OPEN, Keys


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...] = ()             # --model, once per model loaded at start (none: the default)
    name: str | None = None                  # the model id clients send (one model; default: as given)
    tags: str | None = None                  # words on the --model's card in /v1/models
    models_dir: Path | None = None           # every .gguf in it, loaded on demand (lineup.py)
    models_preset: Path | None = None        # a TOML file of models and their settings (lineup.py)
    keep_alive: str | None = None            # on-demand models' idle time before unloading (None: for room only)
    ctx_size: int | None = None              # the pool's KV cells (None: sizing.py chooses)
    parallel: int = MAX_SEQS - 1             # the pool's sequences: llama.cpp's most
    exact: bool = False
    share_prefixes: bool = False
    cache_dir: Path | None = None
    host_cache_mib: int | None = None        # host RAM for evicted prefixes (None: sizing.py chooses)
    api_key: str | None = None
    api_key_file: Path | None = None
    allow_remote_without_key: bool = False
    default_max_tokens: int = 1024
    max_requests: int = 256
    max_requests_per_key: int | None = None  # None: per_key()
    max_body_bytes: int = 8 << 20
    read_timeout: float = 30.0               # seconds to send a request's headers, and again its body
    idle_connections_per_address: int = 64   # connections without a request yet (guard.py)
    send_timeout: float = 30.0               # seconds a client may leave its answer unread (guard.py)
    model_churn_window: float = 60.0         # a key unloads others' model at most once in it (churn.py)
    cors_origins: str | None = None          # web pages that may call the API from a browser (app.cors)
    metrics: bool = True                     # GET /metrics answers (off: 501, llama-server's without --metrics)
    reranking: bool = False                  # POST /rerank answers (rerank.py), as llama-server's --reranking
    pooling: str | None = None               # embeddings' pooling (None: the model's own, else mean)
    temperature: float | None = None         # --temp: a request's temperature when it gives none
    verbose_answers: bool = False            # every whole answer carries __verbose (llama-server's --verbose)
    seed: int | None = None                  # --seed: a request's seed when it gives none
    metrics_key: str | None = None           # a scrape with it sees the whole server's /metrics
    stored_responses: int = 256              # the Responses API's stored responses per key (stored.py)
    stored_responses_mib: int = 64           # ... and their text, per key
    stored_responses_ttl: float = 3600.0     # seconds unused before one is forgotten
    keep_billing_header: bool = False        # keep a system prompt's billing header (volatile.py)
    chat_template: str | None = None         # a built-in template's name or a Jinja template's text
    chat_template_file: Path | None = None   # a Jinja chat template instead of the model's own
    reasoning: str = "auto"                  # thinking in the chat: off tells the template enable_thinking=false
    reasoning_format: str = "auto"           # a thinking model's thought: reasoning_content, or "none" (dialects.py)

    @property
    def served_names(self) -> str:
        """Every id clients may send, for a log line."""
        return ", ".join(spec.name for spec in self.specs())

    @property
    def aliases(self) -> list[str]:
        """--name's ids (`a,b,c`: three ids of the one model, as llama-server's --alias)."""
        return [n.strip() for n in (self.name or "").split(",") if n.strip()]

    @property
    def tag_list(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in (self.tags or "").split(",") if t.strip())

    def specs(self) -> list[lineup.ModelSpec]:
        """Every model id clients may send and how its pool is made (lineup.py): each
        --model, loaded at start and pinned (the default model when nothing names any),
        then --models-dir's and --models-preset's, loaded on demand unless the preset
        says otherwise."""
        keep = lineup.FOREVER if self.keep_alive is None else lineup.keep_alive_seconds(self.keep_alive)
        base = lineup.ModelSpec("", "", self.ctx_size, self.parallel, self.exact, keep)
        models = self.models or (() if self.models_dir or self.models_preset else (catalog.DEFAULT_MODEL,))
        specs = [dataclasses.replace(base, name=name, model=m, pinned=True, at_start=True, tags=self.tag_list)
                 for i, m in enumerate(models) for name in (self.aliases if self.name and i == 0 else [m])]
        if self.models_dir is not None:
            specs += lineup.from_dir(self.models_dir, base)
        if self.models_preset is not None:
            specs += lineup.from_preset(self.models_preset, base)
        return specs

    def check(self) -> None:
        """A clear ValueError for a setting that cannot work, before anything loads."""
        if len(self.models) > 1 and self.name is not None:
            raise ValueError("--name renames a single --model; with several, clients send each as given")
        if self.name is not None and not self.aliases:
            raise ValueError("--name: give at least one id (several as a,b,c)")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"--temp must be in 0..2, got {self.temperature:g}")
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"a --model is given twice: {', '.join(self.models)}")
        if self.keep_alive is not None:
            try:
                lineup.keep_alive_seconds(self.keep_alive)
            except ValueError as exc:
                raise ValueError(f"--keep-alive: {exc}") from None
        if self.ctx_size is not None and self.ctx_size < lineup.MIN_CELLS:
            raise ValueError(f"--ctx-size must be at least {lineup.MIN_CELLS} cells, got {self.ctx_size}")
        if not 2 <= self.parallel <= MAX_SEQS - 1:
            raise ValueError(f"--parallel must be in 2..{MAX_SEQS - 1}, got {self.parallel}")
        if self.default_max_tokens < 1 and self.default_max_tokens != -1:
            raise ValueError("--default-max-tokens must be >= 1, or -1 for as far as the context allows")
        if self.max_requests < 1 or (self.max_requests_per_key or 1) < 1:
            raise ValueError("--max-requests and --max-requests-per-key must be >= 1")
        if self.host_cache_mib is not None and not 0 <= self.host_cache_mib <= 1 << 24:
            raise ValueError(f"--host-cache-mib must be in 0..{1 << 24} (0: off), got {self.host_cache_mib}")
        if self.max_body_bytes < 1024:
            raise ValueError("--max-body-bytes must be at least 1024")
        if self.stored_responses < 0 or self.stored_responses_mib < 0 or self.stored_responses_ttl <= 0:
            raise ValueError("--stored-responses and --stored-responses-mib must be >= 0 (0: none kept), "
                             "--stored-responses-ttl > 0 seconds")
        if not 0 < self.read_timeout <= 3600 or not 0 < self.send_timeout <= 3600 \
                or self.idle_connections_per_address < 1:
            raise ValueError("--read-timeout and --send-timeout must be in (0, 3600] seconds and "
                             "--idle-connections-per-address at least 1")
        bad = [o for o in (self.cors_origins or "").split(",")
               if o.strip() and not re.fullmatch(r"\*|localhost|https?://[^/\s]+", o.strip())]
        if bad:
            raise ValueError(f"--cors-origins: {bad[0]!r} is not an origin (scheme://host[:port]), "
                             "`localhost` or `*`")
        if not 0 <= self.model_churn_window <= 86400:
            raise ValueError("--model-churn-window must be in [0, 86400] seconds (0: no limit)")
        lineup.check(self.specs())
        if self.chat_template is not None or self.chat_template_file is not None:
            if self.chat_template is not None and self.chat_template_file is not None:
                raise ValueError("give --chat-template or --chat-template-file, not both")
            if len(lineup.pools(self.specs())) > 1:
                given = "--chat-template" if self.chat_template is not None else "--chat-template-file"
                raise ValueError(f"{given} replaces a single model's template; with several "
                                 "models, give each a GGUF with the template it needs")
            templates.chosen(self.chat_template, self.chat_template_file)

    def per_key(self, n_keys: int) -> int:
        """Choices one key may have running or queued: as set, else all of --max-requests
        for a server of one key (or none; what does not fit the pool's sequences waits),
        half of --parallel where keys share it, so no key can hold every sequence."""
        if self.max_requests_per_key is not None:
            return self.max_requests_per_key
        return self.max_requests if n_keys <= 1 else max(1, min(self.parallel, self.max_requests) // 2)

    def keys(self, host: str) -> Keys:
        """The keys to require; none only on loopback addresses (unless allowed); `host` may
        name several, comma-separated."""
        if self.api_key is not None:
            if len(self.api_key) < 8:
                raise ValueError("an API key must be at least 8 characters")
            keys = Keys({self.api_key: "key1"})
        elif self.api_key_file is not None:
            keys = Keys.from_file(self.api_key_file)
        else:
            keys = Keys()
        if self.metrics_key is not None and (len(self.metrics_key) < 8 or keys.owner(f"Bearer {self.metrics_key}")
                                             not in (None, OPEN)):
            raise ValueError("--metrics-key must be at least 8 characters and no API key")
        remote = [h for h in host.split(",") if not is_loopback(h.strip())]
        if not keys.required and remote and not self.allow_remote_without_key:
            raise ValueError(f"{remote[0]} is reachable from other machines and no API key is set; "
                             "pass an API key file (or allow it explicitly)")
        return keys

    @classmethod
    def from_args(cls, args: argparse.Namespace, prefix: str = "") -> "Settings":
        """The settings add_arguments(…, prefix) parsed into `args`."""
        dest = prefix.replace("-", "_")
        values = {f.name: getattr(args, dest + f.name) for f in dataclasses.fields(cls)}
        values["models"] = tuple(values["models"] or ())    # --model appends
        return cls(**values)


DEFAULTS = Settings()


def add_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup, prefix: str = "") -> None:
    """The settings as flags, each named --PREFIX<name> (lmxd: prefix "http-")."""
    def flag(name: str, **kw) -> None:
        p.add_argument(f"--{prefix}{name}", **kw)

    d = DEFAULTS
    flag("model", dest=f"{prefix.replace('-', '_')}models", action="append", default=None, metavar="MODEL",
         help="a packaged short name or a path to a .gguf file; repeat it to serve several models from one "
              "endpoint, each with a pool of its own under one memory ledger, requests routed by their "
              f"`model` field; each is loaded at start and stays loaded (default: {catalog.DEFAULT_MODEL}, "
              "unless --models-dir or --models-preset names the models)")
    flag("models-dir", type=Path, default=d.models_dir, metavar="DIR",
         help="serve every .gguf file in DIR (writable by this user alone) under its file name without "
              ".gguf, each loaded on its first request (which waits, queued, meanwhile) and unloaded when "
              "another needs its memory: the least recently used idle one, else the least busy one once "
              "its running requests end (its new ones wait for its next turn)")
    flag("models-preset", type=Path, default=d.models_preset, metavar="FILE",
         help="a TOML file with one table per model id: model, ctx_size, parallel, exact, keep_alive, "
              "pinned, load = \"start\" or \"demand\" (docs/serve.md); two ids of one file share its pool")
    flag("keep-alive", default=d.keep_alive, metavar="DURATION",
         help="how long a model loaded on demand stays loaded after its last request, as Ollama's "
              "keep_alive: seconds or 30s/5m/1h, negative for until its memory is needed; a request's "
              "own keep_alive field overrides it (default: until its memory is needed)")
    flag("name", default=d.name, help="the model id clients send, for a single --model; several ids of the one "
         "model as a,b,c (one card in /v1/models, as llama-server's --alias) (default: the model as given)")
    flag("tags", default=d.tags, metavar="A,B", help="words /v1/models shows on the --model's card, as "
         "llama-server's --tags (default: none)")
    flag("ctx-size", type=int, default=d.ctx_size,
         help="KV cells of the pool: every running request's prompt + max_tokens and the cached "
              "prefixes share them, each cell booked once (default: 4 x the model's context, or what "
              "a quarter of the memory budget holds if less; the startup line says which)")
    flag("parallel", type=int, default=d.parallel,
         help="sequences in the pool: requests running plus kept prefixes (default: %(default)s, "
              "llama.cpp's most: a sequence costs no memory of its own, the cells bound how many run)")
    flag("exact", action="store_true",
         help="batch-invariant kernels: a request's answer does not depend on what else runs")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument(f"--{prefix}api-key", default=d.api_key,
                      help="require this key (Authorization: Bearer KEY)")
    keys.add_argument(f"--{prefix}api-key-file", type=Path, default=d.api_key_file,
                      help="one key per line (optionally followed by a name): each key is an owner "
                           "with its own fair share, quota and cache")
    flag("temp", dest=f"{prefix.replace('-', '_')}temperature", type=float, default=d.temperature, metavar="T",
         help="the temperature of every request that gives none, as llama-server's --temp (default: each API's "
              "own: 1.0 for OpenAI's and Anthropic's, 0.8 for llama-server's /completion)")
    flag("seed", type=int, default=d.seed,
         help="the seed of every request that gives none, as llama-server's --seed: the same request then "
              "draws the same answer (default: none, a fresh draw each time)")
    flag("verbose-answers", action="store_true",
         help="every whole answer carries llama-server's __verbose: the prompt as the model read it, what it "
              "wrote, counts and timings (a request's own `verbose` says otherwise; serve's -v turns it on too)")
    flag("pooling", choices=("mean", "cls", "last", "none"), default=d.pooling,
         help="how /v1/embeddings pools an input's rows into its vector, as llama-server's --pooling "
              "(default: the model's own, mean for a generative model; none is refused there: OpenAI's "
              "shape is one vector per input)")
    flag("reranking", action="store_true",
         help="answer POST /rerank (llama-server's route, Jina's and TEI's shapes) with the model's "
              "classification head; a reranker model is meant (a generative model's scores rank nothing)")
    flag("metrics", action=argparse.BooleanOptionalAction, default=d.metrics,
         help="answer GET /metrics in Prometheus' format, with our figures and llama-server's `llamacpp:` "
              "ones (default: on; turned off, the route answers 501 as llama-server's does without --metrics)")
    flag("metrics-key", default=d.metrics_key,
         help="a scrape of /metrics with this key (Authorization: Bearer KEY) sees the whole server's "
              "figures; an API key sees its own requests' counters only (default: none; without API "
              "keys every scrape sees everything)")
    flag("allow-remote-without-key", action="store_true",
         help="listen on a non-loopback address with no API key (anyone who reaches it may use it)")
    flag("cache-dir", type=Path, default=d.cache_dir, metavar="DIR",
         help="keep prefixes that requests share (256 tokens or more) in this prefix-cache folder, so "
              "a restarted server restores them instead of prefilling (default: off; each key's "
              "prefixes apart; a full or read-only folder only logs a warning)")
    flag("host-cache-mib", type=int, default=d.host_cache_mib, metavar="MIB",
         help="host RAM for the KV of cached prefixes the pool evicts for room: a later request "
              "over the same document restores it instead of prefilling, when restoring has "
              "measured cheaper; when full, the oldest go on to --cache-dir if set; split evenly "
              "between several --model (default: an eighth of this machine's RAM, at most 4096; 0: off)")
    flag("share-prefixes", action="store_true",
         help="let every key reuse every key's cached prefixes (off: a cached prefix's speed would "
              "tell one key what another asked)")
    flag("default-max-tokens", type=int, default=d.default_max_tokens,
         help="max_tokens of a chat request that sends none; -1: as far as the context allows, as "
              "llama-server's --n-predict -1 (default: %(default)s)")
    flag("max-requests", type=int, default=d.max_requests,
         help="choices running or queued at once, all keys (default: %(default)s; more get 503)")
    flag("max-requests-per-key", type=int, default=d.max_requests_per_key,
         help="choices running or queued at once per key (default: --max-requests with one key, half of "
              "--parallel with several; more get 429)")
    flag("max-body-bytes", type=int, default=d.max_body_bytes,
         help="largest request body (default: 8 MiB)")
    flag("read-timeout", type=float, default=d.read_timeout, metavar="SECONDS",
         help="a connection that has not sent a request's headers this long after opening (or after "
              "its last answer) is closed, and a body not sent whole within it is a 408 "
              "(default: %(default)s)")
    flag("send-timeout", type=float, default=d.send_timeout, metavar="SECONDS",
         help="a client that takes none of its answer for this long, while the server has more to "
              "send, is cut off and its request ended; until then a stream's choices count against "
              "its key, sent or not (default: %(default)s)")
    flag("model-churn-window", type=float, default=d.model_churn_window, metavar="SECONDS",
         help="where memory holds fewer models than are asked for: a key whose request unloads a model "
              "other keys used within this window may do so once per window (later such requests get "
              "429 with Retry-After), and the model it unloaded comes back for its users without "
              "counting against them (default: %(default)s; 0: no limit)")
    flag("cors-origins", default=d.cors_origins, metavar="ORIGINS",
         help="web pages whose scripts may call this server from a browser (CORS): a comma-separated "
              "list of origins (https://app.example.com), `localhost` for any page served from this "
              "machine, or `*` for any (keys are still required where set). Default: none, as a server "
              "behind keys should be (llama-server allows any)")
    flag("stored-responses", type=int, default=d.stored_responses, metavar="N",
         help="Responses API: responses kept per key for previous_response_id (store, on by default as "
              "OpenAI's); past N, or past --stored-responses-mib, the least recently used go "
              "(default: %(default)s; 0: none kept)")
    flag("stored-responses-mib", type=int, default=d.stored_responses_mib, metavar="MIB",
         help="the text of one key's stored responses, at most (default: %(default)s)")
    flag("stored-responses-ttl", type=float, default=d.stored_responses_ttl, metavar="SECONDS",
         help="a stored response unused this long is forgotten (default: %(default)s)")
    flag("keep-billing-header", action="store_true",
         help="keep a billing header line (x-anthropic-billing-header: ...; cch=...;) at the top of a "
              "system prompt; by default it is dropped before templating, since its value changes on "
              "every request and would defeat the prefix cache (docs/serve.md)")
    flag("chat-template", default=d.chat_template, metavar="NAME|JINJA",
         help="render the model's chats with one of libllama's built-in templates by name (chatml, "
              "llama3, command-r, ...: text messages only) or with this Jinja template's text, instead "
              "of the one in its GGUF (as llama-server's flag; one model only)")
    flag("chat-template-file", type=Path, default=d.chat_template_file, metavar="FILE",
         help="a Jinja chat template to render the model's chats with instead of the one in its GGUF "
              "(as llama-server's flag; one model only)")
    flag("reasoning", choices=["on", "off", "auto"], default=d.reasoning,
         help="a thinking model's thinking, as llama-server's flag: 'off' renders its chats with "
              "enable_thinking=false (Qwen3's and DeepSeek R1's templates then close the thought "
              "before the answer); a request's chat_template_kwargs may set it for itself "
              "(default: %(default)s)")
    flag("reasoning-format", choices=["auto", "deepseek", "none"], default=d.reasoning_format,
         help="a thinking model's thought (its template names <think>): 'auto' or 'deepseek' split it "
              "into reasoning_content (a reasoning item, a thinking block), 'none' leaves it in the "
              "answer's text, as llama-server's flag (default: %(default)s)")
    flag("idle-connections-per-address", type=int, default=d.idle_connections_per_address, metavar="N",
         help="connections one client address may hold open without a request; a newer one closes "
              "its oldest (default: %(default)s)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
