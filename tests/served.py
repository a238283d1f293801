"""In-process kvbridge servers for tests (tests/test_server*.py, tests/test_reliability*.py, tests/test_shm_server.py):
started on a free loopback port (port 0) with bearer tokens, read through their own request counters, waited on
with a deadline; and the tally of what concurrent client threads saw. The pytest fixtures built on them
(`adapters_dir`, `server`, `identity_server`, `alice`, `bob`) are in tests/conftest.py.

No pytest fixtures in here; `wait_for` and `code` use pytest's failure helpers.
"""

from __future__ import annotations

import math
import time
import traceback
from collections import Counter, defaultdict

import grpc
import pytest
from kvbridge.server.client import KVBridgeError

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef01"
TOKENS = {ALICE: "alice", BOB: "bob"}
TEXT = ("The module provides a way to read and write data in a portable format. Each record holds a name, "
        "a value and an optional comment, and readers skip what they do not understand.")
WAIT_S = 60.0  # bound on every wait for something another thread or process does
# where the servers start() makes put their shared-memory segment folders when the test names none: a folder of the
# test session's own in /dev/shm (conftest's `session_shm_dir` sets it, then removes it with what a killed server left)
SHM_DIR: str | None = None


def words() -> list[str]:
    from kvbridge.transfer.selfcheck import sample_text

    return sample_text().split()


def text(n: int, count: int = 40) -> str:
    """The n-th run of `count` words of the packaged sample text: distinct texts for distinct n."""
    w = words()
    return " ".join(w[n * count:(n + 1) * count])


def start(source, targets, adapters_dir, tokens: dict[str, str] | None = TOKENS, store=None, **overrides):
    """An in-process server on a free loopback port, serving `source` -> `targets` with the adapters in
    adapters_dir (store: a PagedStore built by the test, else one from the config; tokens None: an open server);
    its shared-memory folders in SHM_DIR unless overrides name shm_dir.
    The projection's path (correction "replace"): tests/test_corrections.py has the served modes."""
    from kvbridge.server.app import build_service, start_server
    from kvbridge.server.config import ServeConfig

    fields = dict(preset="tiny", listen="127.0.0.1:0", adapters=str(adapters_dir), store_capacity_mb=64,
                  max_message_mb=2, chunk_kb=64, correction="replace")
    if SHM_DIR is not None:
        fields["shm_dir"] = SHM_DIR
    fields.update(overrides)
    config = ServeConfig(**fields)
    service = build_service(config, source=source, targets=targets, store=store)
    return start_server(service, config, tokens=tokens)


def start_on_cpu(source, targets, adapters_dir, tokens: dict[str, str] | None = TOKENS, store=None, **overrides):
    """start() with the store on the CPU and no self-check: the reliability tests' servers (faults and load are
    their subject; the models' self-checks run in the other servers)."""
    return start(source, targets, adapters_dir, tokens, store, **{"store_device": "cpu", "selfcheck": False,
                                                                   **overrides})


def code(call) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a client call that must fail."""
    with pytest.raises(KVBridgeError) as info:
        call()
    return info.value.code, info.value.details


def wait_for(condition, what: str, timeout_s: float = WAIT_S, state=None) -> None:
    """Poll a condition that another thread or process makes true (a real server or Redis: no clock to inject).
    state(): what to show when it times out."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}" + (f"; {state()}" if state else ""))
        time.sleep(0.02)


def snapshot(store, *tenants):
    """What a refused call must leave as it was: entries, device bytes, each tenant's keys."""
    stats = store.stats()
    return stats.entries, stats.bytes_used["device"], [sorted(store.keys(t)) for t in tenants]


# ------------------------------------------------------------------------------------------------ counters


def server_count(running, method: str, code: str) -> float:
    return running.metrics.requests.labels(method, code)._value.get()


def server_codes(running, method: str) -> dict[str, float]:
    out = {}
    for metric in running.metrics.requests.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels.get("method") == method:
                out[sample.labels["code"]] = sample.value
    return out


def internal_errors(running) -> dict[str, float]:
    """INTERNAL answers by method, from the server's own request counter."""
    out = {}
    for metric in running.metrics.requests.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels.get("code") == "INTERNAL" and sample.value:
                out[sample.labels["method"]] = sample.value
    return out


