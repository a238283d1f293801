"""The packaged models' reference check (`transfer.selfcheck.check_reference`): the internal checks pass on any
model; the recorded greedy tokens and top logits of a fixed prompt tell a wrong or wrongly converted one."""

from __future__ import annotations

import json

import pytest
import torch
from kvbridge.transfer.data import data_path
from kvbridge.transfer.models import PACKAGED, wrap_model
from kvbridge.transfer.selfcheck import REFERENCE_FILE, check_reference, run_selfcheck


def test_the_reference_names_each_packaged_model_and_how_it_was_made():
    record = json.loads(data_path(REFERENCE_FILE).read_text())
    assert set(record["models"]) == set(PACKAGED)
    assert record["command"] == "python -m kvbridge.transfer.selfcheck --record"
    for ref in record["models"].values():
        assert len(ref["greedy"]) == len(ref["top_ids"]) == len(ref["top_logits"]) == len(ref["margins"]) == 8


def test_other_models_have_no_reference(tiny_target):
    assert check_reference(tiny_target) is None
    assert all(r.check != "reference" for r in run_selfcheck(tiny_target))


def test_another_model_under_a_packaged_name_fails_by_name(tiny_target):
    impostor = wrap_model(tiny_target.model, tiny_target.tokenizer, "smollm2-135m-instruct-q4_1")
    result = check_reference(impostor)
    assert not result.passed and "smollm2-135m-instruct-q4_1: the tokenizer gives" in result.detail


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["gemma", "smollm2"])
def test_the_packaged_models_match_their_reference(fixture, request):
    result = check_reference(request.getfixturevalue(fixture))
    assert result.passed, result.line()


@pytest.mark.slow
def test_slightly_wrong_weights_fail_the_reference_and_only_it(smollm2):
    weight = smollm2.model.model.layers[3].mlp.down_proj.weight
    kept = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(1.05)  # 5% on one matrix of 30 layers
        result = check_reference(smollm2)
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    assert not result.passed
    assert "smollm2-135m-instruct-q4_1 is not the packaged model" in result.line()
