"""Workflow graph: edges from keys, deterministic order, one-line errors, and unrolling over iterations."""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from loomrl.errors import WorkflowError
from loomrl.workflow import MFC, MFCKind, Workflow
from oracles import to_dot, unroll

G, I, T, C = MFCKind.GENERATE, MFCKind.INFERENCE, MFCKind.TRAIN, MFCKind.COMPUTE
SOURCES = ("prompt_ids",)
RESPONSE = ("prompt_ids", "response_ids")


def ppo_mfcs() -> list[MFC]:
    return [
        MFC("actor_gen", "actor", G, ("prompt_ids",), ("response_ids", "logp")),
        MFC("ref_inf", "ref", I, RESPONSE, ("ref_logp",)),
        MFC("reward_inf", "reward", I, RESPONSE, ("score",)),
        MFC("critic_inf", "critic", I, RESPONSE, ("values",)),
        MFC("adv", None, C, ("logp", "ref_logp", "score", "values"), ("advantages", "returns")),
        MFC("actor_train", "actor", T, (*RESPONSE, "logp", "advantages"), ("actor_stats",)),
        MFC("critic_train", "critic", T, (*RESPONSE, "values", "returns"), ("critic_stats",)),
    ]


def names(mfcs) -> list[str]:
    return [m.name for m in mfcs]


@contextmanager
def raises_one_line(*fragments: str) -> Iterator[None]:
    """Expect a WorkflowError whose single-line message contains every fragment."""
    with pytest.raises(WorkflowError) as info:
        yield
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


# --- the PPO graph ---------------------------------------------------------------------------------------


def test_ppo_edges_from_keys():
    wf = Workflow(ppo_mfcs(), SOURCES)
    assert wf.deps("actor_gen") == []
    assert wf.deps("ref_inf") == ["actor_gen"]
    assert wf.deps("adv") == ["actor_gen", "ref_inf", "reward_inf", "critic_inf"]  # input order
    assert wf.deps("actor_train") == ["actor_gen", "adv"]
    assert wf.deps("critic_train") == ["actor_gen", "critic_inf", "adv"]
    assert wf.producers["advantages"] == "adv"
    assert "prompt_ids" not in wf.producers
    readers = ["ref_inf", "reward_inf", "critic_inf", "actor_train", "critic_train"]
    assert wf.consumers("response_ids") == readers
    assert wf.consumers("actor_stats") == []


def test_independent_calls_share_no_data_path():
    wf = Workflow(ppo_mfcs(), SOURCES)
    assert wf.independent("ref_inf", "reward_inf") and wf.independent("actor_train", "critic_train")
    assert not wf.independent("actor_gen", "critic_train")  # through a chain of edges, not only a direct one
    assert not wf.independent("critic_train", "critic_inf") and not wf.independent("adv", "adv")
    with pytest.raises(WorkflowError, match="no MFC named 'nope'"):
        wf.independent("nope", "adv")


def test_ppo_topological_order_and_lookup():
    wf = Workflow(ppo_mfcs(), SOURCES)
    expected = ["actor_gen", "ref_inf", "reward_inf", "critic_inf", "adv", "actor_train", "critic_train"]
    assert names(wf.topological_order()) == expected
    assert names(wf) == expected
    assert len(wf) == 7
    assert wf["adv"].kind is MFCKind.COMPUTE
    assert "adv" in wf and "nope" not in wf
    assert wf.roles() == ["actor", "ref", "reward", "critic"]
    assert names(wf.mfcs_of_role("actor")) == ["actor_gen", "actor_train"]


def test_topological_order_breaks_ties_by_given_order():
    wf = Workflow(list(reversed(ppo_mfcs())), SOURCES)
    # once actor_gen ran, critic_inf, reward_inf and ref_inf are all ready: they keep the reversed order
    assert names(wf.topological_order()) == [
        "actor_gen", "critic_inf", "reward_inf", "ref_inf", "adv", "critic_train", "actor_train",
    ]  # fmt: skip
    assert wf.roles() == ["actor", "critic", "reward", "ref"]


