"""The same-host data plane (issue 16, part 3): KV through a 0600 shared-memory file instead of the gRPC stream.

The file layout and the server's registry, alone (a fake clock for the TTL): a segment maps back bit-identical
without a copy, a file that is not what its header says is refused, the registry releases to the owner only, sweeps
after the TTL, refuses past max_bytes, keeps spares, and keeps a finished file for the next fetch of the same KV
(kept files): linked under a new name, never for another tenant or another entry. Through a server:
tests/test_shm_server.py.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch
from kvbridge.server import shm_layout
from kvbridge.server.shm_segments import SegmentRegistry, SegmentsFull
from safetensors.torch import load_file


def _kv(dtype=torch.float32, shape=(3, 2, 2, 17, 8)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def file_mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ------------------------------------------------------------------------------------------------ the file


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_segment_maps_back_bit_identical_without_a_copy(tmp_path, dtype):
    kv = _kv(dtype)
    path = tmp_path / "seg.safetensors"
    size, checksum = shm_layout.write(path, kv)
    assert file_mode(path) == 0o600 and path.stat().st_size == size
    assert checksum == shm_layout.checksum(path.read_bytes())
    assert torch.equal(load_file(str(path))["kv"], kv)  # a valid safetensors file
    mapped = shm_layout.map_kv(path, size, checksum, tuple(kv.shape), dtype)
    assert mapped.dtype == dtype and torch.equal(mapped, kv)
    # a map, not a copy: a byte written to the file shows in the tensor (its pages are the file's until written)
    with open(path, "r+b") as f:
        f.seek(size - kv.element_size())
        f.write(b"\0" * kv.element_size())
    assert mapped.reshape(-1)[-1].item() == 0.0
    path.unlink()
    assert torch.equal(mapped.reshape(-1)[:-1], kv.reshape(-1)[:-1])  # the map outlives the file
    mapped[0, 0, 0, 0, 0] = 1.0  # copy-on-write: writable, and the writes stay private


def test_a_segment_that_is_not_what_the_header_says_is_refused(tmp_path):
    kv = _kv()
    path = tmp_path / "seg.safetensors"
    size, checksum = shm_layout.write(path, kv)
    shape = tuple(kv.shape)
    with pytest.raises(shm_layout.SegmentError, match="bytes, the header says"):
        shm_layout.map_kv(path, size + 8, checksum, shape, torch.float32)
    with pytest.raises(shm_layout.SegmentError, match="the fetch's header says"):
        shm_layout.map_kv(path, size, checksum, (3, 2, 2, 8, 17), torch.float32)
    with open(path, "r+b") as f:  # one flipped byte in the KV
        f.seek(size - 1)
        last = f.read(1)
        f.seek(size - 1)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(shm_layout.SegmentError, match="checksum"):
        shm_layout.map_kv(path, size, checksum, shape, torch.float32)
    os.chmod(path, 0o644)
    with pytest.raises(shm_layout.SegmentError, match="mode 0600"):
        shm_layout.map_kv(path, size, checksum, shape, torch.float32)
    with pytest.raises(FileExistsError):  # never written over
        shm_layout.write(path, kv)
    with pytest.raises(FileNotFoundError):
        shm_layout.map_kv(tmp_path / "gone.safetensors", size, checksum, shape, torch.float32)


@pytest.mark.parametrize("path, name", [
    ("/etc/passwd", "passwd"), ("/dev/shm/kvbridge-ab/x.safetensors", "y"), ("kvbridge-ab/x.safetensors", "x"),
    ("/dev/shm/kvbridge-ab/../x.safetensors", "x"), ("/home/u/x.safetensors", "x"), ("/dev/shm/kvbridge-ab/", "")])
def test_a_client_opens_only_paths_shaped_like_a_segment(path, name):
    with pytest.raises(shm_layout.SegmentError):
        shm_layout.check_path(path, name)
    shm_layout.check_path("/dev/shm/kvbridge-ab12/Zx-9_q.safetensors", "Zx-9_q")


# ------------------------------------------------------------------------------------------------ the registry


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_registry_releases_to_the_owner_only_sweeps_after_the_ttl_and_cleans_up(tmp_path):
    clock = FakeClock()
    registry = SegmentRegistry(tmp_path, ttl_s=10.0, max_bytes=1 << 20, clock=clock)
    assert file_mode(registry.folder) == 0o700 and registry.folder.name.startswith("kvbridge-")
    kept = registry.publish("alice", _kv())
    read = registry.publish("alice", _kv())
    assert file_mode(kept.path) == 0o600 and kept.name != read.name and len(kept.name) >= 32
    assert registry.release("bob", read.name) is False and read.path.exists()  # another tenant finds nothing
    assert registry.release("alice", read.name) is True and not read.path.exists()
    assert registry.release("alice", read.name) is False
    clock.now = 9.9
    assert registry.sweep() == 0 and kept.path.exists()
    clock.now = 10.0
    assert registry.sweep() == 1 and not kept.path.exists()
    assert len(registry) == 0 and registry.held_bytes == 0
    registry.publish("bob", _kv())
    registry.close()
    assert not registry.folder.exists()


def test_registry_refuses_past_max_bytes_and_gives_the_bytes_back(tmp_path):
    kv = _kv()
    registry = SegmentRegistry(tmp_path, ttl_s=10.0, max_bytes=kv.numel() * 4 + 512)
    first = registry.publish("alice", kv)
    with pytest.raises(SegmentsFull):
        registry.publish("alice", kv)
    assert registry.held_bytes == first.size and len(list(registry.folder.glob("*.safetensors"))) == 1
    registry.release("alice", first.name)
    registry.publish("alice", kv)
    registry.close()


@pytest.mark.parametrize("dtype, shape", [(torch.float32, (3, 2, 2, 17, 8)), (torch.bfloat16, (3, 2, 1, 5, 3))])
def test_a_segment_filled_in_place_is_named_only_when_complete_and_sums_its_bytes(tmp_path, dtype, shape):
    kv = _kv(dtype, shape)  # the bf16 layers are 30 bytes: the checksum's words straddle layers
    registry = SegmentRegistry(tmp_path, ttl_s=10.0, max_bytes=1 << 20)
    pending = registry.reserve("alice", dtype)
    assert pending.tensor(shape, torch.float16 if dtype != torch.float16 else torch.float32) is None  # other dtype
    buffer = pending.tensor(shape, dtype)
    for layer in range(shape[0]):
        assert not list(registry.folder.glob("*.safetensors"))  # unnamed until published
        buffer[layer].copy_(kv[layer])
        pending.written(layer, layer + 1)
    segment = pending.publish(buffer)  # the buffer itself: no copy
    assert file_mode(segment.path) == 0o600 and segment.checksum == shm_layout.checksum(segment.path.read_bytes())
    assert torch.equal(load_file(str(segment.path))["kv"], kv)
    assert torch.equal(shm_layout.map_kv(segment.path, segment.size, segment.checksum, shape, dtype), kv)
    assert registry.held_bytes == segment.size == segment.path.stat().st_size
    registry.close()


def test_a_fetch_that_fails_leaves_no_file_and_gives_its_bytes_back(tmp_path):
    registry = SegmentRegistry(tmp_path, ttl_s=10.0, max_bytes=1 << 20)
    pending = registry.reserve("alice")
    pending.tensor((3, 2, 2, 17, 8), torch.float32)[0].fill_(1.0)
    pending.discard()
    assert registry.held_bytes == 0 and [p.name for p in registry.folder.iterdir()] == [".lock"]
    registry.close()



def test_released_segments_leave_spares_that_the_next_segments_are_written_into(shm_root):
    kv = _kv()
    registry = SegmentRegistry(shm_root, ttl_s=10.0, max_bytes=1 << 20, spares=2)
    first = registry.publish("alice", kv)
    assert registry.make_spares() == 0  # spares follow a released segment's size
    registry.release("alice", first.name)
    assert registry.make_spares() == 2
    spares = sorted(p for p in registry.folder.iterdir() if p.name != ".lock")
    assert len(spares) == 2 and all(file_mode(p) == 0o600 and not p.name.endswith(".safetensors") for p in spares)
    assert all(p.stat().st_blocks * 512 >= first.size for p in spares)  # pages allocated, not a sparse file
    assert registry.held_bytes == 2 * first.size
    second = registry.publish("bob", kv.flip(0).contiguous())  # written into a spare, renamed
    assert sum(p.exists() for p in spares) == 1 and torch.equal(load_file(str(second.path))["kv"], kv.flip(0))
    assert second.checksum == shm_layout.checksum(second.path.read_bytes())
    assert registry.held_bytes == 2 * first.size
    registry.close()
    assert not registry.folder.exists()


def test_spares_give_way_to_segments_at_max_bytes(tmp_path):
    kv = _kv()
    size = shm_layout.segment_size(tuple(kv.shape), kv.dtype)
    registry = SegmentRegistry(tmp_path, ttl_s=10.0, max_bytes=2 * size, spares=2)
    registry.release("alice", registry.publish("alice", kv).name)
    assert registry.make_spares() == 2 and registry.held_bytes == 2 * size
    big = _kv(shape=(3, 2, 2, 30, 8))  # fits no spare: grows the largest
    held = [registry.publish("alice", big)]
    assert registry.held_bytes <= 2 * size
    with pytest.raises(SegmentsFull):
        registry.publish("alice", big)  # the remaining spare went; two big ones do not fit
    assert registry.held_bytes == held[0].size
    registry.close()


@pytest.mark.parametrize("peer, local", [
    ("ipv4:127.0.0.1:50051", True), ("ipv6:%5B::1%5D:50051", True), ("unix:/run/kvbridge.sock", True),
    ("ipv6:%5B::ffff:127.0.0.1%5D:5", True), ("ipv4:10.0.0.3:50051", False), ("ipv6:%5B2001:db8::1%5D:80", False),
    ("ipv6:%5B::ffff:10.1.1.1%5D:5", False), ("", False)])
def test_only_callers_on_this_host_are_offered_a_segment(peer, local):
    from kvbridge.server.servicer import is_local_peer

    assert is_local_peer(peer) is local


def test_a_new_registry_removes_the_folders_of_dead_servers_only(tmp_path):
    from kvbridge.server.shm_segments import remove_stale_folders

    live = SegmentRegistry(tmp_path)
    dead = SegmentRegistry(tmp_path)
    dead.publish("alice", _kv())
    os.close(dead._lock_fd)  # as when its process is killed: the kernel drops the lock, the files stay
    (tmp_path / "kvbridge-other.safetensors").write_bytes(b"x")  # not a folder: not ours (the vLLM hand-off's)
    (tmp_path / "kvbridge-starting").mkdir()  # no .lock yet
    assert remove_stale_folders(tmp_path) == [dead.folder]
    assert live.folder.exists() and (tmp_path / "kvbridge-other.safetensors").exists()
    assert (tmp_path / "kvbridge-starting").exists()
    live.close()
    assert not live.folder.exists()


# ------------------------------------------------------------------------------------------------ kept files


def _gathered(registry: SegmentRegistry, tenant: str, tag: tuple, kv: torch.Tensor):
    """A fetch of `tag`'s KV as the service makes it: reuse() first, else the store gathers into tensor()."""
    pending = registry.reserve(tenant)
    buffer = pending.reuse(tag, tuple(kv.shape), kv.dtype)
    if buffer is None:
        buffer = pending.tensor(tuple(kv.shape), kv.dtype)
        for layer in range(kv.shape[0]):
            buffer[layer].copy_(kv[layer])
            pending.written(layer, layer + 1)
    return pending.publish(buffer), buffer


