"""The Redis tier's commands on a Redis Cluster (a redis+cluster:// URL, redis_url): redis-py's own RedisCluster,
and writes acknowledged only once a replica holds them.

Routing is redis-py's slot map. Reads and small writes go through redis-py's commands and pipelines: MOVED and ASK
are followed, a connection refused or a CLUSTERDOWN makes it read the slot map again and retry (`RETRIES` times, no
backoff: a failover the cluster has not finished is an error, and the tier reports itself down until its next try).
Multi-key commands become one per slot (`mget_nonatomic`, DEL); nothing runs in MULTI or Lua across keys. Blocks go
out as the one-server tier sends them, packed, each from its tensor, one connection per primary the map names, WAIT
after them (`send_sets`); whatever a primary does not answer OK (MOVED, ASK, TRYAGAIN, a connection lost) is sent
again through redis-py's pipeline, which handles it as above. The client is made on first use, so that a store
starts while the cluster is unreachable, as it does with one server.

Writes and replicas. A primary answers a write before its replicas have it (replication is asynchronous): if it dies
in that window and a replica is promoted, the write is gone though the tier was told OK. So with `wait_replicas` >= 1
(the default, 1) a write the tier acknowledges was confirmed by that many replicas: `WAIT wait_replicas
wait_timeout_ms` on the connection that sent it; for what redis-py sent (retries, entry records), `confirm`: on one
connection to each primary the map names now, a PEXPIRE of each key to the TTL it was written with (is it there?)
then WAIT. A replica's acknowledgment covers everything before it in its primary's replication stream, so a WAIT that
counts enough replicas covers every write that primary answered, on whatever connection. Keys not found, a WAIT short
of replicas (a shard whose replica is down, a primary promoted a moment ago that has none yet, or whose replica has
just synced: a primary streams to it only once it next hears from it, up to a second later), a node out of reach, a
slot being migrated (the PEXPIRE meets ASK): the write is reported as not stored (`RedisStats.unreplicated`) and its
value stays (it is correct; a failover may drop it). What is left: a confirmed write is lost only if its replica fails
too before it is promoted. Deletes are not confirmed: a failover may bring back, until its TTL, a value deleted just
before, one a replica wrote and signed.
"""

from __future__ import annotations

import threading

from kvbridge.transfer.store.redis_commands import Commands, Item, Seal, Sealing, packed_sets
from kvbridge.transfer.store.redis_url import ClusterUrl

RETRIES = 3  # redis-py re-reads the slot map and retries a command this many times after a connection error


