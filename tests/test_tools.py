"""kvserve.tools on its own: format detection, the streaming parser, trigger patterns and grammars
(on real llama.cpp samplers over a tiny model's vocabulary), and how history reaches templates."""

from __future__ import annotations

import ctypes
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import llama_cpp
import pytest

from kvserve.config import embedded_model_path
from kvserve.llama.chat_template import ChatTemplate
from kvserve.llama.model import Model
from kvserve.llama.sampler import Sampler, SamplingParams
from kvserve.tools import (
    ArgumentsDelta,
    CallStarted,
    ChatTurn,
    ContentDelta,
    FunctionTool,
    HistoryCall,
    Mode,
    ToolChoice,
    ToolError,
    ToolFormat,
    detect_format,
    plan_tools,
    template_messages,
)
from kvserve.tools.grammar import json_gbnf, tool_grammar
from kvserve.tools.int_range import EmptyRange, integer_bounds, integer_range
from kvserve.tools.parser import ToolCallParser
from kvserve.testing.tiny_models import TEMPLATES

ADD = FunctionTool("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"]})
WEATHER = FunctionTool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                       "required": ["city"]})
NAMES = ("add", "get_weather")


# --- format detection ----------------------------------------------------------------------------


def test_formats_detected_from_the_templates() -> None:
    smollm2 = Model(embedded_model_path())
    try:
        assert detect_format(ChatTemplate.from_model(smollm2).source) is ToolFormat.GENERIC
    finally:
        smollm2.close()
    assert detect_format(TEMPLATES["hermes"]) is ToolFormat.HERMES
    assert detect_format(TEMPLATES["llama3"]) is ToolFormat.LLAMA3
    assert detect_format("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}") is ToolFormat.MISTRAL
    # Llama 3.0: the same headers, no ipython role, no tools
    assert detect_format("<|start_header_id|>{{ m.role }}<|end_header_id|>") is ToolFormat.GENERIC


# --- the parser ----------------------------------------------------------------------------------


def parse(fmt: ToolFormat, text: str, seed: int | None = None) -> tuple[str, list[tuple[str, str]], list]:
    """(content, [(name, arguments)], events) of `text` fed whole, or in random pieces of 1-5 chars."""
    parser = ToolCallParser(fmt, NAMES)
    events = []
    if seed is None:
        events += parser.feed(text)
    else:
        rng, i = random.Random(seed), 0
        while i < len(text):
            j = i + rng.randint(1, 5)
            events += parser.feed(text[i:j])
            i = j
    events += parser.finish()
    return parser.content, [(c.name, c.arguments) for c in parser.calls], events


