"""Cross-tokenizer alignment: map each target token to the source token that covers its last character.

Two tokenizers cut the same text differently. The source model's KV at source token j has read the text up to the
end of token j, so the target token whose last character is c takes the KV of the last source token whose span
contains c (EXACT). Where no source token contains c (a normalizer dropped it, or offsets leave a space out) the
target token takes the nearest source token that ends at or before c (FALLBACK); it never takes a source token
that starts after c, so no target token is given KV that has read text beyond its own last character (no
look-ahead). Structural special tokens (BOS/EOS/...) are matched by role (SPECIAL). What cannot be mapped is
UNMAPPED (-1).

Offsets are character offsets into the original text as fast (`tokenizers`-backed) tokenizers report them;
slow tokenizers have none and are refused.
"""

import enum
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase


class AlignKind(enum.IntEnum):
    """How a target token was mapped; stored as int8 in `Alignment.kind`."""

    EXACT = 0  # the source token's span contains the target token's last character
    FALLBACK = 1  # nearest preceding source token (no source token contains that character), or a leading BOS
    SPECIAL = 2  # a structural special token matched to the source special token with the same role
    UNMAPPED = 3  # nothing to map to: source_index is -1


# Role of a special token id, checked in this order; the first and last positions break bos/eos ties.
SPECIAL_ROLES = ("bos", "eos", "sep", "cls", "pad", "unk")
OTHER_SPECIAL = "other_special"


@dataclass(frozen=True, slots=True)
class TokenizedText:
    """One text as one tokenizer cut it.

    Invariants: ``0 <= start <= end`` for every offset; ``roles[i] is None`` exactly when ``special[i]`` is False.
    ``special`` marks structural tokens that stand for no characters of the text: those the tokenizer's template
    inserted (BOS, EOS, SEP, ...) and special ids with an empty span. A special token written literally in the text
    (e.g. the characters "<|endoftext|>" parsed as that token) covers characters and counts as text here.
    """

    ids: torch.Tensor  # [T] int64 token ids
    offsets: torch.Tensor  # [T, 2] int64 character offsets (start, end) into the original text
    special: torch.Tensor  # [T] bool, True for structural special tokens
    roles: tuple[str | None, ...]  # [T] "bos"/"eos"/"sep"/"cls"/"pad"/"unk"/"other_special"; None for text

    def __post_init__(self):
        num_tokens = self.ids.shape[0] if self.ids.dim() == 1 else -1
        if self.ids.dim() != 1 or self.ids.dtype != torch.int64:
            raise ValueError(f"ids must be a 1-d int64 tensor, got shape {tuple(self.ids.shape)} {self.ids.dtype}")
        if self.offsets.shape != (num_tokens, 2) or self.offsets.dtype != torch.int64:
            raise ValueError(
                f"offsets must be an int64 tensor of shape ({num_tokens}, 2), "
                f"got {tuple(self.offsets.shape)} {self.offsets.dtype}"
            )
        if self.special.shape != (num_tokens,) or self.special.dtype != torch.bool:
            raise ValueError(
                f"special must be a bool tensor of shape ({num_tokens},), "
                f"got {tuple(self.special.shape)} {self.special.dtype}"
            )
        if len(self.roles) != num_tokens:
            raise ValueError(f"roles has {len(self.roles)} entries for {num_tokens} tokens")
        if num_tokens and not bool(((self.offsets[:, 0] >= 0) & (self.offsets[:, 0] <= self.offsets[:, 1])).all()):
            raise ValueError("offsets must satisfy 0 <= start <= end for every token")
        has_role = [role is not None for role in self.roles]
        if has_role != self.special.tolist():
            raise ValueError("roles must be set exactly for the special tokens")

    def __len__(self) -> int:
        return self.ids.shape[0]


