"""GRPO rewarded by a generative reward model (a judge) on digit sorting, from an SFT warm start.

    .venv/bin/python benchmarks/judge_demo.py [--out runs/judge_demo] [--judge-steps 1500] [--iterations 60]
        [--judge-model llama-10m] [--on-policy 3000] [--reuse]

Three stages, each from the project's own configs: the policy's short SFT warm start
(``examples/sft_sort.yaml``), the judge's SFT on synthetic verdicts (``examples/sft_judge.yaml``: the task's
prompts with a response right half of the time, the verdict yes or no), then GRPO whose only reward is the judge's
verdict (``examples/judge_grpo_sort.yaml``). With ``--on-policy N`` the judge also learns from N of the SFT
policy's own samples (temperature 1, other prompts than the evaluation's), each labelled by the task's rule: the
near misses GRPO will show it, written with as many synthetic verdicts to a prompt file the judge's SFT reads.
``--reuse`` keeps a policy, verdict file or judge already made under ``--out``. The task's rule never rewards;
it measures: held-out greedy exact match of the SFT policy and of the GRPO policy. The judge is also scored on
the SFT policy's own samples (what GRPO shows it): how often it says yes to a right and to a wrong response.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from loomrl.config.schema import SFTConfig, TrainConfig  # noqa: E402
from loomrl.config.tools import load_config  # noqa: E402
from loomrl.data.judges import DEFAULT_TEMPLATE, judge_prompt  # noqa: E402
from loomrl.data.sources import build_task, held_out  # noqa: E402
from loomrl.models.tokenizer import decode_response, encode_prompt, task_tokenizer  # noqa: E402
from loomrl.models.zoo import build_causal_lm  # noqa: E402
from loomrl.report import summary_table  # noqa: E402
from loomrl.rollout import Request, RolloutEngine, SamplingParams, stream_keys  # noqa: E402
from loomrl.runtime.launch import quiet_libraries  # noqa: E402
from loomrl.train.rl import RLTrainer  # noqa: E402
from loomrl.train.sft import run_sft  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _generate(model, tokenizer, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[str]:
    engine = RolloutEngine(
        model.eval(),
        params,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        slots=len(prompts),
        max_len=max(map(len, prompts)) + params.max_new_tokens,
    )
    keys = stream_keys(seed, 0, list(range(len(prompts)))).tolist()
    engine.submit(Request(i, p, k, None) for i, (p, k) in enumerate(zip(prompts, keys)))
    done = []
    while engine.has_work():
        done += engine.step()
    return [decode_response(tokenizer, c.tokens) for c in sorted(done, key=lambda c: c.sample_id)]


@torch.no_grad()
def judge_on_policy_samples(policy_dir: Path, judge_dir: Path, train: TrainConfig, n: int) -> dict[str, float]:
    """The judge's verdicts on ``n`` samples of the policy (temperature 1, as GRPO draws them): the share of
    right responses it calls right, and of wrong ones."""
    tokenizer = task_tokenizer(train.task, str(policy_dir))
    examples = held_out(train.task, build_task(train.task), train.seed + 1, n)
    policy = build_causal_lm(str(policy_dir), tokenizer, 0)
    responses = _generate(
        policy,
        tokenizer,
        [encode_prompt(tokenizer, ex.model_input) for ex in examples],
        SamplingParams(train.rollout.max_new_tokens, 1.0),
        train.seed,
    )
    spec = train.reward.judges[0]
    judge = build_causal_lm(str(judge_dir), tokenizer, 0)
    verdicts = _generate(
        judge,
        tokenizer,
        [
            encode_prompt(tokenizer, judge_prompt(spec.template, ex.prompt, r, ex.answer))
            for ex, r in zip(examples, responses)
        ],
        SamplingParams(spec.max_new_tokens, 0.0),
        train.seed,
    )
    right = [v.startswith("yes") for ex, r, v in zip(examples, responses, verdicts) if r == ex.answer]
    wrong = [v.startswith("yes") for ex, r, v in zip(examples, responses, verdicts) if r != ex.answer]
    return {
        "right": len(right),
        "right_yes": sum(right) / max(len(right), 1),
        "wrong": len(wrong),
        "wrong_yes": sum(wrong) / max(len(wrong), 1),
    }


def verdict_file(out: Path, judge_task, policy_dir: Path, n: int, seed: int) -> None:
    """Write ``n`` verdicts on the policy's own samples (labelled by the judged task's rule) and ``n`` synthetic
    ones to ``out/verdicts.jsonl``, with the reward function that scores the judge's verdicts against them."""
    from loomrl.config.schema import TaskConfig
    from loomrl.data.sources import prompt_source

    judged_cfg = TaskConfig(name=judge_task.judged, min_len=judge_task.min_len, max_len=judge_task.max_len)
    judged = build_task(judged_cfg)
    source = prompt_source(judged_cfg, judged, seed + 2, "train")
    examples = [source[i] for i in range(n)]
    tokenizer = task_tokenizer(judged_cfg, str(policy_dir))
    policy = build_causal_lm(str(policy_dir), tokenizer, 0)
    responses = []
    for start in range(0, n, 512):
        part = examples[start : start + 512]
        responses += _generate(
            policy,
            tokenizer,
            [encode_prompt(tokenizer, ex.model_input) for ex in part],
            SamplingParams(8, 1.0),
            seed + start,
        )
    rows = [
        {
            "prompt": judge_prompt(DEFAULT_TEMPLATE, ex.prompt, r, ex.answer),
            "answer": "yes" if judged.exact(ex.prompt, r, ex.answer) else "no",
        }
        for ex, r in zip(examples, responses)
    ]
    synthetic = build_task(judge_task)
    stream = prompt_source(judge_task, synthetic, seed + 3, "train")
    rows += [{"prompt": stream[i].prompt, "answer": stream[i].answer} for i in range(n)]
    random.Random(seed).shuffle(rows)
    path = out / "verdicts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (out / "verdict_match.py").write_text(
        "def match(prompt, response, answer):\n    return float(response.strip() == answer)\n"
    )


