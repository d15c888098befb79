"""A reply read once, for every API: reasoning split off, then tool calls parsed, as neutral events."""

from kvserve.reply.detect import detect_reasoning, resolve_format, syntax_for
from kvserve.reply.reader import Ended, ReasoningDelta, ReplyEvent, ReplyPlan, ReplyReader, merged
from kvserve.reply.reasoning import ReasoningFormat, ReasoningSplitter, ReasoningSyntax

__all__ = [
    "Ended", "ReasoningDelta", "ReasoningFormat", "ReasoningSplitter", "ReasoningSyntax", "ReplyEvent", "ReplyPlan",
    "ReplyReader", "detect_reasoning", "merged", "resolve_format", "syntax_for",
]
