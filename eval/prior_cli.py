"""`kvbridge prior fit` and `kvbridge prior check`: the commands over eval/prior_fit.py (the fit, its windows and its
record) and eval/prior_answers.py (the answer objective's windows). prior_fit.py's docstring has the recipe."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from kvbridge.eval.prior_answers import AnswerWindows
from kvbridge.eval.prior_fit import OBJECTIVES, TOLERANCE, Recipe, Windows, adapter_record, compare, fit, recorded
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.suffix.induction import InductionPrior


def _recipe(args: argparse.Namespace) -> Recipe:
    return Recipe(preset=args.preset, windows=args.windows, dev=args.dev, steps=args.steps, lam=args.lam,
                  objective=args.objective)


def _windows(recipe: Recipe, data: Path, work: Path, source: LoadedModel, target: LoadedModel, adapter: Path):
    """The recipe's windows: projected ones, and for the answer objective their instructions and answers too."""
    if recipe.objective == "answer":
        return AnswerWindows(recipe, data, work / "windows", source, target, adapter)
    return Windows(recipe, data, work / "windows", source, target, adapter)


def _adapter_file(args: argparse.Namespace, source: LoadedModel, target: LoadedModel) -> Path:
    """--adapter, else the adapter that ships for the pair."""
    from kvbridge.adapters.shipped import find_shipped

    if args.adapter:
        path = Path(args.adapter)
        if not path.is_file():
            raise FileNotFoundError(f"--adapter {path}: no such file")
        return path
    path = find_shipped(source.spec, target.spec)
    if path is None:
        raise FileNotFoundError(f"no adapter ships for {source.name} -> {target.name}: pass --adapter FILE (the "
                                "adapter the prior is for)")
    return path


def _split_words(split) -> str:
    """What `fitted_on` adds for a split of other documents than the trainer's default ones ("" for those)."""
    from kvbridge.eval.heldout import DEFAULT_DOC_CHARS

    return "" if split.doc_chars == DEFAULT_DOC_CHARS else f" of {split.doc_chars}-character documents"


def cmd_prior_fit(args: argparse.Namespace) -> int:
    from kvbridge.transfer.presets import load_pair

    recipe = _recipe(args)
    if Path(args.out).exists() and not args.force:
        raise ValueError(f"--out {args.out} exists: choose another file, or pass --force to write over it")
    source, target = load_pair(recipe.preset)
    work = Path(args.work)
    windows = _windows(recipe, args.data, work, source, target, _adapter_file(args, source, target))
    theta, trajectory = fit(recipe, target, windows, work)
    given = f" --adapter {windows.adapter_file.name}" if args.adapter else ""
    given += f" --objective {recipe.objective}" if recipe.objective != Recipe.objective else ""
    command = (f"kvbridge prior fit --preset {recipe.preset} --data DATA{given} --windows {recipe.windows} "
               f"--dev {recipe.dev} --steps {recipe.steps} --lam {recipe.lam} --out {Path(args.out).name} (DATA: the "
               f"folder `kvbridge data build --out DATA` writes)")
    InductionPrior(theta.float(), origin=Path(args.out).name).save(args.out, {
        "target": {"name": target.name, "config_hash": target.spec.identity.config_hash},
        "adapter": windows.adapter,
        "recipe": asdict(recipe), "dev_nll": trajectory, "tolerance": TOLERANCE,
        "fitted_on": f"windows of pydoc_corpus.txt and kernel_docs_corpus.txt, the chain's training documents "
                     f"(blake2b split{_split_words(windows.split)}, {100 * windows.split.heldout_fraction:g}% held "
                     f"out never used); {recipe.windows - recipe.dev} training windows, {recipe.dev} dev windows",
        "command": command})
    print(f"wrote {args.out}: dev NLL (recompute:0.1, replace) {trajectory['0']} at step 0, "
          f"{trajectory[str(recipe.steps)]} at step {recipe.steps}")
    return 0


