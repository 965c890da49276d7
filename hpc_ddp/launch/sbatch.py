"""`hpc-ddp render`: a ready sbatch script from slurm/train.sh, the same template users submit
(installed with the package, so render works without a checkout).

The script runs the template's program: the built-in trainer with a config, or your own
script or module with its arguments.

Pure text work: :func:`render_sbatch` takes the template's text and a :class:`RenderRequest`.
Values that reach the shell are quoted with shlex; values that reach ``#SBATCH`` lines (which
sbatch parses, not the shell) must match a strict pattern, so nothing can break out of them.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.slurm import time_to_minutes

TEMPLATE_NAMES = {"srun": "train.sh", "torchrun": "train-torchrun.sh"}
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.,+-]{1,128}$")
#: A folder Slurm reads from an #SBATCH line as it is: no spaces, quotes or shell syntax.
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_.,+/-]{1,4000}$")
_PYTHON_LINE = "python=${PYTHON:-python}"
_STRICT_LINE = "set -euo pipefail"
_DEFAULT_ARGS_LINE = re.compile(r"^DEFAULT_ARGS=\(.*\)$", re.MULTILINE)
_SIGNAL_LINES = (
    re.compile(r"^(#SBATCH --signal=)[A-Z0-9]+(@\d+)$", re.MULTILINE),
    re.compile(
        r"^(export HPC_DDP_JOB_SIGNAL=\$\{HPC_DDP_JOB_SIGNAL:-)[A-Z0-9]+(\})$", re.MULTILINE
    ),
)
#: The warning signals the ranks can handle (preempt.signal).
SIGNALS = ("USR1", "USR2", "URG", "HUP", "INT", "ALRM")


@dataclass(frozen=True)
class RenderRequest:
    """What `hpc-ddp render` fills into the template."""

    #: The program's arguments as the template takes them: a config and overrides, a script
    #: and its arguments, or -m, a module and its arguments.
    arguments: tuple[str, ...]
    nodes: int = 1
    gpus_per_node: int = 1
    #: Tasks per node when gpus_per_node is 0 (CPU-only partitions).
    cpu_tasks_per_node: int = 1
    cpus_per_task: int | None = None
    time: str = "01:00:00"
    partition: str | None = None
    job_name: str | None = None
    launcher: str = "srun"
    #: Slurm's warning signal before the time limit: the one the ranks handle (preempt.signal).
    signal: str = "USR1"
    #: Where the job's log and NCCL's flight-recorder dumps go (it must exist: Slurm does not
    #: create it); relative paths are resolved against the directory sbatch is called from.
    #: None: that directory itself, as the templates have it.
    log_dir: str | None = None
    #: Any other sbatch options (name without dashes: value, None for a flag), checked by
    #: :mod:`hpc_ddp.launch.slurmoptions`; written after the time limit.
    sbatch_options: tuple[tuple[str, str | None], ...] = ()
    #: The written script's path as given: its header then says how to submit it, in place of
    #: the template's lines about slurm/train.sh. None keeps the template's header.
    script_name: str | None = None
    #: The folder the job works in (it cds there first), so that the program's relative paths
    #: hold wherever the script is submitted from. None: the folder sbatch is called from.
    workdir: str | None = None
    #: The python that runs hpc_ddp in the job unless $PYTHON names another. None: the first
    #: python on the job's PATH.
    python: str | None = None


def template_path(launcher: str = "srun") -> Path:
    """The installed template (slurm/ of a checkout links to the same files)."""
    if launcher not in TEMPLATE_NAMES:
        raise HpcDdpError(
            f"unknown launcher {launcher!r}", f"choose one of: {', '.join(TEMPLATE_NAMES)}"
        )
    return Path(__file__).resolve().parent / "templates" / TEMPLATE_NAMES[launcher]


def _check_safe(value: str, what: str, pattern: re.Pattern[str], example: str) -> str:
    if not pattern.fullmatch(value):
        raise HpcDdpError(
            f"{what}={value!r} is not accepted in an #SBATCH line",
            f"use letters, digits and . _ - only, e.g. {example}",
        )
    return value


def _check_shell_value(value: str, what: str) -> str:
    if any(char in value for char in "\n\r\0"):
        raise HpcDdpError(
            f"{what} {value!r} contains a line break or NUL", "remove it; paths are one line"
        )
    return value


def _set_directive(text: str, option: str, value: str | None, launcher: str) -> str:
    """Replace the one `#SBATCH --option=...` line (remove it when value is None)."""
    pattern = re.compile(rf"^#SBATCH --{re.escape(option)}=.*$\n", re.MULTILINE)
    matches = pattern.findall(text)
    if len(matches) != 1:
        raise HpcDdpError(
            f"the {TEMPLATE_NAMES[launcher]} template has {len(matches)} '#SBATCH --{option}=' "
            "lines; expected exactly one",
            "restore slurm/ from the repository",
        )
    replacement = (
        f"# (--{option} not requested)\n" if value is None else f"#SBATCH --{option}={value}\n"
    )
    return pattern.sub(lambda _match: replacement, text)


def _set_signal(text: str, signal: str, launcher: str) -> str:
    """The warning signal in the --signal directive and in the variable the ranks check."""
    if signal not in SIGNALS:
        raise HpcDdpError(
            f"signal={signal!r} is not a warning signal the ranks handle",
            f"choose one of: {', '.join(SIGNALS)}",
        )
    for line in _SIGNAL_LINES:
        if len(line.findall(text)) != 1:
            raise HpcDdpError(
                f"the {TEMPLATE_NAMES[launcher]} template has no single {line.pattern!r} line",
                "restore slurm/ from the repository",
            )
        text = line.sub(lambda match: f"{match.group(1)}{signal}{match.group(2)}", text)
    return text


def _directives(request: RenderRequest) -> dict[str, str | None]:
    gpus = request.gpus_per_node
    if request.launcher == "torchrun":
        return {
            "nodes": str(request.nodes),
            "gpus-per-node": str(gpus) if gpus else None,
            "time": request.time,
        }
    return {
        "nodes": str(request.nodes),
        "ntasks-per-node": str(gpus if gpus else request.cpu_tasks_per_node),
        "gpus-per-node": str(gpus) if gpus else None,
        "time": request.time,
    }


def _set_log_dir(text: str, log_dir: str) -> str:
    """The template with the job's log and NCCL's flight-recorder dumps in ``log_dir``
    instead of the directory sbatch is called from."""
    if not log_dir.strip():
        raise HpcDdpError(
            "--log-dir is empty: expected the folder for the job's log",
            "leave --log-dir out for the submission directory, or e.g. --log-dir logs",
        )
    folder = _check_safe(
        log_dir.rstrip("/") or "/", "log folder", _SAFE_PATH, "--log-dir /scratch/me/logs"
    )
    prefix = folder if folder.endswith("/") else f"{folder}/"
    text, logs = re.subn(r"^(#SBATCH --(?:output|error)=)%x", rf"\g<1>{prefix}%x", text, flags=re.M)
    default = "${HPC_DDP_LOG_DIR:-$PWD}"
    if logs == 0 or default not in text:
        raise HpcDdpError(
            f"the template has no '#SBATCH --output=%x...' line or no {default}: "
            "expected both, to move the job's log",
            "restore slurm/ from the repository, or leave --log-dir out",
        )
    return text.replace(default, f"${{HPC_DDP_LOG_DIR:-{folder}}}")


def render_sbatch(template: str, request: RenderRequest) -> str:
    """The template with the request's values in place; raises HpcDdpError on unsafe input."""
    if request.nodes < 1 or request.gpus_per_node < 0 or request.cpu_tasks_per_node < 1:
        raise HpcDdpError(
            f"nodes={request.nodes}, gpus_per_node={request.gpus_per_node}, "
            f"tasks_per_node={request.cpu_tasks_per_node}: expected nodes >= 1, GPUs >= 0, "
            "tasks >= 1",
            "e.g. --nodes 2 --gpus-per-node 4",
        )
    try:
        valid_time = time_to_minutes(request.time) > 0 and request.time == request.time.strip()
    except HpcDdpError:
        valid_time = False
    if not valid_time:
        raise HpcDdpError(
            f"time={request.time!r} is not accepted in an #SBATCH line",
            "write it as minutes, HH:MM:SS or D-HH:MM:SS, e.g. --time 02:00:00",
        )
    text = _set_signal(template, request.signal, request.launcher)
    for option, value in _directives(request).items():
        text = _set_directive(text, option, value, request.launcher)
    if request.cpus_per_task is not None:
        text = _set_directive(text, "cpus-per-task", str(request.cpus_per_task), request.launcher)
    if request.job_name is not None:
        name = _check_safe(request.job_name, "job name", _SAFE_NAME, "--job-name my-run")
        text = _set_directive(text, "job-name", name, request.launcher)
    if request.partition is not None:
        partition = _check_safe(request.partition, "partition", _SAFE_NAME, "--partition gpu")
        text = re.sub(
            r"^(#SBATCH --time=.*)$",
            lambda match: f"{match.group(1)}\n#SBATCH --partition={partition}",
            text,
            count=1,
            flags=re.MULTILINE,
        )
    if request.log_dir is not None:
        text = _set_log_dir(text, request.log_dir)
    if request.sbatch_options:
        # sbatch reads a directive's value as a shell word: one with spaces is quoted.
        lines = "".join(
            f"\n#SBATCH --{name}" + ("" if value is None else f"={shlex.quote(value)}")
            for name, value in request.sbatch_options
        )
        text = re.sub(r"^(#SBATCH --time=.*)$", lambda match: match.group(1) + lines, text,
                      count=1, flags=re.MULTILINE)  # fmt: skip
    arguments = [_check_shell_value(item, "argument") for item in request.arguments]
    if len(_DEFAULT_ARGS_LINE.findall(text)) != 1:
        raise HpcDdpError(
            "the template has no single DEFAULT_ARGS=(...) line",
            "restore slurm/ from the repository",
        )
    default_args = "DEFAULT_ARGS=(" + " ".join(shlex.quote(arg) for arg in arguments) + ")"
    text = _DEFAULT_ARGS_LINE.sub(lambda _match: default_args, text, count=1)
    if request.python is not None:
        text = _replace_once(text, _PYTHON_LINE, _python_lines(request.python))
    if request.workdir is not None:
        text = _replace_once(text, _STRICT_LINE, _workdir_lines(request.workdir))
    if request.script_name is not None:
        text = _own_header(
            text, TEMPLATE_NAMES[request.launcher], request.script_name, arguments, request.workdir
        )
    return text


