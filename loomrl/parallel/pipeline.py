"""Pipeline-parallel stages of HF Llama / Qwen2 models: each rank keeps a contiguous run of decoder layers.

:func:`split_stages` cuts a plain HF model (``*ForCausalLM``, ``*ForSequenceClassification`` with a ``score``
head, or the bare backbone) in place, so that pipeline rank ``r`` of ``pp`` keeps only

- decoder layers ``r·n/pp .. (r+1)·n/pp - 1`` of the ``n`` in ``model.model.layers``;
- the token embedding if it is the first stage;
- the final norm and the head (``lm_head`` or ``score``) if it is the last stage.

A head that shares the token embedding's weight (tied embeddings, as SmolLM2 and Qwen2.5's small models have)
keeps sharing it on the last stage, so the first and the last stage each hold the matrix under its one name,
``model.embed_tokens.weight`` (:func:`loomrl.plan.shards.pp_stages`), as Megatron-LM's first and last stages
hold their word embeddings. The pair then stays one weight: both start from the same values, the runner sums the
two stages' gradients (the lookup's and the head's: the whole model's gradient,
:meth:`~loomrl.parallel.pipeline_runner.PipelineRunner.sum_tied_gradient`), the global norm counts the matrix
once, and each stage's optimizer takes the same step. Checkpoints write it once (from the first stage) and
reallocation treats the last stage's copy as one more holder and receiver of it.

Every other module is replaced by ``nn.Identity`` and the dropped layers lose their last reference, so their
memory is freed (split before building an optimizer, which would keep them alive). The kept layers move into an
``nn.ModuleDict`` keyed by their GLOBAL index, so every parameter keeps its original fully-qualified name
(``model.layers.5.mlp.up_proj.weight`` on the stage that holds layer 5): checkpoints, ``full_state_dict`` and
the reallocation planner address parameters by those names on any layout.

A stage's :meth:`PipelineStage.forward` replaces the HF backbone's forward (which iterates ``layers`` by
position and cannot start from hidden states of the middle of the stack): it embeds (first stage) or takes the
previous stage's hidden states, rebuilds the rotary embeddings and the causal masks with the model's own
``rotary_emb`` and transformers' ``masking_utils`` (so eager / sdpa / sliding-window behave as in HF), runs its
layers and, on the last stage, the norm and head. Nothing here communicates; :mod:`loomrl.parallel.pipeline_runner`
moves activations between stages.

Pipeline and tensor parallelism combine: split first, then shard the stage's ``model`` with
:func:`loomrl.parallel.apply_tensor_parallel` over the stage's TP mesh (the parameter names stay global, and
the modules a stage dropped are skipped); the forward above then runs unchanged on the sharded layers.

Legend: B rows, L tokens per row (right-padded), H hidden size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from loomrl.errors import ConfigError
from loomrl.models.heads import score_head, tied_embeddings

PP_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2")
"""``model_type`` values whose backbone :class:`PipelineStage` re-implements (embed → layers → norm with RoPE)."""

# The mask each layer type attends with; the keys are the values of HF's ``config.layer_types``.
_MASK_BUILDERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def check_pipeline(config: object, pp_size: int, where: str = "layout") -> None:
    """Raise a one-line :class:`ConfigError` unless a model of HF ``config`` splits into ``pp_size`` equal stages."""
    if pp_size == 1:
        return
    model_type = getattr(config, "model_type", None)
    if model_type not in PP_ARCHITECTURES:
        raise ConfigError(
            f"{where}.pp: {pp_size} needs one of the architectures {', '.join(PP_ARCHITECTURES)}; "
            f"model_type '{model_type}' supports only pp=1"
        )
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers % pp_size:
        raise ConfigError(f"{where}.pp: {pp_size} does not divide num_hidden_layers={layers}")


class PipelineStage:
    """One pipeline rank's part of a model: the pruned HF model plus what its forward needs to know.

    Not an ``nn.Module`` on purpose: wrapping the HF model would prefix every parameter name. ``model`` is the
    pruned HF model itself (optimizers, checkpoints and ``train()`` / ``eval()`` use it directly).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        pp_rank: int,
        pp_size: int,
        layer_ids: tuple[int, ...],
        output: str,
        head_name: str | None,
        tied: bool = False,
    ):
        self.model = model
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.layer_ids = layer_ids
        """Global indices of the decoder layers this stage runs, in order."""
        self.output = output
        """What the last stage returns: 'logits' (B×L×V), 'values' (B×L, float32) or 'hidden' (B×L×H)."""
        self._head_name = head_name
        self.tied = tied
        """Whether the first and the last stage both hold the input embedding, shared with the output head."""

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def device(self) -> torch.device:
        """Where the stage computes: its parameters' device (cpu for gloo, a GPU for nccl)."""
        return next(self.model.parameters()).device

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This stage's parameters under their original, global names."""
        return self.model.named_parameters()

    @property
    def tied_weight(self) -> nn.Parameter | None:
        """The shared embedding matrix on the first and the last stage of a tied model; None elsewhere."""
        if not self.tied or not (self.is_first or self.is_last):
            return None
        return self.model.base_model.embed_tokens.weight

    @property
    def copies_tied_weight(self) -> bool:
        """Whether this stage's shared embedding is the second copy (the last stage's), which the global
        gradient norm leaves to the first stage (as checkpoints do every embedding past the first stage)."""
        return self.tied and self.is_last and not self.is_first

    def forward(
        self, inputs: torch.Tensor, attention_mask_BL: torch.Tensor, position_ids_BL: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids_BL (first stage) or hidden_BLH (others) → hidden_BLH, or the head's output on the last stage.

        ``attention_mask_BL`` is the 2-D padding mask of the rows (every stage needs it: masks are rebuilt per
        stage rather than shipped, being cheap to compute and B×L×L to send). Position ids default to
        ``0..L-1`` as in HF's cache-less forward, which is right for right-padded rows.
        """
        base = self.model.base_model
        hidden_BLH = base.embed_tokens(inputs) if self.is_first else inputs
        if position_ids_BL is None:
            position_ids_BL = torch.arange(hidden_BLH.shape[1], device=hidden_BLH.device).unsqueeze(0)
        masks = {
            kind: _MASK_BUILDERS[kind](
                config=self.model.config,
                inputs_embeds=hidden_BLH,
                attention_mask=attention_mask_BL,
                past_key_values=None,
                position_ids=position_ids_BL,
            )
            for kind in {self._layer_type(i) for i in self.layer_ids}
        }
        rope = base.rotary_emb(hidden_BLH, position_ids=position_ids_BL)
        for index, layer in zip(self.layer_ids, base.layers.values()):
            hidden_BLH = layer(
                hidden_BLH,
                attention_mask=masks[self._layer_type(index)],
                position_ids=position_ids_BL,
                position_embeddings=rope,
                use_cache=False,
            )
        if not self.is_last:
            return hidden_BLH
        return self._head(base.norm(hidden_BLH))

    def _layer_type(self, index: int) -> str:
        """The attention pattern of global layer ``index`` (HF indexes ``layer_types`` by the global index too)."""
        types = getattr(self.model.config, "layer_types", None)
        kind = types[index] if types else "full_attention"
        if kind not in _MASK_BUILDERS:
            raise TypeError(f"pipeline stage: layer {index} has attention type '{kind}', which has no mask builder")
        return kind

    def _head(self, hidden_BLH: torch.Tensor) -> torch.Tensor:
        if self.output == "hidden":
            return hidden_BLH
        head = getattr(self.model, self._head_name)
        if self.output == "logits":
            return head(hidden_BLH)
        # As loomrl.models.heads.token_values: the score head at every position, in float32.
        return head(hidden_BLH.to(head.weight.dtype)).squeeze(-1).float()


def split_stages(model: PreTrainedModel, pp_rank: int, pp_size: int) -> PipelineStage:
    """Prune ``model`` in place to pipeline stage ``pp_rank`` of ``pp_size`` and return that stage.

    Raises the one-line :class:`ConfigError` of :func:`check_pipeline` when the layers do not split evenly. A
    tied input/output embedding stays on the first and the last stage (see the module docstring).
    """
    check_pipeline(model.config, pp_size, where="pipeline")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside 0..{pp_size - 1}")
    base = model.base_model
    if not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__}: no decoder ModuleList at {type(base).__name__}.layers "
            "(already split, or not a Llama-like model)"
        )
    output, head_name = _output_kind(model)
    tied = pp_size > 1 and tied_embeddings(model)
    per_stage = model.config.num_hidden_layers // pp_size
    layer_ids = tuple(range(pp_rank * per_stage, (pp_rank + 1) * per_stage))
    # ModuleDict keyed by the global index: parameter names stay 'model.layers.{global}.…'.
    base.layers = nn.ModuleDict({str(i): base.layers[i] for i in layer_ids})
    if pp_rank > 0 and not (tied and pp_rank == pp_size - 1):
        base.embed_tokens = nn.Identity()
    if pp_rank < pp_size - 1:
        base.norm = nn.Identity()
        if head_name:
            setattr(model, head_name, nn.Identity())
    return PipelineStage(model, pp_rank, pp_size, layer_ids, output, head_name, tied)


def _output_kind(model: PreTrainedModel) -> tuple[str, str | None]:
    """('logits', 'lm_head'), ('values', name of the score head) or ('hidden', None) for a bare backbone."""
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        return "logits", "lm_head"
    if model.base_model is model:
        return "hidden", None
    head = score_head(model)
    name = next(n for n, module in model.named_children() if module is head)
    return "values", name
