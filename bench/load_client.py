"""One client process of load_test.py: its calls, each answer checked against what it knows, every call recorded.

It mixes the operations `OPS` names, checks every answer against what it knows about its own entries (`Entry`: which
server, before or after the restart, made or answered each), records every call (`Calls`) for the runner, and deletes
what it made at the end.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import random
import signal
import time
import traceback
from pathlib import Path

RESTART_CODES = ("UNAVAILABLE", "CANCELLED")  # what a call that meets the restart may get
OPS = ("Ingest", "Ingest(extend)", "Lookup", "GetProjectedCache(shm)", "GetProjectedCache(stream)",
       "GetProjectedCache(text)", "GetSourceCache", "Delete")
# how often each client operation is picked (Delete also runs whenever a client holds more than LIVE entries)
WEIGHTS = {"ingest": 20, "extend": 15, "lookup": 15, "fetch_shm": 15, "fetch_stream": 15, "fetch_text": 5,
           "source": 5, "delete": 10}
LIVE = 3  # entries a client keeps at most (it deletes its oldest beyond that)
TIMEOUT_S = 300.0  # deadline of every call (a loaded 2-core machine serves 64 processes slowly)
PRESETS = {  # words per text, store capacity (4 layouts' share each; pages are touched only when used)
    "tiny": {"words": 24, "extend_words": 12, "capacity_mb": 1024},
    "small": {"words": 40, "extend_words": 16, "capacity_mb": 4096},
}
INF = float("inf")


def sample_words() -> list[str]:
    from kvbridge.transfer.selfcheck import sample_text

    return sample_text().split()


def token_of(tenant: str) -> str:
    return f"{tenant}-token-0123456789abcdef"


def kv_digest(segment) -> str:
    """sha256 of a segment's KV bytes and token ids: equal digests, bit-identical caches."""
    h = hashlib.sha256(segment.kv.contiguous().numpy().tobytes())
    h.update(segment.token_ids.numpy().tobytes())
    return h.hexdigest()


def runner_gone() -> bool:
    """Whether the runner that started this process has exited (killed, or it lost this process's pid): then nobody
    sets the start or the deadline, and the client stops instead of waiting for them forever."""
    parent = multiprocessing.parent_process()  # its sentinel: a pipe the runner holds open while it lives
    return parent is not None and not parent.is_alive()


class Shared:
    """Times every process reads (time.monotonic is one clock for the whole host on Linux): when load starts and
    ends, when the server went down (before its SIGTERM or SIGKILL) and came back (its ready file seen)."""

    def __init__(self, ctx, n_clients: int):
        self.ready = ctx.Array("b", n_clients, lock=False)
        self.start_at = ctx.Value("d", INF, lock=False)
        self.deadline = ctx.Value("d", INF, lock=False)
        self.down_at = ctx.Value("d", INF, lock=False)
        self.up_at = ctx.Value("d", INF, lock=False)


class Calls:
    """Every call a client made: (op, start, seconds, code, intended, detail). code: "OK" for an answered call,
    else the status code's name; intended: why that error was the right answer ("" when it was not); detail: the
    server's sentence."""

    def __init__(self, shared: Shared):
        self.shared = shared
        self.rows: list[tuple[str, float, float, str, str, str]] = []
        self.wrong: list[str] = []

    def call(self, op: str, fn, *args, expect: str | None = None, note: str = "", **kwargs):
        """fn(*args, **kwargs); the answer, or None when it failed. expect: a status code that is the right answer
        here (then that error is intended; its answer would be wrong)."""
        from kvbridge.server.client import KVBridgeError

        t0 = time.monotonic()
        try:
            out = fn(*args, **kwargs)
        except KVBridgeError as exc:
            code = exc.code.name
            self.rows.append((op, t0, time.monotonic() - t0, code, note if code == expect else "", exc.details[:200]))
            return None
        self.rows.append((op, t0, time.monotonic() - t0, "OK", "", ""))
        if expect is not None:
            self.check(False, f"{op}: answered OK where {expect} was the right answer ({note})")
        return out

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.wrong.append(what)

    def intend_last(self, why: str) -> None:
        """The last call's NOT_FOUND was a right answer after all (the restart may have dropped its key)."""
        op, t0, dt, code, _, detail = self.rows[-1]
        self.rows[-1] = (op, t0, dt, code, why, detail)

    def last_code(self) -> str:
        return self.rows[-1][3]

    def life(self, t0: float, t1: float) -> int | None:
        """Which server answered a call that ran from t0 to t1: 0 (before the restart), 1 (after), None (it met
        the restart: either)."""
        if t1 < self.shared.down_at.value:
            return 0
        if t0 > self.shared.up_at.value:
            return 1
        return None


class Entry:
    """One of the client's source entries, and what it knows about it."""

    def __init__(self, key: str, text: str, tokens: int | None, life: int | None, projected: bool = False):
        self.key, self.text, self.tokens, self.life = key, text, tokens, life
        self.projected = projected  # a projection of it was fetched (Delete removes it too)
        # tokens: None when made by GetProjectedCache(text); life: the server that made it (0 before the restart,
        # 1 after, None: the call met the restart)
        self.digest: str | None = None  # of its projected cache, once fetched outside the restart
        self.digest_life: int | None = None  # the server that answered that fetch


