"""Served corrections (server/corrections.py): GetProjectedCache's mode computed once with the target, stored linked
to its source entry, then served from the store; equal to the in-process correction with the same rule and prior."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from kvbridge.server.adapter_registry import AdapterRegistry
from kvbridge.server.corrections import CorrectionLimits, Corrections, recomputed_of
from kvbridge.server.service import KVBridgeService
from kvbridge.transfer import kvcache
from kvbridge.transfer.store import NotFound, PagedStore, StoreConfig
from kvbridge.transfer.suffix.correction import Correction, correct
from kvbridge.transfer.suffix.induction import InductionPrior

TEXT = ("Readers skip the fields they do not understand, and writers keep the order of the fields they were given. "
        "A reader may stop at any field; a writer never reorders what it was handed.")


def _service(tiny_source, tiny_target, folder, adapter, store=None, **limits) -> KVBridgeService:
    store = store or PagedStore(StoreConfig(capacity_bytes=32 << 20, device="cpu"))
    registry = AdapterRegistry(folder, tiny_source.spec, [tiny_target.spec])
    registry.add("fitted", adapter, make_default=True)
    return KVBridgeService(tiny_source, [tiny_target], store, registry,
                           corrections=Corrections(CorrectionLimits(**limits)))


class Forwards:
    """Counts the forwards of a model's decoder (a hook on its first layer)."""

    def __init__(self, lm):
        self.count = 0
        self._lock = threading.Lock()
        self._handle = lm.model.model.layers[0].register_forward_hook(self._hook)

    def _hook(self, *_):
        with self._lock:
            self.count += 1

    def close(self):
        self._handle.remove()


@pytest.mark.parametrize("mode", ["replace", "recompute:0.1", "recompute:1", "blend:0.05", "blend:0.25", "blend:1"])
def test_a_corrections_planned_forwards_are_the_ones_it_runs(tiny_target, mode):
    """Correction.forwards (what eval counts for a server's stored correction) equals correct()'s own forwards."""
    ids = torch.randint(3, tiny_target.spec.vocab_size, (41,), generator=torch.Generator().manual_seed(2))
    projected = kvcache.extract(tiny_target.model, tiny_target.spec, ids)
    correction = Correction.parse(mode)
    done = correct(tiny_target, projected, correction)
    assert done.forwards == correction.forwards(40, tiny_target.spec.num_layers)
    assert int((~done.still_projected[1:]).sum()) == correction.tokens(40)
    with pytest.raises(ValueError, match="at least one document token"):
        correction.forwards(0, tiny_target.spec.num_layers)


def test_mode_strings_parse_and_bad_ones_name_the_field():
    assert str(Correction.parse("blend:0.1")) == "blend:0.1" and Correction.parse("replace").kind == "replace"
    assert Correction.parse("recompute:0.25").tokens(100) == 25
    for bad in ("blend", "blend:", "blend:0", "blend:1.5", "blend:nan", "replace:0.1", "fuse:0.1", "Blend:0.1", "x"):
        with pytest.raises(ValueError, match="^mode"):
            Correction.parse(bad)
    with pytest.raises(ValueError, match="correction"):
        CorrectionLimits(default="blend:2")
    with pytest.raises(ValueError, match="max_corrections"):
        CorrectionLimits(max_running=0)
    assert recomputed_of({"recomputed": "0,3,7"}, 8) == [0, 3, 7]
    for bad in ("3,1", "0,0", "0,8", "-1", "a", 5):  # records come back from Redis: checked, never trusted
        with pytest.raises(ValueError, match="recomputed positions"):
            recomputed_of({"recomputed": bad}, 8)


@pytest.mark.parametrize("kind", ["recompute", "blend"])
def test_fractions_that_recompute_different_tokens_are_stored_apart(tmp_path, tiny_source, tiny_target, adapter, kind):
    """A stored correction is keyed by its mode's name: two fractions that print alike to 6 digits ('%g') but
    recompute a different number of tokens once shared one entry, and the second was served the first's KV."""
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    d = service.projected_cache("t", text=TEXT, mode="replace").segment.num_tokens - 1
    k = 2 if d % 4 else 4  # an even k: round((k + 0.5) / d · d) rounds half to even, down to k
    low = (k + 0.5) / d
    high = low * (1 + 4e-7)  # the same 6 digits, and past the half: k + 1 tokens
    assert f"{low:g}" == f"{high:g}"
    assert (Correction(kind, low).tokens(d), Correction(kind, high).tokens(d)) == (k, k + 1)
    for fraction, want in ((low, k), (high, k + 1)):
        mode = f"{kind}:{fraction!r}"
        served = service.projected_cache("t", text=TEXT, mode=mode)
        assert len([p for p in served.recomputed if p >= 1]) == want, mode  # position 0: the start token, its own
        assert served.mode == mode and Correction.parse(served.mode) == Correction.parse(mode)  # its name parses back