CASES = {
    "hermes-two-calls": (
        ToolFormat.HERMES,
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "}"}]}}\n</tool_call>',
        "Let me look.", [("get_weather", '{"city": "Pa\\"ris"}'), ("add", '{"a": 1, "b": [2, {"c": "}"}]}')],
    ),
    "hermes-text-only": (ToolFormat.HERMES, "a < b, <tool and </tool_call> are text\n\n", 
                         "a < b, <tool and </tool_call> are text\n\n", []),
    "hermes-unknown-name-is-text": (
        ToolFormat.HERMES, 'x <tool_call>{"name": "rm", "arguments": {}}</tool_call> y',
        'x <tool_call>{"name": "rm", "arguments": {}}</tool_call> y', [],
    ),
    "hermes-cut-before-arguments": (ToolFormat.HERMES, 'x <tool_call>{"name": "add", "argu',
                                    'x <tool_call>{"name": "add", "argu', []),
    # after a call, what was opening another when max_tokens cut it is syntax, not text
    "hermes-cut-second-call-before-arguments": (
        ToolFormat.HERMES, '<tool_call>{"name": "add", "arguments": {}}</tool_call>\n<tool_call>\n{"name": "ad',
        "", [("add", "{}")]),
    # a certain call that max_tokens cut is dropped, never reported with arguments that do not parse
    "hermes-cut-in-arguments": (ToolFormat.HERMES, 'x\n<tool_call>{"name": "add", "arguments": {"a": 1',
                                "x", []),
    "hermes-arguments-not-json-are-text": (
        ToolFormat.HERMES, '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', []),
    "hermes-arguments-not-an-object-are-text": (
        ToolFormat.HERMES, '<tool_call>{"name": "add", "arguments": NaN}</tool_call>',
        '<tool_call>{"name": "add", "arguments": NaN}</tool_call>', []),
    # a call object without the tags of the model's format is text (Qwen2.5-Coder writes one after a
    # tool's result), fenced or bare
    "hermes-fenced-object-is-text": (
        ToolFormat.HERMES, 'Sure.\n```json\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n```',
        'Sure.\n```json\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n```', []),
    "hermes-bare-object-is-text": (ToolFormat.HERMES, 'I call {"name": "add", "arguments": {"a": 1}}.',
                                   'I call {"name": "add", "arguments": {"a": 1}}.', []),
    # the variants Hermes-style models write: a fence around a tag, another tag
    "hermes-fenced-tag": (
        ToolFormat.HERMES, '```\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n```\nDone.',
        "\nDone.", [("add", "{}")]),
    "hermes-other-tags": (
        ToolFormat.HERMES, '<tools>{"name": "add", "arguments": {}}</tools>\n<JSON>{"name": "get_weather", '
                           '"arguments": {"city": "P"}}</JSON>',
        "", [("add", "{}"), ("get_weather", '{"city": "P"}')]),
    "hermes-bare-object-then-a-call": (
        ToolFormat.HERMES, '{"name": "add", "arguments": {}}\n<tool_call>{"name": "add", "arguments": {}}</tool_call>',
        '{"name": "add", "arguments": {}}', [("add", "{}")]),
    "hermes-code-blocks-are-text": (
        ToolFormat.HERMES, '```python\nx = {"a": 1}\n```\n```json\n{"name": "Bob"}\n```\n``` {"x"',
        '```python\nx = {"a": 1}\n```\n```json\n{"name": "Bob"}\n```\n``` {"x"', []),
    "hermes-opening-inside-a-false-one": (
        ToolFormat.HERMES, '{ <tool_call>{"name": "add", "arguments": {}}</tool_call>', "{", [("add", "{}")]),
    "hermes-unknown-tag-is-text": (ToolFormat.HERMES, '<call>{"name": "rm", "arguments": {}}</call>',
                                   '<call>{"name": "rm", "arguments": {}}</call>', []),
    "mistral": (
        ToolFormat.MISTRAL,
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {}}]',
        "", [("add", '{"a": 1, "b": 2}'), ("get_weather", "{}")],
    ),
    "llama3-call": (ToolFormat.LLAMA3, ' {"name": "add", "parameters": {"a": -1.5e3, "b": true}}', "",
                    [("add", '{"a": -1.5e3, "b": true}')]),
    "llama3-json-answer-is-text": (ToolFormat.LLAMA3, '{"answer": 3}', '{"answer": 3}', []),
    "llama3-call-after-text-is-text": (ToolFormat.LLAMA3, 'Hi {"name": "add", "parameters": {}}',
                                       'Hi {"name": "add", "parameters": {}}', []),
    "generic-response": (ToolFormat.GENERIC, '{"response": "caf\\u00e9 \\ud83d\\ude00\\n\\"q\\" \\ud800x"}',
                         'café 😀\n"q" \ufffdx', []),
    "generic-calls": (
        ToolFormat.GENERIC,
        '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "P"}}]}',
        "", [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "P"}')],
    ),
    "generic-not-json": (ToolFormat.GENERIC, "plain words", "plain words", []),
    "generic-cut-second-call": (
        ToolFormat.GENERIC, '{"tool_calls": [{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"',
        "", [("add", '{"a": 1}')]),
    "mistral-cut-second-call": (
        ToolFormat.MISTRAL, '[TOOL_CALLS][{"name": "add", "arguments": {}}, {"name": "get_weather", "arguments": {"c',
        "", [("add", "{}")]),
}


@pytest.mark.parametrize("fmt,text,content,calls", CASES.values(), ids=CASES.keys())
def test_parser_splits_content_and_calls(fmt: ToolFormat, text: str, content: str, calls: list) -> None:
    assert parse(fmt, text)[:2] == (content, calls)


