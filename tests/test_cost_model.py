"""The planner's cost model: hand-computed terms, monotonicity, datasheet profiles, fitted corrections."""

from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace

import pytest

from loomrl.plan import GB, Allocation, ClusterSpec, param_count, plan_reallocation
from loomrl.plan.cluster import profile_for
from loomrl.plan.hardware import PROFILES, HardwareProfile
from loomrl.plan.model_shape import ModelShape
from loomrl.plan.plan import AsyncTraining
from loomrl.planner.calibration.local import calibrate_local
from loomrl.planner.calibration.traces import observations_from_metrics, trace_predictor
from loomrl.planner.cost import decode as D
from loomrl.planner.cost import realloc as RC
from loomrl.planner.cost import terms as T
from loomrl.planner.cost.corrections import fit_corrections
from loomrl.planner.cost.model import CostModel
from loomrl.planner.cost.system import SystemSettings
from loomrl.planner.cost.workload import Workload, lengths_from_summary
from loomrl.workflow import MFC, MFCKind

LLAMA_7B = SimpleNamespace(
    model_type="llama",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    intermediate_size=11008,
    vocab_size=32000,
)
SMALL = ModelShape(params=1_000_000, layers=4, hidden=64, heads=8, kv_heads=4, intermediate=96, vocab=128)

TRAIN = MFC("actor_train", "actor", MFCKind.TRAIN, ("response_ids",), ())
GEN = MFC("actor_gen", "actor", MFCKind.GENERATE, ("prompt_ids",), ("response_ids",))
INF = MFC("ref_inf", "actor", MFCKind.INFERENCE, ("response_ids",), ("ref_logp",))
ADV = MFC("advantages", None, MFCKind.COMPUTE, ("ref_logp",), ("advantages",))

# An exponential-ish spread of response lengths with mean ≈ 256, capped at 1024 (a typical RLHF rollout).
LENGTHS = tuple(min(1024, max(1, round(-256 * math.log(1 - (i + 0.5) / 512)))) for i in range(512))


def a(text: str) -> Allocation:
    return Allocation.parse(text)


def llama_model(cluster: str = "h100:8", batch: int = 512, lengths: tuple[int, ...] = LENGTHS, **kwargs) -> CostModel:
    spec = ClusterSpec.parse(cluster)
    workload = Workload(batch=batch, prompt_len=256, response_lengths=lengths, minibatches=4, **kwargs)
    return CostModel(spec, profile_for(spec), {"actor": ModelShape.from_config(LLAMA_7B)}, workload)


# ------------------------------------------------------------------------------------------------- profiles


def test_profiles_hold_the_datasheet_figures():
    h100, a100, h200, h20 = (PROFILES[k] for k in ("h100-80g", "a100-80g", "h200", "h20"))
    assert (h100.matmul_flops, h100.mem_bandwidth, h100.memory_bytes) == (989e12, 3.35e12, 80 * GB)
    assert (a100.matmul_flops, a100.mem_bandwidth, a100.memory_bytes) == (312e12, 2.039e12, 80 * GB)
    assert (h200.matmul_flops, h200.mem_bandwidth, h200.memory_bytes) == (989e12, 4.8e12, 141 * GB)
    assert (h20.matmul_flops, h20.mem_bandwidth, h20.memory_bytes) == (148e12, 4.0e12, 96 * GB)
    assert h100.intra_node_bw == 450e9 and a100.intra_node_bw == 300e9  # NVLink, one direction
    assert h100.inter_node_bw == 50e9  # 400 Gb/s NDR per GPU
    assert all(p.intra_node_bw > p.inter_node_bw for p in PROFILES.values())


def test_profile_for_takes_the_clusters_memory():
    assert profile_for(ClusterSpec.parse("h100:8")) == PROFILES["h100-80g"]
    small = ClusterSpec(1, 8, "h100", "h100-80g", 70.0)
    assert profile_for(small).memory_bytes == 70 * GB
    with pytest.raises(Exception, match="matmul_flops"):
        HardwareProfile("x", 0.0, 1.0, 1.0, 1.0, 1.0)


def test_calibrate_local_smoke():
    profile = calibrate_local(2, matmul_n=64, copy_mb=1, transfer_mb=1, repeats=1)
    assert profile.name == "local" and profile.devices_share_cores >= 1
    for value in (
        profile.matmul_flops,
        profile.mem_bandwidth,
        profile.memory_bytes,
        profile.intra_node_bw,
        profile.link_latency,
    ):
        assert 0 < value < math.inf


def test_planner_imports_neither_torch_nor_ray():
    code = "import sys, loomrl.planner; print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ----------------------------------------------------------------------------------------- shapes and terms


def test_model_shape_from_config():
    shape = ModelShape.from_config(LLAMA_7B)
    assert shape.params == param_count(LLAMA_7B) == 6_738_415_616  # the published 6.7B
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim) == (32, 4096, 32, 32, 128)
    assert sum(math.prod(s) for s in shape.param_shapes().values()) == shape.params


