"""Bad model paths and files give clear errors, never a crash; short names resolve."""
from __future__ import annotations

import numpy as np
import pytest

from swarmkv_ffi import Model, catalog, errors


def test_missing_file(tmp_path):
    with pytest.raises(errors.ModelNotFoundError, match="not found"):
        Model(tmp_path / "nope.gguf")


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(errors.ModelLoadError, match="not a file"):
        Model(tmp_path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello, I am text")
    with pytest.raises(errors.ModelLoadError, match="not a GGUF file"):
        Model(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(errors.ModelLoadError, match="not a GGUF file"):
        Model(path)


@pytest.mark.parametrize("keep", [64, 4096, 0.5])
def test_truncated_gguf(tmp_path, keep):
    src = catalog.resolve("smollm2-135m").read_bytes()
    n = int(len(src) * keep) if isinstance(keep, float) else keep
    path = tmp_path / "truncated.gguf"
    path.write_bytes(src[:n])
    with pytest.raises(errors.ModelLoadError, match="llama_model_load_from_file"):
        Model(path)


def test_unknown_architecture(tmp_path):
    """A well-formed GGUF that libllama cannot build a model from (made with `gguf`)."""
    import gguf
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), arch="no-such-arch")
    w.add_tensor("weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(errors.ModelLoadError) as info:
        Model(path)
    assert "no-such-arch" in str(info.value)


def test_unknown_short_name():
    with pytest.raises(errors.ModelNotFoundError, match="smollm2-135m"):
        catalog.resolve("gpt-99")


def test_short_names_resolve_to_gguf_files():
    for name in catalog.CATALOG:
        path = catalog.resolve(name)
        with open(path, "rb") as f:
            assert f.read(4) == b"GGUF"
    assert catalog.resolve(None) == catalog.resolve(catalog.DEFAULT_MODEL)


def test_progress_callback_reports_and_can_cancel():
    seen = []
    m = Model(catalog.resolve("smollm2-135m"), progress=lambda p: seen.append(p))
    m.close()
    assert seen and seen[-1] == pytest.approx(1.0)
    with pytest.raises(errors.ModelLoadError):
        Model(catalog.resolve("smollm2-135m"), progress=lambda p: False)


def test_an_error_in_the_progress_callback_is_raised_as_itself():
    """Not as a 'truncated file?' load failure: the caller's own bug, with its traceback."""
    class Broken(Exception):
        pass

    def progress(p):
        raise Broken(f"at {p}")

    with pytest.raises(Broken):
        Model(catalog.resolve("smollm2-135m"), progress=progress)