def _replace_once(text: str, line: str, replacement: str) -> str:
    if text.count(f"\n{line}\n") != 1:
        raise HpcDdpError(
            f"the template has no single line {line!r}", "restore slurm/ from the repository"
        )
    return text.replace(f"\n{line}\n", f"\n{replacement}\n", 1)


def _python_lines(python: str) -> str:
    """The job's python: $PYTHON; else, when the site file was sourced (it may activate an
    environment), the first python on the PATH, as the template has it; else ``python``, the
    one the script was written with."""
    written_with = shlex.quote(_check_shell_value(python, "python"))
    return (
        "# $PYTHON; else the python of the environment slurm/site.sh activated; else the one\n"
        "# this script was written with.\n"
        "if [[ -n ${PYTHON:-} ]]; then\n"
        "    python=$PYTHON\n"
        "elif [[ -f $site_file ]]; then\n"
        "    python=python\n"
        "else\n"
        f"    python={written_with}\n"
        "fi"
    )


def _workdir_lines(workdir: str) -> str:
    folder = shlex.quote(_check_shell_value(workdir, "working folder"))
    return (
        f"{_STRICT_LINE}\n\n"
        "# The folder the script was written in: the program's relative paths (the script, its\n"
        "# configs, slurm/site.sh) are read from there, wherever the script is submitted from.\n"
        f"workdir={folder}\n"
        'if ! cd -- "$workdir"; then\n'
        '    echo "error: cannot work in $workdir, the folder this script was written in." \\\n'
        '        "HINT: write it again with hpc-ddp render in the project\'s folder" >&2\n'
        "    exit 2\n"
        "fi"
    )


