"""Adapter files that are not what they claim are refused by file and field (adapters/io.py, weights.py), and an
average of adapters whose data-fitted bases differ is refused by the tensor's name (adapters/average.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from kvbridge.adapters.average import average
from kvbridge.adapters.io import load_adapter, save_adapter
from safetensors import safe_open
from safetensors.torch import save_file
from test_adapters import random_adapter


def _rewrite(path, edit_meta=None, edit_tensors=None):
    """The file at path with its kvbridge metadata and tensors changed in place."""
    with safe_open(str(path), "pt") as f:
        meta, tensors = json.loads(f.metadata()["kvbridge_adapter"]), {k: f.get_tensor(k) for k in f.keys()}
    if edit_meta:
        edit_meta(meta)
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(path), metadata={"kvbridge_adapter": json.dumps(meta)})
    return path


@pytest.mark.parametrize("what, edit_meta, edit_tensors, says", [
    ("no source", lambda m: m.pop("source"), None, "field 'source'"),
    ("source not a record", lambda m: m.update(source="tiny-qwen2"), None, "field 'source'"),
    ("no num_kv_heads", lambda m: m["target"].pop("num_kv_heads"), None, "'target.num_kv_heads'"),
    ("a text head_dim", lambda m: m["source"].update(head_dim="16"), None, "'source.head_dim'"),
    ("no layer_map name", lambda m: m.pop("layer_map"), None, "field 'layer_map'"),
    ("a float layer_map", None, lambda t: t.update(layer_map=t["layer_map"].float()), "layer_map"),
    ("an int32 wk", None, lambda t: t.update(wk=t["wk"].to(torch.int32)), "wk"),
    ("an integer start_kv", None, lambda t: t.update(start_kv=t["start_kv"].long()), "start_kv"),
])
def test_malformed_files_are_refused_by_file_and_field(tmp_path, tiny_source, tiny_target, what, edit_meta,
                                                       edit_tensors, says):
    path = save_adapter(random_adapter(tiny_source, tiny_target), tmp_path / "a.safetensors")
    _rewrite(path, edit_meta, edit_tensors)
    with pytest.raises(ValueError) as raised:
        load_adapter(path)
    assert str(path) in str(raised.value) and says in str(raised.value), (what, str(raised.value))


def test_the_checks_hold_for_adapters_made_in_memory(tiny_source, tiny_target):
    a = random_adapter(tiny_source, tiny_target)
    with pytest.raises(ValueError, match="layer_map must hold integers"):
        dataclasses.replace(a, layer_map=a.layer_map.float())
    with pytest.raises(ValueError, match="wk must be floating point"):
        dataclasses.replace(a, wk=a.wk.to(torch.int32))


def test_adapters_with_other_token_tables_or_source_bases_do_not_average(tiny_source, tiny_target):
    a = random_adapter(tiny_source, tiny_target, k=2, layer_map="mix")
    gen = torch.Generator().manual_seed(3)
    lt, d_s, d_t = a.wk.shape
    vocab, r = tiny_target.spec.vocab_size, 4
    tok = dataclasses.replace(a, tok_table=torch.randn(vocab, r, generator=gen), wk_tok=torch.zeros(lt, r, d_t),
                              wv_tok=torch.zeros(lt, r, d_t))
    refit = dataclasses.replace(tok, tok_table=tok.tok_table + 1, wk_tok=tok.wk_tok + 0.1)
    with pytest.raises(ValueError, match="tok_table differs"):
        average([tok, refit], names=["a.safetensors", "b.safetensors"])
    torch.testing.assert_close(average([tok, dataclasses.replace(tok, wk_tok=tok.wk_tok + 0.2)]).wk_tok,
                               tok.wk_tok + 0.1)  # the same table: the maps average
    s = tiny_source.spec
    width = 2 * s.num_layers * d_s
    wide = dataclasses.replace(a, src_basis=torch.randn(width, 3, generator=gen),
                               layer_map=torch.zeros(lt, 1, dtype=torch.int64), mix_k=torch.ones(lt, 1),
                               mix_v=torch.ones(lt, 1), wk=torch.randn(lt, 3, d_t, generator=gen),
                               wv=torch.randn(lt, 3, d_t, generator=gen))
    with pytest.raises(ValueError, match="src_basis differs"):
        average([wide, dataclasses.replace(wide, src_basis=wide.src_basis * 2)])
