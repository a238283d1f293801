"""server/undo.py: a failed call never removes an entry it only refreshed, nor one another request refreshed meanwhile
(mutations of these rules got past the suite)."""
import threading

import pytest
import torch
from kvbridge.server.undo import created, undone_on_failure
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store import PagedStore, StoreConfig

M = ModelIdentity("m", "0" * 64)


def _seg(seed):
    g = torch.Generator().manual_seed(seed)
    return KVSegment(kv=torch.randn(2, 2, 2, 20, 8, generator=g), positions=torch.arange(20), model=M,
                     token_ids=torch.randint(0, 1000, (20,), generator=g), rotated=True)


def _store():
    return PagedStore(StoreConfig(capacity_bytes=4 << 20, device="cpu"))


class Refused(Exception):
    pass


def test_a_failed_call_keeps_an_entry_it_only_refreshed():
    """kills undo_refreshed_too (created() journals a put of generation > 0 too)."""
    st = _store()
    before = st.put(_seg(1), "t")  # the store's before the call
    with pytest.raises(Refused):
        with undone_on_failure(st):
            assert created(st.put(_seg(1), "t"), "t").generation == 1  # the call's put only refreshes it
            created(st.put(_seg(2), "t"), "t")  # and stores one of its own
            raise Refused
    assert st.keys("t") == [before.key] and st.check() == []


def test_a_failed_call_keeps_an_entry_another_request_stored_too_meanwhile():
    """kills undo_no_generation_guard (the undo deletes without if_generation)."""
    st = _store()
    with pytest.raises(Refused):
        with undone_on_failure(st):
            mine = created(st.put(_seg(3), "t"), "t")
            other = threading.Thread(target=lambda: created(st.put(_seg(3), "t"), "t"))  # its own context
            other.start()
            other.join()
            raise Refused
    assert st.keys("t") == [mine.key] and st.check() == []


def test_a_failed_call_keeps_an_entry_another_request_refreshed_meanwhile():
    """kills refresh_no_generation_bump (PagedStore.refresh leaves the generation as it was, so the undo still takes
    the entry another request just refreshed, pinned or re-texted as its own)."""
    st = _store()
    with pytest.raises(Refused):
        with undone_on_failure(st):
            mine = created(st.put(_seg(4), "t"), "t")
            other = threading.Thread(target=lambda: st.refresh(mine.key, "t", text="theirs"))
            other.start()
            other.join()
            raise Refused
    assert st.keys("t") == [mine.key] and st.info(mine.key, "t").text == "theirs" and st.check() == []
