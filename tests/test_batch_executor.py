"""The per-sample Batch, packing prompt+response into response-aligned columns, and the reference executor."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from loomrl.algorithms.context import OpContext, Role
from loomrl.algorithms.ops import train_loop
from loomrl.models.heads import token_logprobs, token_values
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm, build_value_model
from loomrl.plan import ClusterSpec, colocate
from loomrl.plan.schedule import build_schedule
from loomrl.role import ModelPasses
from loomrl.runtime.executor import Executor, IterationResult
from loomrl.runtime.reference import ReferenceExecutor
from loomrl.workflow import MFC, MFCKind, Workflow
from loomrl.workflow.batch import Batch, pack_sequences, pad_right, response_columns, response_mask


def _batch() -> Batch:
    return Batch(
        [10, 11, 12],
        {
            "prompt_ids": [[1, 5], [1, 6, 7], [1]],
            "score": torch.tensor([0.5, -1.0, 2.0]),
            "logp": torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
        },
    )


# ---------------------------------------------------------------------------------------------- Batch


def test_update_rejects_wrong_row_count():
    batch = _batch()
    with pytest.raises(ValueError, match="'bad' has 2 rows, batch has 3"):
        batch.update({"bad": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match="'bad_list' has 4 rows"):
        batch.update({"bad_list": [[1]] * 4})
    with pytest.raises(ValueError):
        Batch([0, 1], {"x": [1, 2, 3]})
    assert "bad" not in batch and "bad_list" not in batch
    batch.update({"good": [[], [2], [3, 4]]})
    assert batch["good"] == [[], [2], [3, 4]] and len(batch) == 3


def test_columns_restricts_keys_and_shares_storage():
    batch = _batch()
    view = batch.columns(["score", "prompt_ids"])
    assert sorted(view.keys()) == ["prompt_ids", "score"] and view.ids == [10, 11, 12]
    assert view["score"] is batch["score"]
    # New columns on the view do not appear in the original.
    view.update({"extra": [0, 0, 0]})
    assert "extra" not in batch
    with pytest.raises(KeyError):
        batch.columns(["missing"])


def test_select_rows_follow_ids():
    batch = _batch()
    picked = batch.select([2, 0])
    assert picked.ids == [12, 10] and len(picked) == 2
    assert picked["prompt_ids"] == [[1], [1, 5]]
    assert torch.equal(picked["score"], torch.tensor([2.0, 0.5]))
    assert torch.equal(picked["logp"], torch.tensor([[5.0, 6.0], [1.0, 2.0]]))
    only = batch.select([1], keys=["score"])
    assert only.keys() == ["score"] and only.ids == [11]
    empty = batch.select([])
    assert len(empty) == 0 and empty["score"].shape == (0,) and empty["logp"].shape == (0, 2)


def test_concat_pads_2d_tensors_to_widest_part_and_keeps_ids():
    a = Batch([3, 1], {"r": [[7], [8, 9]], "logp": torch.tensor([[1.0], [2.0]]), "s": torch.tensor([1.0, 2.0])})
    b = Batch([0], {"r": [[4, 4, 4]], "logp": torch.tensor([[3.0, 4.0, 5.0]]), "s": torch.tensor([3.0])})
    both = Batch.concat([a, b])
    assert both.ids == [3, 1, 0]
    assert both["r"] == [[7], [8, 9], [4, 4, 4]]
    assert torch.equal(both["logp"], torch.tensor([[1.0, 0, 0], [2.0, 0, 0], [3.0, 4.0, 5.0]]))
    assert torch.equal(both["s"], torch.tensor([1.0, 2.0, 3.0]))
    # Splitting by rows and concatenating in another order puts every sample back with its id.
    batch = _batch()
    shuffled = Batch.concat([batch.select([2]), batch.select([0, 1])])
    assert shuffled.ids == [12, 10, 11]
    by_id = {i: r for r, i in enumerate(shuffled.ids)}
    for r, i in enumerate(batch.ids):
        assert shuffled["prompt_ids"][by_id[i]] == batch["prompt_ids"][r]
        assert torch.equal(shuffled["logp"][by_id[i]], batch["logp"][r])


def test_pad_right_and_response_mask():
    assert torch.equal(pad_right([[1, 2], [], [3]], value=-1.0), torch.tensor([[1.0, 2.0], [-1.0, -1.0], [3.0, -1.0]]))
    assert pad_right([[1]], width=4).shape == (1, 4)
    assert pad_right([]).shape == (0, 0)
    assert torch.equal(response_mask([[5, 6, 7], [8]]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
    assert response_mask([[5]], width=3).tolist() == [[1.0, 0.0, 0.0]]


# ---------------------------------------------------------------------------------------------- packing


def test_pack_sequences_layout():
    ids_BL, attn_BL, plen_B = pack_sequences([[1, 5], [1, 6, 7]], [[9, 2], [8]], pad_id=0, device="cpu")
    assert ids_BL.tolist() == [[1, 5, 9, 2], [1, 6, 7, 8]]
    assert attn_BL.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    ids_BL, attn_BL, plen_B = pack_sequences([[1], [1, 6, 7]], [[9], [8, 4]], pad_id=0, device="cpu")
    assert ids_BL.tolist() == [[1, 9, 0, 0, 0], [1, 6, 7, 8, 4]]
    assert attn_BL.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert plen_B.tolist() == [1, 3] and ids_BL.dtype == torch.long


def test_response_columns_hand_example():
    # logp_BL1[b, j] scores token j+1; prompt of length 2 → response token t is scored at column 1 + t.
    x_BL1 = torch.arange(12.0).reshape(2, 6)
    cols_BR = response_columns(x_BL1, torch.tensor([2, 4]), width=3)
    assert cols_BR[0].tolist() == [1.0, 2.0, 3.0]
    assert cols_BR[1, :2].tolist() == [9.0, 10.0]  # its third column is past the end: clamped, to be masked


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def lm(tok):
    return build_causal_lm("qwen2-1m", tok, seed=0)


PROMPTS = [[1, 10, 11, 12], [1, 20], [1, 30, 31, 32, 33, 34, 35]]
RESPONSES = [[5, 6, 2], [7, 8, 9, 10, 11, 2], [40]]


def test_response_aligned_logps_match_manual_loop(lm):
    ids_BL, attn_BL, plen_B = pack_sequences(PROMPTS, RESPONSES, pad_id=0, device="cpu")
    width = max(len(r) for r in RESPONSES)
    mask_BR = response_mask(RESPONSES)
    for temperature in (1.0, 0.7):
        with torch.no_grad():
            logp_BR = response_columns(token_logprobs(lm, ids_BL, attn_BL, temperature), plen_B, width)
        assert logp_BR.shape == mask_BR.shape == (3, 6)
        for b, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
            with torch.no_grad():  # each sample alone, unpadded, one position at a time
                logits_LV = lm(input_ids=torch.tensor([prompt + response])).logits[0]
            for t, token in enumerate(response):
                expected = torch.log_softmax(logits_LV[len(prompt) - 1 + t] / temperature, -1)[token]
                torch.testing.assert_close(logp_BR[b, t], expected, atol=1e-5, rtol=0)
        assert mask_BR[2].tolist() == [1.0, 0, 0, 0, 0, 0] and mask_BR[1].tolist() == [1.0] * 6
        # The padded columns are finite junk; masking removes them from any masked sum.
        assert torch.isfinite(logp_BR).all()
        masked_sum_B = (logp_BR * mask_BR).sum(-1)
        torch.testing.assert_close(masked_sum_B[2], logp_BR[2, 0])


def test_response_aligned_values_are_state_before_each_token(tok):
    critic = build_value_model("llama-1m", tok, seed=1)
    with torch.no_grad():
        torch.nn.init.normal_(critic.score.weight, std=0.1)  # the zoo head starts at zero
        ids_BL, attn_BL, plen_B = pack_sequences(PROMPTS, RESPONSES, pad_id=0, device="cpu")
        values_BR = response_columns(token_values(critic, ids_BL, attn_BL), plen_B, 6)
        for b, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
            alone_L = token_values(critic, torch.tensor([prompt + response]), torch.ones(1, len(prompt + response)))[0]
            for t in range(len(response)):
                # V before response token t is the value at the last token already seen: position plen-1+t.
                torch.testing.assert_close(values_BR[b, t], alone_L[len(prompt) - 1 + t], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- executor

G, I, T, C = MFCKind.GENERATE, MFCKind.INFERENCE, MFCKind.TRAIN, MFCKind.COMPUTE


def _calls(workflow: Workflow):
    """The reference executor's schedule: the workflow on one device, nothing but its calls."""
    return build_schedule(workflow, colocate(workflow, ClusterSpec.parse("cpu:1")))