def client_main(cid: int, address: str, tenant: str, preamble: str, preset: str, redis: bool, crash: bool,
                seed: int, shared: Shared, out: str) -> None:
    """One client process: ready, wait for the start, run until the deadline, delete what it holds, write its calls
    to `out` (JSON). SIGINT and SIGTERM are ignored: a terminal's Ctrl-C reaches the whole process group, and the
    runner alone stops the run (its clients end at their deadline, or it kills them)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    import torch

    torch.set_num_threads(1)
    from kvbridge.server.client import KVBridgeClient

    calls = Calls(shared)
    try:
        with KVBridgeClient(address, token=token_of(tenant), timeout_s=TIMEOUT_S, retries=0) as client:
            shared.ready[cid] = 1
            while shared.start_at.value == INF or time.monotonic() < shared.start_at.value:
                if runner_gone():
                    return
                time.sleep(0.01)
            _client_loop(client, calls, cid, preamble, preset, redis, crash, random.Random(seed))
    except Exception:
        calls.wrong.append(f"client {cid} crashed: {traceback.format_exc()[-1500:]}")
    if runner_gone():  # nobody reads the results (and their folder may be gone)
        return
    Path(out).write_text(json.dumps({"cid": cid, "tenant": tenant, "rows": calls.rows, "wrong": calls.wrong}))


def _client_loop(client, calls: Calls, cid: int, preamble: str, preset: str, redis: bool, crash: bool,
                 rng: random.Random):
    words = sample_words()
    sizes = PRESETS[preset]
    live: list[Entry] = []
    maybe: list[str] = []  # texts whose Ingest met the restart unanswered: the server may hold them
    n = 0

    def text_of(n: int, count: int) -> str:
        start = rng.randrange(len(words) - count)
        return f"{preamble} Note {cid}.{n}: " + " ".join(words[start:start + count])

    def seen(entry: Entry, life: int | None) -> None:
        """An answered call of server `life` found the entry: that server holds it."""
        if entry.life is None and life is not None:
            entry.life = life

    def gone(entry: Entry, life: int | None) -> bool | None:
        """Whether the restart dropped `entry` for a call from `life`: True, False, or None (cannot tell)."""
        if redis:  # made by server 0 after its write-through: kept; but a crash (SIGKILL) loses the writes still
            # queued, and a call's writes may be sent after its answer (by another thread already sending)
            return False if entry.life is not None and not (crash and entry.life == 0 and life != 0) else None
        if entry.life is None or life is None:
            return None
        return entry.life != life

    def ingest(text: str, op: str, base: Entry | None = None) -> None:
        t0 = time.monotonic()
        reply = calls.call(op, client.ingest, text, session_id=f"c{cid}")
        life = calls.life(t0, time.monotonic())
        if reply is None:
            maybe.append(text)
            return
        entry = reply.entries[0]
        calls.check(len(reply.entries) == 1 and entry.kind == "prefix"
                    and entry.num_tokens == reply.source_token_ids.numel(),
                    f"client {cid}: {op} answered {reply.entries} for {reply.source_token_ids.numel()} tokens")
        if base is not None and base.tokens is not None:
            calls.check(entry.num_tokens > base.tokens, f"client {cid}: {op} has {entry.num_tokens} tokens, its "
                                                         f"base {base.tokens}")
        live.append(Entry(entry.key, text, entry.num_tokens, life))

    def fetch(entry: Entry, op: str, transport: str) -> None:
        t0 = time.monotonic()
        life_now = calls.life(t0, t0)
        drop = gone(entry, life_now) if life_now is not None else None
        fetched = calls.call(op, client.fetch_projected, key=entry.key, transport=transport,
                             expect="NOT_FOUND" if drop else None, note="the restart dropped it")
        life = calls.life(t0, time.monotonic())
        if fetched is None:
            if calls.last_code() == "NOT_FOUND" and drop is not False:  # dropped, or it may have been: forget it
                if drop is None:
                    calls.intend_last("the restart may have dropped it")
                live.remove(entry)
            return
        seen(entry, life)
        entry.projected = True
        calls.check(fetched.source_key == entry.key and fetched.segment.num_tokens > 0,
                    f"client {cid}: {op} of {entry.key[:12]} answered source {fetched.source_key[:12]}, "
                    f"{fetched.segment.num_tokens} tokens")
        if life is not None:  # the shared-memory path falls back to the stream only when the server went away
            calls.check(fetched.transport == transport,
                        f"client {cid}: {op} asked for {transport}, came by {fetched.transport}")
            digest = kv_digest(fetched.segment)
            if entry.digest is None or (crash and entry.digest_life != life):  # a crash may have lost it: new
                entry.digest, entry.digest_life = digest, life
            else:  # the projection is cached (and kept in Redis over the restart): the same bytes every time
                calls.check(digest == entry.digest, f"client {cid}: {op} of {entry.key[:12]} answered other KV "
                                                    "than its first fetch")

    def delete(entry: Entry) -> None:
        live.remove(entry)
        t0 = time.monotonic()
        life_now = calls.life(t0, t0)
        drop = gone(entry, life_now) if life_now is not None else None
        deleted = calls.call("Delete", client.delete, entry.key, expect="NOT_FOUND" if drop else None,
                             note="the restart dropped it")
        life = calls.life(t0, time.monotonic())
        if deleted is None:
            if calls.last_code() == "NOT_FOUND" and drop is None:
                calls.intend_last("the restart may have dropped it")
            elif calls.last_code() in RESTART_CODES:
                live.insert(0, entry)  # the server is restarting: delete it later
            elif calls.last_code() != "NOT_FOUND":
                maybe.append(entry.text)  # it may still be there
            return
        if life is None or entry.life is None or gone(entry, life) is not False:
            calls.check(deleted in (1, 2), f"client {cid}: Delete removed {deleted} entries")
        else:
            want = 1 + entry.projected
            calls.check(deleted == want, f"client {cid}: Delete of {entry.key[:12]} (made by server {entry.life}) "
                                         f"removed {deleted} entries on server {life}, expected {want}")
        # the key is gone now, whoever holds it
        calls.call("GetSourceCache", client.fetch_source, key=entry.key, expect="NOT_FOUND",
                   note="deleted just before")

    ops, weights = zip(*WEIGHTS.items())
    while time.monotonic() < calls.shared.deadline.value:
        if runner_gone():  # the runner was killed: no deadline comes, and nobody checks what is left
            return
        n += 1
        op = rng.choices(ops, weights)[0] if live else "ingest"
        entry = rng.choice(live) if live else None
        if op == "ingest":
            ingest(text_of(n, sizes["words"]), "Ingest")
        elif op == "extend":  # the same text and more: the server computes only the new tokens
            start = rng.randrange(len(words) - sizes["extend_words"])
            more = " ".join(words[start:start + sizes["extend_words"]])
            ingest(f"{entry.text} More {cid}.{n}: {more}", "Ingest(extend)", base=entry)
        elif op == "lookup":
            t0 = time.monotonic()
            found = calls.call("Lookup", client.lookup, entry.text)
            life = calls.life(t0, time.monotonic())
            drop = gone(entry, life) if life is not None else None
            if found is not None and drop is not None:
                want = None if drop else entry.key
                calls.check(found.key == want and (want is None or entry.tokens in (None, found.num_tokens)),
                            f"client {cid}: Lookup of its text answered {found}, expected {want}")
            if found is not None and found.key is None and drop is not False:
                live.remove(entry)  # dropped by the restart
            elif found is not None and found.key == entry.key:
                seen(entry, life)
        elif op == "fetch_shm":
            fetch(entry, "GetProjectedCache(shm)", "shared_memory")
        elif op == "fetch_stream":
            fetch(entry, "GetProjectedCache(stream)", "stream")
        elif op == "fetch_text":  # ingested and projected in one call
            text = text_of(n, sizes["words"])
            t0 = time.monotonic()
            fetched = calls.call("GetProjectedCache(text)", client.fetch_projected, text=text, transport="auto")
            if fetched is None:
                maybe.append(text)
                continue
            calls.check(fetched.text == text and fetched.segment.num_tokens > 0,
                        f"client {cid}: GetProjectedCache by text answered another text")
            live.append(Entry(fetched.source_key, text, None, calls.life(t0, time.monotonic()), projected=True))
        elif op == "source":
            t0 = time.monotonic()
            life_now = calls.life(t0, t0)
            drop = gone(entry, life_now) if life_now is not None else None
            source = calls.call("GetSourceCache", client.fetch_source, key=entry.key,
                                expect="NOT_FOUND" if drop else None, note="the restart dropped it")
            if source is not None:
                calls.check(source.text == entry.text, f"client {cid}: GetSourceCache answered another text")
                seen(entry, calls.life(t0, time.monotonic()))
            elif calls.last_code() == "NOT_FOUND" and drop is not False:
                if drop is None:
                    calls.intend_last("the restart may have dropped it")
                live.remove(entry)
        elif op == "delete":
            delete(live[0])
        while len(live) > LIVE and not (calls.rows and calls.last_code() in RESTART_CODES):
            delete(live[0])
        if calls.rows and calls.last_code() in RESTART_CODES:
            time.sleep(0.2)  # the server is restarting: try again shortly
    # the end: delete what it holds, and what the restart may have left unanswered
    for _ in range(1000):  # (a bound: a server that never comes back leaves them, and the checks after say so)
        if not live:
            break
        delete(live[0])
        if calls.last_code() in RESTART_CODES:
            time.sleep(0.2)
    for text in maybe:
        found = calls.call("Lookup", client.lookup, text)
        if found is not None and found.key is not None:
            calls.call("Delete", client.delete, found.key)
