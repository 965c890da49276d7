"""Fixtures shared by the suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm_cluster import DEFAULT_CONF, SlurmCluster, cluster_unavailable_reason


@pytest.fixture(scope="session")
def slurm() -> SlurmCluster:
    """The test Slurm cluster; skipped when absent, a failure when HPC_DDP_REQUIRE_SLURM=1."""
    conf = Path(os.environ.get("HPC_DDP_SLURM_CONF", DEFAULT_CONF))
    reason = cluster_unavailable_reason(conf)
    if reason:
        if os.environ.get("HPC_DDP_REQUIRE_SLURM") == "1":
            pytest.fail(f"HPC_DDP_REQUIRE_SLURM=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return SlurmCluster(conf)


@pytest.fixture(autouse=True)
def cancel_left_over_jobs(request: pytest.FixtureRequest) -> Iterator[None]:
    """A Slurm test that fails half-way must not leave its job running into the next test."""
    yield
    if "slurm" in request.fixturenames:
        cluster: SlurmCluster = request.getfixturevalue("slurm")
        cluster.cancel_all()


@pytest.fixture()
def slurm_conf_in_environ(slurm: SlurmCluster) -> Iterator[None]:
    """submitit calls sbatch/sacct from this process, so they need SLURM_CONF here."""
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(slurm.conf)
    yield
    if previous is None:
        del os.environ["SLURM_CONF"]
    else:
        os.environ["SLURM_CONF"] = previous
