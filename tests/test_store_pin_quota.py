"""The pinned-bytes quota counts the tenant's own pins only, and applies when an existing entry is pinned by a
second put or by a refresh."""

from __future__ import annotations

import pytest
from kvbridge.transfer.store import QuotaExceeded
from test_store import BLOCK_BYTES, BS, seg, store


def test_another_tenants_pins_do_not_count_against_this_tenants_quota():
    st = store(tenant_max_pinned_bytes=3 * BLOCK_BYTES)
    st.put(seg(range(3 * BS)), "u", pin=True)  # u's own 3 blocks: u's quota
    st.put(seg(range(500, 500 + 3 * BS)), "t", pin=True)  # t holds no pins: its 3 blocks fit its quota
    assert st.check() == []


@pytest.mark.parametrize("how", ["put", "refresh"])
def test_pinning_an_existing_entry_is_checked_against_the_quota(how):
    st = store(tenant_max_pinned_bytes=3 * BLOCK_BYTES)
    st.put(seg(range(3 * BS)), "t", pin=True)  # the quota, pinned
    other = seg(range(1000, 1000 + 2 * BS))
    key = st.put(other, "t").key  # stored unpinned: no quota needed
    with pytest.raises(QuotaExceeded, match="pinning 8192 more bytes"):
        if how == "put":
            st.put(other, "t", pin=True)
        else:
            st.refresh(key, "t", pin=True)
    assert not st.registry.get(key).pinned and st.check() == []
