"""`lmxd`, the conductor's daemon: its Unix-socket front, with the OpenAI API beside it.

A front of the engine: it imports only the conductor's door (swarmkv_ffi.conductor).
Lowest first (tests/test_layers.py holds the same order):

    protocol.py   the line protocol: parsing requests, formatting replies, error codes
    lines.py      request lines off a Unix socket, with the descriptors sent with them
    client.py     the Python client and the `lmx` command (imports nothing of the engine)
    access.py     what a client may make the daemon open
    server.py     the socket server: peers, quotas, the verbs, handed other fronts

main() puts the two fronts together: the daemon is handed serve/'s HTTP front (its
--http flags and its start), so neither the conductor nor server.py imports the server
built on it. It imports them when called, so `import swarmkv_ffi.lmxd.client` stays light.
"""
from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from ..serve.http import LmxdFront
    from . import server
    return server.main(argv, front=LmxdFront())
