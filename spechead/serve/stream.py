"""Stop strings on text, not tokens: a stop string can span tokens, or end inside one, so the worker
releases only the text that no later token can change."""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    """Turns a growing token list into text deltas and finds the first stop string.

    The text of all tokens so far is decoded each round (cheap next to a forward pass) and only its
    settled part is released: a tail that is a prefix of some stop string, or an unfinished UTF-8
    character (decoded as U+FFFD), is held back until the next tokens decide it. The concatenated
    deltas therefore equal the final (stop-cut) text, streamed or not.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self.decode, self.stop = decode, stop
        self.sent = 0
        self.stopped = False

    def _cut(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return max(min(hits), self.sent) if hits else None

    def push(self, tokens: list[int]) -> str:
        """The new settled text after ``tokens``; sets ``stopped`` when a stop string appeared."""
        text = self.decode(tokens)
        cut = self._cut(text)
        if cut is not None:
            self.stopped = True
            return self._release(text, cut)
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        room = end - self.sent
        hold = max(
            (k for s in self.stop for k in range(1, min(len(s) - 1, room) + 1) if s.startswith(text[end - k : end])),
            default=0,
        )  # the longest tail that could still grow into a stop string
        return self._release(text, end - hold)

    def finish(self, tokens: list[int]) -> str:
        """Whatever is left once generation has ended (the stop cut still applies)."""
        if self.stopped:
            return ""
        text = self.decode(tokens)
        cut = self._cut(text)
        self.stopped = cut is not None
        return self._release(text, len(text) if cut is None else cut)

    def _release(self, text: str, end: int) -> str:
        piece = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece
