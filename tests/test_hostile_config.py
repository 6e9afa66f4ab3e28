"""Hostile YAML (issue 42, door 6): every such file ends `config validate/show` with one
problem naming the place, exit 2 and no traceback, in bounded memory; every duration and
count has an upper bound, so nothing that validates overflows later in a worker."""

from __future__ import annotations

import resource
import subprocess
import sys
import typing

import pytest
from pydantic import BaseModel

from longrun.config import ConfigError, config_from_dict
from longrun.config.job import JobConfig

TINY = "job:\n  name: tiny\n"
# ~350 bytes; nine levels of nine references: 9^9 (~4 x 10^8) strings to whoever expands it.
BOMB = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n' + "".join(
    f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True))
# Being reworked by the memory-snapshot work (issue 39) at the same time: bounded there.
LEFT_TO_THE_CHECKPOINT_WORK = {"checkpoint.memory_interval_steps"}
# What an entry of a list of sections needs besides the number tried.
ENTRY = {"mix": {"path": "d"}, "faults": {"rank": 0, "step": 0, "kind": "kill"}}


def _limited() -> None:
    # A config run that expands the bomb must fail here, not take the shared machine's memory.
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _longrun(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longrun.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=300, preexec_fn=_limited)


@pytest.mark.parametrize(("text", "problem"), [
    (BOMB, "invalid YAML at line 2, column 8: an alias (*a) repeats another value"),
    (TINY + "  seed: " + "9" * 5000 + "\n",
     "invalid YAML at line 3, column 9: an integer of 5000 characters"),
    (TINY + "health:\n  heartbeat_timeout_s: 1e308\n",
     "health.heartbeat_timeout_s: Input should be less than or equal to 604800"),
    (TINY + "x: " + "[" * 100000 + "]" * 100000 + "\n", "invalid YAML: nested too deeply"),
    (TINY + "# " + "x" * (1 << 20) + "\n", "more than a config may hold"),
    # Fewer characters than the cap, more bytes: never parsed cut (the cut fell in a comment).
    (TINY + "# " + "\u00e9" * 600_000 + "\n", "more than a config may hold"),
], ids=["alias-bomb", "long-integer", "huge-duration", "deep-nesting", "huge-file", "huge-file-bytes"])
def test_a_hostile_config_is_one_problem_naming_the_place(tmp_path, text, problem):
    path = tmp_path / "job.yaml"
    path.write_text(text, encoding="utf-8")
    for command in ("validate", "show"):
        out = _longrun("config", command, path, cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-3000:]
        assert problem in out.stderr, out.stderr[-3000:]
        assert "Traceback" not in out.stderr and out.stdout == ""


def _numeric_fields(model: type[BaseModel], prefix: str = ""):
    """(dotted path, int or float) of every number a config holds, sections walked."""
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        kinds, annotation = set(), field.annotation
        for arg in (annotation,) if typing.get_origin(annotation) is list else \
                typing.get_args(annotation) or (annotation,):
            arg = typing.get_args(arg)[0] if typing.get_origin(arg) is typing.Annotated else arg
            if typing.get_origin(arg) is list and typing.get_args(arg):  # a list of sections: its first
                arg, path = typing.get_args(arg)[0], path + "[0]"
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                yield from _numeric_fields(arg, path + ".")
            elif arg in (int, float) and not isinstance(arg, bool):
                kinds.add(arg)
        if kinds and path not in LEFT_TO_THE_CHECKPOINT_WORK:
            yield path, float if float in kinds else int


def _too_large(path: str, kind: type) -> float:
    """A count past any bound, a duration past a week, or (a rate, a size, a factor) infinity."""
    if kind is int:
        return 10**30
    duration = path.endswith("_s") and not path.endswith("_per_s")
    return 1e308 if duration else float("inf")


def test_every_duration_and_count_has_an_upper_bound():
    fields = list(_numeric_fields(JobConfig))
    assert len(fields) > 60 and ("health.heartbeat_timeout_s", float) in fields
    unbounded = []
    for path, kind in fields:
        raw: dict = {"job": {"name": "tiny"}}
        node, *parts = raw, *path.split(".")
        for part in parts[:-1]:
            if part.endswith("[0]"):
                node[part[:-3]] = [dict(ENTRY[part[:-3]])]
                node = node[part[:-3]][0]
            else:
                node = node.setdefault(part, {})
        node[parts[-1]] = _too_large(path, kind)
        try:
            config_from_dict(raw)
        except ConfigError as exc:
            # The field's own path, an arm of its union, or its section's check naming it.
            name = path.rsplit(".", 1)[-1]
            if not any(p == path or p.startswith(path + ".") or (path.startswith(p + ".") and name in why)
                       for p, why in exc.problems):
                unbounded.append(f"{path} refused elsewhere: {exc.problems}")
        else:
            unbounded.append(path)
    assert unbounded == [], "\n".join(unbounded)
