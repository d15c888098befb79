"""The reference for kvserve's decode throughput: raw batched llama_decode, one token per sequence
per call, through the same build and context settings, with no server around it.

python -m bench.raw_decode --sequences 8 --steps 48  -> prints one JSON line
"""

from __future__ import annotations

import argparse
import json
import time

from kvserve.config import embedded_model_path
from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams
from kvserve.llama.model import Model


def measure(model: Model, sequences: int, steps: int, prompt_len: int, threads: int) -> float:
    ctx = Context(model, ContextParams(n_ctx_seq=prompt_len + steps, n_batch=512, n_seq_max=max(sequences, 1),
                                       n_threads=threads))
    batch = Batch(512)
    prompt = model.tokenize("Tell me a long story about a cat and a dog. " * 8, add_special=True)[:prompt_len]
    for seq in range(sequences):
        batch.clear()
        for pos, token in enumerate(prompt):
            batch.add(token, pos, seq, pos == len(prompt) - 1)
        ctx.decode(batch)
    pos = len(prompt)
    started = time.perf_counter()
    for _ in range(steps):
        batch.clear()
        for seq in range(sequences):
            batch.add(100 + seq, pos, seq, True)
        ctx.decode(batch)
        pos += 1
    elapsed = time.perf_counter() - started
    batch.close()
    ctx.close()
    return sequences * steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = Model(embedded_model_path())
    result = {n: measure(model, n, args.steps, args.prompt_len, args.threads) for n in args.sequences}
    model.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
