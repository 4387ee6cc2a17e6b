"""One HTTP request in flight: its choices, run on the engine, their events for the loop.

A request with n choices over P prompts is P x n Jobs (engine.py). Each runs on a thread
of its own (the engine blocks until its choice ends); the tokens it generates are turned
into text as they come (text.py: stop strings) on the scheduler's thread, and handed to
the event loop through a queue only when the response streams.

A choice counts against its key (engine.admit) from start() until it has ended and, for a
stream, until the stream is done with (sent()): a client that reads nothing cannot have
its key's output pile up beyond its quota while new requests start.
"""
from __future__ import annotations

import asyncio
import threading
import time

from .engine import Job, ServeEngine
from .errors import refused
from .loading import Use
from .schemas import CachedTokens, Sampling, TokenLogprob, TopLogprob, Usage
from .structured import Structure
from .telemetry import timings
from .text import TextStream


class Choice:
    """One choice as it is produced: its text so far, logprobs, how it ended."""

    def __init__(self, index: int, stream: TextStream, model):
        self.index, self.text, self.model = index, stream, model
        self.ranked: list[tuple[int, tuple]] = []   # (token, (logprob, [(id, logprob), ...])), as sampled
        self._entries: list[TokenLogprob] = []      # ranked, formatted so far
        self._formatting = threading.Lock()
        self.logprobs_sent = 0            # entries already streamed
        self.result, self.error = None, None
        self.job: Job | None = None
        self.n_tokens, self.first_at = 0, None   # tokens so far, when the first came (telemetry.py)
        self.progress: int | None = None  # the prompt's tokens its last prompt_progress reported
        self.forked = 0                   # its prompt's tokens forked from cells, as the scheduler said

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """Each token's logprobs entry (OpenAI's shape), formatted by whoever reads them
        (the event loop, a request's thread), never on the scheduler's thread that ranked
        them: there the callback only checks for a stop string. The list only grows: a
        stream slices what it has not sent yet, with no copy of the rest per chunk."""
        with self._formatting:
            for token, ranked in self.ranked[len(self._entries):]:
                self._entries.append(logprob_entry(self.model, token, ranked))
            return self._entries

    def finish_reason(self, reply=None) -> str:
        if reply is not None and reply.tool_calls:
            return "tool_calls"
        if self.text.stopped or self.result.stopped_on_eog or self.result.completed:
            return "stop"
        return "length"


def logprob_entry(model, token: int, ranked) -> TokenLogprob:
    """A token's logprobs entry: its text, bytes and logprob, and its top alternatives'."""
    lp, top = ranked

    def item(t: int, p: float) -> TopLogprob:
        raw = model.token_bytes(t)
        return TopLogprob(token=raw.decode("utf-8", "replace"), logprob=p, bytes=list(raw))
    return TokenLogprob(**dict(item(token, lp)), top_logprobs=[item(t, p) for t, p in top])


