#!/usr/bin/env python3
"""Fan-out benchmark: the same as `swarmkv bench fanout` (see --help)."""
import sys

from swarmkv_ffi.bench.fanout import main

if __name__ == "__main__":
    sys.exit(main())
