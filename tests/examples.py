"""The examples in examples/ as the tests run them: small settings for 2 CPU cores, and
where each one's run directory and results are."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO


@dataclass(frozen=True)
class Example:
    """One example script and the arguments that make it small."""

    #: The run name the script starts its runs under.
    name: str
    script: str
    #: Arguments for a test-sized run (at 2 ranks; ``scaled`` adapts them to others).
    args: tuple[str, ...]
    #: (summary key, bound) the default test run must reach: value < bound, or > for accuracy.
    target: tuple[str, float]

    @property
    def path(self) -> str:
        return str(REPO / self.script)

    def command(self, *extra: str) -> list[str]:
        return [self.path, *self.args, *extra]


LM = Example(
    "lm",
    "examples/lm/train.py",
    (
        *("--epochs", "2", "--width", "32", "--layers", "2", "--heads", "2", "--context", "32"),
        *("--batch", "16", "--train-bytes", "60000", "--val-bytes", "20000", "--warmup", "10"),
        *("--sample-bytes", "40", "--log-interval", "5"),
    ),
    ("val_loss", 3.3),
)
CNN = Example(
    "digits_cnn",
    "examples/digits_cnn/train.py",
    ("--epochs", "6", "--batch", "32", "--workers", "2", "--log-interval", "5"),
    ("val_accuracy", 0.9),
)
#: The converted tutorial; its --batch_size is per rank, as in the plain script.
TUTORIAL = Example(
    "tutorial",
    "examples/tutorial/with_hpc_ddp.py",
    ("4", "2", "--batch_size", "16"),
    ("mse", 0.05),
)


def settings(output_dir: Path, run_id: str, *extra: str) -> dict[str, str]:
    """The run settings, passed the way the tutorial script (which has no place for them in
    its own arguments) takes them: $HPC_DDP_OVERRIDES."""
    values = [f"run.output_dir={output_dir}", f"run.id={run_id}", *extra]
    return {"HPC_DDP_OVERRIDES": shlex.join(values)}


def run_dir(output_dir: Path, example: Example, run_id: str) -> Path:
    return output_dir / example.name / run_id
