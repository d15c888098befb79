"""python -m bench [compare|serving|prefix|checkpoints|soak] — each writes JSON and Markdown to bench/results/.

compare (the default) puts kvserve next to llama-server and llama-cpp-python's server; the others
are the earlier kvserve-only suites whose numbers docs/benchmarks.md quotes; soak serves thousands of requests
and charts kvserve's resident memory.
"""

from __future__ import annotations

import argparse

from bench import checkpoints, compare, prefix, serving, soak

WORKLOADS = ["shared", "multiturn", "unique", "long"]
SERVERS = ["kvserve", "llama-server", "llama-cpp-python"]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("suite", nargs="?", default="compare", choices=["compare", "serving", "prefix", "checkpoints", "soak"])
    parser.add_argument("--quick", action="store_true", help="compare: one or two rounds, 16 tokens (a smoke run)")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, help="compare: only these servers")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, help="compare: only these workloads")
    args = parser.parse_args()
    if args.suite == "compare":
        print(compare.main(args.quick, args.servers, args.workloads))
    else:
        print({"serving": serving, "prefix": prefix, "checkpoints": checkpoints, "soak": soak}[args.suite].main())


if __name__ == "__main__":
    main()
