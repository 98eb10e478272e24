"""The training–inference mismatch of each rollout backend: its sampled tokens' log-probs against the trainer's.

    .venv/bin/python benchmarks/mismatch.py [--model smollm2-135m-instruct] [--prompts 64] [--tokens 32]
        [--precision fp32 bf16]

For each precision and backend (loomrl's rollout engine; vLLM, its CPU build here, as ``rollout.backend=vllm``
runs it), the same arithmetic chat prompts are sampled (temperature 1, ``--tokens`` new tokens), then the model
as the trainer holds it (transformers, eager attention, the same weights and precision) recomputes every sampled
token's log-prob in one forward pass. The table gives the figures a run logs every iteration
(:mod:`loomrl.algorithms.mismatch`): mean |Δ log-prob|, the mean of exp|Δ| (``token_mult_prob_error``), the k3
estimate of KL(sampler ‖ trainer) and the normalised effective sample size of the importance weights, plus the
largest |Δ|.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from loomrl.report import summary_table  # noqa: E402

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _prompts(tokenizer, n: int) -> list[list[int]]:
    from loomrl.config.schema import TaskConfig
    from loomrl.data.sources import build_task, examples_window, prompt_source
    from loomrl.models.tokenizer import encode_prompt

    cfg = TaskConfig(name="arith", level=1)
    return [
        encode_prompt(tokenizer, ex.prompt)
        for ex in examples_window(prompt_source(cfg, build_task(cfg), 0, "train"), 0, n)
    ]


def _sample(backend: str, model, prompts, tokens: int, eos: int):
    from loomrl.rollout.engine import Request, RolloutEngine
    from loomrl.rollout.sampling import SamplingParams, stream_keys
    from loomrl.rollout.vllm_engine import VLLMEngine

    params = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    keys = stream_keys(0, 0, range(len(prompts))).tolist()
    requests = [Request(i, list(p), k) for i, (p, k) in enumerate(zip(prompts, keys))]
    if backend == "loomrl":
        with torch.no_grad():
            engine = RolloutEngine(model, params, eos, 0, slots=len(prompts), max_len=max(map(len, prompts)) + tokens)
            return engine.generate(requests)
    engine = VLLMEngine(model, max_len=max(map(len, prompts)) + tokens, slots=len(prompts))
    try:
        engine.sync(model, 1)
        return engine.generate_with(requests, params, [eos], 1)
    finally:
        engine.close()


def _trainer_logps(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def measure(model_name: str, precision: str, prompts_n: int, tokens: int) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loomrl.algorithms.mismatch import mismatch_metrics, mismatch_sums
    from loomrl.models.attention import EAGER, use_attention
    from loomrl.models.pretrained import pretrained_dir

    path = pretrained_dir(model_name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=PRECISIONS[precision]).eval()
    use_attention(model, EAGER)
    prompts = _prompts(tokenizer, prompts_n)
    rows = []
    for backend in ("loomrl", "vllm"):
        done = _sample(backend, model, prompts, tokens, tokenizer.eos_token_id)
        trainer = [_trainer_logps(model, p, c.tokens) for p, c in zip(prompts, done)]
        width = max(len(c.tokens) for c in done)
        trainer_BT, behav_BT, mask_BT = (torch.zeros(len(done), width, dtype=torch.float64) for _ in range(3))
        for b, (c, t) in enumerate(zip(done, trainer)):
            n = len(c.tokens)
            trainer_BT[b, :n], behav_BT[b, :n], mask_BT[b, :n] = t.double(), torch.tensor(c.logps).double(), 1
        figures = mismatch_metrics(mismatch_sums(trainer_BT, behav_BT, mask_BT))
        rows.append(
            {
                "precision": precision,
                "backend": backend,
                "tokens": int(mask_BT.sum()),
                "mean |Δ logp|": figures["mismatch/mean_abs_logp_diff"],
                "max |Δ logp|": float(((trainer_BT - behav_BT).abs() * mask_BT).max()),
                "token_mult_prob_error": figures["mismatch/token_mult_prob_error"],
                "k3 KL": figures["mismatch/k3_kl"],
                "ESS": figures["mismatch/ess"],
            }
        )
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a pretrained name")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=sorted(PRECISIONS))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.prompts < 1 or args.tokens < 1:
        print("mismatch.py: error: --prompts and --tokens must be at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rows = [r for p in args.precision for r in measure(args.model, p, args.prompts, args.tokens)]
    Console(width=180).print(summary_table(rows, f"sampler against trainer log-probs: {args.model}, temperature 1"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
