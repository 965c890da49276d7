"""Atomic checkpoint files in <run dir>/checkpoints: write, keep the last K, load the newest
good one.

A checkpoint is written to a temporary file in the same directory, flushed and fsynced, then
renamed over its final name (and the directory fsynced), so a kill at any moment leaves every
earlier checkpoint loadable. Files hold only tensors and plain data: they load with
``torch.load(weights_only=True)``. What goes into one is
:mod:`hpc_ddp.runtime.checkpoint.state`'s job.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from hpc_ddp.runtime.checkpoint.sharded.layout import METADATA, is_complete
from hpc_ddp.runtime.checkpoint.sharded.reading import load_run
from hpc_ddp.runtime.errors import HpcDdpError, error_line
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.safefiles import DIR_MODE, create_temporary, make_dirs

FORMAT_VERSION = 2
#: Where unreadable checkpoints are moved, inside the checkpoints folder.
UNREADABLE_DIR = "unreadable"
#: Where a run started with checkpoint.resume=false moves the checkpoints it replaces.
SUPERSEDED_DIR = "superseded"
#: A pruned folder's name while it is removed (out of every list at once).
PRUNED_PREFIX = ".pruned-"
#: A checkpoint's path and its contents.
Found = tuple[Path, dict[str, Any]]
_NAME = re.compile(r"^step-(\d{9})(\.pt)?$")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def saved_world_size(saved: Mapping[str, Any]) -> int:
    """How many ranks wrote a checkpoint (older ones say it by their random streams)."""
    return int(saved.get("world_size", len(saved["rng"])))


def checkpoint_step(path: Path) -> int:
    """The step in a checkpoint's name (``step-000000120/`` or ``step-000000120.pt``: 120)."""
    matched = _NAME.match(path.name)
    if matched is None:
        raise ValueError(f"not a checkpoint's name: {path.name}")
    return int(matched.group(1))


