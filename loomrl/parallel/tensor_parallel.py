"""Tensor parallelism (Megatron-style, with DTensor) applied from outside to plain HF Llama and Qwen2 models.

Works on ``*ForCausalLM``, ``*ForSequenceClassification`` and the bare ``*Model`` alike. The plan:

- attention ``q/k/v_proj`` column-wise, ``o_proj`` row-wise; MLP ``gate/up_proj`` column-wise, ``down_proj``
  row-wise. Each rank holds whole heads (tp divides both head counts, see :func:`check_layout`) and a slice of the
  MLP width; each block ends in one all-reduce, so the residual stream stays a replicated plain tensor.
- ``embed_tokens`` row-wise and ``lm_head`` column-wise, both splitting the vocabulary (so a tied pair stays
  one parameter), the head's output all-gathered: logits come back as a plain full-vocabulary tensor,
  bit-identical on every TP rank (each rank concatenates the same pieces). The rollout engine samples on every
  rank from the same per-sample random stream, so every rank draws the same token. Splitting the vocabulary
  keeps the two largest matrices of a real model off every rank; the gathered logits take the memory a
  replicated head's output would have taken anyway.
- a projection with LoRA adapters (peft's layer around the linear, :mod:`loomrl.models.lora`): its base is split
  as the plain projection is; of the adapters, ``lora_B`` of a column-wise projection is split column-wise (its
  output rows are the base's) and ``lora_A`` of a row-wise one row-wise (its input columns are the base's, its r
  outputs all-reduced), Megatron's choice, so each adapter's update adds to the base's local output as it is; the
  other adapter, r × width, is replicated (small: splitting it would add a collective per projection).
- everything else with parameters (norms, a sequence-classification ``score`` head) becomes Replicate DTensors.
  Their inputs are replicated and so are the gradients reaching them (the backward of every column-wise layer
  all-reduces the gradient of its replicated input), so their gradients agree across ranks without any extra
  communication. Making them DTensors too (rather than leaving plain tensors) keeps every parameter the same
  kind, which foreach optimizers, ``clip_grad_norm_`` and :func:`full_state_dict` require.

Pipeline stages (:func:`loomrl.parallel.pipeline.split_stages`) are sharded the same way, each over its own
TP mesh, after the split: modules a stage replaced with ``nn.Identity`` (the embedding off the first stage, the
final norm and head off the last) are skipped, and the stage's ``layers`` ModuleDict, keyed by global layer
index, matches the same ``layers.*`` patterns. Hidden states between stages are the replicated residual
stream, plain tensors identical on every TP rank of a stage, so TP rank t of stage s exchanges them with TP
rank t of stage s ± 1 only.

How HF attention sees local heads: the attention modules reshape projections with
``view(*shape, -1, head_dim)``, so with ``use_local_output=True`` they see ``heads / tp`` query heads and
``kv_heads / tp`` key/value heads; their only head-count attribute, ``num_key_value_groups`` (query heads per
key/value head), is the same ratio locally, and rank r's query heads are exactly those served by its key/value
heads because both are split in contiguous blocks. A KV cache therefore stores local heads only: the rollout
engine's ``SlotKVCache`` allocates from the first key tensor it is given, which is already local. Attention
masks, rotary embeddings and position ids are replicated and untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import PreTrainedModel

from loomrl.models.lora import has_adapters
from loomrl.plan.layout import Layout, check_layout


def apply_tensor_parallel(
    model: PreTrainedModel, tp_mesh: DeviceMesh, src_data_rank: int | None = 0
) -> PreTrainedModel:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` and return it (unchanged when the mesh has one rank).

    ``model`` may be a whole model or a pipeline stage's pruned model (see the module docstring); parameter
    names do not change either way. ``src_data_rank``: the mesh rank whose weights are split and sent to the
    others (so ranks need not have built identical weights); None slices each rank's own copy without
    communication.
    """
    tp = tp_mesh.size()
    if tp == 1:
        return model
    check_layout(Layout(tp=tp), model.config, tp, where="tensor parallel")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} is already distributed; apply tensor parallelism once")
    tied = _tied_embeddings(model)
    parallelize_module(model, tp_mesh, _plan(model), src_data_rank=src_data_rank)
    if tied:
        # Each style wrapped the shared weight in its own Parameter. Both split the vocabulary rows (Shard(0)),
        # so one DTensor serves both modules again and its gradient sums both uses, as in the plain model.
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    _replicate_remaining(model, tp_mesh, src_data_rank)
    return model


