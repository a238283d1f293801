"""Reliability of the service under load (issue 8): many concurrent clients (threads, each its own channel and
bearer token) mix every RPC on their own entries against one in-process server with the tiny pair; no errors but
the intended ones, server and clients agree on the counts, nothing is left behind. The faults (a server killed
mid-stream, clients gone mid-upload): tests/test_reliability_server.py; Redis killed, corrupt blocks, a full store:
tests/test_reliability_store.py.

The load runs until every client has made LOAD_ROUNDS rounds (each round an Ingest and the calls by its key, or a
fetch by text; deletes once a client holds more than LOAD_LIVE entries): 64 clients, 4 rounds by default. For the
full run (figures printed with -s), a minimum duration as well:

    KVBRIDGE_LOAD_SECONDS=60 .venv/bin/python -m pytest tests/test_reliability.py -k load -s

KVBRIDGE_LOAD_CLIENTS and KVBRIDGE_LOAD_ROUNDS change the number of clients (default 64) and rounds (default 4).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import grpc
import pytest
import served
import torch
from kvbridge.server.client import KVBridgeClient
from served import ALICE, BOB, Tally

pytestmark = pytest.mark.integration

LOAD_CLIENTS = int(os.environ.get("KVBRIDGE_LOAD_CLIENTS", "64"))
LOAD_ROUNDS = int(os.environ.get("KVBRIDGE_LOAD_ROUNDS", "4"))  # by 4 rounds a client has made every call
LOAD_SECONDS = float(os.environ.get("KVBRIDGE_LOAD_SECONDS", "0"))  # a minimum duration (the full run: 60)
LOAD_TENANTS = 4
LOAD_LIVE = 2  # entries a load client keeps at most (it deletes its oldest beyond that)
LOAD_WORDS = 15  # words of a load text after its tenant's shared preamble

KEEPER = "keeper-token-0123456789abcd"
LOAD_TOKENS = {f"load{t}-token-0123456789abcdef": f"load{t}" for t in range(LOAD_TENANTS)}
TOKENS = {ALICE: "alice", BOB: "bob", KEEPER: "keeper", **LOAD_TOKENS}

NOT_FOUND = grpc.StatusCode.NOT_FOUND


def _start(source, targets, adapters_dir, **overrides):
    return served.start_on_cpu(source, targets, adapters_dir, TOKENS, **overrides)


# ------------------------------------------------------------------------------------------------ load


def _load_client(address: str, token: str, preamble: str, cid: int, stop: threading.Event, tally: Tally,
                 deletes: list[int], rounds: list[int]) -> None:
    """Ingest, look up, fetch projected and source KV of its own texts, delete its oldest entries (then check the
    deleted key is gone: the intended NOT_FOUND), counting its rounds in rounds[0]; once `stop` is set, delete
    everything it still holds."""
    words = served.words()
    live: list[str] = []  # its source entries, oldest first; each has had its projection fetched

    def delete(key: str) -> None:
        deleted = tally.call("Delete", client.delete, key)
        tally.check(deleted == 2, f"client {cid}: Delete {key[:12]} removed {deleted} entries, expected 2 "
                                  "(the source entry and its projection)")

    with KVBridgeClient(address, token=token, timeout_s=120, retries=0) as client:
        n = 0
        while not stop.is_set():
            rounds[0] = n  # rounds finished (one that failed early counts: its errors fail the test)
            n += 1
            start = (cid * 37 + n * LOAD_WORDS) % (len(words) - LOAD_WORDS)
            text = f"{preamble} Note {cid}.{n}: " + " ".join(words[start:start + LOAD_WORDS])
            if n % 4:  # ingest, then everything by key
                reply = tally.call("Ingest", client.ingest, text, session_id=f"c{cid}")
                if reply is None:
                    continue
                entry = reply.entries[0]
                live.append(entry.key)
                tally.check(entry.num_tokens == reply.source_token_ids.numel() and entry.kind == "prefix",
                            f"client {cid}: Ingest answered {entry}")
                found = tally.call("Lookup", client.lookup, text)
                tally.check(found is None or (found.key == entry.key and found.tier == "device"),
                            f"client {cid}: Lookup of its own text answered {found}, expected {entry.key[:12]}")
                fetched = tally.call("GetProjectedCache", client.fetch_projected, key=entry.key)
                tally.check(fetched is None or (fetched.source_key == entry.key and fetched.segment.num_tokens > 0
                                                and fetched.segment.model.name == "tiny-phi3"),
                            f"client {cid}: GetProjectedCache by key answered the wrong entry")
                if fetched is None:
                    live.pop()  # no projection to delete with it: delete it now and expect 1
                    tally.call("Delete", client.delete, entry.key)
                    continue
                if n % 4 == 1:
                    source = tally.call("GetSourceCache", client.fetch_source, key=entry.key)
                    tally.check(source is None or torch.equal(source.segment.token_ids, reply.source_token_ids),
                                f"client {cid}: GetSourceCache by key answered other tokens")
            else:  # by text: the server ingests it and projects it in one call
                fetched = tally.call("GetProjectedCache", client.fetch_projected, text=text)
                if fetched is None:
                    continue
                live.append(fetched.source_key)
                tally.check(fetched.text == text, f"client {cid}: GetProjectedCache by text answered another text")
            while len(live) > LOAD_LIVE:
                old = live.pop(0)
                delete(old)
                deletes[0] += 1
                tally.call("GetSourceCache", client.fetch_source, key=old, expect=NOT_FOUND)
        for key in live:
            delete(key)


def test_load_many_clients_leave_no_errors_and_no_blocks(tiny_source, tiny_target, adapters_dir):
    """N clients (threads, own channel and bearer token, LOAD_TENANTS tenants) mix Ingest, Lookup, GetProjectedCache,
    GetSourceCache and Delete of their own entries until each has made LOAD_ROUNDS rounds: no errors but the
    intended ones, server and clients agree on the counts, and once every client has deleted what it made the store
    is as before."""
    n_clients = LOAD_CLIENTS
    # Room for every client's live entries (at most LOAD_LIVE + 1, ~10 target blocks of 72 KB each) with no
    # eviction, so "the device bytes return to what they were" is exact.
    running = _start(tiny_source, [tiny_target], adapters_dir, store_capacity_mb=max(256, 10 * n_clients))
    store = running.service.store
    try:
        with KVBridgeClient(running.address, token=KEEPER, retries=0) as keeper:  # another tenant's pinned entry
            kept = keeper.ingest(served.text(0), pin=True).entries[0]
            kept_projection = keeper.fetch_projected(key=kept.key)
        before = store.stats().bytes_used["device"]
        assert before > 0
        methods = ("Ingest", "Lookup", "GetProjectedCache", "GetSourceCache", "Delete")
        served_before = {(m, c): served.server_count(running, m, c) for m in methods for c in ("OK", "NOT_FOUND")}

        tenants = list(LOAD_TOKENS.items())
        preambles = [" ".join(served.words()[500 + 20 * t:520 + 20 * t]) for t in range(LOAD_TENANTS)]
        tallies = [Tally() for _ in range(n_clients)]
        deletes = [[0] for _ in range(n_clients)]
        rounds = [[0] for _ in range(n_clients)]
        stop = threading.Event()
        threads = [threading.Thread(target=tallies[i].run, name=f"load-{i}",
                                    args=(_load_client, running.address, tenants[i % LOAD_TENANTS][0],
                                          preambles[i % LOAD_TENANTS], i, stop, tallies[i], deletes[i], rounds[i]))
                   for i in range(n_clients)]
        t0 = time.monotonic()
        try:
            for t in threads:
                t.start()

            def enough() -> bool:  # every client made its rounds (or died: its traceback fails the test below)
                return (all(r[0] >= LOAD_ROUNDS or not t.is_alive() for r, t in zip(rounds, threads))
                        and time.monotonic() - t0 >= LOAD_SECONDS)

            served.wait_for(enough, f"every load client to make {LOAD_ROUNDS} rounds",
                            timeout_s=LOAD_SECONDS + 10 * served.WAIT_S,
                            state=lambda: f"rounds made: {sorted(r[0] for r in rounds)}")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=5 * served.WAIT_S)
        elapsed = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads), "load clients still running 300 s after they were stopped"

        tally = Tally.merged(tallies)
        served.report(f"load: {n_clients} clients, {LOAD_TENANTS} tenants, {min(r[0] for r in rounds)} or more "
                      "rounds each", tally, elapsed)
        stats = store.stats()
        print(f"  store: {stats.entries} entries, {stats.bytes_used['device']} device bytes (before: {before}), "
              f"hits {stats.hits}, misses {stats.misses}, evictions {stats.evictions}", flush=True)
        assert tally.wrong == [], tally.wrong[:5]
        assert not tally.errors, (dict(tally.errors), tally.samples)
        assert tally.expected == Counter({("GetSourceCache", "NOT_FOUND"): sum(d[0] for d in deletes)})
        assert all(tally.answered(m) > 0 for m in methods), {m: tally.answered(m) for m in methods}

        # the server served exactly what the clients saw answered (its stream counters settle after the last chunk)
        def server_agrees() -> bool:
            return all(served.server_count(running, m, "OK") - served_before[(m, "OK")] == tally.answered(m)
                       for m in methods)
        served.wait_for(server_agrees, "the server's request counters to match the clients'", timeout_s=10)
        assert (served.server_count(running, "GetSourceCache", "NOT_FOUND")
                - served_before[("GetSourceCache", "NOT_FOUND")]) == sum(tally.expected.values())

        # nothing left behind: no entries of the load tenants, no blocks in use beyond the keeper's
        assert store.check() == []
        for _, tenant in tenants:
            assert store.keys(tenant) == [] and running.service.tenant_usage(tenant) == (0, 0)
        assert stats.evictions == {"device": 0, "cpu": 0} and stats.lost_entries == 0  # the sizing held
        assert store.stats().bytes_used["device"] == before
        assert sorted(store.keys("keeper")) == sorted([kept.key, kept_projection.entry_key])
        with KVBridgeClient(running.address, token=KEEPER, retries=0) as keeper:
            again = keeper.fetch_projected(key=kept.key)
        assert torch.equal(again.segment.kv, kept_projection.segment.kv)
        assert served.internal_errors(running) == {}
    finally:
        running.stop(1)
