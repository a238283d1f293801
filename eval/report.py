"""From per-document results to the report: ROUGE-1/2/L F1 by Google's rouge-score (stemming on) with bootstrap
95% intervals over documents, NLL recovery (pooled over tokens, bootstrap interval), and — because a 135M model's
summaries score near noise against reference titles — measures against `full`'s own output that can tell modes
apart: fidelity (ROUGE-L of the mode's summary against full's), top-1 agreement with full over the continuation
tokens, and the share of repeated 3-grams in the summary. Cost: prefill FLOPs saved against `full`, the whole
system's FLOPs per request (source prefill, projection and a served correction amortised over N reuses of one
projected context), TTFT and KV bytes. Written as Markdown, JSON and a plot of quality against the recompute
fraction."""

from __future__ import annotations

import json
import os
import statistics
import textwrap
from dataclasses import asdict
from pathlib import Path

from kvbridge.adapters.answering import ROUGE_TYPES, greedy_agreement, rouge, top1_agreement
from kvbridge.adapters.scoring import bootstrap_mean, bootstrap_recovery
from kvbridge.eval.cost import PairCost
from kvbridge.eval.modes import NEEDS_PROJECTION, NO_PRIOR, PROBE_PRIOR, base_mode
from kvbridge.eval.summaries import DocumentResult

# the demo and tests read rouge, top1_agreement, greedy_agreement and bootstrap_mean here too
REUSES = (1, 10)  # N: requests sharing one projected context, for the amortised system cost


