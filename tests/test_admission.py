"""Bounded work and bounded input without gRPC: stream slots, the idle watchdog (on an injected clock), the field
limits and how client input is quoted in status messages."""

from __future__ import annotations

import pytest
from kvbridge.proto import pb2
from kvbridge.server.admission import IdleWatchdog, StreamSlots, TooManyStreams
from kvbridge.server.request_limits import MAX_DETAILS_BYTES, MAX_NAME_CHARS, check_message, clip_details, quote


def test_stream_slots_refuse_at_the_tenant_and_the_server_limit_and_free_on_exit():
    slots = StreamSlots(per_tenant=2, total=3)
    with slots.hold("a"), slots.hold("a"):
        with pytest.raises(TooManyStreams, match="this tenant already has 2 uploads open"):
            with slots.hold("a"):
                pass
        with slots.hold("b"):
            with pytest.raises(TooManyStreams, match="the server has 3 uploads open"):
                with slots.hold("c"):
                    pass
        assert slots.open_for("a") == 2 and slots.open_for("b") == 0
    with pytest.raises(RuntimeError):
        with slots.hold("a"):
            raise RuntimeError("the call failed")
    assert slots.open_for("a") == 0


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_watchdog_cancels_only_streams_idle_for_idle_s():
    clock = Clock()
    dog = IdleWatchdog(idle_s=30, clock=clock)
    cancelled = []
    with dog.watch(lambda: cancelled.append("quiet")) as quiet, dog.watch(lambda: cancelled.append("busy")) as busy:
        clock.now += 20
        busy.touch()
        assert dog.sweep() == 0
        clock.now += 10
        assert dog.sweep() == 1 and cancelled == ["quiet"] and quiet.expired and not busy.expired
        assert dog.sweep() == 0  # cancelled once
        clock.now += 30
        assert dog.sweep() == 1 and cancelled == ["quiet", "busy"]
    clock.now += 100
    assert dog.sweep() == 0  # streams that ended are not watched any more


def test_field_limits_name_the_field_and_refuse_unknown_enum_values():
    check_message(pb2.IngestRequest(text="t" * 1000, model="m", mode=1), max_text_chars=1000)
    with pytest.raises(ValueError, match=r"^text is 1001 characters long; this server takes at most 1000$"):
        check_message(pb2.IngestRequest(text="t" * 1001), max_text_chars=1000)
    with pytest.raises(ValueError, match=f"session_id is {MAX_NAME_CHARS + 1} characters"):
        check_message(pb2.IngestRequest(session_id="s" * (MAX_NAME_CHARS + 1)), max_text_chars=1000)
    with pytest.raises(ValueError, match="mode = 99 is not a Mode value"):
        check_message(pb2.IngestRequest(text="t", mode=99), max_text_chars=1000)
    nested = pb2.PutSourceKVRequest(header=pb2.KVHeader(model=pb2.ModelRef(name="n", config_hash="h" * 300)))
    with pytest.raises(ValueError, match="header.model.config_hash is 300 characters"):
        check_message(nested, max_text_chars=1000)


def test_client_input_is_quoted_short_and_escaped_and_messages_are_clipped():
    assert quote("abc") == "'abc'"
    shown = quote("\x1b[2J\u202e" + "x" * 5000)
    assert shown.isascii() and "\\x1b" in shown and "\\u202e" in shown and shown.endswith("(5005 characters)")
    assert len(shown) < 120
    clipped = clip_details("no entry " + "\u00e9\n" * 3000)
    assert clipped.isascii() and "\n" not in clipped and len(clipped) <= MAX_DETAILS_BYTES
    assert clipped.endswith("(message shortened)")
