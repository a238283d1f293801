"""Self-checks of the exact KV foundation on a loaded model: RoPE identities, re-positioned real keys, and
extract -> to_cache -> greedy continue against a plain greedy generate; for the packaged models, a reference (the
greedy tokens and top logits of a fixed prompt, recorded once) that the internal checks cannot replace: they pass
on a wrong model too. The CLI and the server run these.

    python -m kvbridge.transfer.selfcheck --record   # writes transfer/data/selfcheck_reference.json again
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.data import data_path
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.rope import rotate, unrotate
from kvbridge.transfer.tiny_pair import tiny_corpus_text

# Relative error allowed when two prefills that are equal in exact arithmetic are compared, by parameter dtype.
PREFILL_TOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
# In half precision, injected and plain runs round differently: a greedy continuation may flip at a near tie and
# then diverge. There the inject check compares logits (max |Δ| relative to the largest |logit|, within
# PREFILL_TOL) and asks the greedy tokens to agree on at least this share of the first AGREE_WINDOW; float32 stays
# exact (every token equal).
AGREE_WINDOW, AGREE_SHARE = 8, 0.75
REFERENCE_FILE = "selfcheck_reference.json"  # in kvbridge.transfer.data, written by --record
REFERENCE_PROMPT = "The Python programming language was created by"
REFERENCE_STEPS, REFERENCE_TOP = 8, 5  # greedy tokens recorded, logits recorded per token
# float32 logits agree to ~1e-4 across CPU instruction sets; the tolerance leaves room for other kernels (CUDA,
# oneDNN). A step's greedy token is compared only where the recorded top-2 margin exceeds REFERENCE_MARGIN and
# twice the tolerance: logits within the tolerance cannot swap those two.
REFERENCE_TOL, REFERENCE_MARGIN = 5e-2, 0.5


@dataclass(frozen=True, slots=True)
class CheckResult:
    model: str
    check: str  # "spec", "rope", "rope-real", "inject"
    detail: str  # what was measured, in words
    error: float  # the measured error (0 where the check is an equality of tokens and they matched)
    passed: bool

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.model:<28} {self.check:<9} {self.detail}"


def sample_text() -> str:
    """A few KB of Python documentation prose shipped with kvbridge (PSF licence)."""
    return tiny_corpus_text()


def _span(layers: list[int]) -> str:
    return f"{layers[0]}" if len(layers) == 1 else (
        f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else
        ",".join(map(str, layers)))


def check_rope(lm: LoadedModel, num_tokens: int = 256, seed: int = 0) -> list[CheckResult]:
    """unrotate∘rotate = identity and rotate(p) then shift(Δ) = rotate(p+Δ), per RoPE family, on random keys."""
    results = []
    gen = torch.Generator().manual_seed(seed)
    conv = lm.rope.check_convention(lm.model)
    for rope, layers in lm.rope.families:
        layer = layers[0]
        limit = min(rope.original_max_positions or 4096, 4096)
        positions = torch.randint(0, limit // 2, (num_tokens,), generator=gen)
        delta = torch.randint(1, limit // 2, (1,), generator=gen)
        x = torch.randn(lm.spec.num_kv_heads, num_tokens, lm.spec.head_dim, generator=gen)  # [H, T, D]
        cos, sin = lm.rope.cos_sin(layer, positions)
        rot = rotate(x, cos, sin)
        round_trip = float((unrotate(rot, cos, sin) - x).abs().max() / x.abs().max())
        shifted = lm.rope.shift(rot, layer, positions, positions + delta)
        direct = lm.rope.rotate(x, layer, positions + delta)
        shift_err = float((shifted - direct).abs().max() / x.abs().max())
        # Both sides use the module's float32 angles p·θ, so the identity holds to float32 rounding of the
        # products, not to the (much larger) rounding of the angles themselves.
        tol = 1e-5
        ok = round_trip < tol and shift_err < tol
        results.append(CheckResult(
            lm.name, "rope",
            f"layers {_span(layers)} ({rope.rope_type}, base {rope.base:g}, rotary_dim {rope.rotary_dim}): "
            f"unrotate(rotate(x)) rel err {round_trip:.1e}; shift(rotate(x,p),+{int(delta)}) vs rotate(x,p+Δ) "
            f"rel err {shift_err:.1e} (tol {tol:.0e}); vs the model's apply_rotary_pos_emb {conv:.1e}",
            max(round_trip, shift_err), ok))
    if not results:
        results.append(CheckResult(lm.name, "rope", "no layer applies RoPE", 0.0, True))
    return results


def check_real_shift(lm: LoadedModel, token_ids: torch.Tensor, delta: int = 37) -> CheckResult:
    """Keys of a real prefill at positions 0.. shifted by Δ equal the keys of the same prefill at Δ.. (RoPE
    attention only sees relative positions, so every layer's hidden states are the same in exact arithmetic)."""
    tol = PREFILL_TOL[lm.spec.dtype]
    at0 = kvcache.extract(lm.model, lm.spec, token_ids)
    at_delta = kvcache.extract(lm.model, lm.spec, token_ids, start_position=delta)
    shifted = lm.rope.shift_all(at0.keys.float(), at0.positions, at0.positions + delta)
    ref = at_delta.keys.float()
    err = float(((shifted - ref).abs().amax(dim=(1, 2, 3)) / ref.abs().amax(dim=(1, 2, 3))).max())
    return CheckResult(lm.name, "rope-real",
                       f"{token_ids.numel()} real tokens: shift(extract@0, +{delta}) vs extract@{delta}, "
                       f"worst layer rel err {err:.1e} (tol {tol:.0e})", err, err < tol)


def check_inject(lm: LoadedModel, token_ids: torch.Tensor, tail: int = 4, new_tokens: int = 16) -> CheckResult:
    """extract(context) -> to_cache -> greedy continue == plain greedy generate from the full token sequence."""
    ctx, rest = token_ids[:-tail], token_ids[-tail:]
    segment = kvcache.extract(lm.model, lm.spec, ctx)
    device = lm.device
    with torch.no_grad():
        cache = kvcache.to_cache(segment, lm.model, lm.spec)
        pos = torch.arange(ctx.numel(), token_ids.numel(), device=device)[None]
        injected = lm.model(input_ids=rest[None].to(device), position_ids=pos, cache=cache).logits[0].float()
        full = lm.model(input_ids=token_ids[None].to(device)).logits[0, -tail:].float()
    logit_err = float((injected - full).abs().max())
    rel_err = logit_err / max(float(full.abs().max()), 1e-12)
    ours = kvcache.generate(lm.model, lm.spec, segment, rest, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    ref = kvcache.generate_plain(lm.model, lm.spec, token_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    same = int((ours == ref).sum()) if ours.shape == ref.shape else 0
    windows = [layer.sliding_window for layer in lm.spec.layers if layer.sliding_window]
    note = f" (> sliding window {min(windows)})" if windows and ctx.numel() > min(windows) else ""
    head = f"{ctx.numel()}-token context{note} + {tail} new: {same}/{ref.numel()} greedy tokens equal to plain generate"
    if lm.spec.dtype == "float32":
        ok = ours.shape == ref.shape and bool(torch.equal(ours, ref))
        return CheckResult(lm.name, "inject", f"{head}; max |Δlogit| {logit_err:.1e}", 0.0 if ok else 1.0, ok)
    tol = PREFILL_TOL[lm.spec.dtype]
    n = min(AGREE_WINDOW, ours.numel(), ref.numel())
    agree = float((ours[:n] == ref[:n]).float().mean()) if n else 0.0
    ok = rel_err < tol and agree >= AGREE_SHARE
    return CheckResult(lm.name, "inject",
                       f"{head}; {lm.spec.dtype}: max |Δlogit| {rel_err:.1e} of the largest (tol {tol:.0e}), first "
                       f"{n} tokens agree {agree:.0%} (need {AGREE_SHARE:.0%})", rel_err, ok)


@torch.no_grad()
def _step_logits(lm: LoadedModel, prompt_ids: list[int], greedy: list[int]) -> torch.Tensor:
    """The logits that chose each greedy token, the recorded ones fed back (one forward): [len(greedy), V]."""
    ids = torch.tensor([prompt_ids + greedy[:-1]], dtype=torch.int64, device=lm.device)  # [1, P + N - 1]
    return lm.model(input_ids=ids).logits[0, len(prompt_ids) - 1:].float().cpu()


def record_reference(lm: LoadedModel) -> dict:
    """A model's reference: the prompt's ids, its first greedy tokens, and for each the top logits and the margin
    between the first two."""
    prompt_ids = lm.tokenizer(REFERENCE_PROMPT, add_special_tokens=True)["input_ids"]
    greedy = kvcache.generate_plain(lm.model, lm.spec, prompt_ids, max_new_tokens=REFERENCE_STEPS,
                                    min_new_tokens=REFERENCE_STEPS).tolist()
    top = _step_logits(lm, prompt_ids, greedy).topk(REFERENCE_TOP, dim=-1)  # [N, TOP]
    return {"prompt_ids": prompt_ids, "greedy": greedy, "top_ids": top.indices.tolist(),
            "top_logits": [[round(x, 4) for x in row] for row in top.values.tolist()],
            "margins": [round(x, 4) for x in (top.values[:, 0] - top.values[:, 1]).tolist()]}


def check_reference(lm: LoadedModel) -> CheckResult | None:
    """The recorded reference of a packaged model against this one (None for other models): the same prompt ids,
    the same greedy token where the margin allows, the top logits within the tolerance (in half precision, the
    prefill tolerance of the largest |logit|)."""
    ref = json.loads(data_path(REFERENCE_FILE).read_text())["models"].get(lm.name)
    if ref is None or not lm.has_weights or lm.tokenizer is None:
        return None
    prompt_ids = lm.tokenizer(REFERENCE_PROMPT, add_special_tokens=True)["input_ids"]
    fix = "not the packaged model, or converted wrongly (`kvbridge models prepare --force`)"
    if prompt_ids != ref["prompt_ids"]:
        return CheckResult(lm.name, "reference", f"{lm.name}: the tokenizer gives {prompt_ids} for the reference "
                           f"prompt, recorded {ref['prompt_ids']}: {fix}", 1.0, False)
    logits = _step_logits(lm, prompt_ids, ref["greedy"])  # [N, V]
    tol = REFERENCE_TOL if lm.spec.dtype == "float32" else PREFILL_TOL[lm.spec.dtype] * float(logits.abs().max())
    ours = logits.gather(1, torch.tensor(ref["top_ids"]))  # [N, TOP]
    err = float((ours - torch.tensor(ref["top_logits"])).abs().max())
    greedy = logits.argmax(-1).tolist()
    flipped = [i for i, (a, b, m) in enumerate(zip(greedy, ref["greedy"], ref["margins"]))
               if a != b and m > max(REFERENCE_MARGIN, 2 * tol)]
    ok = err <= tol and not flipped
    detail = (f"{len(ref['greedy'])} greedy tokens of {REFERENCE_PROMPT!r}: top-{REFERENCE_TOP} logits differ from "
              f"the recorded by {err:.1e} at most (tol {tol:.0e})")
    if flipped:
        detail += f"; tokens {flipped} differ ({[greedy[i] for i in flipped]}, recorded " \
                  f"{[ref['greedy'][i] for i in flipped]})"
    return CheckResult(lm.name, "reference", detail + ("" if ok else f": {lm.name} is {fix}"), err, ok)


def check_tokens(lm: LoadedModel, min_tokens: int, seed: int = 0) -> torch.Tensor:
    """Token ids for the checks: real text through the tokenizer, or seeded random ids for config-only models."""
    if lm.tokenizer is not None:
        text = sample_text()
        ids = torch.tensor(lm.tokenizer(text, add_special_tokens=True)["input_ids"], dtype=torch.int64)
        while ids.numel() < min_tokens:
            ids = torch.cat((ids, ids))
        return ids[:min_tokens]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, lm.spec.vocab_size, (min_tokens,), generator=gen)


def run_selfcheck(lm: LoadedModel, context_tokens: int | None = None, new_tokens: int = 16) -> list[CheckResult]:
    """All checks on one model. The context is longer than every sliding window so sliding layers are covered."""
    windows = [layer.sliding_window for layer in lm.spec.layers if layer.sliding_window]
    if context_tokens is None:
        context_tokens = max(96, max(windows, default=0) + 64)
    results = [CheckResult(lm.name, "spec", line.strip(), 0.0, True) for line in lm.spec.describe()]
    results += check_rope(lm)
    ids = check_tokens(lm, context_tokens + 4)
    results.append(check_real_shift(lm, ids[:64]))
    results.append(check_inject(lm, ids, new_tokens=new_tokens))
    reference = check_reference(lm)
    if reference is not None:
        results.append(reference)
    return results


def main(argv: list[str] | None = None) -> int:
    """--record: load the small preset's models on the CPU in float32 and write their references."""
    from kvbridge.transfer.presets import load_pair

    parser = argparse.ArgumentParser(description="the packaged models' selfcheck reference")
    parser.add_argument("--record", action="store_true", help=f"write {REFERENCE_FILE} (kvbridge.transfer.data)")
    args = parser.parse_args(argv)
    models_loaded = load_pair("small", dtype="float32", device="cpu")
    path = Path(__file__).parent / "data" / REFERENCE_FILE
    record = {"command": "python -m kvbridge.transfer.selfcheck --record", "prompt": REFERENCE_PROMPT,
              "models": {lm.name: record_reference(lm) for lm in models_loaded}}
    models = ",\n".join(f"  {json.dumps(name)}: {{\n" + ",\n".join(f"   {json.dumps(k)}: {json.dumps(v)}"
                                                                 for k, v in ref.items()) + "\n  }"
                        for name, ref in record.pop("models").items())
    text = json.dumps(record, indent=1)[:-2] + f',\n "models": {{\n{models}\n }}\n}}\n'  # one line a field
    assert json.loads(text)["models"].keys() == {lm.name for lm in models_loaded}
    if args.record:
        path.write_text(text)
        print(f"wrote {path}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
