"""Benchmarks: kvserve against references measured in the same run (see docs/benchmarks.md)."""
