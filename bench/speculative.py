"""The speculative-decoding benchmark: decode tokens per second after the first token, kvserve with
`--speculative off`, `ngram` and `auto`, and llama-server without speculation and with `ngram-mod`
where its binary is built (`make bench-setup`).

Workloads, greedy:
- edit: a code edit whose answer repeats most of the input (rename a variable in a function);
- edit+prediction: the same edit with OpenAI's `prediction` set to the original code (kvserve only;
  no llama.cpp server honours the field);
- free: a free-form question, whose answer repeats little;
- regenerate: the free-form question asked again (the prefix tree holds the earlier answer).
Each at 1 and 4 concurrent users (`USERS`). Every request but regenerate's starts with its own tag,
so no request finds an earlier one's answer in the prefix tree.

The target is Qwen2.5-Coder-0.5B-Instruct (the part packages `part_models.py` assembles); the issue's
1.5B target is left out where its parts are not installed.

python -m bench speculative
"""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path

import httpx

from bench import llama_server
from bench.client import gather_limited, stream_chat
from kvserve.testing import ServerProcess, free_port
from kvserve.testing.part_models import part_model

RESULTS = Path(__file__).parent / "results"
USERS = (1, 4)
MAX_TOKENS = 120
THREADS = 2

CODE = '''def summarize(values):
    total = 0
    count = 0
    for value in values:
        if value is None:
            continue
        total += value
        count += 1
    if count == 0:
        return {"total": 0, "count": 0, "mean": None}
    mean = total / count
    return {"total": total, "count": count, "mean": mean}
'''
EDIT = [{"role": "user", "content": "Rename the variable `count` to `n` in this Python function. "
                                    "Reply with the whole function only, in a code block.\n\n```python\n" + CODE + "```"}]
FREE = [{"role": "user", "content": "Explain in a few paragraphs why the sky is blue and why sunsets are red."}]


def workloads() -> dict[str, tuple[list[dict], dict]]:
    prediction = {"prediction": {"type": "content", "content": "```python\n" + CODE.replace("count", "n") + "```"}}
    return {"edit": (EDIT, {}), "edit+prediction": (EDIT, prediction), "free": (FREE, {}), "regenerate": (FREE, {})}


def tagged(messages: list[dict], tag: str) -> list[dict]:
    return [{**messages[0], "content": f"[{tag}] {messages[0]['content']}"}, *messages[1:]]


def decode_rate(results) -> float:
    """Median over requests of (tokens after the first) / (seconds after the first token)."""
    rates = [(r.output_tokens - 1) / (r.seconds - r.ttft) for r in results
             if not r.error and r.output_tokens > 1 and r.seconds > r.ttft]
    return statistics.median(rates) if rates else 0.0


_tags = iter(range(10**6))


async def measure(url: str, messages: list[dict], extra: dict, users: int, fresh: bool) -> dict:
    """`fresh`: each request tagged apart, so none finds another's answer in the prefix tree."""
    def one(n_tokens: int):
        return lambda: stream_chat(client, url, tagged(messages, f"r{next(_tags)}") if fresh else messages,
                                   n_tokens, extra)
    async with httpx.AsyncClient() as client:
        await one(MAX_TOKENS if not fresh else 4)()  # a warm-up; for regenerate, the answer asked again
        results = await gather_limited([one(MAX_TOKENS) for _ in range(max(users, 2))], users)
    errors = [r.error for r in results if r.error]
    return {"decode_tps": decode_rate(results), "tokens": statistics.mean(r.output_tokens for r in results),
            "errors": errors[:1]}


def servers(model: Path) -> list[tuple[str, list[str] | dict, tuple[str, ...]]]:
    """(name, kvserve settings or a llama-server argv tail, workloads it runs)."""
    runs: list[tuple[str, list[str] | dict, tuple[str, ...]]] = [
        (f"kvserve {mode}", {"speculative": mode}, ("edit", "edit+prediction", "free", "regenerate"))
        for mode in ("off", "ngram", "auto")
    ]
    if llama_server.binary().is_file():
        runs += [("llama-server none", [], ("edit", "free", "regenerate")),
                 ("llama-server ngram-mod", ["--spec-type", "ngram-mod"], ("edit", "free", "regenerate"))]
    return runs


def start(name: str, spec, model: Path, log: Path) -> ServerProcess:
    if isinstance(spec, dict):
        return ServerProcess.kvserve(log, model=str(model), threads=THREADS, parallel=max(USERS), ctx_size=4096, **spec)
    port = free_port()
    argv = [str(llama_server.binary()), "--host", "127.0.0.1", "--port", str(port), "--model", str(model),
            "--threads", str(THREADS), "--threads-batch", str(THREADS), "--parallel", str(max(USERS)),
            "--ctx-size", str(4096 * max(USERS)), *spec]
    return ServerProcess(argv, port, log)


def main() -> str:
    model = part_model("qwen2.5-coder-0.5b")
    if model is None:
        raise SystemExit("the Qwen2.5-Coder-0.5B part packages are not installed")
    rows = []
    for name, spec, names in servers(model):
        log = RESULTS / f"speculative-{name.replace(' ', '-')}.log"
        with start(name, spec, model, log) as server:
            server.wait_healthy()
            for workload, (messages, extra) in workloads().items():
                if workload not in names:
                    continue
                for users in USERS:
                    row = {"server": name, "workload": workload, "users": users,
                           **asyncio.run(measure(server.url, messages, extra, users, workload != "regenerate"))}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "speculative.json").write_text(json.dumps(rows, indent=1))
    return table(rows)


def table(rows: list[dict]) -> str:
    base = {(r["workload"], r["users"]): r["decode_tps"] for r in rows if r["server"] == "kvserve off"}
    lines = ["| server | workload | users | decode tok/s | vs kvserve off |", "|---|---|---|---|---|"]
    for r in rows:
        ref = base.get((r["workload"], r["users"])) or 0.0
        ratio = f"{r['decode_tps'] / ref:.2f}x" if ref else "-"
        lines.append(f"| {r['server']} | {r['workload']} | {r['users']} | {r['decode_tps']:.1f} | {ratio} |")
    text = "\n".join(lines)
    (RESULTS / "speculative.md").write_text(text + "\n")
    return text
