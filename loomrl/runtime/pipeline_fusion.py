"""A fused train step on one worker: two train calls whose pipelines run as one (intra-stage fusion).

The two calls' ops (PPO's actor and critic train) run as written, each in its own thread, but never at the same
time: a baton passes between them, so every rank issues its collectives in the same order. Each op runs until
its role's engine is asked for a backward; the engine of a fused role (:class:`_Deferred`) only records the
request and hands the baton on. Once both ops wait on a backward, one fused pipeline step runs both
(:func:`loomrl.parallel.pipeline_fusion.pipeline_fusion_backward`) with this device's order of the plan's fused
schedule, and the ops resume, in turn, to sum, clip and step their gradients. An op with more optimizer steps
than the other runs its extra backwards alone, through its own engine.

The fused schedule cuts every replica's rows into the plan's micro-batch count (as the schedule was made for):
a replica with fewer rows than micro-batches (or none) adds padding micro-batches of one token whose loss is
zero, so they run their tasks, sends and receives and add nothing to any gradient.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loomrl.parallel.pipeline_fusion import FusedTask, PipelineFusionSide, pipeline_fusion_backward
from loomrl.role.passes import at_responses
from loomrl.workflow.batch import response_width

__all__ = ["BackwardRequest", "run_pipeline_fusion"]


@dataclass
class BackwardRequest:
    """What an op asked its engine for: a forward and backward of ``parts`` of the rows (see
    :meth:`loomrl.algorithms.context.Passes.backward`)."""

    ids_BL: torch.Tensor | None
    attn_BL: torch.Tensor | None
    parts: list[slice]
    loss: Callable | None
    passes: int


class _Aborted(RuntimeError):
    """Raised in an op's thread when the other op failed: its backward will never run."""


