"""python -m bench restart: the disk tier (`--prefix-disk-dir`) across a restart, against recomputing and
against llama-server's manual slot save and restore.

1. Restart TTFT. Qwen2.5-Coder-1.5B-Instruct where its part packages are installed, else
   Qwen2.5-Coder-0.5B-Instruct (said so in the results), `--parallel 1`, `--ctx-size CTX`, all cores.
   A prompt of each size is kvserve's own source files, concatenated and cut to size in tokens, then a
   question; the same token ids go to every server (`/v1/completions` with a token list for kvserve,
   `/completion` for llama-server), streamed, 2 tokens: TTFT is the first token's arrival, and the
   request's whole time (the second token, and what a server does as a request ends) is shown beside it.
   Every server first answers a 2-token warm-up request (no page of it is cached), so the one-time
   costs of a first request are in no cell. For each size and run, each on a fresh folder:
   - kvserve, SIGTERM: cold TTFT on a fresh server (the prompt computed), then SIGTERM and wait (the
     writer finishes its queue), a new server on the same folder, the same prompt's TTFT (`restart`),
     with its `usage.prompt_tokens_details.cached_tokens`;
   - kvserve, SIGKILL: the same, but the first server is killed `KILL_WAIT` seconds after its answer
     (what the writer had not written by then is lost);
   - llama-server `--slot-save-path`: cold TTFT, `POST /slots/0?action=save`, SIGTERM, a new server,
     `POST /slots/0?action=restore`, then the prompt (`cache_prompt`, `id_slot` 0): save, restore and
     TTFT times, where bench.llama_server has built the binary.
   Runs alternate the order of the three. With `--restarts K`, each chain then restarts K-1 more times
   from what it left (kvserve: its folder, each restarted server stopped with SIGTERM; llama-server: the
   slot file, restored again), in turns across the chains (A B C, C B A, ...), so that each restart has
   a neighbour of each server beside it; the restart cells are then over every turn, the cold ones over
   the runs, and each restart is also shown over llama-server's in the same turn. Each cell is the
   median (lowest-highest).
2. Disk bandwidth: `dd` on the folders' file system (512 MiB written with `conv=fsync`, then read back,
   after `echo 3 > /proc/sys/vm/drop_caches` where permitted, and read again from the page cache),
   beside the disk tier's own counters: bytes written over the writer's seconds (each page a file,
   written, fsynced and renamed), and pages read back over the seconds reading them, on the restarted
   servers (those files were just written: the reads come from the page cache, as after a process
   restart on a running machine; two threads read, and their seconds are summed, so this rate is a
   lower bound).
3. Workloads: `python -m bench`'s shared and multiturn workloads (SmolLM2-135M, the sizes they are
   written for: 8 users, 4,096-token context, 64 output tokens) on kvserve alone, `host` (no disk tier,
   the default host budget, ample) against `disk` (the disk tier on, `--prefix-state-mb` a quarter of
   what `host`'s first run held in `/v1/cache`), ABBA on fresh servers; ratios disk / host per run.

python -m bench restart [--quick] [--sizes 2048,8192,16384:1] [--runs 2] [--restarts 1]
                        [--parts restart,bandwidth,workloads]
(--quick: 2,048 and 8,192 tokens, 1 run, short workloads; writes restart-partial.*; a size may carry its
own number of runs after a colon)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench import compare, llama_server, report, workloads
from bench.client import timing_client
from bench.stats import markdown_table, summarize
from kvserve.config import embedded_model_path
from kvserve.testing import ServerProcess, free_port, http_get, kvserve_command, read_metrics
from kvserve.testing.part_models import part_model

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parent.parent
SIZES = (2048, 8192, 16384)
QUICK_SIZES = (2048, 8192)
RUNS = 2
CTX = 17000  # one request's context: the longest prompt and its answer fit
KILL_WAIT = 2.0  # seconds between the cold answer and SIGKILL: the writer's time to write behind
CAP = 1800.0  # the most seconds one request may take (16k tokens computed on 2 busy cores: minutes)
START_CAP = 300.0
DD_MIB = 512
MODEL, FALLBACK = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
QUESTION = ("\n\nQuestion: in the repository above, which module writes the prefix cache's pages to disk, "
            "and what does it do after a crash? Answer in one sentence.\nAnswer:")
WARM_UP = "Hi"
TARGET_SIZE, TARGET_SPEEDUP = 8192, 20.0
WORKLOADS = ("shared", "multiturn")
PARTS = ("restart", "bandwidth", "workloads")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def pick_model() -> tuple[Path, str]:
    """The model for part 1 and a note on which it is."""
    path = part_model(MODEL)
    if path is not None:
        return path, "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)"
    path = part_model(FALLBACK)
    if path is None:
        raise SystemExit("neither Qwen2.5-Coder-1.5B's nor 0.5B's part packages are installed (`make install-bench`)")
    return path, ("Qwen2.5-Coder-0.5B-Instruct (Q4), the fallback: Qwen2.5-Coder-1.5B-Instruct's part packages "
                  "are not installed here")


# -- prompts ----------------------------------------------------------------------------------------------

def source_files() -> list[Path]:
    """kvserve's own Python files, in a fixed order."""
    return sorted((ROOT / "kvserve").rglob("*.py"))