def expected_projection(text, tiny_source, tiny_target, adapter):
    """The source KV of `text` and its projection, computed here as the server computes them."""
    from kvbridge.adapters.adapter import project
    from kvbridge.adapters.pairs import pair_text
    from kvbridge.transfer import kvcache

    paired = pair_text(text, tiny_source.tokenizer, tiny_target.tokenizer)
    source_kv = kvcache.extract(tiny_source.model, tiny_source.spec, paired.source_ids)
    return source_kv, project(adapter, source_kv, paired.alignment, paired.target_ids, tiny_source.rope,
                              tiny_target.rope)


class ManualClock:
    """A store's clock, moved by the test (TTLs and Redis retry intervals without sleeping)."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ------------------------------------------------------------------------------------------------ tallies


class Tally:
    """What one client thread saw: latencies of answered calls, errors by (method, code), wrong answers."""

    def __init__(self):
        self.latency: dict[str, list[float]] = defaultdict(list)  # method -> seconds, answered calls
        self.expected: Counter = Counter()  # (method, code): errors the client asked for (its own deleted key)
        self.tolerated: Counter = Counter()  # (method, code): errors the test allows here (misses, full store)
        self.errors: Counter = Counter()  # (method, code): everything else
        self.wrong: list[str] = []  # answers that came back but were wrong; exceptions in the client thread
        self.samples: list[str] = []  # the first few unexpected error messages
        self.where = None  # () -> str: the test's phase, noted with each unexpected error

    def call(self, method: str, fn, *args, expect: grpc.StatusCode | None = None, tolerate=None, **kwargs):
        """fn(*args, **kwargs) timed and classified; its value, or None when it failed."""
        t0 = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        except KVBridgeError as exc:
            key = (method, exc.code.name)
            if expect is not None and exc.code == expect:
                self.expected[key] += 1
            elif tolerate is not None and tolerate(exc.code):
                self.tolerated[key] += 1
            else:
                self.errors[key] += 1
                if len(self.samples) < 5:
                    self.samples.append(f"{exc} [{self.where()}]" if self.where else str(exc))
            return None
        self.latency[method].append(time.perf_counter() - t0)
        if expect is not None:
            self.wrong.append(f"{method} answered, expected {expect.name}")
        return out

    def check(self, ok: bool, message: str) -> None:
        if not ok and len(self.wrong) < 20:
            self.wrong.append(message)

    def run(self, body, *args) -> None:
        """body(*args) in a thread; whatever it raises becomes a wrong answer (never a silent thread death)."""
        try:
            body(*args)
        except Exception:
            self.wrong.append(traceback.format_exc())

    @staticmethod
    def merged(tallies: list[Tally]) -> Tally:
        out = Tally()
        for t in tallies:
            for method, values in t.latency.items():
                out.latency[method] += values
            out.expected.update(t.expected)
            out.tolerated.update(t.tolerated)
            out.errors.update(t.errors)
            out.wrong += t.wrong
            out.samples += t.samples[:2]
        return out

    def answered(self, method: str) -> int:
        return len(self.latency.get(method, ()))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def report(title: str, tally: Tally, seconds: float) -> None:
    """Requests per second, latencies per method and errors by kind, printed (shown with -s)."""
    answered = sum(len(v) for v in tally.latency.values())
    intended, tolerated, unexpected = (sum(c.values()) for c in (tally.expected, tally.tolerated, tally.errors))
    total = answered + intended + tolerated + unexpected
    print(f"\n{title}: {total} requests in {seconds:.1f} s = {total / seconds:.1f} requests/s ({answered} answered; "
          f"errors: {intended} intended, {tolerated} tolerated, {unexpected} unexpected)", flush=True)
    for method in sorted(tally.latency):
        v = tally.latency[method]
        print(f"  {method:<24} {len(v):>6} answered  p50 {1e3 * percentile(v, 0.5):8.1f} ms  "
              f"p99 {1e3 * percentile(v, 0.99):8.1f} ms  max {1e3 * max(v):8.1f} ms", flush=True)
    for name, counts in (("intended errors", tally.expected), ("tolerated errors", tally.tolerated),
                         ("unexpected errors", tally.errors)):
        by_code = Counter()
        for (method, code_name), n in counts.items():
            by_code[f"{method} {code_name}"] += n
        print(f"  {name}: {dict(sorted(by_code.items())) or 'none'}", flush=True)