def test_terms_against_hand_computed_values():
    # 2 FLOPs per matmul parameter per token, plus causal attention 2·layers·hidden·S²
    assert T.forward_flops(SMALL, 10, 100) == 2 * (1_000_000 - 128 * 64) * 10 + 2 * 4 * 64 * 100
    assert T.train_flops(SMALL, 10, 100) == 3 * T.forward_flops(SMALL, 10, 100)
    assert T.kv_bytes_per_token(SMALL, 2) == 2 * 4 * (4 * 8) * 2
    assert T.ring_allreduce_bytes(100, 4) == 150  # 2·3/4 of the buffer
    assert T.ring_allreduce_time(100, 4, 10.0, 1.0) == 15 + 2  # volume/bw + log2(4) start-ups
    assert T.ring_allreduce_time(100, 1, 10.0, 1.0) == 0
    assert T.pipeline_slots(4, 8) == 11 and T.decode_step_slots(4, 2) == 4
    # bf16 weights: read the fp32 grads, read and write the fp32 master and both moments, write the weights
    assert T.adam_step_bytes(10, 2) == 10 * (4 + 2 * (4 + 8) + 2)
    assert T.adam_step_bytes(10, 4) == 10 * (3 * 4 + 16)  # fp32 weights are their own master copy


def test_sum_max_linear_matches_the_step_by_step_sum():
    for a_, b_, c_, d_ in [(0, 1, 5, 0), (5, 0, 0, 1), (1, 2, 1, 2), (-3, 0.5, 2, -0.25), (0, 0, 0, 0)]:
        for t0, t1 in [(0, 0), (0, 1), (0, 17), (3, 40)]:
            expected = sum(max(a_ + b_ * t, c_ + d_ * t) for t in range(t0, t1))
            assert T.sum_max_linear(a_, b_, c_, d_, t0, t1) == pytest.approx(expected)


def test_decode_segments_conserve_tokens():
    lengths = (3, 3, 5, 9)
    for segs, samples in [(D.continuous_segments(lengths, 8, 10), 8), (D.slot_segments(lengths, 8, 3, 10), 8)]:
        assert sum(s.live * (s.end - s.start) for s in segs) == pytest.approx(sum(lengths) * samples / 4)
    # unlimited: all start at 0; live(t) = 8·P(R > t)
    assert D.continuous_segments(lengths, 8, 10) == [
        D.Segment(0, 3, 8.0, 80.0),
        D.Segment(3, 5, 4.0, 40.0),
        D.Segment(5, 9, 2.0, 20.0),
    ]
    assert D.decode_steps(D.slot_segments(lengths, 8, 2, 0)) > max(lengths)  # queued samples start late


def test_partial_rollouts_decode_at_full_occupancy_without_the_tail():
    """Steady state: the steps make the samples' tokens at ``live`` a step, every step holding ``live`` times the
    steady mean context (E[L²]/2E[L] past the prompt), far fewer steps than the longest sample's decode."""
    lengths = (10, 10, 10, 1000)
    segs = D.steady_segments(lengths, 64, 32, 100)
    steps = D.decode_steps(segs)
    assert steps == math.ceil(64 * 257.5 / 32) and steps < 1000  # 515 steps, not 1000
    assert sum(s.live * (s.end - s.start) for s in segs) == pytest.approx(32 * steps)
    held = sum(s.ctx_base * (s.end - s.start) + s.live * (s.start + s.end - 1) * (s.end - s.start) / 2 for s in segs)
    assert held / steps == pytest.approx(32 * D.live_context(lengths, 100))
    assert max(s.ctx_base + s.live * (s.end - 1) for s in segs) < 1.05 * 32 * D.live_context(lengths, 100)
    wide = D.steady_segments(lengths, 64, 64, 100)
    assert D.decode_steps(wide) == math.ceil(steps / 2)


def test_loomrl_partial_rollouts_decode_each_sample_over_its_iterations():
    """Each sample's pieces: ``segment`` tokens in every iteration but its last, the rest in the last (by default
    the longest sample split evenly); a call holding those pieces of a heavy tail decodes its longest piece, not
    its longest sample, and the same tokens in all."""
    assert D.partial_pieces((6, 3, 1, 10), 2, 2) == (2, 4, 2, 1, 1, 2, 8)
    assert D.partial_pieces((6, 3, 1, 10), 3, None) == (4, 2, 3, 1, 4, 4, 2)
    assert sum(D.partial_pieces((640, 16, 16), 2, None)) == 672
    tail = (16,) * 63 + (2048,)
    model = llama_model(lengths=tail)
    whole = model.mfc_time(GEN, a("0-7:dp8"))
    cut = model.partial_rollout_time(GEN, a("0-7:dp8"), AsyncTraining(2, partial_rollout=True))
    assert 0.4 * whole < cut < 0.7 * whole
    assert model.partial_rollout_time(GEN, a("0-7:dp8"), AsyncTraining(2, True, 4096)) == pytest.approx(whole)


# ------------------------------------------------------------------------------------------- monotonicity


