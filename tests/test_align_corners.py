"""Alignment corner rules no other test pins down (a mutation of each got past the suite). Both tests call private
helpers of transfer/align.py directly (no tokenizer the suite packages reaches these cases)."""
from types import SimpleNamespace

import torch
from kvbridge.transfer import align


def test_an_id_that_is_bos_and_eos_alone_in_its_sequence_is_bos():
    """kills align_bos_eos_tie ("eos" whenever the token is last, even when it is first too)."""
    tok = SimpleNamespace(bos_token_id=5, eos_token_id=5, sep_token_id=None, cls_token_id=None, pad_token_id=None,
                          unk_token_id=None)
    assert align._special_role(tok, 5, is_first=True, is_last=True) == "bos"
    assert align._special_role(tok, 5, is_first=False, is_last=True) == "eos"
    assert align._special_role(tok, 5, is_first=True, is_last=False) == "bos"


def test_a_split_characters_pieces_never_step_back_onto_a_source_special_token():
    """kills align_pieces_step_onto_special (the step back ignores source_text)."""
    exact = torch.tensor([1])
    char = torch.tensor([0])
    pieces_after = torch.tensor([1])
    source_offsets = torch.tensor([[0, 2], [0, 2]])
    assert align._match_pieces_from_right(exact, char, pieces_after, source_offsets,
                                          torch.tensor([False, True])).tolist() == [1]
    assert align._match_pieces_from_right(exact, char, pieces_after, source_offsets,
                                          torch.tensor([True, True])).tolist() == [0]


def test_a_token_without_a_span_is_never_a_later_piece_of_the_character_before_it():
    """kills align_pieces_no_span_check (an empty-span token, an EOS at (3, 3), counted as a piece of the text token
    that ends at 3)."""
    offsets = torch.tensor([[0, 3], [3, 3]])
    assert align._pieces_after(offsets, torch.tensor([True, False])).tolist() == [0, 0]
    assert align._pieces_after(torch.tensor([[0, 2], [1, 2]]), torch.tensor([True, True])).tolist() == [1, 0]
