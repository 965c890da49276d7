"""Any sbatch option a cluster asks for (``--account``, ``--qos``, ``--constraint``,
``--exclude``, ``--mem``, ``--mail-type``, ``--reservation``, ...), from a site profile and
the command line, for every way hpc_ddp submits: `render`, `submit`, `sweep submit` and
``hpc_ddp.submit``.

Profiles (YAML, a mapping under ``sbatch:``; ``true`` for a flag, ``false`` or null to drop one
a lower layer set), each winning over the one before:

1. ``$XDG_CONFIG_HOME/hpc_ddp/site.yaml`` (default ``~/.config/hpc_ddp/site.yaml``): yours;
2. ``slurm/site.yaml`` in the submission directory, beside ``slurm/site.sh``: the project's;
3. ``--slurm KEY=VALUE`` (or ``--slurm FLAG``) on the command line.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.yamlread import load_mapping

#: Options the job script sets from hpc_ddp's own options: given twice they would disagree.
OWN_OPTIONS = {
    "nodes": "--nodes",
    "N": "--nodes",
    "ntasks-per-node": "--gpus-per-node (one task per GPU) or --tasks-per-node",
    "ntasks": "--nodes with --gpus-per-node or --tasks-per-node",
    "n": "--nodes with --gpus-per-node or --tasks-per-node",
    "gpus-per-node": "--gpus-per-node",
    "cpus-per-task": "--cpus-per-task",
    "c": "--cpus-per-task",
    "time": "--time",
    "t": "--time",
    "partition": "--partition",
    "p": "--partition",
    "job-name": "--job-name",
    "J": "--job-name",
    "signal": "--signal (or preempt.signal)",
    "output": "--log-dir",
    "o": "--log-dir",
    "error": "--log-dir",
    "e": "--log-dir",
    "requeue": "nothing: the job script requeues itself after a stop",
    "array": "hpc-ddp sweep submit",
}
_KEY = re.compile(r"[A-Za-z][A-Za-z0-9-]+")
#: An sbatch option: its name and its value (None: a flag such as --exclusive).
Options = dict[str, str | None]


def option(key: str, value: Any, source: str) -> tuple[str, str | None]:
    """One option as sbatch takes it, checked: the name without dashes, the value as text."""
    name = key.lstrip("-").replace("_", "-")
    if not _KEY.fullmatch(name):
        raise HpcDdpError(
            f"{source}: {key!r} is not an sbatch option name",
            "write sbatch's long name without the dashes: account=lab (not A=lab), qos=high, "
            "exclusive",
        )
    if name in OWN_OPTIONS:
        raise HpcDdpError(
            f"{source}: --{name} is set from hpc-ddp's own options",
            f"use {OWN_OPTIONS[name]} instead",
        )
    text = None if value is None or value is True else str(value)
    if text is not None and (any(char in text for char in "\n\r\0\\") or not text.strip()):
        raise HpcDdpError(
            f"{source}: --{name}={text!r} is empty or holds a line break, NUL or backslash "
            "(an #SBATCH line would not keep it)",
            f"give --{name} one line of text, e.g. --slurm {name}=VALUE",
        )
    return name, text


def from_words(words: Sequence[str]) -> Options:
    """``--slurm`` words: ``KEY=VALUE`` or ``FLAG``; a later one wins."""
    options: Options = {}
    for word in words:
        key, equals, value = word.partition("=")
        name, text = option(key, value if equals else None, f"--slurm {word}")
        options[name] = text
    return options


def from_profile(path: Path) -> tuple[Options, list[str]]:
    """The options a profile file sets, and the ones it drops (``false`` or null)."""
    raw = load_mapping(path, "site profile")
    unknown = sorted(set(raw) - {"sbatch"})
    section = raw.get("sbatch", {})
    if unknown or not isinstance(section, Mapping):
        raise HpcDdpError(
            f"{path}: expected one mapping 'sbatch:' of sbatch options, found "
            + (f"the keys {unknown}" if unknown else f"sbatch: {section!r}"),
            "write e.g.\nsbatch:\n  account: lab\n  qos: normal",
        )
    options: Options = {}
    dropped = []
    for key, value in section.items():
        if value is False or value is None:
            dropped.append(option(str(key), True, str(path))[0])
            continue
        name, text = option(str(key), value, str(path))
        options[name] = text
    return options, dropped


def profile_paths(cwd: Path, environ: Mapping[str, str]) -> list[Path]:
    """The profile files that exist, the user's first (the project's wins over it)."""
    config_home = environ.get("XDG_CONFIG_HOME") or str(Path(environ.get("HOME", "~")) / ".config")
    candidates = [Path(config_home) / "hpc_ddp" / "site.yaml", cwd / "slurm" / "site.yaml"]
    return [path for path in candidates if path.is_file()]


def job_options(words: Sequence[str], cwd: Path, environ: Mapping[str, str]) -> Options:
    """The sbatch options of a job: the profiles', then ``--slurm`` ``words`` (which win)."""
    options: Options = {}
    for path in profile_paths(cwd, environ):
        found, dropped = from_profile(path)
        for name in dropped:
            options.pop(name, None)
        options.update(found)
    options.update(from_words(words))
    return options


def api_options(
    given: Mapping[str, str | int | bool | None] | None, cwd: Path, environ: Mapping[str, str]
) -> Options:
    """The options of a job submitted from Python (``sbatch=``): the profiles', then
    ``given`` (True: a flag; False or None: drop one a profile set), checked with sbatch."""
    options = job_options([], cwd, environ)
    for key, value in (given or {}).items():
        if value is False or value is None:
            options.pop(option(key, True, "sbatch=")[0], None)
        else:
            name, text = option(key, value, "sbatch=")
            options[name] = text
    check_with_sbatch(options, environ)
    return options


def as_arguments(options: Mapping[str, str | None]) -> list[str]:
    return [
        f"--{name}" if value is None else f"--{name}={value}" for name, value in options.items()
    ]


def slurm_config_here(environ: Mapping[str, str]) -> bool:
    """Whether sbatch would find its configuration at once: a missing $SLURM_CONF makes it
    retry for a minute, and none at all makes it ask DNS (configless Slurm)."""
    return Path(environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf").is_file()


def check_with_sbatch(options: Mapping[str, str | None], environ: Mapping[str, str]) -> None:
    """Refuse an option this cluster's sbatch does not know, in sbatch's own words (sbatch
    reads the options and stops at --version: nothing is submitted). Without sbatch and its
    configuration here (a script rendered on a laptop) nothing can be checked."""
    sbatch = shutil.which("sbatch", path=environ.get("PATH"))
    if not options or sbatch is None or not slurm_config_here(environ):
        return
    try:
        done = subprocess.run(
            [sbatch, *as_arguments(options), "--version"],
            env=dict(environ),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return
    said = [line for line in done.stderr.splitlines() if "unrecognized option" in line]
    if done.returncode != 0 and said:
        raise HpcDdpError(
            f"this cluster's sbatch refuses the job's options: {said[0]}",
            "correct the option (sbatch --help lists them) in --slurm or the site profile ("
            "slurm/site.yaml, ~/.config/hpc_ddp/site.yaml)",
        )
