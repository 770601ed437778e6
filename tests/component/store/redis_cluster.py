"""A real Redis Cluster on 127.0.0.1, started by the tests: N primaries (and replicas), then a failover.

Nodes are plain `redis-server --cluster-enabled yes` processes on free ports (each also needs its bus port,
port + 10000), joined with `redis-cli --cluster create`. With `tls` (a CA, a certificate and its key) every
node listens with TLS only, and the cluster bus and replication use TLS too (`tls-cluster`,
`tls-replication`), as a managed Redis Cluster with in-transit encryption does. `cluster-node-timeout` is
short (1 s), so a killed primary is replaced by its replica within a few seconds, as in a production
failover.
"""

from __future__ import annotations

import random
import subprocess
import time
from pathlib import Path

import redis

from devstack.processes import port_free
from tests.component.store.redis_server import RedisServer, binary

NODE_TIMEOUT_MS = 1000
HASH_TAG = "limits"
"""The store's keys all carry `{limits}`: the one slot whose primary we fail over."""


def cluster_ports(count: int) -> list[int]:
    """Ports whose bus port (port + 10000) is free too."""
    out: list[int] = []
    while len(out) < count:
        port = random.randint(20_000, 40_000)
        if port not in out and port_free(port) and port_free(port + 10_000):
            out.append(port)
    return out


class RedisClusterNodes:
    def __init__(
        self, primaries: int = 3, replicas: int = 0, tls: tuple[Path, Path, Path] | None = None
    ) -> None:
        self.replicas = replicas
        self.tls = tls
        extra: tuple[str, ...] = ("--cluster-enabled", "yes", "--cluster-node-timeout", str(NODE_TIMEOUT_MS))
        if tls is not None:
            extra += ("--tls-cluster", "yes", "--tls-replication", "yes")
        # A replica may take over whatever the age of its data: the tests kill primaries seconds after start.
        extra += ("--cluster-replica-validity-factor", "0")
        ports = cluster_ports(primaries * (1 + replicas))
        self.nodes = {
            port: RedisServer(port, (*extra, "--cluster-config-file", f"nodes-{port}.conf"), tls=tls)
            for port in ports
        }

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{next(iter(self.nodes))}/0"

    def start(self) -> None:
        for node in self.nodes.values():
            node.start()
        addresses = [f"127.0.0.1:{port}" for port in self.nodes]
        subprocess.run(
            [binary("redis-cli"), "--cluster", "create", *addresses, *self._create_options()],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_ok()

    def _create_options(self) -> list[str]:
        options = ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        if self.tls is not None:
            options += ["--tls", "--cacert", str(self.tls[0])]
        return options

    def client(self, port: int) -> redis.Redis:
        if self.tls is None:
            return redis.Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=2)
        return redis.Redis(
            host="127.0.0.1",
            port=port,
            decode_responses=True,
            socket_timeout=2,
            ssl=True,
            ssl_ca_certs=str(self.tls[0]),
        )

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Every live node reports `cluster_state:ok` and names the same live primary for the store's slot."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                states, owners = set(), set()
                for port, node in self.nodes.items():
                    if node.proc is None:
                        continue
                    with self.client(port) as c:
                        states.add(c.cluster("INFO").get("cluster_state"))
                        owners.add(self._owner_seen_by(c))
                settled = states == {"ok"} and len(owners) == 1 and self.nodes[owners.pop()].proc is not None
                if settled and self._replicas_linked():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the Redis Cluster did not settle")

    def _replicas_linked(self) -> bool:
        """Every live replica has finished its sync with a live primary (only those can be promoted)."""
        for port, node in self.nodes.items():
            if node.proc is None:
                continue
            with self.client(port) as c:
                info = c.info("replication")
                if info["role"] == "slave" and info.get("master_link_status") != "up":
                    primary = int(info.get("master_port", 0))
                    if primary in self.nodes and self.nodes[primary].proc is not None:
                        return False
        return True

    def _owner_seen_by(self, client: redis.Redis) -> int:
        slot = int(client.cluster("KEYSLOT", f"{{{HASH_TAG}}}"))
        for start, end, primary, *_ in client.cluster("SLOTS"):
            if int(start) <= slot <= int(end):
                return int(primary[1])
        raise RuntimeError(f"slot {slot} is not served")

    def primary_of_store(self) -> int:
        """Port of the primary that holds every key of the store."""
        port = next(p for p, n in self.nodes.items() if n.proc is not None)
        with self.client(port) as c:
            return self._owner_seen_by(c)

    def flush(self) -> None:
        for port, node in self.nodes.items():
            if node.proc is None:
                continue
            with self.client(port) as c:
                if c.info("replication")["role"] == "master":
                    c.flushall()

    def kill(self, port: int) -> None:
        self.nodes[port].kill()

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()
