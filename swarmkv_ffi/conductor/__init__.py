"""lmxd, the conductor daemon: one process owns the accelerator for many agents.

    ledger.py    admission: reserve bytes under one lock, against a budget
    memory.py    device memory, re-read on a timer and at every admission (NVML or host)
    estimate.py  bytes an agent needs, from its GGUF (weights + KV for n_ctx + compute)
    registry.py  models refcounted by path: two agents on one GGUF share it
    agents.py    agent slots, the one live compute context, KV swap to host RAM
    protocol.py  the line protocol: parsing requests, formatting replies, error codes
    server.py    the Unix-socket server (`lmxd`)
    client.py    the Python client and the `lmx` command
"""