def tokenize(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True) -> TokenizedText:
    """Tokenize one text with a fast tokenizer, keeping character offsets, structural specials and their roles."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"{type(tokenizer).__name__} is a slow tokenizer and reports no character offsets; alignment needs a "
            "fast (tokenizers-backed) tokenizer, e.g. AutoTokenizer.from_pretrained(path) without use_fast=False"
        )
    encoding = tokenizer(
        text,
        add_special_tokens=add_special_tokens,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
        return_attention_mask=False,
        return_token_type_ids=False,
        verbose=False,  # no "sequence longer than model_max_length" warning: alignment does not run the model
    )
    ids = torch.tensor(encoding["input_ids"], dtype=torch.int64).reshape(-1)  # [T]
    offsets = torch.tensor(encoding["offset_mapping"], dtype=torch.int64).reshape(-1, 2)  # [T, 2]
    inserted = torch.tensor(encoding["special_tokens_mask"], dtype=torch.bool).reshape(-1)  # [T]
    special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.int64)
    empty_special = torch.isin(ids, special_ids) & (offsets[:, 0] == offsets[:, 1])
    special = inserted | empty_special  # [T]

    num_tokens = ids.shape[0]
    roles: list[str | None] = [None] * num_tokens
    for i in special.nonzero().flatten().tolist():
        roles[i] = _special_role(tokenizer, int(ids[i]), is_first=i == 0, is_last=i == num_tokens - 1)
    return TokenizedText(ids=ids, offsets=offsets, special=special, roles=tuple(roles))


def _special_role(tokenizer: PreTrainedTokenizerBase, token_id: int, is_first: bool, is_last: bool) -> str:
    roles = [role for role in SPECIAL_ROLES if getattr(tokenizer, f"{role}_token_id", None) == token_id]
    if not roles:
        return OTHER_SPECIAL
    # One id can play several roles (GPT-2: bos == eos; Qwen2: eos == pad == unk): position decides bos vs eos.
    if "bos" in roles and "eos" in roles:
        return "eos" if is_last and not is_first else "bos"
    return roles[0]


@dataclass(frozen=True, slots=True)
class Alignment:
    """For each target token, the source token whose KV it takes.

    Invariants: ``-1 <= source_index < num_source_tokens``; ``source_index == -1`` exactly where ``kind`` is
    UNMAPPED; an EXACT source token's span contains the target token's last character; a FALLBACK source token
    ends at or before that character (or is a leading source special such as BOS); a SPECIAL source token is a
    structural special with the same role as the target token.
    """

    source_index: torch.Tensor  # [T_t] int64 index into the source tokens, -1 = unmapped
    kind: torch.Tensor  # [T_t] int8 AlignKind values
    target_special: torch.Tensor  # [T_t] bool, the target's structural special tokens (TokenizedText.special)
    num_source_tokens: int  # T_s, so that indices can be checked and coverage reported without the source

    def __post_init__(self):
        num_target = self.source_index.shape[0]
        if self.source_index.dim() != 1 or self.source_index.dtype != torch.int64:
            raise ValueError(f"source_index must be a 1-d int64 tensor, got {tuple(self.source_index.shape)}")
        if self.kind.shape != (num_target,) or self.kind.dtype != torch.int8:
            raise ValueError(f"kind must be an int8 tensor of shape ({num_target},), got {tuple(self.kind.shape)}")
        if self.target_special.shape != (num_target,) or self.target_special.dtype != torch.bool:
            raise ValueError(f"target_special must be a bool tensor of shape ({num_target},)")

    @property
    def num_target_tokens(self) -> int:
        return self.source_index.shape[0]

    @property
    def counts(self) -> dict[str, int]:
        """Number of target tokens of each kind, by kind name (EXACT, FALLBACK, SPECIAL, UNMAPPED)."""
        per_kind = torch.bincount(self.kind.to(torch.int64), minlength=len(AlignKind)).tolist()
        return {kind.name: per_kind[kind] for kind in AlignKind}

    @property
    def fractions(self) -> dict[str, float]:
        """Share of the target tokens of each kind; all 0.0 when there are no target tokens."""
        total = self.num_target_tokens
        return {name: (count / total if total else 0.0) for name, count in self.counts.items()}

    @property
    def exact_coverage(self) -> float:
        """Share of the target's text tokens (not structural specials) mapped EXACT; 1.0 when there are none."""
        text = ~self.target_special
        num_text = int(text.sum())
        if num_text == 0:
            return 1.0
        return int((self.kind[text] == AlignKind.EXACT).sum()) / num_text

    def summary(self) -> str:
        parts = ", ".join(
            f"{name} {count} ({fraction:.1%})"
            for (name, count), fraction in zip(self.counts.items(), self.fractions.values(), strict=True)
        )
        return (
            f"{self.num_target_tokens} target tokens -> {self.num_source_tokens} source tokens: {parts}; "
            f"exact coverage of text tokens {self.exact_coverage:.1%}"
        )

    def __str__(self) -> str:
        return self.summary()


