"""The device check for a lent GPU: one PASS / FAIL / SKIP line per check, with its figure (bench/gpu_check.sh runs it).

Checks, on the production-shaped preset (random-init Qwen2 -> Phi3 with Qwen2-7B's and Phi-3-mini-4k's attention
shapes and RoPE) in bf16 with flash-attn on CUDA:
  attention    the target loaded with flash_attention_2 (FAIL naming why when flash-attn is missing or refused)
  serve        a real `kvbridge serve` process with its start-up self-checks (the ridge adapter fitted here):
               ingest, project + fetch, greedy generation from the fetched cache, and fetches with `recompute:0.1`
               and `blend:0.1` (served corrections, computed with the target's induction prior): each mode's first
               fetch in the process, then of another document cold (computed and stored) and warm (a store hit)
               streamed and same-host (/dev/shm), the two equal
  prior        a decode step under the induction prior: no host read-back inside it, flash kept at unbiased layers;
               its time against a plain step's
  store        the store's pool on the device with a pinned CPU tier: put, demote, get back equal
  projection   projection time against the target's own prefill of the same tokens (ratio < 1 passes)
  corrections  in process: the target's induction prior built (cold), `recompute:0.1` and `blend:0.1` of a
               projected document (warm), against the target's own prefill of it
  premise      the production target at full size (random weights): its prefill of n tokens against moving their KV
               through the same-host data plane as a fetch does (ratio < 1 passes: serving KV beats prefilling)
  vllm         the vLLM connector's CUDA tests, only where a CUDA vLLM is importable (else SKIP)
`--device cpu --quick` runs the same checks on the CPU as a dry run (flash-attn and vLLM then SKIP).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # serveproc: `kvbridge serve` as a child process
results: list[str] = []


def line(status: str, name: str, figure: str) -> None:
    results.append(status)
    print(f"{status:4} {name:11} {figure}", flush=True)


def check(name: str):
    def wrap(fn):
        def run(*args):
            start = time.perf_counter()
            try:
                status, figure = fn(*args)
            except Exception as e:  # a check that raises fails, with what it raised
                status, figure = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                traceback.print_exc(file=sys.stderr)
            line(status, name, f"{figure} ({time.perf_counter() - start:.1f} s)")
        return run
    return wrap


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a timing's edges)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, reps: int = 3) -> float:
    """fn's median time over `reps` runs after one untimed run, in ms."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


@check("attention")
def check_attention(target, device):
    used = target.model.config._attn_implementation
    if device.type != "cuda":
        return "SKIP", f"no flash-attn on {device.type}; runs {used}"
    if importlib.util.find_spec("flash_attn") is None:
        return "FAIL", f"flash-attn is not installed; the target runs {used}"
    return ("PASS" if used == "flash_attention_2" else "FAIL"), f"target runs {used}"


