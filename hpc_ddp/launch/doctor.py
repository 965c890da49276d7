"""`hpc-ddp doctor`: each rank prints its resolved plan and the launch checks, without any
process group. Run it exactly like training: `srun hpc-ddp doctor --config ...`.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Mapping
from typing import Any

from hpc_ddp.runtime.config import RuntimeConfig
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.plan import (
    LaunchPlan,
    describe_launch,
    gpu_binding_warning,
    micro_batch_size,
)
from hpc_ddp.trainer.config import Config


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


def diagnose(
    config: Config | RuntimeConfig, environ: Mapping[str, str], name: str = "doctor"
) -> dict[str, Any]:
    """This rank's plan and checks as plain data (the plan errors become a failed check).

    With the built-in trainer's config the global batch is checked too (``data.batch_size``);
    a script's settings (a RuntimeConfig) have no batch to check: the script divides its own."""
    from hpc_ddp.runtime.session.start import resolve_launch

    trainer = config if isinstance(config, Config) else None
    runtime = config.runtime if isinstance(config, Config) else config
    micro = None
    try:
        plan = resolve_launch(runtime, str(runtime.run.name or name), environ)
        if trainer is not None:
            micro = micro_batch_size(
                trainer.data.batch_size,
                plan.dist_env.world_size,
                trainer.train.grad_accum_steps,
                ("data.batch_size", "train.grad_accum_steps"),
            )
    except HpcDdpError as error:
        return {"ok": False, "checks": [["FAIL", str(error)]]}
    env = plan.dist_env
    checks = [["ok", f"launcher {env.launcher}: rank {env.rank} of {env.world_size}"]]
    if trainer is not None:
        checks.append(
            [
                "ok",
                f"global batch {trainer.data.batch_size} = {env.world_size} ranks x "
                f"{micro} x {trainer.train.grad_accum_steps} accumulation",
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


def print_report(report: dict[str, Any]) -> int:
    """Human lines plus one `doctor-json:` line for scripts; exit code 0 only if all pass."""
    label = f"[doctor rank {report.get('rank', '?')}/{report.get('world_size', '?')}]"
    if "plan" in report:
        print(f"{label} {report['plan']}")
    for status, text in report["checks"]:
        print(f"{label} {status:4} {text}")
    print("doctor-json: " + json.dumps(report, sort_keys=True))
    sys.stdout.flush()
    return 0 if report["ok"] else 2
