"""The learned fuser on the tiny pair: an untrained fuser is the target's own cache exactly; the start token and
unmapped tokens are never touched; the saved (folded) file fuses as the trained maps do; cross-entropy training is
deterministic and learns a planted residual."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from kvbridge.adapters.fuser import Fuser, FuserConfig, FuserMaps, load_fuser, save_fuser
from kvbridge.adapters.losses import ce_loss
from kvbridge.adapters.map_kv import context_kv
from kvbridge.adapters.pairs import start_token_id
from kvbridge.adapters.recovery_probe import RecoveryProbe
from kvbridge.adapters.residual import fit_ridge
from kvbridge.adapters.teacher import TeacherCache, TeacherConfig, Window
from kvbridge.adapters.trainer import TrainerConfig, train
from kvbridge.transfer import kvcache
from kvbridge.transfer.segment import KVSegment
from safetensors.torch import load_file, save_file

WORDS = ("the a model reads text once and keeps its cache in blocks while another model of a different family "
         "generates from the projected keys and values without reading the document again").split()
TEACHER = TeacherConfig(context_tokens=24, continuation_tokens=8, topk=8)
C = TEACHER.context_tokens


@pytest.fixture(scope="module")
def pair(tiny_source, tiny_target):
    return tiny_source, tiny_target


@pytest.fixture(scope="module")
def cache(pair, tmp_path_factory):
    """16 windows of random word salad, two per document."""
    rng = random.Random(1)
    salad = [" ".join(rng.choice(WORDS) for _ in range(60)) + "." for _ in range(16)]
    c = TeacherCache(tmp_path_factory.mktemp("teacher"))
    c.build(*pair, [Window(f"doc:{i // 2}/{i % 2}", f"doc:{i // 2}", t) for i, t in enumerate(salad)], TEACHER,
            start_token_id(pair[1].tokenizer), progress=False)
    return c


@pytest.fixture(scope="module")
def ridge(pair, cache):
    return fit_ridge(cache, list(range(12)), list(range(12, 16)), pair[1], progress=False)


def _fuser(ridge, rank=8, seed=0) -> FuserMaps:
    torch.manual_seed(seed)
    return FuserMaps.from_ridge(ridge[0], ridge[1], FuserConfig(rank=rank))


def _fused(maps, w, target):
    return context_kv(maps, None, w["xk"][:, :1 + C].float(), w["xv"][:, :1 + C].float(), w["start_mask"][:1 + C],
                      target, w["ids"][:1 + C], w["k"][:, :, :1 + C].float(), w["v"][:, :, :1 + C].float())


def test_untrained_fuser_is_the_targets_own_cache(pair, cache, ridge):
    _, target = pair
    w = cache.load(0)
    k, v = _fused(_fuser(ridge), w, target)
    assert torch.equal(k, w["k"][:, :, :1 + C].float()) and torch.equal(v, w["v"][:, :, :1 + C].float())
    probe = RecoveryProbe.from_cache(target, ridge[0].start_kv, cache, [12, 13, 14, 15], C)
    assert probe.recovery(_fuser(ridge))["recovery"] == pytest.approx(1.0, abs=0.02)  # own K/V cached in bf16


def test_start_token_and_unmapped_tokens_keep_their_own_kv(pair, cache, ridge):
    _, target = pair
    maps = _fuser(ridge)
    with torch.no_grad():
        for p in maps.parameters():
            p.normal_(std=0.5)
    w = cache.load(1)
    w["xk"][:, 5] = 0  # token 5 has no source token
    w["xv"][:, 5] = 0
    k, v = _fused(maps, w, target)
    own_k, own_v = w["k"][:, :, :1 + C].float(), w["v"][:, :, :1 + C].float()
    for pos in [0, 5]:
        assert bool(w["start_mask"][0]) and torch.equal(k[:, :, pos], own_k[:, :, pos]), pos
        assert torch.equal(v[:, :, pos], own_v[:, :, pos]), pos
    assert not torch.allclose(k[:, :, 1], own_k[:, :, 1])  # elsewhere the residual is added


def test_saved_fuser_fuses_like_the_trained_maps(pair, cache, ridge, tmp_path):
    _, target = pair
    maps = _fuser(ridge)
    with torch.no_grad():
        for p in maps.parameters():
            p.normal_(std=0.3)
    path = save_fuser(maps, ridge[0].meta, tmp_path / "f.safetensors", dtype=torch.float32)
    loaded, record = load_fuser(path)
    assert record["kind"] == "fuser" and record["format_version"] == 2 and record["rank"] == 8
    w = cache.load(2)
    for got, want in zip(_fused(loaded, w, target), _fused(maps, w, target)):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not a kvbridge fuser"):
        from kvbridge.adapters.io import save_adapter
        load_fuser(save_adapter(ridge[0], tmp_path / "plain.safetensors"))


def test_ce_training_is_deterministic(pair, cache, ridge, tmp_path):
    _, target = pair
    cfg = TrainerConfig(objective="ce", max_iters=3, warmup_iters=1, batch_windows=2, eval_interval=3, lr=1e-2,
                        min_lr=1e-3)
    states = []
    for name in ("a", "b"):
        maps = _fuser(ridge)
        train(maps, ridge[0].start_kv, target, cache, list(range(12)), None, cfg, C, tmp_path / name, progress=False)
        states.append(maps.state_dict())
    assert not torch.equal(states[0]["b_k"], torch.zeros_like(states[0]["b_k"]))
    for n in states[0]:
        assert torch.equal(states[0][n], states[1][n]), n
    with pytest.raises(ValueError, match="end to end"):
        train(_fuser(ridge), ridge[0].start_kv, target, cache, list(range(12)), None,
              TrainerConfig(objective="attention", max_iters=2, warmup_iters=0), C, tmp_path / "c", progress=False)


def _segment(k, v, ids, target):
    return KVSegment(kv=torch.stack((k, v), dim=1), token_ids=ids, positions=torch.arange(ids.numel()),
                     model=target.spec.identity, rotated=True)


@torch.no_grad()
def _greedy(target, seg, first: torch.Tensor, n: int) -> torch.Tensor:
    """n tokens: `first`, then the target's greedy continuation over the cache of `seg`."""
    out = first.reshape(1)
    for _ in range(n - 1):
        cache = kvcache.to_cache(seg, target.model, target.spec)
        pos = torch.arange(seg.num_tokens, seg.num_tokens + out.numel())[None]
        nxt = target.model(input_ids=out[None], position_ids=pos, cache=cache).logits[0, -1].argmax()
        out = torch.cat((out, nxt.reshape(1)))
    return out


