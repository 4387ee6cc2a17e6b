"""Generated tokens to text as they come, with OpenAI's stop strings.

A token may end in the middle of a UTF-8 character, and a stop string may span tokens,
so text goes out only once it is whole and cannot be the start of a stop string; the
stop string itself is never sent.
"""
from __future__ import annotations

from ..generate import TextStream as Pieces


class TextStream:
    def __init__(self, model, stop: list[str]):
        self.stop = [s for s in stop if s]
        self._pieces = Pieces(model)
        self._text = ""       # decoded, not sent yet
        self.sent = ""
        self.stopped = False  # a stop string was found
        self.stop_string: str | None = None   # which one (the earliest in the text)

    def feed(self, token: int) -> str:
        """The text that may go out after `token` (maybe none); sets `stopped`."""
        self._text += self._pieces.push(token)
        for s in self.stop:
            at = self._text.find(s)
            if at >= 0:
                self._text, self.stopped, self.stop_string = self._text[:at], True, s
        if self.stopped:
            return self.flush()
        keep = self._held_back()
        out, self._text = self._text[:len(self._text) - keep], self._text[len(self._text) - keep:]
        self.sent += out
        return out

    def _held_back(self) -> int:
        """How many trailing characters could begin a stop string."""
        for n in range(min(len(self._text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(self._text[-n:]) for s in self.stop):
                return n
        return 0

    def flush(self) -> str:
        """Everything not sent yet (the generation ended)."""
        if not self.stopped:
            self._text += self._pieces.flush()
        out, self._text = self._text, ""
        self.sent += out
        return out
