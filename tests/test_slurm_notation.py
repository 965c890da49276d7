"""Slurm's host-list and tasks-per-node notations, and the derived port (pure functions)."""

from __future__ import annotations

import pytest

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.slurm import (
    PORT_BASE,
    PORT_SPAN,
    derive_master_port,
    expand_hostlist,
    expand_tasks_per_node,
)


@pytest.mark.parametrize(
    ("hostlist", "expected"),
    [
        ("node1", ["node1"]),
        ("gpu[001-004,010]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("a,b[1-3],c", ["a", "b1", "b2", "b3", "c"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("x[7]", ["x7"]),
        ("gpu-a100-[1,3],cpu[02-03]", ["gpu-a100-1", "gpu-a100-3", "cpu02", "cpu03"]),
        ("node1.cluster.edu,node2.cluster.edu", ["node1.cluster.edu", "node2.cluster.edu"]),
        # Set by hand: spaces separate hosts as in Slurm's own reading of a host list.
        ("alpha beta gamma", ["alpha", "beta", "gamma"]),
        (" a, b[1-2]\n c ", ["a", "b1", "b2", "c"]),
    ],
)
def test_expand_hostlist(hostlist: str, expected: list[str]) -> None:
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize(
    ("hostlist", "message"),
    [
        ("node[1-2", "unbalanced '['"),
        ("node1-2]", "unbalanced ']'"),
        ("node[4-2]", "runs backwards"),
        ("node[a-b]", "cannot read range 'a-b'"),
        ("a,,b", "empty entry"),
        ("", "empty"),
    ],
)
def test_expand_hostlist_rejects_bad_input_quoting_it(hostlist: str, message: str) -> None:
    with pytest.raises(HpcDdpError, match=message.replace("[", r"\[")) as caught:
        expand_hostlist(hostlist)
    if hostlist:
        assert repr(hostlist) in str(caught.value)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("4", [4]),
        ("2(x3)", [2, 2, 2]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("1,2(x2),3", [1, 2, 2, 3]),
    ],
)
def test_expand_tasks_per_node(spec: str, expected: list[int]) -> None:
    assert expand_tasks_per_node(spec) == expected


@pytest.mark.parametrize("spec", ["", "2(3)", "x", "2(x)", "-1"])
def test_expand_tasks_per_node_rejects(spec: str) -> None:
    with pytest.raises(HpcDdpError, match="tasks-per-node"):
        expand_tasks_per_node(spec)


def test_port_is_deterministic_in_range_and_separates_neighbours() -> None:
    ports = {derive_master_port(job) for job in range(100_000, 102_000)}
    assert len(ports) == 2000, "2000 consecutive job ids must get 2000 distinct ports"
    assert all(PORT_BASE <= port < PORT_BASE + PORT_SPAN for port in ports)
    assert derive_master_port(123456, 0) == derive_master_port(123456, 0)
    assert derive_master_port(123456, 0) != derive_master_port(123456, 1)
    assert derive_master_port(4242, 3) == 10000 + 242 * 10 + 3


@pytest.mark.parametrize(
    ("hostlist", "count"),
    [
        ("n[0-99999999]", "100,000,000"),  # counted from the range, never built
        ("a[0-999]-b[0-999]", "1,000,000"),
        (",".join("x[0-9999]" for _ in range(7)), "70,000"),
    ],
)
def test_a_host_list_beyond_any_cluster_is_refused_before_it_is_built(
    hostlist: str, count: str
) -> None:
    with pytest.raises(HpcDdpError) as caught:
        expand_hostlist(hostlist)
    message = str(caught.value)
    assert f"names {count} hosts, more than 65,536" in message and len(message) < 400
    assert "HINT: check SLURM_STEP_NODELIST" in message


def test_messages_quote_long_input_cut_short() -> None:
    with pytest.raises(HpcDdpError) as caught:
        expand_hostlist("node[1-2]," * 50_000 + "bad[x]")
    message = str(caught.value)
    assert len(message) < 500 and "characters)" in message
