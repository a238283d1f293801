"""Loading: local folders, the local HF cache only, random init from configs, device/dtype choices, packaged GGUF."""

from __future__ import annotations

import json

import pytest
import torch
import zoo
from kvbridge.transfer import kvcache
from kvbridge.transfer.devices import resolve_device, resolve_dtype
from kvbridge.transfer.models import (
    GROUPED_SDPA,
    PACKAGED,
    attention_implementation,
    converted_path,
    kvbridge_home,
    load_model,
    model_from_config_file,
    prepare_gguf,
    random_model,
)
from kvbridge.transfer.presets import load_pair
from kvbridge.transfer.tiny_pair import tiny_source


def test_load_model_from_a_saved_folder_round_trips(tmp_path, tiny_target):
    tiny_target.model.save_pretrained(tmp_path)
    tiny_target.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, name="tiny-phi3", device="cpu")
    assert loaded.spec == tiny_target.spec
    ids = torch.tensor(tiny_target.tokenizer("def f(x): return x")["input_ids"])
    a = kvcache.extract(loaded.model, loaded.spec, ids)
    b = kvcache.extract(tiny_target.model, tiny_target.spec, ids)
    assert torch.equal(a.kv, b.kv)
    assert load_model(tmp_path, device="cpu", dtype="bfloat16").spec.dtype == "bfloat16"


def test_random_init_is_the_same_in_every_process():
    a, b = tiny_source(device="cpu"), tiny_source(device="cpu")
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    state = torch.random.get_rng_state()
    random_model(zoo.configs()["qwen2"], "x", seed=3, device="cpu")
    assert torch.equal(state, torch.random.get_rng_state()), "seeding must not disturb the caller's RNG"


def test_missing_models_fail_clearly_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(FileNotFoundError, match="neither a local folder nor in the local Hugging Face cache"):
        load_model("Qwen/Qwen2-7B-Instruct", device="cpu")
    (tmp_path / "nomodel").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        load_model(tmp_path / "nomodel", device="cpu")
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file"):
        load_model(tmp_path / "file.bin", device="cpu")
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        load_pair("production", source=str(tmp_path / "absent"), target=str(tmp_path / "absent"), device="cpu")


@pytest.mark.parametrize("name", ["qwen2", "gemma3", "phi3-sliding", "mistral-sliding"])
def test_grouped_sdpa_equals_transformers_sdpa_over_a_cache_and_reads_the_kv_heads_in_place(name, monkeypatch):
    """A prefill over a cache (a mask, several queries, KV heads shared by query heads): the same logits as
    transformers' SDPA, which repeats K and V per query head, with every layer through SDPA's grouped path."""
    from kvbridge.transfer import kvcache
    from kvbridge.transfer.models import random_model

    config = zoo.configs()[name]
    config.num_key_value_heads = 2  # of 4 query heads (the zoo's Phi3 has 4, Gemma3 1)
    lm = random_model(config, name, device="cpu")
    assert lm.model.config._attn_implementation == GROUPED_SDPA
    assert lm.model.config.num_attention_heads > lm.model.config.num_key_value_heads  # grouped
    ids = torch.randint(3, lm.spec.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    past = kvcache.extract(lm.model, lm.spec, ids[:29])

    def logits():
        cache = kvcache.to_cache(past, lm.model, lm.spec)
        return lm.model(input_ids=ids[None, 29:], position_ids=torch.arange(29, 40)[None], cache=cache,
                        use_cache=True).logits

    grouped = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        grouped.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    with torch.no_grad():
        ours = logits()
        assert grouped == [True] * lm.spec.num_layers
        lm.model.set_attn_implementation("sdpa")
        try:
            theirs = logits()
        finally:
            lm.model.set_attn_implementation(GROUPED_SDPA)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_device_dtype_and_attention_choices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert attention_implementation(torch.device("cpu")) == GROUPED_SDPA
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    assert resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == torch.float32  # bfloat16 on CUDA
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float8")
    assert tiny_source(device="cpu").model.config._attn_implementation == GROUPED_SDPA
    # flash-attn only for half precision on CUDA (it refuses float32 at the first forward)
    for dtype in (torch.float32, torch.bfloat16):
        assert attention_implementation(torch.device("cpu"), dtype) == GROUPED_SDPA
    assert attention_implementation(torch.device("cuda"), torch.float32) == "sdpa"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_attn_is_used_only_where_a_forward_through_it_works():
    import importlib.util

    from kvbridge.transfer.models import random_model

    lm = random_model(zoo.configs()["qwen2"], "q", device="cuda", dtype="auto")
    assert lm.spec.dtype == "bfloat16"
    expected = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
    assert lm.model.config._attn_implementation == expected  # flash-attn where installed: no silent fallback


def test_preset_errors():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        load_pair("huge")
    with pytest.raises(ValueError, match="production preset only"):
        load_pair("tiny", source="/x")


def test_model_from_config_file(tmp_path):
    cfg = zoo.configs()["llama3"].to_dict()
    (tmp_path / "llama3.json").write_text(json.dumps(cfg))
    lm = model_from_config_file(tmp_path / "llama3.json", device="cpu")
    assert lm.spec.architecture == "LlamaForCausalLM" and lm.spec.layers[0].rope.rope_type == "llama3"
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        model_from_config_file(tmp_path / "bad.json")
    (tmp_path / "untyped.json").write_text("{}")
    with pytest.raises(ValueError, match="no model_type"):
        model_from_config_file(tmp_path / "untyped.json")
    (tmp_path / "alien.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ValueError, match="unknown model_type 'no-such-model'"):
        model_from_config_file(tmp_path / "alien.json")
    with pytest.raises(FileNotFoundError):
        model_from_config_file(tmp_path / "absent.json")


def test_kvbridge_home_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_HOME", str(tmp_path))
    assert kvbridge_home() == tmp_path
    assert converted_path("x") == tmp_path / "models" / "x"
    with pytest.raises(ValueError, match="unknown packaged model"):
        prepare_gguf("nope")


@pytest.mark.slow
def test_prepared_models_are_safetensors_and_reused(smollm2):
    folder = prepare_gguf("smollm2-135m-instruct-q4_1")  # already converted: returns at once
    assert (folder / "model.safetensors").exists()
    assert not list(folder.glob("*.bin")) and not list(folder.glob("*.gguf"))
    marker = json.loads((folder / "kvbridge-converted.json").read_text())
    assert marker["distribution"] == PACKAGED["smollm2-135m-instruct-q4_1"].distribution
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
