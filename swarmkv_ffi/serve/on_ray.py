"""`swarmkv serve --ray`: the same OpenAI API on Ray Serve, R replicas routed by prefix.

    client ──HTTP──▶ Serve's proxy (127.0.0.1 on one machine) ──▶ Ingress: reads the body
        ──handle call, routed by prefix (routing.py)──▶ Replica: a whole `swarmkv serve`
          app (engine, keys, limits, errors) answering in its process

The router sends a request where the longest start of it went before, so the requests
over one document reach the replica whose pool already holds that document; a request
whose replica has --route-imbalance more requests in flight than the least loaded one
goes there instead, so one hot document cannot pin all traffic to one replica.
`--route load` keeps Serve's default router (power of two choices by queue length), the
benchmark's baseline.

A stored response (the Responses API's `previous_response_id`) lives on the replica that
answered it: the replica names it in its answer's headers (RESPONSE_HEADER), the ingress
remembers which replica that was, and a request continuing it is routed there first.

A replica that dies: a request that has received nothing yet is retried once (the router
picks a live replica); one that has streamed part of its answer ends with an error event
(503); Serve starts a new replica. Everything the replica does (keys, 4xx errors, quotas)
is the single server's own code, so the two answer alike.
"""

import asyncio
import hashlib
import json
import logging
import signal
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray.exceptions import RayActorError      # a replica that died, or whose node went

from .errors import Refused, error_body, refused_response
from .keys import presented
from .openai_responses import RESPONSE_HEADER
from .responses import sse
from .routes import capped_body
from .settings import Settings

log = logging.getLogger("swarmkv.serve")

REPLICA_HEADER = "x-swarmkv-replica"
#: Stored responses whose replica the ingress remembers (the oldest forgotten first).
REMEMBERED_RESPONSES = 65536


@dataclass
class Forwarded:
    """One HTTP request as the ingress hands it on. `prompt` is what the prefix router
    reads (an attribute of that name): the text the request starts with."""
    method: str
    path: str
    query: bytes
    headers: list[tuple[str, str]]
    body: bytes
    prompt: str = ""
    choices: int = 1          # n x prompts, as the ingress counts them against the key's quota
    continues: str | None = None    # the stored response (previous_response_id) this request continues
    replica: str | None = None      # the replica holding it (set by the ingress): routed there first

    @classmethod
    def of(cls, method: str, path: str, query: bytes, headers, body: bytes, shared: bool = False) -> "Forwarded":
        """`shared` (--share-prefixes): keys may share cells, so they share routes too;
        otherwise the route is keyed by the caller's key, so which replica answers never
        tells one key what another asked (the pools keep keys apart the same way)."""
        headers = list(headers)
        parsed = _parsed(body)
        text = routing_text(path, parsed)
        if not shared:
            key = presented({k.lower(): v for k, v in headers}) or ""
            text = hashlib.blake2b(key.encode(), digest_size=8).hexdigest() + "\n" + text
        continues = parsed.get("previous_response_id")
        stored = path.rstrip("/").rpartition("/responses/")[2] if "/responses/" in path else None
        continues = stored or continues       # GET or DELETE of a stored response: to its replica
        return cls(method, path, query, headers, body, text, choices_of(parsed),
                   continues if isinstance(continues, str) else None)


def _parsed(body: bytes) -> dict:
    """The body as a dict, or {} (the replica refuses what is not one, in its words)."""
    try:
        parsed = json.loads(body) if body else {}
    except (ValueError, RecursionError):
        parsed = {}
    return parsed if isinstance(parsed, dict) else {}


def choices_of(parsed: dict) -> int:
    """n x prompts: the choices a request runs (at least 1; the replica checks the fields)."""
    n = parsed.get("n")
    n = n if isinstance(n, int) and n > 0 else 1
    prompt = parsed.get("prompt")
    many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    return n * (len(prompt) if many else 1)