def _executor(mfcs: list[MFC], source=("prompt_ids",), roles=("actor", "ref")) -> ReferenceExecutor:
    workflow = Workflow(mfcs, source)
    return ReferenceExecutor(
        _calls(workflow),
        {r: Role(r) for r in roles},
        seed=3,
        pad_id=0,
        eos_id=2,
        decode=lambda ids: "".join(map(str, ids)),
    )


def _recorder(calls: list, name: str, fn):
    """An op that records what it was given, then computes its outputs with ``fn``."""

    def op(ctx: OpContext, batch: Batch) -> dict:
        calls.append(
            (
                name,
                sorted(batch.keys()),
                list(batch.ids),
                ctx.iteration,
                ctx.seed,
                None if ctx.role is None else ctx.role.name,
            )
        )
        return fn(batch)

    return op


def _toy_mfcs(calls: list) -> list[MFC]:
    gen = _recorder(calls, "gen", lambda b: {"response_ids": [p[1:] + [2] for p in b["prompt_ids"]]})
    ref = _recorder(calls, "ref", lambda b: {"ref_logp": pad_right([[-1.0] * len(r) for r in b["response_ids"]])})
    adv = _recorder(calls, "adv", lambda b: {"advantages": b["ref_logp"] * 2})

    def train_fn(b: Batch) -> dict:
        return {"stats": {"actor/loss": float(b["advantages"].sum()), "actor/rows": float(len(b))}}

    train = _recorder(calls, "train", train_fn)
    # Given out of order: the executor must still run them in data-flow order.
    return [
        MFC("adv", None, C, ("ref_logp",), ("advantages",), adv),
        MFC("actor_train", "actor", T, ("response_ids", "advantages"), (), train),
        MFC("ref_inf", "ref", I, ("prompt_ids", "response_ids"), ("ref_logp",), ref),
        MFC("actor_gen", "actor", G, ("prompt_ids",), ("response_ids",), gen),
    ]