@pytest.mark.parametrize("fmt,text,content,calls", CASES.values(), ids=CASES.keys())
def test_parser_events_do_not_depend_on_the_split(fmt: ToolFormat, text: str, content: str, calls: list) -> None:
    for seed in range(25):
        got_content, got_calls, events = parse(fmt, text, seed)
        assert (got_content, got_calls) == (content, calls)
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == content
        started: list[int] = []
        for event in events:
            if isinstance(event, CallStarted):
                assert event.index == len(started) and event.id.startswith("call_")
                started.append(event.index)
            elif isinstance(event, ArgumentsDelta):
                assert event.index == started[-1], "arguments only for the call in progress"
        assert len(started) == len(calls)
        for index, (_, arguments) in enumerate(calls):
            assert "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == index) == arguments


@pytest.mark.parametrize("cut", ["<tool_c", "<tool_call>", '<tool_call>\n{"name": "ad', '<tool_call>\n{"name": "add", "argu'])
def test_a_forced_reply_cut_short_has_no_text(cut: str) -> None:
    """Under tool_choice required the grammar holds the reply to call syntax from its first token:
    cut by max_tokens before a call is certain, none of it is content."""
    parser = ToolCallParser(ToolFormat.HERMES, NAMES, forced=True)
    events = parser.feed(cut) + parser.finish()
    assert parser.content == "" and parser.calls == [] and not any(isinstance(e, ContentDelta) for e in events)


def test_parser_finish_reason() -> None:
    parser = ToolCallParser(ToolFormat.GENERIC, NAMES)
    parser.feed('{"tool_calls": [{"name": "add", "arguments": {}}]}')
    parser.finish()
    assert (parser.finish_reason("stop"), parser.finish_reason("length")) == ("tool_calls", "length")
    plain = ToolCallParser(ToolFormat.GENERIC, NAMES)
    plain.feed('{"response": "hi"}')
    plain.finish()
    assert plain.finish_reason("stop") == "stop"


# --- trigger patterns and grammars ---------------------------------------------------------------


def search(pattern: str, text: str) -> re.Match | None:
    """llama.cpp's search (ECMAScript, where `$` is only the end of the text, as Python's `\\Z`)."""
    return re.search(re.sub(r"\$$", r"\\Z", pattern), text)


def test_trigger_patterns_fire_only_on_a_prefix_the_grammar_accepts() -> None:
    """llama.cpp replays the text from the pattern's first group into the grammar and aborts if the
    grammar rejects it, so a pattern must never match a marker followed by anything else."""
    hermes = tool_grammar(ToolFormat.HERMES, [ADD], required=False, parallel=True, opening_token=None)
    pattern, *_ = hermes.trigger_patterns
    fires = ["x <tool_call>", "<tool_call>\n", '<tool_call>\n{"', '<tool_call>{ "nam', '<tool_call> {"name"']
    never = ['<tool_call>"', "<tool_call>x", '<tool_call>{"name":', "<tool_call>\n\n\n{", "<tool_call"]
    assert all(search(pattern, text) for text in fires)
    assert not any(search(pattern, text) for text in never)
    (llama3,) = tool_grammar(ToolFormat.LLAMA3, [ADD], required=False, parallel=False,
                             opening_token=None).trigger_patterns
    assert search(llama3, '  {"na') and not search(llama3, 'Sure {"na') and not search(llama3, "{'")


