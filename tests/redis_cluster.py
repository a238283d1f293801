"""A real local Redis Cluster for tests and benchmarks: six `redis-server --cluster-enabled yes` processes on loopback
(3 primaries, 1 replica each), each at free ports (clients and cluster bus) in its own folder, no persistence, a
password on every node (so the tier's AUTH is exercised), joined by `redis-cli --cluster create`. And the failures the
tests make: SIGKILL a node, promote a replica (CLUSTER FAILOVER TAKEOVER), start a dead node again (it rejoins as a
replica). Every wait polls the cluster with a deadline; nothing sleeps for a fixed time.

No pytest in here: tests/test_store_cluster.py's fixture wraps it, bench/bench_store_redis.py starts one too.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

from redisproc import RedisProcess, _AddressInUse, _binary, _die_with_parent, _free_port

PASSWORD = "kvbridge tests: the cluster's password"  # requirepass and masterauth of every node
NODE_TIMEOUT_MS = 5000  # cluster-node-timeout: well above a loaded 2-core machine's stalls; failovers are forced
_DEADLINE_S = 30.0
_POLL_S = 0.02


def cli_binary() -> str | None:
    return shutil.which("redis-cli") or shutil.which("valkey-cli")


def cluster_available() -> bool:
    return _binary() is not None and cli_binary() is not None


def _wait(check, what: str, deadline_s: float = _DEADLINE_S):
    """Poll check() until it returns something true (returned); RuntimeError naming `what` at the deadline."""
    deadline = time.monotonic() + deadline_s
    last = None
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # a node still starting, a view not yet agreed: poll again
            last = exc
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis cluster: {what} not within {deadline_s:.0f} s (last error: {last!r})")
        time.sleep(_POLL_S)


class ClusterNode(RedisProcess):
    """One node: RedisProcess's life cycle (a free port, another when it is taken, SIGTERM then SIGKILL, a restart at
    the same port), in cluster mode, with a cluster bus port of its own and the password."""

    def __init__(self, workdir: Path):
        super().__init__(workdir)
        self.bus_port = 0

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=PASSWORD, socket_timeout=5.0,
                           socket_connect_timeout=1.0)

    def pause(self) -> None:
        """SIGSTOP: the node hangs, its sockets stay open."""
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self._proc.pid, signal.SIGCONT)

    def _launch(self, binary: str) -> None:
        if not (self._fixed_port and self.bus_port):  # a restart keeps its bus port
            self.bus_port = _free_port()
        log_offset = self.logfile.stat().st_size if self.logfile.exists() else 0
        self._proc = subprocess.Popen([
            *_die_with_parent(), binary, "--port", str(self.port), "--cluster-port", str(self.bus_port),
            "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--save", "", "--appendonly", "no",
            "--dir", str(self.workdir), "--logfile", str(self.logfile), "--daemonize", "no",
            "--requirepass", PASSWORD, "--masterauth", PASSWORD,
            "--repl-diskless-sync-delay", "0"],  # a replica syncs at once, not after 5 s
            cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _DEADLINE_S
        while not self._answers():
            if self._proc.poll() is not None:
                self._proc = None
                if "Address already in use" in self._log_since(log_offset):
                    raise _AddressInUse()  # RedisProcess.start tries other ports
                raise RuntimeError(f"redis-server exited while starting at {self.port}:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                self._terminate()
                raise RuntimeError(f"redis-server at {self.port} did not answer within {_DEADLINE_S:.0f} s")
            time.sleep(_POLL_S)

    def _answers(self) -> bool:
        import redis

        try:
            with self.client() as c:
                return c.info("server")["process_id"] == self._proc.pid
        except (redis.RedisError, OSError):
            return False


class LocalCluster:
    """`primaries` primaries with `replicas` replicas each, on 127.0.0.1 (see the module docstring)."""

    def __init__(self, workdir: Path, primaries: int = 3, replicas: int = 1):
        self.nodes = [ClusterNode(Path(workdir) / f"node{i}") for i in range(primaries * (1 + replicas))]
        self.primaries, self.replicas = primaries, replicas

    def node(self, port: int) -> ClusterNode:
        return next(n for n in self.nodes if n.port == port)

    def url(self, **options) -> str:
        """redis+cluster:// with the password and every node (options: the tier's wait_replicas, wait_timeout_ms)."""
        query = "&".join(f"{k}={v}" for k, v in options.items())
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"redis+cluster://:{quote(PASSWORD, safe='')}@{hosts}" + (f"?{query}" if query else "")

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        try:
            for node in self.nodes:
                node.start()
            done = subprocess.run(
                [cli_binary(), "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                env={**os.environ, "REDISCLI_AUTH": PASSWORD}, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed ({done.returncode}):\n{done.stdout[-2000:]}"
                                   f"\n{done.stderr[-2000:]}")
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- views --------------------------------------------------------------------------------
    def view(self, node: ClusterNode) -> dict[int, tuple[str, int | None]]:
        """port -> (role, its primary's port) as `node` sees the cluster: role "primary" (holding slots),
        "replica", or "failed"."""
        with node.client() as c:
            lines = c.execute_command("CLUSTER", "NODES").decode().splitlines()
        ids = {line.split()[0]: int(line.split()[1].split("@")[0].rsplit(":", 1)[1]) for line in lines}
        roles = {}
        for line in lines:
            fields = line.split()
            port, flags = ids[fields[0]], fields[2].split(",")
            if "fail" in flags or "fail?" in flags or "noaddr" in flags:
                roles[port] = ("failed", None)
            elif "master" in flags:
                roles[port] = ("primary" if len(fields) > 8 else "primary without slots", None)
            else:
                roles[port] = ("replica", ids.get(fields[3]))
        return roles

    def primary_ports(self) -> list[int]:
        live = next(n for n in self.nodes if n.running)
        return sorted(p for p, (role, _) in self.view(live).items() if role == "primary")

    def replica_of(self, primary_port: int) -> int:
        live = next(n for n in self.nodes if n.running)
        return next(p for p, (role, of) in self.view(live).items() if role == "replica" and of == primary_port)

    def wait_healthy(self) -> None:
        """Until every running node says cluster_state:ok, they agree on who is primary and of which, there are
        `primaries` primaries, and every primary has its replicas attached and in sync."""
        def healthy() -> bool:
            live = [n for n in self.nodes if n.running]
            views = []
            for node in live:
                with node.client() as c:
                    if c.cluster("info")["cluster_state"] != "ok":
                        return False
                views.append({p: r for p, r in self.view(node).items() if self.node(p).running})
            if any(v != views[0] for v in views) or sum(r == "primary" for r, _ in views[0].values()) != self.primaries:
                return False
            for port, (role, _) in views[0].items():
                with self.node(port).client() as c:
                    info = c.info("replication")
                if role == "primary":  # (a primary calls a replica online before it has loaded what it was sent)
                    online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
                              and v.get("state") == "online"]
                    if len(online) < sum(of == port for _, of in views[0].values()):
                        return False
                elif info.get("master_link_status") != "up" or info.get("master_sync_in_progress"):
                    return False  # a replica still loading acknowledges nothing
            return all(self._confirms(port, sum(of == port for _, of in views[0].values()))
                       for port, (role, _) in views[0].items() if role == "primary")

        _wait(healthy, "a healthy cluster (state ok, one view, replicas in sync)")

    def key_on(self, port: int, prefix: str = "cluster-probe") -> bytes:
        """A key `<prefix>:<n>` that the primary at `port` holds."""
        from redis.crc import key_slot

        with self.node(port).client() as c:
            ranges = [(lo, hi) for lo, hi, primary, *_ in c.execute_command("CLUSTER", "SLOTS") if primary[1] == port]
        return next(k for k in (f"{prefix}:{i}".encode() for i in range(1 << 20))
                    if any(lo <= key_slot(k) <= hi for lo, hi in ranges))

    def _confirms(self, port: int, replicas: int) -> bool:
        """Whether a write to the primary at `port` is confirmed by its replicas now: after a full sync a primary
        streams to its replica only once it hears from it (up to a second later), and till then a WAIT times out."""
        key = self.key_on(port)
        with self.node(port).client() as c:
            c.set(key, b"1", px=1000)
            return c.execute_command("WAIT", replicas, 100) >= replicas

    # -- failures -----------------------------------------------------------------------------
    def kill(self, port: int) -> None:
        self.node(port).kill()

    def takeover(self, replica_port: int) -> None:
        """Promote a replica whose primary is dead, without the cluster's agreement (CLUSTER FAILOVER TAKEOVER),
        and wait until every running node sees it as a primary with slots."""
        with self.node(replica_port).client() as c:
            c.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        _wait(lambda: all(self.view(n).get(replica_port, ("?",))[0] == "primary" for n in self.nodes if n.running),
              f"node {replica_port} promoted in every node's view")

    def failover(self, replica_port: int) -> None:
        """A graceful failover (CLUSTER FAILOVER on a replica of a live primary): the two swap roles, nothing is
        lost; waits until the cluster is healthy again."""
        with self.node(replica_port).client() as c:
            c.execute_command("CLUSTER", "FAILOVER")
        _wait(lambda: all(self.view(n).get(replica_port, ("?",))[0] == "primary" for n in self.nodes if n.running),
              f"node {replica_port} promoted in every node's view")
        self.wait_healthy()

    def node_id(self, port: int) -> str:
        with self.node(port).client() as c:
            return c.execute_command("CLUSTER", "MYID").decode()

    def restart(self, port: int) -> None:
        """Start a dead node again at its ports, from its nodes.conf: it finds its slots served by a newer primary,
        becomes that one's replica and syncs (waited for)."""
        self.node(port).restart()
        self.wait_healthy()

    def heal(self) -> None:
        """Start again any node that is down (a test that failed half-way through a failover) and wait until the
        cluster is healthy."""
        for node in self.nodes:
            if not node.running:
                node.restart()
        self.wait_healthy()

    def flush(self) -> None:
        """Empty every primary (replicas follow)."""
        for port in self.primary_ports():
            with self.node(port).client() as c:
                c.flushall()
        for node in self.nodes:  # and wait until the replicas have it
            if node.running:
                _wait(lambda n=node: self._empty(n), f"node {node.port} empty")

    @staticmethod
    def _empty(node: ClusterNode) -> bool:
        with node.client() as c:
            return c.dbsize() == 0
