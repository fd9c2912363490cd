"""A network of its own for each node of a chaos trial, so that a node can be cut off.

Every daemon runs in its own network namespace (``ip netns``), joined to the others by a
veth pair on one bridge in the test's namespace; the bridge's address is where the test
serves the object-store proxy. Partitions drop packets silently, as a real network does
(no error that would make a daemon give up at once):

- ``isolate``: the node's veth goes down: cut off from everyone (coordinator, peers, store);
- ``cut``: a permanent neighbour entry to a MAC nobody has, on both sides of each pair:
  a node cut off from the coordinator only, or from its peers only.

Needs root and ``ip``; ``available()`` says whether it works here, else trials run on
loopback without partitions. Does I/O (it changes the host's network configuration, all of
it under names this object made and removes in ``close``).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterable

_OPENED = itertools.count()
BOGUS_MAC = "02:00:00:c4:a0:5f"
"""A locally administered address that no interface has: frames to it go nowhere."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def available() -> bool:
    """Root, ``ip`` on PATH, and a namespace can be made (not in every container)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"mtcprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError):
        return False
    _ip("netns", "del", name)
    return True


class Network:
    """``nodes`` namespaces on one bridge; node ``r`` has address ``10.77.<net>.<r+1>``."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.net = 0
        """The third octet of its subnet, chosen in ``open`` among those no one uses."""
        self._cut: set[tuple[int, int]] = set()
        self._isolated: set[int] = set()
        self._made: list[list[str]] = []

    @property
    def tag(self) -> str:
        return f"mtc{self.net}"

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def gateway(self) -> str:
        """The test's own address on the bridge: where daemons reach the store proxy."""
        return f"10.77.{self.net}.254"

    def ns(self, rank: int) -> str:
        return f"{self.tag}n{rank}"

    def address(self, rank: int) -> str:
        return f"10.77.{self.net}.{rank + 1}"

    def prefix(self, rank: int) -> tuple[str, ...]:
        """The command a node's daemon runs under."""
        return ("ip", "netns", "exec", self.ns(rank))

    def open(self) -> Network:
        """Make the bridge and the namespaces on the first subnet that is wholly free."""
        # Another run on this host (or a killed one's leftovers) may hold a subnet; so may
        # this process's previous network for a moment (namespaces go away asynchronously,
        # their veths with them): such a subnet is skipped, and nothing of it is touched.
        start = (os.getpid() + 37 * next(_OPENED)) % 200
        for i in range(200):
            self.net = (start + i) % 200 + 20
            try:
                self._make()
            except subprocess.CalledProcessError:
                self.close()
                continue
            return self
        raise RuntimeError("no free 10.77.x.0/24 subnet for a chaos network")

    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(["link", "del", self.bridge])
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for r in range(self.nodes):
            ns, veth = self.ns(r), f"{self.tag}v{r}"
            _ip("netns", "add", ns)
            self._made.append(["netns", "del", ns])
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Remove everything this network made (its namespaces take their veths along)."""
        for args in reversed(self._made):
            subprocess.run(["ip", *args], capture_output=True, check=False, timeout=30)
        self._made.clear()
        self._cut.clear()
        self._isolated.clear()

    # --- partitions ----------------------------------------------------------------------------

    def isolate(self, rank: int) -> None:
        """The node's link goes down: nothing in or out."""
        _ip("link", "set", f"{self.tag}v{rank}", "down")
        self._isolated.add(rank)

    def cut(self, rank: int, others: Iterable[int]) -> None:
        """Packets between ``rank`` and each of ``others`` vanish, both ways."""
        for other in others:
            for a, b in ((rank, other), (other, rank)):
                _ip(
                    "-n", self.ns(a), "neigh", "replace", self.address(b),
                    "lladdr", BOGUS_MAC, "dev", "eth0", "nud", "permanent",
                )  # fmt: skip
                self._cut.add((a, b))

    def heal(self) -> None:
        """Every partition healed: links up, the bogus neighbours gone (ARP finds the real)."""
        for rank in sorted(self._isolated):
            _ip("link", "set", f"{self.tag}v{rank}", "up")
        for a, b in sorted(self._cut):
            _ip("-n", self.ns(a), "neigh", "del", self.address(b), "dev", "eth0")
        self._isolated.clear()
        self._cut.clear()
