#!/usr/bin/env python3
"""Our fan-out against llama.cpp's llama-server: the same as `swarmkv bench peer` (see --help)."""
import sys

from swarmkv_ffi.bench.peer import main

if __name__ == "__main__":
    sys.exit(main())
