"""Which reasoning format a model writes, read from its chat template and vocabulary (as
llama.cpp's common/chat.cpp reads it), and whether a rendered prompt opened the thinking already."""

from __future__ import annotations

from typing import Callable

from kvserve.reply.reasoning import ANALYSIS_OPEN, H_CHANNEL, THINK_CLOSE, THINK_OPEN, ReasoningFormat, ReasoningSyntax

AUTO = "auto"


def detect_reasoning(template_source: str, is_one_token: Callable[[str], bool]) -> ReasoningFormat:
    """harmony where the template writes channels the vocabulary holds as a token; `<think>` blocks
    where the template names them or the vocabulary has both tags as tokens; else none."""
    if H_CHANNEL in template_source and is_one_token(H_CHANNEL):
        return ReasoningFormat.HARMONY
    if THINK_OPEN in template_source or THINK_CLOSE in template_source:
        return ReasoningFormat.DEEPSEEK
    if is_one_token(THINK_OPEN) and is_one_token(THINK_CLOSE):
        return ReasoningFormat.DEEPSEEK
    return ReasoningFormat.NONE


def resolve_format(setting: str, template_source: str, is_one_token: Callable[[str], bool]) -> ReasoningFormat:
    """`--reasoning-format`: `auto` detects, any other value names the format."""
    if setting == AUTO:
        return detect_reasoning(template_source, is_one_token)
    return ReasoningFormat(setting)


def syntax_for(fmt: ReasoningFormat, prompt_tail: str) -> ReasoningSyntax | None:
    """The syntax of a reply to a prompt ending in `prompt_tail`; None where nothing is split.
    A `<think>` block (or harmony analysis body) the prompt opened and did not close is the reply's start."""
    if fmt is ReasoningFormat.NONE:
        return None
    if fmt is ReasoningFormat.HARMONY:
        return ReasoningSyntax(fmt, starts_open=prompt_tail.endswith(ANALYSIS_OPEN))
    tail = prompt_tail.rstrip()
    return ReasoningSyntax(fmt, starts_open=tail.endswith(THINK_OPEN))
