"""Command-line flags derived from the config dataclasses: each field declares its flag once.

    swap_space_gb: float = option(4.0, "--swap-space", "GiB of CPU memory per worker for swapped-out KV")

`add_config_args(parser, EngineConfig)` adds `--swap-space` (type float from the annotation,
default 4.0, dest `swap_space_gb`); `config_from_args(EngineConfig, namespace)` builds the config
from the parsed flags; `config_to_argv(config)` gives the flags that rebuild it in a child process,
so `config_from_args(cls, parse(config_to_argv(config))) == config`. A field no command line sets
says why with `no_flag(default, why)`; tests/test_cli.py fails for a field that does neither.

A bool field is a switch that turns its default around (`--no-prefix-caching` sets
`enable_prefix_caching=False`); one whose default is None (auto: the program decides) takes both
`--flag` and `--no-flag` (`--compile`, `--no-compile`). A field whose flag has an `env` default reads that variable when
the flag is absent, else the field's default.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Collection, Sequence
from typing import Any


def option(default: Any, flag: str, help: str, *, choices: Sequence | None = None, env: str | None = None,
           aliases: Sequence[str] = ()) -> Any:
    """A config field set by `flag` (or one of its `aliases`) on the command line."""
    return dataclasses.field(default=default, metadata={"flag": flag, "help": help, "choices": choices, "env": env,
                                                        "aliases": tuple(aliases)})


def no_flag(default: Any, why: str) -> Any:
    """A config field that no command line sets (`why` says so)."""
    return dataclasses.field(default=default, metadata={"no_flag": why})


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that have a flag, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]


def add_config_args(parser: argparse.ArgumentParser, cls: type, exclude: Collection[str] = ()) -> None:
    """Add a flag for each flag field of `cls` not in `exclude`. A field whose dest the parser
    already has (`--model` of the engine and the gateway) is added once and feeds both configs."""
    dests = {action.dest for action in parser._actions}
    types = typing.get_type_hints(cls)
    for f in flag_fields(cls):
        if f.name in exclude or f.name in dests:
            continue
        meta, value_type = f.metadata, _value_type(types[f.name])
        if value_type is bool:
            action = argparse.BooleanOptionalAction if f.default is None else \
                "store_false" if f.default else "store_true"
            parser.add_argument(meta["flag"], *meta.get("aliases", ()), dest=f.name, help=meta["help"], action=action)
            continue
        if value_type is tuple:  # repeatable, each taking one or more values (vLLM's --lora-modules)
            parser.add_argument(meta["flag"], *meta.get("aliases", ()), dest=f.name, nargs="+", action=_Extend,
                                default=f.default, metavar=_metavar(meta), help=meta["help"])
            continue
        default, help = f.default, meta["help"]
        if meta["env"]:
            value = os.environ.get(meta["env"])
            # An empty variable counts as unset where the field has a default to fall back on;
            # else (--api-key) the config refuses it rather than run without one.
            default = value if value or f.default is None else f.default
            help += f" (default: ${meta['env']}" + (f", else {f.default})" if f.default is not None else ")")
        parser.add_argument(meta["flag"], *meta.get("aliases", ()), dest=f.name, type=value_type, default=default,
                            choices=meta["choices"], metavar=_metavar(meta), help=help)


def config_from_args(cls: type, namespace: argparse.Namespace):
    """`cls` from the parsed flags; a field without its flag in `namespace`, or None there, keeps its default."""
    given = {f.name: getattr(namespace, f.name) for f in flag_fields(cls) if getattr(namespace, f.name, None) is not None}
    return cls(**given)


def config_to_argv(config, exclude: Collection[str] = ()) -> list[str]:
    """The flags that make `config_from_args` rebuild `config` (fields in `exclude` or without a
    flag aside). Every value is written, so a child never falls back on its environment, except an
    auto bool's None (no flag: the child decides, as `--compile`'s PAGODA_COMPILE)."""
    types = typing.get_type_hints(type(config))
    argv = []
    for f in flag_fields(type(config)):
        value = getattr(config, f.name)
        if f.name in exclude or value is None:
            continue
        if _value_type(types[f.name]) is bool:
            if value != f.default:
                argv.append(f.metadata["flag"] if value or f.default is not None else _negated(f.metadata["flag"]))
        elif _value_type(types[f.name]) is tuple:
            argv += [f"{f.metadata['flag']}={item}" for item in value]
        else:
            argv.append(f"{f.metadata['flag']}={value}")  # '=': a value may start with '-'
    return argv


def _negated(flag: str) -> str:
    """An auto bool's off switch: `--no-compile` for `--compile` (argparse.BooleanOptionalAction's)."""
    return "--no-" + flag[2:]


class _Extend(argparse.Action):
    """Each use adds its values to the tuple (the field's default first)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, tuple(getattr(namespace, self.dest) or ()) + tuple(values))


def _value_type(hint: Any) -> type:
    """int for `int` and `int | None`."""
    if typing.get_origin(hint) is tuple:
        return tuple
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) > 1:
        raise TypeError(f"a flag needs one value type, not {hint}")
    return args[0] if args else hint


def _metavar(meta: typing.Mapping) -> str | None:
    return None if meta["choices"] else meta["flag"].lstrip("-").replace("-", "_").upper()
