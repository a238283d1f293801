"""bench_ttft.timed_rounds: every step the TTFT benchmark times runs once untimed first (the blend steps and the
served correction by stream had no warm-up: their first call's costs went into the first round's sample)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


def test_every_step_runs_once_untimed_before_the_timed_rounds():
    import bench_ttft

    calls: list[str] = []

    def step(name: str):
        def fn():
            calls.append(name)
            return 0, {"call": len(calls)}
        return fn

    steps = {"a": (lambda: calls.append("prepare a"), step("a")), "b": (None, step("b")), "c": (None, step("c"))}
    samples, splits = bench_ttft.timed_rounds(steps, 2)
    # the warm-up: each step (and its prepare) once, before anything is timed
    assert calls[:4] == ["prepare a", "a", "b", "c"], calls
    # then the rounds, the order alternating; only they give samples
    assert calls[4:] == ["prepare a", "a", "b", "c", "c", "b", "prepare a", "a"], calls
    assert {name: len(s) for name, s in samples.items()} == {"a": 2, "b": 2, "c": 2}
    assert all(t >= 0 for s in samples.values() for t in s)
    assert splits == {"a": [{"call": 6}, {"call": 12}], "b": [{"call": 7}, {"call": 10}],
                      "c": [{"call": 8}, {"call": 9}]}



def test_a_run_without_a_same_host_data_plane_stops_the_server_it_started(monkeypatch, tiny_source, tiny_target,
                                                                          adapter):
    """run_ttft raised for a server with no shared-memory folder after starting it, outside its try: the server
    (its port, its threads) stayed up in the caller's process."""
    import bench_ttft
    import grpc
    import pytest
    from kvbridge.server.app import start_server

    started = []

    def start_without_segments(service, config):
        running = start_server(service, config)
        started.append(running)
        if running.segments is not None:
            running.segments.close()
        running.segments = None  # as where the server could not make its folder
        return running

    monkeypatch.setattr(bench_ttft, "start_server", start_without_segments)
    with pytest.raises(RuntimeError, match="no same-host data plane"):
        bench_ttft.run_ttft(tiny_source, tiny_target, adapter, [32], 1)
    assert len(started) == 1
    channel = grpc.insecure_channel(started[0].address)
    try:
        with pytest.raises(grpc.FutureTimeoutError):  # nothing listens there any more
            grpc.channel_ready_future(channel).result(timeout=2)
    finally:
        channel.close()
        started[0].stop(grace_s=0)
