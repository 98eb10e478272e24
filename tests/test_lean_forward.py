"""The rollout engine's lean forward: which models take it, and that it computes their own forward's logits."""

import pytest
import torch

from loomrl.models.attention import EAGER, SDPA, use_attention
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.rollout import SamplingParams, stream_keys
from loomrl.rollout.engine import Request, RolloutEngine
from loomrl.rollout.kv_cache import SlotKVCache, causal_slot_mask
from loomrl.rollout.lean_forward import lean_logits, supports_lean_forward


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.mark.parametrize("attention", [EAGER, SDPA])
@pytest.mark.parametrize("arch", ["llama-1m", "qwen2-1m"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lean_logits_equal_the_models_forward_with_a_slot_cache(arch, dtype, attention, tok):
    """The lean forward with either attention kernel (sdpa is CUDA's, its logic checked here on CPU) against the
    model's own forward under eager attention."""
    model = build_causal_lm(arch, tok, seed=0).to(dtype).eval()
    assert supports_lean_forward(model)
    g = torch.Generator().manual_seed(0)
    ids_BQ = torch.randint(4, 48, (6, 9), generator=g)
    pos_BQ = torch.arange(9).expand(6, 9)
    rows_B = torch.tensor([3, 0, 5, 1, 4, 2])  # slots out of order: the cache's gathered path
    mask = causal_slot_mask(pos_BQ, 9, model.dtype)

    def run(lean: bool) -> torch.Tensor:
        use_attention(model, attention if lean else EAGER)
        cache = SlotKVCache(8, 16)
        cache.bind(rows_B.tolist(), pos_BQ, 9)
        if lean:
            prefill = lean_logits(model, ids_BQ, pos_BQ, mask, cache)
        else:
            with torch.no_grad():
                prefill = model(
                    input_ids=ids_BQ, attention_mask=mask, position_ids=pos_BQ, past_key_values=cache, use_cache=True
                ).logits
        # then one decode step over the cache the prefill filled
        step_ids, step_pos = ids_BQ[:, :1] + 1, torch.full((6, 1), 9)
        cache.bind(rows_B.tolist(), step_pos, 10)
        step_mask = causal_slot_mask(step_pos, 10, model.dtype)
        if lean:
            return torch.cat([prefill, lean_logits(model, step_ids, step_pos, step_mask, cache)], dim=1)
        with torch.no_grad():
            step = model(
                input_ids=step_ids,
                attention_mask=step_mask,
                position_ids=step_pos,
                past_key_values=cache,
                use_cache=True,
            ).logits
        return torch.cat([prefill, step], dim=1)

    lean, own = run(True).float(), run(False).float()
    exact = dtype == torch.float32
    torch.testing.assert_close(lean, own, rtol=1e-5 if exact else 2e-2, atol=1e-5 if exact else 2e-2)


def test_lean_logits_at_one_position_per_row_equal_those_rows_of_every_positions(tok):
    model = build_causal_lm("llama-1m", tok, seed=0).eval()
    ids_BQ = torch.randint(4, 48, (5, 7), generator=torch.Generator().manual_seed(1))
    pos_BQ = torch.arange(7).expand(5, 7)
    mask = causal_slot_mask(pos_BQ, 7, model.dtype)
    last_B = torch.tensor([6, 0, 3, 6, 2])

    def logits(last):
        cache = SlotKVCache(5, 8)
        cache.bind(range(5), pos_BQ, 7)
        return lean_logits(model, ids_BQ, pos_BQ, mask, cache, last)

    every_BQV, chosen_BV = logits(None), logits(last_B)
    assert chosen_BV.shape == (5, every_BQV.shape[-1])
    torch.testing.assert_close(chosen_BV, every_BQV[torch.arange(5), last_B], rtol=1e-6, atol=1e-6)


def test_other_models_run_their_own_forward(tok):
    assert not supports_lean_forward(build_causal_lm("gpt2-1m", tok, seed=0))
    hooked = build_causal_lm("llama-1m", tok, seed=0)
    hooked.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert not supports_lean_forward(hooked)


def test_engine_samples_the_same_tokens_either_way(tok):
    model = build_causal_lm("llama-1m", tok, seed=0).eval()
    prompts = [[1, *tok.encode(t)] for t in ("12+3=", "sort 4 1 3=", "ab", "99")]
    keys = stream_keys(3, 0, range(len(prompts))).tolist()
    params = SamplingParams(max_new_tokens=12, temperature=1.0)

    def run(lean: bool):
        engine = RolloutEngine(model, params, eos_id=tok.eos_token_id, pad_id=0, slots=4)
        engine.lean = lean
        return engine.generate([Request(i, p, k) for i, (p, k) in enumerate(zip(prompts, keys))])

    for a, b in zip(run(True), run(False)):
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.tensor(a.logps), torch.tensor(b.logps), atol=1e-5, rtol=0)


def test_models_compute_attention_with_their_devices_kernel(tok):
    from loomrl.models.attention import attention_for, uses_sdpa
    from loomrl.role.build import build_model
    from loomrl.role.spec import RoleSpec

    assert attention_for(torch.device("cuda")) == SDPA and attention_for(torch.device("cpu")) == EAGER
    spec = RoleSpec("actor", "llama-1m", "actor.model")
    model = build_model(spec, tok, torch.device("cpu"), torch.float32)
    assert not uses_sdpa(model)
    assert uses_sdpa(use_attention(model, SDPA)) and not uses_sdpa(use_attention(model, EAGER))
