"""Benchmark 2: seconds from process start to the first finished step, hpc_ddp vs a bare
script that only does init_process_group and steps (bench/raw_ddp.py), and where hpc_ddp's
time goes (imports and config, rendezvous, MLflow, data)."""

from __future__ import annotations

from typing import Any

from bench.harness import hpc_ddp_args, launch, median, raw_args, write_result

MODEL: dict[str, Any] = {"hidden": [256, 256], "samples": 8192, "epochs": 1}
STAGES = ("entry_unix", "dist_ready_unix", "training_unix")


def run(repeats: int = 5) -> dict[str, Any]:
    bare, hpc, hpc_tracked, stages = [], [], [], []
    for _ in range(repeats):
        out, spawned = launch(2, "bench.raw_ddp", [*raw_args(**MODEL), "--steps", "1"])
        bare.append(out["first_step_unix"] - spawned)
        out, spawned = launch(2, "hpc_ddp.train", [*hpc_ddp_args(**MODEL), "train.max_steps=1"])
        hpc.append(out["first_step_unix"] - spawned)
        tracked_args = [a for a in hpc_ddp_args(**MODEL) if a != "tracking.enabled=false"]
        out, spawned = launch(2, "hpc_ddp.train", [*tracked_args, "train.max_steps=1"])
        hpc_tracked.append(out["first_step_unix"] - spawned)
        stages.append(
            {k.removesuffix("_unix"): out["timeline"][k] - spawned for k in STAGES}
            | {"first_step": out["first_step_unix"] - spawned}
        )
    result = {
        "bare_first_step_s": bare,
        "hpc_ddp_first_step_s": hpc,
        "hpc_ddp_with_mlflow_first_step_s": hpc_tracked,
        "bare_median_s": median(bare),
        "hpc_ddp_median_s": median(hpc),
        "hpc_ddp_with_mlflow_median_s": median(hpc_tracked),
        "stages_with_mlflow_median_s": {k: median([s[k] for s in stages]) for k in stages[0]},
    }
    print(
        f"first step: bare {median(bare):.2f} s, hpc_ddp {median(hpc):.2f} s, "
        f"with MLflow {median(hpc_tracked):.2f} s; stages {result['stages_with_mlflow_median_s']}",
        flush=True,
    )
    write_result("startup", result)
    return result


if __name__ == "__main__":
    run()