@check("serve")
def check_serve(args, text, target, adapter):
    # the server's folder: its log and the fitted adapter (tens of MB on the CPU, more at full size), removed after
    work = Path(tempfile.mkdtemp(prefix="kvbridge-gpu-check-"))
    try:
        return _serve_and_fetch(work, args, text, target, adapter)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _serve_and_fetch(work: Path, args, text, target, adapter):
    from kvbridge.adapters.io import save_adapter
    from kvbridge.server.client import KVBridgeClient
    from kvbridge.transfer import kvcache
    from kvbridge.transfer.segment import KVSegment
    from serveproc import ServeProcess

    save_adapter(adapter.to("cpu"), work / "adapters" / "shaped.safetensors")  # fitted here: the server loads it
    serve = ServeProcess(work, ["--preset", "production-shaped", "--device", args.device, "--dtype", args.dtype,
                                "--store-device", args.device, "--store-capacity-mb", "512", "--adapters",
                                str(work / "adapters")], start_timeout_s=300)  # as deployed: self-checks on
    serve.start()
    try:
        started = r"(selfcheck \S+: \d+ passed|corrections warmed on \S+) in [\d.]+ s"  # from its log
        figures = [m.group(0) for m in re.finditer(started, serve.logfile.read_text())]

        modes = ("replace", "recompute:0.1", "blend:0.1")

        def fetch(key: str, mode: str, transport: str) -> tuple[KVSegment, float]:
            t0 = time.perf_counter()
            got = client.fetch_projected(key=key, target_model=target.name, mode=mode, transport=transport).segment
            return got, 1e3 * (time.perf_counter() - t0)

        with KVBridgeClient(serve.address, timeout_s=300) as client:
            # the process's first fetches of each mode pay for its kernels' first runs: another document first
            first = client.ingest(text="\n\n".join(reversed(text.split("\n\n")))).entries[0].key
            figures.append("first in the process " + ", ".join(f"{m} {fetch(first, m, 'stream')[1]:.0f}"
                                                               for m in modes) + " ms")
            key = client.ingest(text=text).entries[0].key
            for mode in modes:
                seg, cold = fetch(key, mode, "stream")  # computed (projected, corrected) and stored
                if not bool(torch.isfinite(seg.kv.float()).all()):
                    return "FAIL", f"{mode}: non-finite KV"
                warm, shm = fetch(key, mode, "stream")[1], fetch(key, mode, "shared_memory")  # store hits
                if not torch.equal(shm[0].kv.to(seg.kv.device), seg.kv):
                    return "FAIL", f"{mode}: the same-host fetch differs from the streamed one"
                figures.append(f"{mode} {seg.num_tokens} tok cold {cold:.0f} ms, warm {warm:.0f} ms stream / "
                               f"{shm[1]:.0f} ms same-host")
        seg = seg.to(device=next(target.model.parameters()).device, dtype=target.model.dtype)
        question = torch.tensor(target.tokenizer("\nIn short,", add_special_tokens=False)["input_ids"])
        out = kvcache.generate(target.model, target.spec, seg, question, max_new_tokens=8, min_new_tokens=8)
        figures.append(f"generated {out.numel()} tokens")
        return ("PASS" if out.numel() == 8 else "FAIL"), "; ".join(figures)
    finally:
        serve.stop() if hasattr(serve, "stop") else serve.kill()


@check("prior")
def check_prior(target):
    from kvbridge.transfer import kvcache
    from kvbridge.transfer.suffix.induction import InductionPrior
    from torch.utils._python_dispatch import TorchDispatchMode

    class Syncs(TorchDispatchMode):
        seen: list[str] = []

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            if func.overloadpacket.__name__ in ("_local_scalar_dense", "equal", "is_nonzero", "nonzero", "item"):
                self.seen.append(func.overloadpacket.__name__)
            return func(*a, **(kw or {}))

    ids = torch.arange(512) % (target.spec.vocab_size - 3) + 3
    seg = kvcache.extract(target.model, target.spec, ids)
    weights = torch.zeros(target.spec.num_layers, target.model.config.num_attention_heads)
    weights[-1, :4] = 1.0  # the last layer biased: the others keep the model's own attention
    prior = InductionPrior.from_weights(weights)
    device = next(target.model.parameters()).device
    mode = Syncs()

    def step(with_prior: bool, watch: TorchDispatchMode | None = None) -> float:
        cache = kvcache.to_cache(seg, target.model, target.spec)  # a fresh cache: every step decodes token 512
        reading = prior.reading(target, ids, torch.ones(512, dtype=torch.bool)) if with_prior else \
            contextlib.nullcontext()
        with reading, torch.no_grad(), watch or contextlib.nullcontext():
            sync(device)
            t0 = time.perf_counter()
            target.model(input_ids=ids[5:6][None].to(device), position_ids=torch.tensor([[512]], device=device),
                         cache=cache, use_cache=True)
            sync(device)
        return 1e3 * (time.perf_counter() - t0)

    first = step(True, mode)  # every op seen through Python: slow, and the first step
    biased = statistics.median(step(True) for _ in range(5))
    plain = statistics.median(step(False) for _ in range(5))
    # transformers' own mask code may read values; the prior adds none: a sync count is the honest figure
    return "PASS", (f"{len(mode.seen)} value reads in the whole step ({set(mode.seen)}); decode step under the "
                    f"prior {biased:.1f} ms, plain {plain:.1f} ms (median of 5; the first, watched: {first:.1f} ms)")


