"""The reply reader: thinking split off by format, tool calls parsed from the answer only, and the
same events whatever the split of the text (every byte boundary, and random splits)."""

from __future__ import annotations

import codecs
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.llama.sampler import Sampler, SamplingParams
from kvserve.reply import (
    Ended, ReasoningDelta, ReasoningFormat, ReasoningSyntax, ReplyPlan, detect_reasoning, merged, syntax_for,
)
from kvserve.scheduler.thinking import ThinkingLimit, ThinkingWatch
from kvserve.tools import ArgumentsDelta, CallStarted, ContentDelta, FunctionTool, ToolChoice, ToolFormat
from kvserve.tools.grammar import Thinking, tool_grammar
from kvserve.tools.spec import Mode

DEEPSEEK = ReasoningSyntax(ReasoningFormat.DEEPSEEK)
DEEPSEEK_OPEN = ReasoningSyntax(ReasoningFormat.DEEPSEEK, starts_open=True)
HARMONY = ReasoningSyntax(ReasoningFormat.HARMONY)
HARMONY_OPEN = ReasoningSyntax(ReasoningFormat.HARMONY, starts_open=True)

# Replies in each format, written as the models write them (tags, whitespace and special tokens as
# their tokenizers spell them), with multi-byte characters so that byte cuts split characters.
REPLIES = {
    # DeepSeek-R1 distills and Qwen3: the template opens the block, the reply starts inside it.
    "r1-opened": (DEEPSEEK_OPEN, "Okay, the user asks for 2+2 — simple arithmetic. 2+2=4.\n</think>\n\n**4** ✓",
                  "Okay, the user asks for 2+2 — simple arithmetic. 2+2=4.", "**4** ✓"),
    # SmolLM3, Magistral, older R1 templates: the reply opens the block itself.
    "think-block": (DEEPSEEK, "<think>\nLet me recall: Paris is the capital of France.\n\n</think>\n\nParis. 🇫🇷",
                    "Let me recall: Paris is the capital of France.", "Paris. 🇫🇷"),
    "no-think": (DEEPSEEK, "Bonjour, ça va?", "", "Bonjour, ça va?"),
    "empty-think": (DEEPSEEK, "<think>\n\n</think>\n\nHi!", "", "Hi!"),
    "tag-in-answer": (DEEPSEEK, "<think>a</think>Write `<think>` to open.", "a", "Write `<think>` to open."),
    # gpt-oss: the analysis channel, then the final one.
    "harmony": (HARMONY, "<|channel|>analysis<|message|>User greets in Japanese: こんにちは. Reply politely.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>こんにちは！ How can I help?",
                "User greets in Japanese: こんにちは. Reply politely.", "こんにちは！ How can I help?"),
    "harmony-no-analysis": (HARMONY, "<|channel|>final<|message|>Just the answer.", "", "Just the answer."),
}


def read(plan: ReplyPlan, pieces: list[str], reason: str = "stop") -> list:
    """The merged events of a reply fed in `pieces`; call ids (random) replaced by their index."""
    reader = plan.reader()
    events = merged([e for piece in pieces for e in reader.feed(piece)] + reader.finish(reason))
    return [CallStarted(e.index, f"call{e.index}", e.name) if isinstance(e, CallStarted) else e for e in events]


def byte_pieces(text: str, cuts: list[int]) -> list[str]:
    """`text`'s UTF-8 bytes cut at `cuts`, decoded as the detokenizer decodes a stream: a character
    split across pieces waits for its rest."""
    data = text.encode()
    decoder = codecs.getincrementaldecoder("utf-8")()
    bounds = [0, *cuts, len(data)]
    return [decoder.decode(data[a:b], final=b == len(data)) for a, b in zip(bounds, bounds[1:])]


def parts(events: list) -> tuple[str, str]:
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    answer = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return reasoning, answer


