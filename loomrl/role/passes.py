"""The engine that runs a role's passes on this process, whatever the layout puts here.

Ops (:mod:`loomrl.algorithms.ops`) ask an :class:`~loomrl.algorithms.context.Passes` for a model's outputs, for
the backward of a minibatch and for the gradients' sum and clipping; :class:`ModelPasses` answers for a whole
model, a pipeline stage (through its :class:`~loomrl.parallel.pipeline_runner.PipelineRunner`), a
data-parallel replica (gradients summed over its group) or an FSDP shard (every pass collective, so each rank
runs the plan's micro-batches, padding with passes that add nothing). The reference executor's engine is the
plain case: a whole model and no group. Outside FSDP a micro-batch's rows run in length buckets
(:mod:`loomrl.role.length_buckets`), so short rows are not padded to the longest one's width, and a prompt
several rows share runs once for them (:mod:`loomrl.role.shared_prefix`). Where the rows' prompt lengths are
given, the outputs are those at their response columns only (what losses read: a policy's log-probs and
entropies at the sampling temperature, a value model's values), the head computed on the response tokens alone
(:func:`~loomrl.models.heads.response_outputs`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from loomrl.algorithms.context import KeepFn, LossFn
from loomrl.models.heads import applies_head_alone, model_outputs, outputs_at_responses, response_outputs
from loomrl.parallel.data_parallel import sync_gradients
from loomrl.parallel.main_grad import grad_of, zero_fill
from loomrl.parallel.pipeline_runner import PipelineRunner, clip_grad_norm_pp, clip_grads
from loomrl.role.length_buckets import bucketed_outputs
from loomrl.role.shared_prefix import prompt_groups, shared_prefix_outputs
from loomrl.workflow.batch import response_width

__all__ = ["ModelPasses", "at_responses"]


class ModelPasses:
    """Forward and backward passes of one role's model (or stage, or shard) on this process.

    ``pipeline``: the runner of this device's stage (``model`` is then the stage's module); ``dp_group``: the
    data-parallel group whose gradients are summed after the backward (None: nothing to sum, or FSDP, which
    reduce-scatters in the backward); ``lockstep``: every pass is collective over the data-parallel ranks (FSDP),
    so each rank runs exactly the plan's micro-batches per optimizer step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pipeline: PipelineRunner | None = None,
        dp_group: dist.ProcessGroup | None = None,
        lockstep: bool = False,
    ) -> None:
        self.model, self.pipeline, self.dp_group, self.lockstep = model, pipeline, dp_group, lockstep

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def any_parts(self) -> bool:
        """Whether micro-batches may be any row ranges: not on a pipeline, whose stages cut near-equal ones."""
        return self.pipeline is None

    def outputs(
        self,
        ids_BL: torch.Tensor,
        attn_BL: torch.Tensor,
        parts: list[slice],
        keep: KeepFn | None = None,
        prompt_len_B: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        width = response_width(attn_BL, prompt_len_B) if prompt_len_B is not None else 0
        if self.pipeline is not None:
            cut = at_responses(keep, parts, ids_BL, prompt_len_B, width, temperature)
            return self.pipeline.forward(ids_BL, attn_BL, len(parts), output_fn=cut, broadcast_result=True)
        kept = []
        for k, rows in enumerate(parts):
            out = self._micro_batch(ids_BL, attn_BL, rows, prompt_len_B, width, temperature)
            kept.append(keep(out, k) if keep is not None else out)
        return torch.cat(kept) if len(kept) > 1 else kept[0]

    def _micro_batch(
        self,
        ids_BL: torch.Tensor,
        attn_BL: torch.Tensor,
        rows: slice,
        prompt_len_B: torch.Tensor | None,
        width: int,
        temperature: float,
    ) -> torch.Tensor:
        """One micro-batch's outputs (at its rows' ``width`` response columns where their prompt lengths are
        known): in length buckets, the head on the response columns only, and with shared prompts run once
        (neither under FSDP, whose passes are collective over ranks holding other rows and run whole models)."""
        if prompt_len_B is None:
            return bucketed_outputs(self._forward, ids_BL[rows], attn_BL[rows], split=not self.lockstep)
        plen_B = prompt_len_B[rows]
        if self.lockstep:
            whole = bucketed_outputs(self._forward, ids_BL[rows], attn_BL[rows], split=False)
            return outputs_at_responses(whole, ids_BL[rows], plen_B, width, temperature)
        shared = not _recomputes(self.model) and applies_head_alone(self.model)
        forward = self._shared_forward if shared else self._response_forward
        forward = partial(forward, width=width, temperature=temperature)
        return bucketed_outputs(forward, ids_BL[rows], attn_BL[rows], rows_B=(plen_B,), width=width)

    def _forward(self, ids_BL: torch.Tensor, attn_BL: torch.Tensor) -> torch.Tensor:
        return model_outputs(self.model, ids_BL, attn_BL)

    def _response_forward(
        self, ids_BL: torch.Tensor, attn_BL: torch.Tensor, prompt_len_B: torch.Tensor, width: int, temperature: float
    ) -> torch.Tensor:
        return response_outputs(self.model, ids_BL, attn_BL, prompt_len_B, width, temperature)

    def _shared_forward(
        self, ids_BL: torch.Tensor, attn_BL: torch.Tensor, prompt_len_B: torch.Tensor, width: int, temperature: float
    ) -> torch.Tensor:
        groups = prompt_groups(ids_BL, prompt_len_B)
        if groups is None:
            return response_outputs(self.model, ids_BL, attn_BL, prompt_len_B, width, temperature)
        return shared_prefix_outputs(self.model, ids_BL, attn_BL, prompt_len_B, groups, width, temperature)

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
        width = response_width(attn_BL, prompt_len_B) if prompt_len_B is not None and attn_BL is not None else 0
        if self.pipeline is not None:
            if parts:  # every stage of a replica gets the same rows, so a replica without rows skips together
                cut = at_responses(loss, parts, ids_BL, prompt_len_B, width, temperature)
                self.pipeline.train_step_backward(ids_BL, attn_BL, _joined(cut), len(parts))
            return
        for k, rows in enumerate(parts):
            out = self._micro_batch(ids_BL, attn_BL, rows, prompt_len_B, width, temperature)
            value = loss(out, k)
            if value is None and self.lockstep:
                value = (out * 0).sum()  # joins the graph: the backward's collectives still run
            if value is not None:
                value.backward()
        for _ in range(passes - len(parts) if self.lockstep else 0):
            self._idle_pass()

    def _idle_pass(self) -> None:
        """A forward and backward of one padding token that adds nothing to any gradient: on an FSDP role every
        data-parallel rank must run as many passes as the others, each gathering the weights and
        reduce-scattering the gradients with them."""
        ids_BL = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        (model_outputs(self.model, ids_BL, torch.ones_like(ids_BL)).float().sum() * 0).backward()

    def reduce_and_clip(self, max_norm: float) -> float:
        if self.dp_group is not None:
            for p in self.model.parameters():  # a rank without rows still joins the gradient sum
                if p.requires_grad and grad_of(p) is None:
                    zero_fill(p)
            sync_gradients(self.model, self.dp_group)
        if self.pipeline is not None:
            self.pipeline.sum_tied_gradient()
            return clip_grad_norm_pp(self.pipeline.stage, max_norm, self.pipeline.group)
        return clip_grads(self.model.parameters(), max_norm, None, self.device)


def _recomputes(model: torch.nn.Module) -> bool:
    """Whether the model's layers recompute their activations in this pass (transformers' gradient checkpointing,
    which turns the layers' caching off)."""
    return model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _joined(loss: LossFn):
    """A pipeline's loss callback: a micro-batch without loss tokens still joins the graph, so the backward
    (and the pipeline's sends) run."""

    def fn(out: torch.Tensor, k: int) -> torch.Tensor:
        value = loss(out, k)
        return (out * 0).sum() if value is None else value

    return fn


def at_responses(
    fn, parts: list[slice], ids_BL: torch.Tensor, prompt_len_B: torch.Tensor | None, width: int, temperature: float
):
    """``fn(out, k)`` (a keep or loss callback; None: keep the outputs) given micro-batch ``k``'s whole-row
    outputs turned into those at its rows' ``width`` response columns
    (:func:`~loomrl.models.heads.outputs_at_responses`), as :meth:`ModelPasses.outputs` gives them where the
    prompt lengths are known; ``fn`` itself without prompt lengths. For passes that run whole rows (pipeline
    stages)."""
    if prompt_len_B is None:
        return fn

    def cut(out: torch.Tensor, k: int):
        rows = parts[k]
        out = outputs_at_responses(out, ids_BL[rows], prompt_len_B[rows], width, temperature)
        return fn(out, k) if fn is not None else out

    return cut
