"""Which models a server offers, read once at start: `--model` alone, `--models-dir`, a `--models` presets file.

A model is named by its preset's table, or by its file's own name without `.gguf` in `--models-dir`
(a symlink's own name, not its target's; a split GGUF's `-00001-of-0000N` file stands for the whole).
A preset's keys are `path`, `aliases`, `pinned`, `load_at_start`, `keep_alive` and any model flag in
snake_case (`ctx_size`, `cache_type_k`, ...); the command line's model flags are every preset's defaults.

Invariants:
- every name and alias names one model: a second use of a name is refused at start;
- a preset's typo or bad value is refused at start, in one line; a missing or broken file is not:
  that model's requests say what is wrong, and every other model serves.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvserve.config import ModelSettings, Settings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_SPLIT = re.compile(r"^(?P<name>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})$")
_PRESET_ONLY = ("path", "aliases", "pinned", "load_at_start", "keep_alive")
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    settings: ModelSettings
    aliases: tuple[str, ...] = ()
    pinned: bool = False  # never unloaded to make room or when idle
    load_at_start: bool = False
    keep_alive: float | None = None  # seconds idle before it unloads (None: --keep-alive's); < 0 never

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request may give for it: its own, its aliases, its LoRA adapters'."""
        return (self.name, *self.aliases, *self.settings.lora_paths())


def keep_alive_seconds(value: object) -> float:
    """Ollama's `keep_alive`: seconds as a number, or a duration such as "5m", "1h30m", "300ms", "-1".
    Negative: forever (-1.0); 0: unload once idle. ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive: {value!r} is not a duration")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(number + unit for number, unit in parts) != body:
                raise ValueError(f"keep_alive: {value!r} is not a duration (seconds, or such as 5m, 1h30m, -1)") from None
            seconds = sign * sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    else:
        raise ValueError(f"keep_alive: {value!r} is not a duration")
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"keep_alive: {value!r} is not a duration")
    return -1.0 if seconds < 0 else seconds


def catalog(settings: Settings) -> list[ModelSpec]:
    """The models `settings` name. `--model` alone: that one model, loaded at start and never unloaded."""
    if not settings.many_models:
        return [ModelSpec(settings.served_name, settings.model_settings(), pinned=True, load_at_start=True)]
    specs = []
    if "model" in settings.model_fields_set and settings.model is not None:
        specs.append(ModelSpec(settings.served_name, settings.model_settings(), load_at_start=True))
    if settings.models_dir is not None:
        specs += [ModelSpec(name, _served_as(settings.model_settings(), name, path))
                  for name, path in scan(settings.models_dir)]
    if settings.models is not None:
        specs += presets(settings, settings.models)
    _check_unique(specs)
    return specs


def scan(folder: Path) -> list[tuple[str, Path]]:
    """(name, path) of every model in `folder`, by name; a split GGUF is its first part, named without the suffix."""
    found = []
    for entry in sorted(folder.iterdir()):
        if entry.suffix != ".gguf" or entry.name.startswith("."):
            continue
        name = entry.name[: -len(".gguf")]
        split = _SPLIT.match(name)
        if split:
            if int(split["part"]) != 1:
                continue
            name = split["name"]
        found.append((name, entry))
    return found


def presets(settings: Settings, file: Path) -> list[ModelSpec]:
    """The models of a `--models` TOML file; ValueError naming the table for a bad key or value."""
    try:
        tables = tomllib.loads(file.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--models {file}: {exc}") from None
    specs = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ValueError(f"--models {file}: {name!r} is not a table ([{name}] with a path)")
        specs.append(_preset(settings, file, name, dict(table)))
    return specs


def _preset(settings: Settings, file: Path, name: str, table: dict) -> ModelSpec:
    where = f"--models {file} [{name}]"
    path = table.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}: path = \"FILE.gguf\" is required")
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ValueError(f"{where}: aliases is a list of names")
    for taken in ("model", "model_alias"):  # the table's path and name are what they would set
        if taken in table:
            instead = "path" if taken == "model" else "the table's name, or aliases"
            raise ValueError(f"{where}: {taken} is not a preset key (give {instead})")
    flags = {key: value for key, value in table.items() if key not in _PRESET_ONLY}
    try:
        model = settings.model_settings(**{"model": None, **flags})
        keep_alive = keep_alive_seconds(table["keep_alive"]) if "keep_alive" in table else None
        pinned, load_at_start = (_flag(table, key) for key in ("pinned", "load_at_start"))
    except ValueError as exc:
        raise ValueError(f"{where}: {_first_error(exc)}") from None
    resolved = (file.parent / Path(path).expanduser()).absolute()
    return ModelSpec(name, _served_as(model, name, resolved), tuple(aliases), pinned, load_at_start, keep_alive)


def _flag(table: dict, key: str) -> bool:
    value = table.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key} is true or false")
    return value


def _served_as(model: ModelSettings, name: str, path: Path) -> ModelSettings:
    """`model` serving `path` as `name`; the file is checked only when the model loads (a missing
    file fails that model alone)."""
    return model.model_copy(update={"model": path, "model_alias": name})


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg'].removeprefix('Value error, ')}" if where else first["msg"]
    return str(exc)


def _check_unique(specs: list[ModelSpec]) -> None:
    seen: dict[str, str] = {}
    for spec in specs:
        for name in spec.names:
            if name in seen:
                raise ValueError(f"model name {name!r} is given twice ({seen[name]} and {spec.name})")
            seen[name] = spec.name
    if not specs:
        raise ValueError("no models: --models-dir holds no *.gguf and --models names none")