@pytest.mark.parametrize("name", REPLIES)
def test_each_format_splits_thinking_from_the_answer_at_every_byte_cut(name: str) -> None:
    syntax, text, reasoning, answer = REPLIES[name]
    plan = ReplyPlan(syntax)
    whole = read(plan, [text])
    assert parts(whole) == (reasoning, answer)
    for cut in range(1, len(text.encode())):
        assert read(plan, byte_pieces(text, [cut])) == whole, cut
    assert read(plan, list(text)) == whole  # a character at a time


@pytest.mark.parametrize("name", REPLIES)
def test_a_reply_cut_inside_its_thinking_is_all_reasoning(name: str) -> None:
    syntax, text, reasoning, _ = REPLIES[name]
    if not reasoning:
        return
    cut = text[: text.index(reasoning) + max(1, len(reasoning) // 2)]
    thought, said = parts(read(ReplyPlan(syntax), [cut], "length"))
    assert said == "" and thought and reasoning.startswith(thought.strip())


def test_none_leaves_the_text_as_generated() -> None:
    text = "<think>x</think>answer"
    assert parts(read(ReplyPlan(ReasoningSyntax(ReasoningFormat.NONE)), [text])) == ("", text)
    assert parts(read(ReplyPlan(), [text])) == ("", text)


TEXT_ATOMS = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "\n", " ", "a", "é", "→", "x y",
                              "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "analysis", "final",
                              "assistant", "<|", "<tool_call>", "</tool_call>", '{"name": "get_weather", ',
                              '"arguments": {"city": "Oslo"}}', "}", " to=functions.get_weather", "<|call|>",
                              "commentary", "<|constrain|>", "json", '{"city": "Oslo"}'])


@settings(max_examples=300, deadline=None)
@given(st.lists(TEXT_ATOMS, max_size=14), st.data(),
       st.sampled_from([DEEPSEEK, DEEPSEEK_OPEN, HARMONY, HARMONY_OPEN]), st.booleans())
def test_any_split_yields_the_same_events(atoms: list[str], data, syntax: ReasoningSyntax, with_tools: bool) -> None:
    """The property: a reply fed whole, or in pieces cut anywhere, gives identical events."""
    text = "".join(atoms)
    tools = (_harmony_plan() if syntax.format is ReasoningFormat.HARMONY else _weather_plan()) if with_tools else None
    plan = ReplyPlan(syntax, tools)
    n = len(text.encode())
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=6)))) if n > 1 else []
    assert read(plan, byte_pieces(text, cuts)) == read(plan, [text])


# --- tools after thinking ---------------------------------------------------------------------------

WEATHER = FunctionTool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                       "required": ["city"]})


def _weather_plan(choice: ToolChoice = ToolChoice(Mode.AUTO)):
    from kvserve.tools.plan import ToolPlan

    grammar = tool_grammar(ToolFormat.HERMES, [WEATHER], required=choice.mode is Mode.REQUIRED, parallel=True,
                           opening_token=None)
    return ToolPlan(ToolFormat.HERMES, (WEATHER,), (WEATHER,), choice, True, grammar)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_a_call_inside_the_thinking_is_reasoning_and_the_one_after_it_a_call() -> None:
    bare = '{"name": "get_weather", "arguments": {}}'
    text = f"I could write {CALL} here, or a bare {bare}.\n</think>\n\n{CALL}"
    plan = ReplyPlan(DEEPSEEK_OPEN, _weather_plan())
    whole = read(plan, [text])
    assert read(plan, list(text)) == whole
    calls = [e for e in whole if isinstance(e, CallStarted)]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    arguments = "".join(e.text for e in whole if isinstance(e, ArgumentsDelta))
    assert json.loads(arguments) == {"city": "Oslo"}
    reasoning, answer = parts(whole)
    assert CALL in reasoning and answer == ""
    assert whole[-1] == Ended("tool_calls")


