"""Shared fixtures: tiny random models (seconds) and the real packaged small pair (slow, converted once)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def tiny_source():
    from kvbridge.transfer.tiny_pair import tiny_source

    return tiny_source(device="cpu")


@pytest.fixture(scope="session")
def tiny_target():
    from kvbridge.transfer.tiny_pair import tiny_target

    return tiny_target(device="cpu")


@pytest.fixture(scope="session")
def tiny_adapter_file(tmp_path_factory, tiny_source, tiny_target):
    """A ridge adapter tiny-qwen2 -> tiny-phi3 fitted once on the packaged tiny corpus; tests copy the file into
    the adapter folders they serve from."""
    from kvbridge.adapters.io import save_adapter
    from kvbridge.adapters.train import TrainConfig, train_adapter
    from kvbridge.transfer.data import data_path

    fitted, _ = train_adapter(tiny_source, tiny_target, [data_path("tiny_corpus.txt")],
                              TrainConfig(max_tokens=1024, window_tokens=128), progress=False)
    return save_adapter(fitted, tmp_path_factory.mktemp("fitted") / "tiny-pair.safetensors")


@pytest.fixture(scope="session")
def adapter(tiny_adapter_file):
    from kvbridge.adapters.io import load_adapter

    return load_adapter(tiny_adapter_file)


@pytest.fixture(scope="session")
def gemma():
    from kvbridge.transfer.models import load_packaged

    return load_packaged("gemma-3-270m-q4_k_m", device="cpu")


@pytest.fixture(scope="session")
def smollm2():
    from kvbridge.transfer.models import load_packaged

    return load_packaged("smollm2-135m-instruct-q4_1", device="cpu")


def _packaged_tokenizer(name: str):
    from kvbridge.transfer.models import prepare_gguf
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepare_gguf(name), local_files_only=True)


@pytest.fixture(scope="session")
def gemma_tokenizer():
    return _packaged_tokenizer("gemma-3-270m-q4_k_m")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    return _packaged_tokenizer("smollm2-135m-instruct-q4_1")


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on 127.0.0.1 at a free port, no persistence, stopped after the test."""
    from redisproc import RedisProcess, redis_available

    if not redis_available():
        pytest.fail(
            "no redis-server (or valkey-server) on PATH: these tests need a real Redis. "
            ".ci/run installs redis-server (apt-get install redis-server) before setup.sh; "
            "install it the same way on this machine."
        )
    server = RedisProcess(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url
