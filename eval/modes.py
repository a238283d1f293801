"""The modes of the summarisation harness (summaries.py), by name, and the grammar of a list of them (`parse_modes`).

What KV the document gets in each mode (the instruction after it is always prefilled by the target):
  full          the target prefills start + document itself (upper bound)
  rounded:T     full's KV rounded to T and back (bf16, fp16, fp8: float8 e4m3, vLLM's fp8 KV cache at scale 1): what
                a perturbation that deployments accept as lossless does to the answer (the fidelity a projection is
                measured against)
  none          start only: no document (lower bound)
  replace       start + document projected from the source through the service; the target prefills none of it
  recompute:r   replace, then the target prefills the last r of the document's tokens again over the projected
                head (exact causal attention to the projected KV before them)
  tail:r        start + only the tokens recompute:r recomputes (the document's last r), prefilled by the target:
                the matched baseline recompute has to beat
  fuse          the target prefills start + document and the projected KV is blended in with per-layer gates
                ((1 - g) · own + g · projected, fitted by eval.gates)
  fuser         the target prefills start + document and a learned fuser (adapters.fuser, --fuser FILE) adds what the
                source read: the source model runs here, beside the target
  blend:r       replace, then CacheBlend over the projected KV (transfer.suffix.blend): r of the document's tokens are
                recomputed through every layer in one forward over the projected KV: the last 16 (they also run once
                first, through every layer, and the attention their queries give the others in the deeper half of
                the layers scores them), the first 4 (sinks), and the highest scored.
                blend-sdev:r (CacheBlend's own rule: the target's first layer over the document, that layer's KV
                exact, the first 4, the last 4 and the most deviating at that layer), blend-dev:r (the most
                deviating alone), blend-last:r (the last r, as recompute:r) and blend-random:r (a control);
                blend-prompt:r scores with the instruction's own queries (one pass of it over the projected KV)
                instead of the document's last 16
  layers:k      replace, then the target's own KV of the document in its first k layers (a forward through those
                layers only, k/L of a prefill's layer work): the layers above keep the projected KV
  exact:a-b     analysis, not a correction anyone runs (it needs full's prefill): full's own KV in layers a..b-1, the
                projection in the others, read without a prior: where in depth the projection's error costs the answer
                (compare with replace/noprior)
Modes that read projected KV (replace, recompute, blend) read it with the evaluator's induction prior
(transfer.suffix.induction: the target's induction heads get back, from the document's tokens, the match their
projected keys blur) when it has one: the prior shipped for the target, else the probe's (`InductionPrior.for_model`),
both while recompute and blend recompute their tokens over the projected KV and while the request reads the cache.
A `/noprior` suffix (`blend:0.1/noprior`) reads it without, `/probe` with the probe's prior even where a fitted one
ships, in the same run (paired comparisons).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.transfer.suffix.correction import Correction

DEFAULT_MODES = "full,none,replace,recompute:0.1,tail:0.1,blend:0.1,recompute:0.25,tail:0.25,blend:0.25,fuse"
BLEND_RULES = {"blend": "attention", "blend-prompt": "prompt", "blend-sdev": "sinks+deviation",
               "blend-dev": "deviation", "blend-last": "last", "blend-random": "random"}
NEEDS_PROJECTION = ("replace", "recompute", "fuse", "served", "layers", "exact", *BLEND_RULES)
FRACTION_KINDS = ("recompute", "tail", *BLEND_RULES)
READS_PROJECTED = ("replace", "recompute", "served", "layers", *BLEND_RULES)  # modes whose context keeps projected KV
ROUNDINGS = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}  # rounded:T -> the torch dtype
NO_PRIOR = "/noprior"
PROBE_PRIOR = "/probe"
PRIOR_SUFFIXES = {NO_PRIOR: "none", PROBE_PRIOR: "probe"}  # a mode's suffix -> the prior it reads with


def base_mode(name: str) -> str:
    """'blend:0.1/noprior' -> 'blend:0.1'"""
    return name.split("/", 1)[0]


@dataclass(frozen=True)
class Mode:
    name: str  # as given: "recompute:0.1"
    kind: str  # full | rounded | none | replace | recompute | tail | fuse | fuser | blend[-...] | served
    fraction: float = 0.0  # recompute and tail: the share of the document's tokens
    # which induction prior reads projected KV: "model" (the evaluator's: for_model), "none" (/noprior) or "probe"
    # (/probe: InductionPrior.probed)
    prior: str = "model"
    correction: str = ""  # served: the correction the server computes once and serves ("blend:0.1"); rounded: dtype
    layers: int = 0  # layers: the target's own first layers; exact: the first layer of full's KV
    upto: int = 0  # exact: the layer after the last of full's KV


def parse_modes(spec: str) -> list[Mode]:
    """'full,none,replace,recompute:0.1,tail:0.1,fuse' -> modes, in order, each once."""
    modes: list[Mode] = []
    for raw in (part.strip() for part in spec.split(",")):
        if not raw:
            continue
        raw, slash, suffix = raw.partition("/")
        suffix = slash + suffix
        if slash and suffix not in PRIOR_SUFFIXES:
            raise ValueError(f"mode {raw + suffix!r}: the suffixes are {' and '.join(PRIOR_SUFFIXES)}")
        kind, _, arg = raw.partition(":")
        if slash and kind not in READS_PROJECTED:
            raise ValueError(f"mode {raw + suffix!r}: {suffix} is for the modes that read projected KV "
                             f"({', '.join(READS_PROJECTED[:3])}, blend...)")
        if kind == "served":  # served:blend:0.1: the server's stored correction, fetched (no target pass here)
            try:
                correction = str(Correction.parse(arg, "mode"))
            except ValueError as exc:
                raise ValueError(f"mode {raw!r}: served takes a correction, e.g. served:blend:0.1 ({exc})") from None
            mode = Mode(f"served:{correction}", kind, correction=correction)
        elif kind == "rounded":
            if arg not in ROUNDINGS:
                raise ValueError(f"mode {raw!r}: rounded takes one of {', '.join(ROUNDINGS)}, e.g. rounded:fp8")
            mode = Mode(raw, kind, correction=ROUNDINGS[arg])
        elif kind == "exact":
            first, dash, last = arg.partition("-")
            if not (dash and first.isdigit() and last.isdigit() and int(first) < int(last)):
                raise ValueError(f"mode {raw!r}: exact takes a range of layers a-b with a < b, e.g. exact:20-30")
            mode = Mode(f"exact:{int(first)}-{int(last)}", kind, layers=int(first), upto=int(last))
        elif kind == "layers":
            if not arg.isdigit() or int(arg) < 1:
                raise ValueError(f"mode {raw!r}: layers takes a number of layers >= 1, e.g. layers:3")
            mode = Mode(f"layers:{int(arg)}", kind, layers=int(arg))
        elif kind in ("full", "none", "replace", "fuse", "fuser"):
            if arg:
                raise ValueError(f"mode {raw!r}: {kind} takes no fraction")
            mode = Mode(raw, kind)
        elif kind in FRACTION_KINDS:
            try:
                fraction = float(arg)
            except ValueError:
                raise ValueError(f"mode {raw!r}: {kind} needs a fraction, e.g. {kind}:0.1") from None
            if not 0 < fraction <= 1:
                raise ValueError(f"mode {raw!r}: the fraction must be in (0, 1]")
            mode = Mode(f"{kind}:{fraction:g}", kind, fraction)
        else:
            raise ValueError(f"unknown mode {raw!r}; modes are full, rounded:T, none, replace, recompute:R, tail:R, "
                             "fuse, fuser, "
                             "blend:R, blend-sdev:R, blend-dev:R, blend-last:R, blend-random:R, layers:K, exact:A-B, "
                             "served:MODE; "
                             f"replace, recompute, blend, layers and served also take a {NO_PRIOR} or {PROBE_PRIOR} "
                             "suffix")
        if slash:
            mode = Mode(mode.name + suffix, mode.kind, mode.fraction, prior=PRIOR_SUFFIXES[suffix],
                        correction=mode.correction, layers=mode.layers)
        if any(m.name == mode.name for m in modes):
            raise ValueError(f"mode {mode.name!r} is given twice")
        modes.append(mode)
    if not modes:
        raise ValueError("no modes given")
    return modes