def build_prompt(tokenize: Callable[[str], list[int]], size: int, files: list[Path]) -> list[int]:
    """`size` token ids: the files, each under its path, as many as it takes, cut so that the question's
    tokens end it."""
    question = tokenize(QUESTION)
    text, tokens = "The files of a repository follow.\n", []
    for path in files:
        text += f"\n### {path.relative_to(ROOT)}\n{path.read_text(errors='replace')}"
        tokens = tokenize(text)
        if len(tokens) >= size:
            break
    if len(tokens) + len(question) < size:
        raise ValueError(f"the source files make only {len(tokens)} tokens, fewer than {size}")
    return tokens[:size - len(question)] + question


def prompts(model_path: Path, sizes: list[int]) -> dict[int, list[int]]:
    from kvserve.llama.model import Model

    model = Model(model_path)
    try:
        files = source_files()
        return {n: build_prompt(lambda t: model.tokenize(t, add_special=False, parse_special=False), n, files)
                for n in sizes}
    finally:
        model.close()


# -- requests ---------------------------------------------------------------------------------------------

def post(url: str, path: str, body: dict, timeout: float = CAP) -> tuple[dict, float]:
    began = time.perf_counter()
    response = timing_client().post(f"{url}{path}", json=body, timeout=timeout)
    seconds = time.perf_counter() - began
    if response.status_code != 200:
        raise RuntimeError(f"POST {path}: HTTP {response.status_code}: {response.text[:300]}")
    return response.json(), seconds


