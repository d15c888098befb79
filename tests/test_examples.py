"""The examples run as a user would run them, and say what they claim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import serve

ROOT = Path(__file__).resolve().parent.parent


def test_prefix_cache_by_hand_attaches_the_system_prompt(tiny) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "prefix_cache_by_hand.py"), str(tiny("lfm2"))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    holds = re.search(r"the cache holds (\d+) of B's (\d+) leading tokens", out)
    attached = re.search(r"B attached (\d+) tokens, prefilled only (\d+)", out)
    assert holds and attached, out
    cached, prompt_b = map(int, holds.groups())
    n_attached, n_tail = map(int, attached.groups())
    assert n_attached == cached >= 48  # the ~60-token system prompt, in whole 16-row pages
    assert n_tail == prompt_b - n_attached and n_tail < 24
    assert "chain {'id': 1" in out and "released: sessions, cache, pool, model" in out
    opening = int(re.search(r"opening=(\d+)", out).group(1))
    stopped = re.search(r"A stopped its prefill at (\d+) and saved a (\d+)-byte state", out)
    restored = re.search(r"B restored the checkpoint at (\d+)", out)
    assert stopped and restored, out
    assert int(stopped.group(1)) == int(restored.group(1)) == opening > 0 and int(stopped.group(2)) > 0


def test_tool_agent_calls_a_tool_and_answers(smollm2: Path) -> None:
    with serve(smollm2, threads=1) as url:
        done = subprocess.run([sys.executable, str(ROOT / "examples" / "tool_agent.py"), "--url", url],
                              capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    calls = re.findall(r"^called (get_weather|to_fahrenheit)\((\{.*\})\) -> (.+)$", done.stdout, re.MULTILINE)
    assert calls and calls[0][0] == "get_weather", done.stdout  # the first turn required a call
    answer = re.search(r"^answer: (.+)", done.stdout, re.MULTILINE)
    assert answer and answer.group(1).strip(), done.stdout