def test_variant_triggers() -> None:
    """The Hermes variants' triggers: a reply that opens with a tag (in a fence or not) and
    `{"name"`, or a tag and a call object that names a tool wherever it stands; the replay starts at
    the brace. A call object without a tag is text, and no trigger fires on it."""
    grammar = tool_grammar(ToolFormat.HERMES, [ADD, WEATHER], required=False, parallel=True, opening_token=None)
    _, leading, variant = grammar.trigger_patterns
    opens = [' \n```json\n<json>{"name": "ad', '```\n<tool_call>\n{ "name": "', '<tools>{"name":']
    for text in opens:
        match = search(leading, text)
        assert match and text[match.start(1):].startswith("{"), text
    assert not any(search(leading, text) for text in ['{"name"', ' \n```json\n{"name": "ad', 'x <tools>{"name"',
                                                      '<tools>{"nam', '<tools>{"name": "addx', '```py\n<tools>{"name"'])
    fires = ['```json\n<json>{"name": "add"', 'x <tools>{"name":"get_weather"', '<tool>\n{ "name": "add",',
             '<JSON>{"name": "add", "argum', '<tools>{"name": "add", "arguments":']
    never = ['<tools>{"name": "ad', '<tools>{"name": "addx"', '<tools>{"name": "add", "arguments": {',
             '<tools>{"name": "add"\n', '<tools>{"key": "add"', '<tools>{"name": "rm"', '```json\n{"name": "add"',
             'x {"name":"get_weather"', '{"name": "add", "argum', '<call>{"name": "add"']
    for text in fires:
        match = search(variant, text)
        assert match and text[match.start(1):].startswith("{"), text
    assert not any(search(variant, text) for text in never)
    required = tool_grammar(ToolFormat.HERMES, [ADD], required=True, parallel=True, opening_token=None)
    assert required.trigger_patterns == () and "```" not in required.gbnf.splitlines()[0]


@pytest.fixture(scope="module")
def hermes_model(tiny) -> Model:
    model = Model(tiny("llama", "hermes"))
    yield model
    model.close()


def allowed_tokens(sampler: Sampler, n_vocab: int) -> set[int]:
    data = (llama_cpp.llama_token_data * n_vocab)(*(llama_cpp.llama_token_data(i, 0.0, 0.0) for i in range(n_vocab)))
    candidates = llama_cpp.llama_token_data_array(data, n_vocab, -1, False)
    llama_cpp.llama_sampler_apply(sampler._chain, ctypes.byref(candidates))
    return {i for i in range(n_vocab) if data[i].logit != float("-inf")}


def lazy_sampler(model: Model, fmt: ToolFormat, opening_token: int | None = None) -> Sampler:
    grammar = tool_grammar(fmt, [ADD], required=False, parallel=False, opening_token=opening_token)
    return Sampler(model, SamplingParams(temperature=0.0, grammar=grammar.gbnf,
                                         grammar_trigger_patterns=grammar.trigger_patterns,
                                         grammar_trigger_tokens=grammar.trigger_tokens))


def accept(sampler: Sampler, tokens: list[int]) -> None:
    for token in tokens:
        llama_cpp.llama_sampler_accept(sampler._chain, token)


def test_lazy_grammar_is_free_until_the_marker_then_holds(hermes_model: Model) -> None:
    n_vocab = hermes_model.info.n_vocab
    text = hermes_model.tokenize("Let me add them: <tool_", add_special=False)
    sampler = lazy_sampler(hermes_model, ToolFormat.HERMES)
    try:
        accept(sampler, text)
        assert len(allowed_tokens(sampler, n_vocab)) == n_vocab  # free text: nothing masked
        accept(sampler, hermes_model.tokenize('call>\n{"', add_special=False))
        allowed = {hermes_model.token_text(t) for t in allowed_tokens(sampler, n_vocab)}
        assert allowed and all('"name"'.startswith('"' + piece) or piece.startswith("name") for piece in allowed), allowed
    finally:
        sampler.close()


def test_marker_token_triggers_the_grammar(hermes_model: Model) -> None:
    """The hermes model spells <tool_call> as one control token: the trigger is that token."""
    (marker,) = hermes_model.tokenize("<tool_call>", add_special=False, parse_special=True)
    plan = plan_tools(ToolFormat.HERMES, hermes_model, [ADD], ToolChoice(Mode.AUTO), parallel=False)
    assert plan.grammar.trigger_tokens == (marker,)
    sampler = lazy_sampler(hermes_model, ToolFormat.HERMES, marker)
    try:
        accept(sampler, hermes_model.tokenize("Sure.", add_special=False) + [marker])
        allowed = {hermes_model.token_text(t) for t in allowed_tokens(sampler, hermes_model.info.n_vocab)}
        assert allowed and all(piece.strip() in ("", "{", '{"') for piece in allowed), allowed
    finally:
        sampler.close()


