"""Google Cloud Vertex AI's custom-container contract, as llama-server serves it.

Vertex AI runs a container with `AIP_MODE=PREDICTION` and sends predictions to one route
(`AIP_PREDICT_ROUTE`, default /predict) as `{"instances": [...]}`; health checks go to
`AIP_HEALTH_ROUTE`, and the server must listen on `AIP_HTTP_PORT`. llama-server
(tools/server/server-http.cpp) answers each instance by the route its `@requestFormat`
names, a path or its camelCase (`chatCompletions` for /v1/chat/completions, the first
route in path order winning a name two share), streaming off, and returns
`{"predictions": [...]}`, an instance that fails holding its error in its place.

Here each instance is handed to that route as a request of its own, with the caller's
headers: the same key check, quotas and limits as if it had been sent alone. At most
MAX_INSTANCES per call, as llama-server.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os

from typing import Any

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from .errors import Refused, error_body, refused
from .routes import owner_of, read_body, served

log = logging.getLogger(__name__)

MAX_INSTANCES = 128


def install(app: FastAPI, environ=os.environ) -> None:
    """The predict route (and the health alias) on `app`, when Vertex AI runs it."""
    if environ.get("AIP_MODE") != "PREDICTION":
        return
    routes = posted_routes(app)
    predict_path = leading_slash(environ.get("AIP_PREDICT_ROUTE") or "/predict")
    if any(r.path == predict_path for r in app.routes if isinstance(r, APIRoute)):
        raise ValueError(f"AIP_PREDICT_ROUTE={predict_path} is one of this server's own routes")
    if environ.get("AIP_HEALTH_ROUTE"):
        health = next(r.endpoint for r in app.routes if isinstance(r, APIRoute) and r.path == "/health")
        app.add_api_route(leading_slash(environ["AIP_HEALTH_ROUTE"]), health, methods=["GET"])

    async def predict(request: Request):
        """The key checked and the body read as on every route; then each instance."""
        who = owner_of(request)
        s = served(request)
        async with s.preparing(who):
            body = await read_body(request, PredictRequest, s)
        done = await asyncio.gather(*(one(request, routes, i) for i in body.instances))
        return {"predictions": done}
    app.add_api_route(predict_path, predict, methods=["POST"])
    log.info("Vertex AI: predictions on POST %s (%d request formats)", predict_path, len(routes))


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instances: list[Any] = Field(max_length=MAX_INSTANCES)
    parameters: Any = None              # Vertex AI's, for all instances: llama-server ignores it too


def posted_routes(app: FastAPI) -> dict[str, APIRoute]:
    """Each POST route by its path and by its camelCase name (the first in path order)."""
    found: dict[str, APIRoute] = {}
    for route in sorted((r for r in app.routes if isinstance(r, APIRoute) and "POST" in r.methods),
                        key=lambda r: r.path):
        found.setdefault(route.path, route)
        found.setdefault(camel_case(route.path), route)
    return found


def camel_case(path: str) -> str:
    """llama-server's name for a route: "/v1/chat/completions" -> "chatCompletions"."""
    stem = path.removeprefix("/v1").split("{")[0]            # up to a path parameter, as llama-server's ':'
    words = [w for w in stem.replace("-", "/").replace("_", "/").split("/") if w]
    return "".join([words[0], *(w[:1].upper() + w[1:] for w in words[1:])]) if words else ""


def leading_slash(path: str) -> str:
    return path if path.startswith("/") else "/" + path


async def one(request: Request, routes: dict[str, APIRoute], instance) -> object:
    """One instance's answer (its route's JSON), or the error it met, in its place."""
    try:
        if not isinstance(instance, dict) or not isinstance(instance.get("@requestFormat"), str):
            raise Refused(400, "each instance must be a JSON object with a string @requestFormat",
                          "invalid_value", "instances")
        payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
        route = routes.get(instance["@requestFormat"])
        if route is None:
            raise Refused(400, f"no route for @requestFormat: {instance['@requestFormat']}", "invalid_value",
                          "@requestFormat")
        if "stream" in payload:
            payload["stream"] = False           # a prediction is one JSON answer
        answer = await route.endpoint(inner_request(request, route.path, payload))
    except Exception as exc:                    # an instance's failure is its prediction
        failure = refused(exc)
        return error_body(failure.status, str(failure), failure.code, failure.param, failure.details)
    if isinstance(answer, Response):
        return json.loads(answer.body) if answer.body else None
    return answer


def inner_request(outer: Request, path: str, payload: dict) -> Request:
    """A request for `path` with the caller's headers and `payload` as its body; it hears
    the caller leave (the route then cancels its work, as for a request of its own)."""
    raw = json.dumps(payload).encode()
    headers = [(k, v) for k, v in outer.scope["headers"] if k not in (b"content-length", b"content-type")]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    scope = {**outer.scope, "path": path, "raw_path": path.encode(), "headers": headers, "query_string": b""}
    sent = False

    async def receive():
        nonlocal sent
        if sent:                        # the body is read: what comes next is the caller leaving
            return await outer.receive()
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}
    return Request(scope, receive)