@pytest.mark.parametrize("thinking", list(Thinking))
def test_lazy_triggers_fire_only_after_the_thinking(thinking: Thinking) -> None:
    """The patterns llama.cpp matches against the text the lazy grammar saw (std::regex, ECMAScript;
    the subset used here reads the same in Python's re). The engine keeps the grammar out of the
    chain while the reply thinks and arms it with the tokens from the close's first on, so that text
    starts at most a token before the close: a call after it fires; an opening object that only
    follows the close further on does not; no token trigger (it would fire inside the thinking)."""
    grammar = tool_grammar(ToolFormat.HERMES, [WEATHER], required=False, parallel=True, opening_token=7,
                           thinking=thinking)
    assert grammar.trigger_tokens == ()
    def fires(text: str) -> bool:
        return any(re.search(p, text) for p in grammar.trigger_patterns)
    assert fires("</think>\n\n<tool_call>") and fires('ne</think>\n<json>{"name": "get_weather", "arg')
    assert fires('</think>\n<json>{"name"')  # the leading variant, anchored past the close
    assert not fires('</think>\n' + "x" * 300 + '<json>{"name"')
    assert not fires('</think>\n<json>{"nome"')
    if thinking is Thinking.OPTIONAL:  # a reply that does not think may call at once
        assert fires("<tool_call>") and fires('<json>{"name"') and not fires('<think>\n<json>{"name"')


# --- detection ------------------------------------------------------------------------------------------


def test_the_format_is_read_from_the_template_and_vocabulary() -> None:
    tokens = {"<|channel|>", "<think>", "</think>"}
    one = tokens.__contains__
    assert detect_reasoning("{{ '<|start|>assistant<|channel|>final<|message|>' }}", one) is ReasoningFormat.HARMONY
    assert detect_reasoning("{% if x %}<think>\n{% endif %}", lambda t: False) is ReasoningFormat.DEEPSEEK
    assert detect_reasoning("{{ content.split('</think>')[-1] }}", lambda t: False) is ReasoningFormat.DEEPSEEK
    assert detect_reasoning("<|im_start|>{{ m }}", one) is ReasoningFormat.DEEPSEEK  # the vocabulary's tags
    assert detect_reasoning("<|im_start|>{{ m }}", lambda t: False) is ReasoningFormat.NONE
    assert detect_reasoning("<|channel|>", lambda t: False) is ReasoningFormat.NONE  # not a token: not harmony


def test_a_prompt_that_opens_the_thinking_starts_the_reply_inside_it() -> None:
    assert syntax_for(ReasoningFormat.DEEPSEEK, "<|im_start|>assistant\n<think>\n").starts_open
    assert not syntax_for(ReasoningFormat.DEEPSEEK, "<|im_start|>assistant\n<think>\n\n</think>\n\n").starts_open
    assert not syntax_for(ReasoningFormat.DEEPSEEK, "<|im_start|>assistant\n").starts_open
    assert syntax_for(ReasoningFormat.NONE, "<think>\n") is None


# --- the budget as the engine applies it ---------------------------------------------------------------


def test_the_watch_counts_thinking_tokens_and_forces_the_close_at_the_budget() -> None:
    close = (901, 902, 903)
    watch = ThinkingWatch(ThinkingLimit(DEEPSEEK_OPEN, 3, close))
    forced = []
    for text in ["I", " think", " more", " and", " more"]:
        token = watch.forced_token()
        if token is not None:
            forced.append(token)
            text = {901: "\n</", 902: "think", 903: ">\n\n"}[token]
        watch.observe(text)
    assert forced == [901, 902]  # the budget of 3 was spent; the close went on from there
    token = watch.forced_token()
    watch.observe(">\n\n")
    assert token == 903 and watch.forced_token() is None
    assert watch.tokens == 6  # three thought, three of the close


def test_no_budget_forces_nothing_and_an_answer_is_not_counted() -> None:
    watch = ThinkingWatch(ThinkingLimit(DEEPSEEK, None, (1,)))
    for text in ["<think>", "a", "</think>", "\n", "Hello", " there"]:
        assert watch.forced_token() is None
        watch.observe(text)
    assert watch.tokens == 3


def test_a_budget_of_zero_closes_an_opened_block_at_once() -> None:
    watch = ThinkingWatch(ThinkingLimit(DEEPSEEK_OPEN, 0, (5, 6)))
    assert watch.forced_token() == 5


