"""What an MFC's function receives: the role it runs on and the iteration it belongs to.

A :class:`Role` is a plain container of one named model (weights, optimizer, the engine that runs it); nothing
here knows where the model lives or how it is sharded. Executors build roles and hand an :class:`OpContext` to
each MFC function, so the same functions run in the reference executor and on distributed workers. An op runs
its model's forward and backward passes only through the role's :class:`Passes`, which hides whether the model
is whole, one pipeline stage, or sharded over data-parallel ranks (:mod:`loomrl.role`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loomrl.data.tasks import BatchScores

ScoreFn = Callable[[Sequence[str], Sequence[str], Sequence["str | None"], Sequence[Mapping[str, Any]]], BatchScores]
"""``rule(prompts, responses, answers, rows)``: a task's scores of a batch (``Task.score_batch``)."""

KeepFn = Callable[[torch.Tensor, int], torch.Tensor]
"""``keep(outputs, k)``: what to keep of micro-batch ``k``'s per-position outputs (e.g. its log-probs)."""
LossFn = Callable[[torch.Tensor, int], "torch.Tensor | None"]
"""``loss(outputs, k)``: micro-batch ``k``'s scaled loss, or None when it has no loss tokens."""


class StreamControl(Protocol):
    """What a fused stage's executor tells a streaming generation op (:func:`loomrl.algorithms.ops.generate_chunks`):
    how many finished samples make a chunk, and a hook run after every decode step, which may move this replica's
    unfinished samples elsewhere (migration) or take others in, and says whether this replica is done."""

    chunk: int
    """Finished samples gathered before they are handed on."""
    max_prompt: int
    """Longest prompt of the whole batch (migrated samples may arrive with any of them)."""
    max_budget: int
    """Largest per-sample token budget of the whole batch (0: none beyond the sampling parameters')."""
    slots: int
    """Samples the engine decodes at once."""
    in_step: bool
    """Whether this replica must go on stepping in step with the others even with nothing left to decode (the
    replicas agree on a migration step by step until it happens)."""

    def after_step(self, engine) -> bool:
        """Called after each decode step of ``engine`` (a :class:`~loomrl.rollout.RolloutEngine`); True when this
        replica stops generating (its unfinished samples went elsewhere)."""
        ...


@dataclass(frozen=True)
class Resumed:
    """A sample a partial rollout paused, to be continued: what it has generated so far."""

    iteration: int
    """The iteration that trains it (its random stream's, so it continues the stream it began)."""
    tokens: tuple[int, ...]
    logps: tuple[float, ...]
    """The behaviour log-prob of each token: under the policy that sampled it."""
    versions: tuple[int, ...]
    """The policy version that sampled each token."""

    def plain(self) -> tuple:
        """As plain data (what a checkpoint and a controller take): :meth:`of_plain` reads it back."""
        return (self.iteration, list(self.tokens), list(self.logps), list(self.versions))

    @classmethod
    def of_plain(cls, data: Sequence) -> Resumed:
        iteration, tokens, logps, versions = data
        return cls(int(iteration), tuple(int(t) for t in tokens), tuple(logps), tuple(int(v) for v in versions))