def test_a_kept_file_serves_the_next_fetch_of_the_same_kv_by_a_new_name_without_a_copy(tmp_path):
    clock = FakeClock()
    kv = _kv()
    registry = SegmentRegistry(tmp_path, ttl_s=10.0, max_bytes=1 << 20, clock=clock, keep_s=5.0)
    first, _ = _gathered(registry, "alice", ("entry", 1), kv)
    assert registry.kept_files == 1 and registry.kept_hits == 0
    kept = [p for p in registry.folder.iterdir() if p.name.startswith("kept-")]
    assert len(kept) == 1 and file_mode(kept[0]) == 0o600 and not kept[0].name.endswith(".safetensors")
    assert registry.release("alice", first.name) and not first.path.exists() and kept[0].exists()

    clock.now = 4.0
    second, buffer = _gathered(registry, "alice", ("entry", 1), kv)
    assert registry.kept_hits == 1 and second.name != first.name and second.checksum == first.checksum
    assert os.stat(second.path).st_ino == os.stat(kept[0]).st_ino  # the same file: nothing written
    assert torch.equal(buffer, kv)
    assert torch.equal(shm_layout.map_kv(second.path, second.size, second.checksum, tuple(kv.shape), kv.dtype), kv)
    assert registry.held_bytes == 2 * first.size  # the kept file and the live name of it
    # another tenant, another entry serial, another dtype: not this file
    for tenant, tag, dtype in (("bob", ("entry", 1), None), ("alice", ("entry", 2), None),
                               ("alice", ("entry", 1), torch.bfloat16)):
        assert registry.reserve(tenant, dtype).reuse(tag, tuple(kv.shape), kv.dtype) is None
    registry.release("alice", second.name)
    third, _ = _gathered(registry, "alice", ("entry", 7), kv)
    registry.release("alice", third.name)
    assert registry.kept_files == 2 and registry.drop_kept() == 2 and registry.held_bytes == 0
    registry.release("alice", _gathered(registry, "alice", ("entry", 1), kv)[0].name)  # written again, kept again

    clock.now = 4.0 + 5.0  # keep_s after its last use: swept
    registry.sweep()
    assert registry.kept_files == 0 and not kept[0].exists() and registry.held_bytes == 0
    assert [p.name for p in registry.folder.iterdir()] == [".lock"]
    registry.close()


