"""The test cluster's configuration for any number of nodes (`make cluster-up NODES=16`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cluster.cluster import FIRST_SLURMD_PORT, Layout, running_node_count, slurm_conf


@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_slurm_conf_declares_every_node_on_its_own_port(tmp_path: Path, nodes: int) -> None:
    layout = Layout(tmp_path, nodes)
    text = slurm_conf(layout, "thishost")
    names = re.findall(r"^NodeName=(\S+) .*Port=(\d+) CPUs=2 ", text, re.MULTILINE)
    assert names == [(f"node{i + 1}", str(FIRST_SLURMD_PORT + i)) for i in range(nodes)]
    assert f"PartitionName=debug Nodes=node[1-{nodes}] Default=YES" in text
    assert text.count("NodeAddr=127.0.0.1") == nodes
    layout.slurm_conf.write_text(text)
    assert running_node_count(layout) == nodes