def test_doubling_tp_never_increases_per_device_memory():
    model = llama_model()
    for kind_mfc, trainable in [(TRAIN, True), (GEN, False), (INF, False)]:
        static = transient = math.inf
        for tp in (1, 2, 4, 8):
            alloc = a(f"0-{tp - 1}:dp1tp{tp}")
            now = model.static_memory("actor", alloc, trainable), model.mfc_memory(kind_mfc, alloc, trainable)
            assert now[0] <= static and now[1] <= transient
            assert model.call_memory(kind_mfc, alloc, trainable) == sum(now)
            static, transient = now


def test_more_dp_replicas_never_slow_a_generate_call():
    model = llama_model("h100:2x8")
    for tp in (1, 2):
        times = [model.mfc_time(GEN, a(f"0-{dp * tp - 1}:dp{dp}tp{tp}")) for dp in (1, 2, 4, 8)]
        assert all(later <= earlier for earlier, later in zip(times, times[1:])), times


def test_longer_responses_take_longer_to_decode():
    model = llama_model()
    alloc = a("0-7:dp4tp2")
    base = model.decode_time("actor", alloc)
    assert model.decode_time("actor", alloc, tuple(2 * n for n in LENGTHS)) > base
    assert model.decode_time("actor", alloc, tuple(n + 1 for n in LENGTHS)) > base


def test_a_heavier_tail_costs_continuous_batching_less_than_static_padding():
    model = llama_model()
    alloc = a("0-7:dp8")
    even = (200,) * 100
    tail = (190,) * 99 + (1190,)  # same mean 200, max 1190
    assert sum(even) == sum(tail)
    continuous = model.decode_time("actor", alloc, tail) - model.decode_time("actor", alloc, even)
    padded = model.decode_time("actor", alloc, tail, padded=True) - model.decode_time("actor", alloc, even, padded=True)
    assert 0 < continuous < padded / 2  # the tail steps decode 1 sample instead of every row


def test_fewer_slots_than_samples_slow_decoding():
    unlimited = llama_model().decode_time("actor", a("0-7:dp8"))
    assert llama_model(decode_slots=16).decode_time("actor", a("0-7:dp8")) > unlimited


def test_micro_batches_shrink_the_pipeline_bubble():
    model = llama_model()
    one, eight = model.time_terms(TRAIN, a("0-7:dp4pp2mb1")), model.time_terms(TRAIN, a("0-7:dp4pp2mb8"))
    assert one["pp_bubble"] / (one["work"] + one["pp_bubble"]) == pytest.approx(1 / 2)  # (pp−1)/(mb+pp−1)
    assert eight["pp_bubble"] / (eight["work"] + eight["pp_bubble"]) == pytest.approx(1 / 9)
    assert model.mfc_time(TRAIN, a("0-7:dp4pp2mb8")) < model.mfc_time(TRAIN, a("0-7:dp4pp2mb1"))


def test_communication_terms_follow_the_layout_and_the_links():
    model = llama_model("h100:2x4")
    assert model.time_terms(TRAIN, a("0-3:dp4")).get("tp_comm", 0) == 0
    assert model.time_terms(TRAIN, a("0-3:dp2tp2"))["tp_comm"] > 0
    assert model.time_terms(TRAIN, a("0:dp1"))["dp_grad_allreduce"] == 0
    within, across = model.time_terms(TRAIN, a("0-1:dp2")), model.time_terms(TRAIN, a("0,4:dp2"))
    assert across["dp_grad_allreduce"] == pytest.approx(within["dp_grad_allreduce"] * 450 / 50, rel=1e-3)
    assert 0 < model.mfc_time(ADV, a("0:dp1")) < 0.01


# ----------------------------------------------------------------------------------------- reallocation


def test_realloc_time_is_zero_for_the_same_placement_and_grows_with_bytes():
    cluster = ClusterSpec.parse("h100:8")
    half = {"hidden_size": 2048, "intermediate_size": 5504, "num_attention_heads": 16, "num_key_value_heads": 16}
    small = ModelShape.from_config(SimpleNamespace(**{**vars(LLAMA_7B), **half}))
    workload = Workload(8, 16, (16,))
    shapes = {"big": ModelShape.from_config(LLAMA_7B), "small": small}
    model = CostModel(cluster, profile_for(cluster), shapes, workload)
    assert model.realloc_time("big", a("0-7:dp4tp2"), a("0-7:dp4tp2mb2")) == 0
    for src, dst in [("0-7:dp4tp2", "0-7:dp8"), ("0-3:dp2tp2", "4-7:dp4"), ("0-7:dp4pp2", "0-7:dp1tp8")]:
        big, little = model.realloc_time("big", a(src), a(dst)), model.realloc_time("small", a(src), a(dst))
        assert 0 < little < big


