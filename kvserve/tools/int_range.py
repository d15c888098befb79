"""GBNF for the integers of a closed or half-open range, in JSON's spelling: no leading zeros, no
`-0`. The pinned schema converter ignores `minimum` and `maximum`; llama-server's enforces them on
integers, and so does this.

A range of non-negative integers is cut by digit count: within one count the numbers from `low` to
`high` are a digit-by-digit alternation (a shared leading digit, then the rest of the range; or a
digit strictly between the two, then any digits; or an edge digit, then what stays at or past that
edge). Negative numbers are `-` and the range of their absolute values.
"""

from __future__ import annotations

import math
from typing import Any

# A bound past this is as good as none (JSON numbers past int64 are no one's integers).
LIMIT = 10**18
_MAX_DIGITS = len(str(LIMIT))


class EmptyRange(ValueError):
    """No integer satisfies the bounds."""


def integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None] | None:
    """The inclusive (low, high) an integer schema's minimum/maximum and exclusive bounds allow
    (None: unbounded on that side); None where it sets none."""
    if not any(key in schema for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        return None
    low = _bound(schema, "minimum", "exclusiveMinimum", math.ceil, 1)
    high = _bound(schema, "maximum", "exclusiveMaximum", math.floor, -1)
    if low is not None and high is not None and low > high:
        raise EmptyRange(f"no integer is between {schema.get('minimum', schema.get('exclusiveMinimum'))} and "
                         f"{schema.get('maximum', schema.get('exclusiveMaximum'))}")
    return low, high


def _bound(schema: dict[str, Any], inclusive: str, exclusive: str, rounded, step: int) -> int | None:
    """The tightest integer bound of one side. Draft 4 spells an exclusive bound as a bool beside it."""
    found: list[int] = []
    value, strict = schema.get(inclusive), schema.get(exclusive)
    if _is_number(value):
        whole = rounded(value)
        found.append(whole + step if strict is True and whole == value else whole)
    if _is_number(strict):
        whole = rounded(strict)
        found.append(whole + step if whole == strict else whole)
    if not found:
        return None
    tightest = max(found) if step > 0 else min(found)
    return None if abs(tightest) > LIMIT else tightest


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer_range(low: int | None, high: int | None) -> str:
    """A GBNF expression for the integers from `low` to `high`, both inclusive (None: unbounded)."""
    alternatives = []
    if low is None or low < 0:  # the negatives: "-" and their absolute values
        top = None if low is None else -low
        bottom = 1 if high is None or high >= 0 else -high
        alternatives.append(f'"-" ({_naturals(bottom, top)})')
    if high is None or high >= 0:
        alternatives.append(_naturals(0 if low is None else max(low, 0), high))
    return " | ".join(f"({a})" for a in alternatives)


def _naturals(low: int, high: int | None) -> str:
    """The integers from `low` >= 0 to `high` (None: up to `_MAX_DIGITS` digits), without leading zeros."""
    first = len(str(low))
    if high is None:  # low's length from low on, then any longer number
        longer = f"[1-9] [0-9]{{{first},{_MAX_DIGITS - 1}}}"
        return f"{_between(str(low), '9' * first)} | {longer}" if first < _MAX_DIGITS else _between(str(low), "9" * first)
    parts = []
    for digits in range(first, len(str(high)) + 1):
        start = low if digits == first else 10 ** (digits - 1)
        end = high if digits == len(str(high)) else 10**digits - 1
        parts.append(_between(str(start), str(end)))
    return " | ".join(parts)


def _between(low: str, high: str) -> str:
    """Digit strings of this length from `low` to `high` (same length, low <= high)."""
    if len(low) > 1 and set(low[1:]) == {"0"} and set(high[1:]) == {"9"}:  # every tail
        return f"[{low[0]}-{high[0]}] {_any(len(low) - 1)}"
    if low[0] == high[0]:
        return f'"{low[0]}" ({_between(low[1:], high[1:])})' if len(low) > 1 else f'"{low[0]}"'
    if len(low) == 1:
        return f"[{low[0]}-{high[0]}]"
    rest = len(low) - 1  # the low edge digit, then at least low's tail; the high one, then at most its
    parts = [f'"{low[0]}" ({_between(low[1:], "9" * rest)})']
    if int(low[0]) + 1 <= int(high[0]) - 1:
        parts.append(f"[{int(low[0]) + 1}-{int(high[0]) - 1}] {_any(rest)}")
    parts.append(f'"{high[0]}" ({_between("0" * rest, high[1:])})')
    return " | ".join(parts)


def _any(n: int) -> str:
    return "" if n == 0 else f"[0-9]{{{n}}}" if n > 1 else "[0-9]"
