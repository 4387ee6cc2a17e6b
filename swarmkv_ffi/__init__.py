"""swarmkv_ffi: prefill a document once, fork its KV cache to N branches.

A direct cffi binding over a custom-built libllama (see build_llama.sh). The small owning
objects below are the whole low-level API; the fan-out engine builds on them.
"""
import logging

from .batch import Batch
from .catalog import DEFAULT_MODEL, resolve as resolve_model
from .context import Context, ContextParams
from .errors import *  # noqa: F401,F403 - the exception hierarchy is public
from .model import Model
from .sampler import Sampler

# A library stays quiet unless the application configures logging (the CLI's -v does).
logging.getLogger("swarmkv_ffi").addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = ["Batch", "Context", "ContextParams", "Model", "Sampler", "DEFAULT_MODEL", "resolve_model"]
