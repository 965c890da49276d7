"""Each rank keeps state of its own, registered per rank: a tally of what this rank drew.

    hpc-ddp local --nproc 2 tests/programs/per_rank.py --steps 40 [--pause 0.05]

``--rank-names``: each rank registers its tally under a name of its own (a mistake).
``--state-by-rank``: each rank also keeps its total in run.state, which a checkpoint keeps
only rank 0's of (a mistake), beside a value alike on every rank.

Each rank prints ``TALLY <rank> <the rank its tally belongs to> <total> <count>`` at the end.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import hpc_ddp


class Tally:
    """A rank's own running total: it differs from rank to rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.total = 0
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "total": self.total, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rank, self.total, self.count = state["rank"], state["total"], state["count"]


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--pause", type=float, default=0.0)
parser.add_argument("--rank-names", action="store_true", help="registered as tally<rank>")
parser.add_argument("--state-by-rank", action="store_true", help="a total in run.state")
args, overrides = parser.parse_known_args()
run = hpc_ddp.start(overrides=overrides, tracking={"enabled": False}, log_interval=5)
model = run.wrap(torch.nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
tally = Tally(run.rank)
run.register(model=model, optimizer=optimizer)
run.register_per_rank(**{f"tally{run.rank}" if args.rank_names else "tally": tally})
for step in run.iterations(args.steps):
    tally.total += (run.rank + 1) * step
    tally.count += 1
    if args.state_by_rank:
        run.state["total"], run.state["steps"] = torch.tensor(float(tally.total)), tally.count
    model(torch.ones(2, 2)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(args.pause)
run.finish()
print(f"TALLY {run.rank} {tally.rank} {tally.total} {tally.count}", flush=True)
