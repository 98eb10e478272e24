"""`loomrl plan`: compare the heuristic placements with a searched plan for a workload on a cluster.

Every strategy (colocate, interleave, separate) gets its best layouts by enumeration, so the comparison with the
search is fair; the searched plan is always printed next to them. Models are given by HF-style configs: the
zoo's, a checkpoint's, or the LLaMA-2 architecture presets below for planning large clusters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Mapping

from loomrl.errors import ConfigError
from loomrl.plan import ClusterSpec, ExecutionPlan
from loomrl.planner.search.bounds import IterationBound, iteration_bound
from loomrl.planner.cost.corrections import Corrections
from loomrl.planner.cost.model import CostModel
from loomrl.plan.hardware import HardwareProfile, profile_for
from loomrl.planner.cost.system import SystemSettings
from loomrl.planner.search.search import CachedCost, best_heuristic_plans, search
from loomrl.planner.simulation.simulator import SimResult
from loomrl.planner.cost.workload import ModelShape, Workload
from loomrl.workflow import Workflow


def _decoder(model_type: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
             **extra: object) -> SimpleNamespace:
    """An HF ``config.json`` as attributes (the fields :func:`loomrl.plan.memory.model_dims` reads)."""
    return SimpleNamespace(model_type=model_type, hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                           vocab_size=vocab, **{"tie_word_embeddings": False, **extra})


def _opt(hidden: int, layers: int, heads: int) -> SimpleNamespace:
    """OPT: plain (two-matrix) MLP of 4·hidden, tied embeddings, 50272-token vocabulary."""
    return SimpleNamespace(model_type="opt", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                           ffn_dim=4 * hidden, vocab_size=50272, tie_word_embeddings=True)


# Published architectures, each the fields of its Hugging Face config.json (huggingface.co/<repo>/blob/main/
# config.json for the repo named beside it); any other model: give its config.json (--model path/config.json).
MODEL_PRESETS: dict[str, SimpleNamespace] = {
    # meta-llama/Llama-2-{7b,13b,70b}-hf, codellama/CodeLlama-34b-hf (the models of ReaLHF's experiments)
    "llama2-7b": _decoder("llama", 4096, 32, 32, 32, 11008, 32000),
    "llama2-13b": _decoder("llama", 5120, 40, 40, 40, 13824, 32000),
    "llama2-34b": _decoder("llama", 8192, 48, 64, 8, 22016, 32000),
    "llama2-70b": _decoder("llama", 8192, 80, 64, 8, 28672, 32000),
    # meta-llama/Llama-3.1-8B, meta-llama/Meta-Llama-3-70B (Llama 3.1 70B has the same shape), Llama-3.1-405B
    "llama3.1-8b": _decoder("llama", 4096, 32, 32, 8, 14336, 128256),
    "llama3-70b": _decoder("llama", 8192, 80, 64, 8, 28672, 128256),
    "llama3.1-70b": _decoder("llama", 8192, 80, 64, 8, 28672, 128256),
    "llama3.1-405b": _decoder("llama", 16384, 126, 128, 8, 53248, 128256),
    # Qwen/Qwen2.5-7B (Qwen2.5-Math-7B: the same shape), Qwen/Qwen2.5-32B
    "qwen2.5-7b": _decoder("qwen2", 3584, 28, 28, 4, 18944, 152064),
    "qwen2.5-32b": _decoder("qwen2", 5120, 64, 40, 8, 27648, 152064),
    # Qwen/Qwen3-8B, Qwen/Qwen3-32B: head_dim 128 whatever the hidden size
    "qwen3-8b": _decoder("qwen3", 4096, 36, 32, 8, 12288, 151936, head_dim=128),
    "qwen3-32b": _decoder("qwen3", 5120, 64, 64, 8, 25600, 151936, head_dim=128),
    # Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B: 128 routed experts, 8 per token, no shared expert
    "qwen3-30b-a3b": _decoder("qwen3_moe", 2048, 48, 32, 4, 6144, 151936, head_dim=128, num_experts=128,
                              num_experts_per_tok=8, moe_intermediate_size=768),
    "qwen3-235b-a22b": _decoder("qwen3_moe", 4096, 94, 64, 4, 12288, 151936, head_dim=128, num_experts=128,
                                num_experts_per_tok=8, moe_intermediate_size=1536),
    # facebook/opt-{350m,1.3b,6.7b,13b,30b,66b} (DeepSpeed-Chat's models)
    "opt-350m": _opt(1024, 24, 16),
    "opt-1.3b": _opt(2048, 24, 32),
    "opt-6.7b": _opt(4096, 32, 32),
    "opt-13b": _opt(5120, 40, 40),
    "opt-30b": _opt(7168, 48, 56),
    "opt-66b": _opt(9216, 64, 72),
}


def model_config(name: str, tokenizer=None) -> object:
    """An architecture to plan with: a preset above, an HF ``config.json`` file (read as it is: no weights, no
    network), a zoo model (``llama-1m``; its vocabulary from ``tokenizer``, by default the built-in one) or a
    local HF checkpoint directory (its ``config.json``)."""
    from pathlib import Path

    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]
    if name.endswith(".json"):
        return read_config_json(name)
    from loomrl.models.zoo import ZOO, zoo_config

    if name in ZOO or Path(name, "config.json").is_file():
        from loomrl.models.tokenizer import tokenizer_for

        if name in ZOO:
            return zoo_config(name, tokenizer or tokenizer_for(None))
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name)
    raise ConfigError(f"model: '{name}' is not a preset, a config.json, a zoo model or a checkpoint directory; "
                      f"presets: {', '.join(MODEL_PRESETS)}; zoo: {', '.join(ZOO)}")


def read_config_json(path: str) -> SimpleNamespace:
    """An HF ``config.json`` as attributes; one-line errors name the file and what is missing."""
    import json
    from pathlib import Path

    from loomrl.errors import DataError
    from loomrl.plan.memory import model_dims

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read a model config ({err})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: a model config is a JSON object (an HF config.json)")
    config = SimpleNamespace(**data)
    try:
        model_dims(config)
    except (AttributeError, TypeError, ValueError) as err:
        raise DataError(f"{path}: not a decoder config ({err}); needed: hidden_size, num_hidden_layers, "
                        "num_attention_heads, vocab_size") from None
    return config


SEARCH_CHAINS = 8
"""Annealing chains of :func:`compare_plans`: one from each heuristic's best plan, the rest from the best
crossovers of them. In the plan_search benchmark (docs/benchmarks.md) eight shorter walks found
faster plans than four longer ones in 5 of 12 setups (13B on 16 GPUs, 384 tokens: 7.08 s, against 7.21 s with
two of three seeds for four chains; 70B/128: 7.76 s against 7.94 s), a slower one in one (70B/384: 16.53 s
against 16.35 s), the same in the others."""

MIN_SEARCH_SHARE = 0.25
"""Least share of :func:`compare_plans`' time budget left to the search, however long the heuristics took."""
BOUND_SHARE = 0.25
"""Share of :func:`compare_plans`' time budget the lower bound may take (past it, it falls back to its looser
rule, which holds for every plan), but at least :data:`MIN_BOUND_S`."""
MIN_BOUND_S = 3.0
"""Seconds the lower bound may always take: enumerating an 8-GPU cluster's training placements takes ~0.7 s
here (more on a loaded machine), so a budget of a few seconds still gets the placement-wise bound."""
HEURISTIC_SHARE = 0.35
"""Share of the budget the heuristics' layout enumeration may take, after the bound (past it, each keeps the
best layouts it has simulated)."""


