"""Loading a `JobConfig` from YAML plus `--set a.b=c` overrides, with errors that name the
dotted path of every bad field."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from longrun.config.job import JobConfig
from longrun.config.yaml_text import MAX_CONFIG_BYTES, YamlTextError, parse_yaml
from longrun.kinds import FaultKind


class ConfigError(ValueError):
    """A config the user must fix. `problems` holds (dotted path, reason) pairs."""

    fault_kind = FaultKind.FATAL  # recurs on any node: the controller ends the job, no restart

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [f"{path}: {why}" if path else why for path, why in problems]
        noun = "problem" if len(problems) == 1 else "problems"
        super().__init__(f"invalid config {source} ({len(problems)} {noun}):\n  " + "\n  ".join(lines))


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> JobConfig:
    """Read YAML from `path`, apply overrides (`a.b=c`, the value parsed as YAML so `4` is an
    int and `[1,2]` a list), validate, and return the resolved config."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        hint = ("it is a directory" if path.is_dir() else
                "it is not a regular file" if path.exists() else "no such file")
        raise ConfigError(source, [("", f"cannot read the config file: {hint}")])
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)  # never more than a config may hold
        if len(data) > MAX_CONFIG_BYTES:  # in bytes: the text of a cut file must never be parsed
            raise YamlTextError(f"the file is more than a config may hold ({MAX_CONFIG_BYTES:,} "
                                "bytes); a job config is a few KiB")
        raw = parse_yaml(data.decode("utf-8")) or {}
    except OSError as exc:
        raise ConfigError(source, [("", f"cannot read the config file: {exc.strerror or exc}")]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(source, [("", f"the file is not UTF-8 text (byte {exc.start})")]) from None
    except YamlTextError as exc:
        raise ConfigError(source, [("", str(exc))]) from None
    return config_from_dict(raw, overrides, source=source)


def config_from_dict(raw: Any, overrides: Iterable[str] = (), source: str = "<dict>") -> JobConfig:
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise ConfigError(source, [("", f"the top level must be a mapping of sections, not {kind}")])
    data = _deep_copy(raw)
    problems = []
    for item in overrides:
        try:
            apply_override(data, item)
        except ValueError as exc:
            problems.append(("--set " + item, str(exc)))
    if problems:
        raise ConfigError(source, problems)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, _problems_from(exc)) from None
    except RecursionError:  # a mapping nested thousands deep where a section was expected
        raise ConfigError(source, [("", "values nested too deeply; a config is a few levels of "
                                    "sections")]) from None


def apply_override(data: dict, item: str) -> None:
    """Apply one `dotted.path=value` override to a raw config mapping, in place."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError("expected KEY=VALUE with a dotted key, e.g. training.steps=200")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ValueError(f"empty segment in key {key!r}")
    try:
        value = parse_yaml(text) if text.strip() else None
    except YamlTextError:
        value = text  # not YAML: take it as a string and let validation judge it
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{'.'.join(parts[: depth + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _problems_from(exc: ValidationError) -> list[tuple[str, str]]:
    problems = []
    for err in exc.errors(include_url=False):
        path = _dotted(err["loc"])
        if err["type"] == "value_error":
            message = str(err["ctx"]["error"])
            # Cross-section checks raise several "path: reason" lines at once.
            for line in message.splitlines():
                sub, sep, why = line.partition(": ")
                if not path and sep:
                    problems.append((sub, why))
                else:
                    problems.append((path, line))
            continue
        if err["type"] == "extra_forbidden":
            message = "unknown key (check the spelling; `longrun config show` lists every key)"
        elif err["type"] == "missing":
            message = "required but missing"
        else:
            message = f"{err['msg']} (got {err['input']!r})"
        problems.append((path, message))
    return problems


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value
