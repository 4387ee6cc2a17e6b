"""Our ABI-mode declarations must match the real header: compile the very same cdef in
cffi's API mode against the built include/llama.h. The C compiler then checks every
field's type, cffi checks every offset and enum value at import, and we compare sizes and
offsets of the structs libllama takes by value with what the ABI-mode ffi believes."""
from __future__ import annotations

import importlib.util

import pytest
from cffi import FFI

from swarmkv_ffi import _cdef, library


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    lib_path = library.find_library()
    root = library.install_root(lib_path)
    api = FFI()
    api.cdef(_cdef.cdef_source())
    api.set_source(
        "_swarmkv_layout_check", '#include "llama.h"',
        include_dirs=[str(root / "include")], library_dirs=[str(lib_path.parent)],
        libraries=["llama"], extra_link_args=[f"-Wl,-rpath,{lib_path.parent}"],
        extra_compile_args=["-Werror=incompatible-pointer-types", "-Werror=int-conversion"])
    out = tmp_path_factory.mktemp("cffi_api")
    so = api.compile(tmpdir=str(out), verbose=False)
    spec = importlib.util.spec_from_file_location("_swarmkv_layout_check", so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # cffi raises here on a wrong offset or enum value
    return module.ffi


def test_header_is_the_pinned_one():
    got = library.header_sha256(library.find_library())
    assert got == _cdef.LLAMA_H_SHA256


@pytest.mark.parametrize("struct", _cdef.CHECKED_STRUCTS)
def test_struct_layout_matches_header(compiled, struct):
    abi = library.ffi
    assert abi.sizeof(struct) == compiled.sizeof(struct)
    assert abi.alignof(struct) == compiled.alignof(struct)
    fields = abi.typeof(struct).fields
    assert fields, f"{struct} has no fields in the cdef"
    for name, _ in fields:
        assert abi.offsetof(struct, name) == compiled.offsetof(struct, name), f"{struct}.{name}"


def test_every_cdef_function_exists_in_library(compiled):
    # API mode linked against libllama: an undeclared or renamed function fails at import.
    # ABI mode must also resolve each one from the loaded library.
    lib = library.lib()
    names = [n for n in dir(lib) if n.startswith(("llama_", "ggml_")) and not n.isupper()
             and not n.startswith(("LLAMA_", "GGML_"))]
    assert len(names) > 50
    for name in names:
        getattr(lib, name)
