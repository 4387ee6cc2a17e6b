"""`lmxd`: the conductor's socket server (conductor/server.py) with the OpenAI API beside it.

The one module that puts the two together: the daemon is handed serve/'s front (its
--http flags and its start), so the conductor never imports the server built on it.
"""
from __future__ import annotations

import sys

from .conductor import server
from .serve.http import LmxdFront


def main(argv: list[str] | None = None) -> int:
    return server.main(argv, front=LmxdFront())


if __name__ == "__main__":
    sys.exit(main())