@dataclass
class PlanningReport:
    rows: list[dict]
    """One row per strategy and for the search: time, peak memory, speedup over colocate."""
    best: tuple[str, ExecutionPlan, SimResult]
    heuristics: dict[str, tuple[ExecutionPlan, SimResult]]
    searched: list[tuple[ExecutionPlan, SimResult]]
    bound: IterationBound
    """No plan of the search's space is faster than ``bound.seconds`` (:mod:`loomrl.planner.search.bounds`)."""

    @property
    def search_speedup(self) -> float:
        """Searched plan vs the best feasible heuristic (≥ 1 means the search found something as good)."""
        feasible = [r.iteration_time for _, r in self.heuristics.values() if r.feasible]
        if not feasible or not self.searched:
            return float("nan")
        return min(feasible) / self.searched[0][1].iteration_time


def _fusions(plan: ExecutionPlan) -> str:
    """The plan's fusions in a few words: inter-stage (its migration), intra-stage (train), or no."""
    parts = [] if plan.stream_fusion is None else [f"at {plan.stream_fusion.migrate_at}, to {plan.stream_fusion.migrate_to}"]
    return "; ".join(parts + (["train"] if plan.pipeline_fusion else [])) or "no"


def compare_plans(workflow: Workflow, cluster: ClusterSpec, configs: Mapping[str, object], workload: Workload,
                  *, seed: int = 0, time_budget_s: float = 30.0, chains: int = SEARCH_CHAINS,
                  profile: HardwareProfile | None = None, corrections: Corrections | None = None,
                  bytes_per_param: int | None = None, settings: SystemSettings | None = None) -> PlanningReport:
    """Best layouts of each heuristic strategy, then a seeded, time-bounded search; all simulated; and the
    lower bound on any plan's time (:func:`~loomrl.planner.search.bounds.iteration_bound`).

    ``time_budget_s`` bounds the whole comparison: the bound may take :data:`BOUND_SHARE` of it (at least
    :data:`MIN_BOUND_S`), the heuristics' enumeration up to :data:`HEURISTIC_SHARE` more, and the search what is
    left, at least :data:`MIN_SEARCH_SHARE`; each stops at its deadline with what it has (the total then exceeds
    the budget by at most the bound's minimum and the pricing of the candidate allocations, which all three
    share through one cache).

    ``profile`` replaces the cluster's named profile (e.g. this machine measured by ``loomrl calibrate``) and
    ``corrections`` are fitted ones (``loomrl calibrate --from``); by default the datasheet profile, uncorrected.
    ``bytes_per_param``: the weights' element size (:data:`~loomrl.planner.cost.model.PRECISION_BYTES`); by default
    the runtime's ``precision: auto`` on the profile's devices. ``settings``: how the system runs the calls
    (:class:`~loomrl.planner.cost.system.SystemSettings`; loomrl's runtime by default)."""
    profile = profile or profile_for(cluster)
    shapes = {role: None if cfg is None else ModelShape.from_config(cfg) for role, cfg in configs.items()}
    began = time.monotonic()
    cost = CachedCost(CostModel(cluster, profile, shapes, workload, corrections, bytes_per_param=bytes_per_param,
                                settings=settings))
    memory = profile.memory_bytes
    # their prices are the search's, cached
    bound_s = max(BOUND_SHARE * time_budget_s, MIN_BOUND_S)
    bound = iteration_bound(workflow, cluster, cost, memory, configs, deadline=began + bound_s)
    heuristics = best_heuristic_plans(workflow, cluster, cost, memory, configs,
                                      deadline=began + bound_s + HEURISTIC_SHARE * time_budget_s)
    search_s = max(time_budget_s - (time.monotonic() - began), MIN_SEARCH_SHARE * time_budget_s)
    feasible = sorted(((r.iteration_time, name, p) for name, (p, r) in heuristics.items() if r.feasible),
                      key=lambda t: t[0])
    # chains start from every feasible heuristic, fastest first (colocate with pure dp when none fits)
    starts = [plan for _, _, plan in feasible] or None
    searched = search(workflow, cluster, cost, memory, configs, seed=seed, time_budget_s=search_s,
                      chains=chains, start=starts)
    base = heuristics["colocate"][1]
    rows = []
    for name, (plan, result) in [*heuristics.items(), *(("searched", s) for s in searched[:1])]:
        rows.append({"plan": name, "feasible": result.feasible,
                     "s/iteration": result.iteration_time if result.feasible else float("nan"),
                     "peak GB/device": max(result.peak_memory.values(), default=0.0) / 2**30,
                     "offloaded": (", ".join(plan.offloaded_roles(workflow)) or "none")
                     if profile.host_offload else "none (CPU)",
                     "fused": _fusions(plan),
                     "speedup vs colocate": (base.iteration_time / result.iteration_time
                                             if base.feasible and result.feasible else float("nan"))})
    candidates = [(r.iteration_time, n, p, r) for n, (p, r) in heuristics.items() if r.feasible]
    candidates += [(r.iteration_time, "searched", p, r) for p, r in searched[:1]]
    if not candidates:  # report the least infeasible plan, with the reason, rather than nothing
        plan, result = heuristics["colocate"]
        return PlanningReport(rows, ("colocate (infeasible)", plan, result), heuristics, searched, bound)
    _, name, plan, result = min(candidates, key=lambda t: t[0])
    return PlanningReport(rows, (name, plan, result), heuristics, searched, bound)

