"""Weights into a rollout engine that keeps its own copy (vLLM), each sync numbered and verified.

The field's silent failures live here: a sync that reached nothing, a sync that reached part of the model, a
tensor that arrived wrong, an engine generating from weights a version behind. Every sync is therefore checked
three ways before a rollout may use the engine:

1. **Everything arrived**: the engine's loader is fed through a counter, and every tensor of the trainer's model
   must have been consumed exactly once (a dropped bucket names its first missing tensor).
2. **Everything is what the trainer has**: a fingerprint per tensor is computed on both sides and compared. The
   engine repacks its weights for its kernels (vLLM fuses q/k/v and gate/up and, on a CPU, keeps linear weights
   in a packed form whose parameters are empty), so a fingerprint is what any layout still computes: a weight
   matrix's product with a fixed probe vector (``W @ p``, one matrix-vector product per tensor: cheap next to one
   decode step), a vector's own values. The engine's side applies each of its layers to the probe with the
   layer's own kernel and splits fused outputs back into the trainer's tensors, so a mismatch names the
   trainer's tensor (``model.layers.3.self_attn.k_proj.weight``).
3. **The version is the one asked for**: the engine records a sync's version only once 1 and 2 passed, and a
   generate call checks it; a skipped or failed sync can never be generated from.

Tolerances come from the arithmetic, not from a fit: a fingerprint entry may differ by ``rtol`` times the same
product over absolute values (``|W| @ |p|``, the size of what was summed), ``rtol`` 1e-5 in float32 (the two
sides' kernels sum in other orders: 2e-7 of it measured on llama-1m and SmolLM2-135M) and 2e-2 in bf16/fp16 (the
engine rounds the product's output to the weight type: 2^-8 of it). A corrupted tensor moves its fingerprint by
its own change; a tensor left a version behind (its new value never loaded) by the training step's change, which
in float32 exceeds the tolerance for matrices of up to a few thousand columns, and which in 16-bit types may not:
there rule 1 (a tensor that never arrived) and rule 3 (a sync that never completed) are what catch it.

Legend: O = output features (rows) of a weight, I = input features.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from loomrl.errors import LoomError


class WeightSyncError(LoomError):
    """A weight sync into a rollout engine did not leave it with the trainer's weights."""


PROBE_SEED = 20261208
"""Seed of the probe vector both sides multiply weights by (any fixed value: both sides must agree)."""


def tolerance(dtype: torch.dtype) -> float:
    """``rtol`` of a fingerprint entry for weights of ``dtype`` (module docstring)."""
    return 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2


def probe(width: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed probe vector of ``width`` entries (standard normal from :data:`PROBE_SEED`)."""
    gen = torch.Generator().manual_seed(PROBE_SEED + width)
    return torch.randn(width, generator=gen).to(device=device, dtype=dtype)


@dataclass(frozen=True)
class Fingerprint:
    """What a tensor's fingerprint holds: its values (``W @ p`` or the vector) and their scale (``|W| @ |p|``)."""

    values: torch.Tensor
    scale: torch.Tensor


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """The trainer's fingerprint of one tensor: a matrix's product with the probe (rows: O), a vector itself."""
    t = tensor.detach()
    if t.dim() == 1:
        values = t.float().cpu()
        return Fingerprint(values, values.abs())
    w_OI = t.reshape(t.shape[0], -1)
    p_I = probe(w_OI.shape[1], w_OI.dtype, w_OI.device)
    values = (w_OI @ p_I).float().cpu()
    scale = (w_OI.abs().float() @ p_I.abs().float()).cpu()
    return Fingerprint(values, scale)


def compare(trainer: Mapping[str, Fingerprint], engine: Mapping[str, torch.Tensor], rtol: float, where: str) -> None:
    """Raise :class:`WeightSyncError` naming the first tensor whose engine fingerprint is missing or differs, or
    the first the engine holds that the trainer has not (a weight left as the engine had it, such as a separate
    output head where the trainer ties it to the embedding)."""
    for name in engine:
        if name not in trainer:
            raise WeightSyncError(f"{where}: the engine holds tensor '{name}', which the trainer did not send")
    for name, mine in trainer.items():
        theirs = engine.get(name)
        if theirs is None:
            raise WeightSyncError(f"{where}: the engine has no tensor '{name}' to check against the trainer's")
        if theirs.shape != mine.values.shape:
            raise WeightSyncError(
                f"{where}: tensor '{name}' has {tuple(theirs.shape)} fingerprint entries in the engine, "
                f"{tuple(mine.values.shape)} in the trainer"
            )
        err = (theirs.float() - mine.values).abs()
        bound = rtol * (mine.scale + mine.scale.max() * 1e-3) + 1e-6
        bad = err > bound
        if bool(bad.any()):
            at = int(bad.nonzero()[0, 0])
            raise WeightSyncError(
                f"{where}: tensor '{name}' differs from the trainer's (fingerprint entry {at}: engine "
                f"{float(theirs[at]):.6g}, trainer {float(mine.values[at]):.6g}); no rollout uses these weights"
            )


@dataclass(frozen=True)
class SyncReport:
    """One sync's figures, as metrics (``sync/...``)."""

    version: int
    tensors: int
    bytes: int
    seconds: float
    """Moving the tensors into the engine."""
    verify_seconds: float
    """Fingerprints on both sides and their comparison."""

    def as_dict(self) -> dict[str, float]:
        return {
            "sync/version": float(self.version),
            "sync/bytes": float(self.bytes),
            "sync/seconds": self.seconds,
            "sync/verify_seconds": self.verify_seconds,
        }


def check_arrivals(seen: Mapping[str, int], expected: Iterable[str], where: str) -> None:
    """Rule 1 of the module docstring: every name of ``expected`` arrived at the engine exactly once (``seen``:
    how often each name did, counted on the engine's side)."""
    for name in expected:
        if seen.get(name, 0) != 1:
            what = "never reached the engine" if name not in seen else f"reached it {seen[name]} times"
            raise WeightSyncError(f"{where}: tensor '{name}' {what}; no rollout uses these weights")


def verified_sync(
    named: Mapping[str, torch.Tensor],
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], Mapping[str, int]],
    engine_fingerprints: Callable[[], Mapping[str, torch.Tensor]],
    version: int,
    where: str,
) -> SyncReport:
    """Feed ``named`` (the trainer's tensors by HF name) to ``load``, which returns how often each name reached
    the engine (counted on the engine's side of every transfer), then check rules 1 and 2 of the module
    docstring; returns the sync's figures. The caller records ``version`` only when this returns."""
    start = time.perf_counter()
    seen = load(named.items())
    loaded = time.perf_counter()
    check_arrivals(seen, named.keys(), where)
    dtype = next(iter(named.values())).dtype if named else torch.float32
    mine = {name: fingerprint(t) for name, t in named.items()}
    compare(mine, engine_fingerprints(), tolerance(dtype), where)
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    return SyncReport(version, len(named), nbytes, loaded - start, time.perf_counter() - loaded)
