"""A sweep of a Python callable: ``hpc_ddp.submit_sweep(train, grid={"lr": [...]})``.

Every task calls ``train(**kwargs, lr=...)`` on each of its ranks, in the array task's own
process, as submitit's ``map_array`` calls a function per task. The callable travels as
``<sweep>/program.pkl`` (cloudpickle, as submitit sends one: a function of ``__main__`` by
value, one of an importable module by reference); the task's keyword arguments are its
option keys without their dashes (``--lr`` -> ``lr``), their values read back as JSON
scalars (numbers, true/false, null), else kept as text. Rank 0's return value is kept in
the task's run directory as ``result.pkl`` (``Sweep.results()``).
"""

from __future__ import annotations

import inspect
import json
import math
import pickle
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.safefiles import replace_bytes
from hpc_ddp.sweep.spec import Settings, describe

PROGRAM_FILE = "program.pkl"
RESULT_FILE = "result.pkl"


@dataclass(frozen=True)
class CallableProgram:
    """What every task of a callable's sweep calls: ``function(**kwargs, **its own)``."""

    function: Callable[..., Any]
    #: Keyword arguments every task passes (the sweep's own ones are added to them).
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    kind: Literal["callable"] = "callable"
    #: A callable has no command line (kept so that it reads like a script's Program).
    args: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        module = getattr(self.function, "__module__", None) or "?"
        return f"{module}.{getattr(self.function, '__qualname__', type(self.function).__name__)}"

    def check(self) -> None:
        """Nothing to look up: :func:`pickled` refuses what cannot travel."""


#: Python's own spellings of the floats JSON has no words for.
_FLOAT_WORDS = ("inf", "-inf", "nan")


def value_of(text: str) -> Any:
    """A task's value as the callable receives it: a JSON scalar where the text is one
    (``inf``, ``-inf`` and ``nan`` too), else the text."""
    if text in _FLOAT_WORDS:
        return float(text)
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if value is None or isinstance(value, bool | int | float | str) else text


def argument_text(value: Any) -> Any:
    """A value given in Python for a callable, as text that :func:`value_of` reads back as
    the same value (a string that would read as a number is quoted); other values as they
    are, for the sweep's own checks."""
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, str) and value_of(value) != value:
        return json.dumps(value)
    return value


def keyword_arguments(settings: Settings) -> dict[str, Any]:
    """The keyword arguments of a task's option keys: ``--lr`` / ``--batch-size`` give
    ``lr`` / ``batch_size``."""
    return {
        key.lstrip("-").replace("-", "_"): value_of(value)
        for key, value in settings.items()
        if key.startswith("-")
    }


def check_calls(
    program: CallableProgram, tasks: Sequence[Settings], overriding: bool = False
) -> None:
    """Refuse, before anything is queued, a task whose arguments the callable cannot take
    (``overriding``: a resume's, which may replace what ``kwargs=`` gave)."""
    try:
        signature = inspect.signature(program.function)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the call itself says
    for index, settings in enumerate(tasks):
        arguments = keyword_arguments(settings)
        shared = sorted(set(arguments) & set(program.kwargs))
        if shared and not overriding:
            raise HpcDdpError(
                f"the sweep sets {', '.join(shared)}, which kwargs= also sets",
                "set each argument in one place: the sweep or kwargs=",
            )
        try:
            signature.bind(**{**program.kwargs, **arguments})
        except TypeError as error:
            raise HpcDdpError(
                f"task {index} ({describe(settings)}) cannot call "
                f"{program.name}{_plain(signature)}: {error}",
                "sweep the callable's own keyword arguments (grid={'lr': [...]}); hpc_ddp "
                "settings take their dots (run.seed)",
            ) from None


def _plain(signature: inspect.Signature) -> inspect.Signature:
    """The signature without its annotations: ``train(lr, width=8, *, steps)``."""
    empty = inspect.Parameter.empty
    parameters = [
        parameter.replace(annotation=empty) for parameter in signature.parameters.values()
    ]
    return signature.replace(parameters=parameters, return_annotation=empty)


