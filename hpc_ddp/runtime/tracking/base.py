"""What every tracker layer shares: the Tracker protocol, the record of a run's attempt, the
tags every run carries, where the store is and the lock that guards its creation. MLflow is
imported only by :mod:`hpc_ddp.runtime.tracking.mlflow_tracker` and
:mod:`hpc_ddp.runtime.tracking.sync`: on rank 0 (its tracking process; after an outage, its
tracking thread) and in `hpc-ddp tracking sync`.
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from hpc_ddp.runtime.config import TrackingConfig

DEFAULT_DB_NAME = "mlflow.db"
#: MLflow takes at most this many metrics in one call (log_batch).
MAX_METRICS_PER_CALL = 1000


class Tracker(Protocol):
    """What the training loop needs from a tracker."""

    @property
    def run_id(self) -> str | None: ...

    @property
    def status(self) -> str:
        """ "ok", "off", or "failed: <why>" (the run went on without it)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_json_artifact(self, name: str, data: Any) -> None: ...

    def log_text_artifact(self, name: str, text: str) -> None: ...

    def set_tag(self, key: str, value: str) -> None:
        """Tag the run (a finding made while it trains, such as an idle GPU)."""

    def finish(self, status: str) -> None: ...

    def suspend(self) -> None: ...


class LoggedMetrics(NamedTuple):
    """Metrics logged at one step, and when."""

    metrics: Mapping[str, float]
    step: int
    #: Unix time in milliseconds, as MLflow stores it.
    time_ms: int


class StoreTracker(Tracker, Protocol):
    """A tracker that writes to the store itself (what GuardedTracker drives): it also takes
    metrics of several steps in one call."""

    def log_metric_steps(self, logged: Sequence[LoggedMetrics]) -> None: ...


class NullTracker:
    """Ranks other than 0, and runs with tracking.enabled=false."""

    run_id: str | None = None
    status = "off"

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_json_artifact(self, name: str, data: Any) -> None:
        pass

    def log_text_artifact(self, name: str, text: str) -> None:
        pass

    def set_tag(self, key: str, value: str) -> None:
        pass

    def finish(self, status: str) -> None:
        pass

    def suspend(self) -> None:
        pass


def default_tracking_uri(output_dir: str | Path) -> str:
    """The embedded SQLite store kept beside the runs: no server needed."""
    return f"sqlite:///{Path(output_dir).resolve() / DEFAULT_DB_NAME}"


@dataclass(frozen=True)
class RunRecord:
    """What rank 0 records in MLflow for this attempt of a run."""

    #: The run's name (MLflow's run name).
    name: str
    params: Mapping[str, Any]
    tags: Mapping[str, str]
    #: The MLflow run a checkpoint names: this attempt continues it.
    resume_run_id: str | None = None
    #: The global step this attempt starts at.
    start_step: int = 0
    #: Names this attempt (host, pid, time): a tracker started again for the same attempt
    #: (after MLflow came back) continues its tags instead of adding an attempt.
    attempt_token: str = ""
    #: When the run started (Unix ms): MLflow's run begins then, not when its tracking process
    #: got round to creating it, so its duration is the run's.
    start_time_ms: int | None = None
    #: The attempts of the run before this one (status.json's count): this attempt's tags
    #: follow theirs, also where MLflow was away for some of them.
    earlier_attempts: int = 0


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Hold an exclusive lock beside an SQLite store while opening it: two runs that open a
    new store at once would both create its tables, and one would fail in the migration. A
    store in a folder that does not exist is refused (MLflow would create the folders)."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    database = Path(uri.removeprefix("sqlite:///"))
    if not database.parent.is_dir():  # MLflow would create every missing folder, even at /
        raise FileNotFoundError(
            f"the folder {database.parent} of {uri} does not exist: create it or fix tracking.uri"
        )
    with open(database.with_name(database.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tracking_uri(config: TrackingConfig, output_dir: str | Path) -> str:
    """tracking.uri, else the embedded SQLite store in output_dir."""
    return config.uri or default_tracking_uri(output_dir)


def artifact_root(output_dir: str | Path) -> Path:
    """Where the embedded store's runs keep their artifacts."""
    return Path(output_dir) / "mlartifacts"


def experiment_folder(root: Path, experiment: str) -> Path:
    """The folder under ``root`` for an experiment's artifacts: one plain name made from
    the experiment's (which may hold '/' or '..'), so it never leads out of ``root``."""
    plain = re.sub(r"[^A-Za-z0-9._-]", "_", experiment).lstrip(".") or "_"
    return root / plain


def run_tags(
    launcher: str,
    world_size: int,
    num_nodes: int,
    job_id: str,
    restart_count: int,
    elastic_restarts: int = 0,
    resumed_world_size: int | None = None,
) -> dict[str, str]:
    """The tags every run carries, so runs can be found by job id and launch shape (the one
    place a run's tags are made; the attempt tags are the tracker's). ``resumed_world_size``:
    the ranks that wrote the checkpoint this attempt resumes from."""
    tags = {
        "hpc_ddp.launcher": launcher,
        "hpc_ddp.world_size": str(world_size),
        "hpc_ddp.num_nodes": str(num_nodes),
        "hpc_ddp.job_id": job_id,
        "hpc_ddp.restart_count": str(restart_count),
        "hpc_ddp.elastic_restarts": str(elastic_restarts),
        "hpc_ddp.hostname": socket.gethostname(),
    }
    if resumed_world_size is not None and resumed_world_size != world_size:
        tags["hpc_ddp.world_size_change"] = f"{resumed_world_size} -> {world_size}"
    return tags
