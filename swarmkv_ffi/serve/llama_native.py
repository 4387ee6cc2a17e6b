"""llama-server's own routes, for clients written against it (issue 64), on the same engine,
keys and limits as the OpenAI routes:

    POST /completion, /completions   llama-server's native completion, whole or streamed
    POST /tokenize                   {"tokens": [...]}, with pieces when asked
    POST /detokenize                 {"content": "..."}
    GET  /props                      the model's settings, as llama-server reports them (props())
    GET  /slots, POST /props         501: there are no slots to list, and settings do not change
                                     over HTTP (a slot's prompt would show one key another's)

A native completion body is read into a text completion (schemas.CompletionRequest: one
set of checks and one call path) with llama-server's defaults (temperature 0.8, top_k 40,
top_p 0.95, min_p 0.05; n_predict -1: as far as --default-max-tokens and the context
allow), and answered in llama-server's shape (tools/server/server-task.cpp): `content`,
`tokens` (the generated ids with return_tokens), `stop`, `stop_type` (eos, limit, word),
`stopping_word`, `tokens_predicted`, `tokens_evaluated`, `tokens_cached`, `truncated`,
`has_new_line`, `generation_settings`, `timings` (telemetry.py). Streamed: one event per
piece of text, then the final object, without OpenAI's [DONE]. Fields llama-server has
and the engine does not act on are refused by name (a 400), never silently dropped:
IGNORED names the few that change nothing here.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from . import telemetry, templates
from .calls import Call, Choice
from .errors import Refused, error_body, validated
from .responses import sse
from .schemas import MAX_LOGIT_BIAS, CompletionRequest

#: llama.cpp's LLAMA_DEFAULT_SEED: what its /props reports for a random seed.
RANDOM_SEED = 0xFFFFFFFF
#: llama-server's generation settings a native completion takes when its body names none.
DEFAULT_PARAMS = ("n_predict", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                  "frequency_penalty", "stop", "seed")

#: llama-server's fields that change nothing on this engine, accepted as it accepts them.
IGNORED = {
    "cache_prompt": "prompts are always cached (the pool keeps finished requests' cells)",
    "id_slot": "there are no slots: any request runs beside the others",
    "samplers": "the sampler chain is fixed: penalties, top_k, top_p, min_p, temperature",
    "backend_sampling": "tokens are drawn on the CPU from the logits, by the same chain either way",
    "verbose": "the answer is llama-server's __verbose object already",
}


class PromptObject(BaseModel):
    """llama-server's prompt as an object: its text (`prompt_string`); `multimodal_data`
    is refused by name, as no served model reads media."""
    model_config = ConfigDict(extra="forbid")
    prompt_string: str


class NativeCompletion(BaseModel):
    """llama-server's /completion body, as far as the engine acts on it."""
    model_config = ConfigDict(extra="allow")

    # several prompts, or (ints and texts at the top) one prompt in pieces
    prompt: Union[str, list[int], PromptObject, list[Union[str, list[int], PromptObject]], list[Union[int, str]]]
    model: str | None = None
    n_predict: int = Field(-1, ge=-1)
    stream: bool = False
    temperature: float = Field(0.8, ge=0.0, le=2.0)
    top_k: int = Field(40, ge=0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, lt=1.0)
    seed: int = -1
    stop: list[str] = Field(default_factory=list)
    repeat_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Union[dict[str, Union[float, bool]], list[list[Union[int, str, float, bool]]], None] = None
    grammar: str | None = None
    return_tokens: bool = False
    response_fields: list[str] = Field(default_factory=list, max_length=64)
    n_probs: int = Field(0, ge=0, le=20)
    post_sampling_probs: bool = False       # n_probs after the sampler chain, as probabilities
    keep_alive: Union[float, str, None] = None
    ignore_eos: bool = False                # every end-of-generation token banned (benchmarks ask for it)
    timings_per_token: bool = False         # a `timings` object on every streamed event
    return_progress: bool = False           # `prompt_progress` events while the prompt is read

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        return v

    def unsupported(self) -> list[str]:
        """Fields llama-server acts on and this engine does not (the 400 names them)."""
        return sorted(k for k in (self.model_extra or {}) if k not in IGNORED)

    def as_completion(self) -> "NativeAsked":
        """The same request as a text completion."""
        unsupported = self.unsupported()
        if unsupported:
            raise Refused(400, f"{', '.join(unsupported)}: not supported by this server (llama-server's "
                          f"fields it accepts: docs/serve.md#llama-servers-own-routes)", "unsupported_parameter",
                          unsupported[0])
        if self.n_predict == 0:
            raise Refused(400, "n_predict: 0 generates nothing; ask for at least 1 token, or -1",
                          "invalid_value", "n_predict")
        return validated(NativeAsked, {
            "prompt": self._prompts(), "max_tokens": self.n_predict if self.n_predict > 0 else None,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "seed": None if self.seed < 0 else self.seed, "stop": self.stop or None, "stream": self.stream,
            "repeat_penalty": self.repeat_penalty, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "grammar": self.grammar,
            "model": self.model, "keep_alive": self.keep_alive, "return_tokens": self.return_tokens,
            "n_probs": self.n_probs, "post_sampling_probs": self.post_sampling_probs,
            "timings_per_token": self.timings_per_token, "return_progress": self.return_progress})

    def _prompts(self):
        """The prompt as the engine takes it: one text or token list, or several of them,
        text and tokens mixed as llama-server allows; a prompt object is its text."""
        p = self.prompt
        if isinstance(p, PromptObject):
            return p.prompt_string
        if isinstance(p, str) or all(isinstance(t, int) for t in p):
            return p
        return [x.prompt_string if isinstance(x, PromptObject) else x for x in p]

    def with_model(self, model, asked: "NativeAsked") -> "NativeAsked":
        """The completion with what needs the model read against it: a prompt in pieces
        as one token list (pieces()), and the logit_bias (bias())."""
        update = {}
        if pieces(asked.prompt):
            text = sum(len(x) for x in asked.prompt if isinstance(x, str))
            if text > (model.n_ctx_train + 1) * templates.longest_token(model):     # not tokenized: too long
                raise Refused(400, f"prompt: {text} characters cannot fit the model's context",
                              "context_length_exceeded", "prompt")
            update["prompt"] = [int(t) for i, piece in enumerate(asked.prompt) for t in (
                [piece] if isinstance(piece, int) else model.tokenize(piece, add_special=i == 0))]
        bias = self.bias(model)
        if bias is not None:
            update["logit_bias"] = bias
        return asked.model_copy(update=update) if update else asked

    def bias(self, model) -> dict[int, float] | None:
        """llama-server's logit_bias read against the model: {token: bias} or [[token,
        bias], ...], a token given as its id or as text (each of the text's tokens gets the
        bias), `false` banning it; as OpenAI's {id: bias in [-100, 100]} (the route checks
        the ids against the vocabulary). A ban (`false`, and with ignore_eos every
        end-of-generation token) is -inf, as llama-server's. None: no bias."""
        if not self.logit_bias and not self.ignore_eos:
            return None
        pairs = self.logit_bias or []
        pairs = pairs.items() if isinstance(pairs, dict) else pairs
        bias: dict[int, float] = {}
        for pair in pairs:
            if len(pair) != 2 or isinstance(pair[1], str):
                raise Refused(400, "logit_bias: each entry is a token (id or text) and a bias", "invalid_value",
                              "logit_bias")
            token, value = pair
            ids = [int(token)] if isinstance(token, int) or str(token).lstrip("-").isdigit() else \
                [int(t) for t in model.tokenize(str(token)[:512], add_special=False)]
            for t in ids:
                bias[t] = -math.inf if value is False else max(-100.0, min(100.0, float(value)))
        if self.ignore_eos:                 # over any bias given for them, as llama-server adds its bans last
            bias.update(dict.fromkeys(end_tokens(model), -math.inf))
        if len(bias) > MAX_LOGIT_BIAS:
            raise Refused(400, f"logit_bias: {len(bias)} tokens; at most {MAX_LOGIT_BIAS}", "invalid_value",
                          "logit_bias")
        return bias


