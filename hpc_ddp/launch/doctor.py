"""`hpc-ddp doctor`: each rank prints its resolved plan and the launch checks, without any
process group. Run it exactly like training: `srun hpc-ddp doctor --config ...`.

Each rank writes its lines to the same merged output as the others, so a line goes out in
one write (srun keeps a task's line whole up to 1 KB and cuts longer ones into pieces that
other tasks' pieces may land between): the whole report, for scripts, goes to a file of its
own per rank (``--json-dir``), whole at any size whatever merges the ranks' output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.config import ChecksConfig, RuntimeConfig
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.checking import own_checks
from hpc_ddp.runtime.place.plan import (
    LaunchPlan,
    describe_launch,
    gpu_binding_warning,
    micro_batch_size,
)
from hpc_ddp.runtime.safefiles import make_dirs, replace_bytes


def _check_master_resolves(plan: LaunchPlan) -> tuple[str, str]:
    host = plan.dist_env.master_addr
    try:
        addresses = sorted({info[4][0] for info in socket.getaddrinfo(host, None)})
    except OSError as error:
        return "FAIL", f"MASTER_ADDR {host!r} does not resolve on this node ({error})"
    return "ok", f"MASTER_ADDR {host} -> {', '.join(map(str, addresses))}"


def _check_port_free(plan: LaunchPlan) -> tuple[str, str]:
    env = plan.dist_env
    if env.world_size == 1 or env.rank != 0 or env.store_hosted_by_launcher:
        return "ok", "port checked by rank 0 only" if env.world_size > 1 else "no rendezvous needed"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", env.master_port))
        except OSError:
            return "FAIL", (
                f"port {env.master_port} is in use on {env.hostname}; set dist.master_port or "
                "MASTER_PORT"
            )
    return "ok", f"port {env.master_port} is free on {env.hostname}"


#: The built-in trainer's batch as its config sets it: (global batch, accumulation steps).
TrainerBatch = tuple[int, int]


def diagnose(
    runtime: RuntimeConfig,
    environ: Mapping[str, str],
    name: str = "doctor",
    batch: TrainerBatch | None = None,
) -> dict[str, Any]:
    """This rank's plan and checks as plain data (the plan errors become a failed check).

    ``batch``: the built-in trainer's (data.batch_size, train.grad_accum_steps), checked
    against the world size; a script has no batch to check here: it divides its own."""
    from hpc_ddp.runtime.session.joining import resolve_launch

    try:
        plan = resolve_launch(runtime, str(runtime.run.name or name), environ)
        report = plan_report(plan, batch)
    except HpcDdpError as error:
        return {"ok": False, "checks": [["FAIL", str(error)]]}
    if runtime.checks.enabled:
        report["checks"] += health_lines(plan, runtime.checks, environ)
        report["ok"] = all(status != "FAIL" for status, _ in report["checks"])
    return report


def health_lines(
    plan: LaunchPlan, settings: ChecksConfig, environ: Mapping[str, str]
) -> list[list[str]]:
    """The checks training runs before its first step, but the collective one (doctor starts
    no process group); the run directory's write is tried in its nearest existing folder."""
    probed = plan.run_dir
    while not probed.is_dir() and probed != probed.parent:
        probed = probed.parent
    own = own_checks(dataclasses.replace(plan, run_dir=probed), settings, environ, False)
    if own.findings:
        return [["FAIL", finding.line()] for finding in own.findings]
    took = ", ".join(f"{check} {seconds:.2f} s" for check, seconds in own.seconds.items())
    return [["ok", f"checks before the first step passed ({took}; the collective path is "
             "checked when training starts)"]]  # fmt: skip