def routing_text(path: str, parsed: dict) -> str:
    """The text a request's prompt starts with: its system prompt or instructions, then
    its messages' or input items' contents in order (chat, Messages, Responses), its
    prompt (a completion); never empty (the router divides by its length), so a request
    without one (GET /health, a malformed body the replica will refuse) is its path."""
    messages, prompt = parsed.get("messages", parsed.get("input")), parsed.get("prompt")
    head = _content(parsed.get("system")) + _content(parsed.get("instructions"))
    if isinstance(messages, str):
        text = head + messages
    elif isinstance(messages, list):
        text = head + "".join(_content(m.get("content")) for m in messages if isinstance(m, dict))
    elif isinstance(prompt, list):
        text = next((p for p in prompt if isinstance(p, str)), "")
    else:
        text = prompt if isinstance(prompt, str) else ""
    return text or path


def _content(content) -> str:
    """A message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


async def call_app(app, request: Forwarded):
    """Run one request through an ASGI app in this process. Yields ("start", status,
    headers) and then the body's chunks. When the caller stops listening (the client
    left), the app is told the client disconnected."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    given = False

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
             "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
             "query_string": request.query, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers]}
    task = asyncio.create_task(app(scope, receive, sent.put))
    try:
        while True:
            message = await _next_message(sent, task)
            if message["type"] == "http.response.start":
                yield ("start", message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                                    for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    return
    finally:
        gone.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), 30)
        except BaseException:
            task.cancel()


async def _next_message(sent: asyncio.Queue, task: asyncio.Task) -> dict:
    getter = asyncio.ensure_future(sent.get())
    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    task.result()                       # the app raised: that error, here
    raise RuntimeError("the app ended without sending its whole response")


class Replica:
    """A Serve replica: one `swarmkv serve` app over its own engine, on its node's cores."""

    def __init__(self, settings: Settings, keys: dict[str, str], threads: int, budget_bytes: int | None,
                 batch_size: int = 512):
        from ray import serve

        from .app import create_app
        from .engine import ServeEngine
        from .keys import Keys
        keys = Keys(keys)
        self.engine = ServeEngine(settings, keys, threads=threads, budget_bytes=budget_bytes, batch_size=batch_size)
        self.app = create_app(self.engine, keys, self.engine.settings)
        self.id = serve.get_replica_context().replica_id.unique_id

    async def __call__(self, request: Forwarded):
        """The app's response; its start says which replica answered (x-swarmkv-replica)."""
        async for part in call_app(self.app, request):
            if isinstance(part, tuple):
                part = (*part[:2], [*part[2], (REPLICA_HEADER, self.id)])
            yield part

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def ingress(settings: Settings, keys: dict[str, str]):
    """The ingress deployment: takes any request, checks its key before it reads the body
    (capped, within --read-timeout, two of a key's at a time as the single server does),
    counts the key's choices against its quota across every replica, and hands it to a
    replica, retrying once on another when the first died before answering. The body is
    parsed (to route it) on a worker thread."""
    from ray import serve

    from .keys import Gates, Keys
    api = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    from .app import add_middleware
    add_middleware(api, settings.cors_origins)

    @serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    @serve.ingress(api)
    class Ingress:
        def __init__(self, replicas):
            self.replicas = replicas.options(stream=True)
            self.keys = Keys(keys)
            self.per_key = settings.per_key(len(keys))
            self.running: dict[int, int] = {}       # owner -> choices in flight, on every replica
            self.gates = Gates()                    # owner -> bodies read and parsed at once
            self.made: OrderedDict[tuple[int | None, str], str] = OrderedDict()   # (owner, response id) -> replica

        @api.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
        async def forward(self, request: Request, path: str):
            public = path in ("health", "v1/health")
            who = self.keys.owner(presented(request.headers)) if not public else None
            if who is None and not public:
                return refused_response(Refused(401, "Incorrect API key provided", "invalid_api_key"))
            try:
                async with self.gates.of(who):
                    forwarded = await self._read(request)
                    self._admit(who, forwarded.choices)
                forwarded.replica = self.made.get((who, forwarded.continues))
            except Refused as exc:
                return refused_response(exc, request.url.path)
            except TimeoutError:
                return refused_response(Refused(408, "the body did not arrive within --read-timeout",
                                                "request_timeout"), request.url.path)
            try:
                return await self._send(forwarded, who)
            except BaseException:
                self._leave(who, forwarded.choices)
                raise

        async def _read(self, request: Request) -> Forwarded:
            async with asyncio.timeout(settings.read_timeout):
                body = await capped_body(request, settings.max_body_bytes)
            return await asyncio.to_thread(Forwarded.of, request.method, request.url.path,
                                           request.url.query.encode(), request.headers.items(), body,
                                           settings.share_prefixes)

        def _admit(self, who: int | None, choices: int) -> None:
            if who is None:
                return
            mine = self.running.get(who, 0)
            if choices > self.per_key:
                raise Refused(400, f"this request asks for {choices} choices (n x prompts); a key may run at "
                              f"most {self.per_key} at once (--max-requests-per-key): split it",
                              "too_many_choices", "n")
            if mine + choices > self.per_key:
                raise Refused(429, f"this key has {mine} choices running; the limit per key is {self.per_key} "
                              "(--max-requests-per-key), across every replica", "rate_limit_exceeded")
            self.running[who] = mine + choices

        def _remember(self, who: int | None, headers) -> None:
            """A stored response's replica, from its answer's headers (the key's own: another
            key naming the id is not routed by it, and its replica refuses it anyway)."""
            made = dict((k.lower(), v) for k, v in headers)
            if RESPONSE_HEADER in made and REPLICA_HEADER in made:
                self.made[who, made[RESPONSE_HEADER]] = made[REPLICA_HEADER]
                if len(self.made) > REMEMBERED_RESPONSES:
                    self.made.popitem(last=False)

        def _leave(self, who: int | None, choices: int) -> None:
            if who is not None:
                self.running[who] -= choices

        async def _send(self, forwarded: Forwarded, who: int | None):
            for attempt in range(2):
                stream = self.replicas.remote(forwarded)
                try:
                    _, status, headers = await stream.__anext__()
                except RayActorError:
                    log.warning("serve --ray: a replica died before answering; %s",
                                "retrying on another" if attempt == 0 else "giving up")
                    continue
                self._remember(who, headers)
                release = once(lambda: self._leave(who, forwarded.choices))
                body = self.rest(stream, headers, release)
                weakref.finalize(body, release)     # a response never sent (the client left first)
                return StreamingResponse(body, status_code=status,
                                         headers={k: v for k, v in headers if k.lower() != "content-length"})
            self._leave(who, forwarded.choices)
            return refused_response(Refused(503, "the replicas that took this request died; try again",
                                            "replica_lost"), forwarded.path)

        async def rest(self, stream, headers, release):
            try:
                async for chunk in stream:
                    yield chunk
            except RayActorError:
                if any(k.lower() == "content-type" and "event-stream" in v for k, v in headers):
                    yield sse(error_body(503, "the replica answering this request died", "replica_lost"))
            finally:
                release()               # the key's choices are no longer in flight
    return Ingress


