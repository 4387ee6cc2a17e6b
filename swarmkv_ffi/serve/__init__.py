"""The OpenAI-compatible server: `swarmkv serve`, `lmxd --http` (docs/serve.md): one or several models.

Lowest first (tests/test_layers.py holds the same order):

    schemas.py    the OpenAI API's request bodies and response objects (pydantic)
    keys.py       API keys and the owners they stand for
    text.py       tokens to text as they come, stop strings
    routing.py    the Ray Serve router, by prefix
    templates.py  a chat through the model's own Jinja template (jinja2's sandbox), tool turns;
                  control tokens only from the template's own text
    guard.py      uvicorn's protocol with a deadline for a request's headers, an idle cap per address
    metrics.py    /metrics in Prometheus' format (prometheus-client): the operator's view, a key's own
    sizing.py     the pool's default --ctx-size (model, memory budget) and the host tier's --host-cache-mib
    telemetry.py  llama-server's timings and prompt progress, for the clients that ask for them
    volatile.py   text that changes on every request at a prompt's head, dropped before templating
    stored.py     responses kept for previous_response_id (the Responses API's store), per key
    churn.py      model churn (loads, unloads) charged to the key that causes it
    lineup.py     the models served, one ModelSpec per id: --model, --models-dir, --models-preset (TOML)
    errors.py     every failure as OpenAI's error JSON (Refused), for the app and on_ray
    settings.py   the server's settings and their flags, written once for every front
    embeddings.py POST /v1/embeddings from a served model
    rerank.py     llama-server's POST /rerank (with --reranking): documents scored against a query
    vertex.py     Google Vertex AI's POST /predict (AIP_MODE=PREDICTION), each instance by its route
    dialects.py   a model family's tool-call form and thoughts (Hermes' <tool_call>, Mistral's
                  [TOOL_CALLS], <think>), told by its template; answers read whole or as they stream
    structured.py response_format, tools and grammar: the grammar a request's output follows
                  (in the model's dialect), and the answer read back as content or tool calls
    hosted.py     one hosted model: its RequestPool, the host-RAM tier below it, how its size was chosen
    loading.py    models loaded on a request's demand under the ledger, unloaded when idle (LRU, keep_alive)
    engine.py     the served models on one conductor; choices in flight per key; draining
    calls.py      one request in flight: its choices on threads, their events for the loop
    responses.py  a call as chat.completion / text_completion objects, whole or streamed
    openai_responses.py  OpenAI's Responses API, as a chat request
    anthropic.py  Anthropic's Messages API, as a chat request
    llama_native.py  llama-server's own routes (/completion, /tokenize, ...) on the same engine
    routes.py     the routes: who asks what, to the engine, and the answer
    app.py        create_app: the routes and the error handlers on FastAPI
    http.py       uvicorn for both fronts; the front on lmxd's conductor (LmxdFront)
    on_ray.py     `--ray`: an ingress and Serve replicas, each a whole server
    cli.py        the `swarmkv serve` command
"""
