"""Command-line flags generated from the config dataclasses: one flag per field, with the
field's default and help, so a knob is declared once (in brisk/config.py) and every command
that runs an engine (`generate`, `chat`, `serve`, `bench ...`) takes it under the same name."""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING
from typing import TypeVar

from brisk.config import EmbeddingConfig, EngineConfig, ResponseCacheConfig, ServerConfig, knobs

C = TypeVar("C", EngineConfig, ServerConfig, EmbeddingConfig, ResponseCacheConfig)


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: type[C], title: str) -> None:
    """One flag per field of config_cls, with the field's default and help."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(config_cls)
    for f in knobs(config_cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"].replace("%", "%%")  # argparse formats help strings with %
        kind = _base_type(hints[f.name])
        default = f.default if f.default is not MISSING else None
        if hasattr(kind, "parse"):  # a nested config as JSON (`--speculative-config '{...}'`), parsed by the config
            group.add_argument(flag, type=str, default=default, help=help_text)
        elif kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif typing.get_origin(kind) is list:  # `--served-model-name a b`
            group.add_argument(flag, nargs="+", type=typing.get_args(kind)[0], default=default, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=default, help=help_text)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, EngineConfig, "engine options")


def config_from_args(config_cls: type[C], args: argparse.Namespace) -> C:
    return config_cls(**{f.name: getattr(args, f.name) for f in knobs(config_cls)})


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(EngineConfig, args)


def config_flags(config: EngineConfig | ServerConfig) -> list[str]:
    """The flags that rebuild `config` (the inverse of config_from_args), to start a `brisk`
    subprocess with this process's configuration."""
    flags = []
    for f in knobs(type(config)):
        value, flag = getattr(config, f.name), f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, list):
            flags += [f"--{flag}", *map(str, value)]
        elif hasattr(value, "to_json"):
            flags += [f"--{flag}", value.to_json()]
        elif value is not None:
            flags += [f"--{flag}", str(value)]
    return flags


def _base_type(hint) -> type:
    """`int | None` -> int, `list[str] | None` -> list[str]."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint
