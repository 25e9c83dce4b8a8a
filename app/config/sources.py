"""Where a run config's values come from: the declared defaults (app/config/schema.py), a TOML
file (--config FILE) and the command line, in that order of precedence, each checked against
its declared type and range; a mistake is one UserError naming the file or flag and key."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import types
import typing
from typing import Any, Collection

import tomli_w

from app.config.checks import Spelling, flag_spelling, validate
from app.config.schema import RENAMED, SECTIONS, Config
from app.config.tomlfile import read_toml
from app.runtime.errors import UserError


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in SECTIONS}


def _coerce(value: Any, kind: Any, where: str, choices: tuple | None) -> Any:
    """Check (and for flag strings, convert) one value against its declared type."""
    if isinstance(kind, types.UnionType):  # int | list[str]: try each in order
        for option in typing.get_args(kind):
            try:
                return _coerce(value, option, where, choices)
            except UserError:
                continue
        raise UserError(f"{where}: expected {_describe(kind)}, got {value!r}")
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            value = value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise UserError(f"{where}: expected true or false, got {value!r}")
    elif kind in (int, float):
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = kind(value)
        accepted = (int,) if kind is int else (int, float)
        if not isinstance(value, accepted) or isinstance(value, bool):
            raise UserError(f"{where}: expected {_describe(kind)}, got {value!r}")
        value = kind(value)
    elif kind is str:
        if not isinstance(value, str):
            raise UserError(f"{where}: expected a string, got {value!r}")
    elif typing.get_origin(kind) is list:
        if isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, list):
            raise UserError(f"{where}: expected {_describe(kind)}, got {value!r}")
        (item_kind,) = typing.get_args(kind)
        try:
            value = [_coerce(item, item_kind, where, None) for item in value]
        except UserError:
            raise UserError(f"{where}: expected {_describe(kind)}, got {value!r}") from None
    for item in (value if isinstance(value, list) else [value]) if choices else []:
        if item not in choices:
            raise UserError(f"{where}: must be one of {', '.join(choices)}, got {item!r}")
    return value


def _describe(kind: Any) -> str:
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
    if isinstance(kind, types.UnionType):
        return " or ".join(_describe(k) for k in typing.get_args(kind))
    if typing.get_origin(kind) is list:
        return {str: "a list of strings", float: "a list of numbers"}[typing.get_args(kind)[0]]
    return names[kind]


def file_overrides(path: str) -> dict[tuple[str, str], Any]:
    data = read_toml(path, "run config")
    overrides = {}
    sections = _section_types()
    for section, values in data.items():
        if section not in sections:
            raise UserError(f"{path}: unknown section [{section}]; known: {', '.join(sections)}")
        if not isinstance(values, dict):
            raise UserError(f"{path}: `{section}` must be a table ([{section}])")
        known = typing.get_type_hints(sections[section])
        for key, value in values.items():
            if key not in known:
                renamed = RENAMED.get(f"{section}.{key}")
                hint = f"it is now `{renamed}`" if renamed else \
                    f"known in [{section}]: {', '.join(known)}"
                raise UserError(f"{path}: unknown key `{section}.{key}`; {hint}")
            overrides[(section, key)] = value
    return overrides


def build_parser() -> argparse.ArgumentParser:
    """Flags for every declared parameter; defaults are SUPPRESSed so only given flags count."""
    parser = argparse.ArgumentParser(prog="driver.py", argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE", help="run config (TOML) with sections "
                        + ", ".join(f"[{s}]" for s in SECTIONS))
    for section, section_cls in _section_types().items():
        group = parser.add_argument_group(f"[{section}]")
        kinds = typing.get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            flags = _flags(section, f)
            kind = kinds[f.name]
            dest = f"{section}.{f.name}"
            help_text = f"{f.metadata['help']} (default: {_default_text(f)})"
            if kind is bool:
                group.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction,
                                   help=help_text)
            else:
                # Lists ("console,wandb") are checked item by item in _coerce, not by argparse.
                choices = None if typing.get_origin(kind) is list else f.metadata["choices"]
                group.add_argument(*flags, dest=dest, metavar=f.name.upper(), choices=choices,
                                   help=help_text)
    return parser


def _flags(section: str, f: dataclasses.Field) -> tuple[str, ...]:
    """The aliases, then the flag named after the key (last: the name messages use)."""
    return (*f.metadata["aliases"], f.metadata["flag"] or "--" + f.name.replace("_", "-"))


def _default_text(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if isinstance(value, list):
        return ",".join(map(str, value))
    return repr(value) if value == "" else str(value)


def parse_config(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """Defaults, then --config FILE, then flags. Returns the config and the raw namespace."""
    namespace = build_parser().parse_args(argv)
    file = getattr(namespace, "config", None)
    overrides = file_overrides(file) if file else {}
    source = dict.fromkeys(overrides, file)
    for dest, value in vars(namespace).items():
        if "." in dest:
            section, key = dest.split(".", 1)
            overrides[(section, key)] = value
            declared = {f.name: f for f in dataclasses.fields(_section_types()[section])}
            source[(section, key)] = "flag " + _flags(section, declared[key])[-1]
    return make_config(overrides, source), namespace


def make_config(overrides: dict[tuple[str, str], Any] | None = None,
                source: dict[tuple[str, str], str] | None = None,
                spell: Spelling = flag_spelling) -> Config:
    """A Config with `{(section, key): value}` applied and validated."""
    overrides = overrides or {}
    source = source or {}
    sections = _section_types()
    built = {}
    for section, section_cls in sections.items():
        values = {}
        declared = {f.name: f for f in dataclasses.fields(section_cls)}
        kinds = typing.get_type_hints(section_cls)
        for (sec, key), value in overrides.items():
            if sec != section:
                continue
            if key not in declared:
                raise UserError(f"unknown config key `{section}.{key}`")
            where = f"{source.get((sec, key), 'config')}: {section}.{key}"
            values[key] = _coerce(value, kinds[key], where, declared[key].metadata["choices"])
        built[section] = section_cls(**values)
    for sec in overrides:
        if sec[0] not in sections:
            raise UserError(f"unknown config section [{sec[0]}]")
    config = Config(**built)
    validate(config, spell)
    return config


def dump_toml(config: Config) -> str:
    return tomli_w.dumps(config.to_dict())


def keyword_names() -> dict[str, tuple[str, str]]:
    """Keyword -> (section, key): each key by its name, and by its flag's (run_name)."""
    names = {}
    for section, section_cls in _section_types().items():
        for f in dataclasses.fields(section_cls):
            names[f.name] = (section, f.name)
            names[_flags(section, f)[-1].lstrip("-").replace("-", "_")] = (section, f.name)
    return names


def config_from_keywords(keywords: dict[str, Any], file: str = "", caller: str = "",
                         ignore: Collection[tuple[str, str]] = (),
                         spell: Spelling = flag_spelling) -> Config:
    """parse_config for the Python API: defaults, the TOML `file` (less its keys in `ignore`),
    then `keywords`; the messages name settings as `spell` writes them."""
    known = keyword_names()
    overrides = file_overrides(file) if file else {}
    overrides = {key: value for key, value in overrides.items() if key not in ignore}
    source = dict.fromkeys(overrides, file)
    for name, value in keywords.items():
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {near[0]}=?" if near else "see help(app.prepare_training)"
            raise UserError(f"{caller}: unknown keyword {name}=; {hint}")
        overrides[known[name]] = value
        source[known[name]] = f"{caller}({name}=...)"
    return make_config(overrides, source, spell)