def test_realloc_prices_are_shared_by_pairs_with_the_same_node_relations_only():
    """Renumbering the nodes a pair uses in their order (or shifting within the one node holding both) keeps
    every link and the devices' order the same: one priced plan serves them all, and it prices each of them
    exactly; a shift that changes which pairs share a node is priced anew."""
    from loomrl.planner.cost.realloc import realloc_seconds

    cluster = ClusterSpec.parse("h100:4x4")
    model = CostModel(
        cluster, profile_for(cluster), {"actor": ModelShape.from_config(LLAMA_7B)}, Workload(8, 16, (16,))
    )
    same = [("0-1:dp2", "2-3:tp2"), ("4-5:dp2", "6-7:tp2"), ("9-10:dp2", "11:dp1"), ("1-2:dp2", "3:dp1")]
    for src, dst in same[:2]:
        model.realloc_time("actor", a(src), a(dst))
    assert len(model.cache.reallocs) == 1
    model.realloc_time("actor", a("0-3:dp4"), a("4-7:dp4"))  # across nodes: another plan
    model.realloc_time("actor", a("8-11:dp4"), a("12-15:dp4"))  # the same, two nodes later
    model.realloc_time("actor", a("0-3:dp4"), a("12-15:dp4"))  # the same: nodes 0 and 3, in order
    model.realloc_time("actor", a("4-7:dp2tp2"), a("12-15:tp4"))
    model.realloc_time("actor", a("0-3:dp2tp2"), a("8-11:tp4"))
    assert len(model.cache.reallocs) == 3
    gaps = [("0-3:dp4", "12-15:dp4"), ("4-7:dp2tp2", "12-15:tp4"), ("0-7:dp4tp2", "12-15:tp4")]
    for src, dst in [*same, ("0-3:dp4", "4-7:dp4"), ("2-5:dp4", "6-9:dp4"), *gaps]:  # 2-5 straddles nodes
        direct = realloc_seconds(model._shape("actor"), a(src), a(dst), cluster, model.profile, model.bytes_per_param)
        # every time the model gives carries the H100's stated system factor (profiles.py)
        assert model.realloc_time("actor", a(src), a(dst)) == pytest.approx(direct * model.profile.system_factor), (
            src,
            dst,
        )


def test_the_reduced_model_moves_the_true_bytes():
    """Received bytes per device are exact; senders' balance may differ slightly (module docstring)."""
    shape = ModelShape(params=1, layers=4, hidden=256, heads=8, kv_heads=4, intermediate=512, vocab=1024)
    cluster, profile = ClusterSpec.parse("h100:2x4"), PROFILES["h100-80g"]
    for src, dst in [("0-7:dp4tp2", "0-7:dp2tp4"), ("0-3:dp2tp2", "4-7:dp4"), ("0-7:dp2pp4", "0-3:dp1tp4")]:
        true_plan = plan_reallocation(shape.param_shapes(), shape.layers, a(src), a(dst), cluster.node_of)
        true = RC.device_loads(true_plan, {name: 1.0 for name in true_plan.shapes}, 2)
        params, layers, scale = RC.reduced_model(shape, a(src), a(dst))
        reduced = RC.device_loads(plan_reallocation(params, layers, a(src), a(dst), cluster.node_of), scale, 2)
        for device, load in true.items():
            assert reduced[device].recv_intra + reduced[device].recv_inter == pytest.approx(
                load.recv_intra + load.recv_inter
            )
        assert RC.price_loads(reduced, profile) == pytest.approx(RC.price_loads(true, profile), rel=0.05)


# ------------------------------------------------------------------------------------------ corrections


def test_fit_corrections_recovers_known_factors():
    truth = {"train": (2.5, 0.3), "generate": (1.8, 0.0), "inference": (3.0, 0.05)}
    observations = [
        {"kind": kind, "predicted_s": p, "seconds": scale * p + overhead}
        for kind, (scale, overhead) in truth.items()
        for p in (0.5, 1.0, 2.0, 4.0)
    ]
    fitted = fit_corrections(observations)
    for kind, (scale, overhead) in truth.items():
        assert fitted.scale[kind] == pytest.approx(scale)
        assert fitted.overhead_s[kind] == pytest.approx(overhead, abs=1e-9)
        assert fitted.apply(kind, 10.0) == pytest.approx(scale * 10 + overhead)
    assert fitted.apply("compute", 1.0) == 1.0  # unobserved kinds stay uncorrected


