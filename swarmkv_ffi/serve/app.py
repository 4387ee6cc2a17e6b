"""The HTTP app: OpenAI's routes (routes.py) on FastAPI, errors in OpenAI's shape (errors.py).

    GET  /health                 200 {"status": "ok"}, 503 while stopping
    GET  /metrics                Prometheus' text format (metrics.py says who sees what)
    GET  /v1/models              the served model
    POST /v1/chat/completions    chat, whole or streamed (server-sent events)
    POST /v1/completions         text completion, whole or streamed
    POST /v1/embeddings          a unit vector per input (embeddings.py)
    POST /v1/responses           OpenAI's Responses API (openai_responses.py), whole or streamed
    GET, DELETE /v1/responses/{response_id}   a stored response of the key's
    POST /v1/messages            Anthropic's Messages API (anthropic.py), whole or streamed
    POST /v1/messages/count_tokens            the prompt a message request would make, counted
    POST /apply-template, /completion, /completions, /tokenize, /detokenize   llama-server's own
         (llama_native.py); /health, /models, /chat/completions, /responses without /v1 too
    POST /rerank (/reranking, /v1/rerank, /v1/reranking)   llama-server's, with --reranking (rerank.py)
    POST /predict                Google Vertex AI's, when AIP_MODE=PREDICTION (vertex.py)
"""
from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import PlainTextResponse

from . import errors, routes, vertex
from .engine import ServeEngine
from .keys import Keys
from .settings import Settings


def create_app(engine: ServeEngine, keys: Keys, settings: Settings) -> FastAPI:
    app = FastAPI(title="swarmkv serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = routes.Served(engine, keys, settings)
    errors.install(app)
    for prefix in ("", "/v1"):          # llama-server answers these without /v1 too
        app.add_api_route(f"{prefix}/health", routes.health, methods=["GET"])
        app.add_api_route(f"{prefix}/models", routes.models, methods=["GET"])
        app.add_api_route(f"{prefix}/chat/completions", routes.chat, methods=["POST"])
        app.add_api_route(f"{prefix}/chat/completions/input_tokens", routes.chat_input_tokens, methods=["POST"])
        app.add_api_route(f"{prefix}/responses", routes.responses, methods=["POST"])
        app.add_api_route(f"{prefix}/embeddings", routes.embeddings, methods=["POST"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", routes.stored_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", routes.delete_response, methods=["DELETE"])
    app.add_api_route("/v1/messages", routes.messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"])
    app.add_api_route("/apply-template", routes.apply_template, methods=["POST"])
    for path in ("/completion", "/completions"):        # llama-server's native completion (llama_native.py)
        app.add_api_route(path, routes.native_completion, methods=["POST"])
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):   # as llama-server names it
        app.add_api_route(path, routes.rerank, methods=["POST"])
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    app.add_api_route("/props", routes.props, methods=["GET"])
    app.add_api_route("/props", routes.not_supported, methods=["POST"])
    app.add_api_route("/slots", routes.not_supported, methods=["GET"])
    vertex.install(app)                 # Google Vertex AI's /predict, when it runs the server
    add_middleware(app, settings.cors_origins)
    return app


#: What `--cors-origins localhost` allows: a page served from this machine, on any port.
LOCALHOST = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def add_middleware(app: FastAPI, cors_origins: str | None) -> None:
    """What both fronts (this app and the Ray ingress) wrap their routes in: CORS for the
    pages --cors-origins names (none: no CORS at all)."""
    if cors_origins:
        app.add_middleware(Cors, **cors(cors_origins))


class Cors(CORSMiddleware):
    """Starlette's CORS, except that a preflight it refuses (an origin, method or header not
    allowed) is answered 200 with no Access-Control-Allow-* header, as llama-server answers it,
    instead of 400: the browser refuses the call either way, and a page written against
    llama-server sees the same answer. The body still says what was refused."""

    def preflight_response(self, request_headers):
        answer = super().preflight_response(request_headers)
        if answer.status_code == 200:
            return answer
        return PlainTextResponse(answer.body, status_code=200, headers={"Vary": answer.headers["vary"]})


def cors(origins: str) -> dict:
    """Starlette's CORSMiddleware settings for --cors-origins (a list, `localhost`, `*`):
    the methods and headers llama-server allows, no cookies (the key is a header)."""
    named = [o.strip() for o in origins.split(",") if o.strip()]
    local = "localhost" in named
    named = [o for o in named if o != "localhost"]
    return {"allow_origins": named, "allow_origin_regex": LOCALHOST if local else None,
            "allow_methods": ["GET", "POST", "DELETE", "OPTIONS"], "allow_headers": ["*"]}
