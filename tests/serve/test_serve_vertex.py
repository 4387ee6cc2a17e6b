"""Google Vertex AI's contract (serve/vertex.py, issue 64) on a real server started as
Vertex starts it (AIP_MODE=PREDICTION): instances answered by the route their
@requestFormat names, a failed one holding its error in its place, the key checked as on
every route, the health alias; and the route names as llama-server derives them."""
from __future__ import annotations

import os

import pytest
import requests

from serve_process import Serve

KEY = "key-vertex-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vertex")
    keys = folder / "keys"
    keys.write_text(f"{KEY} vertex\n")
    saved = dict(os.environ)
    os.environ.update(AIP_MODE="PREDICTION", AIP_HEALTH_ROUTE="ping", AIP_PREDICT_ROUTE="/predict")
    try:
        with Serve("--ctx-size", "1024", "--api-key-file", str(keys), log=folder / "serve.log") as s:
            yield s
    finally:
        os.environ.clear()
        os.environ.update(saved)


def predict(server, instances, key: str | None = KEY) -> requests.Response:
    return requests.post(server.url + "/predict", json={"instances": instances}, timeout=120,
                         headers={"Authorization": f"Bearer {key}"} if key else {})


@pytest.mark.slow
def test_each_instance_is_answered_by_the_route_it_names(server):
    chat = {"max_tokens": 4, "messages": [{"role": "user", "content": "Say hello"}]}
    got = predict(server, [{"@requestFormat": "chatCompletions", **chat},
                           {"@requestFormat": "/v1/completions", "prompt": "Hi", "max_tokens": 3, "stream": True},
                           {"@requestFormat": "tokenize", "content": "hello"},
                           {"@requestFormat": "nowhere"}, 5,
                           {"@requestFormat": "chatCompletions", "messages": []}])
    assert got.status_code == 200
    answers = got.json()["predictions"]
    assert answers[0]["object"] == "chat.completion" and answers[0]["choices"][0]["message"]["role"] == "assistant"
    assert answers[1]["object"] == "text_completion" and answers[1]["usage"]["completion_tokens"] == 3
    assert answers[2]["tokens"]
    assert "nowhere" in answers[3]["error"]["message"] and "@requestFormat" in answers[4]["error"]["message"]
    assert answers[5]["error"]["param"] == "messages"


@pytest.mark.slow
def test_the_key_is_checked_and_instances_are_bounded(server):
    assert predict(server, [{"@requestFormat": "tokenize", "content": "hi"}], key=None).status_code == 401
    assert predict(server, [{"@requestFormat": "tokenize", "content": "hi"}] * 129).status_code == 400
    assert requests.get(server.url + "/ping", timeout=30).json() == {"status": "ok"}


def test_route_names_are_llama_servers():
    from swarmkv_ffi.serve.vertex import camel_case
    assert camel_case("/v1/chat/completions") == "chatCompletions"
    assert camel_case("/apply-template") == "applyTemplate"
    assert camel_case("/v1/messages/count_tokens") == "messagesCountTokens"
    assert camel_case("/v1/responses/{response_id}") == "responses"


def test_nothing_is_added_unless_vertex_runs_the_server():
    from fastapi import FastAPI
    from swarmkv_ffi.serve.vertex import install
    app = FastAPI()
    before = len(app.routes)
    install(app, environ={})
    assert len(app.routes) == before
