"""Inter-stage fusion (RLHFuse): generation streams finished samples into the inference calls, and the tail
migrates onto a few replicas; the run is the unfused run.

Equivalence (3 iterations, tiny model, float32, the tolerances of ``test_runtime.py``): PPO and GRPO, a colocated
plan (inference on generation's devices, freed by the migration) and a separated one (inference on other devices,
from the first chunk on), on 2 and 4 devices, each against the single-process reference run. A warm-started policy
emits eos, so responses end at different steps and the stages stream and migrate for real (checked in the traces).
"""

import dataclasses
import json

import pytest

from loomrl.algorithms.context import OpContext, Role
from loomrl.algorithms.ops import generate_chunks, generate_op
from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import AlgoConfig, RolloutConfig, SFTConfig
from loomrl.config.tools import load_config
from loomrl.errors import ConfigError
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.plan import ClusterSpec, ExecutionPlan, format_plan_string, make_plan, parse_plan_string
from loomrl.plan.plan import StreamFusion
from loomrl.plan.schedule import StepKind, build_schedule
from loomrl.report.run_timeline import result_from_traces
from loomrl.rollout import SamplingParams
from loomrl.runtime.migration import assign_tail
from loomrl.train.rl import RLTrainer
from loomrl.workflow.batch import Batch
from test_runtime import _assert_equivalent, _cfg

PPO = build_workflow(AlgoConfig(name="ppo"), RolloutConfig())
GRPO = build_workflow(AlgoConfig(name="grpo"), RolloutConfig())


# --------------------------------------------------------------------------------------------------- plans
def test_fusion_is_a_plan_knob_in_strings_files_and_after_a_strategy(tmp_path):
    cluster = ClusterSpec.parse("cpu:4")
    plan = make_plan("colocate; stream_fusion=migrate_at:0.25,migrate_to:2,chunk:4", PPO, cluster)
    assert plan.stream_fusion == StreamFusion(0.25, 2, 4)
    assert make_plan("separate:2; stream_fusion=on", PPO, cluster).stream_fusion == StreamFusion()
    assert make_plan("interleave; stream_fusion=migrate_at:auto", GRPO, cluster).stream_fusion.migrate_at == "auto"
    text = format_plan_string(plan, PPO)
    assert (
        "stream_fusion=migrate_at:0.25,migrate_to:2,chunk:4" in text and parse_plan_string(text, PPO, cluster) == plan
    )
    plan.save(tmp_path / "p.yaml")
    assert ExecutionPlan.load(tmp_path / "p.yaml") == plan
    for bad, fragment in (
        ("colocate; stream_fusion=migrate_at:2", "outside 0..1"),
        ("colocate; stream_fusion=when:3", "not migrate_at"),
        ("colocate; stream_fusion=migrate_at:x", "not a number"),
        ("colocate; stream_fusion=migrate_to:5", "valid: 1-4"),
        ("colocate; actor_gen=0-3", "only shadow, offload, stream_fusion"),
    ):
        with pytest.raises(ConfigError, match=fragment):
            make_plan(bad, PPO, cluster)


def test_the_fused_stage_replaces_generation_and_the_calls_that_read_only_it():
    cluster = ClusterSpec.parse("cpu:2")
    schedule = build_schedule(PPO, make_plan("interleave; stream_fusion=on", PPO, cluster))
    ids = [s.id for s in schedule]
    assert ids[:3] == ["copy actor→0-1:dp2", "copy critic→0-1:dp2", "stream_fusion_actor_gen"]
    fused = schedule["stream_fusion_actor_gen"]
    assert fused.kind is StepKind.STREAM_FUSION and fused.devices == (0, 1)
    assert [m.id for m in fused.members] == ["actor_gen", "ref_inf", "reward_inf", "critic_inf"]
    assert fused.deps == ("copy actor→0-1:dp2", "copy critic→0-1:dp2")  # models in place before the stage
    assert schedule["copy critic→0-1:dp2"].deps == ()  # it no longer waits for generation
    assert schedule["free critic@0-1:dp2"].deps == ("stream_fusion_actor_gen",)
    assert schedule["advantages"].deps == ("stream_fusion_actor_gen",)
    assert [c.id for c in schedule.calls()] == [m.name for m in PPO.topological_order()]
    grpo = build_schedule(GRPO, make_plan("colocate; stream_fusion=on", GRPO, cluster))
    assert [m.id for m in grpo["stream_fusion_actor_gen"].members] == ["actor_gen", "ref_inf", "reward_inf"]


