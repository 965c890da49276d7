""":func:`spawn`: a drop-in for ``torch.multiprocessing.spawn(main, args, nprocs)``.

The classic DDP script starts its ranks itself::

    if __name__ == "__main__":
        mp.spawn(main, args=(world_size,), nprocs=world_size)

With ``hpc_ddp.spawn`` in its place (and ``hpc_ddp.start()`` inside ``main`` instead of
``init_process_group``) the same script runs under every launcher: started by plain
``python`` it starts ``nprocs`` local ranks as ``hpc-ddp local`` does (same supervisor, same
environment: each rank runs the script again and calls ``main(rank, *args)``); under a
launcher that already made one process per rank (``srun``, torchrun, ``hpc-ddp local``,
submitit) it calls ``main(rank, *args)`` in this process and ``nprocs`` is the launcher's.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from hpc_ddp.launch.program import Program
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.exits import rank_label
from hpc_ddp.runtime.place.env import detect_launcher
from hpc_ddp.runtime.place.plan import SPAWN_NPROCS_VAR

__all__ = ["spawn"]

#: Set in the ranks :func:`spawn` starts: they end after ``main``, as mp.spawn's children do.
SPAWNED_VAR = "HPC_DDP_SPAWNED"


def this_program(argv: list[str], main_module: Any) -> Program:
    """The program this process runs, to start it again on each rank: the module it was
    started as (``python -m pkg.train``), else the script."""
    spec = getattr(main_module, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return Program("module", spec.name.removesuffix(".__main__"), tuple(argv[1:]))
    return Program("script", argv[0], tuple(argv[1:]))


def check_call(fn: object, args: object, join: object) -> None:
    """Refuses what ``mp.spawn`` would fail on later, in a child: ``fn`` not callable,
    ``args`` not a tuple or not fitting ``fn(rank, *args)``, ``join=False``."""
    if not callable(fn):
        raise HpcDdpError(
            f"hpc_ddp.spawn({fn!r}, ...): the first argument is a {type(fn).__name__}, "
            "expected the function each rank runs",
            "pass the function itself: hpc_ddp.spawn(main, args=(...), nprocs=N)",
        )
    if not isinstance(args, tuple):
        raise HpcDdpError(
            f"hpc_ddp.spawn(..., args={args!r}): args is a {type(args).__name__}, expected a "
            "tuple (each rank calls fn(rank, *args))",
            f"args=({args!r},) for a single argument",
        )
    try:
        inspect.signature(fn).bind(0, *args)
    except TypeError as mismatch:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise HpcDdpError(
            f"hpc_ddp.spawn({name}, args={args!r}): each rank calls {name}(rank, *args), "
            f"which does not fit its parameters ({mismatch})",
            f"take the rank first, as with mp.spawn: def {name}(rank, ...)",
        ) from None
    except ValueError:  # a builtin without a signature: its call says what is wrong
        pass
    if join is not True:
        raise HpcDdpError(
            f"hpc_ddp.spawn(..., join={join!r}): the ranks run to their end before it returns",
            "leave join out (its default, True); code after the call runs once they ended",
        )


def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
    *,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Run ``fn(rank, *args)`` on every rank (see the module docstring). Call it from the
    script's ``if __name__ == "__main__":`` block, as with ``mp.spawn``. In a rank it
    started, the process ends after ``fn`` returns; a failed rank ends the launch with its
    exit code (SystemExit), the others stopped. ``join``, ``daemon`` and ``start_method``
    are mp.spawn's, taken so that a call keeps its words: every rank is a fresh process run
    to its end (``join=False`` is refused: there is no process context to return)."""
    from hpc_ddp.runtime.session.ending import install_excepthook

    install_excepthook()  # a refusal here is one line, as hpc_ddp.start()'s are
    check_call(fn, args, join)
    del daemon, start_method  # each rank is a fresh interpreter: neither applies
    environment = os.environ if environ is None else environ
    if detect_launcher(environment) != "single":
        if environ is None:  # for start() to compare with the launcher's world
            os.environ[SPAWN_NPROCS_VAR] = str(nprocs)
        try:
            fn(int(rank_label(environment)), *args)
        finally:
            os.environ.pop(SPAWN_NPROCS_VAR, None)
        if environment.get(SPAWNED_VAR):
            sys.exit(0)
        return
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise HpcDdpError(
            f"hpc_ddp.spawn(..., nprocs={nprocs!r}): the number of ranks must be an integer >= 1",
            "e.g. nprocs=2 (torch.cuda.device_count() on a GPU node)",
        )
    from hpc_ddp.launch.local import launch_local

    program = this_program(sys.argv, sys.modules["__main__"])
    code = launch_local(nprocs, program, {**environment, SPAWNED_VAR: "1"})
    if code:
        sys.exit(code)