def test_a_fetch_that_falls_back_to_other_kv_after_reuse_publishes_that_kv_and_keeps_nothing(tmp_path):
    kv, other = _kv(), _kv().neg()
    registry = SegmentRegistry(tmp_path, ttl_s=10.0, max_bytes=1 << 20)
    registry.release("alice", _gathered(registry, "alice", ("entry", 1), kv)[0].name)
    pending = registry.reserve("alice")
    assert pending.reuse(("entry", 1), tuple(kv.shape), kv.dtype) is not None
    segment = pending.publish(other)  # e.g. the entry went meanwhile and was projected again: a copy of that KV
    assert torch.equal(load_file(str(segment.path))["kv"], other) and registry.kept_hits == 0
    assert registry.kept_files == 1  # still the first fetch's file, for the first KV
    again, buffer = _gathered(registry, "alice", ("entry", 1), kv)
    assert torch.equal(buffer, kv) and registry.kept_hits == 1
    registry.close()


def test_a_kept_file_removed_between_reuse_and_publish_is_copied_from_its_map(tmp_path):
    kv = _kv()
    registry = SegmentRegistry(tmp_path, ttl_s=10.0, max_bytes=1 << 20)
    registry.release("alice", _gathered(registry, "alice", ("entry", 1), kv)[0].name)
    pending = registry.reserve("alice")
    buffer = pending.reuse(("entry", 1), tuple(kv.shape), kv.dtype)
    with registry._lock:  # as when it gives way to another segment in the meantime
        registry._drop_kept(next(iter(registry._kept)))
    segment = pending.publish(buffer)
    assert torch.equal(load_file(str(segment.path))["kv"], kv) and registry.kept_hits == 0
    assert registry.kept_files == 1 and registry.held_bytes == 2 * segment.size  # the copy is kept for the tag now
    registry.close()