def _own_header(
    text: str, template: str, script_name: str, arguments: list[str], workdir: str | None
) -> str:
    """The template's header with its usage lines (about slurm/train.sh) replaced by the
    written script's own."""
    lines = text.split("\n")
    first_directive = next(i for i, line in enumerate(lines) if line.startswith("#SBATCH "))
    blank = lines.index("#", 1)
    if blank > first_directive:
        raise HpcDdpError(
            "the template's header has no '#' line before its #SBATCH lines",
            "restore slurm/ from the repository",
        )
    name = shlex.quote(_check_shell_value(script_name, "script name"))
    program = " ".join(shlex.quote(arg) for arg in arguments) or "the built-in trainer"
    where = (
        f"# It works in {workdir}: relative paths are read from there.\n#\n"
        if workdir is not None
        else "# Relative paths are read from the folder sbatch is called from.\n#\n"
    )
    usage = [
        (f"sbatch {name}", "as written"),
        (f"sbatch --nodes=4 {name}", "sbatch's options override the directives below"),
        (f"sbatch {name} other.py --lr 1e-3", "another program, or other arguments"),
    ]
    width = max(len(command) for command, _ in usage)
    header = (
        f"# Written by hpc-ddp from its {template} template; it runs: {program}\n#\n"
        + "".join(f"#   {command:<{width}}  # {what}\n" for command, what in usage)
        + "#\n"
        + where
    )
    return "\n".join(lines[:blank]) + "\n" + header + "\n".join(lines[first_directive:])