def test_marker_with_a_foreign_tail_leaves_the_grammar_off(hermes_model: Model) -> None:
    """A token that completes the marker and goes on with text the grammar rejects (`>"`) must not
    trigger it: llama.cpp would abort the process on the replay."""
    n_vocab = hermes_model.info.n_vocab
    tail = next(t for t in range(n_vocab) if hermes_model.token_text(t) == '>"')
    sampler = lazy_sampler(hermes_model, ToolFormat.HERMES)
    try:
        accept(sampler, hermes_model.tokenize("x <tool_call", add_special=False) + [tail])
        assert len(allowed_tokens(sampler, n_vocab)) == n_vocab
    finally:
        sampler.close()


def test_same_named_definitions_of_two_tools_stay_apart(hermes_model: Model) -> None:
    def with_item(name: str, field: str) -> FunctionTool:
        item = {"type": "object", "properties": {field: {"type": "integer"}}, "required": [field]}
        return FunctionTool(name, {"type": "object", "properties": {"x": {"$ref": "#/$defs/Item"}},
                                   "required": ["x"], "$defs": {"Item": item}})

    grammar = tool_grammar(ToolFormat.HERMES, [with_item("f", "n"), with_item("g", "m")],
                           required=True, parallel=False, opening_token=None)
    assert re.search(r'^t0-Item ::= "\{" space t0-Item-n-kv', grammar.gbnf, re.M), grammar.gbnf
    assert re.search(r'^t1-Item ::= "\{" space t1-Item-m-kv', grammar.gbnf, re.M), grammar.gbnf
    Sampler(hermes_model, SamplingParams(grammar=grammar.gbnf)).close()  # llama.cpp parses it


def _string_opened(model: Model, schema: dict) -> Sampler:
    sampler = Sampler(model, SamplingParams(temperature=0.0, grammar=json_gbnf(schema)))
    sampler.accept(model.tokenize('"', add_special=False)[0])
    return sampler


def test_a_json_string_holds_no_raw_control_character(hermes_model: Model) -> None:
    """JSON forbids a raw newline in a string (`\\n` is how it writes one): the response_format
    grammar does too, or a finished reply would not parse."""
    sampler = _string_opened(hermes_model, {"type": "string"})
    try:
        newline, escape, letter = (hermes_model.tokenize(t, add_special=False)[0] for t in ("\n", "\\", "a"))
        assert sampler.allows([newline, escape, letter]) == [False, True, True]
    finally:
        sampler.close()


def test_a_literal_past_u_ffff_is_one_character_to_the_grammar(hermes_model: Model) -> None:
    """An emoji in an enum: the grammar admits its UTF-8 bytes, not those of two lone surrogates."""
    sampler = _string_opened(hermes_model, {"enum": ["\U0001F600 happy"]})
    try:
        first = hermes_model.tokenize("\U0001F600", add_special=False)[0]
        assert sampler.allows([first]) == [True]
    finally:
        sampler.close()


_LONG_ANSWER = """
import sys, threading
from pathlib import Path
from kvserve.llama.model import Model
from kvserve.llama.sampler import Sampler, SamplingParams
from kvserve.tools.formats import ToolFormat
from kvserve.tools.grammar import Thinking, tool_grammar
from kvserve.tools.spec import FunctionTool

model = Model(Path(sys.argv[1]))
tools = [FunctionTool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})]
answer = model.tokenize("</think>" + " " * 6000 + "#" * 6000 + "\\n" * 3000, add_special=False)

def feed() -> None:
    for fmt in ToolFormat:
        for thinking in (None, *Thinking):
            if fmt is ToolFormat.GENERIC:
                continue
            grammar = tool_grammar(fmt, tools, required=False, parallel=True, opening_token=None, thinking=thinking)
            sampler = Sampler(model, SamplingParams(grammar=grammar.gbnf, grammar_trigger_patterns=grammar.trigger_patterns))
            for token in answer:
                sampler.accept(token)
            sampler.close()
    print("fed", len(answer))

threading.stack_size(512 * 1024)  # the crash below 40,000 characters on an 8 MiB stack comes at ~2,500 here
worker = threading.Thread(target=feed)
worker.start()
worker.join()
"""


