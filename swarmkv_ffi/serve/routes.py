"""The routes: each reads who asks and what, hands it to the engine, and answers.

Every route finds the server's state (`Served`: engine, keys, settings) on the app. A
failure anywhere is raised as errors.Refused and shaped by errors.py; nothing here
decides admission, fairness or sharing (the engine's and the conductor's).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import grammar
from . import anthropic, dialects, llama_native, openai_responses, structured, telemetry, templates, volatile
from . import embeddings as embeddings_api
from . import rerank as rerank_api
from .calls import Call
from .engine import ServeEngine
from .hosted import HostedModel
from .errors import Refused, error_response, refused, validated
from .guard import body_over_cap
from .keys import OPEN, Gates, Keys, bearer, presented
from .metrics import CONTENT_TYPE as METRICS_TYPE
from .metrics import render as metrics_text
from .openai_responses import ResponsesRequest
from .responses import ChatShape, CompletionShape, Events, fingerprint
from .schemas import ChatRequest, CompletionRequest, ModelCard, ModelList, ModelStatus, bad_text
from .settings import Settings
from .stored import StoredResponses


#: The prompt's last tokens read for a thought it opens (dialects.opens_thought).
THOUGHT_TAIL = 16
#: The API each POST route speaks, as /metrics counts requests.
API_OF = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/responses": "responses",
          "/responses": "responses", "/v1/messages": "messages"}


@dataclass
class Served:
    """What the routes serve: the engine (every hosted model), the keys and the settings."""
    engine: ServeEngine
    keys: Keys
    settings: Settings
    created: int = field(default_factory=lambda: int(time.time()))
    gates: Gates = field(default_factory=Gates)
    stored: StoredResponses = field(init=False)    # the Responses API's stored responses (from settings)

    def __post_init__(self):
        s = self.settings
        self.stored = StoredResponses(s.stored_responses, s.stored_responses_mib << 20, s.stored_responses_ttl)

    def preparing(self, owner: int) -> asyncio.Semaphore:
        """The owner's gate to read, parse and tokenize a request (keys.Gates)."""
        return self.gates.of(owner)


def served(request: Request) -> Served:
    return request.app.state.served


def owner_of(request: Request) -> int:
    """The owner the request's API key stands for (Authorization or x-api-key); 401
    without a valid one."""
    who = served(request).keys.owner(presented(request.headers))
    if who is None:
        raise Refused(401, "Incorrect API key provided", "invalid_api_key")
    return who


# ---- GET ---------------------------------------------------------------------------------

async def health(request: Request):
    if served(request).engine.stopping:
        return error_response(503, "the server is draining: running requests finish, new ones are refused",
                              "server_draining")
    return {"status": "ok"}


async def metrics(request: Request):
    """Prometheus' scrape: the whole server's figures for the metrics key (or on a server
    without keys), a key's own counters for an API key (metrics.py)."""
    s = served(request)
    who = viewer(request)
    if not s.settings.metrics:
        raise Refused(501, "/metrics is off on this server (--no-metrics)", "not_supported",
                      details={"type": "not_supported_error"})
    return Response(metrics_text(s.engine, who), media_type=METRICS_TYPE,
                    headers={"Process-Start-Time-Unix": str(s.engine.started_unix)})


def viewer(request: Request) -> int | None:
    """Who asks for the server's state: None for the operator (the metrics key, or anyone
    on a server without keys), else the key's owner (a wrong key is a 401)."""
    wanted = served(request).settings.metrics_key
    if wanted is not None and hmac.compare_digest(bearer(presented(request.headers)), wanted.encode()):
        return None
    owner = owner_of(request)
    return None if owner == OPEN else owner


async def models(request: Request):
    """One card per model served, as llama-server's: its ids under `aliases` (any of them
    names it in a request), the first in sorted order as its `id`. The operator also sees
    each one's state (loaded, loading, unloaded, failed: why). A key does not: a model
    going from unloaded to loading within milliseconds of its own request would tell it
    what another key just asked (issue 63)."""
    operator = viewer(request) is None
    s = served(request)
    cards = []
    for entry in s.engine.models.entries:
        card = ModelCard(id=min(entry.names), created=s.created, aliases=list(entry.names),
                         tags=list(entry.spec.tags))
        if operator:
            card.status = ModelStatus(value=entry.state, pinned=entry.spec.pinned)
            if entry.state == "failed":
                card.status.error = str(entry.error)
        cards.append(card)
    return ModelList(data=cards).model_dump()