def test_fit_corrections_from_a_trace_through_the_cost_model():
    """Known factors per term group (roofline, launches, tensor-parallel launches, FSDP's collective launches,
    over tensor-parallel shards too) and a per-call overhead are recovered from calls priced by the cost model
    itself."""
    from loomrl.planner.cost.corrections import group_sums

    cluster = ClusterSpec.parse("cpu:8")  # a small model on CPU: launches and roofline of similar size
    shapes = {"actor": SMALL}
    predict = trace_predictor(cluster, profile_for(cluster), shapes)
    truth = {
        "generate": ({"roofline": 1.5, "launch": 4.0, "launch_tp": 9.0}, 0.2),
        "train": ({"roofline": 2.0, "launch": 3.0, "launch_tp": 6.0, "launch_fsdp": 40.0, "launch_fsdp_tp": 70.0}, 0.5),
    }
    observations = []
    calls = [
        (64, "0-7:dp8", GEN),
        (256, "0-7:dp4tp2", GEN),
        (128, "0-3:dp4", GEN),
        (512, "0-7:dp1tp8", GEN),
        (32, "0-1:dp2", GEN),
        (128, "0-3:dp2tp2", TRAIN),
        (512, "0-7:dp4tp2mb4", TRAIN),
        (256, "0-7:dp8", TRAIN),
        (64, "0:dp1", TRAIN),
        (512, "0-7:dp2tp4", TRAIN),
        (256, "0-7:dp8fsdp", TRAIN),
        (128, "0-3:dp4mb2fsdp", TRAIN),
        (64, "0-1:dp2fsdp", TRAIN),
        (512, "0-7:dp8mb4fsdp", TRAIN),
        (128, "0-3:dp4mb2", TRAIN),
        (32, "0-1:dp2mb4", TRAIN),
        (256, "0-7:dp4tp2fsdp", TRAIN),
        (128, "0-3:dp2tp2mb2fsdp", TRAIN),
        (512, "0-7:dp2tp4mb4fsdp", TRAIN),
        (64, "0-7:dp2tp4fsdp", TRAIN),
        (256, "0-3:dp2tp2mb4fsdp", TRAIN),
        (256, "0-7:dp4tp2mb2", TRAIN),
        (64, "0-3:dp1tp4", TRAIN),
    ]
    for i, (batch, alloc, mfc) in enumerate(calls):  # lengths and steps vary, so launches are not constant
        obs = {
            "mfc": mfc.name,
            "kind": mfc.kind.value,
            "role": "actor",
            "allocation": alloc,
            "batch": batch,
            "prompt_len": 256.0,
            "response_mean": 240.0,
            "response_p90": 500.0,
            "response_max": 600.0 + 150 * i,
            "epochs": 1,
            "minibatches": 1 + i % 4,
        }
        factors, overhead = truth[mfc.kind.value]
        sums = group_sums(predict(obs))
        obs["seconds"] = sum(factors.get(g, 1.0) * sums[g] for g in sums) + overhead
        observations.append(obs)
    fitted = fit_corrections(observations, predict)
    for kind, (factors, overhead) in truth.items():
        # exact data: only the weak prior of 1 on each scale (PRIOR_WEIGHT) keeps the fit from being exact
        assert fitted.scale[kind] == pytest.approx(factors["roofline"], rel=1e-3)
        assert fitted.scale[f"{kind}.launch"] == pytest.approx(factors["launch"], rel=1e-3)
        assert fitted.scale[f"{kind}.launch_tp"] == pytest.approx(factors["launch_tp"], rel=1e-3)
        for group in ("launch_fsdp", "launch_fsdp_tp"):
            assert fitted.scale.get(f"{kind}.{group}", 1.0) == pytest.approx(factors.get(group, 1.0), rel=1e-3)
        assert fitted.overhead_s[kind] == pytest.approx(overhead, rel=1e-3)


def test_lengths_from_summary_and_observations_from_metrics():
    lengths = lengths_from_summary(240.0, 500.0, 1000.0)
    assert max(lengths) == 1000 and sum(lengths) / len(lengths) == pytest.approx(240, rel=0.01)
    assert sorted(lengths)[89] <= 500 <= sorted(lengths)[90]
    from loomrl.plan import ExecutionPlan
    from loomrl.workflow import Workflow

    workflow = Workflow([GEN, TRAIN], ("prompt_ids",))
    plan = ExecutionPlan(ClusterSpec.parse("cpu:2"), {"actor_gen": a("0-1:dp2"), "actor_train": a("0-1:dp2")})
    record = {
        "time/actor_gen_s": 3.0,
        "time/actor_train_s": 5.0,
        "response/length": 7.0,
        "response/length_p90": 9.0,
        "response/length_max": 12.0,
    }
    obs = observations_from_metrics([record, record], plan, workflow, batch=8, prompt_len=20)
    assert [(o["mfc"], o["kind"], o["allocation"], o["seconds"]) for o in obs] == [
        ("actor_gen", "generate", "0-1:dp2", 3.0),
        ("actor_train", "train", "0-1:dp2", 5.0),
    ]


# ------------------------------------------------------------------------------------------- sanity


def test_llama_7b_train_on_8_h100_is_physically_sensible():
    """512 samples of 256 + ~256 tokens, one epoch in 4 minibatches, dp4 × tp2 with 4 micro-batches.

    Range: passes run at the H100 profile's achievable rate, ``matmul_efficiency`` (0.47, Megatron's MFU) of
    the dense peak, so the model may not beat 6·P·tokens FLOPs at 8 × 0.47 × 989 TFLOP/s (2.82 s here; it was
    the peak, 1.33 s, before the profiles carried measured efficiencies); and at this size (16k tokens per
    replica per step) compute dominates, so the tp all-reduces, the dp gradient all-reduce over NVLink and the
    Adam steps must add less than the compute itself: at most 2× the bound. Memory: the trained shard (12 bytes
    per parameter / tp) plus activations of one micro-batch fits in 80 GB, while dp8 with the whole model per
    GPU does not.
    """
    model = llama_model()
    workload = model.workload
    assert model.profile.matmul_efficiency == 0.47
    bound = 6 * model.shapes["actor"].params * workload.batch * workload.mean_seq / (8 * 0.47 * 989e12)
    seconds = model.mfc_time(TRAIN, a("0-7:dp4tp2mb4"))
    assert bound <= seconds <= 2 * bound, (bound, seconds)
    assert model.call_memory(TRAIN, a("0-7:dp4tp2mb4"), trainable=True) < 80 * GB
    assert model.call_memory(TRAIN, a("0-7:dp8"), trainable=True) > 80 * GB
    # decode is memory-bound: at least one read of the weights per step of the longest response
    decode_floor = max(LENGTHS) * model.shapes["actor"].params * 2 / (2 * 3.35e12)
    assert model.decode_time("actor", a("0-7:dp4tp2")) > decode_floor