def _tied_embeddings(model: PreTrainedModel) -> bool:
    """Whether ``model`` holds both an input embedding and a linear output head sharing one weight.

    False when either is missing, e.g. on a pipeline stage that kept only one of them (``nn.Identity`` in the
    other's place): each then is sharded on its own.
    """
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return isinstance(head, nn.Linear) and isinstance(embed, nn.Embedding) and head.weight is embed.weight


def _plan(model: PreTrainedModel) -> dict[str, Any]:
    """Module path (fnmatch patterns, relative to ``model``) → parallel style.

    Only modules ``model`` really holds: a pipeline stage's ``nn.Identity`` embedding or head gets no style.
    """
    base = _base_prefix(model)
    plan: dict[str, Any] = {}
    if isinstance(getattr(model.base_model, "embed_tokens", None), nn.Embedding):
        plan[f"{base}embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    layers = getattr(model.base_model, "layers", None)
    first = next(iter(layers.values() if isinstance(layers, nn.ModuleDict) else layers)) if layers else None
    for path, column in _PROJECTIONS:
        pattern = f"{base}layers.*.{path}"
        style = ColwiseParallel if column else RowwiseParallel
        if first is None or not has_adapters(first.get_submodule(path)):
            plan[pattern] = style()
            continue
        # LoRA (see the module docstring): the base as the plain projection, the adapter on the split side split
        # with it, the other (r wide) replicated by _replicate_remaining
        plan[f"{pattern}.base_layer"] = style()
        plan[f"{pattern}.{'lora_B' if column else 'lora_A'}.*"] = style()
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


_PROJECTIONS = (
    ("self_attn.q_proj", True),
    ("self_attn.k_proj", True),
    ("self_attn.v_proj", True),
    ("self_attn.o_proj", False),
    ("mlp.gate_proj", True),
    ("mlp.up_proj", True),
    ("mlp.down_proj", False),
)
"""Each layer's projections, column-wise (True) or row-wise."""


def _base_prefix(model: PreTrainedModel) -> str:
    """'model.' for a model with a head, '' for a bare backbone (its own base_model)."""
    base = model.base_model
    if base is model:
        return ""
    for name, module in model.named_children():
        if module is base:
            return f"{name}."
    raise TypeError(f"{type(model).__name__}: its base model is not a direct child")


def _replicate_remaining(model: nn.Module, tp_mesh: DeviceMesh, src_data_rank: int | None) -> None:
    """Turn the plain parameters left (norms, score head) into Replicate DTensors; see the module docstring.

    Works on pipeline stages too: whatever a stage dropped is an ``nn.Identity`` without parameters.
    """
    for name, module in list(model.named_modules()):
        own = [p for p in module._parameters.values() if p is not None and not isinstance(p, DTensor)]
        if not own:
            continue
        if next(module.children(), None) is not None:
            # distribute_module would also convert the children's buffers (e.g. rotary frequencies).
            raise TypeError(f"tensor parallelism: module '{name}' has both parameters and submodules")
        distribute_module(
            module,
            tp_mesh,
            partition_fn=_replicate_params(src_data_rank),
            input_fn=_inputs_to_replicate,
            output_fn=_outputs_to_local,
        )


def _replicate_params(src_data_rank: int | None) -> Callable[[str, nn.Module, DeviceMesh], None]:
    """A partition_fn replicating a leaf's parameters from ``src_data_rank`` (as the sharded layers are split)."""

    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                full = distribute_tensor(param.data, mesh, [Replicate()], src_data_rank=src_data_rank)
                module.register_parameter(key, nn.Parameter(full, requires_grad=param.requires_grad))

    return partition


def _inputs_to_replicate(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _outputs_to_local(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    if isinstance(outputs, DTensor):
        return outputs.to_local()
    if isinstance(outputs, tuple):
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
    return outputs
