"""Rollout engine vs transformers `generate` on a heavy-tailed length workload, and on a pretrained model.

    .venv/bin/python benchmarks/rollout.py [--model llama-10m] [--prompts 128] [--max-new 128]
    .venv/bin/python benchmarks/rollout.py --model smollm2-135m-instruct [--concurrency 64,128] [--tokens 64]
        [--precision bf16] [--no-vllm]

Both generate for the same 128 prompts with the same ~10M-parameter model on this machine. Response lengths
follow a heavy-tailed distribution (most short, a few at the maximum), imposed as per-sample token budgets
with eos ignored, as serving benchmarks do. transformers' `generate` (KV cache on) runs the prompts as one
static batch, so it must decode until the longest budget; only the useful tokens (the budgets) are counted for
both. The engine's decode rate is also given as a fraction of the roofline measured in this run (matmul rate
and memory bandwidth), computed step by step from the engine's own log of live rows per step.

With a pretrained name (SmolLM2-135M-Instruct, its 49k vocabulary), the decode rate at each concurrency: every
sequence decodes the same number of tokens (a static batch's best case), the engine (with the attention kernel
loomrl gives a model on this device) beside `generate` with the faster of transformers' `eager` and `sdpa`
attention and beside vLLM (``rollout.backend=vllm``'s engine, in its own process, same threads), against the
same roofline and against the linear floor: the model's linear layers alone, timed at each of the engine's
steps' row counts, which any engine must run (attention, norms and sampling come on top).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from loomrl.models.tokenizer import build_char_tokenizer  # noqa: E402
from loomrl.models.zoo import build_causal_lm, count_parameters  # noqa: E402
from loomrl.report import summary_table  # noqa: E402
from loomrl.rollout.engine import Request, RolloutEngine  # noqa: E402
from loomrl.rollout.sampling import SamplingParams, stream_keys  # noqa: E402
from roofline import best_of, matmul_flops, memory_bandwidth  # noqa: E402


def heavy_tailed_lengths(n: int, max_new: int, seed: int) -> list[int]:
    """Mostly short (Pareto, alpha 1.2, from 4 tokens), the tail clipped at max_new: a few reach the max."""
    rng = random.Random(seed)
    return [min(max_new, int(4 * rng.paretovariate(1.2))) for _ in range(n)]


def make_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    letters = "0123456789abcdefghijklmnopqrstuvwxyz"
    return [
        [
            tokenizer.bos_token_id,
            *tokenizer.encode(
                "".join(rng.choice(letters) for _ in range(rng.randint(8, 16))), add_special_tokens=False
            ),
        ]
        for _ in range(n)
    ]


def run_hf(model, prompts, budgets, pad_id) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    start = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max(budgets),
        min_new_tokens=max(budgets),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        pad_token_id=pad_id,
        use_cache=True,
    )
    return time.perf_counter() - start


def run_engine(model, prompts, budgets, slots) -> tuple[float, RolloutEngine]:
    keys = stream_keys(0, 0, range(len(prompts))).tolist()
    engine = RolloutEngine(
        model,
        SamplingParams(max(budgets), 1.0),
        eos_id=-1,
        pad_id=0,
        slots=slots,
        max_len=max(len(p) for p in prompts) + max(budgets),
    )
    requests = [Request(i, p, keys[i], max_new_tokens=b) for i, (p, b) in enumerate(zip(prompts, budgets))]
    start = time.perf_counter()
    engine.generate(requests)
    return time.perf_counter() - start, engine


def compare_hf_continuous_batching(model, prompts, tokens: int = 32) -> list[dict]:
    """transformers' own continuous batching (`generate_batch`) vs the engine, every sample ``tokens`` long."""
    import logging

    from transformers import GenerationConfig

    logging.disable(logging.WARNING)  # its manager warns about psutil and eos on every call
    config = GenerationConfig(max_new_tokens=tokens, do_sample=True, temperature=1.0, eos_token_id=None, pad_token_id=0)
    model.generate_batch(prompts[:8], generation_config=config)  # warm-up
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config)
    hf_s = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in out.values())
    eng_s, _ = run_engine(model, prompts, [tokens] * len(prompts), slots=len(prompts))
    logging.disable(logging.NOTSET)
    return [
        {
            "system": "transformers generate_batch (continuous batching)",
            "seconds": hf_s,
            "tokens/s": produced / hf_s,
            "speedup": 1.0,
        },
        {
            "system": "loomrl RolloutEngine",
            "seconds": eng_s,
            "tokens/s": len(prompts) * tokens / eng_s,
            "speedup": hf_s / eng_s,
        },
    ]


