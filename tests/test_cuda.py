"""loomrl on CUDA against the same on CPU: the rollout engine's tokens and log-probs, one RL iteration's losses.

Marked ``cuda``: ``make gpu-check`` runs them (``pytest -m cuda``); skipped where no CUDA device is present. CUDA
models compute attention with ``sdpa`` and CPU models with ``eager`` (:mod:`loomrl.models.attention`), so every
comparison here also holds the two kernels to each other.
"""

import json
import random

import pytest
import torch

from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.models.attention import attention_for, use_attention
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.rollout import Request, RolloutEngine, SamplingParams, stream_keys
from loomrl.train.rl import RLTrainer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check runs these)"),
]

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
BF16_LOGP_TOL = 2e-2
"""Log-prob agreement of two bf16 computations of the same tokens (tiny llama: logits of order 1)."""


def _model(device: torch.device, dtype: torch.dtype):
    model = build_causal_lm("llama-1m", build_char_tokenizer(), seed=3).to(device, dtype)
    return use_attention(model, attention_for(device)).eval()


def _requests(n: int = 8) -> list[Request]:
    rng = random.Random(0)
    keys = stream_keys(0, 0, range(n)).tolist()
    return [Request(i, [1] + [rng.randint(4, 47) for _ in range(rng.randint(2, 12))], keys[i]) for i in range(n)]


def _generate(model, requests: list[Request]):
    engine = RolloutEngine(model, GREEDY, eos_id=2, pad_id=0, slots=len(requests), max_len=64)
    return engine.generate(requests)


def test_greedy_tokens_on_cuda_equal_those_on_cpu_in_fp32():
    requests = _requests()
    on_cpu = _generate(_model(CPU, torch.float32), requests)
    on_cuda = _generate(_model(CUDA, torch.float32), requests)
    assert [c.tokens for c in on_cuda] == [c.tokens for c in on_cpu]
    for a, b in zip(on_cuda, on_cpu):
        assert torch.allclose(torch.tensor(a.logps), torch.tensor(b.logps), atol=1e-4)


@torch.no_grad()
def test_bf16_decoding_on_cuda_scores_its_tokens_as_the_cpu_model_does():
    """The tokens CUDA's bf16 engine chose (lean decode with sdpa over the slot cache), scored by the CPU's bf16
    model in one forward: the same log-probs within bf16's tolerance, and each token the CPU's greedy choice up to
    that tolerance (a near-tie may go either way in bf16, so the tokens themselves are not compared)."""
    requests = _requests()
    on_cuda = _generate(_model(CUDA, torch.bfloat16), requests)
    reference = _model(CPU, torch.bfloat16)
    for request, completion in zip(requests, on_cuda):
        ids = torch.tensor([request.prompt + completion.tokens])
        logits = reference(input_ids=ids).logits[0, len(request.prompt) - 1 : -1].float()
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, torch.tensor(completion.tokens)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(completion.logps), logp, atol=BF16_LOGP_TOL)
        assert (logp_all.max(dim=-1).values - logp <= BF16_LOGP_TOL).all()


TINY_RUN = (
    "rollout.prompts_per_iter=8",
    "rollout.max_new_tokens=8",
    "algo.group_size=2",
    "loop.iterations=1",
    "loop.eval_prompts=4",
    "loop.progress=false",
    "report.html=false",
    "runtime.executor=reference",
)
COMPARED = {
    "grpo": ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "reward/mean"),
    "ppo": ("actor/pg_loss", "critic/value_loss", "actor/entropy", "reward/mean"),
}
"""Metrics of the first iteration held to each other: the losses, and what the samples decide (their reward)."""


@pytest.mark.parametrize("algo", sorted(COMPARED))
def test_an_rl_iteration_on_cuda_has_the_losses_of_the_cpu_run(tmp_path, algo):
    """One iteration with ``runtime.precision=auto`` on each device: bf16 with fp32 master weights on CUDA, fp32
    on CPU. The samples are drawn from per-sample streams, so both devices draw the same tokens but where bf16
    moves a probability across a draw; the losses agree within bf16's tolerance."""
    first = {}
    for device in ("cpu", "cuda"):
        run_dir = tmp_path / device
        overrides = [*TINY_RUN, f"algo.name={algo}", f"runtime.device={device}", f"run_dir={run_dir}"]
        RLTrainer(load_config(TrainConfig, None, overrides)).run()
        first[device] = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    for key in COMPARED[algo]:
        assert first["cuda"][key] == pytest.approx(first["cpu"][key], rel=5e-2, abs=1e-3), key
