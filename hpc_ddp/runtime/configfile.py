"""Strict YAML configs for any tree of dataclasses: a top-level dataclass whose fields are
sections, each a dataclass of typed, documented settings.

``load(Config, "configs/digits.yaml", ["train.epochs=3", "data.batch_size=128"])``. Unknown
sections and keys, wrong types and bad values are refused with a message that names the
file, the key and what is valid. The runtime's own sections (:mod:`hpc_ddp.runtime.config`)
and the built-in trainer's config are both read with it.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.yamlread import load_raw, load_value, shown

T = TypeVar("T")


def setting(default: Any, doc: str) -> Any:
    """A dataclass field with its documentation attached (shown by `hpc-ddp config`)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def section(factory: Any, doc: str) -> Any:
    """A section field of a top-level config: ``factory()`` builds its defaults."""
    return field(default_factory=factory, metadata={"doc": doc})


def require(condition: bool, key: str, seen: object, expected: str) -> None:
    """Refuse a bad value in a ``__post_init__``, naming the key and what is valid."""
    if not condition:
        raise HpcDdpError(f"{key}={shown(seen)} is invalid: expected {expected}", f"fix {key}")


def section_names(cls: type) -> list[str]:
    """The sections of a top-level config class, in declaration order."""
    return [item.name for item in dataclasses.fields(cls)]


_YAML_EXPONENT = re.compile(r"^[-+]?\d+(\.\d*)?[eE][-+]?\d+$")


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(choice) for choice in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))


#: Integer settings fit a signed 64-bit integer (what torch, numpy and Slurm take).
INT_LIMIT = 2**63


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _coerce_scalar(value: Any, hint: Any) -> tuple[bool, Any]:
    """(matched, value) for None, bool, int, float and str; ints widen to float."""
    if hint is str and _is_int(value):
        return True, str(value)  # run.id=1234 (a Slurm job id) is read by YAML as a number
    if hint is type(None) or hint is bool or hint is str:
        return isinstance(value, hint), value
    if hint is int:
        return _is_int(value) and -INT_LIMIT <= value < INT_LIMIT, value
    if hint is float:
        if _is_int(value) or isinstance(value, float):
            return True, float(value)
        # YAML 1.1 reads exponents without a dot (1e-3) as text; accept them as numbers.
        if isinstance(value, str) and _YAML_EXPONENT.match(value.strip()):
            return True, float(value)
    return False, value


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check ``value`` against a type hint and return it (ints widen to float)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _coerce(value, option, where)
            except HpcDdpError:
                continue
    elif origin is Literal:
        if value in typing.get_args(hint):
            return value
    elif origin is list:
        if isinstance(value, list):
            (item_hint,) = typing.get_args(hint)
            return [_coerce(item, item_hint, f"{where}[{i}]") for i, item in enumerate(value)]
    else:
        matched, coerced = _coerce_scalar(value, hint)
        if matched:
            return coerced
    expected = _describe(hint)
    if _is_int(value) and not -INT_LIMIT <= value < INT_LIMIT:
        expected += " within a 64-bit integer"
    raise HpcDdpError(f"{where}: got {shown(value)} ({type(value).__name__}), expected {expected}")


def _build_section(defaults: Any, section: str, values: Any, source: str) -> Any:
    if not isinstance(values, Mapping):
        raise HpcDdpError(
            f"{source}: section '{section}' must be a mapping of keys to values, got "
            f"{shown(values)}",
            f"write it as '{section}:' followed by indented 'key: value' lines",
        )
    hints = typing.get_type_hints(type(defaults))
    valid = [item.name for item in dataclasses.fields(defaults)]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        guess = nearest(unknown[0], valid, f"{section}.")
        raise HpcDdpError(
            f"{source}: unknown key '{section}.{unknown[0]}'{guess}",
            f"valid keys in '{section}': {', '.join(valid)}",
        )
    try:
        coerced = {
            key: _coerce(value, hints[key], f"{section}.{key}") for key, value in values.items()
        }
        return dataclasses.replace(defaults, **coerced)
    except HpcDdpError as error:
        raise HpcDdpError(
            f"{source}: {error.message}", error.hint or "fix it in the YAML file or the override"
        ) from None


