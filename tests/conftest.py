"""Fixtures shared by the suite, and its two tiers.

The fast tier is every test not marked ``e2e`` (nor ``slurm``): it starts no process, so
it runs in the inner loop in minutes (``make test-fast``). A test of that tier that starts
one fails, saying to mark it. The end-to-end tier (``e2e``, ``slurm``) runs real ranks, real
Slurm and real servers; ``make test`` runs both.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, RESUMABLE, run_local
from tests.slurm_cluster import DEFAULT_CONF, SlurmCluster, cluster_unavailable_reason

#: Set to 1 to run the tests marked slow (as ``--slow`` does).
RUN_SLOW = "HPC_DDP_RUN_SLOW"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow", action="store_true", help=f"also run the tests marked slow (or {RUN_SLOW}=1)"
    )


#: Every way a test could start a process: subprocess (its own reference to
#: _posixsubprocess.fork_exec, or posix_spawn), multiprocessing's spawn (fork_exec), fork
#: (multiprocessing's fork, DataLoader workers), pty's fork and os.system.
PROCESS_STARTERS: tuple[tuple[Any, str], ...] = (
    (subprocess, "_fork_exec"),
    (_posixsubprocess, "fork_exec"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
)


def end_to_end(item: pytest.Item) -> bool:
    return item.get_closest_marker("e2e") is not None or "slurm" in item.keywords


@contextlib.contextmanager
def no_process_started(item: pytest.Item) -> Iterator[None]:
    """Around a fast test's setup (its module's fixtures too), call and teardown: starting a
    process fails the test with what to do about it (also where the code caught the error)."""
    if end_to_end(item):
        yield
        return
    started: list[str] = []

    def refuse(name: str) -> Callable[..., Any]:
        def refused(*_args: Any, **_kwargs: Any) -> Any:
            started.append(name)
            raise RuntimeError(f"{name}: {NOT_FAST}")

        return refused

    saved = [  # subprocess._fork_exec is Python 3.11's: 3.10 calls _posixsubprocess
        (owner, name, getattr(owner, name))
        for owner, name in PROCESS_STARTERS
        if hasattr(owner, name)
    ]
    for owner, name, _original in saved:
        setattr(owner, name, refuse(f"{owner.__name__}.{name}"))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    if started:
        pytest.fail(f"this test started a process ({started[0]}): {NOT_FAST}", pytrace=False)


def pytest_sessionstart(session: pytest.Session) -> None:
    """matplotlib's first import on a machine builds its font cache by running ``fc-list``:
    built here, before any fast test, so a plot test's verdict does not depend on whether an
    earlier command on the machine drew something."""
    with contextlib.suppress(ImportError):
        import matplotlib.font_manager  # noqa: F401


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with no_process_started(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with no_process_started(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with no_process_started(item):
        return (yield)


NOT_FAST = (
    "a test that starts a process belongs to the end-to-end tier: mark it @pytest.mark.e2e "
    "(the fast tier starts none)"
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


#: Where a run lands when nothing says where: a test's runs belong in its tmp_path.
DEFAULT_RUNS = REPO / "runs"


def _default_runs() -> set[Path]:
    return set(DEFAULT_RUNS.glob("*/*"))


@pytest.fixture(autouse=True)
def runs_stay_out_of_the_repository() -> Iterator[None]:
    """A test whose run fell back to ./runs (a setting passed where nothing reads it) would
    leave it in the repository, and a later test could read it as its own: that fails the
    test, naming the run."""
    before = _default_runs()
    yield
    left = sorted(_default_runs() - before)
    if left:
        pytest.fail(
            f"this test left its run in the repository ({left[0].relative_to(REPO)}): give it "
            "run.output_dir=<tmp_path> (`hpc-ddp local --set`, $HPC_DDP_OVERRIDES or start())",
            pytrace=False,
        )


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


@pytest.fixture(scope="session")
def resumable_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of RESUMABLE trained uninterrupted on 2 local ranks (run id
    "reference", tracking off): trained once, the resume tests compare with it."""
    output = tmp_path_factory.mktemp("resumable")
    reference = run_local(2, output, [*RESUMABLE, "run.id=reference", "tracking.enabled=false"])
    assert reference.returncode == 0, reference.stderr[-2000:]
    return output


#: DDP models that outlived their test's group (a failed test's traceback holds its own):
#: kept until the interpreter exits, when gloo's threads are long idle, so that none drops
#: the group's last reference mid-session.
_KEPT_UNTIL_EXIT: list[Any] = []


@pytest.fixture
def one_rank() -> Iterator[None]:
    """One gloo rank in this process (an in-memory store: nothing listens), destroyed after
    the test's own objects are gone.

    The order matters: a DDP model's reducer holds the group, and where it drops the last
    reference the group is destroyed with the GIL held, joining gloo's threads while one of
    them may wait for the GIL to free a backward's finished all-reduce (torch keeps the
    backward's context with it). Whether it hangs then depends on the machine's pace, so a
    model still alive here is kept until exit, and fails a test that passed."""
    import gc
    import sys

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
        gc.collect()
        # type(), not isinstance: the latter reads each object's __class__, and some warn.
        every = gc.get_objects()
        kept = {id(held) for held in _KEPT_UNTIL_EXIT}
        alive = [
            held
            for held in every
            if issubclass(type(held), DistributedDataParallel) and id(held) not in kept
        ]
        _KEPT_UNTIL_EXIT.extend(alive)
        count = len(alive)
        del every, alive
        # pytest keeps a failed test's traceback (sys.last_value), and with it its models.
        failed = getattr(sys, "last_value", None) is not None
        assert failed or not count, (
            f"{count} DDP model(s) outlive the test's group: drop them in the test "
            "(a reducer holding the group last would destroy it with the GIL held)"
        )
    finally:
        dist.destroy_process_group()
