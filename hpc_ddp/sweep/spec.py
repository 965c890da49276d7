"""A sweep's description and its expansion into tasks: pure functions over plain data.

A sweep file (YAML) names the sweep and the values to try::

    name: lr-seeds
    grid:                 # every combination
      --lr: [0.1, 0.03, 0.01]
      run.seed: [1, 2]
    zip:                  # lists taken side by side (equal lengths)
      --width: [64, 128]
      --depth: [2, 4]
    list:                 # tasks spelled out, one mapping each
      - {--dropout: 0.1}
      - {--dropout: 0.0, --label-smoothing: 0.1}
    concurrency: 4        # tasks running at once (the array's %K)
    metric: val_loss      # the one `hpc-ddp sweep status` sorts by (min; max for scores)

Tasks are every list entry x every zip row x every grid combination, in that order. A key
starting with ``-`` is an option of your program (``--lr 0.1`` on its command line); a
dotted key (``run.seed``, ``train.epochs``) is an hpc_ddp setting, given to every rank in
``$HPC_DDP_OVERRIDES``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hpc_ddp.runtime.configfile import nearest
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.yamlread import shown

#: The most tasks a sweep may have unless its file says ``max_tasks``.
DEFAULT_MAX_TASKS = 1000
#: ... and the most it may ever say.
MAX_TASKS_LIMIT = 100_000
#: Keys a sweep file may hold.
FILE_KEYS = ("name", "grid", "zip", "list", "concurrency", "metric", "mode", "max_tasks")
#: Settings the sweep sets for each task itself.
RESERVED_SETTINGS = ("run.id", "run.name", "run.output_dir")
#: Settings rendered into the one job script of all the tasks (``--signal``): a task whose
#: value differed would wait for a signal its job never sends.
WHOLE_SWEEP_SETTINGS = ("preempt.signal",)
#: Characters a value may not hold: control characters (terminal escapes, vertical tabs)
#: and marks that turn the direction of the text shown after them.
_UNSHOWABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")

_OPTION = re.compile(r"--?[A-Za-z0-9][A-Za-z0-9_.-]*")
_PLAIN_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_SETTING = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*")
_SWEEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")

#: One task's values: key -> value as its command line or override writes it.
Settings = dict[str, str]


@dataclass(frozen=True)
class SweepSpec:
    """What a sweep tries, read from its file and command line."""

    name: str
    grid: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    zipped: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    listed: tuple[Settings, ...] = ()
    #: Tasks running at once (None: as many as the cluster starts).
    concurrency: int | None = None
    #: The metric `sweep status` sorts by (None: the first validation metric it finds).
    metric: str | None = None
    mode: Literal["min", "max"] | None = None
    max_tasks: int = DEFAULT_MAX_TASKS


def value_text(value: Any, where: str) -> str:
    """A YAML scalar as a command line writes it (true/false for booleans, not True)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        text = str(value)
        if any(char in text for char in "\n\r\0"):
            raise HpcDdpError(f"{where}: {shown(value)} holds a line break", "one line per value")
        found = _UNSHOWABLE.search(text)
        if found:
            raise HpcDdpError(
                f"{where}: {shown(value)} holds the character U+{ord(found.group()):04X} (a "
                "terminal control or a text-direction mark), which would be printed as it is",
                "write the value in plain characters",
            )
        return text
    raise HpcDdpError(
        f"{where}: {shown(value)} is a {type(value).__name__}, not a single value",
        "give numbers, words or true/false (a list belongs under grid or zip)",
    )


def check_key(key: Any, where: str) -> str:
    """A sweep key: ``--option`` of the program, or a dotted ``section.key`` setting."""
    if isinstance(key, str) and (_OPTION.fullmatch(key) or _SETTING.fullmatch(key)):
        if key in RESERVED_SETTINGS:
            raise HpcDdpError(
                f"{where}: {key} is set by the sweep for each task (its run directory)",
                "remove it; the sweep's folder is run.output_dir/<sweep name>",
            )
        if key in WHOLE_SWEEP_SETTINGS:
            raise HpcDdpError(
                f"{where}: {key} goes into the one job script all the tasks share (sbatch "
                "--signal), so it cannot differ between tasks",
                f"give it once for the whole sweep, among the program's settings (e.g. "
                f"{key}=USR2), and submit a new sweep to change it",
            )
        return key
    raise HpcDdpError(
        f"{where}: {shown(key)} is neither an option of your program (--lr) nor a dotted "
        "setting (run.seed)",
        "write program options with their dashes, e.g. --lr: [0.1, 0.01]",
    )


