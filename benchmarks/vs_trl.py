"""End-to-end GRPO throughput: loomrl (reference executor and Ray runtime) against TRL's GRPOTrainer.

    .venv/bin/pip install trl==1.16.0      # or: pip install -e '.[bench]'; leaves torch as it is
    .venv/bin/python benchmarks/vs_trl.py [--quick] [--rows 1m:12,6m:48] [--steps 7] [--stat median|best]
                                          [--precision best|fp32|bf16|each]

Both train the same HF model directory (a random-init Llama written here, with the task's character tokenizer) on
the same digit-sort prompts (loomrl's own prompt stream, in order), rewarded by the task's partial-credit rule: 16
prompts x 8 samples an iteration, one optimizer step per batch, KL coefficient 0, temperature 1, the same learning
rate and response budget. Each row is a model size and a response budget; each system runs in a process of its
own, its first iterations (warm-up) left out and the median of the rest taken, or with `--stat best` the fastest
(loomrl's iteration time, TRL's step time from a callback: both include generation, rewards and the update).
loomrl's reference executor and TRL use both cores in one process; the Ray runtime runs one worker per core
(2 devices). `--quick` runs one row. Each row's JSON (every step time included) is printed as it completes.

Precision: 'best' is bf16 where the CPU computes it natively (avx512_bf16 or amx_bf16 in /proc/cpuinfo; a GPU
would too), fp32 elsewhere: for loomrl runtime.precision=bf16 (bf16 weights, fp32 master weights and Adam
moments); for TRL bf16=True (autocast over fp32 weights, its mixed precision). 'each' runs every system in fp32
and, where native, in bf16, and takes each system's faster run (a tiny model can run faster in fp32 than in
bf16, whose small matrix products are slower here): each system at its own best precision. The arithmetic limit
of a row is its FLOPs per sample (8 x non-embedding parameters x (prompt + response tokens): 2 for the sampling
forward, 6 for the training forward and backward; attention over these short sequences is negligible) against
the matmul rate benchmarks/roofline.py measures in the same run at the faster precision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

PROMPTS, GROUP, LR, SEED = 16, 8, 1e-4, 0
SIZES = {
    # zoo llama-1m's shape: ~1.0M parameters with the 48-character vocabulary
    "1m": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
    },
    # ~5.9M parameters
    "6m": {
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1024,
    },
}
ROWS = [("1m", 12), ("1m", 48), ("6m", 12), ("6m", 48)]
SYSTEMS = ("trl", "loomrl-reference", "loomrl-ray")


def native_bf16() -> bool:
    """Whether bf16 matmuls run natively here (a GPU, or a CPU with AVX512-BF16 or AMX)."""
    if torch.cuda.is_available():
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def write_model(size: str, out: Path) -> int:
    """A random-init Llama of ``size`` with the task tokenizer, saved as an HF checkpoint; its non-embedding
    parameter count."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from loomrl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        attention_dropout=0.0,
        **SIZES[size],
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)


def run_loomrl(model: str, budget: int, steps: int, bf16: bool, executor: str, run_dir: str) -> dict:
    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import load_config
    from loomrl.train.rl import RLTrainer

    runtime = (
        ["runtime.executor=reference", "runtime.threads=2"]
        if executor == "reference"
        else ["runtime.executor=ray", "runtime.devices=2", "runtime.threads=1"]
    )
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={run_dir}",
            f"seed={SEED}",
            f"actor.model={model}",
            f"actor.optim.lr={LR}",
            "reward.source=rule",
            "algo.name=grpo",
            f"algo.group_size={GROUP}",
            "algo.kl_coef=0",
            "algo.ppo_epochs=1",
            "algo.minibatches=1",
            f"rollout.prompts_per_iter={PROMPTS}",
            f"rollout.max_new_tokens={budget}",
            "rollout.temperature=1.0",
            f"loop.iterations={steps}",
            "loop.eval_every=0",
            "loop.save_every=0",
            "loop.eval_prompts=16",
            "loop.progress=false",
            "report.html=false",
            "runtime.device=cpu",
            f"runtime.precision={'bf16' if bf16 else 'fp32'}",
            *runtime,
        ],
    )
    RLTrainer(cfg).run()
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {
        "step_s": [r["time/iteration_s"] for r in records],
        "gen_s": [r["time/actor_gen_s"] for r in records],
        "train_s": [r["time/actor_train_s"] for r in records],
        "response_len": statistics.mean(r["response/length"] for r in records),
    }


def trl_prompts(n: int) -> list[dict]:
    """loomrl's training prompts of the sort task, in its order (what TRL's unshuffled sampler then takes)."""
    from loomrl.config.schema import TaskConfig
    from loomrl.data.sources import build_task, examples_window, prompt_source

    cfg = TaskConfig()
    examples = examples_window(prompt_source(cfg, build_task(cfg), SEED, "train"), 0, n)
    return [{"prompt": ex.prompt, "answer": ex.answer} for ex in examples]


