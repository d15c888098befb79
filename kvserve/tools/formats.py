"""Which tool-call syntax a model was trained on, read from its own chat template (as llama.cpp's
common/chat.cpp and vLLM's tool parsers do)."""

from __future__ import annotations

import enum

# Tags a Hermes-style model may wrap a call in besides <tool_call>, each closed by its own </tag>: the
# ones llama.cpp's Hermes parser accepts (Hermes 2 Pro and Qwen 2.5 fine-tunes write them).
HERMES_TAGS = ("tool_call", "function_call", "tool", "tools", "response", "json", "xml", "JSON")
# A Markdown fence around a tagged call: ```json, ```xml or ```.
FENCE = "```"
FENCE_LANGUAGES = ("", "json", "xml")


class ToolFormat(str, enum.Enum):
    HERMES = "hermes"  # Hermes 2 Pro, Qwen 2.5/3: <tool_call>{"name": ..., "arguments": ...}</tool_call>
    LLAMA3 = "llama3"  # Llama 3.1-3.3: the whole reply is {"name": ..., "parameters": ...}
    MISTRAL = "mistral"  # Mistral v3 and Nemo: [TOOL_CALLS][{"name": ..., "arguments": ...}, ...]
    HARMONY = "harmony"  # gpt-oss: a message to=functions.NAME whose body is the arguments (`kvserve.reply`)
    GENERIC = "generic"  # a template that knows nothing of tools: kvserve describes them itself

    @property
    def opening(self) -> str | None:
        """The text that opens the calls; None where the calls are the reply itself."""
        return {ToolFormat.HERMES: "<tool_call>", ToolFormat.MISTRAL: "[TOOL_CALLS]"}.get(self)

    @property
    def openings(self) -> tuple[str, ...]:
        """Every text that may open calls in the middle of a reply: the marker and, for Hermes, the
        variants its models write (another tag, or a fence around a tag). A bare or fenced
        `{"name": ...}` object is not a call in a format whose calls are tagged: a model writes one
        as text (Qwen2.5-Coder, given a tool's result under `auto`), and a forced choice's grammar
        writes the tag from the first token."""
        if self is ToolFormat.HERMES:
            return (*(f"<{tag}>" for tag in HERMES_TAGS), FENCE)
        return (self.opening,) if self.opening else ()

    @property
    def arguments_key(self) -> str:
        return "parameters" if self is ToolFormat.LLAMA3 else "arguments"


def detect_format(template_source: str) -> ToolFormat:
    # gpt-oss's template writes a call's header in pieces: "<|start|>assistant to=" then "functions." + name
    if "<|channel|>" in template_source and "to=" in template_source and "functions." in template_source:
        return ToolFormat.HARMONY
    if "[TOOL_CALLS]" in template_source:
        return ToolFormat.MISTRAL
    if "<tool_call>" in template_source:
        return ToolFormat.HERMES
    # Llama 3.0's template has the headers too, but no ipython role: it was not trained for tools.
    if "<|start_header_id|>" in template_source and "ipython" in template_source:
        return ToolFormat.LLAMA3
    return ToolFormat.GENERIC
