"""locate's cut after a skip, its search order, its skip bound, and the recomputed positions of a cut placement
(mutations of each got past the suite)."""

import pytest
from kvbridge.server.prompt_place import locate

CACHE = [0] + list(range(10, 30))  # start token 0, document 10..29
DOC = CACHE[1:]


@pytest.mark.parametrize("prompt, placed", [
    ([5, 6, 77, *DOC[1:]], (3, 1, 0)),  # first token merged into the head, the rest whole
    ([5, 6, 77, *DOC[1:-2], 98], (3, 1, 2)),  # ... and the prompt goes on otherwise before the last two
    ([5, 77, *DOC[2:15]], (2, 2, 5)),  # two cut, and the prompt ends early
])
def test_locate_cuts_what_follows_a_skipped_start(prompt, placed):
    """kills locate_cut_ignores_skip (cut = len(doc) - held) and locate_held_from_doc_start (held counted against
    the document's first token, not its first served one)."""
    where = locate(prompt, CACHE)
    assert (where.head, where.skip, where.cut) == placed
    served = DOC[where.skip:len(DOC) - where.cut]
    assert prompt[where.head:where.head + len(served)] == served


def test_locate_takes_the_smallest_skip_below_max_skip_and_the_first_place():
    """kills locate_skip_range (skip max_skip - 1 never tried) and locate_first_place_last (the last place the run
    is found, not the first)."""
    where = locate([5, 77, *DOC[3:]], CACHE)  # 3 = MAX_SKIP - 1 leading tokens merged otherwise
    assert (where.head, where.skip, where.cut) == (2, 3, 0)
    twice = [5, *DOC, 6, *DOC]  # the document quoted twice: placed where it first is
    where = locate(twice, CACHE)
    assert (where.head, where.skip, where.cut) == (1, 0, 0)


def test_a_cut_placements_recomputed_positions_lie_in_what_it_serves(tmp_path, tiny_source, tiny_target, adapter):
    """kills place_recomputed_shift (a stored recomputed position at the cut's first token, `end`, served shifted,
    one past the placed cache)."""
    from test_prompt_place import TEXT, _service
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    stored = service.projected_cache("t", text=TEXT, mode="blend:0.2")
    ids = stored.segment.token_ids.tolist()
    ends = [p for p in stored.recomputed if p >= 12]
    assert ends, stored.recomputed
    end = ends[0]  # the prompt holds the document up to (not including) a recomputed token
    head = [ids[0], 17, 23, 5, 42]
    prompt = head + ids[1:end] + [7]
    served = service.prompt_cache("t", prompt, text=TEXT, mode="blend:0.2")
    n = served.segment.num_tokens
    assert n == len(head) + end - 1
    assert all(0 <= p < n for p in served.recomputed), (served.recomputed, n)
    h = len(head)
    assert list(served.recomputed) == [p + h - 1 for p in stored.recomputed if 1 <= p < end]


def test_locate_refuses_a_prompt_that_starts_as_stored_but_holds_fewer_than_a_probe():
    """kills locate_asstored_probe_short (the as-stored check compares the start token and n - 1 document tokens)."""
    with pytest.raises(ValueError, match="does not hold the document"):
        locate([0, *DOC[:7], 99, 98, 97], CACHE)  # 7 document tokens after the start token, probe 8
    with pytest.raises(ValueError, match="does not hold the document"):
        locate([0, *DOC[:2], 99], CACHE, probe=3)


def test_a_document_that_ends_on_the_targets_last_position_is_placed(tmp_path, tiny_source, tiny_target, adapter):
    """kills place_check_fits_ge: a placement that fills the target's positions exactly fits."""
    from test_prompt_place import TEXT, _service
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    ids = service.projected_cache("t", text=TEXT, mode="replace").segment.token_ids.tolist()
    limit = service.model("", "target").max_positions
    head = [ids[0]] + [17, 23, 5, 42] * limit
    head = head[:limit - (len(ids) - 1)]
    served = service.prompt_cache("t", head + ids[1:], text=TEXT, mode="replace")
    assert served.segment.num_tokens == limit
