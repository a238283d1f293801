"""blend's token choice when the count leaves room for fewer sinks than configured (a mutation of it got past the
suite)."""
import pytest
import torch
from kvbridge.transfer.suffix.blend import BlendConfig, select_tokens


@pytest.mark.parametrize("rule", ["sinks+deviation", "attention"])
def test_select_tokens_takes_count_tokens_when_the_sinks_do_not_all_fit(rule):
    """kills blend_sinks_overflow (every sink taken even when fewer than `sinks` fit after the tail/window)."""
    score = torch.arange(20, dtype=torch.float32)
    config = BlendConfig(fraction=0.25, rule=rule, sinks=4, tail=3, window=3)
    chosen = select_tokens(score, 5, config)
    assert chosen.tolist() == [0, 1, 17, 18, 19]  # the 3 last, then as many sinks as room is left for
