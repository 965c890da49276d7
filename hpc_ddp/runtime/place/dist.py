"""Process group up and down, with bounded waits and errors that say which side is missing;
and the few cross-rank helpers the runtime uses, each a no-op without a group of 2 or more."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import time
from collections.abc import MutableMapping
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import (  # type: ignore[attr-defined]
    HashStore,
    PrefixStore,
    Store,
    TCPStore,
)

from hpc_ddp.runtime.config import DistConfig
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.env import DistEnv
from hpc_ddp.runtime.place.plan import DevicePlan

T = TypeVar("T")


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else "timeout"


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    """Return once something accepts connections at host:port; TimeoutError at ``deadline``,
    saying what the last attempt met (one attempt is made however close the deadline)."""
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=min(max(left, 0.1), 5.0)).close()
            return
        except OSError as error:
            last = error.strerror or str(error)
        if deadline - time.monotonic() <= 0:
            raise TimeoutError(f"no answer at {host}:{port} ({last})")
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def store_listen_host(master_addr: str, num_nodes: int) -> str | None:
    """The one address rank 0's store listens on: the announced one (loopback for a local
    run), so nothing else on the host or its network can reach the store, which takes any
    client without credentials. None (every interface, torch's default) when the name does
    not resolve here, or resolves to loopback in a job of several nodes (a node whose
    /etc/hosts maps its own name to 127.0.1.1: the other nodes reach it by another
    address)."""
    try:
        found = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    host = str(found[0][4][0])
    if ipaddress.ip_address(host.split("%")[0]).is_loopback and num_nodes > 1:
        return None
    return host


def _listening_socket(host: str, port: int) -> int:
    """A socket listening on ``host``:``port`` only, handed over to the store as its fd."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(1024)
    except BaseException:
        listener.close()
        raise
    return listener.detach()


def _rendezvous_store(dist_env: DistEnv, init_timeout_s: float) -> Store:
    """The store all ranks meet in; every wait on it is bounded by ``init_timeout_s``."""
    if dist_env.world_size == 1:
        return HashStore()
    hosts_store = dist_env.rank == 0 and not dist_env.store_hosted_by_launcher
    where = f"{dist_env.master_addr}:{dist_env.master_port}"
    deadline = time.monotonic() + init_timeout_s
    try:
        if not hosts_store:
            # Wait for the port here: torch's own timeout logs pages of C++ frames.
            _wait_for_listener(dist_env.master_addr, dist_env.master_port, deadline)
        listen_host = (
            store_listen_host(dist_env.master_addr, dist_env.num_nodes) if hosts_store else None
        )
        store = TCPStore(
            host_name=dist_env.master_addr,
            port=dist_env.master_port,
            world_size=dist_env.world_size,
            is_master=hosts_store,
            timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())),
            wait_for_workers=True,
            master_listen_fd=(
                _listening_socket(listen_host, dist_env.master_port) if listen_host else None
            ),
        )
        if dist_env.store_hosted_by_launcher:
            # torchrun's agent keeps its store across worker restarts: the keys of the
            # workers it restarted (their gloo addresses) would be read as this round's.
            return PrefixStore(f"hpc_ddp/attempt_{dist_env.elastic_restarts}", store)
        return store
    except (RuntimeError, dist.DistError, TimeoutError, OSError) as error:
        text = str(error)
        in_use = isinstance(error, OSError) and error.errno == errno.EADDRINUSE
        if in_use or "address already in use" in text.lower() or "EADDRINUSE" in text:
            raise HpcDdpError(
                f"rank 0 cannot listen on rendezvous port {where}: it is already in use",
                "another job on this node holds the port; set dist.master_port=<free port> "
                "(or export MASTER_PORT) to pick another",
            ) from None
        if hosts_store and isinstance(error, OSError) and not isinstance(error, TimeoutError):
            raise HpcDdpError(
                f"rank 0 cannot listen on rendezvous address {where}: {error.strerror or error}",
                "MASTER_ADDR must name this host (rank 0's); check it, or leave it to the launcher",
            ) from None
        if hosts_store:
            raise HpcDdpError(
                f"rank 0 waited {init_timeout_s:g} s at {where} and not all "
                f"{dist_env.world_size} ranks arrived",
                "some ranks never started or cannot reach this host: check the job's other "
                "tasks' logs, that every task was started by the same srun, and "
                "dist.init_timeout_s",
            ) from None
        raise HpcDdpError(
            f"rank {dist_env.rank} on {dist_env.hostname} could not reach the rendezvous at "
            f"{where} within {init_timeout_s:g} s ({_first_line(text)})",
            "check that rank 0 is running, that MASTER_ADDR resolves from this node and that the "
            "port is not firewalled; raise dist.init_timeout_s if nodes start slowly",
        ) from None


#: gloo connects each pair of ranks only when they first talk, instead of every rank to every
#: other when a group is made: without it each rank holds W-1 sockets per gloo group and
#: making the group costs O(W) connections per rank (O(W^2) over the job).
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


def export_gloo_lazy_init(environ: MutableMapping[str, str]) -> bool:
    """Turn on gloo's lazy connections (read by torch when a gloo group is made) unless the
    user set TORCH_GLOO_LAZY_INIT; returns whether it wrote it."""
    if GLOO_LAZY_INIT in environ:
        return False
    environ[GLOO_LAZY_INIT] = "1"
    return True


def init_distributed(
    dist_env: DistEnv,
    device: DevicePlan,
    config: DistConfig,
    timeline: dict[str, float] | None = None,
) -> None:
    """Select the GPU (before NCCL starts), meet the other ranks, build the process group.
    ``timeline`` gets ``rendezvous_unix``: when this rank reached the store."""
    if device.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device.device))
    export_gloo_lazy_init(os.environ)
    store = _rendezvous_store(dist_env, config.init_timeout_s)
    if timeline is not None:
        timeline["rendezvous_unix"] = time.time()
    dist.init_process_group(
        backend=device.backend,
        store=store,
        rank=dist_env.rank,
        world_size=dist_env.world_size,
        timeout=timedelta(seconds=config.timeout_s),
        device_id=torch.device(device.device) if device.backend == "nccl" else None,
    )


def shutdown_distributed() -> None:
    """Destroy the process group if one exists (on the clean path)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def several_ranks() -> bool:
    """True inside a process group of two or more ranks: only then do collectives talk."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(values: torch.Tensor, group: Any | None = None) -> torch.Tensor:
    """Sum ``values`` over all ranks in place and return it (a no-op without a group)."""
    if several_ranks():
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def same_on_all_ranks(value: int, group: Any | None = None) -> bool:
    """Whether every rank holds the same 64-bit ``value``: one MAX all-reduce of the value and
    its negation, two numbers whatever the world size (True without a group)."""
    if not several_ranks():
        return True
    extremes = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    return bool(extremes[0] == -extremes[1])


def broadcast_object(value: T, group: Any | None = None) -> T:
    """Rank 0's ``value`` on every rank (any picklable object)."""
    if not several_ranks():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


def all_gather_object(value: T, group: Any | None = None) -> list[T]:
    """Every rank's ``value``, in rank order (any picklable object)."""
    if not several_ranks():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def gather_object_to_main(value: T, group: Any | None = None) -> list[T]:
    """Every rank's ``value`` in rank order on rank 0, [] elsewhere: rank 0 receives W
    objects, the others send one (an all-gather would send every rank W objects)."""
    if not several_ranks():
        return [value]
    is_main = dist.get_rank() == 0
    gathered: list[Any] | None = [None] * dist.get_world_size() if is_main else None
    dist.gather_object(value, gathered, dst=0, group=group)
    return gathered or []
