"""Nodes as hosts on one machine: each agent in a network namespace of its own, joined to
the controller's side by a bridge, so that a node's link can be cut (a real partition:
its sockets stall instead of closing).

Needs root and ``ip`` (iproute2).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def can_make_hosts() -> bool:
    """Whether this process may make namespaces and links (root, with ``ip``)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


@dataclass
class Hosts:
    """A bridge and, made on demand, one namespace per node; :meth:`close` removes all."""

    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    net: str = field(default_factory=lambda: f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}")
    # node name -> (namespace, host-side link, address)
    nodes: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    _bridge_up: bool = False

    @property
    def bridge(self) -> str:
        return f"rlb{self.tag}"

    @property
    def controller(self) -> str:
        """The controller's address on the bridge."""
        return f"{self.net}.1"

    def open(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_up = True
        ip("addr", "add", f"{self.controller}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def add(self, name: str) -> str:
        """Make node ``name``'s namespace and link; return its address."""
        index = len(self.nodes)
        if index > 240:
            raise RuntimeError("no addresses left on the bridge's /24")
        ns, link = f"rl{self.tag}n{index}", f"rlv{self.tag}n{index}"
        address = f"{self.net}.{10 + index}"
        self.nodes[name] = (ns, link, address)
        ip("netns", "add", ns)
        ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("link", "set", link, "master", self.bridge, "up")
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        return address

    def address(self, name: str) -> str:
        return self.nodes[name][2]

    def exec_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[name][0]]

    def cut(self, name: str) -> None:
        ip("link", "set", self.nodes[name][1], "down")

    def mend(self, name: str) -> None:
        ip("link", "set", self.nodes[name][1], "up")

    def close(self) -> None:
        for ns, link, _ in self.nodes.values():
            subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.nodes.clear()
        if self._bridge_up:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
            self._bridge_up = False
