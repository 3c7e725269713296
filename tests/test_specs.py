"""The shared FLOP formulas count exactly the pairs the masks of docs/CONTRACTS.md leave visible."""
import pytest
import torch

from jfa import reference, specs


@pytest.mark.parametrize("lq, lk, causal, window", [(5, 9, True, None), (9, 5, True, None), (7, 7, True, 2),
                                                    (6, 11, False, 3), (4, 4, False, None), (3, 0, True, None)])
def test_attention_pairs_match_the_reference_masks(lq, lk, causal, window):
    # A row's LSE with all-zero scores is log(#visible keys): the reference's mask, counted.
    q = torch.zeros(lq, 1, 64, dtype=torch.float64)
    kv = torch.zeros(lk, 1, 64, dtype=torch.float64)
    offsets_q, offsets_kv = torch.tensor([0, lq]), torch.tensor([0, lk])
    _, lse = reference.jagged_attention_ref(q, kv, kv, offsets_q, offsets_kv, causal=causal, window=window)
    visible = lse.exp().round().sum().item()
    assert specs.attention_pairs([lq], [lk], causal=causal, window=window) == visible


def test_flops_passes():
    fwd = specs.attention_flops([128, 64], [256, 32], heads=4, head_dim=128)
    assert fwd == 4 * 4 * 128 * (128 * 256 + 64 * 32)
    assert specs.attention_flops([128], [128], 4, 128, pass_="bwd") == 2.5 * specs.attention_flops([128], [128], 4, 128)
    assert specs.attention_flops([128], [128], 4, 128, pass_="fwd+bwd") == 3.5 * specs.attention_flops([128], [128], 4, 128)