def test_operator_launches_count_passes_layers_and_decode_steps():
    """Launch terms: ops × the profile's op overhead, per slot of a pass; tensor-parallel ones named apart."""
    spec = ClusterSpec.parse("cpu:4")
    prof = profile_for(spec)
    short = CostModel(spec, prof, {"actor": SMALL}, Workload(8, 16, (10,)))
    long = CostModel(spec, prof, {"actor": SMALL}, Workload(8, 16, (20,)))
    per_step = (T.forward_ops(SMALL, SMALL.layers) + T.SAMPLE_OPS) * prof.op_overhead
    assert short.time_terms(GEN, a("0:dp1"))["decode_launch"] == pytest.approx(10 * per_step)
    assert long.time_terms(GEN, a("0:dp1"))["decode_launch"] == pytest.approx(20 * per_step)
    terms = short.time_terms(TRAIN, a("0-1:dp1tp2"))
    assert "launch_tp" in terms and "launch" not in terms and "optimizer_launch_tp" in terms
    assert terms["launch_tp"] == pytest.approx(3 * T.forward_ops(SMALL, SMALL.layers) * prof.op_overhead)
    # a pipeline stage dispatches its share of the layers, once per slot (micro-batches + bubble)
    pp = short.time_terms(INF, a("0-1:pp2mb4"))["launch"]
    assert pp == pytest.approx(5 * T.forward_ops(SMALL, SMALL.layers / 2) * prof.op_overhead)


def test_queued_launches_add_only_what_exceeds_the_work():
    import dataclasses

    spec = ClusterSpec.parse("cpu:4")
    sync = profile_for(spec)
    queued = dataclasses.replace(sync, async_launch=True)
    for workload in (Workload(8, 16, (10,)), Workload(512, 16, (10,))):  # launch-bound, then work-bound
        eager = CostModel(spec, sync, {"actor": SMALL}, workload).time_terms(GEN, a("0:dp1"))
        overlapped = CostModel(spec, queued, {"actor": SMALL}, workload).time_terms(GEN, a("0:dp1"))
        assert overlapped["decode"] == eager["decode"]
        assert overlapped["decode_launch"] == pytest.approx(max(0.0, eager["decode_launch"] - eager["decode"]))
    assert PROFILES["h100-80g"].async_launch and not PROFILES["local"].async_launch


def test_activation_recompute_trades_a_forward_for_activation_memory():
    model = llama_model()
    plain, recomputed = a("0-7:dp2tp4mb4"), Allocation.parse("0-7:dp2tp4mb4rc")
    assert recomputed.recompute and not plain.recompute
    work = model.time_terms(TRAIN, plain)["work"]
    assert model.time_terms(TRAIN, recomputed)["work"] == pytest.approx(work * 4 / 3, rel=0.02)
    assert model.mfc_time(TRAIN, recomputed) > model.mfc_time(TRAIN, plain)
    assert model.mfc_memory(TRAIN, recomputed, True) < model.mfc_memory(TRAIN, plain, True) / 4
    assert model.static_memory("actor", recomputed, True) == model.static_memory("actor", plain, True)


def test_zero_divides_adam_state_and_step_over_dp_for_one_all_gather():
    """ZeRO-1 on dp4 × tp2 (7B, bf16): the fp32 master weights and moments (12 of the 18 bytes per parameter
    of a trained copy) shrink 4×, the Adam step covers a quarter of the weights, and one all-gather of the tp
    shard is added."""
    model = llama_model()
    plain, zero = a("0-7:dp4tp2"), Allocation.parse("0-7:dp4tp2zero")
    params = model._shape("actor").params
    assert model.static_memory("actor", plain, True) == pytest.approx(params * 18 / 2, rel=1e-6)
    assert model.static_memory("actor", zero, True) == pytest.approx(params * (6 + 12 / 4) / 2, rel=1e-6)
    assert model.static_memory("actor", zero, False) == model.static_memory("actor", plain, False)
    p, z = model.time_terms(TRAIN, plain), model.time_terms(TRAIN, zero)
    assert z["optimizer"] == pytest.approx(p["optimizer"] / 4)
    steps = 4  # minibatches, one epoch
    bw = PROFILES["h100-80g"].intra_node_bw
    assert z["zero_allgather"] == pytest.approx(steps * params / 2 * 2 * 3 / 4 / bw, rel=0.01)
    assert "zero_allgather" not in p and z["work"] == p["work"]
    assert model.mfc_memory(TRAIN, zero, True) == model.mfc_memory(TRAIN, plain, True)


