"""Tests of loomrl.models: the character tokenizer, the zoo, checkpoint loading and the per-token heads."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loomrl.errors import DataError
from loomrl.models.heads import score_head, sequence_scores, token_logprobs, token_logprobs_and_entropy, token_values
from loomrl.models.tokenizer import TASK_ALPHABET, build_char_tokenizer, load_tokenizer
from loomrl.models.zoo import MODEL_NAMES, build_causal_lm, build_value_model, count_parameters


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def lm(tok):
    return build_causal_lm("llama-1m", tok, seed=0)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory, tok, lm):
    path = tmp_path_factory.mktemp("llama1m")
    lm.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _padded_batch(tok, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids with bos/eos added explicitly, as the rollout code does."""
    rows = [[tok.bos_token_id, *tok.encode(t), tok.eos_token_id] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


# --- tokenizer -------------------------------------------------------------------------------------------


def test_tokenizer_layout(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 4 + len(TASK_ALPHABET)
    assert tok.convert_ids_to_tokens(4) == TASK_ALPHABET[0]
    # No automatic bos/eos: one id per character.
    assert tok.encode("sort 3142=1234") == [tok.convert_tokens_to_ids(c) for c in "sort 3142=1234"]
    assert tok.encode("?") == [tok.unk_token_id]


@pytest.mark.parametrize("text", ["sort 3142=1234", " a  b ", "add 12+345=357", "x:>,-|"])
def test_tokenizer_round_trip_after_save(tok, tmp_path, text):
    tok.save_pretrained(tmp_path)
    for loaded in (AutoTokenizer.from_pretrained(tmp_path, local_files_only=True), load_tokenizer(tmp_path)):
        ids = loaded.encode(text)
        assert ids == tok.encode(text)
        assert len(ids) == len(text)
        assert loaded.decode(ids) == text
        assert loaded.pad_token_id == 0 and loaded.eos_token_id == 2


def test_tokenizer_decode_skips_specials(tok):
    ids = [tok.bos_token_id, *tok.encode("ab c"), tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "ab c"


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError) as exc:
        build_char_tokenizer("abca")
    assert "abca" in _one_line(exc)
    with pytest.raises(DataError) as exc:
        load_tokenizer(tmp_path / "nope")
    assert "nope" in _one_line(exc)


# --- zoo -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("llama-1m", 0.8e6, 1.2e6),
        ("qwen2-1m", 0.8e6, 1.2e6),
        ("gpt2-1m", 0.7e6, 1.2e6),
        ("llama-10m", 8e6, 12e6),
        ("llama-30m", 25e6, 35e6),
    ],
)
def test_zoo_parameter_counts(tok, name, low, high):
    # The meta device builds the module tree without allocating or initialising weights.
    with torch.device("meta"):
        model = build_causal_lm(name, tok, seed=0)
    assert low <= count_parameters(model) <= high