def test_executor_runs_in_topological_order_with_declared_inputs_only():
    calls: list = []
    executor = _executor(_toy_mfcs(calls))
    batch = Batch([7, 8], {"prompt_ids": [[1, 4], [1, 5, 6]], "unrelated": [0, 0]})
    result = executor.run_iteration(4, batch)
    assert isinstance(result, IterationResult)
    assert [c[0] for c in calls] == ["gen", "ref", "adv", "train"]
    # Each op saw exactly its declared inputs (no "unrelated", nothing produced later), with the row ids.
    assert [c[1] for c in calls] == [
        ["prompt_ids"],
        ["prompt_ids", "response_ids"],
        ["ref_logp"],
        ["advantages", "response_ids"],
    ]
    assert all(c[2] == [7, 8] and c[3] == 4 and c[4] == 3 for c in calls)
    assert [c[5] for c in calls] == ["actor", "ref", None, "actor"]
    assert result.batch["response_ids"] == [[4, 2], [5, 6, 2]]
    assert torch.equal(result.batch["advantages"], torch.tensor([[-2.0, -2.0, 0.0], [-2.0, -2.0, -2.0]]))
    assert "stats" not in result.batch
    assert result.stats == {"actor/loss": -10.0, "actor/rows": 2.0}


def test_executor_reports_each_samples_response_length_in_batch_order():
    result = _executor(_toy_mfcs([])).run_iteration(0, Batch([7, 8], {"prompt_ids": [[1, 4], [1, 5, 6]]}))
    assert result.response_lengths == [len(r) for r in result.batch["response_ids"]] == [2, 3]