def test_fsdp_divides_the_whole_training_state_and_prices_gathers_overlapped_on_gpus_only():
    """FSDP on dp8 (7B, bf16): 16 bytes per parameter over 8 (fp32 shards, gradients, moments); the step's Adam
    covers an eighth of the fp32 weights; per micro-batch two all-gathers of the bf16 weights and one
    reduce-scatter of fp32 gradients, hidden behind the pass on a GPU but for one layer's gather, all of them
    on a CPU; the gathered layers and the root unit add transient memory."""
    model = llama_model()
    plain, fsdp = a("0-7:dp8"), Allocation.parse("0-7:dp8mb2fsdp")
    params, layers = model._shape("actor").params, model._shape("actor").layers
    assert model.static_memory("actor", fsdp, True) == pytest.approx(params * 16 / 8, rel=1e-6)
    assert model.static_memory("actor", fsdp, False) == model.static_memory("actor", plain, False)
    p, f = model.time_terms(TRAIN, a("0-7:dp8mb2")), model.time_terms(TRAIN, fsdp)
    assert "dp_grad_allreduce" not in f and "fsdp_comm" in f and f["work"] == p["work"]
    assert f["optimizer"] == pytest.approx(4 * T.adam_step_bytes(params / 8, 4) / PROFILES["h100-80g"].mem_bandwidth)
    steps, bw = 4, PROFILES["h100-80g"].intra_node_bw
    gather = params * 2 * 7 / 8 / bw  # per all-gather of the bf16 weights
    comm = 2 * (2 * gather + 2 * gather)  # two micro-batches: two gathers and one fp32 (twice the bytes) scatter
    pass_seconds = sum(v for k, v in p.items() if k not in ("dp_grad_allreduce", "optimizer", "optimizer_launch"))
    assert f["fsdp_comm"] == pytest.approx(steps * (max(0.0, comm - pass_seconds / steps) + gather / layers), rel=0.01)
    assert model.mfc_memory(TRAIN, fsdp, True) > model.mfc_memory(TRAIN, a("0-7:dp8mb2"), True)
    cpu = llama_model("cpu:2")
    c = cpu.time_terms(TRAIN, Allocation.parse("0-1:dp2fsdp"))
    assert c["fsdp_comm"] == pytest.approx(
        steps
        * 3
        * T.ring_allgather_time(params * 4, 2, PROFILES["local"].intra_node_bw, PROFILES["local"].link_latency),
        rel=1e-6,
    )


def test_reloading_an_offloaded_role_is_its_shard_over_the_host_link_on_accelerators_only():
    model = llama_model()
    alloc = a("0-7:dp4tp2")
    shard = model.static_memory("actor", alloc, False)  # bf16 weights over tp=2
    assert shard == pytest.approx(ModelShape.from_config(LLAMA_7B).params * 2 / 2, rel=1e-6)
    h100 = PROFILES["h100-80g"]
    assert model.offloads() and model.reload_time("actor", alloc) == pytest.approx(
        (shard / h100.host_bw + h100.link_latency) * h100.system_factor
    )  # the H100's stated factor, as every time
    assert model.reload_time("actor", a("0-7:dp2tp4")) < model.reload_time("actor", alloc)  # a smaller shard
    cpu = llama_model("cpu:2")  # CPU devices are their own host: the runtime keeps every role resident
    assert not cpu.offloads() and cpu.reload_time("actor", a("0-1:dp2")) == 0.0
    assert all(p.host_offload for name, p in PROFILES.items() if name != "local")


def test_a_shared_prompt_is_priced_once_where_the_runtime_computes_it_once():
    spec = ClusterSpec.parse("h100:8")

    def model(group: int, shared: bool) -> CostModel:
        workload = Workload(
            batch=512, prompt_len=1024, response_lengths=LENGTHS, minibatches=4, samples_per_prompt=group
        )
        return CostModel(
            spec,
            profile_for(spec),
            {"actor": ModelShape.from_config(LLAMA_7B)},
            workload,
            settings=SystemSettings(packing=False, sorted_passes=True, shared_prompts=shared),
        )

    whole, plain = a("0-7:dp2tp4mb4"), a("0-7:dp8")
    for mfc in (TRAIN, INF):
        unshared, shared = model(8, False), model(8, True)
        for alloc in (whole, plain):
            assert shared.time_terms(mfc, alloc)["work"] < 0.8 * unshared.time_terms(mfc, alloc)["work"]
            assert shared.mfc_memory(mfc, alloc, mfc is TRAIN) < unshared.mfc_memory(mfc, alloc, mfc is TRAIN)
        # one sample per prompt, pipeline stages, FSDP and recomputed training passes compute every prompt
        assert model(1, True).time_terms(mfc, whole) == model(1, False).time_terms(mfc, whole)
        for other in ("0-7:dp4pp2mb4", "0-7:dp8fsdp"):
            assert shared.time_terms(mfc, a(other)) == unshared.time_terms(mfc, a(other))
    recomputed = a("0-7:dp2tp4mb4rc")
    assert model(8, True).time_terms(TRAIN, recomputed) == model(8, False).time_terms(TRAIN, recomputed)
    assert model(8, True).time_terms(INF, recomputed)["work"] < model(8, False).time_terms(INF, recomputed)["work"]