def test_unknown_names_raise_with_choices():
    wf = Workflow(ppo_mfcs(), SOURCES)
    with raises_one_line("'nope'", "actor_gen"):
        wf["nope"]
    with raises_one_line("'nope'", "actor, ref, reward, critic"):
        wf.mfcs_of_role("nope")
    with raises_one_line("'nope'", "advantages", "prompt_ids"):
        wf.consumers("nope")


# --- errors ----------------------------------------------------------------------------------------------


def test_duplicate_mfc_name():
    mfcs = ppo_mfcs() + [MFC("ref_inf", "ref", I, RESPONSE, ("other",))]
    with raises_one_line("'ref_inf'", "unique"):
        Workflow(mfcs, SOURCES)


def test_duplicate_producer_names_both_and_key():
    mfcs = ppo_mfcs() + [MFC("ref_inf2", "ref", I, RESPONSE, ("ref_logp",))]
    with raises_one_line("'ref_logp'", "'ref_inf'", "'ref_inf2'"):
        Workflow(mfcs, SOURCES)


def test_source_key_cannot_also_be_produced():
    mfcs = ppo_mfcs() + [MFC("regen", "actor", G, ("response_ids",), ("prompt_ids",))]
    with raises_one_line("'regen'", "'prompt_ids'", "source key"):
        Workflow(mfcs, SOURCES)


def test_missing_producer_names_mfc_key_and_available_keys():
    mfcs = ppo_mfcs()
    mfcs[1] = MFC("ref_inf", "ref", I, ("prompt_ids", "responses"), ("ref_logp",))
    with raises_one_line("'ref_inf'", "'responses'", "available:", "response_ids", "prompt_ids"):
        Workflow(mfcs, SOURCES)


def test_missing_source_key():
    with raises_one_line("'actor_gen'", "'prompt_ids'"):
        Workflow(ppo_mfcs(), source_keys=())


def test_cycle_named_in_flow_order():
    mfcs = [
        MFC("start", "actor", G, ("prompt_ids",), ("x",)),
        MFC("a", "m", I, ("x", "c_out"), ("a_out",)),
        MFC("b", "m", I, ("a_out",), ("b_out",)),
        MFC("c", "m", I, ("b_out",), ("c_out",)),
    ]
    with raises_one_line("cycle: a -> b -> c -> a"):
        Workflow(mfcs, SOURCES)
    # the message starts from the earliest-given MFC on the cycle, whatever order they were given in
    with raises_one_line("cycle: c -> a -> b -> c"):
        Workflow([mfcs[3], mfcs[0], mfcs[2], mfcs[1]], SOURCES)


def test_cycle_downstream_of_stuck_mfc_names_only_the_cycle():
    mfcs = [
        MFC("a", "m", I, ("b_out",), ("a_out",)),
        MFC("b", "m", I, ("a_out",), ("b_out",)),
        MFC("after", "m", I, ("a_out",), ("z",)),
    ]
    with raises_one_line("cycle: a -> b -> a"):
        Workflow(mfcs, ())


def test_self_loop_is_a_cycle():
    with raises_one_line("cycle: loop -> loop"):
        Workflow([MFC("loop", "m", I, ("prompt_ids", "y"), ("y",))], SOURCES)


def test_unordered_reader_of_trained_role_is_rejected():
    # actor_eval reads the actor's weights but nothing orders it against actor_train
    mfcs = ppo_mfcs() + [MFC("actor_eval", "actor", I, RESPONSE, ("eval_logp",))]
    with raises_one_line("'actor_eval'", "'actor_train'", "'actor'"):
        Workflow(mfcs, SOURCES)


def test_empty_workflow_rejected():
    with raises_one_line("at least one MFC"):
        Workflow([], SOURCES)


# --- MFC validation --------------------------------------------------------------------------------------


def test_mfc_validation_errors():
    with raises_one_line("non-empty"):
        MFC("", "actor", G, (), ("y",))
    with raises_one_line("'gen'", "needs a role"):
        MFC("gen", None, G, (), ("y",))
    with raises_one_line("'adv'", "no role", "'actor'"):
        MFC("adv", "actor", C, ("x",), ("y",))
    with raises_one_line("'gen'", "'decode'", "generate, inference, train, compute"):
        MFC("gen", "actor", "decode", (), ("y",))
    with raises_one_line("'inf'", "at least one"):
        MFC("inf", "ref", I, ("x",), ())
    with raises_one_line("'inf'", "'x'", "twice"):
        MFC("inf", "ref", I, ("x", "x"), ("y",))