def test_kept_files_give_way_to_new_segments_least_recently_used_first_and_keep_s_0_keeps_none(tmp_path):
    kv = _kv()
    size = shm_layout.segment_size(tuple(kv.shape), kv.dtype)
    clock = FakeClock()
    registry = SegmentRegistry(tmp_path, ttl_s=10.0, max_bytes=4 * size, clock=clock)
    for serial in (1, 2, 3):
        clock.now += 1
        registry.release("alice", _gathered(registry, "alice", ("entry", serial), kv)[0].name)
    assert registry.kept_files == 3 and registry.held_bytes == 3 * size
    clock.now += 1
    registry.release("alice", _gathered(registry, "alice", ("entry", 1), kv)[0].name)  # 1 is now the most recent
    live = [registry.publish("bob", kv)]  # fits beside the three
    live.append(registry.publish("bob", kv))  # no room: the least recently used kept file (2) goes
    assert registry.kept_files == 2 and registry.held_bytes == 4 * size
    assert registry.reserve("alice").reuse(("entry", 2), tuple(kv.shape), kv.dtype) is None
    assert registry.reserve("alice").reuse(("entry", 1), tuple(kv.shape), kv.dtype) is not None
    for segment in live:
        registry.release("bob", segment.name)
    registry.close()

    off = SegmentRegistry(tmp_path, ttl_s=10.0, max_bytes=1 << 20, keep_s=0)
    off.release("alice", _gathered(off, "alice", ("entry", 1), kv)[0].name)
    assert off.kept_files == 0 and off.held_bytes == 0
    off.close()


