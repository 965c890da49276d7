"""run.deterministic in this process: the kernels it sets (restored after the test) and the
refusal of an operation torch has no deterministic kernel for. The refusal on real ranks:
test_user_script.py."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import redirect_stderr

import pytest
import torch

from hpc_ddp.runtime.config import RuntimeConfig, resolve_config
from hpc_ddp.runtime.errors import EXIT_FAILURE, EXIT_USER_ERROR
from hpc_ddp.runtime.exits import report_failure
from hpc_ddp.runtime.session.joining import use_deterministic_kernels


@pytest.fixture
def kernels_restored() -> Iterator[None]:
    cudnn = torch.backends.cudnn
    before = (torch.are_deterministic_algorithms_enabled(), cudnn.deterministic,
              cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
              torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[4])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]
    if before[3] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[3]


def test_the_setting_is_off_by_default_and_read_from_run() -> None:
    assert RuntimeConfig().run.deterministic is False
    overridden = resolve_config(None, ["run.deterministic=true"], {}, {})
    assert overridden.run.deterministic is True


def test_deterministic_kernels_are_set_and_a_users_cublas_workspace_kept(
    kernels_restored: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    use_deterministic_kernels()
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    use_deterministic_kernels()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
        torch.zeros(4).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))


def test_an_operation_without_a_deterministic_kernel_ends_the_rank_with_a_hint(
    kernels_restored: None,
) -> None:
    torch.use_deterministic_algorithms(True)
    stderr = io.StringIO()
    try:
        torch.zeros(4).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
    except RuntimeError as error:
        with redirect_stderr(stderr):
            assert report_failure(error, "0") == EXIT_USER_ERROR
    assert "put_ does not have a deterministic implementation" in stderr.getvalue()
    assert "HINT: run.deterministic=true asks every operation" in stderr.getvalue()
    with redirect_stderr(io.StringIO()):
        assert report_failure(RuntimeError("an error of the program's own"), "0") == EXIT_FAILURE
