"""What one `llama_decode` costs, by the tokens of each ubatch it splits into (`ubatch_sizes`).

A ubatch's cost is not a line in its tokens on a CPU: llama.cpp's matrix kernels work in tiles, so
on 2 cores a 1.5B's ubatch of 4 tokens costs about what 3 do, 16 less than 14, and 2 costs 1.6x
of 1 (docs/benchmarks.md). So the cost is a table: seconds per ubatch size, timed on the context
itself at start (`calibrate`) and kept current by the steps the engine runs (`observe`).

Invariants:
- `ubatch(n)` is positive for every n >= 1: between two known sizes it interpolates, beyond the
  largest it extends the last two known sizes' slope (never falling), below the smallest it scales;
- a step's cost is the sum of its ubatches' (`step`); an observed step moves each of its sizes'
  entries by the same ratio toward what it took, and a size first seen becomes an entry;
- the table holds at most `max_entries` sizes (the rarest beyond that are not added).
"""

from __future__ import annotations

import bisect

# The ubatch sizes timed at start (`Context.time_ubatches`): one sequence's drafts, and eight's.
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


class UbatchCost:
    def __init__(self, seconds: dict[int, float] | None = None, weight: float = 0.1, max_entries: int = 256) -> None:
        # before any timing: a guess of a small model's step, a read of the weights and a share per token
        self.table: dict[int, float] = dict(seconds) if seconds else {1: 0.022, 64: 0.148}
        self._sizes = sorted(self.table)
        self.weight = weight
        self.max_entries = max_entries

    def calibrate(self, seconds: dict[int, float]) -> None:
        """Replace the table by ubatches timed on the context (size: seconds)."""
        self.table = {n: t for n, t in seconds.items() if n >= 1 and t > 0} or self.table
        self._sizes = sorted(self.table)

    def ubatch(self, n: int) -> float:
        sizes, table = self._sizes, self.table
        if n in table:
            return table[n]
        i = bisect.bisect_left(sizes, n)
        if i == 0:
            return table[sizes[0]] * n / sizes[0]
        if i == len(sizes):
            if len(sizes) == 1:
                return table[sizes[0]] * n / sizes[0]
            lo, hi = sizes[-2], sizes[-1]
            slope = max((table[hi] - table[lo]) / (hi - lo), table[hi] / hi / 4)
            return table[hi] + slope * (n - hi)
        lo, hi = sizes[i - 1], sizes[i]
        return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)

    def step(self, sizes: list[int]) -> float:
        return sum(self.ubatch(n) for n in sizes)

    def observe(self, sizes: list[int], seconds: float) -> None:
        """A step of ubatches of `sizes` took `seconds`."""
        predicted = self.step(sizes)
        if not sizes or predicted <= 0 or seconds <= 0:
            return
        ratio = seconds / predicted
        for n in set(sizes):
            if n not in self.table:
                if len(self.table) >= self.max_entries:
                    continue
                self.table[n] = self.ubatch(n)
                bisect.insort(self._sizes, n)
            self.table[n] *= 1 + self.weight * (ratio - 1)
