"""Chat templates from GGUF metadata, rendered in jinja2's sandbox."""

from __future__ import annotations

import copy
import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvserve.llama.model import Model

# Used when a GGUF carries no template: ChatML, the most common convention.
_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# A template renders the request's own messages; output far beyond them, or a render this slow, is
# a template looping on crafted input, and stops there instead of holding a worker thread.
RENDER_MAX_CHARS = 64 * 1024 * 1024
RENDER_MAX_SECONDS = 5.0


class ChatTemplateError(ValueError):
    """The template refused the conversation (e.g. its own raise_exception)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    """Renders OpenAI-style messages to the prompt text the model was trained on."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self.source = source
        self._template = env.from_string(source)
        self._tools: list[dict[str, Any]] | None = None
        self._kwargs: dict[str, Any] = {}
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_model(cls, model: Model, source_file: Path | None = None) -> "ChatTemplate":
        """The model's template, or the one in `source_file` instead."""
        source = source_file.read_text() if source_file is not None else model.chat_template()
        return cls(
            source or _CHATML,
            bos_token=model.token_text(model.bos) if model.bos >= 0 else "",
            eos_token=model.token_text(model.eos) if model.eos >= 0 else "",
        )

    def with_tools(self, tools: list[dict[str, Any]]) -> "ChatTemplate":
        """This template with `tools` (OpenAI's function tool objects) in its context, as templates
        that describe tools themselves expect them."""
        bound = copy.copy(self)
        bound._tools = tools
        return bound

    def with_kwargs(self, kwargs: dict[str, Any]) -> "ChatTemplate":
        """This template with `kwargs` as more variables of its context (`enable_thinking`,
        `reasoning_effort`, ...); the messages, tools and generation flag are not overridden."""
        bound = copy.copy(self)
        bound._kwargs = {**self._kwargs, **kwargs}
        return bound

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text; rendering stops with ChatTemplateError past RENDER_MAX_CHARS or
        RENDER_MAX_SECONDS (checked between the pieces jinja2 emits)."""
        deadline = time.monotonic() + RENDER_MAX_SECONDS
        pieces: list[str] = []
        size = 0
        try:
            context = {**self._kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt,
                       "bos_token": self.bos_token, "eos_token": self.eos_token,
                       **({"tools": self._tools} if self._tools else {})}
            for piece in self._template.generate(**context):
                pieces.append(piece)
                size += len(piece)
                if size > RENDER_MAX_CHARS or time.monotonic() > deadline:
                    raise ChatTemplateError("the chat template's output exceeds its size or time bound")
            return "".join(pieces)
        except ChatTemplateError:
            raise
        except TemplateError as exc:  # includes SecurityError from the sandbox
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            # the request's own variables or messages broke the template (a variable that shadows
            # one of its functions): the request's fault, not the server's
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
