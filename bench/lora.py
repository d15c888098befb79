"""python -m bench lora: what switching LoRA adapter sets between steps costs, in raw llama.cpp calls.

SEQUENCES sequences of PROMPT_TOKENS tokens are resident in a context of a stream each (kvserve's
layout), flash attention on. One decode step (a token per sequence, removed again after) is timed
STEPS times in each of three ways, interleaved step by step so machine load falls on all:
- base: no adapter set, never changed;
- same set: adapter A set once, every step under it;
- switching: the set changes before every step (A, then B, then A ...), the switch's own call
  (`llama_set_adapters_lora`) included in the step's time; llama.cpp re-plans its graph after it.
The switch cost is the median switching step minus the median same-set step.

python -m bench lora  -> bench/results/lora.{json,md}
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.report import describe_machine, machine
from bench.stats import markdown_table
from kvserve.config import embedded_model_path
from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.lora import BASE, AdapterSet, LoraAdapters
from kvserve.llama.model import Model
from kvserve.testing.lora_adapters import RANK, TARGETS, lora_adapter

RESULTS = Path(__file__).parent / "results"
SEQUENCES = 4
PROMPT_TOKENS = 256
STEPS = 24


class Resident:
    """SEQUENCES resident prompts; times one decode step that leaves them as they were."""

    def __init__(self, model: Model, threads: int) -> None:
        self.ctx = Context(model, ContextParams(n_ctx_seq=1024, n_batch=1024, n_seq_max=SEQUENCES,
                                                n_threads=threads, flash_attn="on"))
        self.batch = Batch(1024)
        for seq in range(SEQUENCES):
            tokens = model.tokenize(f"Story {seq}: a tale of the number {seq * 31} and its friends. " * 40,
                                    add_special=True)[:PROMPT_TOKENS]
            self.batch.clear()
            for pos, token in enumerate(tokens):
                self.batch.add(token, pos, seq, False)
            self.ctx.decode(self.batch)

    def step(self, before=lambda: None) -> float:
        self.batch.clear()
        for seq in range(SEQUENCES):
            self.batch.add(100 + seq, PROMPT_TOKENS, seq, True)
        started = time.perf_counter()
        before()
        self.ctx.decode(self.batch)
        seconds = time.perf_counter() - started
        for seq in range(SEQUENCES):
            self.ctx.seq_rm(seq, PROMPT_TOKENS)
        return seconds

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


def main(model_path: Path | None = None, threads: int = 2, out: Path = RESULTS) -> str:
    path = model_path or embedded_model_path()
    model = Model(path)
    with tempfile.TemporaryDirectory() as directory:
        lora = LoraAdapters(model, {name: lora_adapter(path, Path(directory), seed)
                                    for name, seed in (("A", 1), ("B", 2))})
    resident = Resident(model, threads)
    a: AdapterSet = (("A", 1.0),)
    b: AdapterSet = (("B", 1.0),)
    seconds: dict[str, list[float]] = {"base": [], "same set": [], "switching": []}
    resident.step()  # a first decode plans the graph
    for i in range(STEPS):
        lora.apply(resident.ctx, BASE)
        resident.step()  # back to the base graph, untimed
        seconds["base"].append(resident.step())
        lora.apply(resident.ctx, a)
        resident.step()  # the switch to A, untimed
        seconds["same set"].append(resident.step())
        seconds["switching"].append(resident.step(lambda: lora.apply(resident.ctx, b)))
    resident.close()
    lora.close()
    model.close()
    ms = {name: statistics.median(values) * 1000 for name, values in seconds.items()}
    result = {"machine": machine(),
              "settings": {"sequences": SEQUENCES, "prompt_tokens": PROMPT_TOKENS, "steps": STEPS, "threads": threads,
                           "rank": RANK, "targets": list(TARGETS)},
              "median_ms": ms, "switch_cost_ms": ms["switching"] - ms["same set"]}
    out.mkdir(exist_ok=True)
    (out / "lora.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown_table(["decode step", "median ms"], [[name, value] for name, value in ms.items()])
    markdown = (f"{describe_machine(result['machine'])}; {path.name}, flash attention on, {threads} threads; "
                f"{SEQUENCES} sequences of {PROMPT_TOKENS} tokens resident, one decode token each; rank-{RANK} "
                f"adapters on {', '.join(TARGETS)}; median of {STEPS} steps each.\n\n{table}\n\n"
                f"A switch of adapter set costs {result['switch_cost_ms']:.1f} ms over a step under an unchanged set.")
    (out / "lora.md").write_text(markdown + "\n")
    return markdown