# --- grammars llama.cpp accepts ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [ToolFormat.HERMES, ToolFormat.MISTRAL, ToolFormat.LLAMA3, ToolFormat.GENERIC])
@pytest.mark.parametrize("mode", [Mode.AUTO, Mode.REQUIRED])
@pytest.mark.parametrize("thinking", list(Thinking))
def test_grammars_after_thinking_are_accepted_by_llama_cpp(tiny, fmt: ToolFormat, mode: Mode,
                                                           thinking: Thinking) -> None:
    from kvserve.llama.model import Model

    grammar = tool_grammar(fmt, [WEATHER], required=mode is Mode.REQUIRED, parallel=True,
                           opening_token=None, thinking=thinking)
    model = Model(tiny("llama", "hermes"))
    try:
        params = SamplingParams(grammar=grammar.gbnf, grammar_trigger_patterns=grammar.trigger_patterns)
        Sampler(model, params).close()
    finally:
        model.close()


# --- what reaches the template ------------------------------------------------------------------------


def test_template_variables_and_past_reasoning_reach_the_template(tiny) -> None:
    from kvserve.llama.chat_template import ChatTemplate
    from kvserve.llama.model import Model
    from kvserve.server.prompts import chat_prompt
    from kvserve.server.schemas import ChatCompletionRequest

    source = ("{% for m in messages %}{{ m.role }}:{{ m.content }}[{{ m.reasoning_content | default('') }}]\n"
              "{% endfor %}effort={{ reasoning_effort | default('unset') }} x={{ x | default('unset') }}\n<think>\n")
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
                     {"role": "user", "content": "bye"}],
        "reasoning_effort": "low", "chat_template_kwargs": {"x": 1, "messages": "not these"}})
    model = Model(tiny("llama"))
    try:
        prompt = chat_prompt(model, ChatTemplate(source, "", ""), body, ReasoningFormat.DEEPSEEK)
        text = model.detokenize(prompt.tokens, special=True)
    finally:
        model.close()
    assert "assistant:hello[greet back]" in text and "effort=low x=1" in text
    assert prompt.reasoning == DEEPSEEK_OPEN  # the template opened the block


def test_responses_reasoning_items_are_the_next_assistant_turns_thinking() -> None:
    from kvserve.server.responses_api.schemas import CreateResponse
    from kvserve.server.responses_api.to_chat import chat_messages

    body = CreateResponse.model_validate({"input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "reasoning", "id": "rs_2", "summary": [], "content": [{"type": "reasoning_text", "text": "done"}]},
        {"role": "assistant", "content": "fine"}]})
    messages = chat_messages(body.items)
    assert [m.get("reasoning_content") for m in messages] == [None, "hm", None, "done"]
    assert messages[1]["tool_calls"][0]["id"] == "c1"


def test_variables_that_break_the_template_are_a_400(tiny) -> None:
    """A `chat_template_kwargs` key that shadows one of the template's functions makes it fail:
    the request's fault, answered with a 400 naming messages, never a 500."""
    from kvserve.llama.chat_template import ChatTemplate, ChatTemplateError

    template = ChatTemplate("{% if x %}{{ raise_exception('no') }}{% endif %}{{ messages[0].content }}", "", "")
    with pytest.raises(ChatTemplateError):
        template.with_kwargs({"raise_exception": 1, "x": 1}).render([{"role": "user", "content": "hi"}])


# --- harmony tool calls ---------------------------------------------------------------------------------

ANALYSIS = "<|channel|>analysis<|message|>User wants the weather in Oslo → call get_weather.<|end|>"
ARGS = '{"city": "Oslo — Norway"}'
# Every header gpt-oss writes for a call: the channel first (with <|constrain|>json, or json bare)
# or the recipient first, after `<|start|>assistant`; ended by <|call|> or by the end of the text
# (<|call|> ends generation, so the server never sees it as text).
HARMONY_CALLS = {
    "channel-first": f"{ANALYSIS}<|start|>assistant<|channel|>commentary to=functions.get_weather "
                     f"<|constrain|>json<|message|>{ARGS}<|call|>",
    "recipient-first": f"{ANALYSIS}<|start|>assistant to=functions.get_weather<|channel|>commentary json"
                       f"<|message|>{ARGS}",
    "first-message": f" to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{ARGS}",
    "bare-json": f"{ANALYSIS}<|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{ARGS}",
}


