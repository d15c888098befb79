"""What one `llama_decode` costs, by the tokens of each ubatch it splits into (`ubatch_sizes`) and
the keys its tokens attend to: learnt from the steps the engine runs, a timing at start its prior.

A ubatch's cost is not a line in its tokens on a CPU: llama.cpp's matrix kernels work in tiles, so
on 2 cores a 1.5B's ubatch of 4 tokens costs about what 3 do, 16 less than 14, and 2 costs 1.6x
of 1 (docs/benchmarks.md). So the weights' part is a price per ubatch size. Attention is not in it:
each token also reads its sequence's keys, which at a thousand tokens of context can cost more than
its share of the weights. A step's cost is `sum(price of each ubatch) + per_key * keys`.

Prices are learnt while serving. Each size keeps its last `WINDOW` samples, a sample being the
seconds of one ubatch of that size once the step's keys are priced off; a size with `LEARNT`
samples is priced at their median. A step's seconds are a sample only where they belong to one
size: a step of ubatches of one size (each its share), or a step of several sizes all learnt but
one (what the others' prices leave; all learnt, the one sampled longest ago takes the turn, so a
size seen only beside others stays current). A step of several sizes not learnt teaches nothing: a
split of its seconds among them would be a guess. A median, not a mean: a step that the machine
slowed (another process, a page fault) moves it not at all, and a lasting change of load wins
within half a window.

The table timed at start is the prior: on one box the same start timed a 12-token ubatch 1.51 s and
a 16-token one 0.98 s, and smoothly on the next start. So it is never a sample; a size not learnt is
priced at its start-up timing times the load the learnt sizes measured (the median of each one's
price over its timing, so one poisoned timing among them moves none; a size learnt before it was
timed has no timing of its own and counts for nothing there), never from one sample of its own.
Nor above a larger size's price: served beside another server's start, one start timed 12- and
16-token ubatches at 3.95 s where 8 learnt 0.21 and 32 was timed at 0.73, and a size priced that
high is never drafted at, so no step would ever have sampled it back down.

That cap does not reach a table too high everywhere above the sizes in use: on one box `auto`'s
start priced ubatches of 8 to 64 tokens 20-70% above what the steps of servers drafting at them
learnt (8: 0.32 s against 0.26; 16: 0.47 against 0.35), and drafted 3.6 tokens a draft at 96%
acceptance. So `auto` bids (`bid`, `step(..., bid=True)`; for a step of one sequence,
`Speculator._seconds`) a size that no step has priced yet at `UNTRIED` of its price, in its first
`TRIES` steps: a size a little too dear for a draft gets tried, and `LEARNT` steps of it put its
price right. Where the bid was wrong, those few steps cost at most 1 / `UNTRIED`
of what was weighed; a size steps carry without ever pricing (always beside another unpriced one)
stops being bid low after `TRIES` of them.

Timing every size while the server loaded held /health back (a 0.5B on 2 shared cores: 14 to 52 s
against 4 to 6 s without), so the sizes given as `to_time` are timed while the engine idles, one at
a time, smallest first (`next_to_time`, `add_timings`; `Scheduler.idle`): a request that arrives
meanwhile ends the timing's decode (`Context.time_ubatches`) and waits for one node of its graph. A size that served steps learn first is not timed at
all. Until a step's sizes are priced (`priced`: learnt, or the sizes its prior interpolates between
timed), `step` says it costs without end, and `auto` drafts nothing that needs them. (`calibrate`
still sets a whole table at once.)

`per_key` is the median of the slopes of seconds over keys between steps of one size (Theil-Sen,
per ubatch: `(seconds, keys) / count` of a step all of whose ubatches are that size), over each
size's last `WINDOW` such steps: it never reads a price. An earlier fit, least squares of each step's
seconds on its priced sizes and its keys, fed on itself: a price learnt with too high a `per_key`
taken off came out low, and the next fit gave the keys more still; served on 2 cores it reached 450
us per key for a 1.5B (its rows are 28 KB: ~5 us), and priced 1-token ubatches at 14 ms against 59.

Invariants:
- `ubatch(n)` is positive for every n >= 1: a learnt size's price is a median of positive samples;
  another's is its prior times a positive load, the prior interpolated between two sizes timed at
  start, beyond the largest extending the last two's slope (never falling), below the smallest scaled;
  a size not learnt costs no more than any larger size timed or learnt;
- a size's price is its own samples' median once it has `LEARNT` of them, and no sample is older
  than its size's last `WINDOW`;
- `per_key` >= 0, whatever the steps observed, and reads only steps' seconds and keys;
- `step` is finite exactly where each of its sizes is `priced`; a size is to be timed (`untimed`)
  only while it is neither timed, tried, nor learnt;
- `bid(n)` is `ubatch(n)`, but `UNTRIED` of it while `n` is not learnt and fewer than `TRIES` steps
  carried it.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from typing import Iterable

# The ubatch sizes timed while the engine idles after start (`Context.time_ubatches`): one
# sequence's drafts, and eight's.
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
# The samples a size keeps (its price follows a lasting change within half of them), and those it
# needs before they price it instead of the prior.
WINDOW = 16
LEARNT = 3
# `per_key` is fitted again every REFIT steps of one size (each time from every pair of them), and only
# from pairs whose keys differ by at least MIN_SPREAD of the larger.
REFIT = 8
MIN_SPREAD = 0.2
# A size not learnt is bid at UNTRIED of its price until TRIES steps carried it (see above).
UNTRIED = 0.7
TRIES = 2 * LEARNT


def attended_keys(n_past: int, n_decoded: int) -> int:
    """The keys that `n_decoded` tokens decoded after `n_past` in one sequence attend to, each
    counted as reading them all: what a step's `keys` sums over its sequences."""
    return n_decoded * (n_past + n_decoded)