def prepare_checkpoint_dir(run_dir: Path) -> Path:
    """Create ``<run dir>/checkpoints`` up front, so that a path that cannot hold them (a
    file, a dangling or looping link, no write permission) is named at the start, not at
    the first save."""
    directory = checkpoint_dir(run_dir)
    try:
        directory.mkdir(mode=DIR_MODE, exist_ok=True)
    except OSError as error:
        kind = "a link that leads nowhere" if directory.is_symlink() else "not a directory"
        reason = kind if isinstance(error, FileExistsError) else error.strerror or str(error)
        raise HpcDdpError(
            f"{directory} cannot hold checkpoints: {reason}",
            "remove or rename it (hpc_ddp writes this run's checkpoints there), or give the "
            "run another run.id",
        ) from None
    if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
        kind = "not a directory" if not directory.is_dir() else "not writable by this user"
        raise HpcDdpError(
            f"{directory} cannot hold checkpoints: {kind}",
            "remove it or make it writable, or give the run another run.id",
        )
    return directory


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in ``directory``, newest (highest step) first: whole folders (with
    ``.metadata``) and single files; at one step the folder comes first."""
    if not directory.is_dir():
        return []
    # is_file, not "not a folder": a folder another rank removes as this one lists (a save
    # that failed) must not count as a single-file checkpoint once it is gone.
    found = [
        path
        for path in directory.iterdir()
        if _NAME.match(path.name) and (is_complete(path) or path.is_file())
    ]
    return sorted(found, key=lambda path: (checkpoint_step(path), path.is_dir()), reverse=True)


def prune_older(directory: Path, step: int, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints up to ``step`` (the one just written).
    Only checkpoints before it count: one numbered above it (another run's, or one kept
    aside by hand) must not push the one just written out."""
    older = [other for other in list_checkpoints(directory) if checkpoint_step(other) < step]
    for old in older[keep_last - 1 :]:
        if old.is_dir():
            # Out of the list at once, whole (a reader such as `hpc-ddp export` sees it gone,
            # never half removed); a leftover of a kill here is removed at the next start.
            pruned = old.with_name(f"{PRUNED_PREFIX}{old.name}")
            try:
                os.replace(old, pruned)
            except OSError:  # a leftover of that name, or folders that cannot be renamed
                pruned = old
            shutil.rmtree(pruned, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """Write ``path`` through ``write(handle)`` so that readers see the old file or the whole
    new one, never a part: a temporary file, fsynced, renamed into place."""
    make_dirs(path.parent)
    temporary, descriptor = create_temporary(path.parent, f".{path.name}.tmp-")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk must not keep a partial file
        raise
    _fsync_directory(path.parent)
    return path


def save_checkpoint(state: Mapping[str, Any], directory: Path, step: int, keep_last: int) -> Path:
    """Write ``state`` atomically as step-<step>.pt; keep only the newest ``keep_last``.

    A write the file system refuses (full, over quota, read-only) leaves the earlier
    checkpoints as they were and raises an HpcDdpError naming the path and the free space."""
    path = directory / f"step-{step:09d}.pt"
    try:
        final = write_atomically(path, lambda handle: torch.save(dict(state), handle))
    except (OSError, RuntimeError) as error:  # torch.save reports a full disk as RuntimeError
        raise unwritable(path, error) from None
    prune_older(directory, step, keep_last)
    return final


def unwritable(path: Path, error: BaseException) -> HpcDdpError:
    """The refusal of a checkpoint the file system would not take, naming its space."""
    try:
        usage = shutil.disk_usage(path.parent)
        space = f"{_size(usage.free)} free of {_size(usage.total)} on its file system"
    except OSError as unknown:
        space = f"free space unknown ({unknown.strerror})"
    kept = list_checkpoints(path.parent)
    previous = f"the previous checkpoint {kept[0].name} is kept" if kept else "no checkpoint"
    if isinstance(error, OSError):
        reason = error.strerror or str(error)
    else:  # torch.save's writer says only where the stream stopped short
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        reason = f"the write stopped short: full disk or quota? torch: {first[:200]}"
    return HpcDdpError(
        f"cannot write checkpoint {path} ({reason}); {space}; {previous}",
        "free space (or quota) there, or set run.output_dir to a larger file system, then run "
        "the same command again to resume from the previous checkpoint",
    )


def _size(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def writing_mark(folder: Path) -> Path:
    """The file beside ``folder`` that says this run's writer has not finished it: rank 0
    makes it before any rank writes, and removes it once ``.metadata`` is in place."""
    return folder.parent / f".writing-{folder.name}"


def remove_partial_writes(directory: Path) -> list[Path]:
    """Removes the temporary files and the unfinished folders (no ``.metadata``) that this
    run's writers left when killed mid-save (the folders marked by :func:`writing_mark`);
    returns the other folders without ``.metadata`` (copied without their dotfiles, or not
    written by hpc_ddp), which are not this run's to delete."""
    unfinished: list[Path] = []
    if not directory.is_dir():
        return unfinished
    for path in directory.glob(".step-*.pt.tmp-*"):
        path.unlink(missing_ok=True)
    for path in directory.glob(f"{PRUNED_PREFIX}step-*"):
        shutil.rmtree(path, ignore_errors=True)
    for path in sorted(directory.glob("step-*")):
        if not (path.is_dir() and _NAME.match(path.name)):
            continue
        mark = writing_mark(path)
        if not is_complete(path) and not mark.exists():
            unfinished.append(path)
            continue
        if not is_complete(path):
            shutil.rmtree(path, ignore_errors=True)
        mark.unlink(missing_ok=True)
    for mark in directory.glob(".writing-step-*"):
        if not (directory / mark.name.removeprefix(".writing-")).exists():
            mark.unlink(missing_ok=True)
    return unfinished


def _refused_by_weights_only(error: Exception) -> bool:
    return "weights_only" in str(error) and "Unsupported global" in str(error)


def load_checkpoint(path: Path, rank: int = 0, verify: bool = True) -> dict[str, Any]:
    """One checkpoint, as ``rank`` needs it; raises for a damaged or foreign one. A folder's
    run state and this rank's own state are read now, its objects on resume (see
    :func:`hpc_ddp.runtime.checkpoint.sharded.reading.load_run`; ``verify``: its files' checksums
    too, which reads every byte).

    A single file is read with ``weights_only=True``.

    The file is memory-mapped: a tensor is read from disk when it is used, so each of W ranks
    reads the weights and its own random streams, not every rank's. A file that is whole but
    holds an object ``weights_only`` loading refuses is the user's to fix, so that one is an
    HpcDdpError, not a damaged file to skip."""
    if path.is_dir():
        return load_run(path, rank, verify)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        if _refused_by_weights_only(error):
            first = str(error).split("Unsupported global:")[-1].splitlines()[0].strip()
            raise HpcDdpError(
                f"checkpoint {path} holds an object that safe loading (weights_only=True) "
                f"refuses: {first}",
                "make every registered object's state_dict() return tensors and plain "
                "Python data (numbers, strings, lists, dicts)",
            ) from None
        raise
    if not isinstance(state, dict):
        raise ValueError(f"not an hpc_ddp checkpoint (a {type(state).__name__})")
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"format {state.get('format')!r}: this hpc_ddp reads format {FORMAT_VERSION}"
        )
    return state


def load_newest(
    directory: Path,
    start_fresh_if_unreadable: bool = False,
    unfinished: Sequence[Path] = (),
    verify: Callable[[Path], str | None] | None = None,
) -> Found | None:
    """The newest checkpoint that loads. Unreadable ones newer than it (damaged, truncated,
    of another format) and the ``unfinished`` folders (see :func:`remove_partial_writes`)
    are moved to ``checkpoints/unreadable/``, so a later save never replaces them. When none
    loads, nothing is touched and the run is refused, unless ``start_fresh_if_unreadable``:
    then all are moved aside and None says "start fresh". ``verify``: checks a folder's
    checksums instead of reading it whole here (the ranks share it), returning what failed
    or None."""
    unreadable = [(path, f"no {METADATA}: unfinished, or copied without it") for path in unfinished]
    for path, reason in unreadable:
        get_logger().warning(f"checkpoint {path} cannot be loaded ({reason})")
    for path in list_checkpoints(directory):
        try:
            found = path, load_checkpoint(path, verify=verify is None)
        except HpcDdpError:
            raise
        except BaseException as error:  # a damaged file fails in many ways; all mean: skip it
            if isinstance(error, KeyboardInterrupt | SystemExit):
                raise  # (torch's CheckpointException is a BaseException, not an Exception)
            failed: str | None = error_line(error, 200)
        else:
            failed = verify(path) if verify is not None and path.is_dir() else None
        if failed is not None:
            unreadable.append((path, failed))
            get_logger().warning(f"checkpoint {path} cannot be loaded ({failed})")
            continue
        if unreadable:
            get_logger().warning(f"trying the previous one: {path.name} loads")
        set_aside([path for path, _reason in unreadable])
        return found
    if unreadable and not start_fresh_if_unreadable:
        listed = "; ".join(f"{path.name}: {reason}" for path, reason in unreadable[:3])
        raise HpcDdpError(
            f"no checkpoint in {directory} can be loaded ({listed}); nothing was changed",
            "a checkpoint written by a newer hpc_ddp loads with that version; to start this "
            "run from step 0 anyway, with the files kept in checkpoints/unreadable/, add "
            "checkpoint.start_fresh_if_unreadable=true (or give the run another run.id)",
        )
    set_aside([path for path, _reason in unreadable])
    return None


def set_aside(paths: list[Path], into: str = UNREADABLE_DIR, kind: str = "unreadable") -> None:
    """Move checkpoints into the folder ``into`` beside them, never over a file."""
    for path in paths:
        aside = path.parent / into
        aside.mkdir(mode=DIR_MODE, exist_ok=True)
        target, copy = aside / path.name, 1
        while target.exists():
            target, copy = aside / f"{path.name}.{copy}", copy + 1
        os.replace(path, target)
        get_logger().warning(f"moved the {kind} checkpoint {path.name} to {target}")


def supersede(run_dir: Path) -> None:
    """A run started with checkpoint.resume=false over checkpoints of its own: they move to
    ``checkpoints/superseded/``, so that a later resume continues this training, not the one
    it replaced (whose later steps would otherwise win)."""
    set_aside(list_checkpoints(checkpoint_dir(run_dir)), SUPERSEDED_DIR, "superseded")