class ClusterCommands(Commands):
    """RedisTier's commands on a cluster (see the module docstring)."""

    tagged = True

    def __init__(self, target: ClusterUrl, timeout_s: float):
        import redis  # imported here: the store works without the package when no Redis tier is configured

        if target.wait_replicas and target.wait_timeout_ms >= timeout_s * 1000:
            raise ValueError(f"wait_timeout_ms {target.wait_timeout_ms} must be below the redis tier's socket "
                             f"timeout ({timeout_s * 1000:.0f} ms), or every WAIT would time out the connection")
        exc = redis.exceptions
        # ClusterError: CLUSTERDOWN and the like (the cluster cannot serve now)
        self.errors = (exc.ConnectionError, exc.TimeoutError, OSError, exc.RedisClusterException, exc.ClusterError)
        # every other redis-py error: error replies the retries still meet (TRYAGAIN, ASK; OOM, READONLY, NOPERM, ...)
        self.refusals = (exc.RedisError,)
        # what send_sets, confirm and the slot lookup handle themselves (a group sent again, a key not confirmed)
        self._handled = self.errors + (exc.ResponseError,)
        self._response_error = exc.ResponseError
        self.target = target
        self._timeout_s = timeout_s
        self._client = None
        self._making = threading.Lock()

    @property
    def client(self):
        """redis-py's RedisCluster, made on first use (it reads the slot map as it is made)."""
        if self._client is None:
            with self._making:
                if self._client is None:
                    self._client = self._connect()
        return self._client

    def _connect(self):
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        t = self.target
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in t.nodes], username=t.username,
                            password=t.password, ssl=t.tls, socket_timeout=self._timeout_s,
                            socket_connect_timeout=self._timeout_s, retry=Retry(NoBackoff(), RETRIES),
                            require_full_coverage=False)  # serve the shards that are up

    def mget(self, keys: list[bytes]) -> list[bytes | None]:
        return self.client.mget_nonatomic(keys)

    def send_sets(self, items: list[Item], ttl_s: int, seal: Seal) -> list[bytes]:
        """The SETs grouped by the primary redis-py's slot map names for their keys, each group packed (each block's
        bytes sent from its tensor as the next headers are sealed: redis_commands) on one connection to its
        primary, WAIT after them; every group written before any reply is read, so the primaries take them in at
        once. What a primary does not answer OK (MOVED, ASK, TRYAGAIN, CLUSTERDOWN, a connection lost) goes again
        through redis-py's pipeline, which follows redirections and retries (a copy of each value there), then
        `confirm`. Returns the keys whose writes replicas did not confirm."""
        client, wait = self.client, self.target.wait_replicas  # (made here: a cluster out of reach raises here)
        groups, orphans = self._by_primary(client, items, lambda item: item[0])
        sealing = Sealing([item for _, group in groups for item in group] + orphans, seal)
        numbers = iter(range(len(sealing.items)))  # groups and again hold indices into sealing.items
        numbered = [(node, [next(numbers) for _ in group]) for node, group in groups]
        again = list(numbers)  # the orphans
        unconfirmed, sent = [], []  # sent: (pool, connection, group), replies not read yet
        try:
            for node, group in numbered:
                pool = client.get_redis_connection(node).connection_pool
                try:
                    conn = pool.get_connection()  # (released by the pool itself when it cannot connect)
                except self._handled:
                    again += group
                    continue
                sent.append((pool, conn, group))
                try:
                    conn.send_packed_command(packed_sets(sealing.sealed(group), ttl_s,
                                                         (wait, self.target.wait_timeout_ms) if wait else None))
                except self._handled:
                    sent.pop()
                    conn.disconnect()
                    pool.release(conn)
                    again += group
            while sent:
                pool, conn, group = sent[0]
                ok = [self._reply(conn) == b"OK" for _ in group]
                replicas = self._reply(conn) if wait else 0
                pool.release(sent.pop(0)[1])
                again += [i for i, done in zip(group, ok) if not done]
                if wait and not (isinstance(replicas, int) and replicas >= wait):
                    unconfirmed += [sealing.items[i][0] for i, done in zip(group, ok) if done]
        except self._handled:  # a connection lost while reading: its group and those not read yet go again
            again += [i for _, _, group in sent for i in group]
        except BaseException:
            sealing.stop()
            raise
        finally:
            for pool, conn, _ in sent:
                conn.disconnect()  # replies left unread would answer the next command
                pool.release(conn)
        if again:
            pipe = client.pipeline(transaction=False)
            for key, head, data in sealing.sealed(again):
                pipe.set(key, head + data, ex=ttl_s)
            pipe.execute()
            unconfirmed += self.confirm([(sealing.items[i][0], ttl_s * 1000) for i in again])
        return unconfirmed

    def _reply(self, conn):
        """The next reply on conn; an error reply is returned, not raised (the replies after it still follow)."""
        try:
            return conn.read_response()
        except self._response_error as exc:
            return exc

    def _by_primary(self, client, items: list, key_of) -> tuple[list[tuple[object, list]], list]:
        """items grouped by the primary the slot map names for key_of(item), and those whose slot has none."""
        groups: dict[str, tuple[object, list]] = {}
        orphans = []
        for item in items:
            try:
                node = client.get_node_from_key(key_of(item))
            except self._handled:
                orphans.append(item)
                continue
            groups.setdefault(node.name, (node, []))[1].append(item)
        return list(groups.values()), orphans

    def confirm(self, written: list[tuple[bytes, int]]) -> list[bytes]:
        """Of these written (key, its TTL in milliseconds), the keys whose writes are not confirmed by `wait_replicas`
        replicas (see the module docstring)."""
        if not written or not self.target.wait_replicas:
            return []
        client = self.client
        groups, orphans = self._by_primary(client, written, lambda item: item[0])
        unconfirmed = [key for key, _ in orphans]
        for node, items in groups:
            node_keys = [key for key, _ in items]
            try:  # one connection: the WAIT follows the PEXPIREs, and counts replicas that acknowledged them
                pipe = client.get_redis_connection(node).pipeline(transaction=False)
                for key, ttl_ms in items:
                    pipe.pexpire(key, ttl_ms)
                pipe.execute_command("WAIT", self.target.wait_replicas, self.target.wait_timeout_ms)
                *found, replicas = pipe.execute(raise_on_error=False)
            except self._handled:
                unconfirmed += node_keys
                continue
            if isinstance(replicas, Exception) or replicas < self.target.wait_replicas:
                unconfirmed += node_keys
            else:
                unconfirmed += [key for key, there in zip(node_keys, found) if there is not True]
        return unconfirmed

    def ping(self) -> None:
        from redis.cluster import RedisCluster

        self.client.ping(target_nodes=RedisCluster.PRIMARIES)
