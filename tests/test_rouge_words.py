"""ROUGE's words (answering.WordTokenizer): ASCII text is cut exactly as rouge-score's own tokenizer cuts it
(underscores split words, case folded, stems only words longer than 3), and non-ASCII words are not Porter-stemmed."""

from __future__ import annotations

import pytest
from kvbridge.adapters.answering import ROUGE_TYPES, WordTokenizer, rouge
from rouge_score import tokenizers

ASCII = ["The os_path module WAS used; it HAS a get_file_name() and was_run flags.",
         "Runs __init__ of the Class: its ARGS are *args and **kwargs (dogs, cats, was).",
         "snake_case_names and CamelCaseNames 3.14 x86_64"]


@pytest.mark.parametrize("text", ASCII)
def test_ascii_text_is_cut_as_rouge_scores_tokenizer_cuts_it(text):
    assert WordTokenizer().tokenize(text) == tokenizers.DefaultTokenizer(use_stemmer=True).tokenize(text)


def test_case_does_not_change_the_score():
    assert rouge("The Cat sat", "the cat SAT") == dict.fromkeys(ROUGE_TYPES, 1.0)


def test_non_ascii_words_are_not_porter_stemmed():
    """The Porter stemmer takes 'cafés' to 'café' and 'naïves' to 'naïv'."""
    assert WordTokenizer().tokenize("cafés naïves") == ["cafés", "naïves"]
