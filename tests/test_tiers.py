"""The fast tier's guard (tests/conftest.py): a test without the e2e mark that starts a
process fails, saying to mark it, also where the code under test caught the refusal."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import subprocess
from typing import Any, ClassVar

import pytest

from tests.conftest import NOT_FAST, no_process_started


class FastItem:
    """What the guard reads of a test item that has no e2e (or slurm) mark."""

    keywords: ClassVar[dict[str, Any]] = {}

    def get_closest_marker(self, _name: str) -> None:
        return None


@pytest.mark.parametrize(
    "start",
    [
        lambda: subprocess.run(["true"], check=False),
        lambda: os.fork(),
        lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
        lambda: os.system("true"),
    ],
    ids=["subprocess", "fork", "multiprocessing-spawn", "os.system"],
)
def test_a_fast_test_that_starts_a_process_fails_saying_to_mark_it(start: Any) -> None:
    with (
        pytest.raises(pytest.fail.Exception, match=re.escape("mark it @pytest.mark.e2e")),
        no_process_started(FastItem()),  # type: ignore[arg-type]
        pytest.raises(RuntimeError, match=re.escape(NOT_FAST)),
    ):
        start()


def test_a_refusal_the_code_caught_still_fails_the_test() -> None:
    with (
        pytest.raises(pytest.fail.Exception, match=r"started a process \(os\.fork\)"),
        no_process_started(FastItem()),  # type: ignore[arg-type]
        contextlib.suppress(RuntimeError),  # the code under test went on without its process
    ):
        os.fork()