def test_the_tail_goes_to_the_replicas_with_the_most_left():
    # replica 0 has 5 steps left over two samples, replica 1 has 9, replica 2 has 1: with one destination,
    # replica 1 keeps its own and takes the rest, the longest first
    samples = {0: [(10, 3), (11, 2)], 1: [(20, 9)], 2: [(30, 1)]}
    assert assign_tail(samples, 1) == ([1], {10: 1, 11: 1, 30: 1})
    # two destinations (1 and 0, each keeping its own): 30 goes to the less loaded one, replica 0 (5 < 9)
    assert assign_tail(samples, 2) == ([0, 1], {30: 0})
    # ties: the lower replica; among moving samples the longest first, each to the least loaded destination
    assert assign_tail({0: [(1, 2)], 1: [(2, 2)], 2: [(3, 4), (4, 3)]}, 2) == ([0, 2], {2: 0})


class _Chunks:
    """A stream control without migration: chunks of two."""

    chunk, max_prompt, max_budget, slots, in_step = 2, 9, 0, 64, False

    def after_step(self, engine) -> bool:
        return False


def test_chunked_generation_delivers_every_sample_once_and_as_a_whole_run_would():
    tok = build_char_tokenizer()
    model = build_causal_lm("llama-1m", tok, seed=0)
    prompts = [[tok.bos_token_id] + tok.encode(t, add_special_tokens=False) for t in ("sort 31=", "sort 2=", "ab")]
    batch = Batch([7, 3, 9], {"prompt_ids": prompts})
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    ctx = OpContext(Role("actor", model), 5, 2, tok.pad_token_id, tok.eos_token_id, str)
    whole = generate_op(ctx, batch, params)
    seen: dict[int, list[int]] = {}
    chunks = list(generate_chunks(dataclasses.replace(ctx, stream=_Chunks()), batch, params))
    assert [len(ids) for ids, _ in chunks] in ([2, 1], [3]) and len(chunks) >= 1
    for ids, columns in chunks:
        for sid, response in zip(ids, columns["response_ids"]):
            assert sid not in seen
            seen[sid] = response
    assert seen == dict(zip([7, 3, 9], whole["response_ids"]))


# ---------------------------------------------------------------------------------------------- equivalence
pytestmark = pytest.mark.usefixtures("ray_session")

COMMON = ("rollout.max_new_tokens=8", "rollout.prompts_per_iter=8")


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A policy that emits eos after a few SFT steps, so response lengths vary."""
    from loomrl.train.sft import run_sft

    path = tmp_path_factory.mktemp("sft")
    run_sft(load_config(SFTConfig, None, [f"out_dir={path}", "steps=40", "eval_prompts=8"]), progress=False)
    return f"actor.model={path}"


@pytest.fixture(scope="module")
def references(tmp_path_factory, warm):
    out = {}
    for algo in ("ppo", "grpo"):
        path = tmp_path_factory.mktemp(f"ref_{algo}")
        RLTrainer(_cfg(path, "ref", warm, *COMMON, f"algo.name={algo}", "algo.group_size=2")).run()
        out[algo] = [json.loads(line) for line in (path / "ref" / "metrics.jsonl").read_text().splitlines()]
    return out


@pytest.mark.parametrize(
    "algo,plan,devices",
    [
        ("ppo", "colocate", 2),
        ("ppo", "separate:1", 2),
        ("grpo", "colocate", 2),
        ("grpo", "separate:1", 2),
        ("ppo", "colocate", 4),
        ("ppo", "separate:2", 4),
        ("grpo", "colocate", 4),
        ("grpo", "separate:2", 4),
    ],
    ids=lambda v: str(v),
)
def test_a_fused_run_is_the_reference_run(tmp_path, warm, references, algo, plan, devices):
    text = f"{plan}; stream_fusion=migrate_at:0.5,migrate_to:1,chunk:2"
    cfg = _cfg(
        tmp_path,
        "fused",
        warm,
        *COMMON,
        f"algo.name={algo}",
        "algo.group_size=2",
        "runtime.executor=ray",
        f"runtime.devices={devices}",
        "runtime.verify_reallocation=true",
    )
    RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=text))).run()
    got = [json.loads(line) for line in (tmp_path / "fused" / "metrics.jsonl").read_text().splitlines()]
    _assert_equivalent(got, references[algo])
    assert any(r["response/length"] < r["response/length_max"] for r in got), "lengths should vary"
    traces = [json.loads(line) for line in (tmp_path / "fused" / "traces.jsonl").read_text().splitlines()]
    stages = [t for t in traces if t["step"] == "stream_fusion_actor_gen"]
    assert len(stages) == 3
    generators = devices if plan == "colocate" else int(plan.split(":")[1])
    for stage in stages:
        labels = [p[0] for p in stage["parts"]]
        assert labels.count("actor_gen") == generators  # one stream per generating device
        assert {"ref_inf", "reward_inf"} <= set(labels)
        if plan == "colocate":  # the replicas agreed on a migration: some of them handed their tail over
            assert "migrate" in labels
    drawn = result_from_traces(traces).timeline  # the measured timeline draws each part on its device
    assert {(i.label, i.kind) for i in drawn} >= {("actor_gen", "generate"), ("ref_inf", "inference")}
    assert not any(i.label == "stream_fusion_actor_gen" for i in drawn)
