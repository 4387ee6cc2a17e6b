"""A tiny base for objects that own a libllama handle: explicit close(), safe double close,
context-manager use, and a clear error when used after close."""
from __future__ import annotations

from .errors import ClosedError


class Owned:
    _closed = True  # until a subclass finishes __init__

    def _check_open(self):
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")

    def _release(self) -> None:  # overridden: free the C handle
        pass

    def close(self) -> None:
        """Free the underlying libllama object. Safe to call more than once."""
        if not self._closed:
            self._closed = True
            self._release()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
