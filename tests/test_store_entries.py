"""What an entry carries besides its KV: the text it was made from, links from derived entries (projections) to
their source with cascading deletes, and the events the store reports when entries leave it. check() == [] after
every scenario (it verifies the derived-entries index too)."""

from __future__ import annotations

import pytest
from kvbridge.transfer.errors import NotFound
from test_store import OTHER, Clock, ok, seg, store


def test_an_entry_keeps_its_text_and_a_refresh_or_second_put_can_add_it():
    st = store()
    a = st.put(seg(range(20)), "t", text="twenty tokens")
    assert a.text == "twenty tokens" and st.info(a.key, "t").text == "twenty tokens"
    b = st.put(seg(range(100, 120)), "t")
    assert st.info(b.key, "t").text is None
    assert st.refresh(b.key, "t", text="later").text == "later"
    assert st.put(seg(range(100, 120)), "t", text="again").text == "again"  # the idempotent put keeps the newest
    with pytest.raises(ValueError, match="text must be a str"):
        st.put(seg(range(7)), "t", text=b"bytes")
    ok(st)


def test_deleting_a_source_deletes_what_derives_from_it_and_nothing_else():
    st = store(blocks=64, max_layouts=2)
    src = st.put(seg(range(40)), "t", text="the source")
    p1 = st.put(seg(range(40), model=OTHER, seed=1), "t", adapter="a@1#" + src.key, source_key=src.key,
                annotations={"exact_coverage": 0.75})
    p2 = st.put(seg(range(40), model=OTHER, seed=2), "t", adapter="b@1#" + src.key, source_key=src.key)
    st.put(seg(range(10), model=OTHER, seed=3), "t", source_key=p1.key)  # derived from a derived
    other = st.put(seg(range(200, 240)), "t")
    assert p1.source_key == src.key and p1.annotations == {"exact_coverage": 0.75} and p1.adapter == "a@1#" + src.key
    assert {i.key for i in st.derived(src.key, "t")} == {p1.key, p2.key}
    assert st.derived(src.key, "someone-else") == []
    ok(st)
    assert st.delete(src.key, "t") == 4  # the source, both projections, and the one derived from a projection
    assert st.keys("t") == [other.key]
    assert st.derived(src.key, "t") == []
    ok(st)
    assert st.delete(src.key, "t") == 0


def test_a_derived_entry_needs_its_source_to_exist_for_that_tenant():
    st = store()
    src = st.put(seg(range(20)), "alice")
    with pytest.raises(NotFound):
        st.put(seg(range(20), model=OTHER), "bob", source_key=src.key)  # another tenant's entry is no source
    with pytest.raises(NotFound):
        st.put(seg(range(20), model=OTHER), "alice", source_key="0" * 32)
    assert st.keys("bob") == [] and st.keys("alice") == [src.key]
    ok(st)


def test_links_outlive_an_expired_source_until_their_entries_go():
    clock = Clock()
    st = store(blocks=64, clock=clock, max_layouts=2)
    src = st.put(seg(range(32)), "t", ttl_s=10)
    proj = st.put(seg(range(32), model=OTHER), "t", source_key=src.key, ttl_s=100)
    clock.now += 20
    assert st.keys("t") == [proj.key]  # the source expired; its projection is still a valid cache
    assert [i.key for i in st.derived(src.key, "t")] == [proj.key]
    ok(st)
    clock.now += 100
    assert st.keys("t") == [] and st.derived(src.key, "t") == []
    ok(st)


def test_listeners_hear_why_each_entry_left():
    clock = Clock()
    # room for 4 blocks, no tier below: a fifth block's put evicts, and the entry using the evicted block is lost
    st = store(blocks=4, clock=clock)
    events = []
    st.add_listener(lambda key, tenant, reason: events.append((key, tenant, reason)))
    a = st.put(seg(range(16)), "t", ttl_s=5)
    b = st.put(seg(range(100, 116)), "t")
    c = st.put(seg(range(200, 216)), "u")
    st.delete(b.key, "t")
    clock.now += 10
    st.purge_expired()
    d = st.put(seg(range(300, 364)), "t")  # 4 blocks: c is evicted and lost
    assert events == [(b.key, "t", "deleted"), (a.key, "t", "expired"), (c.key, "u", "lost")]
    assert st.keys("t") == [d.key] and st.keys("u") == []
    ok(st)
