"""Length buckets: which rows run together, and that bucketed passes give the unbucketed outputs and gradients."""

import pytest
import torch

from loomrl.models.attention import EAGER, SDPA, use_attention
from loomrl.models.heads import model_outputs
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.role.length_buckets import bucketed_outputs, length_buckets


def test_equal_lengths_stay_one_group():
    groups = length_buckets(torch.full((32,), 20))
    assert len(groups) == 1 and groups[0].tolist() == list(range(32))


def test_a_long_tail_is_cut_into_groups_of_similar_length():
    # 24 rows of 5 positions and 8 of 40: one group pads 32 x 40 = 1280 positions, two 24 x 5 + 8 x 40 = 440
    lengths = torch.tensor([40 if i % 4 == 0 else 5 for i in range(32)])
    groups = length_buckets(lengths)
    assert [sorted(set(lengths[g].tolist())) for g in groups] == [[5], [40]]
    assert sorted(torch.cat(groups).tolist()) == list(range(32))
    # three lengths, 16 rows each: three groups (16 x (4 + 30 + 60) = 1504 of 2880 positions, 2080 with two
    # groups charged 10% of 2880 each, against 2208 for two groups)
    lengths = torch.tensor([4, 30, 60] * 16)
    assert [sorted(set(lengths[g].tolist())) for g in length_buckets(lengths)] == [[4], [30], [60]]


def test_few_rows_or_a_small_saving_are_not_split():
    assert len(length_buckets(torch.tensor([5] * 7 + [40]))) == 1  # fewer than 2 x 8 rows
    assert len(length_buckets(torch.tensor([19] * 16 + [20] * 16))) == 1  # saves 16 of 640 positions


@pytest.mark.parametrize("attention", [EAGER, SDPA])
def test_bucketed_pass_gives_the_outputs_and_gradients_of_one_pass(attention):
    """Buckets under either attention kernel (sdpa is CUDA's) against one pass under eager."""
    torch.manual_seed(0)
    model = build_causal_lm("llama-1m", build_char_tokenizer(), seed=0).train()
    lengths = [30 if i % 4 == 0 else 6 + i % 3 for i in range(32)]
    ids_BL = torch.zeros(32, 30, dtype=torch.long)
    attn_BL = torch.zeros(32, 30, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids_BL[b, :n] = torch.randint(4, 48, (n,))
        attn_BL[b, :n] = 1
    assert len(length_buckets(attn_BL.sum(1))) > 1

    def run(split: bool):
        model.zero_grad()
        use_attention(model, attention if split else EAGER)
        out = bucketed_outputs(lambda i, a: model_outputs(model, i, a), ids_BL, attn_BL, split=split)
        (out.log_softmax(-1)[..., 5] * attn_BL).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    (one, one_grads), (split, split_grads) = run(False), run(True)
    real = attn_BL.bool()
    torch.testing.assert_close(split[real], one[real], rtol=1e-5, atol=1e-5)
    for name, grad in one_grads.items():
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-3, atol=1e-5 * float(grad.abs().max()))
