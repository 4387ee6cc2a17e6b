#!/usr/bin/env python3
"""Ours vs llama-bench and llama-batched-bench: the same as `swarmkv bench tools` (see --help)."""
import sys

from swarmkv_ffi.bench.tools import main

if __name__ == "__main__":
    sys.exit(main())
