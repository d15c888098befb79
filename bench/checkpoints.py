"""The checkpoints benchmark: multi-turn chats on a hybrid (LFM2-style) model, with and without checkpoints.

8 conversations x 4 turns on one ~1,000-token system prompt; each turn carries the previous answers.
Reports the share of prompt tokens restored instead of prefilled from the second turn on, and TTFT
p50. A turn resumes from the previous turn's end when the client's copy of the answer re-tokenizes
to the tokens generated; the random-weight model's token soup often does not, and then it resumes
from the previous turn's last-message close and prefills the answer again. No
real hybrid GGUF ships in a package, so the model is the tests' tiny random-weight LFM2 with
SmolLM2's tokenizer and chat template: the token accounting is real, the timings are small.

python -m bench checkpoints
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from bench import workloads
from bench.stats import markdown_table, percentile, summarize
from kvserve.testing import ServerProcess
from kvserve.testing.tiny_models import tiny_model

RESULTS = Path(__file__).parent / "results"
MAX_TOKENS = 24


def main() -> str:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model("lfm2", Path(tmp))
        for cache in (True, False):
            log = RESULTS / f"checkpoints-{'cache' if cache else 'nocache'}.log"
            with ServerProcess.kvserve(log, model=model, parallel=8, prefix_cache=cache) as server:
                server.wait_healthy()
                run = workloads.run_sync(server.url, workloads.multiturn(), MAX_TOKENS)
            later = [r for conv in run.per_user for r in conv[1:]]
            rows.append({
                "cache": cache,
                **summarize(run.results, run.wall),
                "skipped_from_turn_2": sum(r.cached_tokens or 0 for r in later) / sum(r.prompt_tokens for r in later),
                "ttft_p50_from_turn_2": percentile([r.ttft for r in later], 0.5),
            })
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "checkpoints.json").write_text(json.dumps(rows, indent=2))
    table = markdown_table(
        ["checkpoints", "prompt tokens skipped, turns 2-4", "TTFT p50 s", "TTFT p50 s, turns 2-4", "errors"],
        [["on" if r["cache"] else "off", f"{r['skipped_from_turn_2']:.0%}", r["ttft_p50"], r["ttft_p50_from_turn_2"],
          r["errors"]] for r in rows],
    )
    (RESULTS / "checkpoints.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    print(main())
