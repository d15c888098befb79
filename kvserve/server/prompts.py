"""From an OpenAI body to a scheduler `Request`: prompt tokens, limits, sampling and grammar."""

from __future__ import annotations

import asyncio
import json
import uuid

from llama_cpp.llama_grammar import json_schema_to_gbnf
from pydantic import ValidationError

from kvserve.cache.chat_marks import Mark, mark_messages
from kvserve.llama.chat_template import ChatTemplate, ChatTemplateError
from kvserve.llama.model import Model
from kvserve.llama.sampler import GrammarError, Sampler, SamplingParams
from kvserve.scheduler.request import Request
from kvserve.scheduler.config import SchedulerConfig
from kvserve.server.errors import invalid, invalid_body
from kvserve.server.schemas import ChatCompletionRequest, CompletionRequest, ResponseFormat, _Sampling


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    # Templates know system/user/assistant; OpenAI's newer "developer" role is a system message.
    return [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
    ]


def chat_prompt(model: Model, template: ChatTemplate, body: ChatCompletionRequest) -> tuple[list[int], list[Mark]]:
    """The prompt tokens and, for a model that carries state, the marks worth a checkpoint."""
    try:
        if model.info.carries_state:
            turn = mark_messages(model, template, chat_messages(body))
            return turn.tokens, turn.checkpoint_marks()
        return text_tokens(model, template.render(chat_messages(body)), template.bos_token), []
    except ChatTemplateError as exc:
        raise invalid(str(exc), "messages") from exc


def text_tokens(model: Model, text: str, bos_text: str = "") -> list[int]:
    """Tokens of a rendered prompt; BOS is added only where the model wants it and the text lacks it."""
    add_bos = model.adds_bos and not (bos_text and text.startswith(bos_text))
    return model.tokenize(text, add_special=add_bos, parse_special=True)


def completion_prompt(model: Model, body: CompletionRequest) -> list[int]:
    if isinstance(body.prompt, str):
        if not body.prompt:
            raise invalid("prompt must not be empty", "prompt")
        return text_tokens(model, body.prompt)
    check_token_ids(model, body.prompt, "prompt")
    return list(body.prompt)


def check_token_ids(model: Model, tokens: list[int], param: str) -> None:
    if any(not 0 <= t < model.info.n_vocab for t in tokens):
        raise invalid(f"{param}: token ids must be in [0, {model.info.n_vocab})", param)


async def prompt_tokens(
    model: Model, template: ChatTemplate, body: ChatCompletionRequest | CompletionRequest
) -> list[int]:
    """The tokens a chat or completion body is served with, for the endpoints that only look at
    prompts (prefix match, tokenize, render): the same functions as the real request path."""
    if isinstance(body, ChatCompletionRequest):
        tokens, _ = await asyncio.to_thread(chat_prompt, model, template, body)
        return tokens
    return await asyncio.to_thread(completion_prompt, model, body)


async def body_prompt(model: Model, template: ChatTemplate, body: dict) -> list[int]:
    """`prompt_tokens` of a raw body: a chat when it has `messages`, else a completion."""
    try:
        parsed = (ChatCompletionRequest if "messages" in body else CompletionRequest).model_validate(body)
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from exc
    return await prompt_tokens(model, template, parsed)


def grammar_for(response_format: ResponseFormat | None) -> str | None:
    if response_format is None or response_format.type == "text":
        return None
    schema = {"type": "object"}
    if response_format.type == "json_schema":
        schema = response_format.json_schema.schema_ or {}
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # the converter raises plain exceptions on schemas it cannot express
        raise invalid(f"unsupported json_schema: {exc}", "response_format") from exc


def sampling_params(model: Model, body: _Sampling, grammar: str | None) -> SamplingParams:
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        token = int(key)
        if not 0 <= token < model.info.n_vocab:
            raise invalid(f"logit_bias token {token} is not in the vocabulary", "logit_bias")
        bias[token] = value
    params = SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repeat_penalty=body.repeat_penalty,
        logit_bias=bias,
        grammar=grammar,
    )
    if grammar is not None:
        _check_grammar(model, params)
    return params


def _check_grammar(model: Model, params: SamplingParams) -> None:
    """Build the chain once here, so a grammar llama.cpp rejects is a 400, not an engine fault."""
    try:
        Sampler(model, params).close()
    except GrammarError as exc:
        raise invalid(str(exc), "response_format") from exc


def build_request(
    prompt: list[int], body: _Sampling, params: SamplingParams, logprobs: int | None, limits: SchedulerConfig,
    prefix: str,
) -> Request:
    if body.n > limits.max_running:  # its choices decode side by side: they could never all be admitted
        raise invalid(f"n is {body.n}, but this server runs at most {limits.max_running} sequences at once", "n")
    max_seq_len = limits.max_seq_len
    if not prompt:
        raise invalid("the prompt is empty", "messages" if prefix == "chatcmpl" else "prompt")
    room = max_seq_len - len(prompt)
    if room < 1:
        raise invalid(
            f"the prompt has {len(prompt)} tokens, but this server's limit is {max_seq_len - 1} prompt tokens "
            f"({max_seq_len} per sequence)",
            "messages" if prefix == "chatcmpl" else "prompt",
        )
    return Request(
        id=f"{prefix}-{uuid.uuid4().hex}",
        prompt=prompt,
        params=params,
        max_tokens=min(body.token_limit or room, room),
        n=body.n,
        stop_strings=body.stop,
        logprobs=logprobs,
        ignore_eos=body.ignore_eos,
    )