def _file_key(written: Any, where: str) -> str:
    """A sweep file's key; a plain word is the program's option, as on the command line
    and in Python: ``lr`` is ``--lr``."""
    plain = isinstance(written, str) and _PLAIN_WORD.fullmatch(written)
    return check_key(f"--{written}" if plain else written, where)


def _refuse_twice(key: str, found: Mapping[str, Any], where: str) -> None:
    """``lr`` and ``--lr`` in one mapping name one option: one of them would be dropped."""
    if key in found:
        raise HpcDdpError(
            f"{where}: {key} is given twice ({key.removeprefix('--')} and {key} name the same "
            "option of your program)",
            "keep one of them",
        )


def _lists(raw: Any, where: str) -> dict[str, tuple[str, ...]]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise HpcDdpError(f"{where}: expected a mapping of key: [values]", "e.g. --lr: [0.1, 1]")
    lists: dict[str, tuple[str, ...]] = {}
    for written, values in raw.items():
        key = _file_key(written, where)
        _refuse_twice(key, lists, where)
        if not isinstance(values, list):
            values = [values]
        if not values:
            raise HpcDdpError(f"{where}.{key}: the list is empty", "give at least one value")
        lists[key] = tuple(value_text(value, f"{where}.{key}") for value in values)
        twice = sorted({value for value in lists[key] if lists[key].count(value) > 1})
        if twice and where == "grid":  # zip's rows may share a value, see expand
            raise HpcDdpError(
                f"{where}.{key}: {', '.join(map(repr, twice))} listed more than once: the same "
                "tasks would run again",
                "list each value once",
            )
    return lists