def plan_report(plan: LaunchPlan, batch: TrainerBatch | None = None) -> dict[str, Any]:
    """What ``hpc-ddp doctor`` and the trainer's ``--dry-run`` report of a resolved launch:
    where this rank runs, what it drives, and the checks (each ["ok" | "warn" | "FAIL",
    text]); a batch that does not divide over the ranks raises."""
    env = plan.dist_env
    checks = [["ok", f"launcher {env.launcher}: rank {env.rank} of {env.world_size}"]]
    micro = None
    if batch is not None:
        global_batch, accumulation = batch
        micro = micro_batch_size(
            global_batch,
            env.world_size,
            accumulation,
            ("data.batch_size", "train.grad_accum_steps"),
        )
        checks.append(
            [
                "ok",
                f"global batch {global_batch} = {env.world_size} ranks x {micro} x "
                f"{accumulation} accumulation",
            ]
        )
    checks += [
        ["ok", f"device {','.join(plan.device.devices)} ({plan.device.reason})"],
        list(_check_master_resolves(plan)),
        list(_check_port_free(plan)),
    ]
    binding = gpu_binding_warning(env, plan.device)
    if binding:
        checks.append(["warn", binding])
    return {
        "ok": all(status != "FAIL" for status, _ in checks),
        "host": env.hostname,
        "rank": env.rank,
        "local_rank": env.local_rank,
        "world_size": env.world_size,
        "local_world_size": env.local_world_size,
        "node_rank": env.node_rank,
        "num_nodes": env.num_nodes,
        "launcher": env.launcher,
        "job_id": env.job_id,
        "master_addr": env.master_addr,
        "master_port": env.master_port,
        "device": plan.device.device,
        "devices": list(plan.device.devices),
        "backend": plan.device.backend,
        "cuda_visible_devices": env.cuda_visible_devices,
        "per_rank_batch": micro,
        "plan": describe_launch(plan),
        "checks": checks,
    }


def report_path(json_dir: Path, report: Mapping[str, Any], environ: Mapping[str, str]) -> Path:
    """Where a rank's report goes in ``json_dir``: ``doctor-rank-<rank>.json``; a rank whose
    plan failed (no rank known) is named by the launcher's task id, or else host and pid."""
    rank = report.get("rank")
    if rank is None:  # torchrun's RANK first: under it, SLURM_PROCID numbers the nodes
        task = environ.get("RANK") or environ.get("SLURM_PROCID")
        rank = task if task is not None else f"unknown-{socket.gethostname()}-{os.getpid()}"
    return json_dir / f"doctor-rank-{rank}.json"


#: The longest line doctor prints: srun keeps lines of up to 1 KB whole.
LINE_BYTES = 1000


def labelled_pieces(label: str, text: str, most: int = LINE_BYTES) -> list[str]:
    """``text`` after ``label`` in lines of at most ``most`` bytes (UTF-8), each labelled (a
    line of ``text`` too: an error's HINT); a piece that goes on from the one before starts
    with "...". Pure."""
    if "\n" in text:
        return [piece for line in text.split("\n") for piece in labelled_pieces(label, line, most)]
    pieces: list[str] = []
    room = most - len(label.encode()) - 5
    while True:
        piece = text.encode()[:room].decode(errors="ignore")  # never half a character
        pieces.append(f"{label} {'... ' if pieces else ''}{piece}")
        text = text[len(piece) :]
        if not text:
            return pieces


def print_report(report: dict[str, Any], json_dir: Path | None, environ: Mapping[str, str]) -> int:
    """Human lines on stdout, each in one write, and (``json_dir``) the whole report as JSON in
    a file of this rank's own; exit code 0 only if all pass."""
    label = f"[doctor rank {report.get('rank', '?')}/{report.get('world_size', '?')}]"
    texts = [report["plan"]] if "plan" in report else []
    texts += [f"{status:4} {text}" for status, text in report["checks"]]
    lines = [line for text in texts for line in labelled_pieces(label, text)]
    if json_dir is not None:
        path = report_path(json_dir, report, environ)
        try:
            make_dirs(json_dir)
            replace_bytes(path, (json.dumps(report, sort_keys=True) + "\n").encode())
        except OSError as error:
            raise HpcDdpError(
                f"hpc-ddp doctor --json-dir {json_dir}: cannot write {path.name} there "
                f"({error.strerror or error})",
                "pass a folder this user can write, on a file system every node sees",
            ) from None
        lines.append(f"{label} report: {path}")
    for line in lines:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    return 0 if report["ok"] else 2
