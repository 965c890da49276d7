"""What a sweep runs, and the settings its tasks may set: the program after ``--``, the
dotted keys it knows, the settings its own command line fixes and the runtime settings every
task starts from (where the sweep's MLflow store is)."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.launch.program import Program, program_from
from hpc_ddp.runtime import configfile
from hpc_ddp.runtime.config import RuntimeConfig, resolve_config
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.yamlread import load_raw
from hpc_ddp.sweep.calls import CallableProgram, load_program
from hpc_ddp.sweep.spec import RESERVED_SETTINGS

#: What a sweep's tasks run: a script, a module, the built-in trainer or a Python callable.
SweepProgram = Program | CallableProgram


def sweep_program(words: Sequence[str]) -> Program:
    """What every task runs, as written after ``--``: a script and its arguments, ``-m`` and
    a module, or ``--config NAME`` and overrides for the built-in trainer."""
    if not words:
        raise HpcDdpError(
            "no program: the sweep needs what every task runs after --",
            "e.g. hpc-ddp sweep submit sweep.yaml -- train.py --epochs 5 (or -- --config "
            "digits for the built-in trainer)",
        )
    if words[0] == "--config" and len(words) > 1:
        return program_from(words[2:], config=words[1])
    module = words[0] == "-m"
    return program_from(words[1:] if module else words, module=module)


def known_settings(program: SweepProgram, trainer_settings: Collection[str]) -> set[str]:
    """The dotted keys a task of ``program`` may set: the built-in trainer's (which whoever
    knows the trainer gives), or the runtime's for a script or module (its own options are
    written with dashes)."""
    if program.kind == "builtin":
        return set(trainer_settings)
    return set(configfile.flatten(RuntimeConfig()))


def check_settings(
    keys: Sequence[str], program: SweepProgram, trainer_settings: Collection[str] = ()
) -> None:
    """Refuses a key ``program`` does not take; ``trainer_settings``: the built-in trainer's
    dotted keys, for a sweep of it."""
    known = known_settings(program, trainer_settings)
    for key in keys:
        if key.startswith("-") or key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1)
        raise HpcDdpError(
            f"the sweep sets {key}, which is not a setting of "
            + ("the built-in trainer" if program.kind == "builtin" else "hpc_ddp"),
            (f"did you mean {close[0]}? " if close else "")
            + "`hpc-ddp config` lists the settings; your program's own options take their "
            "dashes (--lr)",
        )


def fixed_settings(program: SweepProgram) -> list[str]:
    """The dotted settings on the program's own command line (they would win over the
    sweep's, which reach the ranks in $HPC_DDP_OVERRIDES)."""
    return [word for word in program.args if "=" in word and not word.startswith("-")]


def refuse_conflicts(program: SweepProgram, swept: set[str]) -> None:
    for word in fixed_settings(program):
        key = word.partition("=")[0]
        if key in RESERVED_SETTINGS or key in swept:
            raise HpcDdpError(
                f"the program's command line sets {key}, which the sweep sets for each task",
                f"remove {word} from the command line"
                + ("" if key in RESERVED_SETTINGS else " or from the sweep"),
            )


def runtime_settings(program: SweepProgram, environ: Mapping[str, str]) -> RuntimeConfig:
    """The runtime settings every task starts from: the built-in trainer's config file, the
    environment's $HPC_DDP_OVERRIDES and the program's own dotted settings."""
    sections = configfile.section_names(RuntimeConfig)
    raw: dict[str, Any] = {}
    if program.kind == "builtin" and program.name:
        from hpc_ddp.launch.shipped import find_config

        raw = load_raw(find_config(program.name, Path.cwd()))
    given = {key: raw[key] for key in sections if isinstance(raw.get(key), Mapping)}
    words = [word for word in fixed_settings(program) if word.split(".", 1)[0] in sections]
    return resolve_config(None, words, given, environ)


def recorded_program(sweep_dir: Path, data: Mapping[str, Any]) -> SweepProgram:
    """The program a sweep's record names (a callable's from its pickle)."""
    recorded = data["program"]
    if recorded["kind"] == "callable":
        return load_program(sweep_dir)
    return Program(recorded["kind"], recorded["name"], tuple(recorded["args"]))
