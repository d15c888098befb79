"""Cut a text, at special-token spellings, into pieces llama.cpp tokenizes alone with the same result.

llama.cpp finds special tokens (control, user-defined, unknown) in a text by splitting it on each
special spelling in turn, longest first, over a linked list it walks from the head at every split:
time quadratic in the number of spellings found. A text of 20,000 `<|im_start|>` takes seconds;
a 16 MiB body, hours. Tokenizing bounded pieces one by one keeps llama.cpp's own result and cost
per piece, so the whole stays linear in the text's size.

Invariant of a cut: it falls right after an occurrence `(p, T)` of a special spelling that every
other occurrence overlapping it is strictly shorter than. llama.cpp then always takes `T` there
(nothing it tries before `T` overlaps it), no occurrence it takes crosses the cut, and the text
after the cut starts a fresh fragment just as it would start a fresh text (for SentencePiece
vocabularies both get the prefix space after a special). When a vocabulary strips whitespace
around some special tokens, tokens that strip to the right or begin or end in whitespace never
cut, since stripping could move the boundary.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

_SPACE = frozenset(b" \t\n\v\f\r")


class TooManySpecialTokens(ValueError):
    """A text holds a long run of overlapping special spellings that no safe cut divides."""


def _trie_pattern(words: list[bytes]) -> bytes:
    """A regex matching, at a position, the longest of `words` that starts there (greedy trie)."""
    trie: dict = {}
    for word in words:
        node = trie
        for byte in word:
            node = node.setdefault(byte, {})
        node[None] = True

    def emit(node: dict) -> bytes:
        branches = [re.escape(bytes([b])) + emit(child) for b, child in sorted(node.items(), key=_key) if b is not None]
        if not branches:
            return b""
        body = branches[0] if len(branches) == 1 else b"(?:" + b"|".join(branches) + b")"
        return b"(?:" + body + b")?" if None in node else body

    return emit(trie)


def _key(item: tuple) -> int:
    return -1 if item[0] is None else item[0]


@dataclass(frozen=True)
class SpecialCuts:
    """The special spellings of one vocabulary, and where a text may be cut between them."""

    pattern: re.Pattern[bytes]
    longest: int
    never_cut: frozenset[bytes]

    @classmethod
    def of(cls, specials: list[tuple[bytes, bool, bool]]) -> SpecialCuts | None:
        """From `(spelling, lstrip, rstrip)` of every special token; None when there are none."""
        words = sorted({s for s, _, _ in specials if s})
        if not words:
            return None
        stripping = any(l or r for _, l, r in specials)
        never = {s for s, _, r in specials if r or (stripping and (s[0] in _SPACE or s[-1] in _SPACE))}
        return cls(re.compile(_trie_pattern(words), re.DOTALL), max(map(len, words)), frozenset(never))

    def pieces(self, data: bytes, every: int = 256, limit: int = 4096) -> Iterator[bytes]:
        """`data` in pieces that each hold about `every` special spellings (a piece ends at the first
        safe cut after that many); raises TooManySpecialTokens past `limit` spellings without one."""
        start, found = 0, 0
        for match in self.pattern.finditer(data):
            if match.end() == match.start():
                continue
            found += 1
            if found >= every and self._safe(data, match.start(), match.end()):
                yield data[start:match.end()]
                start, found = match.end(), 0
            elif found > limit:
                raise TooManySpecialTokens(f"over {limit} overlapping special-token spellings in a row")
        if start < len(data):
            yield data[start:]

    def _safe(self, data: bytes, p: int, end: int) -> bool:
        """True when every other spelling overlapping `data[p:end]` (the longest at p) is shorter."""
        if data[p:end] in self.never_cut:
            return False
        size = end - p
        for q in range(max(0, p - self.longest + 1), end):
            if q == p:
                continue
            other = self.pattern.match(data, q)
            n = other.end() - q if other else 0
            if n >= size and q + n > p:
                return False
        return True