def test_train_mfc_may_output_nothing_or_only_stats():
    train = MFC("train", "actor", T, ("x",), ())
    assert train.outputs == ()
    wf = Workflow([MFC("gen", "actor", G, ("p",), ("x",)), train], ("p",))
    assert names(wf) == ["gen", "train"]


def test_mfc_normalises_types_and_ignores_op_in_equality():
    a = MFC("gen", "actor", "generate", ["p"], ["x"], op=lambda: 1)
    b = MFC("gen", "actor", G, ("p",), ("x",), op=lambda: 2)
    assert a.kind is MFCKind.GENERATE and a.inputs == ("p",) and a.outputs == ("x",)
    assert a == b and hash(a) == hash(b)
    assert a != MFC("gen", "actor", G, ("p",), ("x",), doc="other")
    with pytest.raises(AttributeError):
        a.name = "other"


# --- unrolling over iterations ---------------------------------------------------------------------------


def _unrolled_deps(wf: Workflow, iterations: int) -> dict[tuple[int, str], list[tuple[int, str]]]:
    return {(it, mfc.name): deps for it, mfc, deps in unroll(wf, iterations)}


def test_unroll_ppo_parameter_version_edges():
    wf = Workflow(ppo_mfcs(), SOURCES)
    deps = _unrolled_deps(wf, 3)
    assert len(deps) == 21
    assert deps[(0, "actor_gen")] == []
    assert deps[(1, "actor_gen")] == [(0, "actor_train")]
    assert deps[(2, "actor_gen")] == [(1, "actor_train")]
    assert deps[(1, "critic_inf")] == [(1, "actor_gen"), (0, "critic_train")]
    # untrained roles carry no version edge; later calls of a role are ordered by their data edges
    assert deps[(1, "ref_inf")] == [(1, "actor_gen")]
    assert deps[(1, "reward_inf")] == [(1, "actor_gen")]
    assert deps[(1, "actor_train")] == [(1, "actor_gen"), (1, "adv")]
    assert deps[(1, "critic_train")] == [(1, "actor_gen"), (1, "critic_inf"), (1, "adv")]


def test_unroll_order_is_runnable():
    seen: set[tuple[int, str]] = set()
    for it, mfc, deps in unroll(Workflow(ppo_mfcs(), SOURCES), 3):
        assert all(d in seen for d in deps), (it, mfc.name, deps)
        seen.add((it, mfc.name))
    assert [it for it, _, _ in unroll(Workflow(ppo_mfcs(), SOURCES), 2)] == [0] * 7 + [1] * 7


def test_unroll_waits_for_readers_after_train():
    # actor_eval reads the freshly trained actor; the next generation must wait for it too
    mfcs = ppo_mfcs() + [MFC("actor_eval", "actor", I, ("actor_stats",), ("eval_logp",))]
    deps = _unrolled_deps(Workflow(mfcs, SOURCES), 2)
    assert deps[(1, "actor_gen")] == [(0, "actor_eval")]
    assert deps[(1, "actor_eval")] == [(1, "actor_train")]


def test_unroll_zero_and_negative():
    wf = Workflow(ppo_mfcs(), SOURCES)
    assert unroll(wf, 0) == []
    with pytest.raises(ValueError, match="iterations"):
        unroll(wf, -1)


def test_to_dot_lists_nodes_and_key_edges():
    dot = to_dot(Workflow(ppo_mfcs(), SOURCES))
    assert dot.startswith("digraph workflow {") and dot.endswith("}")
    assert '"key:prompt_ids" -> "actor_gen" [label="prompt_ids"];' in dot
    assert '"adv" -> "critic_train" [label="returns"];' in dot
    assert dot.count(" -> ") == sum(len(m.inputs) for m in ppo_mfcs())
