"""One model the server has loaded: its request pool on the conductor, the tier below its
cells, and how its size was chosen.

`swarmkv serve --model A --model B` hosts each on the one conductor (one ledger, one
scheduler): each model gets a RequestPool of its own (conductor/requests.py), sized from
the memory budget as if it were alone (sizing.py: a quarter of it at most, so what one
model gets never depends on which loaded first), with a host-RAM tier for its evicted
prefixes (kvcache/host.py: KV of one model is no use to another) over the disk store
the models share (kvcache/disk.py; entries are keyed by model); the tiers split
--host-cache-mib evenly. The pools stay open side by side (the scheduler never closes a
request pool to serve another), so requests for A and B take turns at the device
without rebuilding each other's cells.
"""
from __future__ import annotations

import dataclasses
import threading

from ..conductor import Conductor, ContextFull, RequestPool, ledger_keys, vetted
from ..kvcache.host import HostTier
from ..kvcache.tier import PrefixTier
from . import dialects, sizing, templates
from .dialects import Dialect
from .embeddings import Embedder
from .errors import context_exceeded
from .lineup import ModelSpec
from .settings import Settings


@dataclasses.dataclass
class HostedModel:
    """`name` (the id clients send) served from `pool`; `cells`: its size, `sized`: why
    (None when --ctx-size gave it); `host_tier`: its evicted prefixes, or None;
    `chat_template`: --chat-template(-file)'s template (templates.chosen), None for the model's own."""
    name: str
    pool: RequestPool
    cells: int
    sized: sizing.Size | None
    host_tier: HostTier | None
    default_max_tokens: int
    chat_template: str | templates.Builtin | None = None
    reads_thoughts: bool = True          # --reasoning-format auto or deepseek
    thinking: bool = True                # --reasoning on or auto: the template's enable_thinking
    pooling: str | None = None           # --pooling: how embeddings pool (None: the model's, else mean)
    _pooling: dict[bool, Embedder] = dataclasses.field(default_factory=dict)   # rank? -> its context
    _pooling_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @classmethod
    def open(cls, conductor: Conductor, spec: ModelSpec, settings: Settings,
             disk: PrefixTier | None, host_bytes: int) -> "HostedModel":
        """Book and open `spec`'s pool (its size from the memory budget unless it names
        one), with a host tier of `host_bytes` (0: none). Raises ledger.LedgerDenied when
        the ledger has no room for it now; anything else when the model cannot load."""
        path = vetted(spec.model)
        sized = None if spec.ctx_size is not None else sizing.for_model(path, conductor.ledger.limit())
        cells = spec.ctx_size if sized is None else sized.cells
        tier = HostTier(conductor.swap, host_bytes, below=disk) if host_bytes else None
        pool = RequestPool(conductor, spec.model, cells=cells, seqs=spec.parallel, exact=spec.exact,
                           share=settings.share_prefixes, store=tier or disk)
        templates.longest_token(pool.model)      # its vocabulary read now, not by the first request
        template = templates.chosen(settings.chat_template, settings.chat_template_file)
        return cls(spec.name, pool, cells, sized, tier, settings.default_max_tokens, template,
                   settings.reasoning_format != "none", settings.reasoning != "off", settings.pooling)

    @property
    def model(self):
        """The loaded Model (tokenizer, chat template, token bytes)."""
        return self.pool.model

    @property
    def knows_tools(self) -> bool:
        """Does its chat template render tool calls itself?"""
        return templates.model_knows_tools(self.model, self.chat_template)

    @property
    def dialect(self) -> Dialect:
        """How its chat template writes tool calls and thoughts (dialects.py); a thought
        stays in the text under --reasoning-format none."""
        dialect = dialects.detect(templates.source_of(self.model, self.chat_template))
        dialect = dialect.with_vocabulary((templates.control_tokens(self.model) or (None, {}))[1])
        return dialect if self.reads_thoughts else dataclasses.replace(dialect, thinks=False)

    def template_variables(self, body) -> dict:
        """The variables a chat request's template gets besides the conversation:
        enable_thinking (--reasoning), then its chat_template_kwargs; add_generation_prompt
        false and continue_final_message when it says so (templates.render)."""
        variables = {"enable_thinking": self.thinking, **(body.chat_template_kwargs or {})}
        if not body.add_generation_prompt:
            variables["add_generation_prompt"] = False
        if body.continue_final_message is not None:
            variables["continue_final_message"] = body.continue_final_message
        return variables

    @property
    def longest_token(self) -> int:
        """The most characters one token of its vocabulary spells."""
        return templates.longest_token(self.model)

    @property
    def max_context(self) -> int:
        """A request's prompt plus max_tokens may take at most this many cells."""
        return self.pool.max_context

    def max_tokens_for(self, prompts: list[list[int]], asked: int | None, what: str) -> int:
        """max_tokens for a request: as asked, or what the context leaves (at most
        --default-max-tokens, unless that is -1); 400 in OpenAI's words when the longest prompt does not fit.
        `what`: "messages" or "prompt", the field at fault."""
        longest = max(len(p) for p in prompts)
        if asked is None:
            room = self.max_context - longest
            asked = room if self.default_max_tokens == -1 else min(self.default_max_tokens, room)
        try:
            self.pool.check(longest, asked)
        except ContextFull as exc:
            raise context_exceeded(exc, what) from None
        return asked

    def embedder(self, rank: bool = False) -> Embedder:
        """Its embeddings context (embeddings.py), or (rank) its reranking one (rerank.py),
        made and booked in the ledger on first use."""
        with self._pooling_lock:
            if rank not in self._pooling:
                conductor = self.pool.conductor
                key = (ledger_keys.ranker if rank else ledger_keys.embeddings)(self.name)
                self._pooling[rank] = Embedder(self.model, conductor.ledger, key, conductor.n_threads,
                                               "rank" if rank else self.pooling)
            return self._pooling[rank]

    def close(self) -> None:
        """Free the pool and its booking, the embeddings context's and the host tier's (no
        request runs here)."""
        with self._pooling_lock:
            for embedder in self._pooling.values():
                embedder.close()
            self._pooling.clear()
        self.pool.close()
        if self.host_tier is not None:
            self.host_tier.clear()

