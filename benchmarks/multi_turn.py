"""Multi-turn rollouts: what an environment's latency costs generation, and what keeping each episode's cache
across turns saves, measured beside the planner's prediction.

    .venv/bin/python benchmarks/multi_turn.py [--model llama-10m] [--episodes 64] [--turns 4] [--latency-ms 50]

Episodes of ``--turns`` turns: each turn samples ``--turn-tokens`` tokens (eos ignored, so every run decodes the
same tokens), then a scripted environment sleeps ``--latency-ms`` (a tool call's latency) and answers with
``--observed`` tokens; prompts are ``--prompt`` tokens long. Variants, run in interleaved rounds (``--repeats``):

- *kept cache, no latency*: the reference throughput;
- *kept cache, latency*: the same episodes waiting on their environment. Many episodes are in flight, and one
  waiting on its environment holds no decode row, so the others decode meanwhile;
- *re-prefill, no latency*: every turn prefills the episode's whole history again (``keep_cache=False``), what an
  engine without kept caches does.

Throughput counts sampled tokens. The planner's prediction prices the same call with the machine's measured
profile (``calibrate_local``, uncorrected: no correction was fitted, so nothing predicted here was fitted on what
it is checked against), its multi-turn terms (continuation prefills and environment waits, priced whole per turn)
beside the measurement; re-prefilling is priced as prefilling the whole history at each later turn.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from loomrl.envs import StepResult  # noqa: E402
from loomrl.models.presets import model_config  # noqa: E402
from loomrl.models.tokenizer import build_char_tokenizer  # noqa: E402
from loomrl.models.zoo import build_causal_lm  # noqa: E402
from loomrl.plan import Allocation, ClusterSpec  # noqa: E402
from loomrl.plan.model_shape import ModelShape  # noqa: E402
from loomrl.planner.calibration.local import calibrate_local  # noqa: E402
from loomrl.planner.cost.model import CostModel  # noqa: E402
from loomrl.planner.cost.workload import EpisodeShape, Workload  # noqa: E402
from loomrl.report import summary_table  # noqa: E402
from loomrl.rollout import RolloutEngine, SamplingParams, stream_keys  # noqa: E402
from loomrl.rollout.episodes import Episode, EpisodeSettings, ObservationTokens, run_episodes  # noqa: E402
from loomrl.workflow import MFC, MFCKind  # noqa: E402

TOKENIZER = build_char_tokenizer()


@dataclass
class Scripted:
    """Ends after ``turns`` turns; each step sleeps ``latency`` seconds and answers ``observed`` characters."""

    turns: int
    latency: float
    observed: int
    seen: int = 0

    def step(self, text: str) -> StepResult:
        time.sleep(self.latency)
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult([], 1.0, True)
        return StepResult([{"role": "user", "content": "ok" + "k" * (self.observed - 2)}])


def run(model, args, latency: float, keep_cache: bool) -> tuple[float, int]:
    """Seconds for every episode and the tokens they sampled."""
    rng = random.Random(0)
    keys = stream_keys(0, 0, range(args.episodes)).tolist()
    budget = args.turns * args.turn_tokens + (args.turns - 1) * args.observed + 1  # room after the last turn
    episodes = [
        Episode(i, [1] + [rng.randint(4, 40) for _ in range(args.prompt - 1)], keys[i], budget, None)
        for i in range(args.episodes)
    ]
    for ep in episodes:
        ep.env = Scripted(args.turns, latency, args.observed)
    params = SamplingParams(max_new_tokens=budget, temperature=1.0, ignore_eos=True)
    engine = RolloutEngine(model, params, 2, 0, slots=args.episodes, max_len=args.prompt + budget)
    settings = EpisodeSettings(
        max_turns=args.turns, turn_tokens=args.turn_tokens, workers=args.episodes, keep_cache=keep_cache
    )
    start = time.perf_counter()
    with torch.no_grad():
        run_episodes(engine, episodes, ObservationTokens(TOKENIZER, [2]), TOKENIZER.decode, settings)
    seconds = time.perf_counter() - start
    assert all(ep.finish == "done" and ep.turns == args.turns for ep in episodes), "every episode ran every turn"
    return seconds, sum(ep.mask.count(1) for ep in episodes)


def predictions(args, latency: float, profile) -> dict[str, float]:
    """The planner's seconds for the call with and without latency, and with re-prefilling instead of kept
    caches, on this machine's measured profile."""
    cluster = ClusterSpec(nodes=1, devices_per_node=1, device_kind="cpu")
    shape = ModelShape.from_config(model_config(args.model))
    sampled = args.turns * args.turn_tokens
    observed = (args.turns - 1) * args.observed

    def cost(step_s: float) -> CostModel:
        episodes = EpisodeShape(args.turns, observed, step_s)
        workload = Workload(args.episodes, args.prompt, (sampled,), decode_slots=args.episodes, episodes=episodes)
        return CostModel(cluster, profile, {"actor": shape}, workload)

    mfc = MFC("actor_gen", "actor", MFCKind.GENERATE, ("prompt_ids",), ("response_ids",), multi_turn=True)
    alloc = Allocation.parse("0:dp1")
    zero, slow = cost(0.0), cost(latency)
    terms = zero.time_terms(mfc, alloc)
    kept = sum(v for k, v in terms.items() if k.startswith("continue_"))
    # re-prefilling: each later turn prefills the prompt and the whole history so far
    history = [args.prompt + t * (args.turn_tokens + args.observed) for t in range(1, args.turns)]
    again = sum(sum(zero.prefill_terms("actor", alloc, args.episodes, n).values()) for n in history)
    return {
        "zero": zero.mfc_time(mfc, alloc),
        "latency": slow.mfc_time(mfc, alloc),
        "reprefill": zero.mfc_time(mfc, alloc) - kept * zero.system_factor + again * zero.system_factor,
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-10m")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--observed", type=int, default=8, help="observation tokens per turn")
    ap.add_argument("--prompt", type=int, default=96, help="prompt tokens")
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build_causal_lm(args.model, TOKENIZER, seed=0).eval()
    latency = args.latency_ms / 1000
    variants = {
        "kept cache, no latency": (0.0, True),
        f"kept cache, {args.latency_ms:g} ms latency": (latency, True),
        "re-prefill, no latency": (0.0, False),
    }
    run(model, args, 0.0, True)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    tokens = 0
    for _ in range(args.repeats):  # interleaved, so that a slow spell of the machine hits every variant
        for name, (lat, keep) in variants.items():
            s, tokens = run(model, args, lat, keep)
            seconds[name].append(s)
    predicted = predictions(args, latency, calibrate_local(1))
    base = seconds["kept cache, no latency"]
    rows = []
    for (name, values), key in zip(seconds.items(), ("zero", "latency", "reprefill")):
        ratio = [b / v for b, v in zip(base, values)]  # per round: throughput relative to the reference
        rows.append(
            {
                "variant": name,
                "seconds": spread(values),
                "sampled tokens/s": f"{statistics.median(tokens / v for v in values):.0f}",
                "throughput vs kept, no latency": spread(ratio),
                "predicted s": f"{predicted[key]:.2f}",
                "predicted ratio": f"{predicted['zero'] / predicted[key]:.2f}",
            }
        )
    console = Console(width=150)
    console.print(summary_table(rows, f"multi-turn rollouts: {args.episodes} episodes × {args.turns} turns"))
    reuse = [r / k for r, k in zip(seconds["re-prefill, no latency"], base)]
    console.print(
        f"kept caches beat re-prefilling by {spread(reuse)}× (predicted "
        f"{predicted['reprefill'] / predicted['zero']:.2f}×); with {args.latency_ms:g} ms per environment step, "
        f"throughput is {spread([b / v for b, v in zip(base, seconds[list(seconds)[1]])])} of the zero-latency run "
        f"(target ≥ 0.80; predicted {predicted['zero'] / predicted['latency']:.2f})"
    )


if __name__ == "__main__":
    main()