class _Baton:
    """Lets exactly one of the op threads or the coordinator run at a time."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.holder: object = "coordinator"

    def pass_to(self, holder: object) -> None:
        with self.cond:
            self.holder = holder
            self.cond.notify_all()

    def wait_for(self, holder: object) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.holder == holder)


class _OpThread:
    """One op run in its own thread, yielding the baton at each backward request and at its end."""

    def __init__(self, index: int, run: Callable[[], dict], baton: _Baton) -> None:
        self.index, self.run, self.baton = index, run, baton
        self.request: BackwardRequest | None = None
        self.result: dict | None = None
        self.error: BaseException | None = None
        self.aborted = False
        self.finished = False
        self.thread = threading.Thread(target=self._main, name=f"fused-train-{index}", daemon=True)

    def _main(self) -> None:
        self.baton.wait_for(self.index)
        try:
            self.result = self.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the coordinator, which re-raises it
            self.error = exc
        self.finished = True
        self.baton.pass_to("coordinator")

    def backward(self, request: BackwardRequest) -> None:
        """Called in this thread by the deferred engine: park the request, wait until it has run."""
        self.request = request
        self.baton.pass_to("coordinator")
        self.baton.wait_for(self.index)
        if self.aborted:
            raise _Aborted("the fused train step was aborted: the other call failed")

    def resume(self) -> None:
        """Run the op (from the coordinator) until its next backward request or its end."""
        self.baton.pass_to(self.index)
        self.baton.wait_for("coordinator")


class _Deferred:
    """A fused role's engine during the step: inference and gradient sums go to the role's own engine; a backward
    is parked for the coordinator."""

    def __init__(self, passes, op: _OpThread) -> None:
        self.passes, self.op = passes, op

    @property
    def device(self):
        return self.passes.device

    any_parts = False
    """A fused step drives pipeline stages, which cut near-equal micro-batches."""

    def outputs(self, *args, **kwargs):
        return self.passes.outputs(*args, **kwargs)

    def backward(self, ids_BL, attn_BL, parts, loss, passes, prompt_len_B=None, temperature=1.0) -> None:
        # a fused step drives pipeline stages, which run whole rows: the loss gets what they give at the response
        # columns, as the role's own engine gives it
        width = response_width(attn_BL, prompt_len_B) if prompt_len_B is not None and attn_BL is not None else 0
        cut = at_responses(loss, list(parts), ids_BL, prompt_len_B, width, temperature)
        self.op.backward(BackwardRequest(ids_BL, attn_BL, list(parts), cut, passes))

    def reduce_and_clip(self, max_norm: float) -> float:
        return self.passes.reduce_and_clip(max_norm)


def run_pipeline_fusion(
    ops: Sequence[Callable[[], dict]],
    roles: Sequence,
    order: Sequence[FusedTask],
    back_groups: Sequence,
    stage_ranks: Sequence[Sequence[int]],
) -> list[dict]:
    """Run two train ops as one fused step per pair of optimizer steps (module docstring); returns their results.

    ``roles[i]`` is op i's :class:`~loomrl.algorithms.context.Role` (its engine drives a pipeline stage);
    ``order`` this device's tasks of one fused step, model i's tasks naming index i; ``back_groups[i]`` and
    ``stage_ranks[i]`` model i's gradient communicator and the device of each of its stages.
    """
    baton = _Baton()
    threads = [_OpThread(i, op, baton) for i, op in enumerate(ops)]
    passes = [role.passes for role in roles]
    for role, thread in zip(roles, threads):
        role.passes = _Deferred(role.passes, thread)
    try:
        for thread in threads:
            thread.thread.start()
            thread.resume()
            _raise_if_failed(threads)
        while any(t.request is not None for t in threads):
            waiting = {t.index: t for t in threads if t.request is not None}
            if len(waiting) == len(threads):
                _fused_backward([t.request for t in threads], passes, order, back_groups, stage_ranks)
            else:
                for t in waiting.values():
                    r = t.request
                    passes[t.index].backward(r.ids_BL, r.attn_BL, r.parts, r.loss, r.passes)
            for t in waiting.values():
                t.request = None
                t.resume()
                _raise_if_failed(threads)
        return [t.result for t in threads]
    except BaseException:
        for t in threads:
            if not t.finished:
                t.aborted = True
                t.resume()
        raise
    finally:
        for role, own in zip(roles, passes):
            role.passes = own


def _raise_if_failed(threads: Sequence[_OpThread]) -> None:
    for t in threads:
        if t.error is not None:
            raise t.error


def _fused_backward(
    requests: Sequence[BackwardRequest],
    passes: Sequence,
    order: Sequence[FusedTask],
    back_groups: Sequence,
    stage_ranks: Sequence[Sequence[int]],
) -> None:
    sides = {}
    for i, (request, engine) in enumerate(zip(requests, passes)):
        ids_BL, attn_BL, parts, loss = _padded(request, engine.device)
        sides[i] = PipelineFusionSide(
            engine.pipeline, back_groups[i], ids_BL, attn_BL, parts, loss, stage_ranks=stage_ranks[i]
        )
    pipeline_fusion_backward(order, sides)


def _padded(request: BackwardRequest, device: torch.device):
    """The request's rows and micro-batches with padding micro-batches up to ``passes`` (module docstring)."""
    ids_BL, attn_BL, parts, loss = request.ids_BL, request.attn_BL, list(request.parts), request.loss
    missing = request.passes - len(parts)
    if missing <= 0:
        return ids_BL, attn_BL, parts, _zero_when_none(loss, len(parts))
    width = 1 if attn_BL is None else attn_BL.shape[1]
    pad_ids = torch.zeros((missing, width), dtype=torch.long, device=device)
    pad_attn = torch.zeros((missing, width), dtype=torch.long, device=device)
    pad_attn[:, 0] = 1
    rows = 0 if attn_BL is None else attn_BL.shape[0]
    ids_BL = pad_ids if ids_BL is None else torch.cat([ids_BL.to(device), pad_ids])
    attn_BL = pad_attn if attn_BL is None else torch.cat([attn_BL.to(device), pad_attn])
    parts += [slice(rows + i, rows + i + 1) for i in range(missing)]
    return ids_BL, attn_BL, parts, _zero_when_none(loss, len(request.parts))


def _zero_when_none(loss: Callable | None, real: int) -> Callable:
    """The pipeline's loss callback: the op's loss for its real micro-batches (a micro-batch without loss tokens
    still joins the graph), zero for padding ones."""

    def fn(out: torch.Tensor, k: int) -> torch.Tensor:
        value = loss(out, k) if loss is not None and k < real else None
        return (out * 0).sum() if value is None else value

    return fn
