"""How one role's model is spread over the devices of its mesh: data × tensor × pipeline parallel degrees.

A :class:`Layout` is a plain value; :func:`check_layout` decides whether it fits a model config and a number of
devices, and says why not in one line. Ranks of a layout are ordered tp-fastest, pp-slowest
(``rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank``) so that the ranks of one tensor-parallel group are
neighbours, which on a GPU node puts them on the fastest links. A *reversed* layout numbers its pipeline stages
from the other end of the mesh (``pp_rank`` replaced by ``pp - 1 - pp_rank`` above): stage 0 on the last ranks.
Two models whose pipelines run in opposite directions over the same devices pair one's first stages with the
other's last ones, as intra-stage fusion wants (:mod:`loomrl.planner.pipeline_fusion`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from loomrl.errors import ConfigError

TP_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2")
"""``model_type`` values :func:`loomrl.parallel.apply_tensor_parallel` can shard (separate q/k/v and
gate/up/down linears). GPT-2, for one, fuses q/k/v into a single Conv1D whose columns would split across heads."""

# Config fields whose value must be a multiple of tp, in the order they are reported.
_TP_DIVIDES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


class Coords(NamedTuple):
    """A rank's place in a layout, slowest-varying first: the order of its rank number and of its mesh dims."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of one role; ``dp * tp * pp`` devices in all."""

    dp: int = 1
    """Data-parallel replicas (each sees a different share of the batch)."""
    tp: int = 1
    """Tensor-parallel shards of every attention and MLP block (heads and MLP columns split)."""
    pp: int = 1
    """Pipeline stages: contiguous, equal ranges of decoder layers (Llama, Qwen2); combines with tp, each stage
    then being tensor-parallel over its own ``tp`` ranks."""
    reverse: bool = False
    """Stage 0 on the mesh's last ranks, stage ``pp - 1`` on its first (module docstring); no effect at pp=1."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"layout.{name}: {value!r} is not a positive integer")
        if not isinstance(self.reverse, bool):
            raise ConfigError(f"layout.reverse: {self.reverse!r} is not true or false")
        if self.pp == 1 and self.reverse:
            object.__setattr__(self, "reverse", False)  # one stage has no direction: equal to the plain layout

    @property
    def size(self) -> int:
        """Devices the layout occupies."""
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> Coords:
        """The pipeline, data and tensor rank of ``rank``."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a layout of {self.size} ranks")
        pp_rank, rest = divmod(rank, self.dp * self.tp)
        return Coords(self.pp - 1 - pp_rank if self.reverse else pp_rank, *divmod(rest, self.tp))

    def rank(self, coords: Coords) -> int:
        """The rank at ``coords`` (:meth:`coords` inverted)."""
        for name, value, size in zip(Coords._fields, coords, (self.pp, self.dp, self.tp)):
            if not 0 <= value < size:
                raise ConfigError(
                    f"{name}_rank: {value} is outside 0..{size - 1} of layout dp{self.dp}tp{self.tp}pp{self.pp}"
                )
        pp_rank = self.pp - 1 - coords[0] if self.reverse else coords[0]
        return (pp_rank * self.dp + coords[1]) * self.tp + coords[2]


def check_layout(layout: Layout, config: object, devices: int, where: str = "layout") -> None:
    """Raise :class:`ConfigError` unless ``layout`` can run the model of HF ``config`` on ``devices`` devices.

    ``where`` is the config path of the layout, so the message can name e.g. ``plan.actor.tp``. pp and tp
    combine freely: a pp×tp layout must pass both the pipeline checks (pp divides the layers) and the tensor
    checks (tp divides the head counts and the MLP width).
    """
    if layout.size != devices:
        raise ConfigError(
            f"{where}: dp={layout.dp} × tp={layout.tp} × pp={layout.pp} = {layout.size} "
            f"devices, but the mesh has {devices}"
        )
    if layout.pp > 1:
        _check_pipeline(layout, config, where)
    if layout.tp == 1:
        return
    model_type = getattr(config, "model_type", None)
    if model_type not in TP_ARCHITECTURES:
        raise ConfigError(
            f"{where}.tp: {layout.tp} needs one of the architectures {', '.join(TP_ARCHITECTURES)}; "
            f"model_type '{model_type}' supports only tp=1"
        )
    for field in _TP_DIVIDES:
        value = getattr(config, field, None)
        if value is None:
            raise ConfigError(f"{where}.tp: {layout.tp} cannot be checked: the model config has no {field}")
        if value % layout.tp:
            raise ConfigError(f"{where}.tp: {layout.tp} does not divide {field}={value}")


def _check_pipeline(layout: Layout, config: object, where: str) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in TP_ARCHITECTURES:
        raise ConfigError(
            f"{where}.pp: {layout.pp} needs one of the architectures {', '.join(TP_ARCHITECTURES)}; "
            f"model_type '{model_type}' supports only pp=1"
        )
    layers = getattr(config, "num_hidden_layers", None)
    if not layers or layers % layout.pp:
        raise ConfigError(f"{where}.pp: {layout.pp} does not divide num_hidden_layers={layers}")
