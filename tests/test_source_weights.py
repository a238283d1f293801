"""A server whose source model is loaded without its weights (`source_weights = false`, `--no-source-weights`): it
stores and projects the source KV others compute (PutSourceKV, a vLLM engine that saves it) exactly as a server with
the weights does, refuses to compute any itself, and still checks what it receives."""

import grpc
import pytest
import served
import torch
from kvbridge.server.client import KVBridgeClient
from kvbridge.server.replies import KVBridgeError
from kvbridge.transfer import kvcache
from kvbridge.transfer.models import without_weights
from kvbridge.transfer.presets import load_pair

pytestmark = pytest.mark.integration  # the `weightless` server

TEXT = served.text(0, 40)


@pytest.fixture(scope="module")
def weightless(adapters_dir):
    """The tiny pair from the preset (as `kvbridge serve --preset tiny --no-source-weights` loads it), open."""
    running = served.start(None, None, adapters_dir, tokens=None, source_weights=False)
    yield running
    running.stop(1)


def test_the_source_is_served_without_weights_and_the_target_with_them(weightless):
    models = weightless.service.models
    source = models[weightless.service.source_name].lm
    assert not source.has_weights and all(p.device.type == "meta" for p in source.model.parameters())
    assert all(models[name].lm.has_weights for name in weightless.service.target_names)


def test_the_weightless_model_has_the_spec_and_rope_of_the_loaded_one(tiny_source):
    bare = without_weights(tiny_source)
    assert bare.spec == tiny_source.spec and not bare.has_weights and tiny_source.has_weights
    positions = torch.arange(0, 3000, 7)
    for layer in range(tiny_source.spec.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(bare.rope.cos_sin(layer, positions),
                                                       tiny_source.rope.cos_sin(layer, positions), strict=True))
    source, _ = load_pair("tiny", source_weights=False)
    assert source.spec == tiny_source.spec and not source.has_weights


def test_ingest_is_refused_by_name_and_stores_nothing(weightless):
    with KVBridgeClient(weightless.address) as client:
        with pytest.raises(KVBridgeError) as caught:
            client.ingest(text=TEXT)
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "without its weights" in caught.value.details and "PutSourceKV" in caught.value.details
        with pytest.raises(KVBridgeError) as caught:  # a fetch by text of a text never stored would ingest it
            client.fetch_projected(text=TEXT, mode="replace")
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert client.lookup(text=TEXT).key is None


def test_uploaded_kv_projects_exactly_as_on_a_server_that_computed_it(weightless, alice, tiny_source):
    """The same text's KV, computed by the server that has the weights (Ingest) and uploaded to the one that has
    none: the projections are identical, by key and by text."""
    ingested = alice.ingest(text=TEXT)
    entry, ids = ingested.entries[0], ingested.source_token_ids.tolist()
    reference = alice.fetch_projected(key=entry.key, mode="replace").segment
    kv = kvcache.extract(tiny_source.model, tiny_source.spec, torch.tensor(ids)).kv  # what a source engine computes
    with KVBridgeClient(weightless.address) as client:
        stored = client.put_kv(kv, ids, model=tiny_source.name, config_hash=tiny_source.spec.identity.config_hash)
        assert stored.num_tokens == len(ids)
        by_key = client.fetch_projected(key=stored.key, mode="replace").segment
        by_text = client.fetch_projected(text=TEXT, mode="replace", require_cached=True).segment
    assert torch.equal(by_key.token_ids, reference.token_ids) and torch.equal(by_key.kv, reference.kv)
    assert torch.equal(by_text.kv, reference.kv)
    assert weightless.service.token_counts[("ingest", "computed")] == 0


def test_uploads_are_still_checked(weightless, tiny_source, tiny_target):
    ids = list(range(5, 25))
    kv = kvcache.extract(tiny_source.model, tiny_source.spec, torch.tensor(ids)).kv
    with KVBridgeClient(weightless.address) as client:
        with pytest.raises(KVBridgeError, match="config_hash") as caught:
            client.put_kv(kv, ids, model=tiny_source.name, config_hash=tiny_target.spec.identity.config_hash)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(KVBridgeError, match="shape|head"):
            client.put_kv(kv[:, :, :, :, :-1].contiguous(), ids, model=tiny_source.name)
        assert client.lookup(token_ids=ids).key is None
