"""A run that is one task of a sweep: ``<run dir>/sweep-task.json``, written by the sweep's
task before the run starts, makes its MLflow run a child of the sweep's parent run, tagged
with the sweep and the task, the task's settings logged as params."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.safefiles import make_dirs
from hpc_ddp.runtime.tracking.record import replace_json

MEMBERSHIP_FILE = "sweep-task.json"


@dataclass(frozen=True)
class SweepMembership:
    """Which sweep a run belongs to, and with what settings."""

    sweep: str
    index: int
    settings: dict[str, str]
    #: The sweep's MLflow run (None: tracking is off, or it could not be made).
    parent_run_id: str | None = None
    #: Values `hpc-ddp sweep resume --set` changed (KEY=VALUE): MLflow keeps a run's first
    #: params, so they are a tag.
    overrides: tuple[str, ...] = ()

    def tags(self) -> dict[str, str]:
        tags = {"hpc_ddp.sweep": self.sweep, "hpc_ddp.sweep.task": str(self.index)}
        if self.parent_run_id:
            tags["mlflow.parentRunId"] = self.parent_run_id
        if self.overrides:
            tags["hpc_ddp.sweep.overrides"] = " ".join(self.overrides)
        return tags

    def params(self) -> dict[str, str]:
        return {f"sweep.{key.lstrip('-')}": value for key, value in self.settings.items()}


def write_membership(run_dir: Path, membership: SweepMembership) -> None:
    make_dirs(run_dir)
    replace_json(run_dir / MEMBERSHIP_FILE, dataclasses.asdict(membership))


def read_membership(run_dir: Path) -> SweepMembership | None:
    """The sweep ``run_dir`` belongs to, or None (not a sweep's task, or the file is not
    one this version wrote)."""
    try:
        data: Any = json.loads((run_dir / MEMBERSHIP_FILE).read_text())
        return SweepMembership(
            sweep=str(data["sweep"]),
            index=int(data["index"]),
            settings={str(key): str(value) for key, value in data["settings"].items()},
            parent_run_id=str(data["parent_run_id"]) if data.get("parent_run_id") else None,
            overrides=tuple(str(item) for item in data.get("overrides", ())),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
