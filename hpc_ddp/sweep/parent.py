"""The sweep's one MLflow parent run: made when the sweep is submitted, ended when its last
task ends, RUNNING again when the sweep is resumed. Every task's run is its child (see
hpc_ddp.runtime.tracking.membership). MLflow is imported here only."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.tracking.base import experiment_folder, store_lock


def _client(uri: str) -> Any:
    import mlflow

    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    return mlflow.MlflowClient(tracking_uri=uri)


def create_parent_run(
    uri: str, experiment: str, artifact_root: Path, name: str, params: Mapping[str, str]
) -> str:
    """A new parent run for sweep ``name``; returns its id."""
    from mlflow.entities import Param

    with store_lock(uri):
        client = _client(uri)
        found = client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = str(found.experiment_id)
        else:
            location = experiment_folder(artifact_root, experiment).resolve().as_uri()
            experiment_id = str(client.create_experiment(experiment, artifact_location=location))
        run = client.create_run(
            experiment_id, run_name=f"sweep {name}", tags={"hpc_ddp.sweep": name}
        )
    run_id = str(run.info.run_id)
    client.log_batch(run_id, params=[Param(key, value) for key, value in params.items()])
    return run_id


def set_parent_status(uri: str, run_id: str, status: str) -> None:
    """FINISHED or FAILED (the sweep ended), RUNNING (resumed)."""
    client = _client(uri)
    if status == "RUNNING":
        client.update_run(run_id, status="RUNNING")
    else:
        client.set_terminated(run_id, status=status)