def run_trl(model: str, budget: int, steps: int, bf16: bool, run_dir: str) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from loomrl.data.tasks import partial_credit

    def sort_reward(prompts, completions, answer, **_):
        return [partial_credit(c, a) for c, a in zip(completions, answer)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.start)

    args = GRPOConfig(
        output_dir=run_dir,
        use_cpu=True,
        bf16=bf16,
        seed=SEED,
        learning_rate=LR,
        max_steps=steps,
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=1,
        beta=0.0,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_completion_length=budget,
        shuffle_dataset=False,
        save_strategy="no",
        report_to="none",
        logging_steps=10**6,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    timer = StepTimes()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=sort_reward,
        args=args,
        callbacks=[timer],
        train_dataset=Dataset.from_list(trl_prompts(steps * PROMPTS)),
    )
    trainer.train()
    return {"step_s": timer.times}


def measure(system: str, model: str, budget: int, steps: int, bf16: bool) -> dict:
    """One system's run in a process of its own (clean thread settings, memory and Ray instance)."""
    spec = json.dumps({"system": system, "model": model, "budget": budget, "steps": steps, "bf16": bf16})
    done = subprocess.run([sys.executable, __file__, "--one", spec], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{system} failed (status {done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def one(spec: dict) -> None:
    from loomrl.runtime.launch import quiet_libraries

    quiet_libraries()
    with tempfile.TemporaryDirectory() as run_dir:
        args = (spec["model"], spec["budget"], spec["steps"], spec["bf16"])
        if spec["system"] == "trl":
            torch.set_num_threads(2)
            result = run_trl(*args, run_dir)
        else:
            result = run_loomrl(*args, spec["system"].removeprefix("loomrl-"), run_dir)
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one row (1m, 12 tokens), fewer steps")
    ap.add_argument("--steps", type=int, default=7, help="iterations per run, the first --warmup left out")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--precision",
        choices=("best", "fp32", "bf16", "each"),
        default="best",
        help="'best': bf16 where native, else fp32, for all; 'each': each system's faster of the two",
    )
    ap.add_argument(
        "--stat",
        choices=("median", "best"),
        default="median",
        help="step time of a run: the median of the measured iterations, or the fastest (on a machine "
        "shared with other work, the best estimate of each system's uncontended speed)",
    )
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    ap.add_argument("--rows", help="comma-separated subset of rows as size:tokens, e.g. 1m:12,6m:48")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(json.loads(args.one))
    from rich.console import Console

    from loomrl.report import summary_table
    from roofline import matmul_flops

    bf16 = native_bf16() if args.precision in ("best", "each") else args.precision == "bf16"
    precisions = [False, True] if args.precision == "each" and bf16 else [bf16]
    rows, steps = ([ROWS[0]], min(args.steps, 4)) if args.quick else (ROWS, args.steps)
    if args.rows:
        known = {f"{size}:{tokens}": (size, tokens) for size, tokens in ROWS}
        wanted = args.rows.split(",")
        if unknown := [r for r in wanted if r not in known]:
            raise SystemExit(f"--rows: unknown {', '.join(unknown)} (valid: {', '.join(known)})")
        rows = [known[r] for r in wanted]
    warmup = min(args.warmup, steps - 1)
    rates = {p: matmul_flops(1024, torch.bfloat16 if p else torch.float32) for p in precisions}
    systems = args.systems.split(",")
    table, params = [], {}
    with tempfile.TemporaryDirectory() as d:
        for size, budget in rows:
            model = str(Path(d) / size)
            if size not in params:
                params[size] = write_model(size, Path(model))
            stat = statistics.median if args.stat == "median" else min
            runs = {(s, p): measure(s, model, budget, steps, p) for s in systems for p in precisions}
            chosen = {s: min(precisions, key=lambda p: stat(runs[s, p]["step_s"][warmup:])) for s in systems}
            result = {s: runs[s, chosen[s]] for s in systems}
            per_s = {s: PROMPTS * GROUP / stat(r["step_s"][warmup:]) for s, r in result.items()}
            length = next((r["response_len"] for r in result.values() if "response_len" in r), budget)
            flops = 8 * params[size] * (11 + length)  # a prompt: bos, 'sort ', 3-5 digits, '=' (11 tokens on average)
            row = {
                "model": f"{size} ({params[size] / 1e6:.1f}M)",
                "new tokens": budget,
                "mean length": length,
                "precision": ", ".join(
                    f"{s.removeprefix('loomrl-')} {'bf16' if chosen[s] else 'fp32'}" for s in systems
                ),
            }
            row.update({f"{s} samples/s": per_s[s] for s in systems})
            if "trl" in per_s:
                row.update(
                    {f"{s.removeprefix('loomrl-')} / trl": per_s[s] / per_s["trl"] for s in systems if s != "trl"}
                )
            row["arith. limit samples/s"] = max(rates.values()) / flops  # at the faster precision
            if "loomrl-reference" in result:  # where the reference executor's iteration goes
                ref = result["loomrl-reference"]
                row["ref gen s"] = stat(ref["gen_s"][warmup:])
                row["ref train s"] = stat(ref["train_s"][warmup:])
            table.append(row)
            print(
                json.dumps(
                    {**row, "steps_s": {f"{s} {'bf16' if p else 'fp32'}": r["step_s"] for (s, p), r in runs.items()}}
                ),
                flush=True,
            )
    matmul = ", ".join(f"{r / 1e9:.0f} GFLOP/s {'bf16' if p else 'fp32'}" for p, r in rates.items())
    Console(width=250).print(
        summary_table(
            table,
            f"GRPO, {PROMPTS} prompts x {GROUP} samples an iteration, {args.stat} "
            f"of {steps - warmup} iterations; matmul rate {matmul}",
        )
    )


if __name__ == "__main__":
    main()
