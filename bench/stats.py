"""Percentiles, the per-workload summary every suite reports, and tables."""

from __future__ import annotations

from bench.client import Result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(results: list[Result], wall: float) -> dict:
    """Latency percentiles over the requests that succeeded; rates over the workload's wall time."""
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok]
    itls = [i for r in ok for i in r.itls]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "requests": len(results),
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p95": percentile(ttfts, 0.95),
        "itl_p50": percentile(itls, 0.5),
        "itl_p95": percentile(itls, 0.95),
        "gap_p95": percentile([g for r in ok for g in r.gaps], 0.95),  # between chunks, whatever each carried
        "output_tok_s": sum(r.output_tokens for r in ok) / wall,
        "requests_s": len(ok) / wall,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(cached) if cached else None,  # None: the server does not report it
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
    }


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if v is None:
            return "n/a"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
