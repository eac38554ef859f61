"""Command-line flags generated from a config dataclass.

A field becomes a flag when its metadata carries `cli(help=...)`:

    @dataclass(frozen=True)
    class Config:
        port: int = field(default=8000, metadata=cli("TCP port to listen on"))
        queue_wait_s: float = field(default=30.0, metadata=cli("seconds ...", flag="--queue-wait"))
        batching: bool = field(default=True, metadata=cli("...", flag="--no-batching"))

`add_config_flags(parser, Config, defaults=...)` adds one argparse argument per such field: its
flag `--<field-name-with-dashes>` unless given, its dest the field's name, its default the field's
(or the `defaults` instance's), its help the metadata's. A bool field is a switch: `--no-...` turns
it off, any other flag on. Other fields are parsed by `type` (the metadata's, else `parse(name)`'s),
and take `choices`, `metavar` and `append` (a repeatable flag collecting a list) from the metadata.
A field without a default of its own (declare the dataclass `kw_only=True` to place it anywhere) is
a required flag: the command line must give it, whatever `defaults` holds.
`config_values(Config, args)` reads the parsed values back by field name.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

KEY = "cli"  # the metadata key a field's flag is described under


@dataclass(frozen=True)
class FlagSpec:
    """How one config field reads from the command line (see the module docstring)."""

    help: str
    flag: str | None = None  # default: --<field name, underscores as dashes>
    aliases: tuple[str, ...] = ()  # further names of the same flag
    type: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    metavar: str | None = None
    append: bool = False  # repeatable: each use adds one value to a list


def cli(
    help: str,
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    type: Callable[[str], Any] | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    append: bool = False,
) -> dict[str, FlagSpec]:
    """The field metadata that makes a config field a flag: `field(default=..., metadata=cli(...))`."""
    return {KEY: FlagSpec(help, flag, aliases, type, choices, metavar, append)}


def flag_fields(cls: type) -> list[tuple[dataclasses.Field[Any], FlagSpec]]:
    """The fields of dataclass `cls` that are flags, in their order, with their specs."""
    return [(f, f.metadata[KEY]) for f in dataclasses.fields(cls) if KEY in f.metadata]


def flag_name(f: dataclasses.Field[Any], spec: FlagSpec) -> str:
    """The flag of field `f`: the spec's, else --<name with dashes>."""
    return spec.flag or "--" + f.name.replace("_", "-")


def _required(f: dataclasses.Field[Any]) -> bool:
    """Whether field `f` has no default of its own (then its flag must be given)."""
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _default(f: dataclasses.Field[Any], defaults: object | None) -> Any:
    if defaults is not None:
        return getattr(defaults, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    defaults: object | None = None,
    parse: Callable[[str], Callable[[str], Any]] | None = None,
    only: Sequence[str] | None = None,
) -> None:
    """Add a flag for every field of dataclass `cls` with `cli` metadata (or those named in `only`);
    defaults from the `defaults` instance when given, else the fields' own; `parse(name)`: the
    parser of a field whose metadata names no `type`; a field without a default is a required flag."""
    for f, spec in flag_fields(cls):
        if only is not None and f.name not in only:
            continue
        names = (flag_name(f, spec), *spec.aliases)
        default = _default(f, defaults)
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": spec.help}
        if spec.metavar is not None:
            kw["metavar"] = spec.metavar
        if isinstance(default, bool):
            kw["action"] = "store_false" if names[0].startswith("--no-") else "store_true"
            parser.add_argument(*names, **kw)
            continue
        parse_as = spec.type or (parse(f.name) if parse is not None and spec.choices is None else None)
        if parse_as is not None and parse_as is not str:
            kw["type"] = parse_as
        if spec.choices is not None:
            kw["choices"] = spec.choices
        if spec.append:
            kw["action"] = "append"
            kw["default"] = None if default is None else list(default)  # argparse appends to a copy
        if _required(f):
            del kw["default"]
            kw["required"] = True
        parser.add_argument(*names, **kw)


def config_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values parsed for `cls`'s flags, by field name (the flags `args` has)."""
    return {f.name: getattr(args, f.name) for f, _ in flag_fields(cls) if hasattr(args, f.name)}


__all__ = ["KEY", "FlagSpec", "add_config_flags", "cli", "config_values", "flag_fields", "flag_name"]
