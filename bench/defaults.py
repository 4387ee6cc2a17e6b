#!/usr/bin/env python3
"""KV type and flash attention by measurement: the same as `swarmkv bench defaults` (see --help)."""
import sys

from swarmkv_ffi.bench.defaults import main

if __name__ == "__main__":
    sys.exit(main())
