#!/usr/bin/env python3
"""Exact vs fast mode, fidelity and cost: the same as `swarmkv bench exact` (see --help)."""
import sys

from swarmkv_ffi.bench.exact import main

if __name__ == "__main__":
    sys.exit(main())