@dataclass
class PartialRollout:
    """What a rollout generate call of an asynchronous plan with partial rollouts is told, and what it reports
    (:attr:`OpContext.partial`; :class:`~loomrl.plan.plan.AsyncTraining`). Rows trained in the next iteration
    (or earlier) run to their end; every other row pauses after ``segment_tokens`` more tokens."""

    version: int
    """The policy version of the weights generating: every token this call samples carries it."""
    max_staleness: int
    segment_tokens: int | None
    """Tokens a row generates in this call before it pauses; None: the call's largest response budget over
    ``max_staleness``, rounded up (every sample is interrupted at the same decode step, as a weight update would)."""
    resumed: Mapping[int, Resumed]
    """Rows of the call's batch that continue a paused sample: sample id → what it generated before."""
    paused: dict[int, Resumed] = field(default_factory=dict)
    """Filled by the call: the rows it paused (their columns hold what they generated so far)."""
    versions: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Filled by the call: every row's token versions (prefix included)."""

    def pause_at(self, iteration: int, prefix: int, budget: int) -> int | None:
        """Where a row of ``iteration`` with ``prefix`` tokens pauses (None: it runs to its end)."""
        if iteration <= self.version + 1:
            return None
        return prefix + (self.segment_tokens or -(-budget // self.max_staleness))


class Passes(Protocol):
    """How a role's model runs its passes on this process; ops call nothing else of the model's."""

    @property
    def any_parts(self) -> bool:
        """Whether the ``parts`` given to :meth:`outputs` and :meth:`backward` may be any contiguous row ranges
        (False: near-equal ones, :func:`~loomrl.workflow.batch.micro_batch_slices`, as pipeline stages cut)."""
        ...

    def outputs(
        self,
        ids_BL: torch.Tensor,
        attn_BL: torch.Tensor,
        parts: list[slice],
        keep: KeepFn | None = None,
        prompt_len_B: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """Per-position outputs (logits, or values) of every row, computed micro-batch by micro-batch (``parts``
        of the rows), each reduced by ``keep``, concatenated over rows, on every rank of the model.
        With ``prompt_len_B``, what a loss reads at the rows' response columns only (column t at position
        prompt_len - 1 + t, as many as the longest response part): a policy's B×R×2 log-prob of response token t
        and entropy of its distribution under softmax(logits / ``temperature``)
        (:func:`~loomrl.models.heads.response_outputs`), or values_BR; rows sharing a prompt may compute it
        once. Without, at every position (B×L)."""
        ...

    def backward(
        self,
        ids_BL: torch.Tensor | None,
        attn_BL: torch.Tensor | None,
        parts: list[slice],
        loss: LossFn | None,
        passes: int,
        prompt_len_B: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> None:
        """Forward and backward of each micro-batch, gradients accumulating, ``loss`` given the outputs as
        :meth:`outputs` gives them; ``passes`` is the plan's number of
        micro-batches, which an engine whose passes are collective runs even without rows (``parts`` empty)."""
        ...

    def reduce_and_clip(self, max_norm: float) -> float:
        """Sum the gradients over the data-parallel ranks (where the backward did not), clip them to a global
        norm of ``max_norm`` and return the norm before clipping."""
        ...


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
    passes: Passes | None = None
    """Runs the model's passes (:mod:`loomrl.role`); None for a role without a model."""
    lr_at: Callable[[int], float] | None = None
    """The learning rate of the run's optimizer step k of this role (numbered from 0 over all iterations);
    None keeps the optimizer's own."""
    on_nonfinite: str = "skip"
    """An optimizer step whose loss or gradient norm is NaN or inf: 'skip' it (gradients zeroed, weights and
    optimizer state untouched) or 'stop' the run (``train.on_nonfinite``)."""
    generator: Any = None
    """A rollout engine that keeps its own copy of the weights (vLLM: :mod:`loomrl.rollout.vllm_engine`), built by
    the first generate call that needs one and synced with the model's weights before each; None until then."""

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
    encode: Callable[[str], list[int]] | None = None
    """A prompt's text → its token ids (:func:`loomrl.models.tokenizer.encode_prompt`): what a judge reads."""
    tokenizer: PreTrainedTokenizerBase | None = None
    """The run's tokenizer: multi-turn rollouts render observations through its chat template."""
    train_steps: tuple[tuple[tuple[int, ...], float], ...] = ()
    """``train`` MFCs: per optimizer step, this executor's rows (positions in the given batch) and the weight
    of their mean loss (their share of the step's loss weight over all data-parallel ranks: tokens, or rows)."""
    loss_unit: str = "token"
    """``train`` MFCs: the MFC's ``loss_unit``, what a row weighs in its minibatch's mean loss (``token``: its
    response tokens; ``sequence``: one), by which the op weights each micro-batch's loss."""
    micro_batches: int = 1
    """Micro-batches the call's rows run as (the plan's ``micro_batches`` for its MFC, per data-parallel rank; the
    reference executor's whole batch runs as that many too). Inference and training ops clip it to their row
    count; generation ignores it."""
    recompute: bool = False
    """``train`` MFCs: recompute each decoder layer's activations in the backward instead of keeping them (the
    plan's ``rc``; activation checkpointing). Same gradients, less memory, one more forward."""
    stream: StreamControl | None = None
    """Generate calls of a fused stage: chunking and migration (None: generate everything, then return)."""
    partial: PartialRollout | None = None
    """Rollout generate calls under partial rollouts: which rows continue, where rows pause (None: every row runs
    to its end)."""
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Compute MFCs given one shard of the batch (one per parallel controller): sums a tensor over every shard,
    for batch-level statistics such as advantage whitening. None: the call sees the whole batch."""
