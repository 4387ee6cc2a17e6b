#!/usr/bin/env python3
"""Conductor benchmark: the same as `swarmkv bench conductor` (see --help)."""
import sys

from swarmkv_ffi.bench.conductor import main

if __name__ == "__main__":
    sys.exit(main())
