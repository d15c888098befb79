"""What one `llama_decode` costs, by the tokens of each ubatch it splits into (`ubatch_sizes`) and
the keys its tokens attend to.

A ubatch's cost is not a line in its tokens on a CPU: llama.cpp's matrix kernels work in tiles, so
on 2 cores a 1.5B's ubatch of 4 tokens costs about what 3 do, 16 less than 14, and 2 costs 1.6x
of 1 (docs/benchmarks.md). So the weights' part is a table of seconds per ubatch size, timed on the
context at start in an empty stream (`calibrate`). Attention is not in that timing: each token
also reads its sequence's keys, which at a thousand tokens of context can cost more than its share
of the weights. A step's cost is `scale * sum(table) + per_key * keys`, `scale` (the machine's load)
and `per_key` fitted to the steps the engine runs by exponentially weighted least squares.

Invariants:
- `ubatch(n)` is positive for every n >= 1: between two known sizes it interpolates, beyond the
  largest it extends the last two known sizes' slope (never falling), below the smallest it scales;
- `scale` > 0 and `per_key` >= 0, whatever the steps observed.
"""

from __future__ import annotations

import bisect

# The ubatch sizes timed at start (`Context.time_ubatches`): one sequence's drafts, and eight's.
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


def attended_keys(n_past: int, n_decoded: int) -> int:
    """The keys that `n_decoded` tokens decoded after `n_past` in one sequence attend to, each
    counted as reading them all: what a step's `keys` sums over its sequences."""
    return n_decoded * (n_past + n_decoded)


class UbatchCost:
    def __init__(self, seconds: dict[int, float] | None = None, weight: float = 0.05) -> None:
        # before any timing: a guess of a small model's step, a read of the weights and a share per token
        self.table: dict[int, float] = dict(seconds) if seconds else {1: 0.022, 64: 0.148}
        self._sizes = sorted(self.table)
        self.weight = weight
        self.scale, self.per_key = 1.0, 0.0
        self._sums = [0.0] * 5  # weighted sums of u*u, u*k, k*k, u*t, k*t (u: table seconds, k: keys)
        self._prior()

    def _prior(self) -> None:
        """The fit's start: as if a few steps had taken what the table says, with and without keys."""
        self._sums = [0.0] * 5
        for keys in (0, 1000):
            self._add(self.ubatch(1), keys, self.ubatch(1), 0.5)
        self._fit()

    def calibrate(self, seconds: dict[int, float]) -> None:
        """Replace the table by ubatches timed on the context (size: seconds)."""
        self.table = {n: t for n, t in seconds.items() if n >= 1 and t > 0} or self.table
        self._sizes = sorted(self.table)
        self._prior()

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

    def step(self, sizes: list[int], keys: int = 0) -> float:
        """Seconds of a step of ubatches of `sizes` whose tokens attend to `keys` keys in all."""
        return self.scale * sum(self.ubatch(n) for n in sizes) + self.per_key * keys

    def observe(self, sizes: list[int], seconds: float, keys: int = 0) -> None:
        """A step of ubatches of `sizes`, its tokens attending to `keys` keys, took `seconds`."""
        if sizes and seconds > 0:
            self._add(sum(self.ubatch(n) for n in sizes), keys, seconds, self.weight)
            self._fit()

    def _add(self, u: float, k: float, t: float, w: float) -> None:
        s = self._sums
        for i, value in enumerate((u * u, u * k, k * k, u * t, k * t)):
            s[i] = (1 - w) * s[i] + w * value

    def _fit(self) -> None:
        uu, uk, kk, ut, kt = self._sums
        det = uu * kk - uk * uk
        if det > 1e-9 * uu * kk:
            self.scale, self.per_key = (ut * kk - kt * uk) / det, (uu * kt - uk * ut) / det
        if self.per_key < 0 or self.scale <= 0:  # outside the model's range: the table's part alone
            self.per_key = 0.0
            self.scale = max(ut / uu, 1e-3) if uu > 0 else 1.0
