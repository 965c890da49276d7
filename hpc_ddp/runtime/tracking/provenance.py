"""What code and environment each attempt of a run ran (``provenance.json`` in the run
directory, rank 0's): the script and its sha256, the git commit of its checkout, whether the
tree was dirty and its diff's hash, the versions of Python, torch, CUDA, NCCL and hpc_ddp,
and the installed packages. A resumed attempt whose code or environment differs from the
attempt before it says what changed in one warning, or is refused (``run.on_code_change``):
a requeued job runs whatever is on disk when it starts again."""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.place.dist import broadcast_object
from hpc_ddp.runtime.safefiles import read_records, write_records
from hpc_ddp.runtime.tracking.journal import PROVENANCE_FILE

#: Where the run directory keeps each attempt's code and environment.
RECORD = PROVENANCE_FILE
#: How long one git command may take (a slow shared file system).
GIT_TIMEOUT_S = 10.0
#: What a resume compares, with the words for it.
COMPARED = {
    "script": "the script",
    "script_sha256": "the script's contents (sha256)",
    "git_commit": "the git commit",
    "git_diff_sha256": "the uncommitted changes (sha256 of git diff HEAD)",
    "python": "Python",
    "torch": "torch",
    "cuda": "CUDA",
    "nccl": "NCCL",
    "hpc_ddp": "hpc_ddp",
}
#: Changed files or packages named in the warning; the rest are counted.
NAMED = 5


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _git(directory: Path, *words: str) -> str | None:
    """git's output in ``directory``, or None (no git, not a checkout, too slow)."""
    try:
        done = subprocess.run(["git", "-C", str(directory), *words], capture_output=True,
                              text=True, timeout=GIT_TIMEOUT_S, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def running_script() -> Path | None:
    """The file of the program this process runs (a script, a module's file)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return Path(path).resolve() if path else None


def code_of(script: Path | None) -> dict[str, Any]:
    """The script, its sha256, and the git state of the checkout it is in."""
    try:
        digest = _sha256(script.read_bytes()) if script else None
    except OSError:
        digest = None
    directory = script.parent if script else Path.cwd()
    commit = (_git(directory, "rev-parse", "HEAD") or "").strip() or None
    diff = _git(directory, "diff", "HEAD") if commit else None
    return {"script": str(script) if script else None, "script_sha256": digest,
            "git_commit": commit, "git_dirty": bool(diff), "git_diff_sha256":
            _sha256(diff.encode()) if diff else None}  # fmt: skip


def environment_of() -> dict[str, Any]:
    """The versions that decide what a step computes, and every installed package."""
    packages = sorted(
        f"{dist.metadata['Name']}=={dist.version}" for dist in importlib.metadata.distributions()
    )
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except (RuntimeError, AttributeError):
        nccl = None
    try:
        own = importlib.metadata.version("hpc_ddp")
    except importlib.metadata.PackageNotFoundError:
        own = None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": nccl, "hpc_ddp": own,
            "packages": packages}  # fmt: skip


def _named(items: Sequence[str]) -> str:
    more = f" and {len(items) - NAMED} more" if len(items) > NAMED else ""
    return ", ".join(items[:NAMED]) + more


def what_changed(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """One phrase per difference between two attempts' records."""
    changes = [
        f"{words}: {before.get(key)} -> {now.get(key)}"
        for key, words in COMPARED.items()
        if before.get(key) != now.get(key)
    ]
    old, new = set(before.get("packages", [])), set(now.get("packages", []))
    if old != new:
        changes.append(f"packages: {_named(sorted(new - old))} installed, "
                       f"{_named(sorted(old - new))} gone")  # fmt: skip
    return changes


def _changed_files(before: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """The files two commits of the script's checkout differ in, named."""
    script, old, new = now.get("script"), before.get("git_commit"), now.get("git_commit")
    if not (script and old and new and old != new):
        return ""
    files = _git(Path(script).parent, "diff", "--name-only", old, new) or ""
    return f" (files: {_named(files.split())})" if files.split() else ""


def check_code(
    run_dir: Path, now: Mapping[str, Any], resumed: bool, on_change: str
) -> HpcDdpError | None:
    """Rank 0: compare this attempt with the one before when it resumes, and record it; the
    refusal under ``run.on_code_change=refuse``."""
    earlier = read_records(run_dir / RECORD, "python")
    changes = what_changed(earlier[-1], now) if resumed and earlier else []
    if changes:
        message = (
            "this attempt resumes a run whose last attempt ran other code or another "
            "environment: " + "; ".join(changes) + _changed_files(earlier[-1], now)
        )
        if on_change == "refuse":
            return HpcDdpError(
                message,
                f"put the code back as it was (git checkout {earlier[-1].get('git_commit')}, "
                f"the same environment), or set run.on_code_change=warn; {run_dir / RECORD} "
                "lists each attempt",
            )
        get_logger().warning(f"{message} (run.on_code_change=refuse refuses this)")
    try:
        write_records(run_dir / RECORD, [*earlier, dict(now)])
    except OSError as error:
        get_logger().warning(f"{run_dir / RECORD} cannot be written: {error}")
    return None


def agree_on_code(
    run_dir: Path,
    is_main: bool,
    resumed: bool,
    on_change: str,
    environ: Mapping[str, str],
    group: Any | None,
) -> None:
    """Every rank: rank 0 records this attempt's code and environment, and every rank ends
    when rank 0 refuses the change."""
    refusal = None
    if is_main:
        record = {**code_of(running_script()), **environment_of(),
                  "job": environ.get("SLURM_JOB_ID"), "at_unix": round(time.time(), 3)}  # fmt: skip
        refusal = check_code(run_dir, record, resumed, on_change)
    refusal = broadcast_object(refusal, group)
    if refusal is not None:
        raise refusal