def align_tokens(source: TokenizedText, target: TokenizedText) -> Alignment:
    """Map every target token to a source token of the same text (see the module docstring for the rules).

    Text tokens (not `special`) with a non-empty span use their last character c = end - 1:
      EXACT     a source token whose span contains c: the latest one ending at or before the target token's end
                if that one contains c (it has read no further than the target token), else the last one (in
                sequence order) — with byte-level pieces of one character spread over several tokens, the last
                one is the one that has read the whole character.
                A target token that is itself an earlier piece of a split character (the k tokens after it also
                end on c) steps back k source tokens among those that contain c, as far as there are such
                tokens: pieces are matched from the right, so identical tokenizations map to the identity;
      FALLBACK  otherwise the source token with the largest end <= c (the latest of those if several), or,
                when there is none, the last of the source's leading special tokens (e.g. BOS);
      UNMAPPED  otherwise.
    Text tokens with an empty span use the same FALLBACK rule at their start position.
    Target special tokens take the source special token with the same role (the first one for "bos", the last one
    for every other role) as SPECIAL; failing that, the character rule if they have a span, else UNMAPPED.
    Source specials never serve as EXACT or ordinary FALLBACK candidates.

    Runs in O(T_s + T_t + N) tensor operations, N the text length in characters, plus Python loops over the
    specials and over the longest run of target pieces ending on one character (at most a handful).
    """
    # source.offsets: [T_s, 2], target.offsets: [T_t, 2]
    device = target.offsets.device
    num_source, num_target = len(source), len(target)
    source_offsets = source.offsets.to(device)
    source_start, source_end = source_offsets[:, 0], source_offsets[:, 1]  # [T_s]
    target_start, target_end = target.offsets[:, 0], target.offsets[:, 1]  # [T_t]
    num_chars = max(int(source_end.max()) if num_source else 0, int(target_end.max()) if num_target else 0)

    source_text = ~source.special.to(device)  # [T_s]
    covering = _last_covering_token(source_start, source_end, source_text, num_chars)  # [N + 1]
    preceding = _last_token_ending_by(source_end, source_text, num_chars)  # [N + 1]
    leading_special = _last_leading_special(source.special)

    # Character rule for every target token; specials are overwritten below.
    has_span = target_end > target_start  # [T_t]
    query = torch.where(has_span, target_end - 1, target_start)  # [T_t] last character, or the start position
    exact = torch.where(has_span, covering[query], -1)  # [T_t]
    # Among the source tokens containing c, prefer one that has read no further than the target token: the latest
    # ending at or before the target's end (it matters where spans overlap, e.g. a prepended "▁" with span (0, 1)
    # next to "re" (0, 2): identical tokenizations must map to the identity).
    if num_source:
        no_further = preceding[target_end.clamp(max=num_chars)]  # [T_t]
        nf = no_further.clamp(min=0)
        contains = has_span & (no_further >= 0) & (source_start[nf] <= query) & (query < source_end[nf])
        exact = torch.where(contains, no_further, exact)
    exact = _match_pieces_from_right(exact, query, _pieces_after(target.offsets, has_span), source_offsets, source_text)
    before = preceding[query]  # [T_t]
    before = torch.where(before >= 0, before, leading_special)
    source_index = torch.where(exact >= 0, exact, before)
    kind = torch.where(
        exact >= 0,
        int(AlignKind.EXACT),
        torch.where(before >= 0, int(AlignKind.FALLBACK), int(AlignKind.UNMAPPED)),
    ).to(torch.int8)

    target_special = target.special.to(device)
    special_positions = target_special.nonzero().flatten().tolist()
    if special_positions:
        source_by_role = _source_specials_by_role(source)
        for i in special_positions:
            matches = source_by_role.get(target.roles[i], [])
            if matches:
                source_index[i] = matches[0] if target.roles[i] == "bos" else matches[-1]
                kind[i] = AlignKind.SPECIAL
            elif not has_span[i]:
                source_index[i] = -1
                kind[i] = AlignKind.UNMAPPED
    return Alignment(source_index=source_index, kind=kind, target_special=target_special, num_source_tokens=num_source)


def align_text(
    text: str,
    source_tokenizer: PreTrainedTokenizerBase,
    target_tokenizer: PreTrainedTokenizerBase,
    add_special_tokens: bool = True,
) -> tuple[TokenizedText, TokenizedText, Alignment]:
    """Tokenize `text` with both tokenizers and align target tokens to source tokens."""
    source = tokenize(source_tokenizer, text, add_special_tokens=add_special_tokens)
    target = tokenize(target_tokenizer, text, add_special_tokens=add_special_tokens)
    return source, target, align_tokens(source, target)


