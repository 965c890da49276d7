"""Reading YAML for configs: safe, strict about keys written twice, values read as a person
means them (YAML 1.2's core schema), bounded against alias bombs; and values quoted in
messages kept short."""

from __future__ import annotations

import io
import re
import reprlib
from pathlib import Path
from typing import Any

import yaml

from hpc_ddp.runtime.errors import HpcDdpError

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 40
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 2, 4, 4

#: The most values a config file may expand to: YAML aliases can make a few hundred bytes
#: stand for billions of values (an "alias bomb").
MAX_EXPANDED_VALUES = 100_000


def shown(value: object) -> str:
    """``value`` as a message quotes it: its repr, bounded in length and depth."""
    return _SHORT.repr(value)


def expanded_size(node: yaml.Node, limit: int = MAX_EXPANDED_VALUES) -> int:
    """How many values the YAML ``node`` stands for once every alias is expanded (counted
    without expanding; past ``limit`` the count stops; a node inside itself counts as over)."""
    sizes: dict[int, int] = {}

    def size(current: yaml.Node) -> int:
        known = sizes.get(id(current))
        if known is not None:
            return known
        sizes[id(current)] = limit + 1  # while counting it: a node inside itself is too big
        total = 1
        if isinstance(current, yaml.SequenceNode):
            children = list(current.value)
        elif isinstance(current, yaml.MappingNode):
            children = [part for pair in current.value for part in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > limit:
                break
        sizes[id(current)] = min(total, limit + 1)
        return sizes[id(current)]

    return size(node)


class _Named(io.StringIO):
    """Text with the file's name, which YAML puts in its messages."""

    def __init__(self, text: str, name: str) -> None:
        super().__init__(text)
        self.name = name


class CoreLoader(yaml.SafeLoader):
    """YAML's safe loader, reading plain values as a person means them (YAML 1.2's core
    schema, not 1.1's): decimal integers, plain floats, true/false and null. ``017`` (1.1:
    octal 15), ``4:16`` (1.1: 256), ``0x10``, ``1_000`` and ``yes``/``on`` stay text, which
    a number or bool setting then refuses by name."""


CoreLoader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp) for tag, regexp in resolvers if not tag.endswith(("bool", "int", "float"))
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
CoreLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
CoreLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"), list("-+0123456789")
)
CoreLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|(?:0|[1-9][0-9]*)(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)


class _StrictLoader(CoreLoader):
    """YAML's safe loader, refusing a key written twice in one mapping and a document that
    aliases expand past :data:`MAX_EXPANDED_VALUES` values."""

    def construct_document(self, node: Any) -> Any:
        if expanded_size(node) > MAX_EXPANDED_VALUES:
            raise HpcDdpError(
                f"{node.start_mark.name}: expands to more than {MAX_EXPANDED_VALUES:,} values "
                "(YAML aliases, *name, repeating each other?)",
                "write the values out; a config needs no more than a few hundred",
            )
        return super().construct_document(node)

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool):
                continue  # unhashable or odd keys are refused later, by name
            if key in seen:
                mark = key_node.start_mark
                raise HpcDdpError(
                    f"{mark.name}: key {key!r} is written twice (line {mark.line + 1})",
                    "keep one of them; a later one would silently win",
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_value(text: str, what: str) -> Any:
    """One value written in YAML (an override's), read as a config file's are (bounded
    aliases and nesting): yaml.YAMLError where it is not YAML, HpcDdpError naming ``what``
    where it is too big."""
    try:
        return yaml.load(_Named(text, what), Loader=_StrictLoader)
    except RecursionError:
        raise HpcDdpError(
            f"{what}: nested deeper than YAML can be read here",
            "give a plain value or a short list",
        ) from None


def load_mapping(path: str | Path, what: str = "config file") -> dict[Any, Any]:
    """Read a YAML file that holds one mapping (strictly: keys written once, aliases
    bounded); HpcDdpError naming the file and the place for anything else."""
    config_path = Path(path)
    if not config_path.is_file():
        raise HpcDdpError(
            f"{what} {str(config_path)!r} does not exist",
            "pass the path of a YAML file, e.g. configs/digits.yaml",
        )
    try:
        text = config_path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise HpcDdpError(
            f"{config_path}: not UTF-8 text (byte {error.object[error.start]:#04x} at "
            f"position {error.start})",
            "save the file as UTF-8",
        ) from None
    try:
        raw = yaml.load(_Named(text, str(config_path)), Loader=_StrictLoader) or {}
    except RecursionError:  # the parser recurses once per level of nesting
        raise HpcDdpError(
            f"{config_path}: nested deeper than YAML can be read here",
            "a config needs sections and keys, at most a few levels deep",
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise HpcDdpError(
            f"{config_path}: not valid YAML{where}: {problem}",
            "fix the YAML there (indentation and 'key: value' pairs); `hpc-ddp config` "
            "lists every key",
        ) from None
    if not isinstance(raw, dict):
        raise HpcDdpError(
            f"{config_path}: expected a mapping, got {type(raw).__name__}",
            "write 'key: value' lines (sections such as 'run:' with their keys indented below)",
        )
    return raw


def load_raw(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into nested plain data: a mapping of sections, each a mapping
    with text keys."""
    config_path = Path(path)
    raw = load_mapping(config_path)
    for name, section_values in raw.items():
        if not isinstance(name, str):
            raise HpcDdpError(
                f"{config_path}: section name {name!r} is a {type(name).__name__}, not text",
                "section names are words such as run, train, data",
            )
        if section_values is not None and not isinstance(section_values, dict):
            raise HpcDdpError(
                f"{config_path}: section {name!r} is {shown(section_values)}, not a mapping of "
                "keys",
                f"write its keys on indented lines below '{name}:', e.g. '  key: value'",
            )
        for key in section_values or {}:
            if not isinstance(key, str):
                raise HpcDdpError(
                    f"{config_path}: key {key!r} in section {name!r} is a "
                    f"{type(key).__name__}, not text",
                    "keys are names such as epochs or batch_size",
                )
    return raw
