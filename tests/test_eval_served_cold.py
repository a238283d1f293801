"""A served correction's cold TTFT counts projecting the document (a new user's first request makes the server project,
then correct), and no mode's cold TTFT depends on the order the modes are given in: both harnesses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvbridge.eval.modes import parse_modes
from kvbridge.eval.summaries import EvalConfig, ProjectedSource, SummaryEvaluator, prepare
from kvbridge.eval.vllm_eval import FirstFetches, VLLMEvaluator
from test_eval_metrics import COLD_FETCH_S, CORRECT_S, ENGINE_S, WARM_FETCH_S, IngestClient, StoreEngine

CONFIG = EvalConfig(max_doc_tokens=40, min_doc_tokens=8, continuation_tokens=4, max_new_tokens=3)


class CountingEngine(StoreEngine):
    """StoreEngine that counts the requests reading the plain projection (replace and recompute:r)."""

    def __init__(self):
        super().__init__()
        self.plain_requests = 0

    def generate(self, prompt: list[int], max_tokens: int = 16, kvbridge: dict | None = None) -> dict:
        self.plain_requests += bool(kvbridge) and kvbridge["mode"] == "replace"
        return super().generate(prompt, max_tokens, kvbridge)


@pytest.mark.parametrize("order", ["replace,recompute:0.5,served:blend:0.1,served:recompute:0.1",
                                   "served:recompute:0.1,served:blend:0.1,recompute:0.5,replace",
                                   "served:blend:0.1,replace,served:recompute:0.1,recompute:0.5",
                                   "served:blend:0.1,served:recompute:0.1"])
def test_vllm_cold_ttft_of_every_mode_is_the_same_whatever_the_modes_order(tiny_target, order):
    """replace after a served mode found the projection the served fetch stored (a store hit for its cold TTFT), and
    a second served correction found the first one's projection (no projecting in its cold TTFT). The harness fetches
    the projection itself before a served mode that comes first, so every mode's cold TTFT is what it is when the
    plain projection's fetch leads: one extra projection request pair, only where a served mode comes first."""
    record = SimpleNamespace(id="d", document=" ".join(f"word{i} tells" for i in range(60)), summary="")
    doc = prepare(record, tiny_target, CONFIG)
    engine = CountingEngine()
    result = VLLMEvaluator(engine, IngestClient(), tiny_target, parse_modes(order), CONFIG).run(doc)
    names = order.split(",")
    assert list(result.modes) == names  # the report's order is the user's
    for name in names:
        served = CORRECT_S if name.startswith("served") else 0.0
        assert result.modes[name].ttft_s == pytest.approx(COLD_FETCH_S + served + ENGINE_S), name
        assert result.modes[name].ttft_warm_s == pytest.approx(WARM_FETCH_S + ENGINE_S), name
    assert (result.fetch_s, result.warm_fetch_s) == (COLD_FETCH_S, WARM_FETCH_S)  # the projection's, not a served's
    plain_modes = sum(not name.startswith("served") for name in names)
    # each mode: cold, summary, warm and the continuation's score; the harness's two where a served mode leads
    assert engine.plain_requests == 4 * plain_modes + 2 * names[0].startswith("served")


def test_first_fetches_refuses_a_served_correction_before_the_projections_fetch():
    """FirstFetches (the vLLM demo's too) cannot count projecting into a served correction's cold TTFT without the
    projection's own cold and warm fetch first: it says so rather than report a cold TTFT without it."""
    first = FirstFetches()
    served = {"key": "k", "mode": "blend:0.1"}
    reply = {"seconds": 2.0, "kvbridge_fetch_s": 1.5}
    assert first.needs_projection(served) and not first.needs_projection({"key": "k", "mode": "replace"})
    with pytest.raises(ValueError, match="before the plain projection"):
        first.cold_seconds(served, reply, reply)
    plain = first.plain({**served, "recompute_tokens": 3})
    assert plain == {"key": "k", "mode": "replace"}
    assert first.cold_seconds(plain, {"seconds": 1.2, "kvbridge_fetch_s": 1.0}, {"kvbridge_fetch_s": 0.1}) == 1.2
    assert not first.needs_projection(served)
    assert first.cold_seconds(served, reply, reply) == pytest.approx(2.0 + 1.0 - 0.1)


class ComputeLog(ProjectedSource):
    """ProjectedSource that keeps, per fetch (cold, then warm): (mode, cold s, warm s, target tokens the server
    projected, target tokens it corrected), the tokens from the server's own counts."""

    def __init__(self, client, target, service):
        super().__init__(client, target)
        self.service, self.fetches = service, []

    def _computed(self) -> tuple[int, int]:
        counts = self.service.token_counts
        return counts[("projection", "computed")], counts[("correction", "computed")]

    def fetch(self, text: str, mode: str = "replace"):
        before = self._computed()
        fetched, cold_s, warm_s, tokens = super().fetch(text, mode)
        projected, corrected = (a - b for a, b in zip(self._computed(), before))
        self.fetches.append((mode, cold_s, warm_s, projected, corrected))
        return fetched, cold_s, warm_s, tokens


@pytest.mark.integration  # identity_server
@pytest.mark.parametrize("order", ["full,served:blend:0.1,served:recompute:0.1",
                                   "full,served:recompute:0.1,served:blend:0.1"])
def test_in_process_cold_ttft_of_every_served_correction_counts_projecting_whatever_the_order(identity_server,
                                                                                              tiny_target, order):
    """With no mode reading the plain projection, the second served correction could find the projection the first
    one's fetch stored. The harness fetches the projection first (the server projects there, never in a served
    fetch), and every served mode's cold TTFT is its own fetch over the stored projection plus the projection's cold
    fetch over a warm one, in either order."""
    from kvbridge.server.client import KVBridgeClient

    text = " ".join(f"{order.split(',')[1]}{i} cold" for i in range(60))  # a document no other test stores
    doc = prepare(SimpleNamespace(id="d", document=text, summary=""), tiny_target, CONFIG)
    with KVBridgeClient(identity_server.address) as client:
        source = ComputeLog(client, tiny_target, identity_server.service)
        result = SummaryEvaluator(tiny_target, parse_modes(order), CONFIG, source).run(doc)
    assert list(result.modes) == order.split(",")
    (plain, plain_cold, plain_warm, projected, corrected), *served = source.fetches
    assert plain == "replace" and projected > 0 and corrected == 0  # the server projected at the harness's fetch
    assert (result.fetch_s, result.warm_fetch_s) == (plain_cold, plain_warm)
    assert [s[0] for s in served] == [name.removeprefix("served:") for name in order.split(",")[1:]]
    for mode, cold, warm, projected, corrected in served:
        assert projected == 0 and corrected > 0, mode  # a correction of the stored projection
        m = result.modes[f"served:{mode}"]  # its cold fetch and the projection's cold cost, less its warm fetch
        assert m.ttft_s - m.ttft_warm_s == pytest.approx(cold + plain_cold - plain_warm - warm), mode