def _last_covering_token(
    start: torch.Tensor, end: torch.Tensor, candidate: torch.Tensor, num_chars: int
) -> torch.Tensor:
    """For each character c in [0, num_chars], the largest candidate index whose span contains c, else -1.

    Slot num_chars is past the text and always -1, so an empty-spanned query at the end indexes safely.
    """
    # start, end, candidate: [T] -> [N + 1]
    index = (candidate & (end > start)).nonzero().flatten()  # [K]
    lengths = (end - start)[index]  # [K]
    token_of_char = index.repeat_interleave(lengths)  # [sum(lengths)]
    group_start = (torch.cumsum(lengths, 0) - lengths).repeat_interleave(lengths)
    char = start[index].repeat_interleave(lengths) + torch.arange(token_of_char.shape[0], device=start.device)
    char -= group_start
    covering = torch.full((num_chars + 1,), -1, dtype=torch.int64, device=start.device)
    return covering.scatter_reduce_(0, char, token_of_char, reduce="amax")


def _last_token_ending_by(end: torch.Tensor, candidate: torch.Tensor, num_chars: int) -> torch.Tensor:
    """For each position p in [0, num_chars], the candidate with the largest end <= p (largest index on ties)."""
    # end, candidate: [T] -> [N + 1]
    index = candidate.nonzero().flatten()  # [K]
    last_at = torch.full((num_chars + 1,), -1, dtype=torch.int64, device=end.device)
    last_at.scatter_reduce_(0, end[index], index, reduce="amax")  # [N + 1] last token ending exactly at p
    positions = torch.arange(num_chars + 1, device=end.device)
    latest_end = torch.cummax(torch.where(last_at >= 0, positions, -1), dim=0).values  # [N + 1]
    return torch.where(latest_end >= 0, last_at[latest_end.clamp(min=0)], -1)


def _pieces_after(offsets: torch.Tensor, has_span: torch.Tensor) -> torch.Tensor:
    """For each token, how many directly following tokens end on its last character too (0 for the last piece).

    Those are the later pieces of a character split over several tokens: byte-level BPE gives "Ġæ" (0, 2),
    "ĸ" (1, 2), "Ģ" (1, 2) for " 斀", and the first of them has 2 pieces after it.
    """
    # offsets: [T, 2], has_span: [T] -> [T]
    num_tokens = offsets.shape[0]
    positions = torch.arange(num_tokens, device=offsets.device)
    same_as_next = torch.zeros(num_tokens, dtype=torch.bool, device=offsets.device)
    if num_tokens > 1:
        same_as_next[:-1] = (offsets[:-1, 1] == offsets[1:, 1]) & has_span[:-1] & has_span[1:]
    last_of_run = torch.where(same_as_next, num_tokens, positions)  # [T]
    run_end = torch.flip(torch.cummin(torch.flip(last_of_run, (0,)), dim=0).values, (0,))  # [T]
    return run_end - positions


def _match_pieces_from_right(
    exact: torch.Tensor,
    char: torch.Tensor,
    pieces_after: torch.Tensor,
    source_offsets: torch.Tensor,
    source_text: torch.Tensor,
) -> torch.Tensor:
    """Step each EXACT match back by its target token's `pieces_after`, over source text tokens containing `char`."""
    # exact, char, pieces_after: [T_t]; source_offsets: [T_s, 2]; source_text: [T_s] -> [T_t]
    steps = torch.where(exact >= 0, pieces_after, 0)
    while bool((steps > 0).any()):
        previous = (exact - 1).clamp(min=0)
        can_step = (
            (steps > 0)
            & (exact > 0)
            & source_text[previous]
            & (source_offsets[previous, 0] <= char)
            & (char < source_offsets[previous, 1])
        )
        if not bool(can_step.any()):
            break
        exact = torch.where(can_step, previous, exact)
        steps = torch.where(can_step, steps - 1, 0)
    return exact


def _last_leading_special(special: torch.Tensor) -> int:
    """Index of the last special token in the run that opens the sequence (e.g. BOS), else -1."""
    # special: [T]
    text_positions = (~special).nonzero().flatten()
    first_text = int(text_positions[0]) if text_positions.numel() else special.shape[0]
    return first_text - 1


def _source_specials_by_role(source: TokenizedText) -> dict[str, list[int]]:
    by_role: dict[str, list[int]] = {}
    for j in source.special.nonzero().flatten().tolist():
        by_role.setdefault(source.roles[j], []).append(j)
    return by_role


def start_token_id(tokenizer) -> int:
    """The token a model's context starts with: its BOS, else its EOS (which causal LMs are trained to read as a
    boundary). Every condition that compares contexts (own prefill, projected, none) starts with it."""
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    raise ValueError(f"{type(tokenizer).__name__} has neither a BOS nor an EOS token to start a context with")