def roofline_seconds(engine: RolloutEngine, model, flops: float, bandwidth: float, bytes_per_param: int = 4) -> float:
    """Lower bound on the engine's time: per step, max(FLOPs / rate, weight bytes / bandwidth); the FLOPs of the
    output head at the positions a token is sampled from (one per row), the layers' at every position, none for
    the input embedding (a lookup)."""
    n_params = count_parameters(model)
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    layers = n_params - head.numel() - (0 if embed is head else embed.numel())
    total = 0.0
    for decoded, prefilled, prefill_tokens in engine.step_log:
        work = layers * (decoded + prefill_tokens) + head.numel() * (decoded + prefilled)
        total += max(2 * work / flops, bytes_per_param * n_params / bandwidth)
    return total


def linear_floor_seconds(model, step_log: list[tuple[int, int, int]]) -> float:
    """Seconds the model's linear layers alone take over these steps, measured here (best of three per distinct
    shape, after a warm-up): the layers' projections at every decoded and prefilled position, the output head at
    the positions a token is sampled from (one per row). A floor under any engine's time on this machine."""
    head = model.get_output_embeddings()
    body = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    dtype, seconds = next(model.parameters()).dtype, {}

    def best(part: str, rows: int) -> float:
        if (part, rows) not in seconds:
            linears = body if part == "body" else [head]
            inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype) for m in linears}
            seconds[part, rows] = best_of(
                lambda: [torch.nn.functional.linear(inputs[m.in_features], m.weight) for m in linears], repeats=3
            )
        return seconds[part, rows]

    total = 0.0
    with torch.no_grad():
        for decoded, prefilled, prefill_tokens in step_log:
            if decoded + prefill_tokens:
                total += best("body", decoded + prefill_tokens) + best("head", decoded + prefilled)
    return total


def run_vllm(model, prompts, tokens: int) -> tuple[float, float]:
    """Seconds vLLM (its CPU build here, in its own process, as ``rollout.backend=vllm`` runs it) takes to decode
    ``tokens`` tokens for every prompt at once (eos ignored), after a weight sync and a warm-up call: with each
    request's own seeded generator (as loomrl runs it, so that a sample does not depend on its batch), and with
    vLLM's engine-wide one (its fastest sampling)."""
    from loomrl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(model, max_len=max(len(p) for p in prompts) + tokens, slots=len(prompts))
    try:
        engine.sync(model, 1)
        params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        keys = stream_keys(0, 0, range(len(prompts))).tolist()
        requests = [Request(i, list(p), k) for i, (p, k) in enumerate(zip(prompts, keys))]
        engine.generate_with(requests[:4], SamplingParams(max_new_tokens=4, ignore_eos=True), [], 1)  # warm-up
        seconds = []
        for seeded in (True, False):
            start = time.perf_counter()
            engine.generate_with(requests, params, [], 1, seeded=seeded)
            seconds.append(time.perf_counter() - start)
        return seconds[0], seconds[1]
    finally:
        engine.close()


