"""Issue 4's benchmark: multi-turn chats on a hybrid (LFM2-style) model, with and without checkpoints.

8 conversations x 4 turns on one ~1,000-token system prompt; each turn carries the previous answers.
Reports the share of prompt tokens restored instead of prefilled from the second turn on, and TTFT
p50. A turn resumes from the previous turn's end when the client's copy of the answer re-tokenizes
to the tokens generated; the random-weight model's token soup often does not, and then it resumes
from the previous turn's last-message close and prefills the answer again. No
real hybrid GGUF ships in a package, so the model is the tests' tiny random-weight LFM2 with
SmolLM2's tokenizer and chat template: the token accounting is real, the timings are small.

python -m bench multiturn
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import httpx

from bench.client import Result, stream_chat
from bench.prefix import system_prompt
from bench.servers import free_port, kvserve_command, running
from bench.stats import markdown_table, percentile

RESULTS = Path(__file__).parent / "results"
CONVERSATIONS = 8
TURNS = 4
SYSTEM = system_prompt()  # the same ~1,000-token handbook as the shared-prompt workload


def hybrid_model(directory: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import tiny_model

    return tiny_model("lfm2", directory)


async def conversations(url: str) -> list[list[Result]]:
    async with httpx.AsyncClient() as client:
        async def conversation(c: int) -> list[Result]:
            messages = [{"role": "system", "content": SYSTEM}]
            results = []
            for t in range(TURNS):
                messages.append({"role": "user", "content": f"Customer {c}, turn {t}: where is parcel {c * 10 + t}?"})
                result = await stream_chat(client, url, messages, 24)
                results.append(result)
                messages.append({"role": "assistant", "content": result.text})
            return results

        return await asyncio.gather(*(conversation(c) for c in range(CONVERSATIONS)))


def main() -> str:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = hybrid_model(Path(tmp))
        for cache in (True, False):
            port = free_port()
            flags = ["--model", str(model), "--parallel", "8"] + ([] if cache else ["--no-prefix-cache"])
            with running(kvserve_command(port, *flags), port,
                         RESULTS / f"multiturn-{'cache' if cache else 'nocache'}.log") as url:
                per_conversation = asyncio.run(conversations(url))
            later = [r for conv in per_conversation for r in conv[1:]]
            everything = [r for conv in per_conversation for r in conv]
            rows.append({
                "cache": cache,
                "skipped_from_turn_2": sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later),
                "ttft_p50": percentile([r.ttft for r in everything], 0.5),
                "ttft_p50_from_turn_2": percentile([r.ttft for r in later], 0.5),
                "errors": sum(r.error is not None for r in everything),
            })
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "multiturn.json").write_text(json.dumps(rows, indent=2))
    table = markdown_table(
        ["checkpoints", "prompt tokens skipped, turns 2-4", "TTFT p50 s", "TTFT p50 s, turns 2-4", "errors"],
        [["on" if r["cache"] else "off", f"{r['skipped_from_turn_2']:.0%}", r["ttft_p50"], r["ttft_p50_from_turn_2"],
          r["errors"]] for r in rows],
    )
    (RESULTS / "multiturn.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    print(main())