def cmd_prior_check(args: argparse.Namespace) -> int:
    from kvbridge.transfer.presets import load_pair

    meta = recorded(Path(args.file))
    recipe = Recipe(**meta["recipe"])
    marks = sorted(int(s) for s in meta["dev_nll"])
    until = args.until if args.until is not None else recipe.steps
    if until not in marks:
        raise ValueError(f"{args.file} records the dev NLL at steps {marks}: --until must be one of them")
    source, target = load_pair(recipe.preset)
    if target.spec.identity.config_hash != meta["target"]["config_hash"]:
        raise ValueError(f"{args.file} was fitted for {meta['target']['name']}, not {target.name}")
    work = Path(args.work)
    adapter = _adapter_file(args, source, target)
    fitted, using = meta.get("adapter"), adapter_record(adapter)
    if isinstance(fitted, dict) and fitted.get("digest") and fitted["digest"] != using["digest"]:
        raise ValueError(f"{args.file} was fitted for adapter {fitted.get('name')} ({fitted['digest'][:16]}), not for "
                         f"{using['name']} ({using['digest'][:16]}): pass --adapter the file it was fitted with")
    windows = _windows(recipe, args.data, work, source, target, adapter)
    theta, trajectory = fit(recipe, target, windows, None, until=until)  # recomputed: no fit's checkpoint read
    worst = compare(meta["dev_nll"][str(until)], trajectory[str(until)], float(meta["tolerance"]))
    line = f"step {until}: dev NLL {trajectory[str(until)]}, recorded {meta['dev_nll'][str(until)]}, " \
           f"relative difference {worst:.1e} (tolerance {meta['tolerance']:.0e})"
    if until == recipe.steps:
        shipped = InductionPrior.load(args.file).terms
        line += f"; terms differ from the file's by at most {float((theta - shipped).abs().max()):.2e}"
    print(line)
    return 0


def add_parsers(sub) -> None:
    from kvbridge.transfer.presets import PRESETS

    prior = sub.add_parser("prior", help="fit a target's induction prior, or check a fitted one reproduces")
    psub = prior.add_subparsers(dest="prior_command", required=True)
    data = argparse.ArgumentParser(add_help=False)
    data.add_argument("--data", required=True, type=Path, metavar="DIR",
                      help="folder of pydoc_corpus.txt and kernel_docs_corpus.txt (`kvbridge data build --out DIR`)")
    data.add_argument("--work", type=Path, default=Path("prior-work"), metavar="DIR",
                      help="the built windows and the fit's checkpoint; a fit resumes from it, a check reads only "
                           "the windows (default prior-work)")
    data.add_argument("--adapter", metavar="FILE",
                      help="the adapter whose projections the prior reads (default: the one that ships for the pair); "
                           "the prior file records its digest")
    p = psub.add_parser("fit", parents=[data], help="fit the prior of a preset's target (about 15 minutes for the "
                        "small pair on 2 cores)")
    p.add_argument("--preset", default=Recipe.preset, choices=sorted(PRESETS))
    p.add_argument("--windows", type=int, default=Recipe.windows, help="dev and training windows")
    p.add_argument("--dev", type=int, default=Recipe.dev, help="dev windows (the first ones)")
    p.add_argument("--steps", type=int, default=Recipe.steps, help="Adam steps, one window each")
    p.add_argument("--lam", type=float, default=Recipe.lam, help="weight of the squared distance from the init")
    p.add_argument("--objective", default=Recipe.objective, choices=OBJECTIVES,
                   help="what the fit lowers: the NLL of the continuation after the context (default), or of the "
                        "target's own greedy answer to an instruction after it (what users read)")
    p.add_argument("--out", required=True, metavar="FILE.safetensors", help="the prior file to write (a new file; "
                                                                            "see --force)")
    p.add_argument("--force", action="store_true", help="write over an existing --out file")
    p.set_defaults(func=cmd_prior_fit)
    p = psub.add_parser("check", parents=[data], help="rerun a fitted prior's recipe up to a step and compare its "
                        "dev NLL with the file's record")
    p.add_argument("file", help="a prior file written by `kvbridge prior fit`")
    p.add_argument("--until", type=int, help="the step to stop at, one the file records (default: the last)")
    p.set_defaults(func=cmd_prior_check)
