"""Hosts on one machine for the multi-host test: a network namespace per host, each with an
`eth0` on a bridge that lives in a namespace of its own (so the machine's own firewall and
routes are untouched), plus one veth from this process's namespace (the test's "driver" host,
which also runs PostgreSQL). A host is cut off the network with iptables DROP rules on its
eth0 in its own namespace (silently: packets vanish, connections hang, as when a link or a
switch fails) and put back by removing them.

Addresses come from 198.18.0.0/15, the range set aside for testing networks (RFC 2544),
never a real network's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import random
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.errors import KafkaError

from agl_stream.bus.kafka import admin_client
from agl_stream.embedded import kafka_node
from agl_stream.embedded.kafka_node import KafkaNode
from agl_stream.embedded.process import stop
from agl_stream.runtime.config import KafkaSettings

PREFIX = "aglmh"  # namespaces: aglmh-<pid>-<host>; interfaces: <= 15 characters


def unavailable() -> str | None:
    """Why the multi-host test cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root: network namespaces (ip netns) and iptables rules are root's"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"needs {tool} (Debian: apt-get install iproute2 iptables)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    try:
        rule = ["ip", "netns", "exec", probe, "iptables", "-A", "INPUT", "-j", "DROP"]
        tried = subprocess.run(rule, capture_output=True, text=True)
        if tried.returncode != 0:
            return f"iptables does not work in a network namespace here: {tried.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


@dataclass
class Network:
    """The hosts by name, their addresses, and which are cut off."""

    subnet: str  # e.g. 198.18.23
    hosts: dict[str, str] = field(default_factory=dict)  # name -> address
    cut: set[str] = field(default_factory=set)
    tag: str = field(default_factory=lambda: str(os.getpid()))

    @property
    def driver(self) -> str:
        """This process's address on the network."""
        return f"{self.subnet}.1"

    def namespace(self, host: str) -> str:
        return f"{PREFIX}-{self.tag}-{host}"

    def prefix(self, host: str) -> list[str]:
        """What runs a command on `host`."""
        ip = shutil.which("ip")
        assert ip is not None
        return [ip, "netns", "exec", self.namespace(host)]

    def _rules(self, host: str, verb: str) -> None:
        for chain, way in (("INPUT", "-i"), ("OUTPUT", "-o")):
            run(*self.prefix(host), "iptables", verb, chain, way, "eth0", "-j", "DROP")

    def cut_off(self, host: str) -> None:
        """Every packet in or out of the host's eth0 is dropped (its loopback still works)."""
        self._rules(host, "-I")
        self.cut.add(host)

    def reconnect(self, host: str) -> None:
        self._rules(host, "-D")
        self.cut.discard(host)


def _free_subnet() -> str:
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    for _ in range(100):
        subnet = f"198.18.{random.randrange(1, 255)}"
        if f"{subnet}." not in routes:
            return subnet
    raise RuntimeError("no free /24 in 198.18.0.0/16")


def _remove_stale() -> None:
    """Namespaces an earlier run left behind (its process is gone): removed."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        stale = len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit()
        if stale and not Path(f"/proc/{parts[1]}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextlib.contextmanager
def network(hosts: Sequence[str]) -> Iterator[Network]:
    """The hosts on one bridge; everything removed on the way out (processes running in a
    host must have been stopped first)."""
    _remove_stale()
    net = Network(_free_subnet())
    switch = net.namespace("switch")
    driver_if = f"{PREFIX}{net.tag[-6:]}"[:15]
    made: list[str] = []
    try:
        run("ip", "netns", "add", switch)
        made.append(switch)
        run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", switch, "link", "set", "br0", "up")
        # The driver: this namespace's end gets .1, the other joins the bridge.
        run("ip", "link", "add", driver_if, "type", "veth", "peer", "name", "d0", "netns", switch)
        run("ip", "addr", "add", f"{net.driver}/24", "dev", driver_if)
        run("ip", "link", "set", driver_if, "up")
        run("ip", "-n", switch, "link", "set", "d0", "master", "br0", "up")
        for i, host in enumerate(hosts):
            ns, port = net.namespace(host), f"p{i}"
            address = f"{net.subnet}.{11 + i}"
            run("ip", "netns", "add", ns)
            made.append(ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                "netns", switch)  # fmt: skip
            run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
            net.hosts[host] = address
        yield net
    finally:
        subprocess.run(["ip", "link", "del", driver_if], capture_output=True)
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextlib.asynccontextmanager
async def kafka_cluster(
    net: Network, home: Path, hosts: Sequence[str], settings: Mapping[str, object] | None = None
) -> AsyncIterator[list[KafkaNode]]:
    """An Apache Kafka node (broker and controller) on each of `hosts`, node ids 1, 2, ...
    in their order, with `settings` over the embedded ones (server.properties keys). Stopped
    on the way out: a node on a host still cut off is killed (no controlled shutdown can
    reach the others from there), the others stop as usual."""
    nodes = [KafkaNode(i + 1, 9092, 9093, host=net.hosts[h]) for i, h in enumerate(hosts)]
    for node in nodes:
        path = kafka_node.write_config(node, nodes, home)
        with path.open("a") as config:  # a later line wins
            config.writelines(f"{key}={value}\n" for key, value in (settings or {}).items())
    cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    await asyncio.to_thread(kafka_node.format_storage, nodes, home, cluster_id)
    pids = {n.node_id: kafka_node.start(n, home, net.prefix(hosts[n.node_id - 1])) for n in nodes}
    try:
        await asyncio.to_thread(kafka_node.wait_ready, pids, nodes, home)
        yield nodes
    finally:
        for host in list(net.cut):
            await asyncio.to_thread(stop, pids.pop(hosts.index(host) + 1), 0)
            net.reconnect(host)
        await asyncio.to_thread(kafka_node.stop_nodes, list(pids.values()))


async def fenced(kafka: KafkaSettings, node_id: int, within: float) -> float:
    """Until the cluster's metadata lists neither the node nor a partition it leads: the
    controller fenced it (no heartbeat from it within broker.session.timeout.ms, 9 s) and
    moved its leaders. Ask through brokers that answer (`kafka`'s servers). Returns the
    seconds it took."""
    began = time.monotonic()
    # Sent to a random broker of its metadata, the cut one too while listed: a short wait.
    asking = kafka.model_copy(update={"request_timeout_ms": 1000})
    async with admin_client(asking) as admin:
        while True:
            try:
                brokers = {b["node_id"] for b in (await admin.describe_cluster())["brokers"]}
                leaders = {
                    p["leader"] for t in await admin.describe_topics() for p in t["partitions"]
                }
            except KafkaError:  # sent to the cut broker while the metadata still listed it
                brokers = leaders = {node_id}
            if node_id not in brokers and node_id not in leaders:
                return time.monotonic() - began
            if time.monotonic() - began > within:
                raise TimeoutError(f"broker {node_id} still listed after {within:.0f} s")
            await asyncio.sleep(0.5)