@pytest.mark.parametrize("mode", ["blend:0.1", "recompute:0.2"])
def test_a_served_correction_equals_the_in_process_one_and_is_computed_once(tmp_path, tiny_source, tiny_target,
                                                                            adapter, mode):
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    key = service.ingest("t", text=TEXT).entries[0][0].key
    plain = service.projected_cache("t", key=key, mode="replace")
    assert plain.mode == "replace" and plain.recomputed == ()
    want = correct(tiny_target, plain.segment, Correction.parse(mode), prior=InductionPrior.for_model(tiny_target))
    forwards = Forwards(tiny_target)
    try:
        served = service.projected_cache("t", key=key, mode=mode)
        computed = forwards.count
        assert computed >= 1  # the target ran over the projection
        again = service.projected_cache("t", text=TEXT, mode=mode)  # by text too: the same stored entry
        shifted = service.projected_cache("t", key=key, mode=mode, offset=3)
        assert forwards.count == computed  # no target forward: store hits
    finally:
        forwards.close()
    assert served.mode == mode and served.entry_key == again.entry_key != plain.entry_key
    torch.testing.assert_close(served.segment.kv, want.segment.kv, atol=1e-5, rtol=1e-5)
    assert torch.equal(again.segment.kv, served.segment.kv)
    assert list(served.recomputed) == (~want.still_projected).nonzero()[:, 0].tolist()
    assert len(served.recomputed) == Correction.parse(mode).tokens(plain.segment.num_tokens - 1) + 1  # + start
    assert torch.equal(shifted.segment.positions, served.segment.positions + 3)
    # same greedy tokens from both caches
    from kvbridge.transfer import kvcache

    prompt = tiny_target.tokenizer(" The reader", add_special_tokens=False, return_tensors="pt").input_ids[0]
    outs = []
    for seg in (served.segment, want.segment):
        ids = torch.cat((seg.token_ids, prompt))[None]
        outs.append(tiny_target.model.generate(input_ids=ids, cache=kvcache.to_cache(seg, tiny_target.model,
                                                                                        tiny_target.spec),
                                               max_new_tokens=8, do_sample=False)[0, ids.shape[1]:])
    assert torch.equal(outs[0], outs[1])
    assert service.token_counts[("correction", "computed")] == served.segment.num_tokens
    assert service.token_counts[("correction", "reused")] == 2 * served.segment.num_tokens


def test_corrections_cascade_with_their_source_and_stay_with_their_tenant(tmp_path, tiny_source, tiny_target,
                                                                          adapter):
    service = _service(tiny_source, tiny_target, tmp_path, adapter, default="blend:0.1")
    key = service.ingest("a", text=TEXT).entries[0][0].key
    served = service.projected_cache("a", key=key)  # the server's default
    assert served.mode == "blend:0.1"
    with pytest.raises(NotFound):  # another tenant neither reads nor detects it
        service.projected_cache("b", key=key)
    with pytest.raises(NotFound):
        service.store.info(served.entry_key, "b")
    theirs = service.projected_cache("b", text=TEXT)  # b's own document: its own entries
    assert theirs.entry_key != served.entry_key and theirs.source_key != key
    torch.testing.assert_close(theirs.segment.kv, served.segment.kv)
    assert service.delete("a", key) >= 3  # the source, its projection and its correction
    for entry in (served.entry_key, key):
        with pytest.raises(NotFound):
            service.store.info(entry, "a")
    assert service.store.info(theirs.entry_key, "b").num_tokens == served.segment.num_tokens


