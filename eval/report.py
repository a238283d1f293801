"""From per-document results to the report: ROUGE-1/2/L F1 by Google's rouge-score (stemming on) with bootstrap
95% intervals over documents, NLL recovery (pooled over tokens, bootstrap interval), prefill FLOPs saved against
`full`, TTFT and KV bytes; written as Markdown, JSON and a plot of quality against the recompute fraction."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from functools import cache
from pathlib import Path

import numpy as np
from kvbridge.eval.summaries import DocumentResult
from rouge_score import rouge_scorer

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


@cache
def _scorer() -> rouge_scorer.RougeScorer:
    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def rouge(reference: str, prediction: str) -> dict[str, float]:
    """F1 of ROUGE-1, -2 and -L (rouge-score, Porter stemming)."""
    scores = _scorer().score(reference, prediction)
    return {name: scores[name].fmeasure for name in ROUGE_TYPES}


def bootstrap_mean(values: list[float], samples: int, seed: int) -> tuple[float, float, float]:
    """(mean, low, high): the 2.5 and 97.5 percentiles of the mean over resampled documents."""
    x = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(samples, len(x)))].mean(axis=1)
    return float(x.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def bootstrap_recovery(none: list[float], full: list[float], mode: list[float], samples: int, seed: int
                       ) -> tuple[float, float, float]:
    """Recovery (NLL_none − NLL_mode) / (NLL_none − NLL_full) over summed NLLs, with a document bootstrap."""
    n, f, m = (np.asarray(v, dtype=np.float64) for v in (none, full, mode))

    def ratio(idx):
        gap = n[idx].sum(-1) - f[idx].sum(-1)
        return (n[idx].sum(-1) - m[idx].sum(-1)) / np.where(gap == 0, np.nan, gap)

    rng = np.random.default_rng(seed)
    boot = ratio(rng.integers(0, len(n), size=(samples, len(n))))
    value = float(ratio(np.arange(len(n))[None])[0])
    return value, float(np.nanpercentile(boot, 2.5)), float(np.nanpercentile(boot, 97.5))


def summarise(results: list[DocumentResult], samples: int = 1000, seed: int = 0) -> dict:
    """Per-mode figures (means with 95% intervals); ROUGE scores are added to every ModeResult row first."""
    if not results:
        raise ValueError("no documents were evaluated")
    modes = list(results[0].modes)
    rows = {name: [r.modes[name] for r in results] for name in modes}
    scores = {name: [rouge(r.reference, r.modes[name].summary) for r in results] for name in modes}
    table: dict[str, dict] = {}
    scored = [i for i, r in enumerate(results) if all(m.nll is not None for m in r.modes.values())]
    nll_tokens = sum(results[i].modes[modes[0]].nll_tokens for i in scored)
    full_flops = statistics.mean(m.prefill_flops for m in rows["full"]) if "full" in rows else None
    full_ttft = statistics.median(m.ttft_s for m in rows["full"]) if "full" in rows else None
    for name in modes:
        entry: dict = {}
        for kind in ROUGE_TYPES:
            mean, lo, hi = bootstrap_mean([s[kind] for s in scores[name]], samples, seed)
            entry[kind] = {"mean": mean, "low": lo, "high": hi}
        nlls = [rows[name][i].nll for i in scored]
        entry["nll_per_token"] = sum(nlls) / nll_tokens if nll_tokens else None
        if "none" in rows and "full" in rows and scored:
            value, lo, hi = bootstrap_recovery([rows["none"][i].nll for i in scored],
                                               [rows["full"][i].nll for i in scored], nlls, samples, seed)
            entry["nll_recovery"] = {"value": value, "low": lo, "high": hi}
        flops = statistics.mean(m.prefill_flops for m in rows[name])
        entry["prefill_flops_mean"] = flops
        entry["prefill_tokens_mean"] = statistics.mean(m.prefill_tokens for m in rows[name])
        entry["flops_saved_vs_full"] = 1 - flops / full_flops if full_flops else None
        ttft = statistics.median(m.ttft_s for m in rows[name])
        entry["ttft_median_s"] = ttft
        entry["ttft_vs_full"] = ttft / full_ttft if full_ttft else None
        entry["kv_bytes_mean"] = statistics.mean(m.kv_bytes for m in rows[name])
        table[name] = entry
    for r, doc_scores in zip(results, zip(*(scores[name] for name in modes))):
        for name, s in zip(modes, doc_scores):
            r.modes[name].rouge = s
    return {"documents": len(results), "nll_documents": len(scored), "nll_tokens": nll_tokens, "modes": table}


def _ci(x: dict | None, key: str = "mean", digits: int = 3) -> str:
    if not x:
        return "–"
    return f"{x[key]:.{digits}f} [{x['low']:.{digits}f}, {x['high']:.{digits}f}]"


def markdown_table(summary: dict) -> str:
    lines = ["| mode | ROUGE-1 | ROUGE-2 | ROUGE-L | NLL recovery | prefill FLOPs saved | TTFT median (× full) "
             "| KV bytes moved |", "|---|---|---|---|---|---|---|---|"]
    for name, e in summary["modes"].items():
        saved = f"{e['flops_saved_vs_full']:.1%}" if e["flops_saved_vs_full"] is not None else "–"
        ratio = f" ({e['ttft_vs_full']:.2f}×)" if e["ttft_vs_full"] is not None else ""
        kv = f"{e['kv_bytes_mean'] / 1e6:.2f} MB" if e["kv_bytes_mean"] else "0"
        lines.append(f"| {name} | {_ci(e['rouge1'])} | {_ci(e['rouge2'])} | {_ci(e['rougeL'])} | "
                     f"{_ci(e.get('nll_recovery'), 'value')} | {saved} | {e['ttft_median_s']:.3f} s{ratio} | {kv} |")
    return "\n".join(lines)


def plot(summary: dict, path: Path, title: str) -> Path | None:
    """ROUGE-L and NLL recovery against the fraction of document tokens the target prefills itself: recompute:r
    (projected head, r recomputed; 0 = replace, 1 = full) against tail:r (only those r tokens; 0 = none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = summary["modes"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in ((axes[0], "rougeL", "ROUGE-L F1"), (axes[1], "nll_recovery", "NLL recovery")):
        key = "value" if metric == "nll_recovery" else "mean"
        for kind, anchor, style in (("recompute", "replace", "o-"), ("tail", "none", "s--")):
            points = [(0.0, modes[anchor].get(metric))] if anchor in modes else []
            points += [(float(n.split(":")[1]), e.get(metric)) for n, e in modes.items() if n.startswith(kind + ":")]
            if "full" in modes:
                points.append((1.0, modes["full"].get(metric)))
            points = sorted(((x, v) for x, v in points if v), key=lambda p: p[0])
            if len(points) < 2:
                continue
            xs = [x for x, _ in points]
            ys = [v[key] for _, v in points]
            err = [[y - v["low"] for y, (_, v) in zip(ys, points)], [v["high"] - y for y, (_, v) in zip(ys, points)]]
            ax.errorbar(xs, ys, yerr=err, fmt=style, capsize=3, label=f"{kind}:r")
        for name, color in (("full", "green"), ("none", "gray"), ("fuse", "purple")):
            if name in modes and modes[name].get(metric):
                ax.axhline(modes[name][metric][key], color=color, linestyle=":", label=name)
        ax.set_xlabel("fraction of document tokens the target prefills itself (r)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out: Path, summary: dict, results: list[DocumentResult], meta: dict) -> dict[str, Path]:
    """results.json (meta, per-mode summary, per-document rows), table.md and quality_vs_recompute.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"id": r.id, "reference": r.reference, "doc_tokens": r.doc_tokens, "fetch_s": r.fetch_s,
             "exact_coverage": r.exact_coverage,
             "modes": {name: {k: v for k, v in asdict(m).items() if k != "summary_ids"}
                       for name, m in r.modes.items()}} for r in results]
    paths = {"json": out / "results.json", "markdown": out / "table.md", "plot": out / "quality_vs_recompute.png"}
    paths["json"].write_text(json.dumps({"meta": meta, "summary": summary, "documents": rows}, indent=1))
    table = markdown_table(summary)
    head = (f"{summary['documents']} documents ({meta.get('data', '')}), {meta.get('source', '')} -> "
            f"{meta.get('target', '')}, adapter {meta.get('adapter', '')}. Means with bootstrap 95% intervals.")
    paths["markdown"].write_text(head + "\n\n" + table + "\n")
    plot(summary, paths["plot"], head)
    return paths
