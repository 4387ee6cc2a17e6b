"""Benchmark harnesses (also `swarmkv bench …`). They print figures and write JSON/CSV/PNG
into one output folder; tests never assert timings.

    measure.py  shared helpers: peak RSS, documents, settings and build into the JSON
    plots.py    PNG plots (matplotlib, headless)
    peer.py     llama.cpp's servers and tools as peers; `bench peer` (fan-out vs llama-server)
    daemon.py   a real lmxd for the benchmarks
    fanout.py defaults.py exact.py prefix_cache.py ray.py builds.py tools.py kernels.py
                the fan-out, its defaults, exact mode, the prefix cache, Ray, two builds,
                llama-bench / llama-batched-bench, our kernels against ggml's
    conductor.py multiuser.py agents.py   lmxd: swap and STATUS, a hostile user, N agents
    serve.py cluster.py   swarmkv serve against llama-server; serve and fan-out on Ray
    serve_keys.py   `bench serve --scenarios keys`: two API keys on one server, one attacking
    serve_scale.py  `bench serve --scenarios scale`: 16..256 agents at once on the defaults
    frameworks.py grammar.py   agent frameworks against both servers; llguidance vs xgrammar
    llama_suite.py  llama.cpp's own server tests, unmodified, against llama-server and ours
"""