# ---- POST --------------------------------------------------------------------------------

async def chat(request: Request):
    who = owner_of(request)
    s = served(request)
    async with s.preparing(who):
        body = await read_body(request, ChatRequest, s)
    return await run_chat(request, who, body, lambda name: Events(ChatShape(name)))


async def responses(request: Request):
    """OpenAI's Responses API: the request as a chat request (openai_responses.py), its
    answer as a response object; `previous_response_id` continues a stored conversation."""
    who = owner_of(request)
    s = served(request)
    async with s.preparing(who):
        body = await read_body(request, ResponsesRequest, s)
    earlier = []
    if body.previous_response_id is not None:
        found = s.stored.get(who, body.previous_response_id)
        if found is None:
            raise Refused(400, f"Previous response with id '{body.previous_response_id}' not found (stored "
                          f"responses are kept {s.settings.stored_responses_ttl:g} s, per key)",
                          "previous_response_not_found", "previous_response_id")
        earlier = found.messages
    name = s.engine.resolve(body.model)
    chat_body, turns = openai_responses.to_chat(body, name, earlier)
    return await run_chat(request, who, chat_body,
                          lambda name: openai_responses.ResponsesShape(body, name, who, s.stored, turns))


async def stored_response(request: Request):
    """GET /v1/responses/{id}: one of the key's stored responses."""
    who = owner_of(request)
    found = served(request).stored.get(who, request.path_params["response_id"])
    if found is None:
        raise Refused(404, f"No response with id '{request.path_params['response_id']}' is stored for this key",
                      "not_found", "response_id")
    return found.response


async def delete_response(request: Request):
    who = owner_of(request)
    response_id = request.path_params["response_id"]
    if not served(request).stored.delete(who, response_id):
        raise Refused(404, f"No response with id '{response_id}' is stored for this key", "not_found", "response_id")
    return {"id": response_id, "object": "response", "deleted": True}


async def messages(request: Request):
    """Anthropic's Messages API: the request as a chat request (anthropic.py), its answer
    as a message with content blocks."""
    who = owner_of(request)
    s = served(request)
    async with s.preparing(who):
        body = await read_body(request, anthropic.MessagesRequest, s)
    chat_body = anthropic.to_chat(body, s.engine.resolve(body.model))
    return await run_chat(request, who, chat_body, lambda name: anthropic.MessagesShape(name))


async def count_tokens(request: Request):
    """The prompt a Messages request would make, counted: its input_tokens, cached or not."""
    s = served(request)

    def count(hosted: HostedModel, body) -> dict:
        return {"input_tokens": counted(hosted, anthropic.to_chat(body, s.engine.resolve(body.model)), s.settings)}
    return await with_model(request, anthropic.CountTokensRequest, count)


async def run_chat(request: Request, who: int, body: ChatRequest, shape_for):
    """Run a chat request of `who`'s (whichever API it came in as) and answer in the shape
    shape_for(model id) makes."""
    s = served(request)
    name = s.engine.resolve(body.model)
    use = await s.engine.use(who, name, body.keep_alive)
    try:
        hosted = use.hosted
        async with s.preparing(who):
            tokens, structure = await prepared_chat(hosted, body, s.settings)
        call = Call(s.engine, use, who, body, [tokens],
                    hosted.max_tokens_for([tokens], body.limit(), "messages"), asyncio.get_running_loop(), structure)
    except BaseException:
        use.release()
        raise
    s.engine.tally.asked(who, API_OF.get(request.url.path, "other"))
    return await answer(request, call, shape_for(name))


async def prepared_chat(hosted: HostedModel, body: ChatRequest, settings: Settings):
    """(the prompt's tokens, its Structure): both made on a worker thread (a grammar's
    compile and the template's render never hold the event loop)."""
    structure = await asyncio.to_thread(plan_for, hosted, body)
    tokens = await asyncio.to_thread(chat_tokens, hosted, body, structure, settings.keep_billing_header)
    if structure.dialect.thinks and structure.grammar is None:
        tail = hosted.model.detokenize(tokens[-THOUGHT_TAIL:], unparse_special=True)
        structure.opened = dialects.opens_thought(tail)
    return tokens, structure