def _harmony_plan(choice: ToolChoice = ToolChoice(Mode.AUTO)):
    from kvserve.tools.plan import ToolPlan

    grammar = tool_grammar(ToolFormat.HARMONY, [WEATHER], required=choice.mode is Mode.REQUIRED, parallel=False,
                           opening_token=None)
    return ToolPlan(ToolFormat.HARMONY, (WEATHER,), (WEATHER,), choice, False, grammar)


@pytest.mark.parametrize("name", HARMONY_CALLS)
def test_harmony_calls_are_read_from_their_headers_at_every_byte_cut(name: str) -> None:
    text = HARMONY_CALLS[name]
    plan = ReplyPlan(HARMONY, _harmony_plan())
    whole = read(plan, [text])
    calls = [e for e in whole if isinstance(e, CallStarted)]
    assert [c.name for c in calls] == ["get_weather"]
    assert "".join(e.text for e in whole if isinstance(e, ArgumentsDelta)) == ARGS
    reasoning, answer = parts(whole)
    assert answer == "" and reasoning == ("" if name == "first-message" else
                                          "User wants the weather in Oslo → call get_weather.")
    assert whole[-1] == Ended("tool_calls")
    for cut in range(1, len(text.encode())):
        assert read(plan, byte_pieces(text, [cut])) == whole, cut


def test_a_harmony_preamble_is_answer_and_other_recipients_are_text() -> None:
    """A `commentary` message without a recipient is a preamble, written for the user: answer
    text, as vLLM and llama-server give it. A message to a builtin tool or to an unknown function
    is text of its channel; a call cut by `length` is dropped."""
    preamble = "<|channel|>commentary<|message|>Checking the forecast.<|end|>"
    text = f"{ANALYSIS}<|start|>assistant{preamble}<|start|>assistant<|channel|>final<|message|>Sunny."
    assert parts(read(ReplyPlan(HARMONY, _harmony_plan()), [text])) == (
        "User wants the weather in Oslo → call get_weather.", "Checking the forecast.Sunny.")
    browse = "<|channel|>analysis to=browser.search<|message|>{\"q\": \"oslo\"}<|call|>"
    events = read(ReplyPlan(HARMONY, _harmony_plan()), [browse])
    assert parts(events) == ('{"q": "oslo"}', "") and not any(isinstance(e, CallStarted) for e in events)
    unknown = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}"
    assert parts(read(ReplyPlan(HARMONY, _harmony_plan()), [unknown])) == ("", "{}")
    cut = read(ReplyPlan(HARMONY, _harmony_plan()), [HARMONY_CALLS["recipient-first"][:-3]], "length")
    assert not any(isinstance(e, CallStarted) for e in cut) and cut[-1] == Ended("length")
    no_tools = read(ReplyPlan(HARMONY), [HARMONY_CALLS["channel-first"]])
    assert parts(no_tools)[1] == ARGS  # no tools asked for: the body is text


def test_a_prompt_that_opens_the_analysis_starts_the_reply_inside_it() -> None:
    syntax = syntax_for(ReasoningFormat.HARMONY, "<|start|>assistant<|channel|>analysis<|message|>")
    assert syntax == HARMONY_OPEN
    assert syntax_for(ReasoningFormat.HARMONY, "<|start|>assistant") == HARMONY
    text = "Think briefly.<|end|><|start|>assistant<|channel|>final<|message|>Done."
    assert parts(read(ReplyPlan(HARMONY_OPEN), [text])) == ("Think briefly.", "Done.")
    assert ReasoningSyntax(ReasoningFormat.HARMONY, calls_next=True).close_text == "<|end|><|start|>assistant"


