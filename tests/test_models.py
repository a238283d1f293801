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


def test_device_dtype_and_attention_choices(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert attention_implementation(torch.device("cpu")) == GROUPED_SDPA
    # both answers of "auto", whichever machine runs this: torch.cuda.is_available() decides
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="device 'cuda' was asked for but CUDA is not available on this machine"):
        resolve_device("cuda")
    assert resolve_dtype("auto") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda") and resolve_device("cuda:1") == torch.device("cuda:1")
    assert resolve_dtype("auto") == torch.bfloat16
    monkeypatch.undo()
    assert resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == torch.float32  # bfloat16 on CUDA
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float8")
    assert tiny_source(device="cpu").model.config._attn_implementation == GROUPED_SDPA
    # flash-attn only for half precision on CUDA (it refuses float32 at the first forward)
    for dtype in (torch.float32, torch.bfloat16):
        assert attention_implementation(torch.device("cpu"), dtype) == GROUPED_SDPA
    assert attention_implementation(torch.device("cuda"), torch.float32) == "sdpa"


@pytest.mark.parametrize("installed", [True, False])
def test_on_cuda_in_half_precision_flash_attn_is_chosen_exactly_when_it_is_installed(monkeypatch, installed):
    """The choice itself, without a GPU: whether the flash_attn package is found decides it (a CUDA device and half
    precision given); float32 never takes it."""
    import importlib.machinery
    import importlib.util

    from kvbridge.transfer import models

    real, asked = importlib.util.find_spec, []

    def find_spec(name, *args):
        if name == "flash_attn":
            asked.append(name)
            return importlib.machinery.ModuleSpec("flash_attn", None) if installed else None
        return real(name, *args)

    monkeypatch.setattr(models.importlib.util, "find_spec", find_spec)
    for dtype in (torch.bfloat16, torch.float16):
        assert attention_implementation(torch.device("cuda"), dtype) == ("flash_attention_2" if installed else "sdpa")
        assert attention_implementation(torch.device("cuda:1"), dtype) == ("flash_attention_2" if installed
                                                                           else "sdpa")
    assert attention_implementation(torch.device("cuda"), torch.float32) == "sdpa"
    assert attention_implementation(torch.device("cpu"), torch.bfloat16) == GROUPED_SDPA
    assert asked  # the choice asked for the package (not answered from somewhere else)


class _FlashModel(torch.nn.Module):
    """A model configured for flash_attention_2 whose forward raises `error` (None: it runs)."""

    def __init__(self, error: Exception | None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"_attn_implementation": "flash_attention_2"})()
        self.error, self.forwards = error, []

    def forward(self, input_ids, logits_to_keep):  # input_ids: [1, T]
        self.forwards.append((tuple(input_ids.shape), self.config._attn_implementation))
        if self.error is not None:
            raise self.error
        return torch.zeros(1, logits_to_keep, 4)

    def set_attn_implementation(self, name: str) -> None:
        self.config._attn_implementation = name


def test_flash_attn_is_used_only_where_a_forward_through_it_works(caplog):
    """check_attention runs one short forward through flash-attn: kept when it runs, SDPA (and a warning naming the
    model and the error) when it raises; any other attention is left alone without a forward."""
    from kvbridge.transfer.models import check_attention

    works = _FlashModel(None)
    assert check_attention(works, "fine") == "flash_attention_2" and works.forwards == [((1, 4), "flash_attention_2")]
    broken = _FlashModel(RuntimeError("FlashAttention only supports Ampere GPUs or newer."))
    with caplog.at_level("WARNING", logger="kvbridge.transfer.models"):
        assert check_attention(broken, "old-gpu") == "sdpa"
    assert broken.config._attn_implementation == "sdpa" and len(broken.forwards) == 1
    assert "old-gpu: flash-attn failed its first forward (RuntimeError: FlashAttention only supports" in caplog.text
    other = _FlashModel(RuntimeError("never run"))
    other.set_attn_implementation("sdpa")
    assert check_attention(other, "plain") == "sdpa" and other.forwards == []


def _flash_attn_kernel_runs() -> bool:
    """Whether flash-attn is installed and its kernel runs on this GPU in bf16 (asked of flash-attn itself, not
    of kvbridge)."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return False
    q = torch.randn(1, 8, 4, 16, device="cuda", dtype=torch.bfloat16)  # [B, S, H, D]
    try:
        out = flash_attn_func(q, q, q, causal=True)
    except Exception:  # an incompatible wheel or GPU
        return False
    return bool(out.isfinite().all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_with_a_working_flash_attn_the_model_uses_it():
    if not _flash_attn_kernel_runs():
        pytest.skip("flash-attn is not installed or its kernel does not run on this GPU")
    lm = random_model(zoo.configs()["qwen2"], "q", device="cuda", dtype="auto")
    assert lm.spec.dtype == "bfloat16"
    assert lm.model.config._attn_implementation == "flash_attention_2"  # no silent fallback where it works
    ids = torch.randint(3, lm.spec.vocab_size, (1, 16), device="cuda")
    with torch.no_grad():
        assert bool(lm.model(input_ids=ids).logits.isfinite().all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_without_flash_attn_the_model_uses_sdpa(monkeypatch):
    import importlib.util

    from kvbridge.transfer import models

    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else
                        real(name, *a))
    lm = random_model(zoo.configs()["qwen2"], "q", device="cuda", dtype="auto")
    assert lm.spec.dtype == "bfloat16" and lm.model.config._attn_implementation == "sdpa"
    ids = torch.randint(3, lm.spec.vocab_size, (1, 16), device="cuda")
    with torch.no_grad():
        assert bool(lm.model(input_ids=ids).logits.isfinite().all())


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