def plan_for(hosted: HostedModel, body) -> structured.Structure:
    """The request's Structure in the dialect of the model's template (dialects.py)."""
    return structured.plan(body, hosted.knows_tools, hosted.dialect)


async def completions(request: Request):
    who = owner_of(request)
    s = served(request)
    async with s.preparing(who):
        body = await read_body(request, CompletionRequest, s)
        if body.echo or body.suffix:
            raise Refused(400, "echo and suffix are not supported", "unsupported_parameter",
                          "echo" if body.echo else "suffix")
    return await run_completion(request, who, body, lambda name, model: Events(CompletionShape(name)))


async def native_completion(request: Request):
    """llama-server's POST /completion (and /completions): llama_native.py."""
    who = owner_of(request)
    s = served(request)
    async with s.preparing(who):
        native = await read_body(request, llama_native.NativeCompletion, s)
        body = native.as_completion()
    return await run_completion(request, who, body,
                                lambda name, model: llama_native.NativeShape(name, model.detokenize,
                                                                             native.response_fields),
                                prepare=native.with_model)


async def run_completion(request: Request, who: int, body: CompletionRequest, shape_for, prepare=None):
    """Run a text completion of `who`'s and answer in the shape shape_for(model id, model)
    makes (OpenAI's or llama-server's); prepare(model, body), if given, finishes the body
    with the model at hand (on the worker thread), before its prompts are tokenized."""
    s = served(request)
    name = s.engine.resolve(body.model)
    use = await s.engine.use(who, name, body.keep_alive)
    try:
        hosted = use.hosted
        async with s.preparing(who):
            if prepare is not None:
                body = await asyncio.to_thread(prepare, hosted.model, body)
            structure = await asyncio.to_thread(structured.plan, body)
            prompts = await asyncio.to_thread(completion_tokens, hosted, body, structure)
        call = Call(s.engine, use, who, body, prompts, hosted.max_tokens_for(prompts, body.limit(), "prompt"),
                    asyncio.get_running_loop(), structure)
    except BaseException:
        use.release()
        raise
    s.engine.tally.asked(who, "completions")
    return await answer(request, call, shape_for(name, hosted.model))


async def embeddings(request: Request):
    """OpenAI's POST /v1/embeddings (embeddings.py): a unit vector per input."""
    name, body, inputs, vectors = await pooled(request, "embeddings", embeddings_api.EmbeddingsRequest,
                                               embeddings_api.tokens_of, lambda hosted: hosted.embedder().embed)
    return embeddings_api.answer(name, vectors, sum(map(len, inputs)), body.encoding_format)


async def rerank(request: Request):
    """llama-server's POST /rerank (rerank.py): the documents scored against the query,
    best first; 501 unless the server runs with --reranking, as llama-server's."""
    if not served(request).settings.reranking:
        owner_of(request)
        raise Refused(501, "This server does not support reranking. Start it with `--reranking`", "not_supported",
                      details={"type": "not_supported_error"})

    def scorer(hosted):
        rerank_api.warn_without_head(hosted.model, hosted.name)
        return hosted.embedder(rank=True).pooled
    name, body, inputs, scores = await pooled(request, "rerank", rerank_api.RerankRequest, rerank_api.tokens_of,
                                              scorer)
    return rerank_api.answer(name, body, scores, sum(map(len, inputs)))


async def pooled(request: Request, api: str, schema, tokens_of, runner):
    """The path embeddings and rerank share: the body read and its inputs tokenized off the
    loop, then `runner(hosted)` run over them (and the key, which takes its turns at the
    context) on a worker thread, counted as one choice in flight of the key's while it
    runs. Returns the model's id, the body, the inputs and what the runner gave."""
    who = owner_of(request)
    s = served(request)
    async with s.preparing(who):
        body = await read_body(request, schema, s)
    name = s.engine.resolve(body.model)
    use = await s.engine.use(who, name, None)
    try:
        async with s.preparing(who):
            inputs = await asyncio.to_thread(tokens_of, use.hosted.model, body)
        s.engine.admit(who, 1)
        try:
            run = await asyncio.to_thread(runner, use.hosted)
            out = await asyncio.to_thread(run, inputs, who)
        finally:
            s.engine.leave(who, 1)
    finally:
        use.release()
    s.engine.tally.asked(who, api)
    return name, body, inputs, out