class UbatchCost:
    def __init__(self, seconds: dict[int, float] | None = None, to_time: Iterable[int] = ()) -> None:
        """`seconds`: a table timed already (the prior); `to_time`: the sizes still to time
        (`next_to_time`), each unpriced until timed or learnt."""
        # before any timing: a guess of a small model's step, a read of the weights and a share per token
        self.table: dict[int, float] = dict(seconds) if seconds else {1: 0.022, 64: 0.148}
        self._sizes = sorted(self.table)
        self._timed = bool(seconds)  # the table is timings, not the guess
        self._to_time = sorted({n for n in to_time if n >= 1})  # the sizes a prior interpolates between
        self.untimed = set(self._to_time)  # of those, the ones neither timed, tried nor learnt yet
        self.samples: dict[int, deque[float]] = {}
        self._learnt: dict[int, float] = {}  # the price of each size with LEARNT samples
        self._sampled_at: dict[int, int] = {}  # the step each size was last sampled at
        self._tries: dict[int, int] = {}  # the steps that carried each size not learnt
        self._steps = 0
        self._load = 1.0  # what the learnt sizes measured over their start-up timing (median)
        self._prices: dict[int, float] = {}  # `ubatch` of each size asked since the prices last changed
        self.per_key = 0.0
        # per size, its last steps of that size alone, per ubatch: (keys, seconds)
        self._points: dict[int, deque[tuple[float, float]]] = {}

    def calibrate(self, seconds: dict[int, float]) -> None:
        """Replace the prior by ubatches timed on the context (size: seconds); forget what was learnt."""
        table = {n: t for n, t in seconds.items() if n >= 1 and t > 0}
        if table:
            self.table, self._timed = table, True
        self._sizes = sorted(self.table)
        self.untimed = set()
        self.samples, self._learnt, self._sampled_at, self._load, self._prices = {}, {}, {}, 1.0, {}
        self._tries = {}
        self._points, self.per_key = {}, 0.0

    def next_to_time(self) -> int | None:
        """The smallest size still to time (`to_time`), or None: all are timed, tried or learnt."""
        return min(self.untimed, default=None)

    def add_timings(self, sizes: list[int], seconds: dict[int, float]) -> None:
        """`sizes` were timed as `Context.time_ubatches` times them, `seconds` what came back (a size
        the context cannot decode in one ubatch, or a failed timing, comes back without): each
        timing joins the prior, learnt prices stay, and none of `sizes` is timed again."""
        self.untimed.difference_update(sizes)
        timed = {n: t for n, t in seconds.items() if n >= 1 and t > 0}
        if not timed:
            return
        self.table = {**self.table, **timed} if self._timed else timed  # the guess goes at the first timing
        self._timed = True
        self._sizes = sorted(self.table)
        self._measure_load()  # over the prior that just changed

    def priced(self, n: int) -> bool:
        """Whether a ubatch of `n` tokens has a price of more than a guess: learnt, or the sizes to
        time that its prior interpolates between (beyond the largest, the last two) timed or tried."""
        if n in self._learnt or not self.untimed:
            return True
        sizes = self._to_time
        i = bisect.bisect_left(sizes, n)
        if i < len(sizes) and sizes[i] == n:
            around = [n]
        elif i == len(sizes):
            around = sizes[-2:]
        else:
            around = sizes[max(i - 1, 0):i + 1]
        return not self.untimed.intersection(around)

    def prior(self, n: int) -> float:
        """A ubatch of `n` tokens as timed at start."""
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

    def ubatch(self, n: int) -> float:
        """A ubatch of `n` tokens: its learnt price, or its prior at the load the learnt sizes measured,
        but never more than a larger size's own price (learnt, or its prior at that load). Kept until a
        timing or a learnt price changes: `auto` asks it for every draft length it weighs."""
        price = self._prices.get(n)
        if price is None:
            price = self._learnt.get(n)
            if price is None:
                larger = {m for m in (*self._sizes, *self._learnt) if m > n}
                price = min([self._own(n), *map(self._own, larger)])
            self._prices[n] = price
        return price

    def _own(self, n: int) -> float:
        learnt = self._learnt.get(n)
        return learnt if learnt is not None else self.prior(n) * self._load

    def bid(self, n: int) -> float:
        """What `auto` weighs a ubatch of `n` tokens at: its price, `UNTRIED` of it while no step has
        priced the size and fewer than `TRIES` steps carried it."""
        price = self.ubatch(n)
        return price if n in self._learnt or self._tries.get(n, 0) >= TRIES else price * UNTRIED

    def step(self, sizes: list[int], keys: int = 0, bid: bool = False) -> float:
        """Seconds of a step of ubatches of `sizes` whose tokens attend to `keys` keys in all (each
        size at its `bid` where asked); without end while a size of it is not `priced`."""
        if self.untimed and not all(self.priced(n) for n in sizes):
            return math.inf
        return sum(map(self.bid if bid else self.ubatch, sizes)) + self.per_key * keys

    def entries(self) -> dict[int, tuple[float, int]]:
        """The price of each size timed at start or sampled since, and how many samples back it."""
        sizes = sorted({*self.table, *self.samples})
        return {n: (self.ubatch(n), len(self.samples.get(n, ()))) for n in sizes}

    def observe(self, sizes: list[int], seconds: float, keys: int = 0) -> None:
        """A step of ubatches of `sizes`, its tokens attending to `keys` keys, took `seconds`."""
        if not sizes or seconds <= 0:
            return
        self._steps += 1
        for n in set(sizes).difference(self._learnt):
            self._tries[n] = self._tries.get(n, 0) + 1
        if len(set(sizes)) == 1:  # a step of one size: a point of its seconds against its keys
            count = len(sizes)
            self._points.setdefault(sizes[0], deque(maxlen=WINDOW)).append((keys / count, seconds / count))
            if self._steps % REFIT == 0 or len(self._points[sizes[0]]) < WINDOW:
                self._fit()
        own = self._sampled_size(sizes)
        if own is not None:
            others = sum(self.ubatch(n) for n in sizes if n != own)
            self._sample(own, (seconds - self.per_key * keys - others) / sizes.count(own))

    def _sampled_size(self, sizes: list[int]) -> int | None:
        """The size a step's seconds are a sample of: its only one; else its only one not learnt, or,
        all learnt, the one sampled longest ago (a size seen only beside others stays current)."""
        distinct = set(sizes)
        if len(distinct) == 1:
            return sizes[0]
        unknown = [n for n in distinct if n not in self._learnt]
        if unknown:
            return unknown[0] if len(unknown) == 1 else None
        return min(distinct, key=self._sampled_at.__getitem__)

    def _sample(self, n: int, seconds: float) -> None:
        if seconds <= 0:  # the keys' or the other sizes' price took it all: nothing of this size's
            return
        window = self.samples.setdefault(n, deque(maxlen=WINDOW))
        window.append(seconds)
        self._sampled_at[n] = self._steps
        if len(window) >= LEARNT:
            self._learnt[n] = statistics.median(window)
            self.untimed.discard(n)  # served steps priced it: no timing needed
            self._measure_load()

    def _measure_load(self) -> None:
        """The median of each learnt size's price over its prior, of the sizes that have one: a size
        to time that the steps learnt first was never timed (its prior is its neighbours')."""
        ratios = [price / self.prior(n) for n, price in self._learnt.items()
                  if n not in self._to_time or (self._timed and n in self.table)]
        self._load = statistics.median(ratios) if ratios else 1.0
        self._prices = {}  # every learnt price and timing change passes here

    def _fit(self) -> None:
        """`per_key`: the median slope between two steps of one size whose keys differ by at least
        `MIN_SPREAD` of the larger (closer ones are noise over a small difference)."""
        slopes = []
        for points in self._points.values():
            ordered = sorted(points)
            for i, (k0, t0) in enumerate(ordered):
                for k1, t1 in ordered[i + 1:]:
                    if k1 > 0 and k1 - k0 >= MIN_SPREAD * k1:
                        slopes.append((t1 - t0) / (k1 - k0))
        if len(slopes) >= LEARNT:
            self.per_key = max(statistics.median(slopes), 0.0)
