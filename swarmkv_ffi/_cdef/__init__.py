"""The pinned subset of llama.h, as cffi declarations, and the pin it was copied from.

Nothing else lives here: loading the library is `swarmkv_ffi.library`'s job.
"""
from importlib.resources import files

#: llama.cpp commit vendored by the llama-cpp-python sdist that build_llama.sh builds.
LLAMA_CPP_COMMIT = "0c1e570"
#: sdist that carries those sources (sha256 checked by build_llama.sh).
SOURCE = "llama-cpp-python==0.3.36"
#: sha256 of the llama.h these declarations were copied from: the pinned header with
#: kernels/ggml/0001-llama-set-batch-invariant.patch and 0004-llama-context-memory-bytes.patch
#: applied (build_llama.sh applies them).
LLAMA_H_SHA256 = "7f3bb7c1354cad30bb895a292267c89285cc6b73cb5fb5614931bc8ec4a43e69"

#: Names of the structs whose layout tests/binding/test_cdef_layout.py checks against the header.
CHECKED_STRUCTS = (
    "struct llama_model_params",
    "struct llama_context_params",
    "struct llama_batch",
    "struct llama_sampler_chain_params",
    "struct llama_logit_bias",
    "struct llama_token_data",
    "struct llama_token_data_array",
    "struct llama_chat_message",
    "struct ggml_tensor",
)


def cdef_source() -> str:
    """The declarations, as text for `FFI.cdef`."""
    return files(__package__).joinpath("llama.cdef.h").read_text()
