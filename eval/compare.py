"""`kvbridge eval compare A B --pairs MODE_A=MODE_B,...`: paired differences between two `eval rouge` runs (their
results.json files, or the folders holding them) on the documents both scored, e.g. one mode through vLLM against
its in-process form. Per pair: NLL recovery in each run (each against its own run's `none` and `full`; left out, "–",
when a run has no `none`) and their difference, fidelity ROUGE-L and top-1 agreement with `full` and their
differences, all with bootstrap 95% intervals over the same resampled documents, and on how many documents A is worse
than B. Runs are paired only where they measured the same thing (`check_paired`: the same data file, document and
continuation lengths, summary length and instruction, and each shared document of the same length and reference).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# What a run measured, from its meta.config: two runs that differ in one of these did not measure the same thing on
# a document (another cut, another held-out continuation, another answer), so they are not paired
SETTINGS = ("max_doc_tokens", "continuation_tokens", "min_doc_tokens", "max_new_tokens", "instruction")


@dataclass(frozen=True)
class Run:
    path: Path
    documents: dict[str, dict]  # id -> the document's row of results.json ({"modes": {name: {...}}})
    meta: dict = field(default_factory=dict)  # results.json's meta (data, config, partial, ...)


def read_run(path: str | Path) -> Run:
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"no results.json at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not the results.json of a `kvbridge eval rouge` run: not JSON ({exc})") from None
    rows = data.get("documents") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("id"), str)
                                             and isinstance(r.get("modes"), dict) for r in rows):
        raise ValueError(f"{path} is not the results.json of a `kvbridge eval rouge` run: no list of documents with "
                         "an id and modes")
    return Run(path, {row["id"]: row for row in rows}, data.get("meta") or {})


def check_paired(a: Run, b: Run, ids: list[str]) -> None:
    """ValueError naming what differs where the runs did not measure the same thing: a setting of SETTINGS, the
    data file (by name: the same file may be read from another folder), or a shared document's length in target
    tokens or its reference."""
    config_a, config_b = a.meta.get("config") or {}, b.meta.get("config") or {}
    differ = [f"{k}: {config_a.get(k)!r} in A, {config_b.get(k)!r} in B" for k in SETTINGS
              if config_a.get(k) != config_b.get(k)]
    data_a, data_b = (Path(str(run.meta.get("data", ""))).name for run in (a, b))
    if data_a != data_b:
        differ.append(f"data file: {data_a or '?'} in A, {data_b or '?'} in B")
    for i in ids:
        row_a, row_b = a.documents[i], b.documents[i]
        if row_a.get("doc_tokens") != row_b.get("doc_tokens"):
            differ.append(f"document {i}: {row_a.get('doc_tokens')} document tokens in A, {row_b.get('doc_tokens')} "
                          "in B")
        elif row_a.get("reference") != row_b.get("reference"):
            differ.append(f"document {i}: another reference summary in B")
    if differ:
        raise ValueError(f"{a.path} and {b.path} did not measure the same thing, so their documents do not pair: "
                         + "; ".join(differ[:6]) + (f"; and {len(differ) - 6} more" if len(differ) > 6 else ""))


def _mode(run: Run, doc: dict, name: str) -> dict:
    if name not in doc["modes"]:
        raise ValueError(f"{run.path}: mode {name!r} is not in the run (it has {sorted(doc['modes'])})")
    return doc["modes"][name]


def _ci(values: np.ndarray, point: float) -> dict:
    return {"value": float(point), "low": float(np.nanpercentile(values, 2.5)),
            "high": float(np.nanpercentile(values, 97.5))}


def compare(a: Run, b: Run, pairs: list[tuple[str, str]], samples: int = 1000, seed: int = 0) -> dict:
    """{"documents": n, "pairs": {"A_MODE vs B_MODE": {"recovery_a", "recovery_b", "recovery_diff", "fidelity_a",
    "fidelity_b", "fidelity_diff", "top1_a", "top1_b", "top1_diff", "worse_on"}}} (each figure {"value", "low",
    "high"}; the recovery figures and worse_on None when a run has no `none` mode)."""
    from kvbridge.adapters.scoring import bootstrap_draws, recovery_ratio
    from kvbridge.eval.report import rouge, top1_agreement

    ids = [i for i in a.documents if i in b.documents]
    check_paired(a, b, ids)
    if len(ids) < 2:
        raise ValueError(f"the runs share {len(ids)} documents; a paired comparison needs at least 2")
    boot = bootstrap_draws(len(ids), samples, seed)
    every = np.arange(len(ids))[None]
    out: dict = {"documents": len(ids), "pairs": {}}

    def column(run: Run, name: str, key: str) -> np.ndarray:
        return np.asarray([_mode(run, run.documents[i], name)[key] for i in ids], dtype=np.float64)

    def against_full(run: Run, name: str) -> tuple[np.ndarray, np.ndarray]:
        fidelity, top1 = [], []
        for i in ids:
            full, mode = _mode(run, run.documents[i], "full"), _mode(run, run.documents[i], name)
            fidelity.append(rouge(full["summary"], mode["summary"])["rougeL"])
            agree = top1_agreement(mode["continuation_top1"], full["continuation_top1"])
            top1.append(np.nan if agree is None else agree)
        return np.asarray(fidelity), np.asarray(top1)

    # recovery needs each run's `none`; fidelity and top-1 only its `full`
    recoverable = all("none" in run.documents[i]["modes"] for run in (a, b) for i in ids)
    for name_a, name_b in pairs:
        rec = {}
        for side, run, name in (("a", a, name_a), ("b", b, name_b)) if recoverable else ():
            none, full, mode = (column(run, m, "nll") for m in ("none", "full", name))
            rec[side] = (recovery_ratio(none, full, mode, boot), float(recovery_ratio(none, full, mode, every)[0]),
                         none - mode)  # per document: NLL recovered
        fid_a, top_a = against_full(a, name_a)
        fid_b, top_b = against_full(b, name_b)
        entry = {"recovery_a": None, "recovery_b": None, "recovery_diff": None, "worse_on": None}
        if recoverable:
            entry = {"recovery_a": _ci(rec["a"][0], rec["a"][1]), "recovery_b": _ci(rec["b"][0], rec["b"][1]),
                     "recovery_diff": _ci(rec["a"][0] - rec["b"][0], rec["a"][1] - rec["b"][1]),
                     "worse_on": int((rec["a"][2] < rec["b"][2]).sum())}
        for key, x, y in (("fidelity", fid_a, fid_b), ("top1", top_a, top_b)):
            entry[f"{key}_a"] = _ci(np.nanmean(x[boot], -1), np.nanmean(x))
            entry[f"{key}_b"] = _ci(np.nanmean(y[boot], -1), np.nanmean(y))
            entry[f"{key}_diff"] = _ci(np.nanmean((x - y)[boot], -1), np.nanmean(x - y))
        out["pairs"][f"{name_a} vs {name_b}"] = entry
    return out


def markdown(result: dict, a: Run, b: Run) -> str:
    def f(x: dict | None) -> str:
        return "–" if x is None else f"{x['value']:+.3f} [{x['low']:+.3f}, {x['high']:+.3f}]"

    def g(x: dict | None) -> str:
        return "–" if x is None else f"{x['value']:.3f} [{x['low']:.3f}, {x['high']:.3f}]"

    lines = [f"A: {a.path}; B: {b.path}; {result['documents']} documents in both, paired; bootstrap 95% intervals."]
    for side, run in (("A", a), ("B", b)):
        partial = run.meta.get("partial")
        if partial:
            lines.append(f"{side} is a partial run: it stopped at document {partial['failed_document']} after "
                         f"{partial['documents_done']} of {partial['documents_planned']} documents.")
    lines += ["", "| A vs B | NLL recovery A | B | A − B | worse on | fidelity A − B | top-1 A − B |",
              "|---|---|---|---|---|---|---|"]
    for name, e in result["pairs"].items():
        lines.append(f"| {name} | {g(e['recovery_a'])} | {g(e['recovery_b'])} | {f(e['recovery_diff'])} | "
                     f"{'–' if e['worse_on'] is None else e['worse_on']} of {result['documents']} | "
                     f"{f(e['fidelity_diff'])} | {f(e['top1_diff'])} |")
    return "\n".join(lines)


def parse_pairs(spec: str) -> list[tuple[str, str]]:
    """'served:blend:0.1=served:blend:0.1/noprior,replace' -> [(a, b), ('replace', 'replace')]"""
    pairs = []
    for part in (p.strip() for p in spec.split(",")):
        if part:
            a, _, b = part.partition("=")
            pairs.append((a, b or a))
    if not pairs:
        raise ValueError("--pairs names no modes")
    return pairs
