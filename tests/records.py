"""What the tests read back from a run's checkpoints (torch and the checkpoint readers:
kept apart from tests/helpers.py, which imports neither)."""

from __future__ import annotations

from pathlib import Path

import torch

from hpc_ddp.runtime.checkpoint.export import model_weights
from hpc_ddp.runtime.checkpoint.files import list_checkpoints


def checkpoints_dir(output_dir: Path, name: str = "*", run_id: str = "*") -> Path:
    """The one ``<output_dir>/<name>/<run_id>/checkpoints`` (either may be a glob pattern)."""
    found = sorted(output_dir.glob(f"{name}/{run_id}/checkpoints"))
    assert len(found) == 1, f"expected one checkpoints folder in {output_dir}/{name}/{run_id}"
    return found[0]


def final_weights(
    output_dir: Path, name: str = "*", run_id: str = "*", registered: str = "model"
) -> dict[str, torch.Tensor]:
    """The weights of the module registered as ``registered`` in the run's newest checkpoint."""
    newest = list_checkpoints(checkpoints_dir(output_dir, name, run_id))[0]
    return model_weights(newest, registered)[1]
