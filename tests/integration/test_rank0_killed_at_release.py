"""Rank 0's daemon killed after its coordinator released a round and before its own agent
published the markers (chaos seed 4112), against two real daemons.

The other rank took its marker and runs on; the restarted daemon resumes its incarnation
still restoring. Before, its fresh coordinator opened a new round that the running rank
never joined (its progress reports were refused, "join again"), and rank 0 waited for it
forever. Now the release left a record in rank 0's store before anyone heard of it, and
the restarted coordinator serves the same round again: rank 0's markers name the step the
other rank restored, and the running rank's reports count (it hears the next restorable
step).

The window is a fraction of a second wide, so the test puts the node in it: kill -9 after
the release, rank 0's saved incarnation set back to restoring and its markers removed,
which is what a kill inside the window leaves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtc_replicator.node.saved_incarnation import STATE_FILE
from tests.integration.cluster import Cluster, assert_restored, running
from tests.integration.helpers import store_root, wait_until

pytestmark = pytest.mark.integration


def test_rank_0_killed_between_the_release_and_its_markers_gets_them(tmp_path: Path) -> None:
    with running(Cluster(tmp_path, "window", nodes=2, backup=False)) as cluster:
        cluster.fresh_start()
        files = cluster.save(10)
        cluster.handshake([1, 0])  # the job restarts: every rank restores step 10
        cluster.wait_markers(10)
        assert_restored(cluster, 10, files)

        # The markers go before the saved incarnation reads steady: wait for both.
        state = store_root(cluster.dirs[0]) / STATE_FILE
        wait_until(
            lambda: json.loads(state.read_text())["phase"] == "steady",
            "rank 0's saved incarnation to read steady",
            daemon=cluster.daemon(0),
        )
        cluster.daemon(0).kill()
        body = json.loads(state.read_text())
        assert body["phase"] == "steady"
        state.write_text(json.dumps(body | {"phase": "restoring"}))
        for marker in cluster.dirs[0].glob("*.restore"):
            marker.unlink()
        cluster.start(0)

        wait_until(
            lambda: cluster.markers(0) == [f"{cluster.job}-s10-n0-w0.restore"],
            "rank 0's marker of step 10 again",
            daemon=cluster.daemon(0),
            timeout=30,
        )
        assert_restored(cluster, 10, files)
        assert "serving released round" in cluster.daemon(0).log()
        # Rank 1 never left the released round: its reports are answered, and it hears
        # the job's next restorable step.
        cluster.save(20)
        wait_until(
            lambda: "restorable step of the cluster: 20" in cluster.daemon(1).log(),
            "rank 1 to hear that step 20 is restorable",
            daemon=cluster.daemon(1),
            timeout=60,
        )