def once(action):
    """`action`, run by the first call only."""
    done = threading.Lock()

    def run() -> None:
        if done.acquire(blocking=False):
            action()
    return run


def application(args, settings: Settings, keys: dict[str, str]):
    """The Serve application `swarmkv serve --ray` runs: the ingress bound to --replicas
    replicas, each a whole server with `settings` on --threads CPUs (one by default),
    routed as --route says."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .routing import PrefixRouter
    threads = args.threads or 1                 # the CPUs each replica asks Ray for, and uses
    options = dict(name="engine", num_replicas=args.replicas, ray_actor_options={"num_cpus": threads},
                   max_ongoing_requests=settings.max_requests, health_check_period_s=2)
    if args.route == "prefix":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixRouter, request_router_kwargs={"imbalance": args.route_imbalance})
    replica = serve.deployment(**options)(Replica).bind(settings, keys, threads, args.budget_bytes, args.batch_size)
    return ingress(settings, keys).bind(replica)


def run(args, settings: Settings, keys: dict[str, str]) -> int:
    """Connect to (or start) Ray, run the application until SIGINT/SIGTERM, shut it down."""
    from ray import serve

    from ..distributed import connect
    connect(None if args.ray == "local" else args.ray)
    serve.start(http_options={"host": args.host, "port": args.port, "location": "HeadOnly"})
    serve.run(application(args, settings, keys), name="swarmkv", route_prefix="/")
    print(f"swarmkv serve: {settings.served_names} on Ray Serve, {args.replicas} replicas routed by "
          f"{args.route}, on http://{args.host}:{args.port}/v1", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    return 0