def repeated_ngram_share(ids: list[int], n: int = 3) -> float:
    """Share of the n-grams of a token sequence that repeat an earlier one (0.0: none, or too short to have one)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def summarise(results: list[DocumentResult], samples: int = 1000, seed: int = 0, cost: PairCost | None = None
              ) -> dict:
    """Per-mode figures (means with 95% intervals); ROUGE scores are added to every ModeResult row first. `cost`:
    the pair's and adapter's FLOP model, for the system cost of projected modes (None: not reported)."""
    if not results:
        raise ValueError("no documents were evaluated")
    modes = list(results[0].modes)
    rows = {name: [r.modes[name] for r in results] for name in modes}
    referenced = [r for r in results if r.reference.strip()]  # a record may come without a reference summary
    scores = {name: [rouge(r.reference, r.modes[name].summary) for r in referenced] for name in modes}
    table: dict[str, dict] = {}
    scored = [i for i, r in enumerate(results) if all(m.nll is not None for m in r.modes.values())]
    nll_tokens = sum(results[i].modes[modes[0]].nll_tokens for i in scored)
    full_flops = statistics.mean(m.prefill_flops for m in rows["full"]) if "full" in rows else None
    full_ttft = statistics.median(m.ttft_s for m in rows["full"]) if "full" in rows else None
    for name in modes:
        entry: dict = {}
        for kind in ROUGE_TYPES:  # against the reference summaries (None: no record has one)
            entry[kind] = None
            if referenced:
                mean, lo, hi = bootstrap_mean([s[kind] for s in scores[name]], samples, seed)
                entry[kind] = {"mean": mean, "low": lo, "high": hi}
        nlls = [rows[name][i].nll for i in scored]
        entry["nll_per_token"] = sum(nlls) / nll_tokens if nll_tokens else None
        if "none" in rows and "full" in rows and scored:
            none, full = [rows["none"][i].nll for i in scored], [rows["full"][i].nll for i in scored]
            entry["nll_recovery"] = None  # undefined where `full` gained nothing over `none` (summed: 0 / 0)
            if sum(none) != sum(full):
                value, lo, hi = bootstrap_recovery(none, full, nlls, samples, seed)
                entry["nll_recovery"] = {"value": value, "low": lo, "high": hi}
        flops = statistics.mean(m.prefill_flops for m in rows[name])
        entry["prefill_flops_mean"] = flops
        entry["prefill_tokens_mean"] = statistics.mean(m.prefill_tokens for m in rows[name])
        entry["flops_saved_vs_full"] = 1 - flops / full_flops if full_flops else None
        ttft = statistics.median(m.ttft_s for m in rows[name])
        entry["ttft_median_s"] = ttft
        entry["ttft_vs_full"] = ttft / full_ttft if full_ttft else None
        warm = [m.ttft_warm_s if m.ttft_warm_s is not None else m.ttft_s for m in rows[name]]
        entry["ttft_warm_median_s"] = statistics.median(warm)  # a second request: the server's store has the KV
        entry["ttft_warm_vs_full"] = entry["ttft_warm_median_s"] / full_ttft if full_ttft else None
        loaded = [m.loaded_tokens for m in rows[name] if m.loaded_tokens is not None]
        if loaded:  # --engine vllm: prompt tokens the connector loaded (whole blocks)
            entry["loaded_tokens_mean"] = statistics.mean(loaded)
        entry["kv_bytes_mean"] = statistics.mean(m.kv_bytes for m in rows[name])
        entry["repeated_3gram_share"] = _mean_ci([repeated_ngram_share(m.summary_ids) for m in rows[name]],
                                                 samples, seed)
        if "full" in rows:
            entry["fidelity_rougeL"] = _mean_ci([rouge(f.summary, m.summary)["rougeL"]
                                                 for f, m in zip(rows["full"], rows[name])], samples, seed)
            agree = [top1_agreement(m.continuation_top1, f.continuation_top1) for f, m in zip(rows["full"], rows[name])]
            agree = [a for a in agree if a is not None]
            entry["top1_agreement"] = _mean_ci(agree, samples, seed) if agree else None
            greedy = [greedy_agreement(m.summary_ids, f.summary_ids) for f, m in zip(rows["full"], rows[name])]
            greedy = [g for g in greedy if g is not None]
            entry["greedy_agreement"] = _mean_ci(greedy, samples, seed) if greedy else None
        if cost is not None and full_flops:
            entry["system_flops"] = {}
            for uses in REUSES:
                flops_n = statistics.mean(_system_flops(cost, name, r, uses) for r in results)
                entry["system_flops"][str(uses)] = {"flops": flops_n, "vs_full": flops_n / full_flops}
        table[name] = entry
    for i, r in enumerate(referenced):  # the documents without a reference keep rouge None
        for name in modes:
            r.modes[name].rouge = scores[name][i]
    out = {"documents": len(results), "nll_documents": len(scored), "nll_tokens": nll_tokens, "modes": table}
    if cost is not None:
        tokens = round(statistics.mean(r.doc_tokens + 1 for r in results))
        out["flop_ceiling"] = {"tokens": tokens, "target_prefill_over_projection": cost.ceiling(tokens)}
    return out


def _mean_ci(values: list[float], samples: int, seed: int) -> dict:
    mean, lo, hi = bootstrap_mean(values, samples, seed)
    return {"mean": mean, "low": lo, "high": hi}


def _system_flops(cost: PairCost, name: str, result: DocumentResult, uses: int) -> float:
    """The whole system's FLOPs for one request of this mode: the target's own prefill, plus, for modes that use the
    projected context, the source's prefill and the projection shared by `uses` requests, and what the server
    computed once for the mode (a served correction's target forwards: ModeResult.shared_flops) shared by them too."""
    mode = result.modes[name]
    shared = mode.shared_flops / uses
    if base_mode(name).split(":")[0] not in NEEDS_PROJECTION or result.source_tokens is None:
        return mode.prefill_flops + shared
    return cost.system(mode.prefill_flops, result.source_tokens, result.doc_tokens + 1, uses) + shared


def _ci(x: dict | None, key: str = "mean", digits: int = 3) -> str:
    if not x:
        return "–"
    return f"{x[key]:.{digits}f} [{x['low']:.{digits}f}, {x['high']:.{digits}f}]"


def _warm(e: dict) -> str:
    if e.get("ttft_warm_median_s") is None:
        return "–"
    ratio = f" ({e['ttft_warm_vs_full']:.2f}×)" if e.get("ttft_warm_vs_full") is not None else ""
    return f"{e['ttft_warm_median_s']:.3f} s{ratio}"


def markdown_table(summary: dict) -> str:
    """Two tables: quality (against the references and against full's own output), then cost."""
    lines = ["| mode | ROUGE-L vs reference | NLL recovery | fidelity ROUGE-L vs full | top-1 agreement with full "
             "| greedy agreement with full | repeated 3-grams |", "|---|---|---|---|---|---|---|"]
    for name, e in summary["modes"].items():
        lines.append(f"| {name} | {_ci(e['rougeL'])} | {_ci(e.get('nll_recovery'), 'value')} | "
                     f"{_ci(e.get('fidelity_rougeL'))} | {_ci(e.get('top1_agreement'))} | "
                     f"{_ci(e.get('greedy_agreement'))} | {_ci(e.get('repeated_3gram_share'))} |")
    reuse = [f"system FLOPs × full (N={n})" for n in REUSES]
    lines += ["", "| mode | ROUGE-1 | ROUGE-2 | prefill FLOPs saved | " + " | ".join(reuse) +
              " | TTFT median, cold (× full) | warm (× full) | KV bytes moved |",
              "|---|---|---|---|" + "---|" * len(reuse) + "---|---|---|"]
    for name, e in summary["modes"].items():
        saved = f"{e['flops_saved_vs_full']:.1%}" if e["flops_saved_vs_full"] is not None else "–"
        system = [f"{e['system_flops'][str(n)]['vs_full']:.3f}" if e.get("system_flops") else "–" for n in REUSES]
        ratio = f" ({e['ttft_vs_full']:.2f}×)" if e["ttft_vs_full"] is not None else ""
        kv = f"{e['kv_bytes_mean'] / 1e6:.2f} MB" if e["kv_bytes_mean"] else "0"
        lines.append(f"| {name} | {_ci(e['rouge1'])} | {_ci(e['rouge2'])} | {saved} | " + " | ".join(system) +
                     f" | {e['ttft_median_s']:.3f} s{ratio} | {_warm(e)} | {kv} |")
    ceiling = summary.get("flop_ceiling")
    if ceiling:
        lines += ["", f"FLOP ceiling of this pair and adapter at {ceiling['tokens']} tokens: the target's own prefill "
                      f"costs {ceiling['target_prefill_over_projection']:.1f}× the projection."]
    return "\n".join(lines)


def plot(summary: dict, path: Path, title: str) -> Path | None:
    """ROUGE-L and NLL recovery against the target's prefill FLOPs as a share of full's (what each mode computes
    itself, selection passes included): recompute:r (projected head, the last r recomputed; from replace to full),
    blend:r (r chosen by the attention of the last tokens, from replace to full) and tail:r (only the last r
    tokens; from none to full); recompute:r and blend:r with /noprior dotted, with /probe dash-dotted, where the run
    has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = summary["modes"]

    def share(name: str) -> float:
        saved = modes[name].get("flops_saved_vs_full")
        return 1 - saved if saved is not None else 0.0

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in ((axes[0], "rougeL", "ROUGE-L F1"), (axes[1], "nll_recovery", "NLL recovery")):
        key = "value" if metric == "nll_recovery" else "mean"
        curves = (("recompute", "replace", "o-", ""), ("tail", "none", "s--", ""), ("blend", "replace", "^-", ""),
                  ("recompute", "replace", "o:", NO_PRIOR), ("blend", "replace", "^:", NO_PRIOR),
                  ("recompute", "replace", "o-.", PROBE_PRIOR), ("blend", "replace", "^-.", PROBE_PRIOR))
        for kind, anchor, style, suffix in curves:  # /noprior and /probe modes make curves of their own
            names = [anchor + suffix] if anchor + suffix in modes else []
            names += [n for n in modes if n.startswith(kind + ":") and n[len(base_mode(n)):] == suffix]
            names += ["full"] if "full" in modes else []
            points = sorted(((share(n), modes[n].get(metric)) for n in names if modes[n].get(metric)),
                            key=lambda p: p[0])
            if len(points) < 2:
                continue
            xs = [x for x, _ in points]
            ys = [v[key] for _, v in points]
            err = [[y - v["low"] for y, (_, v) in zip(ys, points)], [v["high"] - y for y, (_, v) in zip(ys, points)]]
            ax.errorbar(xs, ys, yerr=err, fmt=style, capsize=3, label=f"{kind}:r{suffix}")
        for name, color in (("full", "green"), ("none", "gray"), ("fuse", "purple")):
            if name in modes and modes[name].get(metric):
                ax.axhline(modes[name][metric][key], color=color, linestyle=":", label=name)
        ax.set_xlabel("target prefill FLOPs, share of full's (selection passes included)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a run of modes without curves or lines has nothing to label
            ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 150), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def check_out(out: Path, force: bool = False) -> None:
    """ValueError, before a run, where its report could not be written to the folder `out` or would write over
    files there: `out` a file, a folder that holds files (unless `force`), a parent that is a file or that this
    user cannot write to."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder: the report is a folder of results.json, table.md and "
                         "a plot")
    if out.is_dir():
        held = sorted(p.name for p in out.iterdir())
        if held and not force:
            raise ValueError(f"--out {out} holds files ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): "
                             "choose another folder, or pass --force to write the report over them")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is a file, so the folder cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {existing} is not writable by this user")