def verdict_overrides(out: Path) -> list[str]:
    """The overrides that make the judge's SFT read the verdicts :func:`verdict_file` wrote under ``out``."""
    return [
        "task.name=file",
        f"task.prompt_file={out / 'verdicts.jsonl'}",
        f"task.reward_fn={out / 'verdict_match.py'}:match",
    ]


def _sft(cfg: SFTConfig, reuse: bool) -> dict[str, float]:
    """Run an SFT stage, or with ``reuse`` read the summary of the one already in its ``out_dir``."""
    summary = Path(cfg.out_dir) / "sft_summary.json"
    if reuse and summary.is_file():
        return json.loads(summary.read_text())
    return run_sft(cfg, progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/judge_demo")
    parser.add_argument("--judge-steps", type=int, default=1500)
    parser.add_argument("--judge-model", default=None, help="the judge's model (default: sft_judge.yaml's)")
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--on-policy", type=int, default=0, help="the SFT policy's samples the judge also learns")
    parser.add_argument("--reuse", action="store_true", help="keep a policy or judge already trained under --out")
    args = parser.parse_args()
    quiet_libraries()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seconds = {}

    t0 = time.perf_counter()
    sft = load_config(SFTConfig, EXAMPLES / "sft_sort.yaml", [f"out_dir={out / 'sft'}"])
    policy = _sft(sft, args.reuse)
    seconds["policy SFT"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    extra = [f"out_dir={out / 'judge'}", f"steps={args.judge_steps}"]
    extra += [f"model={args.judge_model}"] if args.judge_model else []
    if args.on_policy:
        if not (args.reuse and (out / "verdicts.jsonl").is_file()):
            verdict_file(
                out,
                judge_task=load_config(SFTConfig, EXAMPLES / "sft_judge.yaml", []).task,
                policy_dir=out / "sft",
                n=args.on_policy,
                seed=sft.seed,
            )
        extra += verdict_overrides(out)
    judge_cfg = load_config(SFTConfig, EXAMPLES / "sft_judge.yaml", extra)
    judge = _sft(judge_cfg, args.reuse)
    seconds["judge SFT"] = time.perf_counter() - t0

    train = load_config(
        TrainConfig,
        EXAMPLES / "judge_grpo_sort.yaml",
        [
            f"run_dir={out / 'grpo'}",
            f"actor.model={out / 'sft'}",
            f"reward.judges=[{{model: {out / 'judge'}}}]",
            f"loop.iterations={args.iterations}",
            "loop.progress=false",
            "report.html=false",
        ],
    )
    scored = judge_on_policy_samples(out / "sft", out / "judge", train, 512)

    t0 = time.perf_counter()
    final = RLTrainer(train).run()
    seconds["GRPO with the judge"] = time.perf_counter() - t0
    records = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]

    console = Console()
    console.print(
        summary_table(
            [
                {"what": "SFT policy: held-out greedy exact match", "value": policy["eval/exact_match"]},
                {
                    "what": "judge: held-out verdict exact match (synthetic responses)",
                    "value": judge["eval/exact_match"],
                },
                {"what": f"judge on {scored['right']} right SFT samples: says yes", "value": scored["right_yes"]},
                {"what": f"judge on {scored['wrong']} wrong SFT samples: says yes", "value": scored["wrong_yes"]},
                {"what": "GRPO policy: held-out greedy exact match", "value": final["eval/exact_match"]},
                {
                    "what": "GRPO: sampled exact match, first → last iteration",
                    "value": f"{records[0]['reward/exact_match']:.3f} → {records[-1]['reward/exact_match']:.3f}",
                },
                {
                    "what": "GRPO: judge's reward, first → last iteration",
                    "value": f"{records[0]['reward/mean']:.3f} → {records[-1]['reward/mean']:.3f}",
                },
            ],
            "GRPO rewarded by a judge (digit sorting, CPU)",
        )
    )
    console.print(summary_table([{"stage": k, "seconds": v} for k, v in seconds.items()], "time"))


if __name__ == "__main__":
    main()
