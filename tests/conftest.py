"""Fixtures shared by the suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm_cluster import DEFAULT_CONF, SlurmCluster, cluster_unavailable_reason

#: Set to 1 to run the tests marked slow (as ``--slow`` does).
RUN_SLOW = "HPC_DDP_RUN_SLOW"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow", action="store_true", help=f"also run the tests marked slow (or {RUN_SLOW}=1)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The default suite stays lean: a test marked slow repeats, at more cost, a guarantee
    that a faster test pins too, so it runs only when asked for."""
    if config.getoption("--slow") or os.environ.get(RUN_SLOW) == "1":
        return
    skip = pytest.mark.skip(reason="marked slow: run with --slow (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


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