@pytest.mark.parametrize("mode", [Mode.AUTO, Mode.REQUIRED])
@pytest.mark.parametrize("thinking", list(Thinking))
def test_harmony_grammars_are_accepted_by_llama_cpp(tiny, mode: Mode, thinking: Thinking) -> None:
    from kvserve.llama.model import Model

    grammar = tool_grammar(ToolFormat.HARMONY, [WEATHER], required=mode is Mode.REQUIRED, parallel=False,
                           opening_token=None, thinking=thinking)
    model = Model(tiny("llama", "harmony"))
    try:
        Sampler(model, SamplingParams(grammar=grammar.gbnf, grammar_trigger_patterns=grammar.trigger_patterns)).close()
    finally:
        model.close()


def test_harmony_triggers_fire_on_a_calls_header_only() -> None:
    grammar = tool_grammar(ToolFormat.HARMONY, [WEATHER], required=False, parallel=False, opening_token=None)
    def fires(text: str) -> str | None:
        for pattern in grammar.trigger_patterns:
            # as llama.cpp looks: a pattern from ^ to $ must match the whole text so far, any other
            # is searched for in it
            whole = pattern.startswith("^") and pattern.endswith("$")
            found = re.fullmatch(pattern, text) if whole else re.search(pattern, text)
            if found:
                return text[next(found.start(i) for i in range(1, found.lastindex + 1) if found.group(i)):]
        return None
    assert fires(f"{ANALYSIS}<|start|>assistant<|channel|>commentary to=functions.get") == \
        "<|channel|>commentary to=functions.get"
    assert fires(" to=functions.") == " to=functions."
    assert fires(f"{ANALYSIS}<|start|>assistant to=functions.get_weather") == " to=functions.get_weather"
    assert fires(f"{ANALYSIS}<|start|>assistant<|channel|>final<|message|>to=functions.") is None
    assert fires("<|channel|>commentary to=functions.get_time") is None  # not a tool's name


# --- work: each character of a long thinking is looked at a bounded number of times ---------------------


def test_the_splitter_examines_each_character_a_bounded_number_of_times() -> None:
    """Fed a token at a time, the tag scanner looks at each character once, plus a held tail no
    longer than a tag: a splitter that rescanned the text so far would look at it n²/2 times."""
    for syntax, piece in [(DEEPSEEK_OPEN, " a<b step"), (HARMONY_OPEN, " a<|b step")]:
        splitter = syntax.splitter()
        for _ in range(2000):
            splitter.feed(piece)
        assert splitter.thinking
        assert splitter.examined <= 2000 * (len(piece) + len("<|constrain|>"))


@pytest.mark.parametrize("syntax,close,call,good", [
    (DEEPSEEK_OPEN, "\n</think>\n\n", "<tool_call>\n{\"name", '":'),
    (HARMONY_OPEN, "<|end|>", "<|start|>assistant<|channel|>commentary to=functions.get", "_weather"),
])
def test_a_lazy_grammar_is_kept_from_the_thinking(tiny, syntax: ReasoningSyntax, close: str, call: str,
                                                  good: str) -> None:
    """The lazy grammar (`auto`) is armed only once the reply answers: llama.cpp, which matches
    its trigger patterns against all the text the grammar saw at every token, sees the close and
    what follows, never the 400 thinking tokens before it; and the trigger still fires."""
    from kvserve.llama.model import Model

    harmony = syntax.format is ReasoningFormat.HARMONY
    template = "harmony" if harmony else "hermes-think"
    fmt = ToolFormat.HARMONY if harmony else ToolFormat.HERMES
    grammar = tool_grammar(fmt, [WEATHER], required=False, parallel=False, opening_token=None,
                           thinking=Thinking.OPEN)
    model = Model(tiny("llama", template))
    params = SamplingParams(grammar=grammar.gbnf, grammar_trigger_patterns=grammar.trigger_patterns)
    sampler = Sampler(model, params, defer_lazy_grammar=True)
    try:
        watch = ThinkingWatch(ThinkingLimit(syntax, None, ()))
        thinking = model.tokenize(" I think" * 200, add_special=False, parse_special=True)
        answer = model.tokenize(close + call, add_special=False, parse_special=True)
        for token in thinking + answer:
            sampler.accept(token)
            watch.gate(sampler, token, model.detokenize([token], special=True))
        assert watch.answering and len(thinking) >= 400
        assert 0 < sampler.grammar_tokens <= len(answer)
        continuations = [model.tokenize(text, add_special=False, parse_special=False)[0] for text in (good, "zz")]
        assert sampler.allows(continuations) == [True, False]  # triggered: the grammar holds the call now
    finally:
        sampler.close()
        model.close()


