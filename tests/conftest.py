"""Shared fixtures: tiny random models (seconds) and the real packaged small pair (slow, converted once)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

# Property tests draw the same examples on every run (CI's .ci/run sets no CI variable, so this is the default
# everywhere): a failure reproduces, with its blob printed; no example database carried between runs. Explore new
# examples with `pytest --hypothesis-profile default`.
settings.register_profile("kvbridge", derandomize=True, database=None, print_blob=True)
settings.load_profile("kvbridge")


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


@pytest.fixture(scope="session", autouse=True)
def session_shm_dir():
    """The servers tests start (tests/served.py's start, tests/serveproc.py's tiny_replica_args) put their
    shared-memory segment folders in this session's own folder in /dev/shm, removed at the end with whatever a
    killed server left there, instead of in /dev/shm itself. None where this machine has no /dev/shm."""
    import shutil
    import tempfile
    from pathlib import Path

    import served
    import serveproc

    if not Path("/dev/shm").is_dir():
        yield None
        return
    root = tempfile.mkdtemp(prefix="kvb-tests-", dir="/dev/shm")
    served.SHM_DIR = serveproc.SHM_DIR = root
    try:
        yield Path(root)
    finally:
        served.SHM_DIR = serveproc.SHM_DIR = None
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ in-process servers
# tests/served.py starts them. `server` and `identity_server`: one each for the session (tests/test_server*.py run
# every scenario against them); `adapters_dir`: a folder per module, for the servers a module starts itself.


def _adapters_folder(folder, tiny_adapter_file):
    import shutil

    shutil.copy(tiny_adapter_file, folder / "tiny-pair.safetensors")
    (folder / "notes.txt").write_text("not an adapter")
    return folder


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory, tiny_adapter_file):
    """An adapters folder for the servers a module starts: the fitted tiny-pair adapter and a file that is not an
    adapter. Each module has its own and may add to it (tests/test_fuzz.py replaces it with a stranger one)."""
    return _adapters_folder(tmp_path_factory.mktemp("adapters"), tiny_adapter_file)


@pytest.fixture(scope="session")
def server_adapters_dir(tmp_path_factory, tiny_adapter_file):
    """The adapters folder of `server` (as adapters_dir); a test may add an adapter to it and load it."""
    return _adapters_folder(tmp_path_factory.mktemp("server-adapters"), tiny_adapter_file)


@pytest.fixture(scope="session")
def server(tiny_source, tiny_target, server_adapters_dir):
    """tiny-qwen2 -> tiny-phi3 through the fitted adapter, tenants alice and bob, /metrics on a free port."""
    import served

    running = served.start(tiny_source, [tiny_target], server_adapters_dir, metrics_listen="127.0.0.1:0")
    yield running
    running.stop(1)


@pytest.fixture(scope="session")
def identity_server(tiny_target, tmp_path_factory):
    """tiny-phi3 -> itself through the identity adapter, open (no tokens): exact transfers."""
    import served
    from kvbridge.adapters.identity import identity_adapter

    running = served.start(tiny_target, [tiny_target], tmp_path_factory.mktemp("no-adapters"), tokens=None,
                           metrics_listen="127.0.0.1:0")
    running.service.adapters.add("identity", identity_adapter(tiny_target), make_default=True)
    yield running
    running.stop(1)


@pytest.fixture()
def alice(server):
    import served
    from kvbridge.server.client import KVBridgeClient

    with KVBridgeClient(server.address, token=served.ALICE, timeout_s=60) as client:
        yield client


@pytest.fixture()
def bob(server):
    import served
    from kvbridge.server.client import KVBridgeClient

    with KVBridgeClient(server.address, token=served.BOB, timeout_s=60) as client:
        yield client


@pytest.fixture
def shm_root():
    """A folder of the test's own on tmpfs (/dev/shm), where a spare's pages are allocated when it is made and a
    server's segment folders go (other processes' kvbridge-* folders in /dev/shm stay out of the checks)."""
    import shutil
    import tempfile
    from pathlib import Path

    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    root = Path(tempfile.mkdtemp(prefix="kvb-test-", dir="/dev/shm"))
    yield root
    shutil.rmtree(root, ignore_errors=True)