def _listed(raw: Any) -> tuple[Settings, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise HpcDdpError("list: expected a non-empty list of mappings", "e.g. - {--lr: 0.1}")
    tasks: list[Settings] = []
    for number, entry in enumerate(raw):
        where = f"list[{number}]"
        if not isinstance(entry, Mapping):
            raise HpcDdpError(f"{where}: {shown(entry)} is not a mapping", "e.g. - {--lr: 0.1}")
        task: Settings = {}
        for written, value in entry.items():
            key = _file_key(written, where)
            _refuse_twice(key, task, where)
            task[key] = value_text(value, f"{where}.{key}")
        if task in tasks:
            raise HpcDdpError(
                f"{where}: the same settings as list[{tasks.index(task)}]: the task would run "
                "twice",
                "list each task once",
            )
        tasks.append(task)
    return tuple(tasks)


def _whole_number(raw: Any, key: str, least: int, most: int | None = None) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < least or (most and raw > most):
        bound = f"{least} to {most}" if most else f"at least {least}"
        raise HpcDdpError(f"{key}: {shown(raw)} is not a whole number {bound}", f"e.g. {key}: 4")
    return raw


def spec_from_dict(raw: Mapping[str, Any], source: str) -> SweepSpec:
    """A SweepSpec from a sweep file's data; HpcDdpError names the first thing wrong."""
    unknown = sorted(set(raw) - set(FILE_KEYS), key=str)
    if unknown:
        raise HpcDdpError(
            f"{source}: unknown key {shown(unknown[0])}"
            + (nearest(unknown[0], FILE_KEYS) if isinstance(unknown[0], str) else ""),
            f"a sweep file holds: {', '.join(FILE_KEYS)}",
        )
    name = raw.get("name")
    if not isinstance(name, str) or not _SWEEP_NAME.fullmatch(name):
        raise HpcDdpError(
            f"{source}: name={shown(name)} cannot name the sweep's folder",
            "give name: one plain word of letters, digits, '.', '_', '+', '-' (e.g. lr-sweep)",
        )
    mode = raw.get("mode")
    if mode not in (None, "min", "max"):
        raise HpcDdpError(f"{source}: mode={shown(mode)}", "mode: min (losses) or max (scores)")
    concurrency = raw.get("concurrency")
    return SweepSpec(
        name=name,
        grid=_lists(raw.get("grid"), "grid"),
        zipped=_lists(raw.get("zip"), "zip"),
        listed=_listed(raw.get("list")),
        concurrency=None if concurrency is None else _whole_number(concurrency, "concurrency", 1),
        metric=None if raw.get("metric") is None else str(raw["metric"]),
        mode=mode,
        max_tasks=_whole_number(
            raw.get("max_tasks", DEFAULT_MAX_TASKS), "max_tasks", 1, MAX_TASKS_LIMIT
        ),
    )


def command_line_key(key: str) -> str:
    """A key as a command line may write it: a plain word (``lr``, no dot) stands for the
    program's option ``--lr``, which argparse would take for an option of hpc-ddp's own."""
    return f"--{key}" if key and "." not in key and not key.startswith("-") else key


def parse_values(text: str, option: str) -> tuple[str, tuple[str, ...]]:
    """``--grid KEY=V1,V2``: the key and its values (split on commas). A plain KEY (no dot,
    no dashes) is the program's option ``--KEY``: ``--grid lr=0.1,0.01``."""
    key, equals, values = text.partition("=")
    key = command_line_key(key)
    if not equals or not values:
        raise HpcDdpError(f"{option} {text!r} is not KEY=V1,V2,...", f"e.g. {option} lr=0.1,0.01")
    check_key(key, option)
    return key, tuple(values.split(","))


def task_count(spec: SweepSpec) -> int:
    rows = len(next(iter(spec.zipped.values()))) if spec.zipped else 1
    combinations = 1
    for values in spec.grid.values():
        combinations *= len(values)
    return max(1, len(spec.listed)) * rows * combinations


def expand(spec: SweepSpec) -> list[Settings]:
    """Every task's settings: list entries x zip rows x grid combinations."""
    lengths = {key: len(values) for key, values in spec.zipped.items()}
    if len(set(lengths.values())) > 1:
        raise HpcDdpError(
            "zip: the lists have different lengths ("
            + ", ".join(f"{key}: {count}" for key, count in lengths.items())
            + ")",
            "zip takes its lists side by side: give each the same number of values, or move "
            "one to grid",
        )
    listed = {key for entry in spec.listed for key in entry}
    _refuse_shared_keys({"grid": set(spec.grid), "zip": set(spec.zipped), "list": listed})
    count = task_count(spec)
    if count > spec.max_tasks:
        raise HpcDdpError(
            f"the sweep expands to {count} tasks, more than max_tasks={spec.max_tasks}",
            "narrow the grid, or raise max_tasks in the sweep file if you mean it",
        )
    rows = [
        dict(zip(spec.zipped, row, strict=True)) for row in zip(*spec.zipped.values(), strict=True)
    ]
    repeated = [number for number, row in enumerate(rows) if row in rows[:number]]
    if repeated:
        again = rows[repeated[0]]
        shown_row = ", ".join(f"{key}={value}" for key, value in again.items())
        raise HpcDdpError(
            f"zip: row {repeated[0]} ({shown_row}) is row {rows.index(again)} again: the same "
            "tasks would run twice",
            "give each row once",
        )
    grid = [
        dict(zip(spec.grid, row, strict=True)) for row in itertools.product(*spec.grid.values())
    ]
    return [
        {**entry, **row, **combination}
        for entry in (spec.listed or ({},))
        for row in (rows or [{}])
        for combination in grid
    ]


def _refuse_shared_keys(sources: Mapping[str, Iterable[str]]) -> None:
    seen: dict[str, str] = {}
    for source, keys in sources.items():
        for key in keys:
            if key in seen:
                raise HpcDdpError(
                    f"{key} is swept in both {seen[key]} and {source}",
                    "sweep each key in one place",
                )
            seen[key] = source


def program_words(settings: Mapping[str, str]) -> list[str]:
    """The program options of a task's settings, as its command line takes them."""
    words: list[str] = []
    for key, value in settings.items():
        if key.startswith("-"):
            words += [key, value]
    return words


def setting_words(settings: Mapping[str, str]) -> list[str]:
    """The dotted settings of a task, as ``key=value`` words."""
    return [f"{key}={value}" for key, value in settings.items() if not key.startswith("-")]


def describe(settings: Mapping[str, str]) -> str:
    """A task's settings in one short line: ``lr=0.1 run.seed=2``."""
    return " ".join(f"{key.lstrip('-')}={value}" for key, value in settings.items()) or "-"


def with_overrides(settings: Mapping[str, str], overrides: Sequence[tuple[str, str]]) -> Settings:
    """``settings`` with ``overrides`` (key, value) set or added, in place of the old values."""
    return {**settings, **dict(overrides)}