@check("store")
def check_store(device):
    from kvbridge.transfer.segment import KVSegment
    from kvbridge.transfer.spec import ModelIdentity
    from kvbridge.transfer.store import PagedStore, StoreConfig

    block = 2 * 2 * 8 * 16 * 128 * 2  # [L=2, 2, H=8, 16, D=128] bf16
    store = PagedStore(StoreConfig(capacity_bytes=8 * block, max_layouts=1, cpu_capacity_bytes=64 * block,
                                   device=str(device)))
    model = ModelIdentity("m", "a" * 64)
    segs = [KVSegment(kv=torch.randn(2, 2, 8, 96, 128).to(torch.bfloat16), token_ids=torch.arange(i, i + 96),
                      positions=torch.arange(96), model=model, rotated=True) for i in (0, 1000)]
    keys = [store.put(s, "t").key for s in segs]  # 6 + 6 blocks in an 8-block pool: the first demotes
    pool = next(iter(store.pools.values())).kv_device
    pinned = all(t.is_pinned() for _, (_, t) in store.cpu._blocks.items()) if device.type == "cuda" else True
    t0 = time.perf_counter()
    same = all(torch.equal(store.get(k, "t").kv.cpu(), s.kv) for k, s in zip(keys, segs))
    ms = 1e3 * (time.perf_counter() - t0)
    ok = same and pool.type == device.type and pinned and store.check() == []
    return ("PASS" if ok else "FAIL"), (f"pool on {pool}, tier pinned {pinned}, round trip equal {same}, "
                                        f"gets {ms:.1f} ms")


