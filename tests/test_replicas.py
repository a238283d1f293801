"""Two `kvbridge serve` processes on one redis-server (issue 16, part 2): an entry the first ingests is found,
fetched and projected by the second, with the same KV, and only by its tenant."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
import torch
from kvbridge.server.client import KVBridgeClient, KVBridgeError

pytestmark = pytest.mark.integration

TOKEN = "replica-token-0123456789abcdef"
OTHER = "other-token-0123456789abcdef01"
TEXT = ("Each record holds a name and a value; readers skip the fields they do not know and keep the rest. "
        "Writers keep the order of the fields they were given, and a reader may stop at any field.")


def _shm_folders(pid: int) -> set[Path]:
    """The segment folders a server process holds open (the `.lock` it keeps for its life)."""
    links = (os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir())
    return {Path(link).parent for link in links if link.startswith("/dev/shm/") and link.endswith("/.lock")}


def test_a_second_replica_finds_fetches_and_projects_what_the_first_ingested(tmp_path, redis_url,
                                                                             tiny_adapter_file, session_shm_dir):
    from serveproc import ServeProcess, tiny_replica_args

    args = tiny_replica_args(tmp_path, tiny_adapter_file, redis_url, f"acme {TOKEN}\nother {OTHER}\n")
    first = ServeProcess(tmp_path / "first", args, env={"KVBRIDGE_HOME": str(tmp_path)}, start_timeout_s=240)
    second = ServeProcess(tmp_path / "second", args, env={"KVBRIDGE_HOME": str(tmp_path)}, start_timeout_s=240)
    try:
        first.start()
        second.start()
        if session_shm_dir is not None:  # their segment folders: in the test session's own, not in /dev/shm itself
            for replica in (first, second):
                held = _shm_folders(replica.pid)
                assert len(held) == 1 and next(iter(held)).parent == session_shm_dir, held
        with KVBridgeClient(first.address, token=TOKEN, retries=0) as a, \
                KVBridgeClient(second.address, token=TOKEN, retries=0) as b:
            entry = a.ingest(TEXT).entries[0]
            source_a = a.fetch_source(key=entry.key)
            projected_a = a.fetch_projected(key=entry.key)

            found = b.lookup(TEXT)
            assert found.key == entry.key and found.num_tokens == entry.num_tokens
            source_b = b.fetch_source(key=entry.key)
            assert torch.equal(source_b.segment.kv, source_a.segment.kv) and source_b.text == TEXT
            projected_b = b.fetch_projected(key=entry.key)  # aligned with the text the record carries
            assert torch.equal(projected_b.segment.token_ids, projected_a.segment.token_ids)
            torch.testing.assert_close(projected_b.segment.kv, projected_a.segment.kv, atol=1e-6, rtol=1e-6)
            by_text = b.fetch_projected(text=TEXT, require_cached=True)  # found, not ingested again
            assert by_text.source_key == entry.key
            # the phrase a replica logs for an ingest: the first's, never the second's
            assert "ingest tenant=acme" in first.logfile.read_text()
            assert "ingest tenant=acme" not in second.logfile.read_text()
            # a served correction the first computed: the second adopts it, runs no target over it
            corrected_a = a.fetch_projected(key=entry.key, mode="blend:0.2")
            assert "correction tenant=acme mode=blend:0.2" in first.logfile.read_text()
            corrected_b = b.fetch_projected(key=entry.key, mode="blend:0.2")
            assert corrected_b.entry_key == corrected_a.entry_key and corrected_b.mode == "blend:0.2"
            assert torch.equal(corrected_b.recomputed, corrected_a.recomputed)
            torch.testing.assert_close(corrected_b.segment.kv, corrected_a.segment.kv, atol=1e-6, rtol=1e-6)
            assert "correction tenant=" not in second.logfile.read_text()
        with KVBridgeClient(second.address, token=OTHER, retries=0) as other:
            with pytest.raises(KVBridgeError) as info:
                other.fetch_source(key=entry.key)
            assert info.value.code == grpc.StatusCode.NOT_FOUND
            assert other.lookup(TEXT).key is None
            with pytest.raises(KVBridgeError) as info:  # nor the correction's entry
                other.fetch_projected(key=corrected_a.entry_key)
            assert info.value.code == grpc.StatusCode.NOT_FOUND
        assert first.stop() == 0 and second.stop() == 0
    finally:
        first.kill()
        second.kill()
