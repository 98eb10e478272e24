"""What loomrl adds to vLLM's worker, inside the engine's own process (vLLM's ``worker_extension_cls``).

The engine runs in a process of its own (:mod:`loomrl.rollout.vllm_engine` says why), so weights reach it as
messages: a sync is begun, its tensors arrive in buckets (raw bytes with names, shapes and a type), and ending it
reloads them all at once through vLLM's in-place reload and reports how often each name arrived. The weights'
fingerprints (:mod:`loomrl.rollout.weight_sync`) are computed here, with each layer's own kernel, and travel
back as bytes. Only names, numbers and bytes cross the process boundary: vLLM's message encoding refuses
anything else unless told to unpickle arbitrary objects, which this extension never needs.

This module is imported by the engine's process by name; it must not import the rest of loomrl's training stack
(only :mod:`loomrl.rollout.weight_sync`, which is plain torch).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from loomrl.rollout.weight_sync import probe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes (any dtype, bf16 included: numpy has no bf16, so through uint8)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_of(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class LoomrlWorker:
    """Methods vLLM mixes into its worker class; called by name through ``LLM.collective_rpc``."""

    model_runner: Any
    """vLLM's worker's (whose ``model`` is the engine's model)."""
    reload_weights: Any
    """vLLM's worker's in-place reload (``weights_iterator``, ``is_checkpoint_format``)."""

    def loomrl_pid(self) -> int:
        return os.getpid()

    def loomrl_begin_sync(self) -> None:
        self._loomrl_bucket: list[tuple[str, torch.Tensor]] = []
        self._loomrl_seen: dict[str, int] = {}

    def loomrl_bucket(self, names: list[str], shapes: list[list[int]], dtype: str, data: bytes) -> None:
        """One bucket of a sync: ``names`` with their ``shapes``, packed one after another in ``data``."""
        flat = tensor_of(data, DTYPES[dtype], [-1])
        at = 0
        for name, shape in zip(names, shapes):
            n = 1
            for s in shape:
                n *= s
            self._loomrl_bucket.append((name, flat[at : at + n].view(shape)))
            self._loomrl_seen[name] = self._loomrl_seen.get(name, 0) + 1
            at += n

    def loomrl_end_sync(self) -> dict[str, int]:
        """Reload every tensor the sync brought, in place; how often each name arrived."""
        tensors, self._loomrl_bucket = self._loomrl_bucket, []
        self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        return dict(self._loomrl_seen)

    def loomrl_fingerprints(self) -> dict[str, bytes]:
        """The engine's fingerprint of every tensor it can name by the trainer's names, as float32 bytes: a linear
        layer (fused or not, packed or not) applied to the probe, its output split back into the trainer's
        projections; an embedding's rows times the probe; one-dimensional weights (norms) as they are."""
        model = self.model_runner.model
        packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, module in model.named_modules():
                method, weight = getattr(module, "quant_method", None), getattr(module, "weight", None)
                if method is None or weight is None:
                    continue
                if hasattr(module, "org_vocab_size"):  # embedding or output head, rows padded past the vocabulary
                    rows = weight[: module.org_vocab_size].float()
                    out[f"{name}.weight"] = rows @ probe(weight.shape[1]).float()
                elif hasattr(module, "input_size_per_partition"):
                    out.update(_linear_fingerprints(name, module, packed))
            for pname, param in model.named_parameters():
                if param.dim() == 1 and param.numel() and pname not in out:
                    out[pname] = param.detach().float()
        return {k: tensor_bytes(v.float().cpu()) for k, v in out.items()}


def _linear_fingerprints(name: str, module, packed: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """A linear layer's output for the probe (its bias left out), split into the projections vLLM fused."""
    dtype = getattr(module, "params_dtype", None) or torch.float32
    p_I = probe(module.input_size_per_partition, dtype)
    y_O = module.quant_method.apply(module, p_I[None, :])[0].float()
    prefix, _, leaf = name.rpartition(".")
    parts = packed.get(leaf)
    sizes = list(getattr(module, "output_sizes", None) or [y_O.shape[0]])
    if parts is None or len(parts) != len(sizes):
        return {f"{name}.weight": y_O}
    out = {f"{prefix}.{sub}.weight": piece for sub, piece in zip(parts, torch.split(y_O, sizes))}
    bias = getattr(module, "bias", None)
    if bias is not None and bias.numel():
        out.update({f"{prefix}.{sub}.bias": b for sub, b in zip(parts, torch.split(bias.detach().float(), sizes))})
    return out