def test_a_multi_turn_call_decodes_its_sampled_tokens_prefills_its_observations_and_waits_its_environment():
    from loomrl.planner.cost.workload import EpisodeShape

    episodic = MFC("actor_gen", "actor", MFCKind.GENERATE, ("prompt_ids",), ("response_ids",), multi_turn=True)
    shape = EpisodeShape(turns=4, observed_tokens=96, env_step_s=0.05)
    plain, multi = llama_model(), llama_model(episodes=shape)
    alloc = a("0-7:dp8")
    # one response per prompt: the shape changes nothing, nor does it for a call that is not multi-turn
    assert multi.time_terms(GEN, alloc) == plain.time_terms(GEN, alloc)
    assert multi.mfc_time(GEN, alloc) == plain.mfc_time(GEN, alloc)
    terms = multi.time_terms(episodic, alloc)
    assert terms["decode"] == plain.time_terms(GEN, alloc)["decode"], "the response lengths are sampled tokens"
    prefill = plain.prefill_terms("actor", alloc, 512 / 8 * 3, 96 / 3 + 1)
    assert terms["continue_work"] == pytest.approx(prefill["prefill_work"]) and terms["continue_work"] > 0
    hardware = multi.corrections.apply_terms(MFCKind.GENERATE, terms) * multi.system_factor
    assert multi.mfc_time(episodic, alloc) == pytest.approx(hardware + 4 * 0.05), "a wait after every turn"
    # the kept caches: every episode of a device's share before its last turn, its prompt and 3/4 of its response
    kept = multi.mfc_memory(episodic, alloc, False) - plain.mfc_memory(GEN, alloc, False)
    w, shape = multi.workload, multi.shapes["actor"]
    per_token = 2 * shape.layers * shape.kv_dim * multi.bytes_per_param
    assert kept > 0 and kept == pytest.approx(512 / 8 * (w.prompt_len + (w.mean_response + 96) * 3 / 4) * per_token)
    assert multi.mfc_memory(GEN, alloc, False) == plain.mfc_memory(GEN, alloc, False)
    with pytest.raises(Exception, match=r"workload\.episodes\.turns: 0.5 is not a number >= 1"):
        EpisodeShape(turns=0.5)


def test_a_runs_measured_episodes_reach_its_workload():
    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import load_config
    from loomrl.planner.cost.workload import EpisodeShape
    from loomrl.planner.inputs import inputs_from_config

    cluster = ClusterSpec.parse("cpu:2")
    cfg = load_config(TrainConfig, None, ["rollout.env.name=guess", "rollout.env.max_turns=5"])
    inputs = inputs_from_config(cfg, cluster)
    assert inputs.workload.episodes == EpisodeShape(5)  # before any measurement: every turn, no observation
    metrics = {"episode/turns": 3.0, "episode/observed_tokens": 12.0, "episode/env_s": 0.3}
    measured = inputs.workload_of([8, 9], 20.0, metrics).episodes
    assert (measured.turns, measured.observed_tokens) == (3.0, 12.0) and measured.env_step_s == pytest.approx(0.1)
    assert inputs.workload_of([8], 20.0, {}).episodes == EpisodeShape(5), "an iteration without them keeps the given"
    plain = inputs_from_config(load_config(TrainConfig, None, []), cluster)
    assert plain.workload_of([8], 20.0, metrics).episodes is None, "a run without episodes has none"


def test_a_runtime_computing_the_head_at_the_response_skips_the_prompts_logits():
    """``head_tokens: response`` (loomrl's runtime): scoring and training passes compute the vocabulary head at
    the response positions only, so a long prompt costs its layers but not its logits; with a one-token prompt
    there is nothing to skip. SmolLM2-135M's shape: its 49,152 × 576 head is a fifth of its arithmetic per token."""
    spec = ClusterSpec.parse("h100:8")
    smollm2 = SimpleNamespace(
        model_type="llama",
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
    shapes = {"actor": ModelShape.from_config(smollm2)}

    def work(mfc, prompt, head):
        workload = Workload(batch=512, prompt_len=prompt, response_lengths=LENGTHS, minibatches=4)
        model = CostModel(spec, profile_for(spec), shapes, workload, settings=SystemSettings(head_tokens=head))
        return model.time_terms(mfc, a("0-7:dp8"))["work"]

    for mfc in (INF, TRAIN):
        assert work(mfc, 1024, "response") < 0.9 * work(mfc, 1024, "all")
        assert work(mfc, 1, "response") == pytest.approx(work(mfc, 1, "all"), rel=0.005)
