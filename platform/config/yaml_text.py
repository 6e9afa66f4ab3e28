"""YAML text from a user, parsed so that no file can exhaust memory or end in a traceback.

`yaml.safe_load` is safe from code execution, not from size: an alias bomb of ~350 bytes (each
list naming the one before nine times) is a few nodes to the parser and ~10^9 to anything that
walks it (the loader's copy, pydantic). A job config has no use for aliases, so an alias is
refused where it appears; the file is capped (`MAX_CONFIG_BYTES`); an integer beyond Python's
4,300-digit conversion limit and nesting beyond the interpreter's recursion limit are refused
with the place they were found, like any other malformed YAML.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.events import AliasEvent

MAX_CONFIG_BYTES = 1 << 20  # a real config is a few KiB; 1 MiB leaves room for long fault lists


class YamlTextError(ValueError):
    """Text that is not a config's YAML; the message names the place (line and column) and why."""


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader without aliases and with integers the interpreter can convert."""

    def compose_node(self, parent, index):
        if self.check_event(AliasEvent):
            event = self.peek_event()
            raise ComposerError(None, None, f"an alias (*{event.anchor}) repeats another value; write "
                                "the value out where it is needed (aliases are not allowed in a config)",
                                event.start_mark)
        return super().compose_node(parent, index)

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
            raise ConstructorError(None, None, f"an integer of {len(node.value)} characters is too "
                                   "large for any setting", node.start_mark) from None


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)


def parse_yaml(text: str) -> Any:
    """The value `text` holds; YamlTextError saying where and why when it cannot be one."""
    if len(text) > MAX_CONFIG_BYTES:
        raise YamlTextError(f"{len(text):,} characters is more than a config may hold "
                            f"({MAX_CONFIG_BYTES:,}); a job config is a few KiB")
    try:
        return yaml.load(text, Loader=_ConfigLoader)  # a SafeLoader subclass: no code runs
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or str(exc)
        raise YamlTextError(f"invalid YAML{where}: {reason}") from None
    except RecursionError:
        raise YamlTextError("invalid YAML: nested too deeply (a config is a few levels of "
                            "sections)") from None
