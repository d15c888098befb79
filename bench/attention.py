"""python -m bench attention: what attention costs kvserve's KV layout, in raw llama_decode calls.

With SEQUENCES prompts of PROMPT_TOKENS tokens resident (the unique workload's round), each shape
is timed in a unified KV cache (kvserve: one stream, sequences masked) and with a stream per
sequence (llama-server's default), both with flash attention on, best of REPEATS:
- a decode step of one token per sequence, and a PROMPT_CHUNK-token prompt chunk of a new sequence;
- that decode step and chunk in one call, against two calls (what kvserve's batch plan does).
llama.cpp's CPU flash-attention kernel reads the mask of every cell in the used extent of the
stream, for each query row, head and layer, even where it then skips the cell; the tiled path
(64+ tokens in a ubatch) computes a tile in full where any of its rows sees a cell.

python -m bench attention  -> bench/results/attention.{json,md}
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from bench.report import describe_machine, machine
from bench.stats import markdown_table
from kvserve.config import embedded_model_path
from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model

RESULTS = Path(__file__).parent / "results"
SEQUENCES = 8
PROMPT_TOKENS = 573
PROMPT_CHUNK = 504
REPEATS = 5


class Resident:
    """SEQUENCES sequences of PROMPT_TOKENS tokens in one context; times calls that leave it as it was."""

    def __init__(self, model: Model, unified: bool, threads: int) -> None:
        n_seq = SEQUENCES + 1  # the last one takes the prompt chunk
        self.ctx = Context(model, ContextParams(n_ctx_seq=4096 * (n_seq if unified else 1), n_batch=2048,
                                                n_seq_max=n_seq, n_threads=threads, flash_attn="on", unified=unified))
        self.batch = Batch(2048)
        self.model = model
        for seq in range(SEQUENCES):
            self.batch.clear()
            self._prompt(seq, PROMPT_TOKENS)
            self.ctx.decode(self.batch)

    def _tokens(self, seq: int, n: int) -> list[int]:
        text = f"Story {seq}: a tale of the number {seq * 31} and its friends. " * 60
        tokens = self.model.tokenize(text, add_special=True)[:n]
        if len(tokens) < n:
            raise ValueError(f"the story is {len(tokens)} tokens long, short of {n}")
        return tokens

    def _prompt(self, seq: int, n: int) -> None:
        """The batch holds `n` prompt tokens of `seq` (appended to what it holds)."""
        for pos, token in enumerate(self._tokens(seq, n)):
            self.batch.add(token, pos, seq, False)

    def _decodes(self) -> None:
        for seq in range(SEQUENCES):
            self.batch.add(100 + seq, PROMPT_TOKENS, seq, True)

    def _undo(self) -> None:
        for seq in range(SEQUENCES):
            self.ctx.seq_rm(seq, PROMPT_TOKENS)
        self.ctx.seq_rm(SEQUENCES)

    def time(self, calls: list[Callable[[], None]]) -> float:
        """Best seconds over REPEATS of the calls, each filling the batch and decoding it."""
        best = float("inf")
        for _ in range(REPEATS):
            started = time.perf_counter()
            for fill in calls:
                self.batch.clear()
                fill()
                self.ctx.decode(self.batch)
            best = min(best, time.perf_counter() - started)
            self._undo()
        return best

    def shapes(self) -> dict[str, float]:
        def chunk() -> None:
            self._prompt(SEQUENCES, PROMPT_CHUNK)

        def both() -> None:
            self._decodes()
            chunk()

        return {"decode step": self.time([self._decodes]), "prompt chunk": self.time([chunk]),
                "decode step and chunk, one call": self.time([both]),
                "decode step and chunk, two calls": self.time([self._decodes, chunk])}

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


def main(model_path: Path | None = None, threads: int = 2, out: Path = RESULTS) -> str:
    model = Model(model_path or embedded_model_path())
    seconds = {}
    for layout, unified in (("unified", True), ("a stream per sequence", False)):
        resident = Resident(model, unified, threads)
        seconds[layout] = resident.shapes()
        resident.close()
    model.close()
    result = {"machine": machine(), "settings": {"sequences": SEQUENCES, "prompt_tokens": PROMPT_TOKENS,
                                                 "prompt_chunk": PROMPT_CHUNK, "threads": threads}, "seconds": seconds}
    out.mkdir(exist_ok=True)
    (out / "attention.json").write_text(json.dumps(result, indent=2) + "\n")
    unified, streams = seconds["unified"], seconds["a stream per sequence"]
    table = markdown_table(["call", "unified ms", "stream per sequence ms", "unified / streams"],
                           [[shape, unified[shape] * 1000, streams[shape] * 1000, unified[shape] / streams[shape]]
                            for shape in unified])
    markdown = (f"{describe_machine(result['machine'])}; {SEQUENCES} sequences of {PROMPT_TOKENS} tokens resident, "
                f"a {PROMPT_CHUNK}-token chunk, {model_path.name if model_path else 'SmolLM2-135M'}, flash attention "
                f"on, {threads} threads, best of {REPEATS}.\n\n{table}")
    (out / "attention.md").write_text(markdown + "\n")
    return markdown
