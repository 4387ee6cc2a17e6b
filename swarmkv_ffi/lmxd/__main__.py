"""`python -m swarmkv_ffi.lmxd`: the daemon, as the `lmxd` command."""
import sys

from . import main

sys.exit(main())