def write_report(out: Path, summary: dict, results: list[DocumentResult], meta: dict, force: bool = False
                 ) -> dict[str, Path]:
    """results.json (meta, per-mode summary, per-document rows), table.md and quality_vs_recompute.png in `out`,
    a folder that holds no files yet (`force`: write over what it holds). A run that stopped early has
    meta["partial"] (what stopped it, how many documents it got through): the table says so first."""
    check_out(out, force)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"id": r.id, "reference": r.reference, "doc_tokens": r.doc_tokens, "fetch_s": r.fetch_s,
             "exact_coverage": r.exact_coverage, "source_tokens": r.source_tokens,
             "modes": {name: {k: v for k, v in asdict(m).items() if k != "summary_ids"}
                       for name, m in r.modes.items()}} for r in results]
    paths = {"json": out / "results.json", "markdown": out / "table.md", "plot": out / "quality_vs_recompute.png"}
    paths["json"].write_text(json.dumps({"meta": meta, "summary": summary, "documents": rows}, indent=1))
    table = markdown_table(summary)
    engine = meta.get("engine", "transformers")
    engine = f"vLLM ({meta.get('dtype')}, through the kvbridge connector; no induction prior)" if engine == "vllm" \
        else "transformers, in process"
    head = (f"{summary['documents']} documents ({meta.get('data', '')}), {meta.get('source', '')} -> "
            f"{meta.get('target', '')}, adapter {meta.get('adapter', '')}, target engine {engine}. Means with "
            "bootstrap 95% intervals.")
    stale = (meta.get("induction_prior") or {}).get("stale")
    warning = (f"\n\nThe modes that read the induction prior read one made for another adapter: {stale}."
               if stale else "")
    partial = meta.get("partial")
    if partial:
        head = (f"PARTIAL RUN: stopped at document {partial['failed_document']} ({partial['error']}) after "
                f"{partial['documents_done']} of {partial['documents_planned']} documents.\n\n" + head)
    paths["markdown"].write_text(head + warning + "\n\n" + table + "\n")
    plot(summary, paths["plot"], head)
    return paths
