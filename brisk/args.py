"""Command-line flags generated from the config dataclasses: one flag per field, with the
field's default and help, so a knob is declared once (in brisk/config.py) and every command
that runs an engine (`generate`, `chat`, `serve`, `bench ...`) takes it under the same name.

The same knobs can come from a YAML file (`brisk serve --config best.yaml`, as `brisk optimize`
writes one): a flat mapping of knob names to values, which become the command's defaults, so a
flag on the command line still overrides the file."""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import typing
from dataclasses import MISSING
from typing import Any, TypeVar

from brisk.config import (ClusterConfig, ConfigError, EmbeddingConfig, EngineConfig, ResponseCacheConfig, ServerConfig,
                          knobs)

C = TypeVar("C", EngineConfig, ServerConfig, EmbeddingConfig, ResponseCacheConfig, ClusterConfig)


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: type[C], title: str) -> None:
    """One flag per field of config_cls, with the field's default and help."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(config_cls)
    for f in knobs(config_cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"].replace("%", "%%")  # argparse formats help strings with %
        kind = _base_type(hints[f.name])
        default = f.default if f.default is not MISSING else None
        if hasattr(kind, "parse") or typing.get_origin(kind) is dict:  # JSON (`--speculative-config '{...}'`),
            group.add_argument(flag, type=str, default=default, help=help_text)  # parsed by the config
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


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """`brisk serve MODEL`: the model as a positional argument, as `vllm serve MODEL` takes it;
    `--model` still works, and naming two different models is an error."""
    parser.add_argument("model_argument", nargs="?", default=None, metavar="MODEL",
                        help="a GGUF file or a Hugging Face folder (the same as --model; default: SmolLM2-135M-Instruct)")


def add_config_file_argument(parser: argparse.ArgumentParser, config_classes: tuple[type, ...]) -> None:
    """`--config FILE`: this command's knobs (of `config_classes`) read from a YAML file."""
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="read options from this YAML file (knob: value per line, e.g. as `brisk optimize` "
                             "writes them); flags given here override it")
    parser.set_defaults(config_file_classes=config_classes, config_file_parser=parser)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """parser.parse_args, then, when the command was given `--config FILE`, again with the
    file's values as the command's defaults: the file fills in what the command line left out."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if path is not None:
        args.config_file_parser.set_defaults(**read_config_file(path, args.config_file_classes))
        args = parser.parse_args(argv)
    for name in ("config_file_parser", "config_file_classes"):  # parsing's, not the command's
        if hasattr(args, name):
            delattr(args, name)
    if hasattr(args, "model_argument"):
        model = args.model_argument
        del args.model_argument
        flags = sys.argv[1:] if argv is None else argv
        flagged = any(a == "--model" or a.startswith("--model=") for a in flags)
        if model is not None and flagged and args.model != model:
            raise ConfigError(f"MODEL {model!r} and --model {args.model!r} name different models: give one")
        if model is not None:
            args.model = model  # over a config file's, as any flag is
    return args


def read_config_file(path: str, config_classes: tuple[type, ...]) -> dict[str, Any]:
    """The knobs of a YAML config file, checked against `config_classes`' fields: an unknown
    name or a value of the wrong kind is an error naming the file, the key and what was expected
    (the configs' own checks of ranges still run when they are built)."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"no config file at {path}")
    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a mapping of option names to values, got {type(document).__name__}")
    fields = {f.name: typing.get_type_hints(cls)[f.name] for cls in config_classes for f in knobs(cls)}
    values = {}
    for key, value in document.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ConfigError(f"{path}: unknown option {key!r}; options are {', '.join(sorted(fields))}")
        values[name] = _checked(path, key, value, fields[name])
    return values


def _checked(path: str, key: str, value: Any, hint) -> Any:
    """`value` as the field `hint` takes it, or a ConfigError."""
    optional = isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{path}: {key} cannot be empty")
    kind = _base_type(hint)
    if hasattr(kind, "parse"):  # a nested config: a mapping in YAML, or its JSON
        return kind.parse(value)
    if typing.get_origin(kind) is dict:  # a mapping in YAML, checked by the config
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: {key} must be a mapping, got {value!r}")
        return value
    if typing.get_origin(kind) is list:
        items = value if isinstance(value, list) else [value]
        return [_checked(path, key, item, typing.get_args(kind)[0]) for item in items]
    accepted = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(kind)
    if accepted is None:
        raise ConfigError(f"{path}: {key} cannot be set from a config file (a {kind} option)")
    if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"{path}: {key} must be {kind.__name__}, got {value!r}")
    return kind(value)


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
        elif isinstance(value, dict):
            flags += [f"--{flag}", json.dumps(value)]
        elif value is not None:
            flags += [f"--{flag}", str(value)]
    return flags


def _base_type(hint) -> type:
    """`int | None` -> int, `list[str] | None` -> list[str]."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint
