"""`hpc-ddp tracking sync RUN`: replay a run's own record (metrics.jsonl, summary.json, its
final state) into MLflow after the tracking server was down or died during the run.

Into the same MLflow run when it exists (its id is in tracking.json, or the checkpoint's),
else into a new one with the run's name, params and tags. Points MLflow already holds (the
same metric at the same step) are skipped, so a sync can be repeated.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.names import name_problem
from hpc_ddp.runtime.tracking.base import experiment_folder, store_lock
from hpc_ddp.runtime.tracking.record import (
    TRACKING_FILE,
    pid_alive,
    read_earlier_metrics,
    read_metrics,
    read_status,
    replace_json,
    tags_set,
)

#: MLflow takes at most 1000 metrics per log_batch call.
BATCH = 1000
#: The MLflow status of each end state of status.json (requeued/running: left RUNNING).
FINAL_STATUS = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}


@dataclass(frozen=True)
class SyncReport:
    run_id: str
    uri: str
    created: bool
    added: int
    already: int
    status: str | None
    #: Every (metric, step) point of the record, now in MLflow.
    points: set[tuple[str, int]]
    #: Metric names of the record MLflow refuses (logged before names were checked): skipped.
    refused: tuple[str, ...] = ()


def _read_tracking(run_dir: Path) -> dict[str, Any]:
    path = run_dir / TRACKING_FILE
    try:
        tracking = json.loads(path.read_text())
    except FileNotFoundError:
        raise HpcDdpError(
            f"{run_dir} has no {TRACKING_FILE}: it is not a run directory, or the run did "
            "not track (tracking.enabled=false)",
            "pass a run directory: <output_dir>/<name>/<id> (hpc-ddp runs lists them)",
        ) from None
    except (OSError, ValueError) as error:
        raise HpcDdpError(f"cannot read {path}: {error}", "check the file") from None
    if not isinstance(tracking, dict) or "uri" not in tracking:
        raise HpcDdpError(f"{path} is not a tracking record", "check the file")
    return tracking


def _refuse_live(run_dir: Path, status: dict[str, Any]) -> None:
    if status.get("state") not in ("running", None) or status.get("host") != socket.gethostname():
        return
    if not pid_alive(int(status.get("pid", 0)) or -1):
        return  # its process is gone: the run was lost, its record is final
    raise HpcDdpError(
        f"run {run_dir} is still running (pid {status['pid']} on {status['host']})",
        "sync after it ended; it sends its metrics to MLflow itself while the server is up",
    )


def sync_run(
    run_dir: Path,
    uri: str | None = None,
    live: bool = False,
    resumed: tuple[float, int] | None = None,
    into: str | None = None,
) -> SyncReport:
    """Replay ``run_dir``'s record into MLflow at ``uri`` (default: the run's own).
    ``live``: the run itself catching up after an outage (it is running, of course: its
    MLflow run is left RUNNING). ``resumed``: (its start, Unix s; the step it resumed from):
    an attempt catching up with what the attempts before it left out of MLflow, which
    replays their points only, ``into`` the MLflow run it tracks in."""
    tracking = _read_tracking(run_dir)
    status = read_status(run_dir) or {}
    if not live:
        _refuse_live(run_dir, status)
    uri = uri or str(tracking["uri"])
    from hpc_ddp.runtime.tracking.mlflow_import import export_mlflow_http_settings

    export_mlflow_http_settings()
    import mlflow
    from mlflow.entities import Metric, Param, RunTag

    try:
        # Its constructor opens the store: an unknown scheme or a damaged database fails here.
        client = mlflow.MlflowClient(tracking_uri=uri)
        with store_lock(uri):  # a fresh SQLite store gets its tables once
            run_id, created = (
                (into, False)
                if into
                else _find_or_create(
                    client, tracking, _known_run(tracking, uri), mlflow.exceptions.MlflowException
                )
            )
        existing: dict[str, set[int]] = {}
        points = []
        refused: set[str] = set()
        entries = read_earlier_metrics(run_dir, *resumed) if resumed else read_metrics(run_dir)
        for entry in entries:
            for key, value in entry["metrics"].items():
                if value is None:
                    continue
                if name_problem(key) is not None:
                    refused.add(key)
                    continue
                if key not in existing:
                    history = [] if created else client.get_metric_history(run_id, key)
                    existing[key] = {metric.step for metric in history}
                point = Metric(key, float(value), int(entry["time"] * 1000), int(entry["step"]))
                points.append(point)
        new = [point for point in points if point.step not in existing[point.key]]
        for start in range(0, len(new), BATCH):
            client.log_batch(run_id, metrics=new[start : start + BATCH])
        if created:
            params = [Param(k, str(v)[:6000]) for k, v in tracking.get("params", {}).items()]
            for start in range(0, len(params), 100):
                client.log_batch(run_id, params=params[start : start + 100])
            tags = {**tracking.get("tags", {}), "hpc_ddp.synced_from": str(run_dir.resolve())}
            client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        later_tags = tags_set(tracking)  # setting one again changes nothing: sent every time
        if later_tags:
            client.log_batch(run_id, tags=[RunTag(k, v) for k, v in later_tags.items()])
        summary = run_dir / "summary.json"
        if summary.is_file():
            client.log_text(run_id, summary.read_text(), "summary.json")
        final = None if live else FINAL_STATUS.get(str(status.get("state")))
        if final is not None:
            client.set_terminated(run_id, status=final)
    except ImportError:
        raise  # a package the tracking process left out (mlflow_import): it lets it in
    except Exception as error:  # MLflow's and its HTTP client's many ways of failing
        raise HpcDdpError(
            f"MLflow at {uri} failed: {str(error).strip().splitlines()[0][:300]}",
            "check that the tracking server is up (or pass --uri), then sync again: points "
            "already there are skipped",
        ) from None
    if into is None:  # else the running attempt's record names it
        remember_run(run_dir, tracking, uri, run_id)
    replayed = {(point.key, point.step) for point in points}
    return SyncReport(
        run_id,
        uri,
        created,
        len(new),
        len(points) - len(new),
        final,
        replayed,
        tuple(sorted(refused)),
    )


def _known_run(tracking: dict[str, Any], uri: str) -> str | None:
    """The MLflow run of this run at ``uri``: the one it tracked into, or an earlier sync's."""
    if uri == tracking["uri"]:
        return tracking.get("run_id")
    return dict(tracking.get("synced", {})).get(uri)


