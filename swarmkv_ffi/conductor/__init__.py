"""The conductor: one process owns the accelerator for many agents (lmxd, and serve/ on it).

Lowest first (tests/test_layers.py holds the same order):

  its parts
    protocol.py        the line protocol: parsing requests, formatting replies, error codes
    lines.py           request lines off a Unix socket, with the descriptors sent with them
    quotas.py          what one user may take of a shared daemon
    policy.py          fairness between owners: rows, virtual time, the step cap, reopens
    kept.py            finished requests' cells (the radix cache) and the PrefixStore interface
    tiers.py           evicted prefixes kept in host RAM (the tier below the cells)
    common_prompts.py  prompt tokens that DECODEs starting together share, decoded once
    ledger.py          admission: bytes reserved per key under one lock, against a budget
    memory.py          device memory, re-read on a timer and at every admission (NVML or host)
    modelfile.py       a client-named model file, opened once and checked before it is read
    registry.py        models refcounted by file identity: two agents on one GGUF share it
    estimate.py        bytes an agent needs, from its GGUF (weights + KV for n_ctx + compute)
    sandbox.py         an untrusted GGUF loads in a child process first
    client.py          the Python client and the `lmx` command
  the engine
    pool.py            one model's shared context, a KV sequence per seated agent; Kind, PoolKey
    scheduler.py       the one thread that runs every llama_decode, batched, fair by owner
    agents.py          the Conductor: registration, DECODE, RESET, swap, the context check
    access.py          what a client may make the daemon open
  its doors
    requests.py        request pools: one-shot requests of owners (what serve/ uses)
    server.py          lmxd's Unix-socket server; handed other fronts by swarmkv_ffi/lmxd.py

Where each rule lives: admission (ledger.py, with the bytes from estimate.py and the
shares from quotas.py) in Conductor.register; fairness (policy.py) applied by the
scheduler; sharing of cells (pool.py: documents, kept cells matched per owner) and
eviction (pool.py: least recently used kept cells first; idle seats paused by
scheduler._make_room); the context length (agents.check_context) for both doors.
"""
