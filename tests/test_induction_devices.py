"""The induction prior on a GPU's terms, proven on a CPU: its tables and masks are made where its inputs live (the
meta device raises on mixing, as CUDA does), a decode step under the prior reads no value back to the host, and the
layers without a biased head keep the model's own attention (a flash-attention stand-in here) while the biased ones
read as they do over SDPA."""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
import zoo
from kvbridge.transfer import kvcache
from kvbridge.transfer.attention import custom_mask_attention
from kvbridge.transfer.suffix import induction
from kvbridge.transfer.suffix.induction import InductionPrior, bias_tables, open_mask
from kvbridge.transfer.suffix.reuse import recompute_selected
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

META = torch.device("meta")
SYNCS = {"_local_scalar_dense", "equal", "is_nonzero", "item", "nonzero", "masked_select"}  # read values back
FLASHLIKE = "kvbridge_test_flashlike"  # flash-attention's interface: no 4-D mask, sliding window as an argument
_flashlike_calls: list[int] = []


def _flashlike(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kw):
    _flashlike_calls.append(module.layer_idx)
    assert attention_mask is None or attention_mask.dim() == 2  # what flash_attention_mask hands a kernel
    mask = open_mask(attention_mask, query.shape[2], key.shape[2], query.device, sliding_window)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask.to(query.dtype),
                                                           scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


ALL_ATTENTION_FUNCTIONS.register(FLASHLIKE, _flashlike)
ALL_MASK_ATTENTION_FUNCTIONS.register(FLASHLIKE, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


def test_the_tables_and_masks_are_made_on_their_inputs_device():
    ids = torch.empty(12, dtype=torch.int64, device=META)
    projected = torch.empty(10, dtype=torch.bool, device=META)
    for query, at, past in ((torch.empty(1, dtype=torch.int64, device=META), None, 12),  # a decode step
                            (torch.empty(3, dtype=torch.int64, device=META),
                             torch.empty(3, dtype=torch.int64, device=META), 12),  # recompute in place
                            (torch.empty(2, dtype=torch.int64, device=META), None, 0)):  # a prefill, no cache
        seen, tables, ok = bias_tables(ids, projected, query, at, past)
        keys = past + query.numel()
        assert {seen.device, tables.device, ok.device} == {META}
        assert seen.shape == (keys,) and tables.shape == (4, query.numel(), keys) and ok.shape == ()
    for mask in (None, torch.empty(1, 15, dtype=torch.bool, device=META),
                 torch.empty(1, 1, 3, 15, dtype=torch.bool, device=META), torch.empty(1, 1, 3, 15, device=META)):
        for window in (None, 4):
            base = open_mask(mask, 3, 15, META, window)
            assert base.device == META and base.shape == (3, 15)


def _prior(lm) -> InductionPrior:
    weights = torch.zeros(lm.spec.num_layers, lm.model.config.num_attention_heads)
    weights[1, :2] = 1.0  # layer 1 biased, layer 0 left alone
    return InductionPrior.from_weights(weights, 4.0, 4.0)


def test_a_decode_step_under_the_prior_on_the_meta_device_runs_and_stays_there(monkeypatch):
    """The whole forward on meta; the block's one read-back (its check, at the end) cannot run there."""
    checked = []
    monkeypatch.setattr(induction._ReadState, "check", lambda state: checked.append(len(state.checks)), raising=False)
    lm = zoo.build("qwen2")
    ids = torch.arange(3, 43)
    seg = kvcache.extract(lm.model, lm.spec, ids)
    meta = copy.copy(lm)
    meta.model = copy.deepcopy(lm.model).to(META)
    cache = kvcache.to_cache(seg.to(device=META), meta.model, meta.spec)
    prior = _prior(lm)
    with prior.reading(meta, ids, torch.ones(ids.numel(), dtype=torch.bool)), torch.no_grad():
        logits = meta.model(input_ids=torch.tensor([[7]], device=META),
                            position_ids=torch.tensor([[ids.numel()]], device=META), cache=cache,
                            use_cache=True).logits
    assert logits.device == META and checked == [1]
    assert {t.device for t in prior.placed(META).values()} == {META}
    assert prior.placed(META) is prior.placed(META)  # the terms go to a device once


class _Recorder(TorchDispatchMode):
    """The ops the induction prior's own code dispatches (the Python stack passes through induction.py or
    induction_attention.py)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(frame.filename.endswith(("suffix/induction.py", "suffix/induction_attention.py"))
               for frame in traceback.extract_stack()):
            device = (kwargs or {}).get("device")
            self.ops.append((func.overloadpacket.__name__, str(device)))
        return out


def test_a_decode_step_under_the_prior_reads_no_value_back_to_the_host():
    lm = zoo.build("qwen2")
    ids = torch.arange(3, 43)
    seg = kvcache.extract(lm.model, lm.spec, ids)
    cache = kvcache.to_cache(seg, lm.model, lm.spec)
    recorder = _Recorder()
    with _prior(lm).reading(lm, ids, torch.ones(ids.numel(), dtype=torch.bool)), torch.no_grad():
        with recorder:
            lm.model(input_ids=ids[20:21][None], position_ids=torch.tensor([[ids.numel()]]), cache=cache,
                     use_cache=True)
    names = [name for name, _ in recorder.ops]
    assert "addmm" in names and "scaled_dot_product" in " ".join(names)  # the prior did run
    assert not [op for op in recorder.ops if op[0] in SYNCS or (op[0] == "_to_copy" and op[1] == "cpu")], recorder.ops


@pytest.mark.parametrize("name", ["qwen2", "phi3-sliding"])
def test_layers_without_a_biased_head_keep_the_models_own_attention(name):
    """A model running a flash-like attention (no 4-D masks) reads with the prior as one running SDPA does, and its
    unbiased layer still runs the flash-like one; selective recompute under it keeps the prior (over SDPA)."""
    lm = zoo.build(name)
    period = torch.randperm(lm.spec.vocab_size - 3, generator=torch.Generator().manual_seed(3))[:10] + 3
    ids = period.repeat(4)  # 40 tokens: past phi3-sliding's window of 20
    seg = kvcache.extract(lm.model, lm.spec, ids[:-2])
    projected = torch.ones(ids.numel() - 2, dtype=torch.bool)
    prior = _prior(lm)

    def run():
        cache = kvcache.to_cache(seg, lm.model, lm.spec)
        out = []
        with prior.reading(lm, ids[:-2], projected), torch.no_grad():
            for t in (ids.numel() - 2, ids.numel() - 1):  # a decode step, then another
                out.append(lm.model(input_ids=ids[t:t + 1][None], position_ids=torch.tensor([[t]]), cache=cache,
                                    use_cache=True).logits[0, -1])
        return torch.stack(out)

    sdpa = run()
    before = lm.model.config._attn_implementation
    _flashlike_calls.clear()
    try:
        lm.model.config._attn_implementation = FLASHLIKE
        flash = run()
        with prior.reading(lm, ids[:-2], projected):
            with custom_mask_attention(lm.model):
                assert lm.model.config._attn_implementation == "kvbridge_induction_prior"  # the prior, over SDPA
    finally:
        lm.model.config._attn_implementation = before
    assert _flashlike_calls == [0, 0]  # layer 0, both steps; layer 1 has biased heads
    assert torch.allclose(flash, sdpa, atol=1e-5)
    placed = kvcache.extract(lm.model, lm.spec, ids)
    with prior.reading(lm, ids, torch.ones(ids.numel(), dtype=torch.bool)):
        recompute_selected(lm, seg.slice(0, 1), placed.slice(1, ids.numel()), torch.tensor([5]))  # runs
