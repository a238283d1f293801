"""kvbridge.transfer.timeline: events of several processes in one file, cut into requests and phases."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kvbridge.transfer import timeline


@pytest.fixture()
def recording(tmp_path):
    path = tmp_path / "timeline"
    timeline.record_to(path)
    try:
        yield path
    finally:
        timeline.record_to(None)


def test_events_of_this_process_and_of_a_child_started_after_record_to_land_in_one_file_in_time_order(recording):
    timeline.event("submit")
    child = "from kvbridge.transfer import timeline; timeline.event('lookup'); timeline.event('fetched')"
    subprocess.run([sys.executable, "-c", child], check=True, env=os.environ.copy())  # the env record_to set
    timeline.event("done")
    events = timeline.read(recording)
    assert [e.name for e in events] == ["submit", "lookup", "fetched", "done"]
    assert events[0].pid == events[-1].pid == os.getpid() and events[1].pid != os.getpid()
    assert all(a.ms <= b.ms for a, b in zip(events, events[1:]))
    assert os.stat(recording).st_mode & 0o777 == 0o600


def test_nothing_is_written_once_stopped(tmp_path):
    path = tmp_path / "timeline"
    timeline.record_to(path)
    timeline.event("a")
    timeline.record_to(None)
    timeline.event("b")
    assert [e.name for e in timeline.read(path)] == ["a"]
    assert timeline.ENV not in os.environ


def test_requests_spans_and_medians(tmp_path):
    path = tmp_path / "timeline"
    lines = ["0.0 1 submit", "1.0 2 lookup", "5.0 3 server_begin", "garbage", "4.0 2 fetched", "10.0 1 done",
             "11.0 2 stray", "20.0 1 submit", "21.0 2 lookup", "27.0 2 fetched", "30.0 1 done", "40.0 1 submit"]
    path.write_text("\n".join(lines) + "\n12.5 1 torn-li")
    reqs = timeline.requests(timeline.read(path))
    assert [[e.name for e in r] for r in reqs] == [["submit", "lookup", "fetched", "server_begin", "done"],
                                                   ["submit", "lookup", "fetched", "done"]]
    assert timeline.span(reqs[0], "lookup", "fetched") == 3.0
    assert timeline.span(reqs[0], "fetched", "lookup") is None  # the last event must come after the first
    steps = timeline.read_lines(["0 1 submit", "1 2 step", "2 2 load", "5 2 step", "6 2 step", "7 1 done"])
    assert timeline.span(steps, "load", "step") == 3  # the step after the load, not the first step
    assert timeline.span(steps, "step", "done") == 1  # the last step before the end
    assert timeline.span(reqs[1], "server_begin", "done") is None
    medians = timeline.median_spans(reqs, [("rtt", "lookup", "fetched"), ("server", "server_begin", "done"),
                                           ("none", "matched", "done")])
    assert medians == {"rtt": 4.5, "server": 5.0, "none": None}