def test_ce_training_learns_a_planted_residual(pair, cache, ridge, tmp_path):
    """Continuations rewritten as the target's greedy text over its own cache plus a planted fuser residual (what
    the "source" knows): the fuser, trained on their cross-entropy from the own cache alone, must win back most of
    the gap between the own cache and the planted one."""
    _, target = pair
    planted = _fuser(ridge, seed=7)
    with torch.no_grad():
        planted.b_k.normal_(std=2.0)
        planted.b_v.normal_(std=2.0)
    root = tmp_path / "planted"
    root.mkdir()
    n = TEACHER.continuation_tokens
    for i, e in enumerate(cache.entries):
        w = cache.load(i)
        with torch.no_grad():
            k, v = _fused(planted, w, target)
        w["ids"] = torch.cat((w["ids"][:1 + C], _greedy(target, _segment(k, v, w["ids"][:1 + C], target),
                                                        w["ids"][1 + C], n)))
        save_file({name: t.contiguous() for name, t in w.items()}, str(root / e["file"]))
    (root / "index.json").write_text(cache.index_path.read_text())
    rewritten = TeacherCache(root)

    def loss(maps):
        with torch.no_grad():
            return float(ce_loss(maps, None, [rewritten.load(i) for i in range(16)], target, C))

    best, before = loss(planted), loss(_fuser(ridge))
    assert before > best + 0.2, (best, before)
    maps = _fuser(ridge)
    cfg = TrainerConfig(objective="ce", max_iters=150, warmup_iters=5, batch_windows=4, eval_interval=1000,
                        lr=3e-2, min_lr=1e-3)
    train(maps, ridge[0].start_kv, target, rewritten, list(range(16)), None, cfg, C, tmp_path / "run",
          progress=False)
    after = loss(maps)
    assert after < before - 0.5 * (before - best), (best, before, after)


