"""Where one kvserve process spends the sweep's 16-user point (16 unique ~200-token prompts at once,
SmolLM2, 32 slots of 512 cells, as `bench sweep` starts both servers), next to llama-server and the
bare `llama_decode` loop.

Phases: `prefill` (every user asks for one token: the burst is all prefill) and `sweep` (two rounds
of 32 tokens per user, as the sweep runs them), each with prompts of its own salt.
- kvserve, from its /metrics counters around a phase: the share of the wall time inside llama_decode,
  in the rest of the engine step (planning, sampling, cache bookkeeping), in the event loop's
  hand-off around a step and between steps, and the tokens per llama_decode call. Shares within one
  process hold on a loaded machine; its seconds do not.
- llama-server (`--metrics`): its llama_decode calls and tokens per call, and the phase's wall time;
  the two servers run in turn `--repeats` times, and kvserve's wall over llama-server's is reported
  per turn (a ratio of two runs: trust it on a quiet machine only).
- the bare loop prefills as many prompts of the same length in one context shaped like kvserve's,
  `chunk` tokens per call in sequence order, for the chunk sizes in CHUNKS (2048 is llama-server's
  -b, 512 its -ub): seconds per prompt token, the floor for kvserve's.

python -m bench.prefill_profile [--users 16] [--threads 2] [--repeats 2]   -> writes results/prefill_profile.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx

from bench import compare, llama_server, workloads
from bench.client import gather_limited, stream_chat
from bench.sweep import SENTENCES
from kvserve.config import embedded_model_path
from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model
from kvserve.testing import ServerProcess, free_port
from kvserve.testing.metrics import Metrics, read_metrics

RESULTS = Path(__file__).parent / "results"
SLOTS, CTX, BATCH = 32, 512, 2048  # the sweep's users axis; kvserve's default --batch-size
CHUNKS = (128, 256, 512, 2048)
COUNTERS = ("steps", "step_seconds", "decode_seconds", "loop_seconds", "decodes", "decode_tokens")


def counters(url: str) -> dict[str, float]:
    page = read_metrics(url)
    return {name: page.value(f"kvserve_engine_{name}_total") for name in COUNTERS}


async def phase(url: str, salt: str, users: int, rounds: int, max_tokens: int, extra: dict) -> tuple[float, list]:
    """Every user's rounds one after another, all users at once; (wall seconds, results). Prompts of
    another salt share nothing but the chat template, so no phase finds another's prompts cached."""
    workload = workloads.unique(salt, users=users, rounds=rounds, sentences=SENTENCES)  # the sweep's prompts
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64, max_keepalive_connections=0)) as client:
        async def user(u: int) -> list:
            return [await stream_chat(client, url, workload.messages(u, r, []), max_tokens, extra)
                    for r in range(rounds)]
        started = time.perf_counter()
        per_user = await gather_limited([lambda u=u: user(u) for u in range(users)], users)
    return time.perf_counter() - started, [r for results in per_user for r in results]


def shares(wall: float, before: dict, after: dict) -> dict:
    d = {name: after[name] - before[name] for name in COUNTERS}
    return {"wall_s": wall, "steps": d["steps"], "decodes": d["decodes"], "tokens": d["decode_tokens"],
            "tokens_per_decode": d["decode_tokens"] / d["decodes"] if d["decodes"] else 0.0,
            "in_llama_decode": d["decode_seconds"] / wall,
            "rest_of_step": (d["step_seconds"] - d["decode_seconds"]) / wall,
            "hand_off": (d["loop_seconds"] - d["step_seconds"]) / wall, "between_steps": 1 - d["loop_seconds"] / wall,
            "decode_s_per_token": d["decode_seconds"] / d["decode_tokens"] if d["decode_tokens"] else 0.0}


PHASES = (("prefill", 1, 1), ("sweep", 2, 32))  # (name, rounds, max_tokens)


