"""What code and environment each attempt of a run ran (``provenance.json`` in the run
directory, rank 0's): the script and its sha256, the git commit of its checkout, whether the
tree was dirty and its diff's hash, the versions of Python, torch, CUDA, NCCL and hpc_ddp,
and the installed packages. A resumed attempt whose code or environment differs from the
attempt before it says what changed in one warning, or is refused (``run.on_code_change``):
a requeued job runs whatever is on disk when it starts again."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.place.dist import broadcast_object
from hpc_ddp.runtime.place.slurm import queue_job_id
from hpc_ddp.runtime.safefiles import read_records, write_records
from hpc_ddp.runtime.tracking.record import PROVENANCE_FILE

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
#: What a snapshot of the code (render/submit --snapshot) says of its source, at its root.
SNAPSHOT_FILE = "hpc-ddp-snapshot.json"
#: The largest uncommitted diff kept whole as a run artifact (its hash is always kept).
MAX_DIFF_CHARS = 200_000
#: The record's fields MLflow shows as tags (``hpc_ddp.code.*``, ``hpc_ddp.env.*``).
CODE_TAGS = ("script_sha256", "git_dirty", "git_diff_sha256")
ENVIRONMENT_TAGS = ("python", "torch", "cuda", "nccl", "hpc_ddp")


@dataclass(frozen=True)
class AttemptCode:
    """Rank 0's record of this attempt's code and environment, for the run's tracker."""

    record: Mapping[str, Any]
    #: The uncommitted changes (``git diff HEAD``) when small enough to keep, else None.
    diff: str | None
    #: This attempt's place among the run's attempts in provenance.json (0 for the first).
    index: int

    def tags(self) -> dict[str, str]:
        """MLflow tags: its own source tags (the UI shows them), then the script's hash, the
        tree's state and the versions, and one hash of the installed packages. An unknown
        value is an empty tag: MLflow keeps a tag an earlier attempt set until it is
        written again."""
        record = self.record
        tags = {"mlflow.source.name": record.get("script"),
                "mlflow.source.git.commit": record.get("git_commit"),
                **{f"hpc_ddp.code.{key}": record.get(key) for key in CODE_TAGS},
                **{f"hpc_ddp.env.{key}": record.get(key) for key in ENVIRONMENT_TAGS},
                "hpc_ddp.env.packages_sha256": _sha256(
                    "\n".join(record.get("packages", [])).encode())}  # fmt: skip
        return {
            key: ""
            if value is None
            else str(value).lower()
            if isinstance(value, bool)
            else str(value)
            for key, value in tags.items()
        }

    def artifacts(self) -> dict[str, str]:
        """Run artifacts: the installed packages, and the uncommitted diff when kept."""
        folder = f"provenance/attempt-{self.index}"
        files = {
            f"{folder}/packages.txt": "".join(
                f"{line}\n" for line in self.record.get("packages", [])
            )
        }
        if self.diff:
            files[f"{folder}/git.diff"] = self.diff
        return files


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
    return code_and_diff(script)[0]


def code_and_diff(script: Path | None) -> tuple[dict[str, Any], str | None]:
    """:func:`code_of`, and the uncommitted changes it hashed (None for a clean tree)."""
    try:
        digest = _sha256(script.read_bytes()) if script else None
    except OSError:
        digest = None
    # A copy taken at submission (often under the checkout's logs/): the checkout's state
    # when it was taken, not the checkout's now.
    source = snapshot_source(script) if script else None
    if source is not None:
        return {"script": str(script), "script_sha256": digest, **source}, None
    # The script's checkout, else the one it is started from (the built-in trainer's code
    # is installed; its configs are the launching checkout's).
    directory = script.parent if script else Path.cwd()
    commit = (_git(directory, "rev-parse", "HEAD") or "").strip() or None
    if commit is None and directory != Path.cwd():
        directory = Path.cwd()
        commit = (_git(directory, "rev-parse", "HEAD") or "").strip() or None
    diff = _git(directory, "diff", "HEAD") if commit else None
    return {"script": str(script) if script else None, "script_sha256": digest,
            "git_commit": commit, "git_dirty": bool(diff), "git_diff_sha256":
            _sha256(diff.encode()) if diff else None}, diff or None  # fmt: skip


def snapshot_source(script: Path) -> dict[str, Any] | None:
    """The git state a snapshot holding ``script`` was taken from (its SNAPSHOT_FILE), and
    the snapshot's folder; None outside a snapshot."""
    for folder in script.parents:
        marker = folder / SNAPSHOT_FILE
        if marker.is_file():
            try:
                taken = json.loads(marker.read_text())
            except (OSError, ValueError):
                return None
            keys = ("git_commit", "git_dirty", "git_diff_sha256")
            return {**{key: taken.get(key) for key in keys}, "snapshot": str(folder)}
    return None


def environment_of() -> dict[str, Any]:
    """The versions that decide what a step computes, and every installed package."""
    import torch

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
    run_dir: Path,
    earlier: Sequence[Mapping[str, Any]],
    now: Mapping[str, Any],
    resumed: bool,
    on_change: str,
) -> HpcDdpError | None:
    """Rank 0: compare this attempt with the one before (``earlier``: the attempts recorded
    so far) when it resumes, and record it; the refusal under ``run.on_code_change=refuse``."""
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
) -> AttemptCode | None:
    """Every rank: rank 0 records this attempt's code and environment (and returns it; the
    other ranks None), and every rank ends when rank 0 refuses the change."""
    refusal, attempt = None, None
    if is_main:
        code, diff = code_and_diff(running_script())
        record = {**code, **environment_of(),
                  "job": queue_job_id(environ), "at_unix": round(time.time(), 3)}  # fmt: skip
        earlier = read_records(run_dir / RECORD, "python")
        refusal = check_code(run_dir, earlier, record, resumed, on_change)
        kept = diff if diff is not None and len(diff) <= MAX_DIFF_CHARS else None
        attempt = AttemptCode(record, kept, len(earlier))
    refusal = broadcast_object(refusal, group)
    if refusal is not None:
        raise refusal
    return attempt
