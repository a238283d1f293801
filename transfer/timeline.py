"""Where a request's time goes across processes: timestamped events appended to one file by every process that
takes part (the vLLM driver, the engine core's connector, the worker's connector, the kvbridge server), read back and
cut into phases by `bench/bench_vllm.py`.

Off unless $KVBRIDGE_TIMELINE names a file (read once, at import: set it before the processes start); then each
`event` appends one line "milliseconds pid name", with `time.monotonic()`, one clock for every process of the host.
A request's events are those between its "submit" and its "done" (the bench sends one request at a time; the server
cannot know vLLM's request ids). An event costs one unbuffered write (~5 µs); off, one comparison.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "KVBRIDGE_TIMELINE"
_PATH = os.environ.get(ENV) or None
_file: tuple[int, int] | None = None  # (pid, fd) of this process's descriptor (a forked child opens its own)


def record_to(path: str | Path | None) -> None:
    """Start (or, with None, stop) recording this process's events into `path`, and those of the processes it starts
    from now on (through the environment)."""
    global _PATH, _file
    if _file is not None and _file[0] == os.getpid():
        os.close(_file[1])
    _PATH, _file = (str(path) if path else None), None
    if _PATH:
        os.environ[ENV] = _PATH
    else:
        os.environ.pop(ENV, None)


def event(name: str) -> None:
    """Record `name` now (nothing when $KVBRIDGE_TIMELINE was not set at import)."""
    if _PATH is None:
        return
    global _file
    pid = os.getpid()
    if _file is None or _file[0] != pid:
        _file = (pid, os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600))
    os.write(_file[1], f"{time.monotonic() * 1e3:.3f} {pid} {name}\n".encode())


@dataclass(frozen=True)
class Event:
    ms: float
    pid: int
    name: str


def read(path: str | Path) -> list[Event]:
    """The file's events in time order (lines that do not parse are skipped: a process killed mid-write)."""
    return read_lines(Path(path).read_text(encoding="utf-8", errors="replace").splitlines())


def read_lines(lines: list[str]) -> list[Event]:
    """Events of lines "milliseconds pid name", in time order; lines that do not parse are skipped."""
    events = []
    for line in lines:
        parts = line.split(maxsplit=2)
        if len(parts) == 3:
            try:
                events.append(Event(float(parts[0]), int(parts[1]), parts[2]))
            except ValueError:
                continue
    return sorted(events, key=lambda e: e.ms)


def requests(events: list[Event], start: str = "submit", end: str = "done") -> list[list[Event]]:
    """The events of each request, from its `start` to its `end` event, in order (one request at a time)."""
    out, current = [], None
    for e in events:
        if e.name == start:
            current = [e]
        elif current is not None:
            current.append(e)
            if e.name == end:
                out.append(current)
                current = None
    return out


def span(request: list[Event], first: str, last: str) -> float | None:
    """Milliseconds from a `first` event to the `last` event that ends it: the request's first `last` event that
    comes after a `first` one, and the latest `first` before it (an event that recurs, as a step's, is paired with
    the right one); None if there is no such pair."""
    begin = None
    for e in request:
        if e.name == first:
            begin = e.ms
        elif e.name == last and begin is not None:
            return e.ms - begin
    return None


def median_spans(reqs: list[list[Event]], phases: list[tuple[str, str, str]]) -> dict[str, float | None]:
    """{label: the median over the requests that have both events of `span(first, last)`} for (label, first, last)."""
    out = {}
    for label, first, last in phases:
        values = [v for v in (span(r, first, last) for r in reqs) if v is not None]
        out[label] = statistics.median(values) if values else None
    return out