def run_phases(url: str, users: int, extra: dict, read: callable) -> dict:
    workloads.run_sync(url, workloads.Workload("warm-up", 1, 1, lambda *_: compare.WARM_UP), 8, extra)
    out = {}
    for name, rounds, max_tokens in PHASES:
        before = read(url)
        wall, results = asyncio.run(phase(url, name, users, rounds, max_tokens, extra))
        out[name] = {**read(url, before, wall), "prompt_tokens": sum(r.prompt_tokens for r in results) / len(results),
                     "ttft_max_s": max(r.ttft for r in results), "errors": sum(bool(r.error) for r in results)}
    return out


def kvserve_read(url: str, before: dict | None = None, wall: float = 0.0) -> dict:
    now = counters(url)
    return now if before is None else shares(wall, before, now)


def llama_read(url: str, before: dict | None = None, wall: float = 0.0) -> dict:
    """llama-server's /metrics (--metrics): its llama_decode calls, and the tokens they carried."""
    page = Metrics.parse(httpx.get(f"{url}/metrics", timeout=30).text)
    now = {"decodes": page.value("llamacpp:n_decode_total"),
           "tokens": page.value("llamacpp:prompt_tokens_total") + page.value("llamacpp:tokens_predicted_total")}
    if before is None:
        return now
    d = {k: now[k] - before[k] for k in now}
    return {"wall_s": wall, "decodes": d["decodes"],
            "tokens_per_decode": d["tokens"] / d["decodes"] if d["decodes"] else 0.0}


def profile(server: str, model: Path, users: int, threads: int) -> dict:
    extra = {"logit_bias": compare.end_of_generation_bias(model)}
    log = RESULTS / f"prefill_profile-{server}.log"
    port = free_port()
    if server == "kvserve":
        process = ServerProcess.kvserve(log, port=port, model=str(model), threads=threads, parallel=SLOTS, ctx_size=CTX)
    else:  # as bench sweep starts it, with its metrics on
        process = ServerProcess([str(llama_server.require()), "--host", "127.0.0.1", "--port", str(port),
                                 "--model", str(model), "--threads", str(threads), "--threads-batch", str(threads),
                                 "--parallel", str(SLOTS), "--ctx-size", str(SLOTS * CTX), "--metrics"], port, log)
    with process:
        process.wait_healthy()
        return run_phases(process.url, users, extra, kvserve_read if server == "kvserve" else llama_read)


def bare_prefill(model: Model, prompts: int, prompt_len: int, chunk: int, threads: int) -> float:
    """Seconds per prompt token: `prompts` prompts of `prompt_len` tokens, `chunk` tokens per call."""
    ctx = Context(model, ContextParams(n_ctx_seq=CTX, n_batch=BATCH, n_seq_max=SLOTS, n_threads=threads))
    batch = Batch(BATCH)
    tokens = model.tokenize("a tale of the number 7 and its friends. " * 64, add_special=True)[:prompt_len]
    pending = [(seq, pos) for seq in range(prompts) for pos in range(prompt_len)]
    started = time.perf_counter()
    for i in range(0, len(pending), chunk):
        batch.clear()
        for seq, pos in pending[i:i + chunk]:
            batch.add(tokens[pos], pos, seq, pos == prompt_len - 1)
        ctx.decode(batch)
    seconds = time.perf_counter() - started
    batch.close()
    ctx.close()
    return seconds / len(pending)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="kvserve and llama-server in turn, this many times")
    args = parser.parse_args()
    path = embedded_model_path()
    served = [{server: profile(server, path, args.users, args.threads) for server in ("kvserve", "llama-server")}
              for _ in range(args.repeats)]
    prompt_len = round(served[0]["kvserve"]["prefill"]["prompt_tokens"])
    model = Model(path)
    bare_prefill(model, args.users, prompt_len, BATCH, args.threads)  # a warm-up: the first context pays page faults
    bare = {chunk: bare_prefill(model, args.users, prompt_len, chunk, args.threads) for chunk in CHUNKS}
    model.close()
    result = {"users": args.users, "threads": args.threads, "prompt_len": prompt_len, "runs": served,
              "kvserve_over_llama_server_wall": {name: [r["kvserve"][name]["wall_s"] / r["llama-server"][name]["wall_s"]
                                                        for r in served] for name, _, _ in PHASES},
              "bare_prefill_s_per_token": bare}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefill_profile.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
