"""python -m bench [compare|sweep|attention|host-tier|kv-types|lora|serving|prefix|checkpoints|soak|embeddings|
speculative|cache-view|models|restart|kv-events]: each writes JSON and Markdown to bench/results/.

compare (the default) puts kvserve next to llama-server, loaded side by side and measured in turns
(`--servers` adds llama-server at its defaults and llama-cpp-python's server); sweep puts
kvserve next to llama-server over 1 to 32 users and prompts of 256 to 4,096 tokens; attention times
raw llama_decode calls in a unified KV cache against a stream per sequence (kvserve's layout, and
why it is); host-tier times copying a prefix's KV rows to host memory and back against prefilling
it; kv-types puts quantized KV caches beside f16 (bytes, decode time, drift); lora times a change
of LoRA adapter set between steps. The others are the earlier kvserve-only suites whose numbers
docs/benchmarks.md quotes; soak serves thousands of requests and charts kvserve's resident memory;
embeddings puts kvserve's /v1/embeddings per second next to llama-server's; speculative times
decoding with each `--speculative` mode (and llama-server's where it is built); cache-view times
/v1/cache, /metrics and the /ui/cache page with 10,000 cached pages; models serves a chat model
and an embedder at once (a RAG mix) from one kvserve against a process per model, and times
loading, reloading and swapping models under `--models-max 1`; restart times a prompt's TTFT after a
restart with the disk tier (`--prefix-disk-dir`, after SIGTERM and SIGKILL) against computing it and
against llama-server's slot save and restore, the tier's bandwidth against dd, and the shared and
multiturn workloads with a small host budget over the disk tier; kv-events serves those workloads with
`--kv-events` and no subscriber against without, in turns.
"""

from __future__ import annotations

import argparse

from bench import (
    attention, cache_view, checkpoints, compare, embeddings, host_tier, kv_events, kv_types, lora, models, prefix, restart,
    serving, soak, speculative, sweep,
)

WORKLOADS = ["shared", "multiturn", "unique", "long", "conversations"]
SERVERS = ["kvserve", "llama-server", "llama-server-defaults", "llama-cpp-python"]
SUITES = ["compare", "sweep", "attention", "host-tier", "kv-types", "lora", "serving", "prefix", "checkpoints", "soak",
          "embeddings", "speculative", "cache-view", "models", "restart", "kv-events"]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("suite", nargs="?", default="compare", choices=SUITES)
    parser.add_argument("--quick", action="store_true",
                        help="compare, sweep, embeddings, speculative, models, restart: a smoke run (fewer rounds, points, tokens, texts or users)")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, help="compare, sweep, embeddings: only these servers")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, help="compare: only these workloads")
    parser.add_argument("--cells", nargs="+", metavar="GLOB",
                        help="speculative: only the cells whose server/workload/users matches one, e.g. 'kvserve-*/edit/1'")
    parser.add_argument("--pair", help="speculative: the server measured in turns with kvserve-off "
                             "(default kvserve-auto; kvserve-auto-nodraft is `auto` without a draft model, as a default serves it)")
    parser.add_argument("--hog", action="store_true",
                        help="speculative: run beside a CPU hog (a busy loop on the last core)")
    parser.add_argument("--sizes", help="restart: prompt sizes in tokens, each with its own runs after a colon "
                        "(default 2048,8192,16384; e.g. 2048,8192,16384:1)")
    parser.add_argument("--runs", type=int, help="compare: turns of each workload; restart: runs per size; kv-events: turns of each config (default 2; --quick 1)")
    parser.add_argument("--parts", help="restart: which of restart,bandwidth,workloads (default all)")
    parser.add_argument("--restarts", type=int, default=1,
                        help="restart: restarts per chain from what its cold server left, in turns across the "
                             "chains (default 1)")
    args = parser.parse_args()
    if args.suite == "compare":
        print(compare.main(args.quick, args.servers, args.workloads, args.runs))
    elif args.suite == "sweep":
        print(sweep.main(args.quick, args.servers))
    elif args.suite == "speculative":
        print(speculative.main(args.quick, args.cells, args.hog, args.pair))
    elif args.suite == "embeddings":
        print(embeddings.main(args.quick, args.servers))
    elif args.suite == "models":
        print(models.main(args.quick))
    elif args.suite == "restart":
        print(restart.main(args.quick, args.sizes, args.runs, args.parts, args.restarts))
    elif args.suite == "kv-events":
        print(kv_events.main(args.quick, args.runs))
    else:
        suites = {"attention": attention, "host-tier": host_tier, "kv-types": kv_types, "lora": lora,
                  "serving": serving, "prefix": prefix, "checkpoints": checkpoints, "soak": soak,
                  "cache-view": cache_view}
        print(suites[args.suite].main())


if __name__ == "__main__":
    main()
