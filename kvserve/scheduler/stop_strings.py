"""Stop strings over streamed text: nothing at or after a stop ever reaches the client."""

from __future__ import annotations


class StopMatcher:
    """Holds back the tail of the text that could still become a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self._pending = ""
        self.matched: str | None = None  # the stop string the text stopped at, once it did

    def feed(self, text: str) -> str:
        """The text that is now safe to emit."""
        if not self._stops:
            return text
        self._pending += text
        found = [(i, s) for s in self._stops if (i := self._pending.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])  # the first to occur; of those, the first given
            out, self._pending = self._pending[:cut], ""
            return out
        keep = self._held_back()
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return out

    def flush(self) -> str:
        """At the end of the stream whatever was held back is plain text."""
        out, self._pending = self._pending, ""
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop."""
        pending = self._pending
        for k in range(min(len(pending), self._longest - 1), 0, -1):
            tail = pending[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
