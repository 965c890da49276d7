"""``--snapshot`` of render, submit and sweep submit: a copy of the code taken when the job is
made, which the job runs. A requeued job otherwise runs whatever is on disk when it starts
again; with a snapshot every attempt runs the code that was submitted.

In a git checkout the copy holds the files git knows of or would add (tracked ones as they
are on disk now, with their uncommitted changes, and untracked ones not ignored); outside
one, the script's folder. Either is refused above :data:`MAX_BYTES`: data belongs elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from hpc_ddp.launch.program import Program
from hpc_ddp.runtime.errors import HpcDdpError

#: The --snapshot option's help, the same for render, submit and sweep submit.
SNAPSHOT_HELP = (
    "copy your script's code now (its git checkout's files as they are on disk, or its "
    "folder) and run that copy, so every requeued attempt runs the code submitted"
)
#: The most a snapshot may copy.
MAX_BYTES = 200 * 1024 * 1024
#: Folders a copy of a script's folder leaves out.
SKIPPED = {"__pycache__", ".git", "runs", "logs", "mlruns", "mlartifacts", ".venv"}
#: How long one git command may take (a slow shared file system).
GIT_TIMEOUT_S = 60


def _checkout_root(folder: Path) -> Path | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "--show-toplevel"],
            capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return Path(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip() else None


def _git_files(root: Path) -> Iterator[Path]:
    """The checkout's files git tracks or would add, as they are on disk now."""
    done = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, timeout=GIT_TIMEOUT_S, check=True,
    )  # fmt: skip
    for name in sorted(set(done.stdout.decode().split("\0"))):
        path = root / name
        if name and path.is_file():  # a tracked file deleted on disk is not copied
            yield Path(name)


def _folder_files(root: Path) -> Iterator[Path]:
    for folder, folders, files in os.walk(root):
        folders[:] = sorted(name for name in folders if name not in SKIPPED)
        for name in sorted(files):
            yield (Path(folder) / name).relative_to(root)


def take_snapshot(program: Program, into: Path, hint: str) -> Program:
    """Copy the code ``program`` runs into a new folder under ``into``; the same program,
    started from that copy. ``hint``: how to name a folder that can be written."""
    from hpc_ddp.runtime.tracking.provenance import SNAPSHOT_FILE, code_of  # imports torch

    if program.kind != "script":
        raise HpcDdpError(
            f"--snapshot copies a script's code, and this job runs {program}",
            "start your code as a script (train.py ...), or leave --snapshot out",
        )
    script = Path(program.name).resolve()
    root = _checkout_root(script.parent)
    files = list(_git_files(root) if root else _folder_files(script.parent))
    root = root or script.parent
    if script.relative_to(root) not in files:  # a script git ignores is copied all the same
        files.append(script.relative_to(root))
    size = sum((root / name).stat().st_size for name in files)
    if size > MAX_BYTES:
        raise HpcDdpError(
            f"--snapshot would copy {size / 2**20:.0f} MiB from {root} (at most "
            f"{MAX_BYTES // 2**20} MiB)",
            "keep data out of the code's folder (or git-ignore it), or leave --snapshot out",
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    copy = into / f"{script.stem}-{stamp}-{os.getpid()}"
    source = {"source": str(root), **code_of(script), "taken_at": stamp}
    try:
        for name in files:
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, copy / name)
        (copy / SNAPSHOT_FILE).write_text(json.dumps(source, indent=1) + "\n")
    except OSError as error:
        raise HpcDdpError(
            f"cannot copy the code into {copy}: {error.strerror or error}", hint
        ) from None
    return Program("script", str(copy / script.relative_to(root)), program.args)


def take_snapshot_saying(program: Program, into: Path, hint: str) -> Program:
    """:func:`take_snapshot`, said in one line."""
    copied = take_snapshot(program, into, hint)
    print(f"copied the code into {Path(copied.name).parent}: every attempt of the job runs "
          "that copy", file=sys.stderr)  # fmt: skip
    return copied


def snapshot_if_asked(asked: bool, program: Program, into: Path, hint: str) -> Program:
    """``program`` started from a snapshot under ``into`` when ``asked``, said in one line."""
    return take_snapshot_saying(program, into, hint) if asked else program