# --- replies recorded from real models ------------------------------------------------------------------


def _tools_plan(fmt: ToolFormat, *names: str):
    from kvserve.tools.plan import ToolPlan

    tools = tuple(FunctionTool(name) for name in names)
    grammar = tool_grammar(fmt, list(tools), required=False, parallel=False, opening_token=None)
    return ToolPlan(fmt, tools, tools, ToolChoice(Mode.AUTO), False, grammar)


def _recorded():
    import recorded_replies as r

    browse_thought = r.GPT_OSS_BROWSE.split("<|message|>")[1].split("<|end|>")[0]
    plan = _tools_plan(ToolFormat.HARMONY, "get_weather", "generate_file")
    return {  # name: (plan, text, reasoning, answer, calls as (name, arguments))
        "gpt-oss-browse": (ReplyPlan(HARMONY, plan), r.GPT_OSS_BROWSE, browse_thought,
                           '{"query": "current US president July 2025", "topn": 10, "source": "news"}', []),
        "gpt-oss-answer": (ReplyPlan(HARMONY, plan), r.GPT_OSS_ANSWER,
                           'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", []),
        "gpt-oss-call": (ReplyPlan(HARMONY, plan), r.GPT_OSS_CALL, "Need to use function get_weather.", "",
                         [("get_weather", '{"location":"San Francisco"}')]),
        "gpt-oss-preamble": (ReplyPlan(HARMONY, plan), r.GPT_OSS_PREAMBLE, "{long chain of thought}",
                             r.GPT_OSS_PREAMBLE.split("commentary<|message|>")[1].split("<|end|>")[0],
                             [("generate_file", '{"template": "basic_html", "path": "index.html"}')]),
        "r1-hello": (ReplyPlan(DEEPSEEK_OPEN, _weather_plan()), r.R1_HELLO, r.R1_REASONING, r.R1_ANSWER, []),
    }


@pytest.mark.parametrize("name", ["gpt-oss-browse", "gpt-oss-answer", "gpt-oss-call", "gpt-oss-preamble", "r1-hello"])
def test_recorded_replies_read_alike_at_every_byte_cut(name: str) -> None:
    plan, text, reasoning, answer, calls = _recorded()[name]
    whole = read(plan, [text])
    assert parts(whole) == (reasoning, answer)
    got = [(e.name, "".join(a.text for a in whole if isinstance(a, ArgumentsDelta) and a.index == e.index))
           for e in whole if isinstance(e, CallStarted)]
    assert got == calls
    assert whole[-1] == Ended("tool_calls" if calls else "stop")
    for cut in range(1, len(text.encode())):
        assert read(plan, byte_pieces(text, [cut])) == whole, cut
    assert read(plan, list(text)) == whole


def test_gpt_oss_templates_are_read_as_harmony_tools() -> None:
    """gpt-oss's own template writes a call's header in two pieces."""
    from kvserve.tools import detect_format

    gpt_oss = ('{{- "<|start|>assistant to=" }}\n{{- "functions." + tool_call.name + "<|channel|>commentary " }}\n'
               '{{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}')
    assert detect_format(gpt_oss) is ToolFormat.HARMONY
    assert detect_format("<|start|>{{ m.role }}<|channel|>final<|message|>") is ToolFormat.GENERIC  # no tools


def test_the_tool_parser_examines_each_character_a_bounded_number_of_times() -> None:
    """Whitespace before a possible call is held back; a long run of it, fed a character at a time,
    is walked once more in all, not once per character (n²/2)."""
    parser = _weather_plan().parser()
    text = ("Some text, then a pause" + " " * 400 + "\n" * 100 + "<to" + "\t" * 300) * 5
    for ch in text:
        parser.feed(ch)
    parser.finish()
    assert parser.content == text
    assert parser.examined <= 2 * len(text)
