"""RoPE's batched ops over a model whose RoPE layers are not one run (a mutation of the runs got past the suite)."""

import torch


def test_consecutive_runs_keeps_a_gap_of_one_layer_apart():
    """kills rope_runs_off_by_one (a run extended over a layer it does not hold)."""
    from kvbridge.transfer.rope import consecutive_runs
    assert consecutive_runs([0, 1, 2, 5, 6]) == [slice(0, 3), slice(5, 7)]
    assert consecutive_runs([0, 2, 3]) == [slice(0, 1), slice(2, 4)]


def test_batched_rope_ops_leave_a_nope_layer_between_rope_layers_as_it_is():
    """the same mutant seen from the model: layer 1 (NoPE) sits between RoPE layers 0 and 2..3."""
    import zoo
    from kvbridge.transfer.models import random_model
    from transformers import SmolLM3Config
    cfg = SmolLM3Config(**zoo.COMMON, num_hidden_layers=4, no_rope_layers=[1, 0, 1, 1], max_position_embeddings=512,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    lm = random_model(cfg, "smollm3-tiny", device="cpu")
    keys = torch.randn(4, lm.spec.num_kv_heads, 5, lm.spec.head_dim)
    pos = torch.arange(5)
    for out in (lm.rope.rotate_all(keys, pos), lm.rope.unrotate_all(keys, pos), lm.rope.shift_all(keys, pos, pos + 3)):
        assert torch.equal(out[1], keys[1])
        assert not torch.equal(out[2], keys[2])
