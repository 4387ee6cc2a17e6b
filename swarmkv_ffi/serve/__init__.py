"""The OpenAI-compatible server: `swarmkv serve`, `lmxd --http` (docs/serve.md).

Lowest first (tests/test_layers.py holds the same order):

    schemas.py    the OpenAI API's request bodies and response objects (pydantic)
    keys.py       API keys and the owners they stand for
    text.py       tokens to text as they come, stop strings
    routing.py    the Ray Serve router, by prefix
    persist.py    shared prefixes on disk: the conductor's PrefixStore on the prefix cache
    errors.py     every failure as OpenAI's error JSON (Refused), for the app and on_ray
    settings.py   the server's settings and their flags, written once for every front
    engine.py     the served model on a conductor's RequestPool; choices in flight per key
    calls.py      one request in flight: its choices on threads, their events for the loop
    responses.py  a call as chat.completion / text_completion objects, whole or streamed
    routes.py     the routes: who asks what, to the engine, and the answer
    app.py        create_app: the routes and the error handlers on FastAPI
    http.py       uvicorn for both fronts; the front on lmxd's conductor (LmxdFront)
    on_ray.py     `--ray`: an ingress and Serve replicas, each a whole server
    cli.py        the `swarmkv serve` command
"""