def test_trigger_patterns_survive_a_long_answer(tiny, tmp_path: Path) -> None:
    """llama.cpp matches each lazy pattern against all the text the grammar saw, at each token, with
    std::regex, which recurses per character a quantifier takes: an unbounded one over the answer
    overflowed the engine thread's stack (SIGSEGV, the server gone) on long answers. Every format's
    patterns, with and without thinking, over 15,000 characters on a 512 KiB stack, in a process of
    its own."""
    script = tmp_path / "long_answer.py"
    script.write_text(_LONG_ANSWER)
    done = subprocess.run([sys.executable, str(script), str(tiny("llama", "hermes"))], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.startswith("fed"), (done.returncode, done.stderr[-2000:])


def _as_regex(gbnf: str) -> re.Pattern:
    """The subset of GBNF `integer_range` writes (quoted characters, classes, groups, `|`, `{m,n}`)
    read as a Python regex."""
    return re.compile(re.sub(r'"(.)"', lambda m: re.escape(m[1]), gbnf).replace(" ", ""))


@pytest.mark.parametrize("low,high", [(5, 10), (0, 0), (-5, 5), (-10, -3), (None, 7), (3, None), (None, -4),
                                      (-4, None), (0, 999), (1, 1000), (17, 4321), (-1234, -56), (99, 101)]
                         + [tuple(sorted(random.Random(i).sample(range(-3000, 3000), 2))) for i in range(20)])
def test_an_integer_range_is_exactly_its_integers(low: int | None, high: int | None) -> None:
    pattern = _as_regex(integer_range(low, high))
    for n in range(-3500, 3500):
        assert bool(pattern.fullmatch(str(n))) == ((low is None or n >= low) and (high is None or n <= high)), n
    assert not any(pattern.fullmatch(text) for text in ("-0", "007", "00", "-", "", "+5", "5.0"))


def test_integer_bounds_read_every_draft() -> None:
    assert integer_bounds({"type": "integer"}) is None
    assert integer_bounds({"minimum": 1.5, "maximum": 7.9}) == (2, 7)
    assert integer_bounds({"exclusiveMinimum": 0, "exclusiveMaximum": 10}) == (1, 9)
    assert integer_bounds({"minimum": 0, "exclusiveMinimum": True, "maximum": 5, "exclusiveMaximum": True}) == (1, 4)
    assert integer_bounds({"minimum": 0, "exclusiveMinimum": 3}) == (4, None)  # the tighter
    assert integer_bounds({"maximum": 1e300}) == (None, None)
    with pytest.raises(EmptyRange):
        integer_bounds({"minimum": 5, "maximum": 2})


def test_an_integers_bounds_hold_in_llama_cpp(hermes_model: Model) -> None:
    """minimum 5, maximum 10: a first digit of 5-9, or a 1 that only a 0 may follow, then nothing."""
    sampler = Sampler(hermes_model, SamplingParams(temperature=0.0, grammar=json_gbnf(
        {"type": "integer", "minimum": 5, "maximum": 10})))
    digit = {d: hermes_model.tokenize(d, add_special=False)[0] for d in "0123456789"}
    try:
        assert sampler.allows(list(digit.values())) == [d in "156789" for d in digit]
        sampler.accept(digit["1"])
        assert sampler.allows([digit["0"], digit["1"], digit["5"]]) == [True, False, False]
    finally:
        sampler.close()


def test_schema_the_converter_cannot_express_names_the_tool(hermes_model: Model) -> None:
    bad = FunctionTool("f", {"$ref": "https://example.com/schema.json"}, param="tools[1].function")
    with pytest.raises(ToolError) as caught:
        plan_tools(ToolFormat.HERMES, hermes_model, [ADD, bad], ToolChoice(Mode.AUTO))
    assert caught.value.param == "tools[1].function.parameters"


# --- history -------------------------------------------------------------------------------------


CONVERSATION = [
    ChatTurn("user", "add 1 and 2"),
    ChatTurn("assistant", "", (HistoryCall("call_abc", "add", '{"a": 1, "b": 2}'),
                               HistoryCall("call_def", "add", "{not json"))),
    ChatTurn("tool", "3", tool_call_id="call_abc"),
    ChatTurn("tool", "error", tool_call_id="call_def"),
]


def test_history_for_a_template_that_knows_tools() -> None:
    messages = template_messages(ToolFormat.HERMES, CONVERSATION)
    calls = messages[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"a": 1, "b": 2}  # an object, as templates expect
    assert calls[1]["function"]["arguments"] == "{not json"  # kept as text
    assert messages[2] == {"role": "tool", "content": "3", "tool_call_id": "call_abc", "name": "add"}
    rendered = ChatTemplate(TEMPLATES["hermes"], "", "").render(messages)
    assert '"arguments": {"a": 1, "b": 2}' in rendered and '"arguments": "{not json"' in rendered
    assert "<tool_response>\n3\n</tool_response>" in rendered


def test_history_for_mistral_pairs_nine_character_ids() -> None:
    messages = template_messages(ToolFormat.MISTRAL, CONVERSATION)
    first, second = (c["id"] for c in messages[1]["tool_calls"])
    assert re.fullmatch(r"[a-zA-Z0-9]{9}", first) and first != second
    assert (messages[2]["tool_call_id"], messages[3]["tool_call_id"]) == (first, second)


def test_history_in_the_generic_mode() -> None:
    messages = template_messages(ToolFormat.GENERIC, CONVERSATION)
    assert json.loads(messages[1]["content"]) == {
        "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": "{not json"}]}
    assert messages[2] == {"role": "user", "content": "Result of add (call call_abc):\n3"}


