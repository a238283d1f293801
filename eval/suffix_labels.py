"""A labelled set for the suffix detector: varied documentation texts with known boilerplate closings appended, the
boundary being the first token of the closing; and the detector's boundary accuracy on it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvbridge.transfer.data import data_path, jsonl_rows
from kvbridge.transfer.suffix.detector import attention_entropy, segment_starts

# Boilerplate closings of the kinds that end real pages and messages (written for this set).
CLOSINGS = (
    "This page is licensed under the Python Software Foundation License Version 2. Examples, recipes, and other "
    "code in the documentation are additionally licensed under the Zero Clause BSD License.",
    "Thanks for reading! If you found this useful, please share it with your colleagues and subscribe to our "
    "newsletter for more updates.",
    "Best regards,\nThe Documentation Team\n\nThis email and any attachments are confidential and intended solely "
    "for the addressee.",
    "Copyright 2001-2024, Python Software Foundation. All rights reserved. Last updated on Jan 01, 2024.",
    "Disclaimer: the information provided here is for general informational purposes only and comes with no "
    "warranty of any kind.",
    "Found a bug? Report it on the issue tracker, and include the version you used and the smallest example that "
    "shows the problem.",
    "Unsubscribe | Privacy policy | Terms of service | Contact us | Help center",
    "If you have any questions, feel free to reach out to our support team at any time. We are happy to help.",
)


@dataclass(frozen=True)
class LabelledText:
    token_ids: torch.Tensor  # [T]
    boundary: int  # index of the first token of the closing
    closing: int  # which CLOSINGS entry


def labelled_set(tokenizer, documents: int = 24, body_words: tuple[int, int] = (90, 160),
                 add_special_tokens: bool = True) -> list[LabelledText]:
    """`documents` texts: the start of a held-out pydoc page (a varying number of words) + "\\n\\n" + a closing,
    closings taken in turn."""
    pages = [row["document"] for _, row in jsonl_rows(data_path("pydoc_heldout.jsonl"))]
    out = []
    lo, hi = body_words
    for i in range(documents):
        words = pages[i % len(pages)].split()
        body = " ".join(words[: lo + (i * 37) % (hi - lo + 1)])
        closing = CLOSINGS[i % len(CLOSINGS)]
        text = f"{body}\n\n{closing}"
        enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        first_char = len(body) + 2
        boundary = next(j for j, (s, e) in enumerate(enc["offset_mapping"]) if e > first_char)
        out.append(LabelledText(token_ids=torch.tensor(enc["input_ids"]), boundary=boundary,
                                closing=i % len(CLOSINGS)))
    return out


@dataclass(frozen=True)
class BoundaryAccuracy:
    texts: int
    tolerance: int  # tokens either side of the label that count as a hit
    recall: float  # texts whose planted boundary has a detected start within tolerance
    precision: float  # detected starts (besides 0) that are a planted boundary within tolerance
    starts_per_text: float  # detected starts besides 0, mean
    mean_offset: float | None  # detected - planted, over hits

    def line(self) -> str:
        offset = "n/a" if self.mean_offset is None else f"{self.mean_offset:+.1f}"
        return (f"{self.texts} texts, tolerance ±{self.tolerance} tokens: recall {self.recall:.2f}, precision "
                f"{self.precision:.2f}, {self.starts_per_text:.1f} starts/text, mean offset of hits {offset}")


def boundary_accuracy(starts_per_text: list[list[int]], labelled: list[LabelledText],
                      tolerance: int = 3) -> BoundaryAccuracy:
    hits, offsets, matched, predicted = 0, [], 0, 0
    for starts, item in zip(starts_per_text, labelled):
        found = [s for s in starts if s > 0]
        predicted += len(found)
        near = [s - item.boundary for s in found if abs(s - item.boundary) <= tolerance]
        matched += len(near)
        if near:
            hits += 1
            offsets.append(min(near, key=abs))
    n = len(labelled)
    return BoundaryAccuracy(texts=n, tolerance=tolerance, recall=hits / n if n else 0.0,
                            precision=matched / predicted if predicted else 0.0,
                            starts_per_text=predicted / n if n else 0.0,
                            mean_offset=sum(offsets) / len(offsets) if offsets else None)


def f1(acc: BoundaryAccuracy) -> float:
    total = acc.recall + acc.precision
    return 2 * acc.recall * acc.precision / total if total else 0.0


def choose_layers(per_layer: list[torch.Tensor], labelled: list[LabelledText], config, max_layers: int = 2,
                  tolerance: int = 3, shortlist: int = 6) -> tuple[tuple[int, ...], BoundaryAccuracy]:
    """The layers whose mean entropy profile detects the labelled boundaries best (F1 of recall and precision),
    among single layers and combinations of up to `max_layers` of the `shortlist` best single layers.

    per_layer: one [L, T] profile per labelled text (attention_entropy(..., per_layer=True) over every layer).
    Fit the choice on one part of a labelled set and report the accuracy on another (see SuffixDetector docs).
    """
    from itertools import combinations

    num_layers = per_layer[0].shape[0]

    def score(layers: tuple[int, ...]) -> BoundaryAccuracy:
        starts = [segment_starts(p[list(layers)].mean(0), config) for p in per_layer]
        return boundary_accuracy(starts, labelled, tolerance)

    singles = sorted(((f1(score((i,))), i) for i in range(num_layers)), reverse=True)
    best = [i for _, i in singles[:shortlist]]
    candidates = [(i,) for i in range(num_layers)]
    for k in range(2, max_layers + 1):
        candidates += [tuple(sorted(c)) for c in combinations(best, k)]
    scored = [(f1(acc := score(c)), -len(c), c, acc) for c in candidates]
    _, _, layers, acc = max(scored, key=lambda x: (x[0], x[1]))
    return layers, acc


@dataclass(frozen=True)
class Calibration:
    layers: tuple[int, ...]
    fit: BoundaryAccuracy  # on the texts the layers were chosen with
    heldout: BoundaryAccuracy  # on the other texts


def calibrate_layers(lm, config, texts: int = 24, tolerance: int = 3, max_layers: int = 2) -> Calibration:
    """Choose the detector's layers for a model on the even-numbered texts of the labelled set; report the accuracy
    on the odd-numbered ones (never seen by the choice)."""
    items = labelled_set(lm.tokenizer, texts)
    per_layer = [attention_entropy(lm.model, lm.spec, it.token_ids, chunk_tokens=config.chunk_tokens,
                                   per_layer=True) for it in items]
    fit, held = list(range(0, texts, 2)), list(range(1, texts, 2))
    layers, fit_acc = choose_layers([per_layer[i] for i in fit], [items[i] for i in fit], config, max_layers,
                                    tolerance)
    starts = [segment_starts(per_layer[i][list(layers)].mean(0), config) for i in held]
    return Calibration(layers=layers, fit=fit_acc,
                       heldout=boundary_accuracy(starts, [items[i] for i in held], tolerance))