def test_corrections_run_one_at_a_time_and_a_source_deleted_meanwhile_leaves_nothing(tmp_path, tiny_source,
                                                                                     tiny_target, adapter,
                                                                                     monkeypatch):
    import kvbridge.server.corrections as corrections

    service = _service(tiny_source, tiny_target, tmp_path, adapter, max_running=1)
    keys = [service.ingest("t", text=f"{TEXT} Part {i}.").entries[0][0].key for i in range(3)]
    for key in keys:
        service.projected_cache("t", key=key, mode="replace")  # projections made: only corrections run below
    state = {"running": 0, "most": 0}
    lock = threading.Lock()
    real = corrections.correct

    def slow_correct(*args, **kwargs):
        with lock:
            state["running"] += 1
            state["most"] = max(state["most"], state["running"])
        time.sleep(0.2)  # long enough for the others to queue at the bound
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                state["running"] -= 1

    monkeypatch.setattr(corrections, "correct", slow_correct)
    errors = []

    def fetch(key):
        try:
            service.projected_cache("t", key=key, mode="blend:0.2")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=fetch, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and state["most"] == 1

    # the source deleted while its correction runs: NotFound, and no corrected entry left behind
    key = service.ingest("t", text=TEXT).entries[0][0].key
    service.projected_cache("t", key=key, mode="replace")

    def deleting_correct(*args, **kwargs):
        service.delete("t", key)
        return real(*args, **kwargs)

    monkeypatch.setattr(corrections, "correct", deleting_correct)
    before = set(service.store.keys("t"))
    with pytest.raises(NotFound):
        service.projected_cache("t", key=key, mode="blend:0.1")
    after = set(service.store.keys("t"))
    assert key in before and key not in after and after < before  # nothing new: no orphaned correction


def test_bad_modes_are_invalid_argument_naming_the_field(tmp_path, tiny_source, tiny_target, adapter):
    from kvbridge.server.app import start_server
    from kvbridge.server.client import KVBridgeClient, KVBridgeError
    from kvbridge.server.config import ServeConfig

    config = ServeConfig(preset="tiny", listen="127.0.0.1:0", selfcheck=False, adapters=str(tmp_path),
                         store_capacity_mb=32, store_device="cpu", shm_dir=None)
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    running = start_server(service, config)
    try:
        with KVBridgeClient(running.address, retries=0) as client:
            key = client.ingest(TEXT).entries[0].key
            for bad in ("blend:2", "fuse:0.1", "blend"):
                with pytest.raises(KVBridgeError) as info:
                    client.fetch_projected(key=key, mode=bad)
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "mode" in info.value.details
            fetched = client.fetch_projected(key=key, mode="blend:0.1")
            assert fetched.mode == "blend:0.1" and fetched.recomputed.numel() >= 2
            assert client.fetch_projected(key=key, mode="replace").mode == "replace"
    finally:
        running.stop(grace_s=1)


def test_a_service_started_with_its_checks_warms_its_corrections_and_stores_nothing(tmp_path, tiny_source,
                                                                                     tiny_target, adapter,
                                                                                     monkeypatch, caplog):
    from kvbridge.adapters.io import save_adapter
    from kvbridge.server.app import build_service
    from kvbridge.server.config import ServeConfig

    save_adapter(adapter, tmp_path / "adapters" / "fitted.safetensors")
    probes = []
    real = InductionPrior.probed.__func__
    monkeypatch.setattr(InductionPrior, "probed", classmethod(lambda cls, lm, *a, **k: probes.append(lm.name)
                                                              or real(cls, lm, *a, **k)))
    store = PagedStore(StoreConfig(capacity_bytes=32 << 20, device="cpu"))
    forwards = Forwards(tiny_target)
    try:
        with caplog.at_level("INFO", logger="kvbridge.server"):
            service = build_service(ServeConfig(preset="tiny", adapters=str(tmp_path / "adapters"), selfcheck=True,
                                                correction="blend:0.2"),
                                    source=tiny_source, targets=[tiny_target], store=store)
        warmed = forwards.count
    finally:
        forwards.close()
    assert any(f"corrections warmed on {tiny_target.name}" in r.getMessage() for r in caplog.records)
    # recompute:0.1, blend:0.1 and the default blend:0.2 ran the target (besides its self-checks); nothing stored
    assert warmed >= 3 and store.stats().entries == 0 and store.stats().puts == 0
    prior_builds = len(probes)
    assert prior_builds == 1  # the tiny target has no shipped fit: probed once, at start
    key = service.ingest("t", text=TEXT).entries[0][0].key
    assert service.projected_cache("t", key=key).mode == "blend:0.2"
    assert len(probes) == prior_builds  # the first corrected fetch builds no prior
    off = Corrections(CorrectionLimits(prior=False))
    assert off.warm(tiny_target) >= 0 and off.prior(tiny_target) is None  # warmed without a prior when it is off