def pieces(prompt) -> bool:
    """Is it one prompt given in pieces, token ids and texts side by side (llama-server's
    mixed prompt: [1, 2, "text", 3]), rather than a text, a token list or several prompts?"""
    return isinstance(prompt, list) and any(isinstance(x, int) for x in prompt) and \
        any(isinstance(x, str) for x in prompt)


@functools.lru_cache(maxsize=16)
def end_tokens(model) -> tuple[int, ...]:
    """The model's end-of-generation tokens (EOS, EOT, ...), read off its vocabulary once."""
    return tuple(t for t in range(model.n_vocab) if model.is_eog(t))


class NativeAsked(CompletionRequest):
    """A native completion as the engine runs it: no limit means as far as the context
    and --default-max-tokens allow (OpenAI's completions default to 16); several prompts
    may mix text and tokens, and one may come in pieces (NativeCompletion.with_model joins them)."""
    prompt: Union[str, list[int], list[Union[str, list[int]]], list[Union[int, str]]]
    return_tokens: bool = False
    n_probs: int = 0
    post_sampling_probs: bool = False
    timings_per_token: bool = False
    return_progress: bool = False

    def limit(self) -> int | None:
        return self.max_tokens

    def settings(self, choice: int, max_tokens: int) -> dict:
        return {**super().settings(choice, max_tokens), **({"post_sampling": True} if self.post_sampling_probs else {})}

    def ranked(self) -> int | None:
        return self.n_probs or None


