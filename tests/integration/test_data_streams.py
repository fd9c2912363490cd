"""One item over several data connections at once, between real daemons (mutual TLS):
a push with ``--data-streams 3`` on both sides, a restore pull the same way, and the lesser
of the two sides' counts when they differ (``core.stripes``; docs/protocol.md, "Data
streams")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.cluster import Cluster, assert_restored, running
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.integration


def took(cluster: Cluster, rank: int, transfer: str, connections: int) -> None:
    """Wait for ``rank``'s log line of ``transfer`` (a regex) over the data channel on
    ``connections`` connections: the line follows the commit the test waited for."""
    line = re.compile(rf"{transfer} over the data channel \({connections} connections\)")
    wait_until(
        lambda: line.search((cluster.root / f"node{rank}.log").read_text()) is not None,
        f"node {rank}'s line {line.pattern!r}",
        daemon=cluster.daemon(rank),
    )


def test_a_push_and_a_restore_pull_use_three_connections(tmp_path: Path) -> None:
    """Each rank's step (four files that carry bytes) crosses to its peer on three
    connections; node 1 then loses its RAM disk and pulls its step back from node 0 on
    three connections, byte for byte what it saved."""
    cluster = Cluster(tmp_path, "streams", ("--data-streams", "3"), backup=False, nodes=2)
    with running(cluster):
        cluster.fresh_start()
        files = cluster.write_step(5, sizes={0: 3 << 20, 1: 2 << 20})
        cluster.wait_saved(5)
        for rank, other in ((0, 1), (1, 0)):
            took(cluster, rank, rf"received streams/s5/n{other}-w0 from \S+", 3)
        cluster.wipe(1)
        cluster.handshake([1, 0])
        cluster.wait_markers(5)
        assert_restored(cluster, 5, files)
        assert cluster.source(1) == "peer"
        took(cluster, 0, r"sent streams/s5/n1-w0 to \S+", 3)


def test_the_side_that_allows_fewer_connections_decides(tmp_path: Path) -> None:
    """Node 0 asks for 3, node 1 allows 2: node 0's push to node 1 uses 2; node 1 asks for
    2 and node 0 allows 3: node 1's push uses 2 as well."""
    cluster = Cluster(tmp_path, "fewer", backup=False, nodes=2)
    cluster.extra = ("--data-streams", "3")
    with running(cluster):
        cluster.daemon(1).stop()
        cluster.extra = ("--data-streams", "2")
        cluster.start(1)
        cluster.fresh_start()
        cluster.write_step(5, sizes={0: 1 << 20, 1: 1 << 20})
        cluster.wait_saved(5)
        for rank, other in ((0, 1), (1, 0)):
            took(cluster, rank, rf"received fewer/s5/n{other}-w0 from \S+", 2)
