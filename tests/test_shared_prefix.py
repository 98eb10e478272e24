"""Shared prompts: which rows share, and that running each prompt once gives the outputs and gradients of whole
rows, for a policy and a value model, through the engine too."""

import pytest
import torch

from loomrl.models.attention import EAGER, SDPA, use_attention
from loomrl.models.heads import (
    LOGP,
    applies_head_alone,
    logprobs_from_logits,
    model_outputs,
    outputs_at_responses,
    response_outputs,
)
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm, build_value_model
from loomrl.role.passes import ModelPasses
from loomrl.role.shared_prefix import prompt_groups, shared_prefix_outputs
from loomrl.workflow.batch import pack_sequences, response_columns, response_width


def _grpo_rows(prompts: int = 4, group: int = 4, seed: int = 0):
    """``prompts`` prompts of 3-8 tokens, each with ``group`` responses of 1-11 tokens, packed."""
    g = torch.Generator().manual_seed(seed)
    prompt_rows, responses = [], []
    for _ in range(prompts):
        prompt = torch.randint(4, 48, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(group):
            prompt_rows.append(prompt)
            length = int(torch.randint(1, 12, (1,), generator=g))
            responses.append(torch.randint(4, 48, (length,), generator=g).tolist())
    return pack_sequences(prompt_rows, responses, 0, "cpu")


def test_rows_of_one_prompt_share_it():
    ids_BL, _, plen_B = _grpo_rows(prompts=3, group=4)
    firsts, index_B = prompt_groups(ids_BL, plen_B)
    assert firsts == [0, 4, 8] and index_B == [0] * 4 + [1] * 4 + [2] * 4


def test_distinct_prompts_or_a_small_saving_do_not_share():
    ids_BL, _, plen_B = _grpo_rows(prompts=8, group=1)
    assert prompt_groups(ids_BL, plen_B) is None
    # two rows of a 2-token prompt and 40-token responses: 2 of 84 positions saved
    ids_BL, _, plen_B = pack_sequences([[5, 6], [5, 6]], [[7] * 40, [8] * 40], 0, "cpu")
    assert prompt_groups(ids_BL, plen_B) is None


@pytest.mark.parametrize("attention", [EAGER, SDPA])
@pytest.mark.parametrize("value_model", [False, True], ids=["policy", "value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shared_prompts_give_the_outputs_and_gradients_of_whole_rows(value_model, dtype, attention):
    """With either attention kernel (sdpa is CUDA's, checked here on CPU), against whole rows under eager."""
    tok = build_char_tokenizer()
    build = build_value_model if value_model else build_causal_lm
    model = build("llama-1m", tok, seed=0).to(dtype).train()
    ids_BL, attn_BL, plen_B = _grpo_rows()
    groups = prompt_groups(ids_BL, plen_B)
    assert groups is not None

    width = response_width(attn_BL, plen_B)
    real = torch.arange(width)[None, :] < (attn_BL.sum(1) - plen_B)[:, None]  # the columns a loss reads

    def run(shared: bool):
        model.zero_grad()
        use_attention(model, attention if shared else EAGER)
        out = (
            shared_prefix_outputs(model, ids_BL, attn_BL, plen_B, groups, width, 0.7)
            if shared
            else outputs_at_responses(model_outputs(model, ids_BL, attn_BL), ids_BL, plen_B, width, 0.7)
        )
        mask = real if out.dim() == 2 else real[..., None].expand_as(out)
        (out.float()[mask] * torch.linspace(-1, 1, int(mask.sum()))).sum().backward()
        return out.detach().float(), mask, {n: p.grad.float().clone() for n, p in model.named_parameters()}

    (whole, mask, whole_grads), (shared, _, shared_grads) = run(False), run(True)
    assert shared.shape == whole.shape
    exact = dtype == torch.float32
    torch.testing.assert_close(shared[mask], whole[mask], rtol=1e-5 if exact else 0, atol=1e-5 if exact else 1e-2)
    for name, grad in whole_grads.items():  # bf16: a sum over rows in another order rounds differently
        scale = float(grad.abs().max())
        torch.testing.assert_close(
            shared_grads[name], grad, rtol=1e-3 if exact else 5e-2, atol=(1e-5 if exact else 2e-2) * scale
        )


@pytest.mark.parametrize("value_model", [False, True], ids=["policy", "value"])
def test_the_head_on_the_response_tokens_alone_gives_what_a_whole_forward_gives_there(value_model):
    build = build_value_model if value_model else build_causal_lm
    model = build("llama-1m", build_char_tokenizer(), seed=0)
    ids_BL, attn_BL, plen_B = _grpo_rows()
    width = response_width(attn_BL, plen_B)
    real = torch.arange(width)[None, :] < (attn_BL.sum(1) - plen_B)[:, None]
    logits_or_values = model_outputs(model, ids_BL, attn_BL)
    want = outputs_at_responses(logits_or_values, ids_BL, plen_B, width, 0.7)
    got = response_outputs(model, ids_BL, attn_BL, plen_B, width, 0.7)
    assert got.shape == want.shape == ((len(ids_BL), width) if value_model else (len(ids_BL), width, 2))
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    if not value_model:  # a log-prob read off the logits of the response token's position
        logp_BL1 = logprobs_from_logits(logits_or_values, ids_BL, 0.7)
        torch.testing.assert_close(got[..., LOGP][real], response_columns(logp_BL1, plen_B, width)[real])
        assert (got[~real] == 0).all()


def test_a_model_whose_outputs_are_more_than_its_head_runs_whole():
    model = build_causal_lm("llama-1m", build_char_tokenizer(), seed=0)
    assert applies_head_alone(model)
    model.config.final_logit_softcapping = 30.0  # Gemma-2's cap on the logits, applied after the head
    assert not applies_head_alone(model)


def test_engine_shares_prompts_where_it_knows_them_and_recomputation_turns_it_off(monkeypatch):
    model = build_causal_lm("llama-1m", build_char_tokenizer(), seed=0).train()
    ids_BL, attn_BL, plen_B = _grpo_rows()
    engine = ModelPasses(model)
    calls = []
    import loomrl.role.passes as model_engine

    real_shared = model_engine.shared_prefix_outputs
    monkeypatch.setattr(model_engine, "shared_prefix_outputs", lambda *a: calls.append(1) or real_shared(*a))
    parts = [slice(0, 16)]
    whole = engine.outputs(ids_BL, attn_BL, parts)
    assert not calls
    shared = engine.outputs(ids_BL, attn_BL, parts, prompt_len_B=plen_B)
    assert calls
    width = response_width(attn_BL, plen_B)
    real = torch.arange(width)[None, :] < (attn_BL.sum(1) - plen_B)[:, None]
    want = outputs_at_responses(whole, ids_BL, plen_B, width)
    torch.testing.assert_close(shared[real], want[real], rtol=1e-5, atol=1e-5)
    calls.clear()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine.backward(ids_BL, attn_BL, parts, lambda out, k: out.float().mean(), 1, prompt_len_B=plen_B)
    assert not calls