@pytest.mark.parametrize("name", [n for n in MODEL_NAMES if n.endswith("-1m")])
def test_small_zoo_models_run(tok, name):
    model = build_causal_lm(name, tok, seed=0)
    assert model.config.vocab_size == len(tok)
    assert model.config.max_position_embeddings == 256
    assert model.config.pad_token_id == 0 and model.config.eos_token_id == 2
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    ids, mask = _padded_batch(tok, ["sort 312=123", "rev ab=ba"])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert logits.shape == (2, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_seeded_init_is_deterministic_and_leaves_global_rng(tok, lm):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    same = build_causal_lm("llama-1m", tok, seed=0)
    assert torch.equal(torch.rand(3), expected_next)
    for (name, a), b in zip(lm.state_dict().items(), same.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    other = build_causal_lm("llama-1m", tok, seed=1)
    assert not torch.equal(other.model.layers[0].self_attn.q_proj.weight, lm.model.layers[0].self_attn.q_proj.weight)


def test_dtype_argument(tok):
    model = build_causal_lm("llama-1m", tok, seed=0, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_checkpoint_round_trip(tok, lm, lm_dir):
    plain = AutoModelForCausalLM.from_pretrained(lm_dir, local_files_only=True)
    ours = build_causal_lm(str(lm_dir), tok, seed=99)  # the seed is irrelevant for a checkpoint
    ids, mask = _padded_batch(tok, ["add 1+2=3"])
    with torch.no_grad():
        ref = lm(input_ids=ids, attention_mask=mask).logits
        assert torch.allclose(plain(input_ids=ids, attention_mask=mask).logits, ref, atol=1e-6)
        assert torch.equal(ours(input_ids=ids, attention_mask=mask).logits, ref)


def test_bad_model_name_is_one_line(tok, tmp_path):
    for bad in ("llama-2m", str(tmp_path)):  # an empty directory is not a checkpoint either
        with pytest.raises(DataError) as exc:
            build_causal_lm(bad, tok, seed=0)
        msg = _one_line(exc)
        assert f"'{bad}'" in msg and "llama-1m" in msg and "gpt2-1m" in msg
    with pytest.raises(DataError) as exc:
        build_value_model("nope", tok, seed=0)
    assert "'nope'" in _one_line(exc)


def test_checkpoint_with_smaller_vocab_is_rejected(tok, tmp_path):
    small_tok = build_char_tokenizer("0123456789")
    build_causal_lm("llama-1m", small_tok, seed=0).save_pretrained(tmp_path)
    with pytest.raises(DataError) as exc:
        build_causal_lm(str(tmp_path), tok, seed=0)
    assert "vocab_size 14" in _one_line(exc)


# --- value models ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("llama-1m", "LlamaForSequenceClassification"),
        ("qwen2-1m", "Qwen2ForSequenceClassification"),
        ("gpt2-1m", "GPT2ForSequenceClassification"),
    ],
)
def test_value_model_from_zoo_has_zero_head(tok, name, cls):
    v = build_value_model(name, tok, seed=0)
    assert type(v).__name__ == cls
    assert v.config.num_labels == 1 and v.config.pad_token_id == tok.pad_token_id
    assert torch.count_nonzero(score_head(v).weight) == 0
    ids, mask = _padded_batch(tok, ["sort 21=12", "a=b"])
    with torch.no_grad():
        assert torch.equal(token_values(v, ids, mask), torch.zeros(ids.shape))


@pytest.mark.parametrize("via_init_from", [False, True])
def test_value_model_from_causal_lm_checkpoint(tok, lm, lm_dir, via_init_from):
    if via_init_from:
        v = build_value_model("llama-1m", tok, seed=0, init_from=str(lm_dir))
    else:
        v = build_value_model(str(lm_dir), tok, seed=0)
    lm_backbone = lm.model.state_dict()
    for name, w in v.model.state_dict().items():
        assert torch.equal(w, lm_backbone[name]), name
    assert torch.count_nonzero(score_head(v).weight) == 0


def test_value_model_from_gpt2_checkpoint(tok, tmp_path):
    g = build_causal_lm("gpt2-1m", tok, seed=0)
    g.save_pretrained(tmp_path)
    v = build_value_model(str(tmp_path), tok, seed=0)
    assert torch.equal(v.transformer.wte.weight, g.transformer.wte.weight)
    assert torch.count_nonzero(score_head(v).weight) == 0


def test_sequence_classification_checkpoint_keeps_its_head(tok, tmp_path):
    v = build_value_model("llama-1m", tok, seed=0)
    with torch.no_grad():
        score_head(v).weight.normal_()
    v.save_pretrained(tmp_path)
    again = build_value_model(str(tmp_path), tok, seed=5)
    assert torch.equal(score_head(again).weight, score_head(v).weight)


def test_init_from_with_other_architecture_is_rejected(tok, lm_dir):
    with pytest.raises(DataError) as exc:
        build_value_model("llama-10m", tok, seed=0, init_from=str(lm_dir))
    msg = _one_line(exc)
    assert "hidden_size=128 (expected 256)" in msg and str(lm_dir) in msg


# --- heads -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_manual(tok, lm, temperature):
    ids, mask = _padded_batch(tok, ["sort 312=123", "rev abc=cba"])
    with torch.no_grad():
        logp = token_logprobs(lm, ids, mask, temperature=temperature)
        logp2, entropy = token_logprobs_and_entropy(lm, ids, mask, temperature=temperature)
        logits = lm(input_ids=ids, attention_mask=mask).logits[:, :-1] / temperature
    manual_all = torch.log_softmax(logits, dim=-1)
    manual = torch.stack(
        [torch.stack([manual_all[b, t, ids[b, t + 1]] for t in range(ids.shape[1] - 1)]) for b in range(2)]
    )
    manual_entropy = -(manual_all.exp() * manual_all).sum(-1)
    assert logp.shape == (2, ids.shape[1] - 1)
    assert torch.allclose(logp, manual, atol=1e-5)
    assert torch.allclose(logp2, logp)
    assert torch.allclose(entropy, manual_entropy, atol=1e-5)
    assert (entropy >= 0).all() and (entropy <= torch.log(torch.tensor(float(len(tok)))) + 1e-5).all()


def _random_head_value_model(tok, seed: int):
    v = build_value_model("llama-1m", tok, seed=seed)
    with torch.no_grad():
        score_head(v).weight.normal_(generator=torch.Generator().manual_seed(seed))
    return v


def test_right_padding_does_not_change_real_positions(tok, lm):
    short, long = "rev ab=ba", "sort 31415=11345"
    ids, mask = _padded_batch(tok, [short, long])
    alone, alone_mask = _padded_batch(tok, [short])
    n = alone.shape[1]
    assert mask[0].sum() == n and mask[0, n:].sum() == 0
    v = _random_head_value_model(tok, seed=3)
    with torch.no_grad():
        assert torch.allclose(
            token_logprobs(lm, ids, mask)[0, : n - 1], token_logprobs(lm, alone, alone_mask)[0], atol=1e-5
        )
        assert torch.allclose(token_values(v, ids, mask)[0, :n], token_values(v, alone, alone_mask)[0], atol=1e-5)


def test_sequence_scores_pick_last_real_token(tok):
    v = _random_head_value_model(tok, seed=4)
    ids, mask = _padded_batch(tok, ["a=b", "add 1+22=23", "rev xyz=zyx"])
    with torch.no_grad():
        values = token_values(v, ids, mask)
        scores = sequence_scores(v, ids, mask)
        hf_scores = v(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    last = mask.sum(1) - 1
    assert torch.equal(scores, values[torch.arange(3), last])
    assert not torch.allclose(scores, values[:, -1])  # padding would have been read otherwise
    # HF's own reward-model forward (last non-pad token) agrees, so checkpoints mean the same elsewhere.
    assert torch.allclose(scores, hf_scores, atol=1e-5)


def test_activation_checkpointing_recomputes_layers_with_the_same_gradients():
    """The plan's ``rc``: each decoder layer runs again in the backward, and the gradients do not change."""
    import torch

    from loomrl.algorithms.ops import activation_checkpointing
    from loomrl.models.tokenizer import build_char_tokenizer
    from loomrl.models.zoo import build_causal_lm, build_value_model

    tok = build_char_tokenizer()
    for build in (build_causal_lm, build_value_model):
        model = build("llama-1m", tok, seed=0)
        model.train()
        calls = []
        # module hooks do not fire in the recomputation: count calls of a submodule's forward itself
        mlp = model.model.layers[1].mlp
        forward = mlp.forward
        mlp.forward = lambda x: calls.append(1) or forward(x)
        ids = torch.randint(3, 20, (3, 9))

        def grads(recompute: bool) -> list[torch.Tensor]:
            model.zero_grad(set_to_none=True)
            calls.clear()
            with activation_checkpointing(model, recompute):
                model(input_ids=ids).logits.float().square().mean().backward()
            return [p.grad.clone() for p in model.parameters()]

        plain = grads(False)
        assert len(calls) == 1
        again = grads(True)
        assert len(calls) == 2  # the forward, then its recomputation in the backward
        assert all(torch.equal(a, b) for a, b in zip(plain, again))
        assert not model.model.layers[1].gradient_checkpointing  # off again after the block
        assert not getattr(model, "_require_grads_hooks", None)  # no hook left behind per call