async def chat_input_tokens(request: Request):
    """llama-server's POST /chat/completions/input_tokens: the prompt a chat request makes, counted."""
    def count(hosted: HostedModel, body: ChatRequest) -> dict:
        return {"input_tokens": counted(hosted, body, served(request).settings)}
    return await with_model(request, ChatRequest, count)


async def apply_template(request: Request):
    """llama-server's POST /apply-template: the prompt a chat request's messages make, as
    text (nothing runs)."""
    def render(hosted: HostedModel, body: ChatRequest) -> dict:
        keep = served(request).settings.keep_billing_header
        return {"prompt": chat_prompt(hosted, body, plan_for(hosted, body), keep)}
    return await with_model(request, ChatRequest, render)


async def tokenize(request: Request):
    """llama-server's POST /tokenize: the content's token ids (with their pieces when asked)."""
    def tokens(hosted: HostedModel, body) -> dict:
        check_length(hosted, len(body.content), "content")
        return llama_native.tokenize(hosted.model, body)
    return await with_model(request, llama_native.TokenizeRequest, tokens)


async def detokenize(request: Request):
    """llama-server's POST /detokenize: the tokens' text."""
    def text(hosted: HostedModel, body) -> dict:
        check_vocabulary(hosted.model.n_vocab, {"tokens": body.tokens})
        return {"content": hosted.model.detokenize(body.tokens)}
    return await with_model(request, llama_native.DetokenizeRequest, text)


async def props(request: Request):
    """llama-server's GET /props: the settings of the model `?model=` names (or the one
    served), held loaded while they are read, as any request of the key's would."""
    who = owner_of(request)
    s = served(request)
    name = s.engine.resolve(request.query_params.get("model"))
    use = await s.engine.use(who, name, None)
    try:
        return llama_native.props(name, use.hosted, fingerprint())
    finally:
        use.release()


async def not_supported(request: Request):
    """llama-server's GET /slots and POST /props: refused as llama-server refuses them
    when they are off. Requests share one pool here, not slots, and a slot's listing would
    show one key the prompts of another."""
    owner_of(request)
    raise Refused(501, f"{request.method} {request.url.path} is not supported by this server: requests share one "
                  "pool (no slots to list), and its settings do not change over HTTP", "not_supported",
                  details={"type": "not_supported_error"})


def counted(hosted: HostedModel, body: ChatRequest, settings: Settings) -> int:
    """The tokens of the prompt a chat request makes (the tools told, as it would run)."""
    structure = plan_for(hosted, body)
    return len(chat_tokens(hosted, body, structure, settings.keep_billing_header))


async def with_model(request: Request, schema, work):
    """The routes that only read a model (count, render, tokenize): the body as `schema`,
    its model held loaded, work(hosted, body) run on a worker thread under the key's gate."""
    who = owner_of(request)
    s = served(request)
    async with s.preparing(who):
        body = await read_body(request, schema, s)
    use = await s.engine.use(who, s.engine.resolve(body.model), None)
    try:
        async with s.preparing(who):
            return await asyncio.to_thread(work, use.hosted, body)
    finally:
        use.release()


# ---- what the POST routes share -------------------------------------------------------------

def declared_length(request: Request) -> int | None:
    """The body's Content-Length, if it gives a number."""
    size = request.headers.get("content-length")
    return int(size) if size is not None and size.isdigit() else None


async def capped_body(request: Request, max_body_bytes: int) -> bytes:
    """The request's body, or 413 as soon as it is known to be over the cap (its
    Content-Length, else the bytes read so far): a huge body is never held whole."""
    size = declared_length(request)
    if size is not None and size > max_body_bytes:
        raise Refused(413, body_over_cap(size, max_body_bytes), "body_too_large")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_body_bytes:
            raise Refused(413, f"the body is over {max_body_bytes} bytes (--max-body-bytes)", "body_too_large")
    return bytes(raw)


