"""python -m bench [serving|prefix|checkpoints] — each writes JSON and a Markdown table to bench/results/."""

from __future__ import annotations

import sys

from bench import checkpoints, prefix, serving

SUITES = {"serving": serving.main, "prefix": prefix.main, "checkpoints": checkpoints.main}


def main() -> None:
    names = sys.argv[1:] or list(SUITES)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite {unknown[0]!r}; choose from {', '.join(SUITES)}")
    for name in names:
        print(f"## {name}\n\n{SUITES[name]()}\n")


if __name__ == "__main__":
    main()
