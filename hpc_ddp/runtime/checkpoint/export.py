"""A registered model's full weights out of any checkpoint, as one plain file: what
inference code and other tools load with ``torch.load`` and ``load_state_dict``. Needs no
process group and no model class."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.runtime.checkpoint.files import (
    checkpoint_dir,
    checkpoint_step,
    list_checkpoints,
    load_checkpoint,
    write_atomically,
)
from hpc_ddp.runtime.checkpoint.objects import MODULE
from hpc_ddp.runtime.checkpoint.sharded.layout import METADATA, FolderObjects
from hpc_ddp.runtime.checkpoint.sharded.reading import full_tensors
from hpc_ddp.runtime.errors import HpcDdpError, error_line

#: How often a checkpoint pruned while it is read gives way to the newest one then.
PRUNED_TRIES = 3


def choose_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The run's newest checkpoint, or the one at ``step``."""
    listed = list_checkpoints(checkpoint_dir(run_dir))
    found = [path for path in listed if step is None or checkpoint_step(path) == step]
    if not found:
        steps = [checkpoint_step(path) for path in listed]
        at = f" at step {step}" if step is not None else ""
        raise HpcDdpError(
            f"no checkpoint{at} in {checkpoint_dir(run_dir)}"
            + (f" (it holds steps {', '.join(map(str, sorted(steps)))})" if steps else ""),
            "give one of the steps it holds (--step), or leave --step out for the newest",
        )
    return found[0]


def _is_weights(state: Any) -> bool:
    return (
        isinstance(state, Mapping)
        and bool(state)
        and all(isinstance(value, torch.Tensor) for value in state.values())
    )


def _models(objects: Any) -> list[str]:
    if isinstance(objects, FolderObjects):
        return [name for name, kind in objects.kinds.items() if kind == MODULE]
    return [name for name, state in objects.items() if _is_weights(state)]


def model_weights(path: Path, name: str | None = None) -> tuple[str, dict[str, torch.Tensor]]:
    """The registered model ``name`` (default: the only one) in checkpoint ``path``, whole,
    on the CPU: its name and state dict."""
    objects = load_checkpoint(path)["objects"]
    models = _models(objects)
    if name is None and len(models) != 1:
        listed = ", ".join(models) or "none"
        raise HpcDdpError(
            f"{path} holds {len(models)} registered models ({listed}): which one?",
            "name it with --object NAME",
        )
    chosen = name if name is not None else models[0]
    if chosen not in models:
        raise HpcDdpError(
            f"{path} holds no registered model {chosen!r} (models: {', '.join(models) or 'none'})",
            "name one of its models with --object",
        )
    if isinstance(objects, FolderObjects):
        return chosen, full_tensors(objects.folder, chosen)
    return chosen, {key: value.clone() for key, value in objects[chosen].items()}


def read_model_weights(
    run_dir: Path, step: int | None = None, name: str | None = None
) -> tuple[Path, str, dict[str, torch.Tensor]]:
    """The run's checkpoint at ``step`` (default: the newest), and the registered model
    ``name`` in it (see :func:`model_weights`). A run that goes on prunes old checkpoints:
    where the newest chosen is pruned while it is read, the newest then is read instead; a
    checkpoint that does not read is one line naming it."""
    for _ in range(PRUNED_TRIES):
        path = choose_checkpoint(run_dir, step)
        try:
            return path, *model_weights(path, name)
        except HpcDdpError:
            raise
        except BaseException as error:  # torch's CheckpointException is a BaseException
            if isinstance(error, KeyboardInterrupt | SystemExit):
                raise
            if path.exists():
                raise HpcDdpError(
                    f"cannot read checkpoint {path}: {error_line(error, 200)}",
                    "export another step (--step; `hpc-ddp runs` lists them)",
                ) from None
            if step is not None:
                raise HpcDdpError(
                    f"checkpoint {path} was removed while it was read (the run pruned it: "
                    "checkpoint.keep_last)",
                    "export a newer step, or leave --step out for the newest",
                ) from None
    raise HpcDdpError(
        f"the newest checkpoint of {run_dir} was pruned {PRUNED_TRIES} times while it was read",
        "run the export again, or once the run has ended",
    )


def check_export_target(output: Path, run_dir: Path) -> None:
    """Refuses an ``output`` that would replace a checkpoint (inside the run's checkpoints
    folder, or inside any checkpoint folder) or that is not a file name (a directory, a
    device, a pipe)."""
    hint = "name a new file outside the run's checkpoints, e.g. -o model.pt"
    where = output.resolve()
    checkpoints = checkpoint_dir(run_dir).resolve()
    if where.is_relative_to(checkpoints) or any(
        (folder / METADATA).exists() for folder in where.parents
    ):
        raise HpcDdpError(
            f"-o {output} is inside a run's checkpoints ({checkpoints}): the export would "
            "replace or mix with a checkpoint",
            hint,
        )
    if where.is_dir():
        raise HpcDdpError(f"-o {output} is a directory, expected the file to write", hint)
    if where.exists() and not where.is_file():
        raise HpcDdpError(f"-o {output} exists and is not a regular file", hint)


def export_model(
    run_dir: Path, output: Path, step: int | None = None, name: str | None = None
) -> tuple[Path, str, int]:
    """Write the model's state dict (see :func:`read_model_weights`) to ``output`` with
    ``torch.save``; the checkpoint read, the model's name and its tensor count. A failed
    write (read-only, a full disk, a file where a folder should be) is an HpcDdpError, and
    leaves no part of the file."""
    path, chosen, weights = read_model_weights(run_dir, step, name)
    try:
        write_atomically(output, lambda handle: torch.save(weights, handle))
    except OSError as error:
        raise HpcDdpError(
            f"cannot write {output}: {error.strerror or error}"
            + (f" ({error.filename})" if error.filename else ""),
            "write to a folder you can write to, with room for the weights",
        ) from None
    return path, chosen, len(weights)
