"""The reference for kvserve's decode throughput: raw batched llama_decode, one token per sequence
per call, through the same build and context settings, with no server around it.

python -m bench.raw_decode --sequences 8 --steps 48  -> prints one JSON line
python -m bench.raw_decode --burst 16 --prompt-len 172 --steps 32 --rounds 2
  -> the floor under a sweep point: that many prompts at once, prefilled whole in batches of 2,048
     tokens (ubatches of 512) in sequence order, then decoded together, round after round
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


def burst(model: Model, users: int, prompt_len: int, steps: int, rounds: int, threads: int,
          n_seq_max: int = 32, n_ctx_seq: int = 512) -> dict:
    """Seconds and output tokens per second of `rounds` rounds of `users` prompts of `prompt_len`
    tokens arriving at once and decoding `steps` tokens each: every prompt prefilled first, in
    batches of up to 2,048 tokens, then one decode token per sequence per call."""
    ctx = Context(model, ContextParams(n_ctx_seq=n_ctx_seq, n_batch=2048, n_seq_max=n_seq_max, n_threads=threads))
    batch = Batch(2048)
    text = "a tale of the number 31 and its friends. " * (prompt_len // 4)
    started = time.perf_counter()
    for round_ in range(rounds):
        prompts = [model.tokenize(f"story {u}-{round_}: " + text, add_special=True)[:prompt_len] for u in range(users)]
        for seq in range(users):
            ctx.seq_rm(seq)
        pending = [(seq, pos) for seq in range(users) for pos in range(prompt_len)]
        for at in range(0, len(pending), 2048):
            batch.clear()
            for seq, pos in pending[at : at + 2048]:
                batch.add(prompts[seq][pos], pos, seq, pos == prompt_len - 1)
            ctx.decode(batch)
        for step in range(steps):
            batch.clear()
            for seq in range(users):
                batch.add(100 + seq, prompt_len + step, seq, True)
            ctx.decode(batch)
    elapsed = time.perf_counter() - started
    batch.close()
    ctx.close()
    return {"seconds": round(elapsed, 2), "output_tok_s": round(users * steps * rounds / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--burst", type=int, default=0, help="users at once (a sweep point); 0: decode only")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model = Model(embedded_model_path())
    if args.burst:
        print(json.dumps(burst(model, args.burst, args.prompt_len, args.steps, args.rounds, args.threads)))
        model.close()
        return
    result = {n: measure(model, n, args.steps, args.prompt_len, args.threads) for n in args.sequences}
    model.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
