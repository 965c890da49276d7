"""The public face and its page agree: every name ``hpc_ddp`` exports and every public member
of a run is in docs/api.md, each exported name loads (lazily: importing the package stays
cheap), and the page names nothing the package does not have."""

from __future__ import annotations

import re

import hpc_ddp
from hpc_ddp.runtime.session.run import Run
from tests.helpers import REPO

PAGE = (REPO / "docs" / "api.md").read_text()


def run_members() -> set[str]:
    """A run's public methods and properties, and the attributes it sets on itself."""
    import inspect

    source = inspect.getsource(Run)
    assigned = set(re.findall(r"self\.([a-z][a-z_]*)\s*(?::[^=]+)?=", source))
    return {name for name in [*dir(Run), *assigned] if not name.startswith("_")}


def settings_of_run_section() -> set[str]:
    """``run.seed`` on the page is the setting (the config's ``run`` section), not a member."""
    import dataclasses

    from hpc_ddp.runtime.config import RunConfig

    return {field.name for field in dataclasses.fields(RunConfig)}


def test_every_exported_name_is_on_the_api_page_and_loads() -> None:
    missing = [name for name in hpc_ddp.__all__ if f"hpc_ddp.{name}" not in PAGE]
    assert not missing, f"exported but not in docs/api.md: {missing}"
    assert all(getattr(hpc_ddp, name) is not None for name in hpc_ddp.__all__)
    named = set(re.findall(r"hpc_ddp\.([A-Za-z_]+)\b", PAGE))
    assert named <= {*hpc_ddp.__all__, "__version__"}, named - set(hpc_ddp.__all__)


def test_every_public_member_of_a_run_is_on_the_api_page() -> None:
    """A member counts as shown as ``run.NAME``, or listed in a row that starts with one
    (``run.rank`, `local_rank`, ...``)."""
    shown = set(re.findall(r"run\.([A-Za-z_]+)", PAGE))
    for row in re.findall(r"^\| (`run\.[^|]*)\|", PAGE, flags=re.M):
        shown |= set(re.findall(r"`(?:run\.)?([A-Za-z_]+)[`(]", row))
    missing = sorted(run_members() - shown)
    assert not missing, f"public members of a run not in docs/api.md: {missing}"
    unknown = sorted(
        name
        for name in re.findall(r"`run\.([A-Za-z_]+)", PAGE)
        if name not in run_members() | settings_of_run_section()
    )
    assert not unknown, f"docs/api.md names members a run does not have: {unknown}"


def test_the_run_types_a_user_meets_are_exported() -> None:
    """What a run's members return, where a user annotates or checks it."""
    from hpc_ddp.runtime.place.distenv import DistEnv

    assert hpc_ddp.DistEnv is DistEnv
    assert Run.env.fget.__annotations__["return"] in ("DistEnv", DistEnv)  # type: ignore[attr-defined]
    assert hpc_ddp.Resumed.__name__ == "Resumed" and hpc_ddp.Sums.__name__ == "Sums"
