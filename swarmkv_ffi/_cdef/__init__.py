"""The pinned subset of llama.h, as cffi declarations, and the pin it was copied from.

Nothing else lives here: loading the library is `swarmkv_ffi.library`'s job.
"""
from importlib.resources import files

#: llama.cpp commit vendored by the llama-cpp-python sdist that build_llama.sh builds.
LLAMA_CPP_COMMIT = "0c1e570"
#: sdist that carries those sources (sha256 checked by build_llama.sh).
SOURCE = "llama-cpp-python==0.3.36"
#: sha256 of the llama.h these declarations were copied from.
LLAMA_H_SHA256 = "d5cf9203bea63b575e76cba4881f29cfd1b611451578b01582b75b72ecbb04bc"

#: Names of the structs whose layout tests/test_cdef_layout.py checks against the header.
CHECKED_STRUCTS = (
    "struct llama_model_params",
    "struct llama_context_params",
    "struct llama_batch",
    "struct llama_sampler_chain_params",
    "struct llama_chat_message",
)


def cdef_source() -> str:
    """The declarations, as text for `FFI.cdef`."""
    return files(__package__).joinpath("llama.cdef.h").read_text()