async def read_body(request: Request, schema, s: Served):
    """The body as `schema`: read within --read-timeout (else 408), parsed and checked
    on a worker thread (an 8 MiB body parsed on the event loop froze every stream). A
    body too long to hold text that fits the context is refused unread, from its
    Content-Length."""
    settings = s.settings
    size = declared_length(request)
    bound = body_bound(s.engine)
    if size is not None and bound is not None and bound[0] < size <= settings.max_body_bytes:
        raise Refused(400, f"the body is {size} bytes: no text this long fits the context of "
                      f"{bound[1]} tokens", "context_length_exceeded")
    try:
        async with asyncio.timeout(settings.read_timeout):
            raw = await capped_body(request, settings.max_body_bytes)
    except TimeoutError:
        raise Refused(408, f"the body did not arrive within {settings.read_timeout:g} s (--read-timeout)",
                      "request_timeout") from None
    return sampling_defaults(await asyncio.to_thread(parse_body, raw, schema), settings)


def sampling_defaults(body, settings: Settings):
    """The body with the server's --temp and --seed where it gives no temperature or seed
    of its own (llama-server's defaults for every request); bodies without those fields as
    they are."""
    fields = type(body).model_fields
    seed = settings.seed if settings.seed is not None and settings.seed >= 0 else None    # -1: random, as there
    update = {name: value for name, value in (("temperature", settings.temperature), ("seed", seed))
              if value is not None and name in fields and name not in body.model_fields_set}
    return body.model_copy(update=update) if update else body


def body_bound(engine: ServeEngine) -> tuple[int, int] | None:
    """(the most bytes a body can take whose text could fit the context of some served
    model, that largest context): every character as a 6-byte JSON escape, and 1 MiB for
    the rest (schemas, token lists, fields). None while a model has never been loaded:
    its vocabulary is not known (its check_length still runs before tokenizing)."""
    bounds = engine.bounds()
    if bounds is None:
        return None
    return max(6 * (ctx + 1) * longest for ctx, longest in bounds) + (1 << 20), max(ctx for ctx, _ in bounds)