def pretrained_decode(
    name: str, concurrency: list[int], tokens: int, precision: str = "fp32", with_vllm: bool = True
) -> None:
    """Decode rate on a pretrained chat model: at each concurrency C, C arithmetic chat prompts each decoding
    ``tokens`` tokens (eos ignored), the engine (C slots) beside transformers' ``generate`` on the same C prompts
    as one batch (all rows equally long, so its static batch wastes no step: its best case) with the faster of its
    attention kernels, with the engine's roofline fraction and the linear floor. ``precision``: both run in it, and
    the roofline takes the machine's matmul rate in it. ``with_vllm``: vLLM on the same prompts too
    (:func:`run_vllm`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loomrl.config.schema import TaskConfig
    from loomrl.data.sources import build_task, examples_window, prompt_source
    from loomrl.models.attention import EAGER, SDPA, attention_for, use_attention
    from loomrl.models.pretrained import pretrained_dir
    from loomrl.models.tokenizer import encode_prompt

    path = pretrained_dir(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    cfg = TaskConfig(name="arith", level=1)
    source = prompt_source(cfg, build_task(cfg), 0, "train")
    flops, bandwidth = matmul_flops(dtype=dtype), memory_bandwidth()
    rows = []
    for c in concurrency:
        prompts = [encode_prompt(tokenizer, ex.prompt) for ex in examples_window(source, 0, c)]
        budgets = [tokens] * c
        with torch.no_grad():
            hf = {}
            for kind in (EAGER, SDPA):
                use_attention(model, kind)
                hf[kind] = run_hf(model, prompts, budgets, tokenizer.pad_token_id)
            hf_kind = min(hf, key=hf.get)
            hf_s = hf[hf_kind]
            use_attention(model, attention_for(next(model.parameters()).device))  # as loomrl builds its roles
            run_engine(model, prompts[:4], [4] * 4, slots=4)  # warm-up
            eng_s, engine = run_engine(model, prompts, budgets, slots=c)
            vllm_s, vllm_free_s = run_vllm(model, prompts, tokens) if with_vllm else (float("nan"),) * 2
        roof_s = roofline_seconds(engine, model, flops, bandwidth, dtype.itemsize)
        floor_s = linear_floor_seconds(model, engine.step_log)
        rows.append(
            {
                "concurrent": c,
                "prompt tokens (mean)": statistics.mean(len(p) for p in prompts),
                "HF generate tok/s": f"{c * tokens / hf_s:.0f} ({hf_kind}; other {c * tokens / max(hf.values()):.0f})",
                "engine tok/s": c * tokens / eng_s,
                "engine / HF": hf_s / eng_s,
                "vLLM tok/s (unseeded)": f"{c * tokens / vllm_s:.0f} ({c * tokens / vllm_free_s:.0f})",
                "engine / vLLM": vllm_s / eng_s,
                "roofline tok/s": c * tokens / roof_s,
                "engine fraction": roof_s / eng_s,
                "HF fraction": roof_s / hf_s,
                "linear floor tok/s": c * tokens / floor_s,
                "3x HF / floor": 3 * floor_s / hf_s,
            }
        )
        print(rows[-1], flush=True)
    Console(width=200).print(
        summary_table(
            rows,
            f"{name} ({n_params / 1e6:.1f}M params, {precision}), {tokens} tokens per sequence; matmul "
            f"{flops / 1e9:.0f} GFLOP/s, copy bandwidth {bandwidth / 1e9:.1f} GB/s",
        )
    )


def _softmax_multinomial(logits: torch.Tensor) -> torch.Tensor:
    return torch.multinomial(torch.softmax(logits.float(), -1), 1)


def sampler_cost(vocab: int, rows_list: list[int], dtype: torch.dtype) -> None:
    """Seconds a decode step spends choosing tokens over a vocabulary of ``vocab``: the engine's sampler (Gumbel
    noise hashed per sample, step and vocabulary entry, so a sample's tokens do not depend on its batch; hashed
    and maximised a block of columns at a time) and, for comparison, the same noise hashed over whole rows at once
    (the sampler's earlier form), beside softmax + ``torch.multinomial`` (what `generate` does); best of five."""
    from loomrl.rollout import SamplingParams
    from loomrl.rollout.sampling import sample_tokens, uniform_noise

    rows = []
    for n in rows_list:
        logits = torch.randn(n, vocab, dtype=dtype)
        keys, steps = torch.arange(n, dtype=torch.int64) * 7919, torch.full((n,), 5, dtype=torch.int64)
        params = SamplingParams(64, 1.0)
        rows.append(
            {
                "rows": n,
                "engine sampler ms": 1e3 * best_of(partial(sample_tokens, logits, keys, steps, params)),
                "noise over whole rows ms": 1e3 * best_of(partial(uniform_noise, keys, steps, vocab)),
                "softmax + multinomial ms": 1e3 * best_of(partial(_softmax_multinomial, logits)),
            }
        )
    Console(width=200).print(summary_table(rows, f"choosing a token over {vocab} entries, logits in {dtype}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-10m", help="a zoo model, or a pretrained name (decode-rate mode)")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="64,128", help="pretrained model: concurrent sequences per row")
    ap.add_argument("--tokens", type=int, default=64, help="pretrained model: tokens each sequence decodes")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="pretrained model: both systems'")
    ap.add_argument("--sampler", action="store_true", help="time token choice alone (49,152 entries: SmolLM2's)")
    ap.add_argument("--no-vllm", action="store_true", help="pretrained model: leave vLLM's column out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.sampler:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
        return sampler_cost(49152, [int(c) for c in args.concurrency.split(",")], dtype)
    from loomrl.models.pretrained import PRETRAINED

    if args.model in PRETRAINED:
        concurrency = [int(c) for c in args.concurrency.split(",")]
        return pretrained_decode(args.model, concurrency, args.tokens, args.precision, not args.no_vllm)
    tokenizer = build_char_tokenizer()
    model = build_causal_lm(args.model, tokenizer, seed=0).eval()
    n_params = count_parameters(model)
    prompts = make_prompts(tokenizer, args.prompts, seed=1)
    budgets = heavy_tailed_lengths(args.prompts, args.max_new, seed=2)
    useful = sum(budgets)
    flops, bandwidth = matmul_flops(), memory_bandwidth()
    with torch.no_grad():
        hf_s = run_hf(model, prompts, budgets, tokenizer.pad_token_id)
        eng_s, engine = run_engine(model, prompts, budgets, slots=args.prompts)
    roof_s = roofline_seconds(engine, model, flops, bandwidth)
    rows = [
        {
            "system": "transformers generate (static batch, KV cache)",
            "seconds": hf_s,
            "useful tokens/s": useful / hf_s,
            "speedup": 1.0,
        },
        {
            "system": "loomrl RolloutEngine (continuous batching)",
            "seconds": eng_s,
            "useful tokens/s": useful / eng_s,
            "speedup": hf_s / eng_s,
        },
    ]
    console = Console()
    console.print(
        f"model {args.model} ({n_params / 1e6:.1f}M params), {args.prompts} prompts, budgets: mean "
        f"{useful / len(budgets):.1f}, max {max(budgets)}, {sum(b == max(budgets) for b in budgets)} at max; "
        f"threads {args.threads}"
    )
    console.print(summary_table(rows, "rollout throughput"))
    with torch.no_grad():
        console.print(
            summary_table(
                compare_hf_continuous_batching(model, prompts),
                "fixed 32 tokens per sample: transformers' continuous batching vs the engine",
            )
        )
    console.print(
        f"machine: matmul {flops / 1e9:.1f} GFLOP/s, copy bandwidth {bandwidth / 1e9:.1f} GB/s; engine roofline "
        f"{roof_s:.2f} s -> engine at {roof_s / eng_s:.1%} of roofline"
    )


if __name__ == "__main__":
    main()