@check("projection")
def check_projection(source, target, tokens, adapter):
    from kvbridge.adapters.adapter import project
    from kvbridge.transfer import kvcache
    from kvbridge.transfer.align import Alignment

    vocab = min(source.spec.vocab_size, target.spec.vocab_size)
    ids = torch.randint(3, vocab, (tokens,))
    seg = kvcache.extract(source.model, source.spec, ids)
    alignment = Alignment(source_index=torch.arange(tokens), kind=torch.zeros(tokens, dtype=torch.int8),
                          target_special=torch.zeros(tokens, dtype=torch.bool), num_source_tokens=tokens)

    def timed(fn, reps=3):
        fn()
        sync(seg.kv.device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(seg.kv.device)
        return (time.perf_counter() - t0) / reps

    p = timed(lambda: project(adapter, seg, alignment, ids, source.rope, target.rope))
    with torch.no_grad():
        device = next(target.model.parameters()).device
        f = timed(lambda: target.model(input_ids=ids[None].to(device), logits_to_keep=1))
    return ("PASS" if p < f else "FAIL"), f"{tokens} tokens: project {1e3 * p:.1f} ms, target prefill {1e3 * f:.1f} " \
                                          f"ms, ratio {p / f:.2f}"


@check("corrections")
def check_corrections(source, target, tokens, adapter):
    """What a served correction costs the server once (then every fetch is a store hit): the target's prior built
    (cold), `recompute:0.1` and `blend:0.1` of a projected document (warm), each against the target's prefill."""
    from kvbridge.adapters.adapter import project
    from kvbridge.transfer import kvcache
    from kvbridge.transfer.align import Alignment
    from kvbridge.transfer.suffix.correction import Correction, correct
    from kvbridge.transfer.suffix.induction import InductionPrior

    vocab = min(source.spec.vocab_size, target.spec.vocab_size)
    ids = torch.randint(3, vocab, (tokens,))
    ids[0] = target.tokenizer.bos_token_id  # the start token at position 0, as the server places a document
    seg = kvcache.extract(source.model, source.spec, ids)
    alignment = Alignment(source_index=torch.arange(tokens), kind=torch.zeros(tokens, dtype=torch.int8),
                          target_special=torch.zeros(tokens, dtype=torch.bool), num_source_tokens=tokens)
    projected = project(adapter, seg, alignment, ids, source.rope, target.rope)
    device = next(target.model.parameters()).device

    def once(fn):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        return out, 1e3 * (time.perf_counter() - t0)

    prior, prior_ms = once(lambda: InductionPrior.for_model(target))
    figures = [f"{tokens} tokens: prior built {prior_ms:.0f} ms ({prior.origin})"]
    with torch.no_grad():
        prefill_ids = ids[None].to(device)
        prefill = median_ms(functools.partial(target.model, input_ids=prefill_ids, logits_to_keep=1), device, reps=1)
        ok = True
        for mode in ("recompute:0.1", "blend:0.1"):
            correction = Correction.parse(mode, "mode")
            run = functools.partial(correct, target, projected, correction, prior=prior)
            once(run)  # the first: kernels chosen, the prior placed on the device
            fixed, ms = once(run)
            ok &= bool(torch.isfinite(fixed.segment.kv.float()).all())
            figures.append(f"{mode} {ms:.0f} ms ({ms / prefill:.2f}x prefill)")
    figures.append(f"prefill {prefill:.1f} ms")
    return ("PASS" if ok else "FAIL"), "; ".join(figures)


@check("premise")
def check_premise(device, quick: bool):
    """The product's premise on this device at the production target's full size (random Phi-3-mini-4k: 32 layers,
    MLP 8192): its own prefill of n tokens against moving that many tokens of its KV through the same-host data
    plane as a fetch does (the store's copy on the device -> host -> a /dev/shm segment -> the client's checked map ->
    the device), through fresh buffers each time (as a cold server: first-touch page faults included), which the
    ratio (< 1 passes: serving KV beats prefilling here) takes; beside it the same with every buffer reused, the best
    a host data plane can do. --quick: 2 layers, 256 tokens."""
    from kvbridge.server import shm_layout
    from kvbridge.transfer.checksum import sum64
    from kvbridge.transfer.shaped_pair import production_shapes
    from transformers import Phi3Config, Phi3ForCausalLM

    c = dict(production_shapes()["target"]["config"])
    layers, counts = (2, (256,)) if quick else (c["num_hidden_layers"], (1024, 4096))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = Phi3Config(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                        intermediate_size=c["intermediate_size"], num_hidden_layers=layers,
                        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
                        max_position_embeddings=c["max_position_embeddings"], rms_norm_eps=c["rms_norm_eps"],
                        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
                        sliding_window=None, attn_implementation="sdpa")
    with torch.device(device):
        model = Phi3ForCausalLM(config).to(dtype).eval()
    head_dim = c["hidden_size"] // c["num_attention_heads"]

    def through_shm(kv: torch.Tensor, folder: Path) -> None:
        path = folder / "segment"
        size, sum_ = shm_layout.write(path, kv.cpu())  # the server: device -> host -> its segment
        shm_layout.map_kv(path, size, sum_, tuple(kv.shape), kv.dtype).to(device)  # the client: checked map
        path.unlink()

    def through_reused(kv: torch.Tensor, staging: torch.Tensor, segment: torch.Tensor, back: torch.Tensor) -> None:
        """The best a host data plane can do: every buffer reused and touched (a pinned staging copy off the device,
        the segment's pages, a device buffer to copy back into), the segment summed by the server and the client."""
        staging.copy_(kv)
        segment.copy_(staging)
        words = segment.view(-1).view(torch.uint8).numpy()
        sum64(words)  # the server's checksum
        sum64(words)  # the client's check
        back.copy_(segment)

    figures, ratios = [], []
    for n in counts:
        ids = torch.randint(3, c["vocab_size"], (1, n), device=device)
        with torch.no_grad():
            prefill = median_ms(functools.partial(model, input_ids=ids, logits_to_keep=1), device)
        kv = torch.randn(layers, 2, c["num_key_value_heads"], n, head_dim, device=device).to(dtype)
        with tempfile.TemporaryDirectory(prefix="kvbridge-premise-",
                                         dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as folder:
            moved = median_ms(functools.partial(through_shm, kv, Path(folder)), device)
        buffers = (torch.zeros(kv.shape, dtype=dtype, pin_memory=device.type == "cuda"),
                   torch.zeros(kv.shape, dtype=dtype), torch.zeros_like(kv))
        reused = median_ms(functools.partial(through_reused, kv, *buffers), device)
        ratios.append(moved / prefill)
        figures.append(f"{n} tokens ({kv.numel() * kv.element_size() / 1e6:.0f} MB of KV): prefill {prefill:.1f} ms, "
                       f"same-host KV {moved:.1f} ms (ratio {moved / prefill:.2f}; every buffer reused "
                       f"{reused:.1f} ms, ratio {reused / prefill:.2f})")
    return ("PASS" if max(ratios) < 1 else "FAIL"), f"{layers} layers; " + "; ".join(figures)


@check("vllm")
def check_vllm(device):
    if device.type != "cuda":
        return "SKIP", "vLLM's CUDA connector needs a GPU"
    found = subprocess.run([sys.executable, "-c", "import vllm, torch; assert torch.cuda.is_available()"],
                           capture_output=True, timeout=120)
    if found.returncode != 0:
        return "SKIP", "no CUDA vLLM importable"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                          "tests/test_vllm.py"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    return ("PASS" if run.returncode == 0 else "FAIL"), run.stdout.strip().splitlines()[-1][:200]


def header(device_name: str, dtype: str) -> str:
    """The first line: what every figure below was measured on (the device, and the CPU capability PyTorch reports,
    which decides the CPU's half-precision path and the host side of every copy)."""
    from kvbridge.transfer.devices import compute_path

    device = torch.device(device_name)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"gpu_check: torch {torch.__version__}, device {device_name} ({name}), dtype {dtype} | {compute_path()}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="short texts and fewer tokens (the CPU dry run)")
    args = p.parse_args()
    args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    device = torch.device(args.device)
    from kvbridge.adapters.identity import identity_adapter  # noqa: F401  (import check)
    from kvbridge.adapters.train import TrainConfig, train_adapter
    from kvbridge.transfer.data import data_path
    from kvbridge.transfer.presets import load_pair
    from kvbridge.transfer.tiny_pair import tiny_corpus_text

    print(header(args.device, args.dtype), flush=True)
    source, target = load_pair("production-shaped", device=args.device, dtype=args.dtype)
    text = "\n\n".join(tiny_corpus_text().split("\n\n")[:2 if args.quick else 6])
    check_attention(target, device)
    # max_tokens: at least three windows (the fit, the choice of its strength, the held-out report)
    adapter, _ = train_adapter(source, target, [data_path("tiny_corpus.txt")],
                               TrainConfig(max_tokens=768 if args.quick else 2048, window_tokens=256), progress=False)
    check_serve(args, text, target, adapter)
    check_prior(target)
    check_store(device)
    check_projection(source, target, 256 if args.quick else 4096, adapter.to(device))
    check_corrections(source, target, 256 if args.quick else 1024, adapter.to(device))
    check_premise(device, args.quick)
    check_vllm(device)
    failed = results.count("FAIL")
    print(f"gpu_check: {len(results) - failed - results.count('SKIP')} passed, {failed} failed, "
          f"{results.count('SKIP')} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
