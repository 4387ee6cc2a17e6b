"""Generated tokens to text as they come, with OpenAI's stop strings.

A token may end in the middle of a UTF-8 character, and a stop string may span tokens,
so text goes out only once it is whole and cannot be the start of a stop string; the
stop string itself is never sent.
"""
from __future__ import annotations

from ..generate import TextStream as Pieces


class StopMatcher:
    """One stop string, matched as text arrives (Knuth-Morris-Pratt): each new character
    costs amortised O(1), however long the string or the output, where searching the
    text again at every token was quadratic (issue 63: a 146 KiB stop string took 0.31 s
    a token on the thread that decodes for every key)."""

    def __init__(self, stop: str):
        self.stop = stop
        self.matched = 0                 # the longest end of the text that begins `stop`
        self._back = [0] * len(stop)     # _back[i]: the longest proper border of stop[:i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self._back[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self._back[i] = k

    def advance(self, text: str) -> int | None:
        """Read `text`; the index in it just past the first whole match, or None."""
        stop, k = self.stop, self.matched
        for i, c in enumerate(text):
            while k and c != stop[k]:
                k = self._back[k - 1]
            if c == stop[k]:
                k += 1
            if k == len(stop):
                self.matched = k
                return i + 1
        self.matched = k
        return None


class TextStream:
    """One answer's text as its tokens come; `shown`: control tokens written as their
    text (a tool-call opener the reader looks for), where others write nothing."""

    def __init__(self, model, stop: list[str], shown: frozenset[int] = frozenset()):
        self.stop = [s for s in stop if s]
        self._matchers = [StopMatcher(s) for s in self.stop]
        self._pieces = Pieces(model, shown)
        self._text = ""       # decoded, not sent yet: at most what could begin a stop string
        self.sent = ""
        self.stopped = False  # a stop string was found
        self.stop_string: str | None = None   # which one (the earliest in the text)

    def feed(self, token: int) -> str:
        """The text that may go out after `token` (maybe none); sets `stopped`."""
        piece = self._pieces.push(token)
        base = len(self._text)
        self._text += piece
        first = None                      # (where the earliest stop string starts, it)
        for m in self._matchers:
            end = m.advance(piece)
            if end is not None and (first is None or base + end - len(m.stop) < first[0]):
                first = (base + end - len(m.stop), m.stop)
        if first is not None:
            self._text, self.stopped, self.stop_string = self._text[:first[0]], True, first[1]
            return self.flush()
        keep = max((m.matched for m in self._matchers), default=0)
        out, self._text = self._text[:len(self._text) - keep], self._text[len(self._text) - keep:]
        self.sent += out
        return out

    def flush(self) -> str:
        """Everything not sent yet (the generation ended)."""
        if not self.stopped:
            self._text += self._pieces.flush()
        out, self._text = self._text, ""
        self.sent += out
        return out