def streamed(url: str, path: str, body: dict, timeout: float = CAP) -> tuple[list[dict], float, float]:
    """POST `body` with `stream` on: its events, the seconds to the first one carrying text (the time to
    first token) and to the end of the response."""
    began, first, events = time.perf_counter(), None, []
    with timing_client().stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=timeout) as response:
        if response.status_code != 200:
            raise RuntimeError(f"POST {path}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            events.append(event)
            texts = [c.get("text") for c in event.get("choices") or []] + [event.get("content")]
            if first is None and any(texts):
                first = time.perf_counter() - began
    seconds = time.perf_counter() - began
    return events, first if first is not None else seconds, seconds


def kvserve_ttft(url: str, tokens: list[int] | str) -> dict:
    """One streamed /v1/completions request of max_tokens 2: the seconds to its first token and to its
    end, prompt and cached tokens."""
    events, first, seconds = streamed(url, "/v1/completions", {"prompt": tokens, "max_tokens": 2, "temperature": 0,
                                                               "stream_options": {"include_usage": True}})
    usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
    return {"ttft_s": first, "request_s": seconds, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"), "loadavg": loadavg()}


def llama_ttft(url: str, tokens: list[int] | str) -> dict:
    """One streamed /completion request of n_predict 2 on slot 0, caching the prompt: seconds to its
    first token and to its end, prompt tokens and the tokens it took from the slot's cache
    (timings.cache_n, else prompt less evaluated tokens)."""
    events, first, seconds = streamed(url, "/completion", {"prompt": tokens, "n_predict": 2, "temperature": 0,
                                                          "cache_prompt": True, "id_slot": 0})
    body = next((e for e in reversed(events) if e.get("timings")), events[-1] if events else {})
    timings = body.get("timings") or {}
    evaluated = timings.get("prompt_n")
    cached = timings.get("cache_n")
    prompt = body.get("tokens_evaluated") or ((cached or 0) + (evaluated or 0)) or None
    if cached is None and prompt is not None and evaluated is not None:
        cached = prompt - evaluated
    return {"ttft_s": first, "request_s": seconds, "prompt_tokens": prompt, "cached_tokens": cached,
            "evaluated_tokens": evaluated, "loadavg": loadavg()}


def disk_stats(url: str) -> dict:
    """/v1/cache's tiers (host and disk) and the disk tier's byte counter from /metrics."""
    status, body = http_get(f"{url}/v1/cache", timeout=30)
    tiers = json.loads(body)["tiers"] if status == 200 else {}
    out = {"host": tiers.get("host"), "disk": tiers.get("disk")}
    with contextlib.suppress(Exception):
        metrics = read_metrics(url)
        out["written_bytes"] = metrics.total("kvserve_prefix_disk_written_bytes_total")
        out["read_seconds"] = metrics.total("kvserve_prefix_disk_read_seconds_total")
        out["write_seconds"] = metrics.total("kvserve_prefix_disk_write_seconds_total")
        out["hits"] = metrics.total("kvserve_prefix_disk_hits_total")
    return out


def page_files(folder: Path) -> tuple[int, int]:
    """(files, bytes) of complete page files under `folder`."""
    files = list((folder / "pages").rglob("*.page")) if (folder / "pages").is_dir() else []
    return len(files), sum(f.stat().st_size for f in files)


# -- part 1: restart TTFT ---------------------------------------------------------------------------------

def started(command: list[str], port: int, log: Path, stack: contextlib.ExitStack) -> tuple[ServerProcess, float]:
    began = time.perf_counter()
    process = stack.enter_context(ServerProcess(command, port, log))
    process.wait_healthy(timeout=START_CAP)
    return process, time.perf_counter() - began


def kvserve_server(model: Path, folder: Path, log: Path, stack: contextlib.ExitStack) -> tuple[ServerProcess, float]:
    port = free_port()
    command = kvserve_command(port=port, model=str(model), threads=os.cpu_count() or 1, parallel=1, ctx_size=CTX,
                              prefix_disk_dir=str(folder))
    process, seconds = started(command, port, log, stack)
    kvserve_ttft(process.url, WARM_UP)
    return process, seconds


def kvserve_chain(model: Path, tokens: list[int], folder: Path, stop: str) -> dict:
    """Cold on a fresh server and folder, `stop` ("sigterm" or "sigkill") it, the same prompt on a new
    server on the folder."""
    row: dict = {"server": f"kvserve-{stop}", "tokens": len(tokens)}
    log = RESULTS / f"restart-kvserve-{stop}.log"
    with contextlib.ExitStack() as stack:
        first, row["start_s"] = kvserve_server(model, folder, log, stack)
        row["cold"] = kvserve_ttft(first.url, tokens)
        if stop == "sigkill":
            time.sleep(KILL_WAIT)
            row["before_stop"] = disk_stats(first.url)
            began = time.perf_counter()
            first.kill()
        else:
            row["before_stop"] = disk_stats(first.url)
            began = time.perf_counter()
            row["exit_status"] = first.stop(grace=120)
        row["stop_s"] = time.perf_counter() - began
    row["files_after_stop"], row["bytes_after_stop"] = page_files(folder)
    turn = kvserve_restart(model, tokens, folder, log.with_suffix(".restarted.log"))
    row["restart_start_s"], row["restart"], row["after_restart"] = turn["start_s"], turn["ttft"], turn["tiers"]
    return row


def kvserve_restart(model: Path, tokens: list[int], folder: Path, log: Path) -> dict:
    """A new server on `folder`: the prompt's TTFT, then SIGTERM."""
    with contextlib.ExitStack() as stack:
        server, start_s = kvserve_server(model, folder, log, stack)
        ttft = kvserve_ttft(server.url, tokens)
        return {"start_s": start_s, "ttft": ttft, "tiers": disk_stats(server.url)}


def llama_command(binary: Path, model: Path, port: int, folder: Path) -> list[str]:
    threads = str(os.cpu_count() or 1)
    return [str(binary), "--host", "127.0.0.1", "--port", str(port), "--model", str(model), "--threads", threads,
            "--threads-batch", threads, "--parallel", "1", "--ctx-size", str(CTX), "--slot-save-path", str(folder)]


def llama_chain(binary: Path, model: Path, tokens: list[int], folder: Path) -> dict:
    """Cold, save slot 0, SIGTERM, a new server, restore slot 0, the same prompt."""
    row: dict = {"server": "llama-server-slot-save", "tokens": len(tokens)}
    folder.mkdir(parents=True, exist_ok=True)
    name = slot_file(tokens)
    log = RESULTS / "restart-llama-server.log"
    with contextlib.ExitStack() as stack:
        port = free_port()
        first, row["start_s"] = started(llama_command(binary, model, port, folder), port, log, stack)
        llama_ttft(first.url, WARM_UP)
        row["cold"] = llama_ttft(first.url, tokens)
        saved, row["save_s"] = post(first.url, "/slots/0?action=save", {"filename": name})
        row["save"] = saved
        row["saved_bytes"] = (folder / name).stat().st_size if (folder / name).is_file() else None
        began = time.perf_counter()
        row["exit_status"] = first.stop(grace=120)
        row["stop_s"] = time.perf_counter() - began
    turn = llama_restart(binary, model, tokens, folder, log.with_suffix(".restarted.log"))
    row["restart_start_s"], row["restore"], row["restore_s"], row["restart"] = (
        turn["start_s"], turn["restore"], turn["restore_s"], turn["ttft"])
    return row


def slot_file(tokens: list[int]) -> str:
    """The file llama-server saves a chain's slot 0 to, under --slot-save-path, and restores it from."""
    return f"prompt-{len(tokens)}.bin"


def llama_restart(binary: Path, model: Path, tokens: list[int], folder: Path, log: Path) -> dict:
    """A new server on `folder`: restore slot 0 from the chain's file, the prompt's TTFT, then SIGTERM."""
    with contextlib.ExitStack() as stack:
        port = free_port()
        server, start_s = started(llama_command(binary, model, port, folder), port, log, stack)
        llama_ttft(server.url, WARM_UP)
        restored, restore_s = post(server.url, "/slots/0?action=restore", {"filename": slot_file(tokens)})
        return {"start_s": start_s, "restore": restored, "restore_s": restore_s, "ttft": llama_ttft(server.url, tokens)}


def show(row: dict) -> str:
    extra = ""
    if "save_s" in row:
        extra = f", save {row['save_s']:.2f} s, restore {row['restore_s']:.2f} s"
    return (f"{row['tokens']:>6} run {row['run']} {row['server']:>24}: cold {row['cold']['ttft_s']:.2f} s "
            f"(cached {row['cold']['cached_tokens']}), restart {row['restart']['ttft_s']:.3f} s "
            f"(cached {row['restart']['cached_tokens']}/{row['restart']['prompt_tokens']}){extra} "
            f"(load {row['cold']['loadavg'][0]})")


def restart_part(model: Path, plan: list[tuple[int, int]], tmp: Path,
                 restarts: int = 1) -> tuple[list[dict], str, list[dict]]:
    """Part 1's rows, the note on llama-server, and the chains that failed. Each chain restarts
    `restarts` times from what its cold server left: the first as the chain ends, the others in
    turns across the chains (A B C, C B A, ...), each turn's restart TTFT in the row's `turns`."""
    binary = llama_server.binary()
    if binary.is_file():
        llama_note = f"measured ({binary})"
    else:
        llama_note = f"not built: {binary} is missing (`make bench-setup`), so its rows are left out"
    print(f"llama-server: {llama_note}", flush=True)
    tokens = prompts(model, sorted({n for n, _ in plan}))
    rows, failed = [], []
    for size, runs in plan:
        for run in range(runs):
            chains = ["sigterm", "sigkill"] + (["llama"] if binary.is_file() else [])
            if run % 2:
                chains.reverse()
            done: dict[str, dict] = {}
            try:
                for turn in range(restarts):
                    for chain in (chains if turn % 2 == 0 else chains[::-1]):
                        if turn and chain not in done:
                            continue
                        folder = tmp / f"{chain}-{size}-{run}"
                        try:
                            if turn == 0:
                                done[chain] = first_restart(binary, model, tokens[size], folder, chain, run)
                                rows.append(done[chain])
                                print(show(done[chain]), flush=True)
                            else:
                                again = further_restart(binary, model, tokens[size], folder, chain)
                                done[chain]["turns"].append(again)
                                print(f"{size:>6} run {run} {done[chain]['server']:>24}: turn {turn} "
                                      f"{show_turn(again)}", flush=True)
                        except Exception as exc:  # a chain that fails is reported, the others still run
                            failed.append({"size": size, "run": run, "chain": chain, "turn": turn,
                                           "error": f"{type(exc).__name__}: {exc}"[-800:]})
                            print(f"{size} run {run} {chain} turn {turn}: failed: {exc}", flush=True)
                            done.pop(chain, None)
            finally:
                for chain in chains:
                    shutil.rmtree(tmp / f"{chain}-{size}-{run}", ignore_errors=True)
    return rows, llama_note, failed


def first_restart(binary: Path, model: Path, tokens: list[int], folder: Path, chain: str, run: int) -> dict:
    """The chain: cold, stopped, restarted once; its row, whose `turns` start with that restart."""
    if chain == "llama":
        row = llama_chain(binary, model, tokens, folder)
    else:
        row = kvserve_chain(model, tokens, folder, chain)
    row["run"] = run
    row["turns"] = turns_of(row)
    return row


def further_restart(binary: Path, model: Path, tokens: list[int], folder: Path, chain: str) -> dict:
    """One more restart on what the chain left (kvserve: its folder, as the last server left it after
    SIGTERM; llama-server: the slot file saved by the cold server)."""
    if chain == "llama":
        turn = llama_restart(binary, model, tokens, folder, RESULTS / "restart-llama-server.restarted.log")
        return {"ttft": turn["ttft"], "restore_s": turn["restore_s"]}
    turn = kvserve_restart(model, tokens, folder, RESULTS / f"restart-kvserve-{chain}.restarted.log")
    runs = (turn["tiers"].get("disk") or {}).get("runs") or {}
    return {"ttft": turn["ttft"], "runs": runs.get("hits"), "staged": runs.get("staged_hits")}


def show_turn(turn: dict) -> str:
    restore = f", restore {turn['restore_s']:.3f} s" if "restore_s" in turn else ""
    return (f"restart {turn['ttft']['ttft_s']:.3f} s (cached {turn['ttft']['cached_tokens']}/"
            f"{turn['ttft']['prompt_tokens']}){restore}")


# -- part 2: bandwidth ------------------------------------------------------------------------------------

def _dd(args: list[str]) -> dict:
    """dd's own figure: bytes, seconds, and MB/s as bytes / seconds / 1e6."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    found = re.search(r"(\d+) bytes .* copied, ([\d.,e-]+) s", out)
    if not found:
        raise RuntimeError(f"dd said: {out[-300:]}")
    nbytes, seconds = int(found[1]), float(found[2].replace(",", "."))
    return {"bytes": nbytes, "seconds": seconds, "mb_s": nbytes / seconds / 1e6}


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def dd_bandwidth(folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "dd.bin"
    try:
        out = {"write": _dd(["if=/dev/zero", f"of={target}", "bs=1M", f"count={DD_MIB}", "conv=fsync"])}
        out["dropped_caches"] = drop_caches()
        out["read"] = _dd([f"if={target}", "of=/dev/null", "bs=1M"])
        out["read_page_cache"] = _dd([f"if={target}", "of=/dev/null", "bs=1M"])
    finally:
        target.unlink(missing_ok=True)
    out["file_system"] = subprocess.run(["df", "--output=source,fstype,target", str(folder)], capture_output=True,
                                        text=True).stdout.splitlines()[-1].split()
    return out


def store_bandwidth(rows: list[dict]) -> dict:
    """The disk tier's write and read rates, over every kvserve chain: written bytes over write seconds
    (the SIGKILL chains' counters, read KILL_WAIT seconds after the answer; the SIGTERM chains' are read
    at once, before the queue is done), and bytes read back (pages read x bytes per page) over read seconds."""
    writes, reads = [], []
    for r in rows:
        if not r["server"].startswith("kvserve"):
            continue
        before, after = r.get("before_stop") or {}, r.get("after_restart") or {}
        if r["server"] == "kvserve-sigkill" and before.get("write_seconds"):
            writes.append({"tokens": r["tokens"], "bytes": before["written_bytes"], "seconds": before["write_seconds"],
                           "pages": (before.get("disk") or {}).get("writes")})
        disk = after.get("disk") or {}
        if disk.get("hits") and disk.get("read_seconds") and disk.get("pages"):
            per_page = disk["bytes"] / disk["pages"]
            reads.append({"tokens": r["tokens"], "bytes": disk["hits"] * per_page, "seconds": after["read_seconds"],
                          "pages": disk["hits"]})

    def rate(items: list[dict]) -> dict | None:
        if not items:
            return None
        each = [i["bytes"] / i["seconds"] / 1e6 for i in items if i["seconds"]]
        return {"mb_s_overall": sum(i["bytes"] for i in items) / sum(i["seconds"] for i in items) / 1e6,
                "mb_s_each": [round(x, 1) for x in each], "bytes": sum(i["bytes"] for i in items),
                "pages": sum(i["pages"] or 0 for i in items), "samples": items}
    return {"write": rate(writes), "read": rate(reads)}


# -- part 3: workloads ------------------------------------------------------------------------------------

def the_workloads(quick: bool) -> list[workloads.Workload]:
    if quick:
        return [workloads.shared(rounds=1), workloads.multiturn(rounds=2)]
    return [workloads.shared(), workloads.multiturn()]


def workload_turns(runs: int, configs: tuple[str, str] = ("host", "disk")) -> list[str]:
    """`runs` turns of each config in ABBA order: host, disk, disk, host, host, disk, ..."""
    a, b = configs
    pattern = [a, b, b, a]
    return [pattern[i % 4] for i in range(2 * runs)]


def workload_measure(config: str, workload: workloads.Workload, budget_mb: float | None, folder: Path,
                     max_tokens: int, extra: dict) -> dict:
    model = embedded_model_path()
    port = free_port()
    settings = {"port": port, "model": str(model), "threads": os.cpu_count() or 1, "parallel": compare.SLOTS,
                "ctx_size": compare.CTX_PER_REQUEST}
    if config == "disk":
        settings |= {"prefix_state_mb": f"{budget_mb:.3f}", "prefix_disk_dir": str(folder)}
    row = {"config": config, "workload": workload.name, "prefix_state_mb": budget_mb, "loadavg": loadavg()}
    with ServerProcess(kvserve_command(**settings), port, RESULTS / f"restart-{config}-{workload.name}.log") as p:
        p.wait_healthy(timeout=START_CAP)
        workloads.run_sync(p.url, workloads.Workload("warm-up", 1, 1, lambda *_: compare.WARM_UP), 8, extra)
        ran = workloads.run_sync(p.url, workload, max_tokens, extra)
        row |= summarize(ran.results, ran.wall)
        row["tiers"] = disk_stats(p.url)
    return row


def workloads_part(quick: bool, runs: int, tmp: Path) -> list[dict]:
    max_tokens = 16 if quick else compare.MAX_TOKENS
    extra = {"logit_bias": compare.end_of_generation_bias(embedded_model_path())}
    rows = []
    for workload in the_workloads(quick):
        budget = None
        for turn, config in enumerate(workload_turns(runs)):
            if config == "disk" and budget is None:
                raise RuntimeError("the disk config runs after a host run sizes its budget")
            folder = tmp / f"workload-{workload.name}-{turn}"
            try:
                row = workload_measure(config, workload, budget if config == "disk" else None, folder, max_tokens, extra)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            row["turn"] = turn
            if config == "host" and budget is None:
                held = (row["tiers"].get("host") or {}).get("bytes") or 0
                row["sized_budget_from_bytes"] = held
                budget = max(held / 4 / 2**20, 0.25)
            rows.append(row)
            disk = (row["tiers"].get("disk") or {})
            print(f"{workload.name:>10} {config:>5} turn {turn}: {row['output_tok_s']:.1f} tok/s, TTFT p50 "
                  f"{row['ttft_p50']:.3f} s p95 {row['ttft_p95']:.3f} s, cached {row['cached_tokens']}/"
                  f"{row['prompt_tokens']}, host held {(row['tiers'].get('host') or {}).get('bytes')}, disk hits "
                  f"{disk.get('hits')}, errors {row['errors']} (load {row['loadavg'][0]})", flush=True)
    return rows


def workload_ratios(rows: list[dict], configs: tuple[str, str] = ("host", "disk"),
                    metrics: tuple[str, ...] = ("output_tok_s", "ttft_p50", "ttft_p95")) -> dict:
    """disk / host (the second config over the first) per workload and metric, pairing each disk turn
    with the host turn nearest it in ABBA order (turn 0 with 1, 3 with 2, ...)."""
    base, other = configs
    out = {}
    for name in dict.fromkeys(r["workload"] for r in rows):
        mine = {r["turn"]: r for r in rows if r["workload"] == name}
        pairs = []
        for turn, r in mine.items():
            if r["config"] != other:
                continue
            partner = next((mine[t] for t in (turn - 1, turn + 1) if t in mine and mine[t]["config"] == base), None)
            if partner is not None:
                pairs.append((r, partner))
        out[name] = {}
        for metric in metrics:
            found = [d[metric] / h[metric] for d, h in pairs if h.get(metric) and d.get(metric) is not None]
            out[name][metric] = ({"median": statistics.median(found), "min": min(found), "max": max(found),
                                  "pairs": len(found)} if found else None)
    return out


# -- report -----------------------------------------------------------------------------------------------

def spread(values: list) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def restart_summary(rows: list[dict]) -> list[dict]:
    """Per size and server: cold and restart TTFT over runs, restart / cold per run."""
    out = []
    for size in sorted({r["tokens"] for r in rows}):
        for server in dict.fromkeys(r["server"] for r in rows):
            mine = [r for r in rows if r["tokens"] == size and r["server"] == server]
            if not mine:
                continue
            cold = [r["cold"]["ttft_s"] for r in mine]
            first = [r["restart"]["ttft_s"] for r in mine]
            turns = [t for r in mine for t in turns_of(r)]
            out.append({"tokens": size, "server": server, "runs": len(mine), "turns": len(turns), "cold_s": cold,
                        "restart_s": [t["ttft"]["ttft_s"] for t in turns],
                        "restart_request_s": [t["ttft"]["request_s"] for t in turns if "request_s" in t["ttft"]],
                        "ratio": [b / a for a, b in zip(cold, first)],
                        "speedup": [a / b for a, b in zip(cold, first)],
                        "cached": [f"{r['restart']['cached_tokens']}/{r['restart']['prompt_tokens']}" for r in mine],
                        "save_s": [r["save_s"] for r in mine if "save_s" in r],
                        "restore_s": [t["restore_s"] for t in turns if "restore_s" in t],
                        "restart_start_s": [r["restart_start_s"] for r in mine]})
    return out


def turns_of(row: dict) -> list[dict]:
    """A chain's restarts (a file from before `--restarts` holds its one restart in `restart`)."""
    return row.get("turns") or [{"ttft": row["restart"], **({"restore_s": row["restore_s"]} if "restore_s" in row else {})}]


def paired(rows: list[dict], size: int, server: str) -> list[float]:
    """`server`'s restart TTFT over llama-server's restore + TTFT, turn by turn within each run."""
    out = []
    for run in sorted({r["run"] for r in rows if r["tokens"] == size}):
        ours = next((r for r in rows if (r["tokens"], r["run"], r["server"]) == (size, run, server)), None)
        theirs = next((r for r in rows if (r["tokens"], r["run"], r["server"]) == (size, run, "llama-server-slot-save")),
                      None)
        if ours and theirs:
            out += [a["ttft"]["ttft_s"] / (b["restore_s"] + b["ttft"]["ttft_s"])
                    for a, b in zip(turns_of(ours), turns_of(theirs))]
    return out


def targets(summary: list[dict], rows: list[dict] | None = None) -> list[dict]:
    by = {(s["tokens"], s["server"]): s for s in summary}
    out = []
    for stop in ("sigterm", "sigkill"):
        mine = by.get((TARGET_SIZE, f"kvserve-{stop}"))
        speedup = statistics.median(mine["speedup"]) if mine else None
        out.append({"target": f"{TARGET_SIZE} tokens, kvserve after {stop.upper()}: restart TTFT >= "
                              f"{TARGET_SPEEDUP:g}x faster than cold", "value": speedup,
                    "shown": "not measured" if speedup is None else f"{speedup:.1f}x ({min(mine['speedup']):.1f}-"
                                                                    f"{max(mine['speedup']):.1f})",
                    "met": None if speedup is None else speedup >= TARGET_SPEEDUP})
    llama = {s["tokens"]: s for s in summary if s["server"] == "llama-server-slot-save"}
    for size in sorted({s["tokens"] for s in summary}):
        mine = by.get((size, "kvserve-sigterm"))
        theirs = llama.get(size)
        if mine is None:
            continue
        if theirs is None:
            out.append({"target": f"{size} tokens: kvserve restart TTFT <= llama-server's restore + TTFT",
                        "value": None, "shown": "not measured (llama-server not built)", "met": None})
            continue
        # llama-server's user pays the restore and the request; kvserve's only the request
        ours = statistics.median(mine["restart_s"])
        manual = statistics.median([a + b for a, b in zip(theirs["restore_s"], theirs["restart_s"])])
        bare = statistics.median(theirs["restart_s"])
        pairs = {stop: paired(rows or [], size, f"kvserve-{stop}") for stop in ("sigterm", "sigkill")}
        each = "".join(f"; turn by turn after {stop.upper()} {spread(found)}x ({len(found)} turns)"
                       for stop, found in pairs.items() if found)
        out.append({"target": f"{size} tokens: kvserve restart TTFT <= llama-server's restore + TTFT",
                    "value": ours / manual, "shown": f"{ours:.3f} s vs {manual:.3f} s ({ours / manual:.2f}x; "
                                                      f"llama-server's TTFT alone {bare:.3f} s{each})",
                    "met": ours <= manual})
    return out


def markdown(result: dict) -> str:
    s = result["settings"]
    loads = "; ".join(f"{part} {x['loadavg_before']} before, {x['loadavg_after']} after ({x['seconds']} s)"
                      for part, x in result.get("part_loads", {}).items() if x)
    lines = [f"{report.describe_machine(result['machine'])}.", "",
             f"Load average (1, 5, 15 min) per part: {loads} (the box has {result['machine']['cores']} cores; above "
             "that, other work shared it and the times are longer and noisier than on an idle box).", ""]
    if result.get("restart") is not None:
        summary = result["restart_summary"]
        lines += ["## 1. TTFT after a restart", "",
                  f"Model: {s['model_note']}. `--parallel 1`, `--ctx-size {CTX}`, {s['threads']} threads; prompts of "
                  "kvserve's own source files cut to size, then a question, the same token ids to every server; "
                  "streamed, 2 tokens: TTFT is the first token's arrival (the whole request's time beside it), "
                  "after a 2-token warm-up request on each "
                  f"server. Runs per size: {s['plan']}. kvserve-sigterm: cold on a fresh server and folder, SIGTERM, "
                  f"a new server on the folder; kvserve-sigkill: SIGKILL {KILL_WAIT:g} s after the cold answer; "
                  "llama-server-slot-save: `--slot-save-path`, POST /slots/0?action=save, SIGTERM, a new server, "
                  "action=restore, then the prompt (`cache_prompt`, `id_slot` 0). Restarts per chain: "
                  f"{s.get('restarts', 1)} (the later ones in turns across the chains, from what each chain left). "
                  "Cells: median (lowest-highest), cold over the runs, restart over every restart.", "",
                  f"llama-server: {result['llama_server_note']}.", ""]
        table = [[x["tokens"], x["server"], x["runs"], x.get("turns", x["runs"]), spread(x["cold_s"]), spread(x["restart_s"]),
                  spread(x.get("restart_request_s") or []),
                  spread(x["ratio"]), spread(x["speedup"]), ", ".join(x["cached"]),
                  spread(x["save_s"]) if x["save_s"] else "-", spread(x["restore_s"]) if x["restore_s"] else "-",
                  spread(x["restart_start_s"])] for x in summary]
        lines += [markdown_table(["tokens", "server", "runs", "restarts", "cold TTFT s", "restart TTFT s",
                                  "restart request s", "restart / cold",
                                  "speedup", "cached after restart", "save s", "restore s",
                                  "restarted server ready s"], table), ""]
        lines += [markdown_table(["target", "measured", "met"],
                                 [[t["target"], t["shown"], "-" if t["met"] is None else ("yes" if t["met"] else "**no**")]
                                  for t in result["targets"]]), ""]
        kills = [r for r in result["restart"] if r["server"] == "kvserve-sigkill"]
        if kills:
            lines += ["After SIGKILL: page files on disk / pages the cold request wrote by the kill: " + ", ".join(
                f"{r['tokens']}: {r['files_after_stop']}/{((r['before_stop'].get('disk') or {}).get('pages'))}"
                for r in kills) + ".", ""]
        for f in result.get("failed", []):
            lines += [f"Failed: {f['size']} tokens, run {f['run']}, {f['chain']}, restart {f.get('turn', 0)}: "
                      f"{f['error'][:300]}", ""]
    if result.get("bandwidth") is not None:
        b = result["bandwidth"]
        dd, store = b["dd"], b["store"]
        read_note = ("after `echo 3 > /proc/sys/vm/drop_caches`: from the disk" if dd["dropped_caches"]
                     else "drop_caches was not permitted: the read came from the page cache")
        rows = [["write", f"{dd['write']['mb_s']:.0f} (`dd bs=1M count={DD_MIB} conv=fsync`)",
                 "n/a" if not store["write"] else f"{store['write']['mb_s_overall']:.0f} (each run: "
                 f"{', '.join(str(x) for x in store['write']['mb_s_each'])}; {store['write']['pages']} pages)"],
                ["read", f"{dd['read']['mb_s']:.0f} ({read_note}); from the page cache {dd['read_page_cache']['mb_s']:.0f}",
                 "n/a" if not store["read"] else f"{store['read']['mb_s_overall']:.0f} (each run: "
                 f"{', '.join(str(x) for x in store['read']['mb_s_each'])}; {store['read']['pages']} pages, "
                 "just written: from the page cache)"]]
        lines += ["## 2. Disk bandwidth", "",
                  f"File system: {' '.join(dd['file_system'])}. The disk tier's write rate is "
                  "`kvserve_prefix_disk_written_bytes_total` over `..._write_seconds_total` (each page a file: "
                  f"written, fsynced, renamed), read on the SIGKILL chains' servers {KILL_WAIT:g} s after the cold "
                  "answer; its read rate is pages read back (`..._hits_total` x bytes per page) over "
                  "`..._read_seconds_total` on the restarted servers. MB/s are 10^6 bytes per second.", "",
                  markdown_table(["", "dd MB/s", "disk tier MB/s"], rows), ""]
    if result.get("workloads") is not None:
        wrows = result["workloads"]
        lines += ["## 3. Workloads with the disk tier under a small host budget", "",
                  f"SmolLM2-135M (the workloads' model), {compare.SLOTS} slots x {compare.CTX_PER_REQUEST} context, "
                  f"{s['workload_max_tokens']} output tokens per request. `host`: no disk tier, the default host "
                  "budget (ample); `disk`: `--prefix-disk-dir` and `--prefix-state-mb` a quarter of the bytes the "
                  f"first `host` run held in /v1/cache. Order: {' '.join(workload_turns(s['workload_runs']))}, a fresh "
                  "server each.", ""]
        table = [[r["workload"], r["turn"], r["config"], "-" if r["prefix_state_mb"] is None else f"{r['prefix_state_mb']:.2f}",
                  r["output_tok_s"], r["ttft_p50"], r["ttft_p95"], report.cached(r),
                  (r["tiers"].get("host") or {}).get("bytes"), (r["tiers"].get("disk") or {}).get("hits", "-"),
                  (r["tiers"].get("disk") or {}).get("writes", "-"), r["errors"]] for r in wrows]
        lines += [markdown_table(["workload", "turn", "config", "host MiB", "output tok/s", "TTFT p50 s", "TTFT p95 s",
                                  "cached prompt tokens", "host bytes held", "disk pages read", "disk pages written",
                                  "errors"], table), ""]
        ratio_rows = []
        for name, metrics in result["workload_ratios"].items():
            for metric, found in metrics.items():
                ratio_rows.append([name, f"disk / host: {metric}", "n/a" if found is None else
                                   f"{found['median']:.2f}x ({found['min']:.2f}-{found['max']:.2f}, {found['pairs']} pairs)"])
        lines += [markdown_table(["workload", "ratio", "median (lowest-highest)"], ratio_rows), ""]
    for note in result.get("not_run", []):
        lines += [f"Not run: {note}", ""]
    for note in result.get("notes", []):  # what a reader of the numbers should know, added after the run
        lines += [note, ""]
    return "\n".join(lines).rstrip()


def parse_sizes(text: str, runs: int) -> list[tuple[int, int]]:
    """'2048,8192,16384:1' -> [(2048, runs), (8192, runs), (16384, 1)]."""
    plan = []
    for item in text.split(","):
        size, _, n = item.strip().partition(":")
        plan.append((int(size), int(n) if n else runs))
    return plan


def main(quick: bool = False, sizes: str | None = None, runs: int | None = None, parts: str | None = None,
         restarts: int = 1) -> str:
    runs = runs or (1 if quick else RUNS)
    plan = parse_sizes(sizes, runs) if sizes else [(n, runs) for n in (QUICK_SIZES if quick else SIZES)]
    chosen = [p.strip() for p in (parts or ",".join(PARTS)).split(",")]
    if unknown := set(chosen) - set(PARTS):
        raise SystemExit(f"unknown parts: {', '.join(sorted(unknown))} (choose from {', '.join(PARTS)})")
    if "bandwidth" in chosen and "restart" not in chosen:
        raise SystemExit("the bandwidth part reads the restart part's counters: run both")
    if max(n for n, _ in plan) + 1 > CTX:
        raise SystemExit(f"a prompt of {max(n for n, _ in plan)} tokens does not fit --ctx-size {CTX}")
    model, model_note = pick_model()
    print(f"model: {model_note}", flush=True)
    result: dict = {"machine": report.machine(), "loadavg_before": loadavg(), "not_run": []}
    result["settings"] = {"model": model.name, "model_note": model_note, "ctx_size": CTX, "threads": os.cpu_count(),
                          "plan": ", ".join(f"{n} tokens x {r}" for n, r in plan), "restarts": restarts,
                          "kill_wait_s": KILL_WAIT,
                          "quick": quick, "parts": chosen, "workload_runs": runs,
                          "workload_max_tokens": 16 if quick else compare.MAX_TOKENS}
    began = time.monotonic()
    RESULTS.mkdir(exist_ok=True)
    result["part_loads"] = {}

    def timed(part: str, run: Callable[[], None]) -> None:
        t, before = time.monotonic(), loadavg()
        run()
        result["part_loads"][part] = {"loadavg_before": before, "loadavg_after": loadavg(),
                                      "seconds": round(time.monotonic() - t)}

    with tempfile.TemporaryDirectory(prefix="kvserve-bench-restart-") as tmp_name:
        tmp = Path(tmp_name)
        if "restart" in chosen:
            def part1() -> None:
                rows, result["llama_server_note"], result["failed"] = restart_part(model, plan, tmp, restarts)
                result["restart"] = rows
                result["restart_summary"] = restart_summary(rows)
                result["targets"] = targets(result["restart_summary"], rows)
            timed("restart", part1)
        if "bandwidth" in chosen:
            timed("bandwidth", lambda: result.update(
                bandwidth={"dd": dd_bandwidth(tmp / "dd"), "store": store_bandwidth(result["restart"])}))
        if "workloads" in chosen:
            def part3() -> None:
                result["workloads"] = workloads_part(quick, runs, tmp)
                result["workload_ratios"] = workload_ratios(result["workloads"])
            timed("workloads", part3)
    result["seconds"] = round(time.monotonic() - began)
    result["loadavg_after"] = loadavg()
    name = "restart-partial" if quick else "restart"
    keys = {"restart": ("restart", "restart_summary", "targets", "llama_server_note", "failed"),
            "bandwidth": ("bandwidth",), "workloads": ("workloads", "workload_ratios")}
    # --parts: a part not run now keeps what this file has from an earlier run, else (a full run's file)
    # what the --quick run's file has, said so
    for source in dict.fromkeys([f"{name}.json", "restart-partial.json"]):
        if set(chosen) == set(PARTS) or not (RESULTS / source).is_file():
            continue
        kept = json.loads((RESULTS / source).read_text())
        for part in PARTS:
            if part not in result["part_loads"] and keys[part][0] in kept:
                if source != f"{name}.json":
                    result["not_run"].append(f"part {part} at its full size: the numbers shown are the --quick run's "
                                             f"({source})")
                result.update({k: kept[k] for k in keys[part] if k in kept})
                result["part_loads"][part] = kept.get("part_loads", {}).get(part, {})
                if part == "restart":
                    result["settings"]["plan"] = kept["settings"]["plan"]
                    result["settings"]["model_note"] = kept["settings"]["model_note"]
                if part == "workloads":
                    result["settings"]["workload_runs"] = kept["settings"]["workload_runs"]
                    result["settings"]["workload_max_tokens"] = kept["settings"]["workload_max_tokens"]
    for part in PARTS:
        if part not in result["part_loads"]:
            result["not_run"].append(f"part {part} (left out with --parts)")
    name = "restart-partial" if quick else "restart"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    return text