def test_both_executors_declare_the_executor_protocol_with_its_signatures():
    import inspect

    from loomrl.runtime.ray_executor import RayExecutor

    methods = {n for n, v in vars(Executor).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert methods == {
        "run_iteration",
        "generate_ahead",
        "evaluate",
        "save",
        "load",
        "apply_plan",
        "drain_traces",
        "check_shared_dir",
        "close",
    }
    for cls in (ReferenceExecutor, RayExecutor):
        assert Executor in cls.__mro__  # declared, not only matched
        for name in methods:
            assert getattr(cls, name) is not getattr(Executor, name), (cls.__name__, name)
            assert list(inspect.signature(getattr(cls, name)).parameters) == list(
                inspect.signature(getattr(Executor, name)).parameters
            ), (cls.__name__, name)


def test_executor_records_one_trace_per_mfc():
    calls: list = []
    executor = _executor(_toy_mfcs(calls))
    result = executor.run_iteration(2, Batch([0], {"prompt_ids": [[1, 9]]}))
    names = [t.step for t in result.traces]
    assert names == ["actor_gen", "ref_inf", "adv", "actor_train"]
    assert [t.role for t in result.traces] == ["actor", "ref", None, "actor"]
    assert [t.kind for t in result.traces] == ["call"] * 4 and result.traces[0].mfc_kind == "generate"
    assert all(t.iteration == 2 and t.start <= t.end and t.devices == (0,) for t in result.traces)
    assert all(a.end[0] <= b.start[0] for a, b in zip(result.traces, result.traces[1:]))


def test_executor_rejects_undeclared_or_missing_outputs():
    extra = [
        MFC(
            "gen",
            "actor",
            G,
            ("prompt_ids",),
            ("response_ids",),
            lambda ctx, b: {"response_ids": [[2]], "logp": torch.zeros(1, 1)},
        )
    ]
    with pytest.raises(
        RuntimeError, match=r"MFC 'gen' returned \['logp', 'response_ids'\], declared \['response_ids'\]"
    ):
        _executor(extra, roles=("actor",)).run_iteration(0, Batch([0], {"prompt_ids": [[1]]}))
    missing = [
        MFC("gen", "actor", G, ("prompt_ids",), ("response_ids", "logp"), lambda ctx, b: {"response_ids": [[2]]})
    ]
    with pytest.raises(RuntimeError, match="MFC 'gen' returned"):
        _executor(missing, roles=("actor",)).run_iteration(0, Batch([0], {"prompt_ids": [[1]]}))
    # Only train calls may report statistics on the side.
    stats = [
        MFC(
            "score", None, C, ("prompt_ids",), ("score",), lambda ctx, b: {"score": torch.zeros(1), "stats": {"x": 1.0}}
        )
    ]
    with pytest.raises(RuntimeError, match="MFC 'score' returned"):
        _executor(stats, roles=()).run_iteration(0, Batch([0], {"prompt_ids": [[1]]}))


def test_executor_requires_every_role():
    with pytest.raises(ValueError, match=r"roles \['ref'\]"):
        _executor(_toy_mfcs([]), roles=("actor",))


def _sequence_role(name: str, value: bool) -> Role:
    from loomrl.models.tokenizer import build_char_tokenizer
    from loomrl.models.zoo import build_causal_lm, build_value_model

    build = build_value_model if value else build_causal_lm
    model = build("llama-1m", build_char_tokenizer(), seed=0)
    return Role(
        name,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        grad_clip=1e9,
        passes=ModelPasses(model),
    )


def _output_loss(prefix: str, scale: float, mb: Batch, outputs: torch.Tensor, packed):
    loss = scale * outputs.float().pow(2).mean()
    return loss, {f"{prefix}/loss": loss.item()}


def test_two_train_mfcs_keep_both_grad_norms():
    roles = {"actor": _sequence_role("actor", value=False), "critic": _sequence_role("critic", value=True)}
    with torch.no_grad():
        torch.nn.init.normal_(roles["critic"].model.score.weight)  # the zoo starts the head at zero

    def train(ctx, batch, prefix, scale):
        return train_loop(ctx, batch, loss_fn=partial(_output_loss, prefix, scale))

    seq = ("prompt_ids", "response_ids")
    mfcs = [
        MFC("actor_train", "actor", T, seq, (), partial(train, prefix="actor", scale=1.0)),
        MFC("critic_train", "critic", T, seq, (), partial(train, prefix="critic", scale=100.0)),
    ]
    executor = ReferenceExecutor(_calls(Workflow(mfcs, seq)), roles, seed=0, pad_id=0, eos_id=2, decode=str)
    batch = Batch(range(4), {"prompt_ids": [[1, 5, 6]] * 4, "response_ids": [[7, 8], [9], [7, 7, 7], [8]]})
    result = executor.run_iteration(0, batch)
    assert {"actor/loss", "critic/loss"} <= set(result.stats)
    grad_norms = sorted(v for k, v in result.stats.items() if "grad_norm" in k)
    # Two roles, two optimizer steps, two different gradient norms (the critic's loss is scaled by 100).
    assert len(grad_norms) == 2 and grad_norms[0] != grad_norms[1], result.stats


def test_gather_rows_pads_per_token_columns_from_different_shards_to_one_width():
    from loomrl.runtime.worker import gather_rows

    a = Batch([0, 1], {"values": torch.ones(2, 3), "text": ["a", "b"]})
    b = Batch([2], {"values": torch.ones(1, 5), "text": ["c"]})
    returns = Batch([0, 1, 2], {"returns": torch.ones(3, 5)})
    got = gather_rows([a, b, returns], [2, 0], ["values", "returns", "text"])
    assert got.ids == [2, 0] and got["text"] == ["c", "a"]
    assert got["values"].shape == got["returns"].shape == (2, 5)
    assert got["values"][1].tolist() == [1, 1, 1, 0, 0]