def pickled(program: CallableProgram) -> bytes:
    import cloudpickle

    code = getattr(program.function, "__code__", None)
    source = code.co_filename if isinstance(code, types.CodeType) else None
    try:
        return bytes(cloudpickle.dumps((program.function, dict(program.kwargs), source)))
    except Exception as error:
        raise HpcDdpError(
            f"cannot send {program.name} and its kwargs to the tasks: they cannot be pickled "
            f"({type(error).__name__}: {error})",
            "sweep a function defined at module level whose kwargs are plain data (no open "
            "files, locks, sockets or process groups)",
        ) from None


def write_program(sweep_dir: Path, data: bytes) -> None:
    replace_bytes(sweep_dir / PROGRAM_FILE, data)


def load_program(sweep_dir: Path) -> CallableProgram:
    """The callable a sweep's tasks call, as it was submitted."""
    try:
        function, kwargs, source = pickle.loads((sweep_dir / PROGRAM_FILE).read_bytes())
    except FileNotFoundError:
        raise HpcDdpError(
            f"{sweep_dir / PROGRAM_FILE} is missing: the sweep's callable is gone",
            "submit the sweep again",
        ) from None
    except Exception as error:  # its module cannot be imported here
        raise HpcDdpError(
            f"cannot load the sweep's callable from {sweep_dir / PROGRAM_FILE} "
            f"({type(error).__name__}: {error})",
            "run this from the folder the sweep was submitted from, in the same environment",
        ) from None
    if source:
        restore_file_names(function, source)
    return CallableProgram(function, kwargs)


#: What cloudpickle (3.1.3 on) names the file of code it sends by value.
DYNAMIC_CODE = "<dynamic-code>"


def restore_file_names(function: Callable[..., Any], source: str) -> None:
    """Give the code that cloudpickle sent by value its file back: ``function`` and what
    its module defines beside it (the functions and classes it uses), so that a traceback
    shows the user's file, lines and source, not ``<dynamic-code>``."""
    module = getattr(function, "__module__", None)
    seen: set[int] = set()

    def restore(value: Any) -> None:
        if id(value) in seen or getattr(value, "__module__", None) != module:
            return
        seen.add(id(value))
        if isinstance(value, types.FunctionType):
            value.__code__ = _with_file(value.__code__, source)
        elif isinstance(value, type):
            for member in vars(value).values():
                restore(
                    member.__func__ if isinstance(member, classmethod | staticmethod) else member
                )

    restore(function)
    for value in getattr(function, "__globals__", {}).values():
        restore(value)


def _with_file(code: types.CodeType, source: str) -> types.CodeType:
    constants = tuple(
        _with_file(constant, source) if isinstance(constant, types.CodeType) else constant
        for constant in code.co_consts
    )
    named = source if code.co_filename == DYNAMIC_CODE else code.co_filename
    return code.replace(co_filename=named, co_consts=constants)


def call_task(sweep_dir: Path, settings: Settings, run_dir: Path, is_main: bool) -> int:
    """Call the sweep's callable with this task's arguments; its exit code as a script's
    would be. Rank 0 keeps a return value other than None in ``run_dir/result.pkl``."""
    from hpc_ddp.launch.program import exit_code_of

    program = load_program(sweep_dir)
    sys.argv = [getattr(program.function, "__name__", "sweep-task")]  # the run's default name
    returned: list[Any] = []

    def body() -> None:
        # A resume's --set may replace a value kwargs= gave: the task's own wins.
        returned.append(program.function(**{**program.kwargs, **keyword_arguments(settings)}))

    code = exit_code_of(body)
    if code == 0 and is_main and returned and returned[0] is not None:
        import cloudpickle

        run_dir.mkdir(parents=True, exist_ok=True)
        replace_bytes(run_dir / RESULT_FILE, cloudpickle.dumps(returned[0]))
    return code


def forget_result(run_dir: Path) -> None:
    """Remove an earlier attempt's return value as a new attempt starts."""
    (run_dir / RESULT_FILE).unlink(missing_ok=True)


def read_result(run_dir: Path) -> Any:
    """A task's return value (None: it returned None or left none)."""
    try:
        return pickle.loads((run_dir / RESULT_FILE).read_bytes())
    except FileNotFoundError:
        return None
    except Exception as error:  # its classes cannot be imported here, or a torn file
        raise HpcDdpError(
            f"cannot read {run_dir / RESULT_FILE} ({type(error).__name__}: {error})",
            "read results in the environment the sweep ran in (the same packages)",
        ) from None