def test_a_prior_fitted_for_another_adapter_is_read_and_said_once(tmp_path, tiny_source, tiny_target, adapter,
                                                                  monkeypatch, caplog):
    from kvbridge.transfer.suffix import induction

    terms = InductionPrior.probed(tiny_target).terms.clone()
    terms[0, 1, 0] = 2.0  # a fitted file of the tiny target's
    folder = tmp_path / "priors"
    folder.mkdir()
    target = {"name": tiny_target.name, "config_hash": tiny_target.spec.identity.config_hash}
    InductionPrior(terms).save(folder / "tiny.safetensors", {"target": target,
                                                             "adapter": {"name": "other", "digest": "0" * 64}})
    monkeypatch.setattr(induction, "PRIORS", folder)
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    with caplog.at_level("WARNING", logger="kvbridge.server.corrections"):
        for text in (TEXT, TEXT + " Two texts, two corrections."):
            assert service.projected_cache("t", text=text, mode="blend:0.1").mode == "blend:0.1"
    said = [r.getMessage() for r in caplog.records if "was fitted for adapter other" in r.getMessage()]
    assert len(said) == 1 and adapter.digest[:16] in said[0]  # read, and said once, naming both adapters
    InductionPrior(terms).save(folder / "tiny.safetensors", {"target": target,
                                                             "adapter": {"name": "fitted", "digest": adapter.digest}})
    caplog.clear()
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    with caplog.at_level("WARNING", logger="kvbridge.server.corrections"):
        service.projected_cache("t", text=TEXT, mode="blend:0.1")
    assert not [r for r in caplog.records if "induction prior" in r.getMessage()]  # its own adapter: nothing to say


def test_a_given_prior_file_is_read_for_its_own_target_and_refused_for_none(tmp_path, tiny_source, tiny_target,
                                                                            tiny_adapter_file):
    from kvbridge.server.app import build_service
    from kvbridge.server.config import ServeConfig

    folder = tmp_path / "adapters"
    folder.mkdir()
    (folder / "fitted.safetensors").write_bytes(tiny_adapter_file.read_bytes())
    terms = InductionPrior.probed(tiny_target).terms.clone()
    terms[0, 1, 0] = 2.0
    mine, theirs = tmp_path / "mine.safetensors", tmp_path / "theirs.safetensors"
    InductionPrior(terms).save(mine, {"target": {"name": tiny_target.name,
                                                 "config_hash": tiny_target.spec.identity.config_hash}})
    InductionPrior(terms).save(theirs, {"target": {"name": "another-model", "config_hash": "1" * 64}})

    def config(prior_file):
        return ServeConfig(preset="tiny", adapters=str(folder), selfcheck=False, correction="blend:0.1",
                           correction_prior_file=str(prior_file))

    service = build_service(config(mine), source=tiny_source, targets=[tiny_target])
    prior = service.corrections.prior(tiny_target)
    assert prior.origin == "mine.safetensors" and torch.equal(prior.terms, terms)
    with pytest.raises(ValueError, match="fitted for none of the served targets"):
        build_service(config(theirs), source=tiny_source, targets=[tiny_target])
    with pytest.raises(ValueError, match="not an induction prior file"):
        build_service(config(tiny_adapter_file), source=tiny_source, targets=[tiny_target])
    with pytest.raises(ValueError, match="fitted for another-model, not for"):
        InductionPrior.load_for(theirs, tiny_target)


def test_corrections_made_with_another_prior_are_never_served_for_this_ones(tmp_path, tiny_source, tiny_target,
                                                                           adapter):
    terms = InductionPrior.probed(tiny_target).terms.clone()
    terms[0, 1, 0] = 2.0
    mine = tmp_path / "mine.safetensors"
    InductionPrior(terms).save(mine, {"target": {"name": tiny_target.name,
                                                 "config_hash": tiny_target.spec.identity.config_hash}})
    store = PagedStore(StoreConfig(capacity_bytes=32 << 20, device="cpu"))  # one store, as replicas share Redis
    shipped = _service(tiny_source, tiny_target, tmp_path, adapter, store=store)
    given = _service(tiny_source, tiny_target, tmp_path, adapter, store=store, prior_file=str(mine))
    bare = _service(tiny_source, tiny_target, tmp_path, adapter, store=store, prior=False)
    tags = [s.corrections.prior_tag(tiny_target) for s in (shipped, given, bare)]
    assert tags[0] == "" and tags[1].startswith("/prior~") and tags[2] == "/noprior"
    key = shipped.ingest("t", text=TEXT).entries[0][0].key
    served = {}
    for name, service in (("shipped", shipped), ("given", given), ("bare", bare)):
        forwards = Forwards(tiny_target)
        try:
            served[name] = service.projected_cache("t", key=key, mode="blend:0.1").segment
            assert forwards.count >= 1, f"{name}: served another prior's correction from the store"
        finally:
            forwards.close()
    assert not torch.equal(served["given"].kv, served["shipped"].kv)  # the given prior made other KV