def nearest(written: str, known: Sequence[str], prefix: str = "") -> str:
    """`` (did you mean '<prefix>x'?)`` for the known name closest to a misspelt one, else
    ""."""
    close = difflib.get_close_matches(written, known, n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def from_dict(cls: type[T], raw: Mapping[str, Any], source: str = "<dict>") -> T:
    """Build ``cls`` from nested plain data over its defaults, refusing anything unknown."""
    names = section_names(cls)
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise HpcDdpError(
            f"{source}: unknown section '{unknown[0]}'{nearest(unknown[0], names)}",
            f"valid sections: {', '.join(names)}",
        )
    defaults = cls()
    sections = {
        name: _build_section(getattr(defaults, name), name, raw.get(name) or {}, source)
        for name in names
    }
    return cls(**sections)


def parse_override(text: str, sections: Sequence[str]) -> tuple[str, str, Any]:
    """Split 'section.key=value'; the value is read as YAML (3, 0.1, true, null, [64, 64])."""
    if "=" not in text:
        raise HpcDdpError(
            f"cannot read override {text!r}: expected section.key=value",
            "write overrides like train.epochs=3 data.batch_size=128",
        )
    dotted, _, raw_value = text.partition("=")
    name, dot, key = dotted.strip().partition(".")
    if not dot or not key or "." in key:
        raise HpcDdpError(
            f"cannot read override {text!r}: the key must be section.key",
            f"sections: {', '.join(sections)}; e.g. {sections[0]}.<key>=<value>",
        )
    if name not in sections:
        raise HpcDdpError(
            f"override {text!r}: unknown section '{name}'{nearest(name, sections)}",
            f"valid sections: {', '.join(sections)}",
        )
    try:
        value = load_value(raw_value, f"override {shown(text)}") if raw_value.strip() else ""
    except yaml.YAMLError:
        value = raw_value  # not YAML (e.g. a path with a backquote): keep it as text
    return name, key, value


def text_keys(cls: type) -> frozenset[str]:
    """``section.key`` of every field of ``cls``'s sections typed ``str`` or ``str | None``."""
    keys = set()
    for section_field in dataclasses.fields(cls):
        section_type = typing.get_type_hints(cls)[section_field.name]
        for name, hint in typing.get_type_hints(section_type).items():
            if hint is str or (
                typing.get_origin(hint) in (typing.Union, types.UnionType)
                and set(typing.get_args(hint)) == {str, type(None)}
            ):
                keys.add(f"{section_field.name}.{name}")
    return frozenset(keys)


def apply_overrides(
    raw: dict[str, Any],
    overrides: Sequence[str],
    sections: Sequence[str],
    text: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """``raw`` with each dotted ``section.key=value`` set (later ones win). Keys in ``text``
    take the value as written unless it is quoted or null (``run.id=4211``, ``run.id=off``,
    ``checks.command=echo a: b`` and ``checks.command=! grep -q x f`` stay text)."""
    for override in overrides:
        name, key, value = parse_override(override, sections)
        written = override.partition("=")[2].strip()
        # Quotes are YAML's to take off; anything else it would read into something other
        # than the text written (a number, a mapping, a tag such as `! grep`) stays as written.
        if f"{name}.{key}" in text and value is not None and written[:1] not in ("'", '"'):
            value = written
        current = raw.setdefault(name, {})
        if not isinstance(current, dict):
            current = raw[name] = {}
        current[key] = value
    return raw


def load(cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """Load ``path`` (or ``cls``'s defaults when None) and apply dotted overrides."""
    raw = load_raw(path) if path is not None else {}
    source = str(path) if path is not None else "<defaults>"
    apply_overrides(raw, overrides, section_names(cls), text_keys(cls))
    return from_dict(cls, raw, f"{source} + overrides" if overrides else source)


def to_dict(config: Any) -> dict[str, Any]:
    """Nested plain data, the inverse of :func:`from_dict`."""
    return dataclasses.asdict(config)


def flatten(config: Any) -> dict[str, Any]:
    """``{"train.epochs": 5, ...}``: the form MLflow params and fingerprints use."""
    flat: dict[str, Any] = {}
    for name, values in to_dict(config).items():
        for key, value in values.items():
            flat[f"{name}.{key}"] = value
    return flat


def docs(cls: type) -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every setting: the reference `hpc-ddp config` prints."""
    rows = []
    defaults = cls()
    for name in section_names(cls):
        values = getattr(defaults, name)
        for item in dataclasses.fields(values):
            default = getattr(values, item.name)
            rows.append((f"{name}.{item.name}", repr(default), item.metadata.get("doc", "")))
    return rows