def test_the_store_touches_an_entry_by_its_serial_and_refuses_another(tmp_path):
    from kvbridge.transfer.errors import NotFound
    from kvbridge.transfer.segment import KVSegment
    from kvbridge.transfer.spec import ModelIdentity
    from kvbridge.transfer.store import PagedStore, StoreConfig

    store = PagedStore(StoreConfig(capacity_bytes=8 << 20, block_size=4, device="cpu"))
    kv = _kv(shape=(3, 2, 2, 10, 8))
    segment = KVSegment(kv=kv, token_ids=torch.arange(10), positions=torch.arange(10),
                        model=ModelIdentity("m", "0" * 64), rotated=True)
    info = store.put(segment, "alice")
    held = kv.clone()
    touched = store.touch(info.key, "alice", held, info.serial)
    assert touched.kv is held and torch.equal(touched.token_ids, segment.token_ids)
    with pytest.raises(ValueError, match="shape"):
        store.touch(info.key, "alice", held[:, :, :, :5], info.serial)
    with pytest.raises(NotFound):
        store.touch(info.key, "bob", held, info.serial)
    store.delete(info.key, "alice")
    again = store.put(segment, "alice")  # the same key, a new entry
    assert again.key == info.key and again.serial != info.serial
    with pytest.raises(NotFound, match="stored again"):
        store.touch(info.key, "alice", held, info.serial)


def test_closing_a_registry_twice_closes_no_other_file(tmp_path):
    registry = SegmentRegistry(tmp_path, ttl_s=10.0, max_bytes=1 << 20)
    registry.close()
    fd = os.open(tmp_path / "mine", os.O_CREAT | os.O_RDWR)  # likely the number the lock file's descriptor had
    try:
        registry.close()  # a shutdown's second stop (a finally and an atexit hook, say)
        os.fstat(fd)  # still this file's
    finally:
        os.close(fd)