def parse_body(raw: bytes, schema):
    try:
        body = json.loads(raw)
        bad = bad_text(body)
        if bad is not None:
            raise Refused(400, f"{bad[0]}: the text {bad[1]}", "invalid_text", bad[0] or None)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Refused(400, f"the body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:
        raise Refused(400, "the body is nested too deeply to parse", "invalid_json") from None
    return validated(schema, body)


def check_vocabulary(n_vocab: int, ids: dict[str, list[int]]) -> None:
    """400 naming the field when a token id the body names is not in the model's vocabulary."""
    for field_name, tokens in ids.items():
        bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise Refused(400, f"{field_name}: token {bad} is not in the model's vocabulary (ids 0..{n_vocab - 1})",
                          "invalid_token", field_name)


def chat_tokens(hosted: HostedModel, body: ChatRequest, structure: structured.Structure,
                keep_billing_header: bool = False) -> list[int]:
    """The messages (a billing header dropped, volatile.py; the tools told, structured.py)
    through the model's chat template, as tokens; the grammar checked against the
    vocabulary. Off the event loop: a body of megabytes takes a while."""
    model = hosted.model
    check_vocabulary(model.n_vocab, body.vocabulary_ids())
    messages = chat_messages(hosted, body, structure, keep_billing_header)
    check_grammar(model, structure)
    with template_errors():
        return templates.tokens(model, messages, structure.tools, hosted.chat_template,
                                hosted.template_variables(body))


def chat_prompt(hosted: HostedModel, body: ChatRequest, structure: structured.Structure,
                keep_billing_header: bool = False) -> str:
    """The text chat_tokens() tokenizes (llama-server's /apply-template)."""
    messages = chat_messages(hosted, body, structure, keep_billing_header)
    with template_errors():
        return templates.render(hosted.model, messages, structure.tools, template=hosted.chat_template,
                                variables=hosted.template_variables(body))


def chat_messages(hosted: HostedModel, body: ChatRequest, structure: structured.Structure,
                  keep_billing_header: bool) -> list[dict]:
    """The messages the template renders, their length checked against the context."""
    said = [m.for_template() for m in body.messages]
    if not keep_billing_header:
        said = volatile.steady(said)
    messages = structure.messages(said, hosted.knows_tools)
    check_length(hosted, sum(len(t) for t in templates.message_texts(messages)), "messages")
    return messages


@contextmanager
def template_errors():
    """A template that cannot render the messages: 400 naming them."""
    try:
        yield
    except templates.TemplateError as exc:
        raise Refused(400, str(exc), "invalid_request_error", "messages") from None


def completion_tokens(hosted: HostedModel, body: CompletionRequest,
                      structure: structured.Structure) -> list[list[int]]:
    """The prompts as tokens (a prompt given as tokens as it is), every token id the body
    names and the grammar checked."""
    model = hosted.model
    check_vocabulary(model.n_vocab, body.vocabulary_ids())
    for p in body.prompts():
        check_length(hosted, len(p), "prompt")
    prompts = [p if isinstance(p, list) else [int(t) for t in model.tokenize(p, add_special=True)]
               for p in body.prompts()]
    if not all(prompts):
        raise Refused(400, "the prompt is empty", "empty_prompt", "prompt")
    check_grammar(model, structure)
    return prompts


def check_length(hosted: HostedModel, n: int, what: str) -> None:
    """400 without tokenizing when `n` characters (or tokens) cannot fit the context
    whatever they say: tokenizing 8 MiB of text took a core from everyone's decodes for
    seconds, and nobody was charged for it."""
    longest = templates.longest_token(hosted.model)
    if n > (hosted.max_context + 1) * longest:
        raise Refused(400, f"{what}: {n} characters cannot fit the context of {hosted.max_context} tokens "
                      f"(no token spells more than {longest} characters)", "context_length_exceeded", what)


def check_grammar(model, structure: structured.Structure) -> None:
    """Compile the grammar for the model once (on the worker thread that builds the
    prompt): every choice starts from a copy of it."""
    if structure.grammar is not None:
        try:
            structure.compiled = grammar.Compiled(model, structure.grammar)
        except grammar.GrammarError as exc:
            raise Refused(400, f"{structure.param}: {exc}", "invalid_grammar", structure.param) from None


async def answer(request: Request, call: Call, shape):
    """Run the call: a stream of events, or, once every choice has ended, the whole
    response (a client that leaves first cancels its choices). `shape` writes both, in
    its API's form (responses.Events, openai_responses, anthropic)."""
    call.start()
    headers = getattr(shape, "headers", None)
    if call.body.stream:
        return Stream(call, stream_events(call, shape), headers)
    watcher = asyncio.create_task(watch_disconnect(request, call))
    try:
        async for _ in call.events():
            pass
    finally:
        watcher.cancel()
    failed = call.failure()
    if failed is not None:
        raise failed
    whole = shape.whole(call)
    asked = getattr(call.body, "verbose", None)          # the request's say, else --verbose-answers
    if (asked if asked is not None else served(request).settings.verbose_answers) and isinstance(whole, dict):
        whole["__verbose"] = telemetry.verbose(call)
    return JSONResponse(whole, headers=headers)


async def watch_disconnect(request: Request, call: Call) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)
    call.cancel()        # the client left: its choices roll back, the others go on


class Stream(StreamingResponse):
    """A call's events as server-sent events. However the response ends (sent whole, the
    client gone, cut off by guard.py's send deadline), the call hears it is done with:
    until then its choices count against the key, so output nobody reads stays bounded
    by the key's quota."""

    def __init__(self, call: Call, events, headers):
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.call = call

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.call.sent()


async def stream_events(call: Call, shape):
    for event in shape.opening(call):
        yield event
    async for kind, choice, value in call.events():
        if choice.error is not None and kind == "end":
            yield shape.error(refused(choice.error))
            continue
        if kind == "progress":
            events = shape.progress(call, choice, value)
        else:
            events = shape.piece(call, choice, value) if kind == "text" else shape.ending(call, choice)
        for event in events:
            yield event
    for event in shape.closing(call):
        yield event
