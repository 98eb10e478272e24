"""The output head a chunk of tokens at a time: log-probs, entropies and both their gradients equal those of the
logits computed whole, at any temperature and chunk size, in fp32 and bf16."""

import pytest
import torch

from loomrl.models import token_head
from loomrl.models.heads import target_logprobs_and_entropy
from loomrl.models.token_head import chunked_logprobs_and_entropy, fuses


def _inputs(dtype, n=37, h=16, v=50):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / 4).to(dtype).requires_grad_()
    return hidden, weight, torch.randint(0, v, (n,), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [5, 1024])
@pytest.mark.parametrize("through", ["both", "logp"])
def test_chunked_head_equals_whole_logits(monkeypatch, dtype, chunk, through):
    monkeypatch.setattr(token_head, "CHUNK_TOKENS", chunk)
    hidden, weight, target = _inputs(dtype)
    g = torch.Generator().manual_seed(1)
    w_logp, w_ent = torch.randn(len(target), generator=g), torch.randn(len(target), generator=g)

    def run(fused: bool):
        hidden.grad = weight.grad = None
        if fused:
            logp, ent = chunked_logprobs_and_entropy(hidden, weight, target, 0.7)
        else:
            logp, ent = target_logprobs_and_entropy(hidden @ weight.t(), target, 0.7)
        loss = (logp * w_logp).sum() + ((ent * w_ent).sum() if through == "both" else 0)
        loss.backward()
        return logp.detach(), ent.detach(), hidden.grad.float().clone(), weight.grad.float().clone()

    exact = dtype == torch.float32
    for got, want in zip(run(True), run(False)):
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=1e-5 if exact else 2e-2, atol=(1e-5 if exact else 2e-2) * scale)


def test_only_a_plain_unbiased_linear_head_is_fused():
    assert fuses(torch.nn.Linear(4, 8, bias=False))
    assert not fuses(torch.nn.Linear(4, 8))
    assert not fuses(torch.nn.Identity())


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_theirs():
    hidden, weight, target = _inputs(torch.float32)
    weight.requires_grad_(False)
    logp, _ = chunked_logprobs_and_entropy(hidden, weight, target)
    logp.sum().backward()
    want = torch.autograd.grad(target_logprobs_and_entropy(hidden @ weight.t(), target)[0].sum(), hidden)[0]
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, want, rtol=1e-5, atol=1e-6)
