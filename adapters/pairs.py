"""One text as both models see it, and the aligned, un-rotated KV pairs it yields for fitting.

Convention (used in fitting, evaluation and serving alike): the source reads the text with its tokenizer's own
special tokens (Gemma adds BOS, Qwen2 none); the target sequence is its start token followed by the text's
tokens. The start token's KV is exact (the target's own, stored in the adapter); every other target token takes
projected KV. SmolLM2's tokenizer adds no BOS, so the start token is chosen once (`start_token_id`) and used in
every condition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.align import AlignKind, Alignment, align_tokens, start_token_id, tokenize
from kvbridge.transfer.models import LoadedModel

__all__ = ["PairedText", "pair_text", "with_start_token", "kv_pairs", "start_kv", "start_token_id", "flatten_heads"]


@dataclass(frozen=True)
class PairedText:
    text: str
    source_ids: torch.Tensor  # [T_s] int64
    target_ids: torch.Tensor  # [T_t] int64: start token, then the text's target tokens
    alignment: Alignment  # [T_t] -> source token index (the start token: UNMAPPED)
    target_offsets: torch.Tensor  # [T_t, 2] character offsets of the target tokens ((0, 0) for the start)


def with_start_token(aligned: Alignment) -> Alignment:
    """The alignment of the target's text tokens with the start token put in front (UNMAPPED: its KV is exact)."""
    return Alignment(
        source_index=torch.cat((torch.tensor([-1]), aligned.source_index)),
        kind=torch.cat((torch.tensor([int(AlignKind.UNMAPPED)], dtype=torch.int8), aligned.kind)),
        target_special=torch.cat((torch.tensor([True]), aligned.target_special)),
        num_source_tokens=aligned.num_source_tokens,
    )


def pair_text(text: str, source_tokenizer, target_tokenizer) -> PairedText:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("text is empty: there is nothing to project")
    src = tokenize(source_tokenizer, text, add_special_tokens=True)
    tgt = tokenize(target_tokenizer, text, add_special_tokens=False)
    alignment = with_start_token(align_tokens(src, tgt))
    start = start_token_id(target_tokenizer)
    return PairedText(text=text, source_ids=src.ids, target_ids=torch.cat((torch.tensor([start]), tgt.ids)),
                      alignment=alignment, target_offsets=torch.cat((torch.zeros(1, 2, dtype=torch.int64),
                                                                     tgt.offsets)))


def pair_segment(text: str, source_tokenizer, target_tokenizer) -> PairedText:
    """A segment entry's text (a piece of a text, at its positions there) as both models cut it: no special tokens,
    no start token, the target's tokens aligned to the segment's source tokens (what the server projects)."""
    src = tokenize(source_tokenizer, text, add_special_tokens=False)
    tgt = tokenize(target_tokenizer, text, add_special_tokens=False)
    return PairedText(text=text, source_ids=src.ids, target_ids=tgt.ids, alignment=align_tokens(src, tgt),
                      target_offsets=tgt.offsets)


def flatten_heads(x: torch.Tensor) -> torch.Tensor:
    # x: [L, H, T, D] -> [L, T, H*D]
    return x.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], x.shape[1] * x.shape[3])


@torch.no_grad()
def kv_pairs(source: LoadedModel, target: LoadedModel, paired: PairedText
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Aligned, un-rotated KV of both models for the target tokens that source text covers.

    Returns xk, xv: [L_s, n, d_s] (source, gathered to target tokens) and yk, yv: [L_t, n, d_t] (target), float32.
    """
    s_seg = kvcache.extract(source.model, source.spec, paired.source_ids)
    t_seg = kvcache.extract(target.model, target.spec, paired.target_ids)
    s_keys = source.rope.unrotate_all(s_seg.keys.float(), s_seg.positions)
    t_keys = target.rope.unrotate_all(t_seg.keys.float(), t_seg.positions)
    kind = paired.alignment.kind
    use = ((kind == AlignKind.EXACT) | (kind == AlignKind.FALLBACK)).nonzero()[:, 0]
    src_index = paired.alignment.source_index[use].to(s_keys.device)
    use = use.to(t_keys.device)
    xk = flatten_heads(s_keys)[:, src_index]
    xv = flatten_heads(s_seg.values.float())[:, src_index]
    yk = flatten_heads(t_keys)[:, use]
    yv = flatten_heads(t_seg.values.float())[:, use]
    return xk, xv, yk, yv


@torch.no_grad()
def start_kv(target: LoadedModel, start: int) -> torch.Tensor:
    """The target's own KV of its start token at position 0, keys un-rotated: [L_t, 2, H_t, D_t]."""
    seg = kvcache.extract(target.model, target.spec, torch.tensor([start]))
    keys = target.rope.unrotate_all(seg.keys.float(), seg.positions)  # [L_t, H_t, 1, D_t]
    return torch.stack((keys[:, :, 0], seg.values[:, :, 0].float()), dim=1)
