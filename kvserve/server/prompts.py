"""From an OpenAI body to a scheduler `Request`: prompt tokens, limits, sampling and grammar."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, replace

from pydantic import ValidationError

from kvserve.cache.chat_marks import Mark, mark_messages
from kvserve.llama.chat_template import ChatTemplate, ChatTemplateError
from kvserve.llama.model import Model
from kvserve.llama.sampler import GrammarError, Sampler, SamplingParams
from kvserve.reply import ReasoningFormat, ReasoningSyntax, ReplyPlan, syntax_for
from kvserve.scheduler.engine import Engine
from kvserve.scheduler.thinking import ThinkingLimit
from kvserve.scheduler.request import Request
from kvserve.server.errors import context_length_exceeded, invalid, invalid_body
from kvserve.llama.lora import BASE, AdapterSet, adapter_set, describe
from kvserve.server.namespace import request_namespace
from kvserve.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ResponseFormat,
    ToolChoiceField,
    Sampling,
)
from kvserve.tools import ChatTurn, HistoryCall, ToolPlan, plan_tools, template_messages
from kvserve.tools.formats import ToolFormat, detect_format
from kvserve.tools.grammar import Thinking, json_gbnf, thinking_first
from kvserve.tools.schema_budget import check_grammar_text, check_schema
from kvserve.tools.spec import NO_PARAMETERS, FunctionTool, Mode, ToolChoice, ToolError


@dataclass(frozen=True)
class ChatPrompt:
    tokens: list[int]
    marks: list[Mark]  # for a model that keeps prefixes at marks: where a checkpoint may be worth it
    tools: ToolPlan | None  # how the reply calls tools; None: it is plain text
    reasoning: ReasoningSyntax | None = None  # how the reply carries its thinking; None: it does not

    @property
    def reply(self) -> ReplyPlan:
        return ReplyPlan(self.reasoning, self.tools)


def chat_turns(body: ChatCompletionRequest) -> list[ChatTurn]:
    # Templates know system/user/assistant; OpenAI's newer "developer" role is a system message.
    return [
        ChatTurn(
            role="system" if m.role == "developer" else m.role,
            content=m.text(),
            tool_calls=tuple(HistoryCall(c.id, c.function.name, c.function.arguments_text) for c in m.tool_calls or ()),
            tool_call_id=m.tool_call_id,
            reasoning=m.reasoning_content or "",
        )
        for m in body.messages
    ]


def chat_tools(model: Model, fmt: ToolFormat, body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan; a 400 naming the field for tools or a choice that cannot be served."""
    if body.tools is None:
        if body.tool_choice is not None:
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    tools = [
        FunctionTool(name=t.function.name, parameters=t.function.parameters or dict(NO_PARAMETERS),
                     description=t.function.description, strict=bool(t.function.strict), param=f"tools[{i}].function")
        for i, t in enumerate(body.tools)
    ]
    choice = _tool_choice(body.tool_choice)
    formatted = body.response_format is not None and body.response_format.type != "text"
    if formatted and choice.mode is not Mode.NONE:
        raise invalid("response_format cannot be combined with tools unless tool_choice is none", "response_format")
    try:
        plan = plan_tools(fmt, model, tools, choice, body.parallel_tool_calls)
    except ToolError as exc:
        raise invalid(str(exc), exc.param) from exc
    return None if formatted else plan  # tool_choice none: the response_format grammar shapes the reply


def _tool_choice(choice: ToolChoiceField | None) -> ToolChoice:
    if choice is None:
        return ToolChoice(Mode.AUTO)
    if isinstance(choice, str):
        return ToolChoice(Mode(choice))
    if isinstance(choice, NamedToolChoice):
        return ToolChoice.function(choice.function.name)
    allowed = choice.allowed_tools
    return ToolChoice(Mode(allowed.mode), tuple(t.function.name for t in allowed.tools))