def test_fuser_load_refuses_a_file_without_the_models_identity_or_for_other_models(pair, ridge, tmp_path):
    """A fuser file must name the models it was fitted for (their config hashes): one that does not, or that names
    others, is refused by file and by both identities, not run on whatever pair loads it."""
    source, target = pair
    maps, meta = _fuser(ridge), ridge[0].meta
    assert meta.source["config_hash"] == source.spec.identity.config_hash
    good = save_fuser(maps, meta, tmp_path / "good.safetensors", dtype=torch.float32)
    assert isinstance(Fuser.load(good, source, target), Fuser)
    unnamed = dataclasses.replace(meta, source={k: v for k, v in meta.source.items() if k != "config_hash"})
    path = save_fuser(maps, unnamed, tmp_path / "unnamed.safetensors", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"unnamed\.safetensors.*'source\.config_hash'"):
        Fuser.load(path, source, target)
    with pytest.raises(ValueError, match=r"unnamed\.safetensors.*'source\.config_hash'"):
        load_fuser(path)
    other = dataclasses.replace(meta, target={**meta.target, "config_hash": "f" * 64, "name": "another-target"})
    path = save_fuser(maps, other, tmp_path / "other.safetensors", dtype=torch.float32)
    both = (rf"other\.safetensors was fitted for target 'another-target' \(config f{{16}}\), not "
            rf"'{target.spec.name}' \(config {target.spec.identity.config_hash[:16]}\)")
    with pytest.raises(ValueError, match=both):
        Fuser.load(path, source, target)
    record = {k: v for k, v in dataclasses.asdict(meta).items() if k != "target"} | {
        "format_version": 2, "kind": "fuser", "rank": maps.config.rank}
    tensors = load_file(str(good))
    save_file(tensors, str(tmp_path / "bare.safetensors"), metadata={"kvbridge_adapter": json.dumps(record)})
    with pytest.raises(ValueError, match=r"bare\.safetensors: fuser metadata field 'target' missing"):
        Fuser.load(tmp_path / "bare.safetensors", source, target)


def test_fuser_load_refuses_tensors_other_than_its_metadata_says(pair, ridge, tmp_path):
    """The parameters are filled by copy_, which broadcasts: a file whose residual holds rank 1 under metadata saying
    rank 8 loaded and fused it eight times over; a file of one layer failed only inside a fuse. Each tensor's shape
    and kind, and the layer map's range, are checked against the metadata, naming the file and the tensor."""
    maps, meta = _fuser(ridge), ridge[0].meta
    good = save_fuser(maps, meta, tmp_path / "good.safetensors", dtype=torch.float32)
    tensors, header = load_file(str(good)), json.loads(_header(good))
    lt = pair[1].spec.num_layers
    for change, named in (({"a_k": tensors["a_k"][:, :, :1].contiguous(), "b_k": tensors["b_k"][:, :1].contiguous()},
                           r"tensor a_k has shape .* at rank 8"),
                          ({name: t[:1].contiguous() for name, t in tensors.items()}, f"expected \\({lt},"),
                          ({"gate_v": tensors["gate_v"].to(torch.int64)}, "gate_v has dtype torch.int64"),
                          ({"layer_map": tensors["layer_map"] + 100}, "layer_map refers to source layers outside")):
        path = tmp_path / "bad.safetensors"
        save_file(tensors | change, str(path), metadata={"kvbridge_adapter": json.dumps(header)})
        with pytest.raises(ValueError, match=rf"bad\.safetensors: fuser .*{named}"):
            load_fuser(path)
    save_file(tensors, str(tmp_path / "rank.safetensors"),
              metadata={"kvbridge_adapter": json.dumps(header | {"rank": 0})})
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        load_fuser(tmp_path / "rank.safetensors")


def _header(path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        return f.metadata()["kvbridge_adapter"]
