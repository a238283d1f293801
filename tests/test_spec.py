"""ModelSpec read from configs and modules: layers, heads, windows, RoPE families; stable config hashes."""

from __future__ import annotations

import pytest
import zoo
from kvbridge.transfer.models import random_model
from kvbridge.transfer.spec import config_hash
from transformers import Qwen2Config


def test_tiny_qwen2_spec():
    spec = zoo.build("qwen2").spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.num_attention_heads) == (2, 2, 16, 4)
    assert spec.dtype == "float32" and spec.architecture == "Qwen2ForCausalLM"
    assert all(layer.attention_type == "full_attention" and layer.sliding_window is None for layer in spec.layers)
    assert spec.layers[0].rope.base == 1e6 and spec.layers[0].rope.rotary_dim == 16
    assert spec.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_gemma3_spec_has_two_layer_types_with_their_own_rope():
    spec = zoo.build("gemma3").spec
    assert [layer.attention_type for layer in spec.layers] == ["sliding_attention"] * 3 + ["full_attention"]
    assert [layer.sliding_window for layer in spec.layers] == [16, 16, 16, None]
    assert spec.layers[0].rope.module_key == "sliding_attention"
    assert spec.layers[3].rope.module_key == "full_attention"
    assert spec.layers[0].rope != spec.layers[3].rope


def test_partial_rotary_and_scaled_rope_are_read_from_the_module():
    phi = zoo.build("phi3-partial").spec
    assert phi.head_dim == 16 and phi.layers[0].rope.rotary_dim == 8
    yarn = zoo.build("llama-yarn").spec.layers[0].rope
    assert yarn.rope_type == "yarn" and yarn.attention_scaling > 1.0
    llama3 = zoo.build("llama3").spec.layers[0].rope
    assert llama3.rope_type == "llama3" and dict(llama3.parameters)["factor"] == "8.0"


def test_mistral_sliding_window_without_layer_types():
    spec = zoo.build("mistral-sliding").spec
    assert all(layer.attention_type == "sliding_attention" and layer.sliding_window == 24 for layer in spec.layers)


def test_no_rope_layers_are_marked():
    from transformers import SmolLM3Config

    cfg = SmolLM3Config(**zoo.COMMON, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0], max_position_embeddings=512,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    lm = random_model(cfg, "smollm3-tiny", device="cpu")
    assert [layer.rope is None for layer in lm.spec.layers] == [False, False, False, True]
    import torch

    x = torch.randn(2, 3, 16)
    assert torch.equal(lm.rope.rotate(x, 3, torch.arange(3)), x)
    with pytest.raises(ValueError, match="applies no RoPE"):
        lm.rope.cos_sin(3, torch.arange(3))


def test_config_hash_is_stable_and_sensitive():
    a = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    b = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    b._name_or_path = "/somewhere/else"
    assert config_hash(a) == config_hash(b) == config_hash(Qwen2Config.from_dict(a.to_dict()))
    c = Qwen2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    assert config_hash(a) != config_hash(c)
    assert len(config_hash(a)) == 64


def test_config_hash_tells_a_quantized_load_from_the_full_precision_one():
    """A bitsandbytes / GPTQ load of a checkpoint computes other KV than its bf16 load: two identities."""
    plain = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    quantized = Qwen2Config.from_dict(plain.to_dict())
    quantized.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                     "bnb_4bit_quant_type": "nf4"}
    other = Qwen2Config.from_dict(quantized.to_dict())
    other.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    assert len({config_hash(plain), config_hash(quantized), config_hash(other)}) == 3
    assert config_hash(quantized) == config_hash(Qwen2Config.from_dict(quantized.to_dict()))


def test_describe_mentions_every_layer():
    lines = zoo.build("gemma3").spec.describe()
    assert "4 layers" in lines[0]
    assert any("layers 0-2: sliding_attention window 16" in line for line in lines)
    assert any("layers 3: full_attention" in line and "base 1e+06" in line for line in lines)


@pytest.mark.slow
def test_real_small_pair_specs(gemma, smollm2):
    g, s = gemma.spec, smollm2.spec
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.num_attention_heads) == (18, 1, 256, 4)
    assert [i for i, layer in enumerate(g.layers) if layer.attention_type == "full_attention"] == [5, 11, 17]
    assert {layer.sliding_window for layer in g.layers} == {512, None}
    assert {layer.rope.base for layer in g.layers} == {1e4, 1e6}
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.num_attention_heads) == (30, 3, 64, 9)
    assert {layer.rope.base for layer in s.layers} == {1e5}
    # bf16 bytes per token as in DESIGN.md's table: 18,432 and 23,040 (float32 here: twice that)
    assert g.kv_bytes_per_token == 2 * 18_432 and s.kv_bytes_per_token == 2 * 23_040