def chat_prompt(model: Model, template: ChatTemplate, body: ChatCompletionRequest,
                reasoning: ReasoningFormat = ReasoningFormat.NONE) -> ChatPrompt:
    """The prompt of a chat body, with the tools it may call and the template variables it sets:
    the same for serving and for the routes that only look at prompts."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    template = template.with_kwargs(kwargs) if kwargs else template
    tools = chat_tools(model, detect_format(template.source), body)
    return turns_prompt(model, template, chat_turns(body), tools, reasoning=reasoning)


def turns_prompt(model: Model, template: ChatTemplate, turns: list[ChatTurn], plan: ToolPlan | None,
                 param: str = "messages", reasoning: ReasoningFormat = ReasoningFormat.NONE) -> ChatPrompt:
    """The prompt of a conversation (any API's, as turns) whose reply may call tools by `plan` and
    carry its thinking in `reasoning`; a template that refuses it is a 400 naming `param`. Where
    the reply thinks, the tool grammar waits for the thinking to close."""
    messages = template_messages(detect_format(template.source), turns)
    if plan is not None:
        template, messages = plan.template(template), plan.prompt_messages(messages)
    try:
        if model.info.keeps_at_marks:
            turn = mark_messages(model, template, messages)
            tokens, marks = turn.tokens, turn.checkpoint_marks()
        else:
            tokens, marks = text_tokens(model, template.render(messages), template.bos_token), []
    except ChatTemplateError as exc:
        raise invalid(str(exc), param) from exc
    syntax = syntax_for(reasoning, model.detokenize(tokens[-_TAIL_TOKENS:], special=True))
    if plan is not None and syntax is not None:
        plan = plan.after_thinking(_placement(syntax))
        if syntax.format is ReasoningFormat.HARMONY and plan.format is ToolFormat.HARMONY:
            syntax = replace(syntax, calls_next=plan.choice.mode is Mode.REQUIRED)  # its close leaves the header
    return ChatPrompt(tokens, marks, plan, syntax)


_TAIL_TOKENS = 16  # enough of a prompt's end to see a thinking block it opened


def _placement(syntax: ReasoningSyntax) -> Thinking:
    """Where the tool grammar finds the thinking (for harmony: the analysis)."""
    return Thinking.OPEN if syntax.starts_open else Thinking.OPTIONAL


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


async def completion_tokens(model: Model, body: CompletionRequest) -> list[int]:
    """`completion_prompt`: a text tokenized off the event loop, a token list checked on it (a hop
    to a thread and back cost more than the check)."""
    if isinstance(body.prompt, str):
        return await asyncio.to_thread(completion_prompt, model, body)
    return completion_prompt(model, body)


def check_token_ids(model: Model, tokens: list[int], param: str) -> None:
    if tokens and (min(tokens) < 0 or max(tokens) >= model.info.n_vocab):
        raise invalid(f"{param}: token ids must be in [0, {model.info.n_vocab})", param)


async def prompt_tokens(
    model: Model, template: ChatTemplate, body: ChatCompletionRequest | CompletionRequest
) -> list[int]:
    """The tokens a chat or completion body is served with, for the endpoints that only look at
    prompts (prefix match, tokenize, render): the same functions as the real request path."""
    if isinstance(body, ChatCompletionRequest):
        return (await asyncio.to_thread(chat_prompt, model, template, body)).tokens
    return await completion_tokens(model, body)


def parse_body(body: dict) -> ChatCompletionRequest | CompletionRequest:
    """A raw body as a chat when it has `messages`, else as a completion; a 400 where it is neither."""
    try:
        return (ChatCompletionRequest if "messages" in body else CompletionRequest).model_validate(body)
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from exc


async def body_prompt(model: Model, template: ChatTemplate, body: dict) -> list[int]:
    """`prompt_tokens` of a raw body: a chat when it has `messages`, else a completion."""
    return await prompt_tokens(model, template, parse_body(body))


def job_namespace(body: Sampling, tenant: str | None, engine: Engine, adapters: AdapterSet = BASE) -> str:
    """The cache namespace a body is served in, for the caller `tenant` (None: shared), under `adapters`
    (of `engine`'s)."""
    files = engine.lora.files(adapters) if adapters and engine.lora else ""
    return request_namespace(tenant=tenant, cache_salt=body.cache_salt, adapters=describe(adapters),
                             adapter_files=files)


def adapters_for(engine: Engine, body: Sampling) -> AdapterSet:
    """The LoRA adapters a body asks for: the one its `model` names (at `--lora-scale`), then its
    `lora` entries (llama-server's: an index into `--lora` and a scale; a later one wins). An id
    beyond the loaded adapters is a 400."""
    names = engine.lora.names if engine.lora else []
    pairs = [(body.model, engine.settings.lora_scale)] if body.model in names else []
    for i, entry in enumerate(body.lora or []):
        if entry.id >= len(names):
            raise invalid(f"lora[{i}].id is {entry.id}, but this server has {len(names)} adapters "
                          "(ids are --lora's order; GET /lora-adapters lists them)", "lora")
        pairs.append((names[entry.id], entry.scale))
    return adapter_set(pairs)


def served_model(engine: Engine, body: Sampling) -> str:
    """The model name a response reports: the adapter the body named, else the served model's."""
    names = engine.lora.names if engine.lora else []
    return body.model if body.model in names else engine.settings.served_name


def grammar_for(response_format: ResponseFormat | None) -> str | None:
    if response_format is None or response_format.type == "text":
        return None
    schema = {"type": "object"}
    if response_format.type == "json_schema":
        schema = response_format.json_schema.schema_ or {}
    try:
        check_schema(schema, "response_format.json_schema.schema")  # before the converter allocates anything
    except ToolError as exc:
        raise invalid(str(exc), exc.param) from exc
    try:
        return json_gbnf(schema)
    except Exception as exc:  # the converter raises plain exceptions on schemas it cannot express
        raise invalid(f"unsupported json_schema: {exc}", "response_format") from exc


def sampling_params(model: Model, body: Sampling, grammar: str | None) -> SamplingParams:
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
        _check_grammar(model, params, "response_format")
    return params


def chat_sampling(model: Model, body: ChatCompletionRequest, prompt: ChatPrompt) -> SamplingParams:
    """A chat's sampling: constrained by its tool grammar, or by its response_format (after the
    thinking, where the reply thinks)."""
    if prompt.tools is not None:
        return with_tool_grammar(model, sampling_params(model, body, None), prompt.tools)
    grammar, syntax = grammar_for(body.response_format), prompt.reasoning
    if grammar is not None and syntax is not None:
        grammar = thinking_first(grammar, _placement(syntax), syntax.format is ReasoningFormat.HARMONY)
    return sampling_params(model, body, grammar)


def with_tool_grammar(model: Model, params: SamplingParams, tools: ToolPlan) -> SamplingParams:
    """`params` constrained by the tool plan's grammar (lazy where it has triggers); a grammar
    llama.cpp rejects is a 400 naming `tools`."""
    grammar = tools.grammar
    if grammar is None:
        return params
    params = replace(params, grammar=grammar.gbnf, grammar_trigger_patterns=grammar.trigger_patterns,
                     grammar_trigger_tokens=grammar.trigger_tokens)
    _check_grammar(model, params, "tools")
    return params


def _check_grammar(model: Model, params: SamplingParams, param: str) -> None:
    """Build the chain once here, so a grammar llama.cpp rejects is a 400, not an engine fault."""
    try:
        check_grammar_text(params.grammar or "", param)
        Sampler(model, params).close()
    except (GrammarError, ToolError) as exc:
        raise invalid(str(exc), param) from exc


async def chat_job(engine: Engine, body: ChatCompletionRequest, *, tenant: str | None) -> tuple[Request, ReplyPlan]:
    """The scheduler request a chat body is served as for the caller `tenant`, and how its reply is
    read (its thinking, its tool calls)."""
    prompt = await asyncio.to_thread(chat_prompt, engine.model, engine.template, body, engine.reasoning)
    params = await asyncio.to_thread(chat_sampling, engine.model, body, prompt)  # grammars: off the loop
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    prediction = body.prediction.text if body.prediction is not None else ""
    predicted = await asyncio.to_thread(
        lambda: engine.model.tokenize(prediction, add_special=False, parse_special=False)) if prediction else []
    special = prompt.reasoning is not None or (prompt.tools is not None and prompt.tools.special_text)
    job = build_request(prompt.tokens, body, params, logprobs, engine, "chatcmpl", "messages",
                        tenant=tenant, marks=prompt.marks, special_text=special,
                        thinking=thinking_limit(engine, prompt.reasoning, body.reasoning_budget),
                        prediction=predicted, adapters=adapters_for(engine, body))
    return job, prompt.reply


def thinking_limit(engine: Engine, syntax: ReasoningSyntax | None, budget: int | None) -> ThinkingLimit | None:
    """How the engine watches a thinking reply: the request's budget, else `--reasoning-budget`."""
    if syntax is None:
        return None
    budget = engine.settings.reasoning_budget if budget is None else budget
    close = engine.model.tokenize(syntax.close_text, add_special=False, parse_special=True)
    return ThinkingLimit(syntax, None if budget < 0 else budget, tuple(close))


def room_for(prompt: list[int], max_seq_len: int, param: str) -> int:
    """The tokens `prompt` leaves to generate within `max_seq_len`; a 400 naming `param`, the body's
    field that holds it, where it is empty or leaves none: a prompt served or matched alike."""
    if not prompt:
        raise invalid("the prompt is empty", param)
    room = max_seq_len - len(prompt)
    if room < 1:
        raise context_length_exceeded(max_seq_len, len(prompt), param)
    return room


def prompt_param(body: ChatCompletionRequest | CompletionRequest) -> str:
    """The field of `body` that holds its prompt."""
    return "messages" if isinstance(body, ChatCompletionRequest) else "prompt"


def build_request(
    prompt: list[int], body: Sampling, params: SamplingParams, logprobs: int | None, engine: Engine,
    prefix: str, param: str, *, tenant: str | None, marks: list[Mark] | None = None, special_text: bool = False,
    thinking: ThinkingLimit | None = None, prediction: list[int] | None = None, adapters: AdapterSet = BASE,
) -> Request:
    """The request for `prompt` under `adapters`, in the cache namespace of `tenant`, the body's salt
    and those adapters; a prompt that is empty or leaves no room is a 400 naming `param`, the field
    of the body that holds it."""
    limits = engine.scheduler.config
    if body.n > limits.max_running:  # its choices decode side by side: they could never all be admitted
        raise invalid(f"n is {body.n}, but this server runs at most {limits.max_running} sequences at once", "n")
    room = room_for(prompt, limits.max_seq_len, param)
    return Request(
        id=f"{prefix}-{uuid.uuid4().hex}",
        prompt=prompt,
        params=params,
        max_tokens=min(body.token_limit or room, room),
        n=body.n,
        stop_strings=body.stop,
        logprobs=logprobs,
        ignore_eos=body.ignore_eos,
        marks=marks or [],
        special_text=special_text,
        namespace=job_namespace(body, tenant, engine, adapters),
        thinking=thinking,
        prediction=prediction or [],
        adapters=adapters,
    )