class Call:
    """One request's choices, of `owner`'s, each with `max_tokens`, to the model `use`
    holds loaded: the call releases it once its last choice has ended (or start fails)."""

    def __init__(self, engine: ServeEngine, use: Use, owner: int, body: Sampling,
                 prompts: list[list[int]], max_tokens: int, loop: asyncio.AbstractEventLoop,
                 structure: Structure | None = None):
        self.engine, self.use, self.hosted, self.owner, self.body = engine, use, use.hosted, owner, body
        self.structure = structure or Structure()
        self.prompts, self.max_tokens = prompts, max_tokens
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.choices: list[Choice] = []
        self.jobs: list[Job] = []
        self._left = 0                    # choices not ended
        self._held = 0                    # choices ended that a stream not yet sent still counts
        self._sent = not body.stream      # the answer is out of our hands (a whole answer: at its end)
        self._lock = threading.Lock()
        self.started = time.perf_counter()

    def start(self) -> None:
        """Admit every choice (or refuse the request whole) and start them."""
        n = self.body.n
        try:
            self.engine.admit(self.owner, n * len(self.prompts))
        except BaseException:
            self.use.release()
            raise
        self._left = n * len(self.prompts)
        for p, tokens in enumerate(self.prompts):
            for k in range(n):
                stream = TextStream(self.hosted.model, self.body.stops(), shown=self.structure.shown)
                choice = Choice(p * n + k, stream, self.hosted.model)
                job = Job(self.hosted, self.owner, tokens, self.max_tokens, self._on_token(choice),
                          sampling=self.body.settings(k, self.max_tokens), top_logprobs=self.body.ranked(),
                          grammar=self.structure.compiled or self.structure.grammar,
                          on_prompt=self._on_prompt(choice) if self.progress_asked else None)
                choice.job = job
                self.choices.append(choice)
                self.jobs.append(job)
                threading.Thread(target=self._run, args=(choice, job), daemon=True,
                                 name=f"serve-choice-{choice.index}").start()

    def _on_token(self, choice: Choice):
        """Runs on the scheduler's thread, between two steps, so it does the least: the
        stop-string check, the token's ranks kept raw (Choice.logprobs formats them), and
        a wake of the event loop only for a stream (on two cores, a thread woken per
        token slows every step)."""
        stream = self.body.stream

        def on_token(token: int, ranked) -> bool:
            if choice.first_at is None:
                choice.first_at = time.perf_counter()
            choice.n_tokens += 1
            piece = choice.text.feed(token)
            if ranked is not None:
                choice.ranked.append((token, ranked))
            if stream:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, ("text", choice, piece))
            return not choice.text.stopped
        return on_token

    @property
    def progress_asked(self) -> bool:
        """Does the client follow the prompt's reading (llama-server's return_progress)?"""
        return self.body.stream and getattr(self.body, "return_progress", False)

    def _on_prompt(self, choice: Choice):
        """Runs on the scheduler's thread after a step read a chunk of the choice's prompt
        (not its last): the tokens now in cells go to the stream (telemetry.progress)."""
        def on_prompt(in_cells: int, forked: int) -> None:
            choice.forked = forked
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ("progress", choice, in_cells))
        return on_prompt

    def _run(self, choice: Choice, job: Job) -> None:
        try:
            choice.result = self.engine.run(job)
            tail = choice.text.flush()
            if self.body.stream:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, ("text", choice, tail))
        except BaseException as exc:     # reported to the client, not raised on a thread
            choice.error = refused(exc)
        finally:
            spent = timings(self, choice)
            self.engine.tally.ended(self.owner, choice.result, len(job.tokens), choice.index % self.body.n == 0,
                                    (spent["prompt_ms"] / 1e3, spent["predicted_ms"] / 1e3))
            with self._lock:
                self._left -= 1
                last, held = not self._left, not self._sent
                self._held += held
            if not held:
                self.engine.leave(self.owner, 1)
            if last:
                self.use.release()
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ("end", choice, None))

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancelled.set()

    def sent(self) -> None:
        """The stream is done with: its last byte handed to the connection, or the client
        gone (or cut off for reading nothing: guard.py). Choices still running are cancelled;
        the ended ones stop counting against the key (the others will as they end)."""
        self.cancel()
        with self._lock:
            if self._sent:
                return
            self._sent, held, self._held = True, self._held, 0
        if held:
            self.engine.leave(self.owner, held)

    async def events(self):
        """(kind, choice, value) until every choice has ended: 'progress' (the prompt's
        tokens read so far, when asked), 'text' pieces, then 'end'."""
        left = len(self.choices)
        while left:
            kind, choice, text = await self.queue.get()
            left -= kind == "end"
            yield kind, choice, text

    def failure(self):
        """The first choice's error (a Refused), or None."""
        return next((c.error for c in self.choices if c.error is not None), None)

    def usage(self) -> Usage:
        """Tokens of the whole request; a prompt's cached tokens counted once, by its
        first choice (the others fork it)."""
        n = self.body.n
        firsts = [c for c in self.choices if c.index % n == 0 and c.result is not None]
        prompt = sum(len(p) for p in self.prompts)
        done = sum(len(c.result.generated) for c in self.choices if c.result is not None)
        return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done,
                     prompt_tokens_details=CachedTokens(cached_tokens=sum(c.result.cached for c in firsts)))