def _find_or_create(
    client: Any, tracking: dict[str, Any], known: str | None, error_type: type[Exception]
) -> tuple[str, bool]:
    """The run's MLflow run (``known``, if MLflow still has it), else a new one."""
    if known:
        try:
            client.get_run(known)
            return str(known), False
        except error_type:
            pass  # another store, or the run was deleted: make a new one
    experiment = client.get_experiment_by_name(tracking["experiment"])
    if experiment is None:
        root = experiment_folder(
            Path(tracking.get("artifact_root", "mlartifacts")), tracking["experiment"]
        )
        experiment_id = client.create_experiment(
            tracking["experiment"], artifact_location=root.as_uri()
        )
    else:
        experiment_id = experiment.experiment_id
    name = str(tracking.get("run_name") or "run")
    run = client.create_run(experiment_id, run_name=name, tags={"mlflow.runName": name})
    return str(run.info.run_id), True


def remember_run(run_dir: Path, tracking: dict[str, Any], uri: str, run_id: str) -> None:
    """Write the run id into tracking.json, so that the next sync finds the same run. Into
    the file as it is now: a live run may have added to it (a tag) since it was read."""
    if _known_run(tracking, uri) == run_id:
        return
    current = _read_tracking(run_dir)
    if uri == tracking["uri"]:
        current["run_id"] = run_id
    else:
        current["synced"] = {**dict(current.get("synced", {})), uri: run_id}
    replace_json(run_dir / TRACKING_FILE, current)
