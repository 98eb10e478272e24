"""One prepared command that measures loomrl on a GPU in minutes, and its dry run on CPU.

    make gpu-check                           # on a GPU machine: the check, JSON in runs/gpu_check.json
    make gpu-check ARGS=--cpu                # the dry run: every part with tiny shapes on this machine's CPU
    python benchmarks/gpu_check.py [--cpu] [--parts tests,decode,train,grpo,profile] [--out FILE]

Without a virtualenv (a GPU machine's system python) it runs from the repository root with ``PYTHONPATH=.``.
Nothing here or in the code it runs imports Ray: the reference executor runs every call in this process.

Parts (docs/gpu.md says what each measures and its target):

- **tests**: ``pytest -m cuda`` over the test files that hold CUDA tests, in a subprocess; its counts.
- **decode**: the rollout engine's decode rate on random models of Qwen2.5-0.5B and Llama-3.2-1B shapes in bf16,
  beside transformers' ``generate`` on the same prompts, each against the memory-bandwidth roofline.
- **train**: one training step's model FLOPs utilisation at Qwen2.5-0.5B and 1.5B shapes (bf16 weights, fp32
  master weights in loomrl's own optimizer), and the optimizer step's time.
- **grpo**: a few GRPO iterations of a random 0.5B-shaped model on the reference executor, split by call.
- **profile**: a measured hardware profile in the JSON form ``loomrl plan --profile FILE`` reads.

The planned time of each part (:data:`PLANNED_S`) is printed before anything runs; the JSON (``--out``) is
rewritten after every part, so a run stopped half-way keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a GPU machine runs this from a plain checkout, loomrl not installed
sys.path.insert(0, str(ROOT / "benchmarks"))  # the shared timing helpers beside it
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from rich.console import Console  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel  # noqa: E402

from loomrl.config.schema import OptimConfig, TrainConfig  # noqa: E402
from loomrl.config.tools import load_config  # noqa: E402
from loomrl.models.attention import attention_for  # noqa: E402
from loomrl.models.heads import LOGP, response_outputs  # noqa: E402
from loomrl.models.presets import MODEL_PRESETS  # noqa: E402
from loomrl.models.tokenizer import build_char_tokenizer  # noqa: E402
from loomrl.models.zoo import count_parameters  # noqa: E402
from loomrl.parallel.main_grad import accumulate_in_fp32  # noqa: E402
from loomrl.plan.hardware import PROFILES, HardwareProfile, load_profile  # noqa: E402
from loomrl.plan.model_shape import ModelShape  # noqa: E402
from loomrl.planner.calibration.local import calibrate_local  # noqa: E402
from loomrl.report import summary_table  # noqa: E402
from loomrl.role.build import adamw  # noqa: E402
from loomrl.role.devices import resolve_dtype  # noqa: E402
from loomrl.rollout.engine import Request, RolloutEngine  # noqa: E402
from loomrl.rollout.sampling import SamplingParams, stream_keys  # noqa: E402
from loomrl.run_dir import RunDir  # noqa: E402
from loomrl.runtime.launch import quiet_libraries  # noqa: E402
from roofline import best_of  # noqa: E402

PARTS = ("tests", "decode", "train", "grpo", "profile")

PLANNED_S = {"tests": 60.0, "decode": 90.0, "train": 60.0, "grpo": 120.0, "profile": 30.0}
"""Seconds each part is expected to take on one H100 (estimates: model building, warm-ups and the timed runs; the
grpo part also writes its final checkpoint); the JSON records the measured ones beside them."""

STARTUP_S = 15.0
"""Seconds before the first part: importing torch and transformers, and CUDA's start."""

MAX_PLANNED_S = 8 * 60.0
"""The whole check must plan under this: GPU machines are lent for minutes."""

DECODE_ROOFLINE_TARGET = 0.5
DECODE_SPEEDUP_TARGET = 3.0
MFU_TARGET = 0.35

_SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
"""The built-in character tokenizer's ids, so a saved random model runs with it (the grpo part)."""


_TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1024,
    max_position_embeddings=256,
)

ARCHITECTURES: dict[str, dict[str, Any]] = {
    **{name: dict(vars(MODEL_PRESETS[name])) for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama3.2-1b")},
    # the dry run's stand-ins: the same architectures, tiny
    "tiny-qwen2": {**vars(MODEL_PRESETS["qwen2.5-0.5b"]), **_TINY},
    "tiny-llama": {**vars(MODEL_PRESETS["llama3.2-1b"]), **_TINY},
}
"""Random-initialised models by name: HF config fields (the presets', every one with tied embeddings)."""

GPU_NAMES = {"NVIDIA H100 80GB HBM3": "h100-80g", "NVIDIA H200": "h200"}
"""CUDA device name → the :data:`~loomrl.plan.hardware.PROFILES` entry whose dense bf16 rate is its peak (the SXM
parts; others, PCIe and NVL variants among them, have lower clocks: their peak is measured)."""


@dataclass(frozen=True)
class Scale:
    """The sizes of one kind of check: full on a GPU, tiny for the CPU dry run."""

    decode_models: tuple[str, ...]
    concurrency: tuple[int, ...]
    """Sequences decoding together; the decode target is read at the last model and the last concurrency."""
    prompt_len: int
    new_tokens: int
    train_models: tuple[str, ...]
    """The MFU target is read at the last."""
    train_seq: int
    train_rows: int
    """Most rows of a training step; halved until the step fits in the device's memory."""
    timed_steps: int
    grpo_model: str
    grpo: tuple[str, ...]
    """Config overrides of the GRPO run."""
    calibrate: dict[str, int] = field(default_factory=dict)
    """Sizes for :func:`~loomrl.planner.calibration.local.calibrate_local`."""
    matmul_tokens: int = 4096
    rate_n: int = 4096
    """Side of the square matmul that measures the machine's rate."""
    tests_timeout_s: float = 300.0
    """Seconds the CUDA tests' pytest may take before it is stopped as hung."""


GPU = Scale(
    decode_models=("qwen2.5-0.5b", "llama3.2-1b"),
    concurrency=(64, 256),
    prompt_len=128,
    new_tokens=128,
    train_models=("qwen2.5-0.5b", "qwen2.5-1.5b"),
    train_seq=2048,
    train_rows=16,
    timed_steps=3,
    grpo_model="qwen2.5-0.5b",
    grpo=(
        "rollout.prompts_per_iter=32",
        "algo.group_size=8",
        "rollout.max_new_tokens=128",
        "loop.iterations=3",
        "loop.eval_prompts=8",
    ),
)
CPU = Scale(
    decode_models=("tiny-qwen2", "tiny-llama"),
    concurrency=(4, 8),
    prompt_len=8,
    new_tokens=8,
    train_models=("tiny-qwen2", "tiny-llama"),
    train_seq=32,
    train_rows=2,
    timed_steps=1,
    grpo_model="tiny-qwen2",
    grpo=(
        "rollout.prompts_per_iter=2",
        "algo.group_size=2",
        "rollout.max_new_tokens=4",
        "loop.iterations=2",
        "loop.eval_prompts=2",
    ),
    calibrate=dict(matmul_n=128, copy_mb=8, transfer_mb=1, repeats=2),
    matmul_tokens=64,
    rate_n=256,
    tests_timeout_s=900.0,  # a guard against a hang, not a budget: a loaded 2-core machine starts pytest slowly
)


# ------------------------------------------------------------------------------------------------- measuring
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``fn()``'s result and its seconds, the device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int = 3) -> float:
    """Best seconds of ``fn`` after a warm-up (never zero: the rates divide by it)."""
    return max(best_of(fn, repeats=repeats, device=str(device)), 1e-9)


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of an (m × k) by (k × n) matmul."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    return 2 * m * k * n / best_seconds(lambda: torch.mm(a, b), device)


def copy_bandwidth(megabytes: int, device: torch.device) -> float:
    """Bytes/s of a large copy, one read and one write per byte."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src), device)


def device_to_host_bandwidth(megabytes: int, device: torch.device) -> float:
    """Bytes/s of a copy from device memory into pinned host memory (the profile's ``host_bw`` is the other
    direction); a CPU's own copy bandwidth on CPU."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=device.type == "cuda")
    return src.numel() * 4 / best_seconds(lambda: dst.copy_(src, non_blocking=True), device)


@dataclass(frozen=True)
class Rates:
    """The machine's rates the fractions are taken against, measured once per check."""

    matmul_flops: float
    """bf16 matmul rate of a large square product."""
    bandwidth: float


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_random_lm(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> PreTrainedModel:
    """A random-initialised model of architecture ``name`` drawn on ``device`` in ``dtype``, with the device's
    attention kernel, in eval mode."""
    fields = dict(ARCHITECTURES[name])
    config = AutoConfig.for_model(fields.pop("model_type"), **_SPECIAL_IDS, **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention_for(device))
    return model.eval()


def model_flops_per_token(params: int, shape: ModelShape, seq: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward and backward) plus causal attention's
    6 · layers · seq · q_dim (QKᵀ and AV over seq/2 keys on average, times 3 with the backward)."""
    return 6 * params + 6 * shape.layers * seq * shape.q_dim


# ----------------------------------------------------------------------------------------------------- check
@dataclass
class Check:
    """What every part reads: the device, the sizes, where files go; the machine's rates measured on first use."""

    device: torch.device
    scale: Scale
    out: Path
    console: Console

    @cached_property
    def rates(self) -> Rates:
        n = self.scale.rate_n
        return Rates(
            matmul_flops=matmul_rate(n, n, n, torch.bfloat16, self.device),
            bandwidth=copy_bandwidth(self.scale.calibrate.get("copy_mb", 1024), self.device),
        )

    @property
    def gpu_name(self) -> str | None:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None

    def show(self, rows: list[dict[str, Any]], title: str) -> None:
        self.console.print(summary_table(rows, title))


# ----------------------------------------------------------------------------------------------------- tests
def cuda_test_files(root: Path) -> list[str]:
    """The test files that hold CUDA tests: collecting only these keeps modules that need Ray out."""
    return sorted(
        str(p.relative_to(root))
        for p in (root / "tests").glob("test_*.py")
        if "pytest.mark.cuda" in p.read_text(encoding="utf-8")
    )


def pytest_counts(output: str) -> dict[str, int]:
    """Counts from pytest's closing line (``3 passed, 1 skipped in 2.1s``)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)]
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)\b", lines[-1] if lines else ""):
        key = "errors" if word.startswith("error") else word
        if key in counts:
            counts[key] = int(number)
    return counts


def tests_part(check: Check) -> dict[str, Any]:
    files = cuda_test_files(ROOT)
    if not files:  # pytest given no file would collect the whole suite
        raise FileNotFoundError(f"no test file under {ROOT / 'tests'} holds a pytest.mark.cuda test")
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-o", "addopts=", "-p", "no:cacheprovider", *files]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=check.scale.tests_timeout_s
    )
    output = proc.stdout + proc.stderr
    row = {**pytest_counts(output), "exit status": proc.returncode, "files": ", ".join(files)}
    if proc.returncode not in (0, 5):  # 5: no test collected
        check.console.print(output[-4000:], markup=False, highlight=False)
    check.show([row], f"pytest -m cuda on {check.device.type}")
    return {"rows": [row], "ok": proc.returncode == 0 and row["failed"] == 0 and row["errors"] == 0}


# ---------------------------------------------------------------------------------------------------- decode
def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=generator).tolist()


def engine_seconds(model: PreTrainedModel, prompts: list[list[int]], tokens: int) -> tuple[float, RolloutEngine]:
    """The engine decoding ``tokens`` tokens for every prompt at once (eos ignored), and the engine."""
    keys = stream_keys(0, 0, range(len(prompts))).tolist()
    engine = RolloutEngine(
        model,
        SamplingParams(tokens, 1.0, ignore_eos=True),
        eos_id=-1,
        pad_id=0,
        slots=len(prompts),
        max_len=max(len(p) for p in prompts) + tokens,
    )
    requests = [Request(i, p, keys[i]) for i, p in enumerate(prompts)]
    _, seconds = timed(lambda: engine.generate(requests), model.device)
    return seconds, engine


def generate_seconds(model: PreTrainedModel, prompts: list[list[int]], tokens: int) -> float:
    """transformers' ``generate`` on the same prompts (equal lengths: one batch without padding), sampling."""
    ids = torch.tensor(prompts, device=model.device)

    def run() -> None:
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            pad_token_id=0,
            use_cache=True,
        )

    return timed(run, model.device)[1]


def decode_roofline_seconds(
    step_log: Sequence[tuple[int, int, int]],
    prompt_len: int,
    budget: int,
    params: int,
    itemsize: int,
    kv_token: int,
    rates: Rates,
    head_params: int = 0,
) -> float:
    """The least time of the engine's steps: each reads the weights and its live samples' keys and values (each
    sample's own length) at the measured bandwidth, or does its FLOPs at the matmul rate, whichever is longer. The
    output head (``head_params`` of ``params``) runs at one position per sampled row, the rest at every position."""
    total = 0.0
    live: list[int] = []  # tokens each live sample has generated
    for decoded, admitted, prefill_tokens in step_log:
        read = params * itemsize + sum(prompt_len + g for g in live) * kv_token + prefill_tokens * kv_token
        flops = 2 * ((params - head_params) * (decoded + prefill_tokens) + head_params * (decoded + admitted))
        total += max(read / rates.bandwidth, flops / rates.matmul_flops)
        live = [g + 1 for g in live if g + 1 < budget] + ([1] * admitted if budget > 1 else [])
    return total


def decode_rows(check: Check, name: str) -> list[dict[str, Any]]:
    scale = check.scale
    model = build_random_lm(name, check.device, torch.bfloat16)
    shape, params = ModelShape.from_config(model.config), count_parameters(model)
    kv_token = shape.layers * 2 * shape.kv_dim * model.dtype.itemsize
    rows = []
    with torch.no_grad():
        warm = random_prompts(4, scale.prompt_len, shape.vocab, seed=99)
        engine_seconds(model, warm, 4)
        generate_seconds(model, warm, 4)
        for c in scale.concurrency:
            prompts = random_prompts(c, scale.prompt_len, shape.vocab, seed=c)
            hf_s = generate_seconds(model, prompts, scale.new_tokens)
            engine_s, engine = engine_seconds(model, prompts, scale.new_tokens)
            roof_s = decode_roofline_seconds(
                engine.step_log,
                scale.prompt_len,
                scale.new_tokens,
                params,
                model.dtype.itemsize,
                kv_token,
                check.rates,
                head_params=shape.vocab * shape.hidden,
            )
            tokens = c * scale.new_tokens
            rows.append(
                {
                    "model": name,
                    "sequences": c,
                    "engine tok/s": tokens / engine_s,
                    "generate tok/s": tokens / hf_s,
                    "engine / generate": hf_s / engine_s,
                    "roofline tok/s": tokens / roof_s,
                    "engine of roofline": roof_s / engine_s,
                    "generate of roofline": roof_s / hf_s,
                }
            )
    return rows


def decode_target(rows: list[dict[str, Any]], scale: Scale) -> dict[str, Any]:
    row = next(r for r in rows if r["model"] == scale.decode_models[-1] and r["sequences"] == scale.concurrency[-1])
    met = row["engine of roofline"] >= DECODE_ROOFLINE_TARGET and row["engine / generate"] >= DECODE_SPEEDUP_TARGET
    return {
        "text": f"{row['model']} at {row['sequences']} sequences: engine ≥ {DECODE_ROOFLINE_TARGET:.0%} of roofline "
        f"(measured {row['engine of roofline']:.1%}) and ≥ {DECODE_SPEEDUP_TARGET:g}× generate (measured "
        f"{row['engine / generate']:.2f}×)",
        "met": met,
    }


def decode_part(check: Check) -> dict[str, Any]:
    rows = []
    for name in check.scale.decode_models:
        rows += decode_rows(check, name)
        free_memory()
    rates = check.rates
    check.show(
        rows,
        f"decode, bf16, {check.scale.prompt_len}-token prompts + {check.scale.new_tokens} tokens each; roofline at "
        f"{rates.bandwidth / 1e9:.0f} GB/s copy, {rates.matmul_flops / 1e12:.1f} TFLOP/s bf16 matmul",
    )
    target = decode_target(rows, check.scale)
    check.console.print(f"target: {target['text']}: {'met' if target['met'] else 'not met'}")
    return {"rows": rows, "target": target, "rates": dataclasses.asdict(rates)}


# ----------------------------------------------------------------------------------------------------- train
def train_step(model: PreTrainedModel, optimizer, ids_BL: torch.Tensor) -> tuple[float, float]:
    """(forward and backward seconds, optimizer step seconds) of one step: every token after the first is a
    response token under a policy-gradient-shaped loss, through loomrl's own passes (the chunked output head)."""
    device = ids_BL.device
    rows, length = ids_BL.shape
    mask_BL = torch.ones_like(ids_BL)
    prompt_len_B = torch.ones(rows, dtype=torch.long, device=device)

    def forward_backward() -> None:
        out_BR2 = response_outputs(model, ids_BL, mask_BL, prompt_len_B, length - 1)
        (-out_BR2[..., LOGP].mean()).backward()

    _, pass_s = timed(forward_backward, device)
    _, step_s = timed(optimizer.step, device)
    optimizer.zero_grad()
    return pass_s, step_s


def fitting_rows(step: Callable[[int], object], rows: int, optimizer) -> int:
    """The most rows, from ``rows`` halving, whose step runs without running out of device memory."""
    while True:
        try:
            step(rows)
            return rows
        except torch.OutOfMemoryError:
            if rows == 1:
                raise
        optimizer.zero_grad()  # outside the handler: its traceback (holding the step's tensors) is gone
        free_memory()
        rows //= 2


def train_row(check: Check, name: str, peak: float) -> dict[str, Any]:
    scale, device = check.scale, check.device
    model = build_random_lm(name, device, torch.bfloat16).train()
    shape, params = ModelShape.from_config(model.config), count_parameters(model)
    accumulate_in_fp32(model)
    optimizer = adamw(model, OptimConfig())  # bf16 weights: ZeroAdamW with fp32 master weights
    generator = torch.Generator().manual_seed(0)

    def batch(rows: int) -> torch.Tensor:
        return torch.randint(3, shape.vocab, (rows, scale.train_seq), generator=generator).to(device)

    rows = fitting_rows(lambda r: train_step(model, optimizer, batch(r)), scale.train_rows, optimizer)
    times = [train_step(model, optimizer, batch(rows)) for _ in range(scale.timed_steps)]
    pass_s, step_s = min(p for p, _ in times), min(s for _, s in times)
    tokens = rows * scale.train_seq
    flops = tokens * model_flops_per_token(params, shape, scale.train_seq)
    return {
        "model": name,
        "params (M)": params / 1e6,
        "tokens/step": tokens,
        "forward+backward s": pass_s,
        "optimizer s": step_s,
        "model TFLOP/s": flops / (pass_s + step_s) / 1e12,
        "MFU": flops / (pass_s + step_s) / peak,
    }


def dense_peak(check: Check) -> tuple[float, str]:
    """The device's dense bf16 rate: its profile's datasheet figure where the GPU is known, else measured."""
    profile = GPU_NAMES.get(check.gpu_name or "")
    if profile is not None:
        return PROFILES[profile].matmul_flops, f"profile {profile}"
    return check.rates.matmul_flops, "measured bf16 matmul"


def train_part(check: Check) -> dict[str, Any]:
    peak, source = dense_peak(check)
    rows = []
    for name in check.scale.train_models:
        rows.append(train_row(check, name, peak))
        free_memory()  # the model and its optimizer state went with train_row's frame
    check.show(
        rows,
        f"one training step, bf16 weights + fp32 masters, {check.scale.train_seq}-token rows; MFU against "
        f"{peak / 1e12:.1f} TFLOP/s ({source})",
    )
    mfu = rows[-1]["MFU"]
    target = {"text": f"{rows[-1]['model']}: MFU ≥ {MFU_TARGET:.0%} (measured {mfu:.1%})", "met": mfu >= MFU_TARGET}
    check.console.print(f"target: {target['text']}: {'met' if target['met'] else 'not met'}")
    return {"rows": rows, "target": target, "peak_flops": peak, "peak_source": source}


# ------------------------------------------------------------------------------------------------------ grpo
def save_random_checkpoint(check: Check, name: str, directory: Path) -> None:
    """A random model of ``name`` with the built-in task tokenizer: what ``actor.model`` takes as a directory."""
    model = build_random_lm(name, check.device, torch.bfloat16)
    model.save_pretrained(directory)
    build_char_tokenizer().save_pretrained(directory)


def call_split(run_dir: RunDir) -> list[dict[str, Any]]:
    """Mean seconds of each call per iteration, from the run's traces, leaving out the first iteration (its
    warm-up) when there are more."""
    traces = [json.loads(line) for line in run_dir.traces.read_text(encoding="utf-8").splitlines() if line]
    traces = [t for t in traces if t["phase"] == "iteration"]
    iterations = sorted({t["iteration"] for t in traces})
    kept = set(iterations[1:] or iterations)
    seconds: dict[str, list[float]] = {}
    for t in traces:
        if t["iteration"] in kept:
            seconds.setdefault(t["step"], []).append(max(t["end"]) - min(t["start"]))
    per_iteration = [r["time/iteration_s"] for r in run_dir.read_metrics() if r["iteration"] in kept]
    iteration_s = sum(per_iteration) / len(per_iteration)
    rows = [
        {"call": step, "seconds": sum(s) / len(kept), "of iteration": sum(s) / len(kept) / iteration_s}
        for step, s in seconds.items()
    ]
    return [*rows, {"call": "iteration", "seconds": iteration_s, "of iteration": 1.0}]


def grpo_part(check: Check) -> dict[str, Any]:
    scale = check.scale
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        model_dir, run_dir = Path(tmp) / "model", Path(tmp) / "run"
        save_random_checkpoint(check, scale.grpo_model, model_dir)
        free_memory()
        overrides = [
            "algo.name=grpo",
            "runtime.executor=reference",
            f"runtime.device={check.device.type}",
            "loop.eval_every=0",
            "loop.save_every=0",
            "loop.progress=false",
            "report.html=false",
            *scale.grpo,
            f"actor.model={model_dir}",
            f"run_dir={run_dir}",
        ]
        from loomrl.train.rl import RLTrainer  # the trainer's imports are the heaviest: only this part needs them

        RLTrainer(load_config(TrainConfig, None, overrides)).run()
        rows = call_split(RunDir(run_dir))
    check.show(rows, f"GRPO, reference executor, {scale.grpo_model} (random): seconds per iteration by call")
    return {"rows": rows, "overrides": list(scale.grpo)}


# --------------------------------------------------------------------------------------------------- profile
def matmul_rows(check: Check, dtype: torch.dtype) -> list[dict[str, Any]]:
    """The rate of each of a layer's matmuls (and the output head) at every training shape."""
    rows = []
    tokens = check.scale.matmul_tokens
    for name in check.scale.train_models:
        fields = ARCHITECTURES[name]
        h, i, v = fields["hidden_size"], fields["intermediate_size"], fields["vocab_size"]
        for what, k, n in (("attention in", h, h), ("mlp up", h, 2 * i), ("mlp down", i, h), ("head", h, v)):
            flops = 2 * tokens * k * n
            rate = matmul_rate(tokens, k, n, dtype, check.device)
            rows.append({"model": name, "matmul": f"{what} {tokens}×{k}×{n}", "TFLOP/s": rate / 1e12, "flops": flops})
    return rows


def decode_step_figures(check: Check, bandwidth: float) -> tuple[float, list[dict[str, Any]]]:
    """(decode_step_s, rows): the time of the engine's decode step at one sequence that reading the weights and
    keys and values at ``bandwidth`` does not explain (a serving engine's fixed step time; ``decode_bw_efficiency``
    stays neutral). The rows show the step at the first concurrency too, beside the profile's price of it."""
    scale, name = check.scale, check.scale.decode_models[0]
    model = build_random_lm(name, check.device, resolve_dtype("auto", check.device))
    shape, params = ModelShape.from_config(model.config), count_parameters(model)
    kv_token = shape.layers * 2 * shape.kv_dim * model.dtype.itemsize
    tokens = max(4, scale.new_tokens // 4)
    points = []
    with torch.no_grad():
        engine_seconds(model, random_prompts(1, scale.prompt_len, shape.vocab, seed=7), 2)  # warm-up
        for c in (1, scale.concurrency[0]):
            seconds, engine = engine_seconds(model, random_prompts(c, scale.prompt_len, shape.vocab, seed=c), tokens)
            read = params * model.dtype.itemsize + c * (scale.prompt_len + tokens / 2) * kv_token
            points.append((c, read, seconds / len(engine.step_log)))
    step_s = max(0.0, points[0][2] - points[0][1] / bandwidth)
    rows = [
        {
            "model": name,
            "sequences": c,
            "bytes read (MB)": read / 1e6,
            "step ms": seconds * 1e3,
            "profile's price ms": (read / bandwidth + step_s) * 1e3,
        }
        for c, read, seconds in points
    ]
    return step_s, rows


def profile_name(check: Check) -> str:
    """``local`` on CPU (the name the planner gives a measured CPU); the GPU's name in lower case on a GPU."""
    gpu = check.gpu_name
    return "local" if gpu is None else re.sub(r"[^a-z0-9.]+", "-", gpu.lower()).strip("-")


def measured_profile(check: Check) -> tuple[HardwareProfile, list[dict[str, Any]], list[dict[str, Any]]]:
    """The device measured as a profile: calibrate_local's figures (copy bandwidth, operator overhead, host to
    device, memory), the matmul rate at the model shapes, and the decode step's fixed time; the efficiencies
    neutral, as in every measured profile (fitted corrections of finished runs play their part)."""
    dtype = resolve_dtype("auto", check.device)
    base = calibrate_local(device=check.device.type, **check.scale.calibrate)
    matmuls = matmul_rows(check, dtype)
    seconds = sum(r["flops"] / (r["TFLOP/s"] * 1e12) for r in matmuls)
    rate = sum(r["flops"] for r in matmuls) / seconds
    step_s, decode = decode_step_figures(check, base.mem_bandwidth)
    free_memory()
    profile = dataclasses.replace(base, name=profile_name(check), matmul_flops=rate, decode_step_s=step_s)
    return profile, matmuls, decode


def profile_part(check: Check) -> dict[str, Any]:
    profile, matmuls, decode = measured_profile(check)
    to_host = device_to_host_bandwidth(check.scale.calibrate.get("copy_mb", 256), check.device)
    text = json.dumps(dataclasses.asdict(profile), indent=2) + "\n"
    paths = [check.out.parent / f"profile_{profile.name}.json"]
    if check.device.type == "cuda":
        paths.append(ROOT / "benchmarks" / "profiles" / f"{profile.name}.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        load_profile(path)  # the form `loomrl plan --profile` reads: fails here rather than there
    check.show([{k: v for k, v in r.items() if k != "flops"} for r in matmuls], "matmul rate at the model shapes")
    check.show(decode, "decode step time")
    figures = [
        {"figure": "matmul_flops (TFLOP/s)", "value": profile.matmul_flops / 1e12},
        {"figure": "mem_bandwidth (GB/s)", "value": profile.mem_bandwidth / 1e9},
        {"figure": "host_bw: host to device (GB/s)", "value": profile.host_bw / 1e9},
        {"figure": "device to host (GB/s, not in the profile)", "value": to_host / 1e9},
        {"figure": "op_overhead (µs)", "value": profile.op_overhead * 1e6},
        {"figure": "decode_step_s (ms)", "value": profile.decode_step_s * 1e3},
        {"figure": "memory (GiB)", "value": profile.memory_bytes / 2**30},
    ]
    check.show(figures, f"profile {profile.name}, written to {', '.join(str(p) for p in paths)}")
    return {
        "profile": dataclasses.asdict(profile),
        "paths": [str(p) for p in paths],
        "matmuls": matmuls,
        "decode": decode,
        "device_to_host_bw": to_host,
    }


PART_FUNCTIONS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "tests": tests_part,
    "decode": decode_part,
    "train": train_part,
    "grpo": grpo_part,
    "profile": profile_part,
}


# ------------------------------------------------------------------------------------------------------ main
def parse_parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    for part in parts:
        if part not in PARTS:
            raise argparse.ArgumentTypeError(f"'{part}' is not a part; valid: {', '.join(PARTS)}")
    if not parts:
        raise argparse.ArgumentTypeError(f"no part named; valid: {', '.join(PARTS)}")
    return tuple(p for p in PARTS if p in parts)  # in the check's order: tests first, before models fill memory


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the dry run: tiny shapes on this machine's CPU")
    ap.add_argument("--parts", type=parse_parts, default=PARTS, help=f"comma-separated, of {','.join(PARTS)}")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_check.json"), help="the JSON results file")
    args = ap.parse_args(argv)
    if args.out.is_dir():
        ap.error(f"argument --out: '{args.out}' is a directory; give the JSON file's path")
    return args


def planned_seconds(parts: Sequence[str]) -> float:
    return STARTUP_S + sum(PLANNED_S[p] for p in parts)


def planned_line(parts: Sequence[str]) -> str:
    each = ", ".join(f"{p} {PLANNED_S[p]:.0f} s" for p in parts)
    total = planned_seconds(parts)
    return (
        f"planned on one H100: start-up {STARTUP_S:.0f} s, {each}; planned total: {total / 60:.1f} min "
        f"(limit {MAX_PLANNED_S / 60:.0f} min)"
    )


def run_part(check: Check, part: str) -> dict[str, Any]:
    """One part's results with its measured seconds; a failure is recorded, so the other parts still run."""
    start = time.perf_counter()
    try:
        result = PART_FUNCTIONS[part](check)
    except Exception as err:  # a rare GPU lease must not lose the other parts to one failure
        traceback.print_exc()
        check.console.print(f"[red]{part}: failed ({type(err).__name__}: {err})[/red]")
        result = {"error": f"{type(err).__name__}: {err}"}
    return {**result, "seconds": time.perf_counter() - start, "planned_s": PLANNED_S[part]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; --cpu runs the dry run with tiny shapes", file=sys.stderr)
        return 2
    quiet_libraries()
    device = torch.device("cpu") if args.cpu else torch.device("cuda")
    check = Check(device, CPU if args.cpu else GPU, args.out, Console(width=160))
    check.console.print(planned_line(args.parts))
    report: dict[str, Any] = {
        "device": check.gpu_name or "cpu",
        "dry_run": args.cpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "planned_total_s": planned_seconds(args.parts),
        "parts": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for part in args.parts:
        report["parts"][part] = run_part(check, part)
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    failed = [p for p, r in report["parts"].items() if "error" in r or r.get("ok") is False]
    check.console.print(f"wrote {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
