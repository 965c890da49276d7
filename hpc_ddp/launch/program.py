"""What every rank of a launch runs: the built-in trainer, or your own script or module.

Every launcher (``hpc-ddp local``, the sbatch and torchrun templates, submitit) starts the
same :class:`Program` on each rank; a user's program runs under ``python -m hpc_ddp run``,
which holds stop signals from its first line and ends with the documented exit codes.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import runpy
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hpc_ddp.launch.output import labelled_stdout
from hpc_ddp.launch.shipped import find_config, shipped_config_name
from hpc_ddp.runtime.errors import HpcDdpError, Stopped
from hpc_ddp.runtime.exits import rank_label, report_failure, toolkit_frame
from hpc_ddp.runtime.tracking.worker import discard_prestarted

#: The config the built-in trainer uses when a launch names none.
DEFAULT_CONFIG = "configs/digits.yaml"


def check_compiles(path: Path) -> None:
    """Refuse a script that Python cannot compile, in one line before any rank starts (each
    rank would print the same traceback)."""
    source_path = path / "__main__.py" if path.is_dir() else path
    try:
        source = source_path.read_bytes()
    except OSError as error:
        raise HpcDdpError(
            f"cannot read {source_path}: {error.strerror or error}",
            "pass a script this user can read",
        ) from None
    if source_path.suffix not in ("", ".py", ".pyw"):
        return  # a zip or another format python runs: it checks it itself
    try:
        compile(source, str(source_path), "exec", dont_inherit=True)
    except SyntaxError as error:
        text = (error.text or "").strip()
        raise HpcDdpError(
            f"{source_path}, line {error.lineno}: {error.msg}" + (f": {text[:80]}" if text else ""),
            "fix the script; `python -m py_compile " + str(source_path) + "` shows the same",
        ) from None
    except ValueError as error:  # null bytes
        raise HpcDdpError(f"{source_path}: {error}", "pass a Python script") from None


def runnable_path(path: Path) -> bool:
    """What ``python PATH`` runs: a file, or a folder (or zip) with a ``__main__.py``."""
    return path.is_file() or (path / "__main__.py").is_file()


@dataclass(frozen=True)
class Program:
    """A script (``train.py args...``), a module (``-m pkg.train args...``) or the built-in
    trainer (``name`` is its config file, ``args`` its dotted overrides)."""

    kind: Literal["builtin", "script", "module"]
    #: The script's path, the module's name, or the built-in trainer's config file ("": its
    #: defaults).
    name: str
    args: tuple[str, ...] = ()

    def python_args(self) -> list[str]:
        """What follows ``python`` to start it on one rank."""
        if self.kind == "builtin":
            config = ["--config", self.name] if self.name else []
            return ["-m", "hpc_ddp.train", *config, *self.args]
        return ["-m", "hpc_ddp", "run", *self.template_args()]

    def template_args(self) -> list[str]:
        """The arguments ``slurm/train.sh`` takes for it: a .yaml first means the built-in
        trainer, ``-m`` a module, anything else a script."""
        if self.kind == "module":
            return ["-m", self.name, *self.args]
        return [self.name, *self.args] if self.name else list(self.args)

    def check(self) -> None:
        """Refuse a script that does not exist or a module that cannot be found, here rather
        than on every rank after the job started."""
        if self.kind == "script" and not runnable_path(Path(self.name)):
            shipped = shipped_config_name(self.name)
            raise HpcDdpError(
                f"script {self.name!r} does not exist (looked in {os.getcwd()})",
                f"for the built-in trainer's shipped config, --config {shipped}"
                if shipped
                else "pass the path of your training script, relative to the directory you "
                "launch from, or -m package.module for a module",
            )
        if self.kind == "script":
            check_compiles(Path(self.name))
        if self.kind == "module":
            check_module_runs(self.name, Path.cwd())
        if self.kind == "builtin" and self.name:
            find_config(self.name, Path.cwd())

    def __str__(self) -> str:
        return " ".join(self.template_args())


def check_module_runs(name: str, cwd: Path) -> None:
    """Refuses a module ``python -m NAME`` started in ``cwd`` could not run: not found (as
    ``python -m`` looks: ``cwd`` first, then this Python's path), or a package without a
    ``__main__`` module."""
    added = str(cwd) not in sys.path
    if added:
        sys.path.insert(0, str(cwd))
    try:
        spec = importlib.util.find_spec(name)
        runs = spec is None or spec.submodule_search_locations is None
        if not runs and spec is not None:  # found without importing the package
            inside = list(spec.submodule_search_locations or [])
            runs = importlib.machinery.PathFinder.find_spec("__main__", inside) is not None
    except (ImportError, ValueError):
        spec, runs = None, False
    finally:
        if added:
            sys.path.remove(str(cwd))
    if spec is None:
        raise HpcDdpError(
            f"module {name!r} cannot be found by this Python ({sys.executable}) from {cwd}",
            "install the package that holds it into this environment, or add its "
            "directory to PYTHONPATH",
        )
    if not runs:
        raise HpcDdpError(
            f"module {name!r} is a package without a __main__ module: python -m cannot run it",
            f"name the module that trains (-m {name}.train), or add {name}/__main__.py",
        )


_SETTING_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*")


def is_setting(text: str) -> bool:
    """Whether a launcher's first word is a dotted setting rather than a program: it reads
    ``section.key=value`` and no file or folder of that name exists (``lr=0.1.py`` or
    ``exp=1/train`` that exist are programs). The job templates apply the same rule."""
    key, equals, _value = text.partition("=")
    return bool(equals) and bool(_SETTING_KEY.fullmatch(key)) and not os.path.lexists(text)


def program_from(
    arguments: Sequence[str],
    *,
    module: bool = False,
    config: str | None = None,
    default_config: str = "",
) -> Program:
    """Read a launcher's command line: ``[-m] TARGET [ARGS...]``, or ``--config C [overrides]``
    / ``C.yaml [overrides]`` / overrides alone (``default_config``; "": the built-in
    defaults) for the built-in trainer."""
    first, rest = (arguments[0], tuple(arguments[1:])) if arguments else (None, ())
    if module:
        if first is None:
            raise HpcDdpError("-m needs a module name", "e.g. -m mypkg.train --lr 3e-4")
        return Program("module", first, rest)
    if config is not None:
        return Program("builtin", config, tuple(arguments))
    if first is None or is_setting(first):
        return Program("builtin", default_config, tuple(arguments))
    if first.endswith((".yaml", ".yml")):
        return Program("builtin", first, rest)
    return Program("script", first, rest)


def run_program(program: Program) -> int:
    """Run a user's script or module in this process as ``__main__`` and return the exit
    code: theirs, or the documented one for what ended it (README: the exit codes)."""
    try:
        return _run_program(program)
    finally:
        discard_prestarted()  # a tracking process the program's run never took


def _run_program(program: Program) -> int:
    program.check()
    sys.argv = [program.name, *program.args]

    def body() -> None:
        if program.kind == "script":
            path = Path(program.name).resolve()
            sys.path.insert(0, str(path if path.is_dir() else path.parent))  # as python does
            runpy.run_path(program.name, run_name="__main__")
        else:
            sys.path.insert(0, os.getcwd())  # as python -m does
            runpy.run_module(program.name, run_name="__main__", alter_sys=True)

    return exit_code_of(body)


def exit_code_of(body: Callable[[], object]) -> int:
    """Run a user's code (``body``) with its output labelled by rank, as ``hpc-ddp run``
    runs a script; return its exit code: theirs, or the documented one for what ended it."""
    sys.stdout = labelled_stdout(sys.stdout, os.environ)
    try:
        body()
    except Stopped as stopped:
        return int(stopped.code or 0)
    except SystemExit as exiting:
        if exiting.code is None or isinstance(exiting.code, int):
            return int(exiting.code or 0)
        print(exiting.code, file=sys.stderr)
        return 1
    except (Exception, KeyboardInterrupt) as error:
        started = sys.modules.get("hpc_ddp.runtime.session.ending")
        if started is not None:
            started.end_active_run(error)
        return report_failure(error, rank_label(os.environ), toolkit_frame)
    return 0