# --- where the grammar lets the model stop ------------------------------------------------------


def eog_allowed(model: Model, sampler: Sampler) -> bool:
    eos = llama_cpp.llama_vocab_eos(model.vocab)
    return eos in allowed_tokens(sampler, model.info.n_vocab)


def sampler_after(model: Model, plan_choice: ToolChoice, parallel: bool, text: str, fmt=ToolFormat.HERMES) -> Sampler:
    plan = plan_tools(fmt, model, [ADD, WEATHER], plan_choice, parallel)
    sampler = Sampler(model, SamplingParams(temperature=0.0, grammar=plan.grammar.gbnf,
                                            grammar_trigger_patterns=plan.grammar.trigger_patterns,
                                            grammar_trigger_tokens=plan.grammar.trigger_tokens))
    accept(sampler, model.tokenize(text, add_special=False, parse_special=True))
    return sampler


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize("choice,parallel,another", [
    (ToolChoice(Mode.REQUIRED), True, True), (ToolChoice(Mode.AUTO), True, True),
    (ToolChoice(Mode.REQUIRED), False, False), (ToolChoice.function("add"), True, False)])
def test_the_model_may_stop_after_each_call(hermes_model: Model, choice: ToolChoice, parallel: bool,
                                            another: bool) -> None:
    """After a complete call (and a newline) the end of generation is allowed; another call only
    where parallel calls are, which a named choice never allows."""
    for text in (CALL, CALL + "\n", f"{CALL}\n{CALL}" if another else CALL):
        sampler = sampler_after(hermes_model, choice, parallel, text)
        try:
            assert eog_allowed(hermes_model, sampler), text
            pieces = {hermes_model.token_text(t) for t in allowed_tokens(sampler, hermes_model.info.n_vocab)}
            assert ("<tool_call>" in pieces) is another, pieces
        finally:
            sampler.close()


@pytest.mark.parametrize("text,rest", [
    ('Sure.\n```json\n<json>{"name": "add"', ', "arguments": {"a": 1, "b": 2}}</json>\n```'),
    ('x <tools>{"name": "add", "argu', 'ments": {"a": 1, "b": 2}}</tools>'),
    ('<tool>{ "name": "get_weather",', ' "arguments": {"city": "P"}}'),
    ('```json\n<xml>{"name": "', 'add", "arguments": {"a": 1, "b": 2}}</xml>\n```')])
def test_variant_trigger_replays_into_the_grammar(hermes_model: Model, text: str, rest: str) -> None:
    """The variant trigger fires (the grammar holds: not every token is allowed) and its replay is
    accepted (a rejected replay would abort this process); the call then closes, with its fence
    or tag, and may end."""
    sampler = sampler_after(hermes_model, ToolChoice(Mode.AUTO), True, text)
    try:
        assert len(allowed_tokens(sampler, hermes_model.info.n_vocab)) < hermes_model.info.n_vocab
        accept(sampler, hermes_model.tokenize(rest, add_special=False))
        assert eog_allowed(hermes_model, sampler)
    finally:
        sampler.close()
