"""What an MFC's function receives: the role it runs on and the iteration it belongs to.

A :class:`Role` is a plain container of one named model (weights, optimizer, tokenizer); nothing here knows
where the model lives or how it is sharded. Executors build roles and hand an :class:`OpContext` to each MFC
function, so the same functions run in the reference executor and on distributed workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import PreTrainedModel

ScoreFn = Callable[[str, str, "str | None"], float]


@dataclass
class Role:
    """One named model of the workflow (actor, critic, ref, reward)."""

    name: str
    model: PreTrainedModel | None = None
    optimizer: torch.optim.Optimizer | None = None
    grad_clip: float = 1.0
    rule: ScoreFn | None = None
    """A rule-based scorer (reward role); combined with the model's score by ``rule_weight``/``model_weight``."""
    rule_weight: float = 1.0
    model_weight: float = 1.0
    pipeline: Any = None
    """A ``loomrl.parallel.PipelineRunner`` when ``model`` is one pipeline stage; calls then go through it."""
    lr_at: Callable[[int], float] | None = None
    """The learning rate of the run's optimizer step k of this role (numbered from 0 over all iterations);
    None keeps the optimizer's own."""

    @property
    def device(self) -> torch.device:
        if self.model is None:
            return torch.device("cpu")
        return next(self.model.parameters()).device


@dataclass(frozen=True)
class OpContext:
    """Everything an MFC function may depend on besides its input batch."""

    role: Role | None
    seed: int
    iteration: int
    pad_id: int
    eos_id: int
    decode: Callable[[list[int]], str]
    """Token ids → text (the tokenizer's decode without special tokens)."""
    train_steps: tuple[tuple[tuple[int, ...], float], ...] = ()
    """``train`` MFCs: per optimizer step, this executor's rows (positions in the given batch) and the weight
    of their token-mean loss (their share of the step's tokens over all data-parallel ranks)."""
    sync_grads: Callable[[torch.nn.Module], None] | None = None
    """Sums gradients over the data-parallel group before the optimizer step; None in a single process."""
    micro_batches: int = 1
    """Micro-batches the call's rows run as (the plan's ``micro_batches`` for its MFC; 1 in the reference
    executor). Inference and training ops clip it to their row count; generation ignores it."""
    recompute: bool = False
    """``train`` MFCs: recompute each decoder layer's activations in the backward instead of keeping them (the
    plan's ``rc``; activation checkpointing). Same gradients, less memory, one more forward."""
    lockstep: bool = False
    """``train`` MFCs of an FSDP role: every data-parallel rank runs exactly ``micro_batches`` forward and
    backward passes per optimizer step (they are collective), padding with passes that add nothing."""