class NativeShape:
    """llama-server's completion objects, for routes.answer (as responses.Events)."""

    def __init__(self, model: str, detokenize, fields: list[str] | None = None):
        self.model, self._detokenize, self.fields = model, detokenize, fields or []

    def whole(self, call: Call) -> Any:
        done = [self._picked(self._final(call, c, c.text.sent, whole=True)) for c in call.choices]
        return done[0] if len(done) == 1 else done

    def _picked(self, final: dict) -> dict:
        """llama-server's response_fields: only those, a nested one named by its path
        ("generation_settings/n_predict"), a missing one left out."""
        if not self.fields:
            return final
        picked = {}
        for path in self.fields:
            value = final
            for part in path.split("/"):
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None:
                picked[path] = value
        return picked

    def opening(self, call: Call):
        return []

    def piece(self, call: Call, choice: Choice, text: str):
        """One event per piece of text; with n_probs, one per token (its text may be held
        back while it could begin a stop string), carrying that token's probabilities. A
        piece comes per token (and one for the text held to the end), so each takes one
        token's: the event loop may come to a piece after later tokens were ranked."""
        progress = self.progress(call, choice)
        start = choice.logprobs_sent
        fresh = self._probs(choice, call.body.post_sampling_probs, start, start + 1)
        if not text and not fresh:
            return progress
        choice.logprobs_sent += len(fresh)
        event = self._partial(call, choice, text)
        return progress + [sse({**event, "completion_probabilities": fresh} if fresh else event)]

    def progress(self, call: Call, choice: Choice, read: int | None = None) -> list[str]:
        """An event per prompt_progress report due (telemetry.progress), when asked;
        `read`: the prompt's tokens in cells, None once it is all read."""
        if not call.progress_asked:
            return []
        return [sse({**self._partial(call, choice, "", timed=False), "prompt_progress": report,
                     **({"timings": spent} if call.body.timings_per_token else {})})
                for report, spent in telemetry.progress(call, choice, read)]

    def _partial(self, call: Call, choice: Choice, text: str, timed: bool = True) -> dict:
        """llama-server's streamed event of a piece of text (its timings so far, when asked)."""
        event = {"index": choice.index, "content": text, "tokens": [], "stop": False, "id_slot": -1,
                 "tokens_predicted": choice.n_tokens, "tokens_evaluated": self._prompt_n(call, choice)}
        return {**event, "timings": telemetry.timings(call, choice)} if timed and call.body.timings_per_token \
            else event

    @staticmethod
    def _probs(choice: Choice, post_sampling: bool, start: int = 0, stop: int | None = None) -> list[dict]:
        """llama-server's completion_probabilities of the choice's tokens from `start` to
        `stop`; after the sampler chain (`post_sampling`) as probabilities, as there."""
        def item(token_id: int, entry) -> dict:
            said = {"prob": math.exp(entry.logprob)} if post_sampling else {"logprob": entry.logprob}
            return {"id": token_id, "token": entry.token, **said, "bytes": entry.bytes}
        tops = "top_probs" if post_sampling else "top_logprobs"
        return [{**item(token, entry), tops: [item(t, top) for (t, _), top in zip(ranks, entry.top_logprobs)]}
                for entry, (token, (_, ranks)) in zip(choice.logprobs[start:stop], choice.ranked[start:stop])]

    def ending(self, call: Call, choice: Choice):
        return [sse(self._picked(self._final(call, choice, "")))]

    def closing(self, call: Call):
        return []

    def error(self, exc: Refused) -> str:
        return sse(error_body(exc.status, str(exc), exc.code))

    @staticmethod
    def _prompt_n(call: Call, choice: Choice) -> int:
        return len(call.prompts[choice.index // call.body.n])

    def _final(self, call: Call, choice: Choice, content: str, whole: bool = False) -> dict:
        """The final object; `whole` (not streamed): with every token's probabilities."""
        body, result = call.body, choice.result
        generated = list(result.generated) if result is not None else []
        stop_type = "word" if choice.text.stopped else "eos" if result is not None and result.stopped_on_eog \
            else "limit"
        return {
            "index": choice.index, "content": content, "tokens": generated if body.return_tokens else [],
            "id_slot": -1, "stop": True, "model": self.model, "tokens_predicted": len(generated),
            "tokens_evaluated": self._prompt_n(call, choice), "tokens_cached": telemetry.cached_tokens(choice),
            "generation_settings": {"n_predict": call.max_tokens, "seed": body.seed if body.seed is not None else -1,
                                    "temperature": body.temperature, "top_k": body.top_k, "top_p": body.top_p,
                                    "min_p": body.min_p, "stop": body.stops(), "stream": body.stream,
                                    "repeat_penalty": body.repeat_penalty,
                                    # llama-server's list; a ban (-inf) is null in JSON there
                                    "logit_bias": [{"token": t, "bias": None if math.isinf(b) else b}
                                                   for t, b in (body.logit_bias or {}).items()]},
            "prompt": self._detokenize(call.prompts[choice.index // body.n]),
            "has_new_line": "\n" in choice.text.sent, "truncated": False, "stop_type": stop_type,
            "stopping_word": getattr(choice.text, "stop_string", "") if choice.text.stopped else "",
            "timings": telemetry.timings(call, choice),
            **({"completion_probabilities": self._probs(choice, body.post_sampling_probs)}
               if body.n_probs and whole else {})}


# ---- tokenize, detokenize ----------------------------------------------------------------

class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: str
    model: str | None = None
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: list[int]
    model: str | None = None


def tokenize(model, body: TokenizeRequest) -> dict:
    """llama-server's answer: ids, or {id, piece} with the piece as text, or as its bytes
    where they are not UTF-8 on their own (part of a character)."""
    ids = [int(t) for t in model.tokenize(body.content, add_special=body.add_special,
                                         parse_special=body.parse_special)]
    if not body.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": _piece(model.token_bytes(t, special=body.parse_special))} for t in ids]}


def _piece(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def props(name: str, hosted, build: str) -> dict:
    """llama-server's GET /props for the served model `name` (tools/server's get_res_props):
    what a client reads before it sends anything. n_ctx is the most one request may take
    (prompt and output: the pool's cells, capped by the training context), as llama-server
    reports it with --kv-unified; total_slots the sequences its pool holds at once. The
    model's file is named, never its folder (a key sees no more of the server's disk)."""
    model = hosted.model
    defaults = NativeCompletion(prompt="")
    params = {k: getattr(defaults, k) for k in DEFAULT_PARAMS}
    params["seed"] = RANDOM_SEED if defaults.seed == -1 else defaults.seed
    return {"default_generation_settings": {"n_ctx": hosted.max_context, "params": params},
            "total_slots": hosted.pool.seqs, "model_alias": name, "model_path": hosted.pool.path.name,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": False, "endpoint_props": False, "endpoint_metrics": True,
            "chat_template": templates.shown(model, hosted.chat_template),
            "bos_token": templates.special_text(model, model.bos),
            "eos_token": templates.special_text(model, model.eos),
            "build_info": build, "is_sleeping": False}

