"""Benchmark: a sweep's record at 100, 10,000 and 100,000 tasks.

`hpc-ddp sweep submit` against a stand-in sbatch and scontrol (MaxArraySize 1001, as
Slurm's default) that answer at once, so the figures are hpc_ddp's own cost: the seconds
to check, record and submit the sweep, then what each task's start and end costs (they
change only their own state file) and what `sweep status` costs to read the record once
every task has run.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import REPO, write_result

SIZES = (100, 10_000, 100_000)
#: Tasks whose start and end are timed at each size.
TIMED_TASKS = 200
STAND_INS = {
    "sbatch": '#!/bin/sh\nn=$(($(cat "$0.count" 2>/dev/null || echo 0) + 1))\n'
    'echo "$n" > "$0.count"\necho "$n"\n',
    "scontrol": "#!/bin/sh\necho 'MaxArraySize            = 1001'\n",
}


def _stand_ins(folder: Path) -> dict[str, str]:
    for name, text in STAND_INS.items():
        path = folder / name
        path.write_text(text)
        path.chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{folder}:{os.environ['PATH']}",
        "HPC_DDP_OVERRIDES": "tracking.enabled=false",
    }


def _one_size(tasks: int, folder: Path) -> dict[str, Any]:
    from hpc_ddp.launch.program import Program
    from hpc_ddp.launch.sbatch import RenderRequest
    from hpc_ddp.sweep import manifest
    from hpc_ddp.sweep.spec import spec_from_dict
    from hpc_ddp.sweep.submit import submit_sweep

    environ = _stand_ins(folder)
    raw = {"name": "s", "grid": {"--seed": list(range(tasks))}, "max_tasks": tasks}
    spec = spec_from_dict(raw, "bench")
    program = Program("script", str(REPO / "tests" / "programs" / "regression.py"))
    began = time.perf_counter()
    sweep_dir = submit_sweep(
        spec, program, RenderRequest(arguments=()), folder / "out", environ, lambda _: None
    )
    submit_s = time.perf_counter() - began
    arrays = len(manifest.read_manifest(sweep_dir)["arrays"])

    def started(task: dict[str, Any]) -> None:
        task.update(state="running", attempts=task["attempts"] + 1)

    def ended(task: dict[str, Any]) -> None:
        task.update(state="finished", final={"val_loss": 0.5}, step=100)

    changes = []
    step = max(1, tasks // TIMED_TASKS)
    for index in range(tasks):
        timed = index % step == 0
        began = time.perf_counter()
        _data, task = manifest.read_task(sweep_dir, index) if timed else (None, {})
        if not timed:  # every task runs, untimed, so the record is as full as a real one's
            task = {"run_id": manifest.run_id_for(index, tasks), "attempts": 0}
        manifest.update_tasks(sweep_dir, [task], started)
        manifest.update_tasks(sweep_dir, [task], ended)
        if timed:
            changes.append(time.perf_counter() - began)
    began = time.perf_counter()
    record = manifest.read_manifest(sweep_dir)
    status_s = time.perf_counter() - began
    assert sum(task["state"] == "finished" for task in record["tasks"]) == tasks
    result = {
        "tasks": tasks,
        "arrays": arrays,
        "submit_s": submit_s,
        "task_start_and_end_median_s": statistics.median(changes),
        "record_read_s": status_s,
        "sweep_json_bytes": (sweep_dir / manifest.MANIFEST_FILE).stat().st_size,
    }
    print(
        f"{tasks} tasks: submit {submit_s:.2f} s ({arrays} arrays), a task's start and end "
        f"{result['task_start_and_end_median_s'] * 1000:.1f} ms, the whole record read "
        f"{status_s:.2f} s",
        flush=True,
    )
    return result


def run(sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    rows = []
    for tasks in sizes:
        with tempfile.TemporaryDirectory(prefix="hpc-ddp-sweep-bench-") as folder:
            rows.append(_one_size(tasks, Path(folder)))
    result = {"sizes": rows}
    write_result("sweep_scale", result)
    return result


if __name__ == "__main__":
    run(tuple(int(word) for word in sys.argv[1:]) or SIZES)
