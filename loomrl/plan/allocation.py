"""One call's place: :class:`DeviceSet`, the devices of a mesh, and :class:`Allocation`, a mesh and a layout.

- :class:`DeviceSet`: a sorted tuple of global device indices of the cluster (a *mesh* once a layout
  arranges them; not torch's ``DeviceMesh``, which the runtime builds from it);
- :class:`Allocation`: the one type for "a mesh and a layout": devices, a :class:`~loomrl.plan.layout.Layout`
  (``dp × tp × pp``) and the options of the call running there (micro-batches, recompute, ZeRO, FSDP). Rank
  ``r = pp_rank·(dp·tp) + dp_rank·tp + tp_rank`` (tp fastest, then dp, pp slowest) runs on device ``mesh[r]``,
  and coordinates are always ``(pp, dp, tp)`` (:class:`~loomrl.plan.layout.Coords`). :attr:`Allocation.shards`
  reduces an allocation to what decides which part of a model each device holds, the identity the runtime
  keys models and communicators by.

The compact text of an allocation, ``0-3,6:dp2tp2pp1mb4``, is shared with plan files and the plan strings of
:mod:`loomrl.plan.plan_string`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass

from loomrl.config.tools import ValidatedConfig, fail, spec
from loomrl.errors import ConfigError
from loomrl.plan.layout import Coords, Layout

__all__ = ["MAX_MESH", "Allocation", "DeviceSet", "format_devices"]

_RANGE_RE = re.compile(r"(\d+)(?:-(\d+))?")
MAX_MESH = 1 << 20
"""Most devices one mesh may list (a bound far above any cluster, so a typo such as 0-99999999 fails at once)."""
_LAYOUT_RE = re.compile(r"(dp|tp|pp|mb)(\d+)|(rc|zero|fsdp|rev)")
_LAYOUT_TOKENS = (
    "expected tokens dp<N>, tp<N>, pp<N>, mb<N> (micro-batches), rc (recompute activations), zero "
    "(optimizer state sharded over dp), fsdp (weights, gradients and optimizer state sharded over "
    "dp) and rev (pipeline stages from the mesh's last device), e.g. dp4tp2, dp2mb4, pp2mb4rc, "
    "dp8zero, dp8fsdp or pp4rev"
)


def format_devices(devices: tuple[int, ...] | list[int]) -> str:
    """Sorted device indices as ranges and singles: ``(0, 1, 2, 3, 6)`` → ``"0-3,6"``."""
    parts: list[str] = []
    ordered = sorted(devices)
    start = prev = ordered[0] if ordered else 0
    for d in ordered[1:] + [None]:  # a sentinel closes the last run
        if d is not None and d == prev + 1:
            prev = d
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if d is not None:
            start = prev = d
    return ",".join(parts) if ordered else ""


@dataclass(frozen=True)
class DeviceSet(ValidatedConfig):
    """A non-empty set of global device indices, stored sorted; ``mesh[rank]`` is the device of a rank."""

    devices: tuple[int, ...]
    """Global device indices (node-major numbering of the cluster); stored sorted."""

    def validate(self) -> None:
        if not self.devices:
            fail("devices", "() is empty; a mesh needs at least one device")
        for d in self.devices:
            if d < 0:
                fail("devices", f"{d} is negative; devices are numbered from 0")
        if len(set(self.devices)) != len(self.devices):
            dupes = sorted({d for d in self.devices if self.devices.count(d) > 1})
            fail("devices", f"{format_devices(list(self.devices))} lists device {dupes[0]} twice")
        object.__setattr__(self, "devices", tuple(sorted(self.devices)))

    @classmethod
    def parse(cls, text: str) -> DeviceSet:
        """``"0-3"``, ``"0,2,5"``, ``"0-3,6"`` → a mesh; errors are at path ``devices``."""
        devices: list[int] = []
        for part in str(text).split(","):
            match = _RANGE_RE.fullmatch(part.strip())
            if match is None:
                fail("devices", f"{text!r} is not a device list; expected ranges like 0-3 or lists like 0,2,5")
            first, last = int(match[1]), int(match[2] if match[2] is not None else match[1])
            if last < first:
                fail("devices", f"range {part.strip()!r} ends before it starts")
            if last - first + 1 + len(devices) > MAX_MESH:
                fail("devices", f"{text!r} lists more than {MAX_MESH} devices; a mesh lists devices of the cluster")
            devices.extend(range(first, last + 1))
        return cls(tuple(devices))

    @functools.cached_property
    def text(self) -> str:
        """The compact form, e.g. ``"0-3,6"`` (made once: a plan search asks for it millions of times)."""
        return format_devices(self.devices)

    def isdisjoint(self, other: DeviceSet) -> bool:
        """True when the two meshes share no device."""
        return set(self.devices).isdisjoint(other.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.devices)

    def __getitem__(self, index: int) -> int:
        return self.devices[index]

    def __contains__(self, device: object) -> bool:
        return device in self.devices


def _layout_text(
    layout: Layout, micro_batches: int, recompute: bool = False, zero: bool = False, fsdp: bool = False
) -> str:
    text = f"dp{layout.dp}"
    text += f"tp{layout.tp}" if layout.tp > 1 else ""
    text += f"pp{layout.pp}" if layout.pp > 1 else ""
    text += "rev" if layout.reverse else ""
    return (
        text
        + (f"mb{micro_batches}" if micro_batches > 1 else "")
        + ("rc" if recompute else "")
        + ("zero" if zero else "")
        + ("fsdp" if fsdp else "")
    )


def _parse_layout(text: str, devices: int) -> tuple[Layout, int, bool, bool, bool]:
    """``"dp2tp2mb4"`` → (Layout(2, 2, 1), 4, False, False, False); ``rc`` sets recompute, ``zero`` optimizer-state
    sharding and ``fsdp`` full sharding; an omitted dp fills the mesh: ``devices / (tp·pp)``."""
    tokens = _LAYOUT_RE.findall(text)
    if "".join(k + v + flag for k, v, flag in tokens) != text:
        fail("layout", f"{text!r} is not a layout; {_LAYOUT_TOKENS}")
    values: dict[str, int] = {}
    flags: set[str] = set()
    for key, value, flag in tokens:
        if flag:
            if flag in flags:
                fail("layout", f"{text!r} gives {flag} twice")
            flags.add(flag)
            continue
        if key in values:
            fail("layout", f"{text!r} gives {key} twice")
        values[key] = int(value)
    tp, pp = values.get("tp", 1), values.get("pp", 1)
    if "dp" not in values and tp * pp and devices % (tp * pp) == 0:
        values["dp"] = devices // (tp * pp)
    for key in ("dp", "tp", "pp", "mb"):
        if values.get(key, 1) < 1:
            fail("layout", f"{key}{values[key]} in {text!r} is not a positive degree")
    if "rev" in flags and pp == 1:
        fail("layout", f"{text!r} reverses a pipeline of one stage; rev needs pp > 1 (e.g. pp4rev)")
    layout = Layout(values.get("dp", 1), tp, pp, "rev" in flags)
    return layout, values.get("mb", 1), "rc" in flags, "zero" in flags, "fsdp" in flags


@dataclass(frozen=True)
class Allocation(ValidatedConfig):
    """Where and how one MFC runs: its devices and its model's parallel layout on them."""

    mesh: DeviceSet
    """The devices; a list or tuple of indices is accepted and converted."""
    layout: Layout
    """Data × tensor × pipeline degrees; their product must equal the number of devices."""
    micro_batches: int = spec(1, ge=1)
    """Micro-batches each rank's share of a batch is split into (pipelining, activation memory)."""
    recompute: bool = False
    """Train calls only: keep each decoder layer's input and recompute the rest in the backward (activation
    checkpointing): one more forward pass of compute for a fraction of the activation memory."""
    zero: bool = False
    """Train calls only (ZeRO stage 1): each data-parallel rank keeps the optimizer state of 1/dp of every
    parameter and updates that part, then the parts are all-gathered; the optimizer state (Adam's moments, and
    the fp32 master copy of 16-bit weights) takes 1/dp of the memory for one more all-gather of the weights per
    step (:mod:`loomrl.parallel.zero`). Nothing to shard at dp=1."""
    fsdp: bool = False
    """Train calls only (FSDP, ZeRO stage 3; :mod:`loomrl.parallel.fsdp`): each data-parallel rank keeps 1/dp of
    the weights (in fp32), of their gradients and of the optimizer state; each decoder layer's weights are
    all-gathered for its forward and again for its backward, and gradients are reduce-scattered. The role's
    other calls then run on a reallocated whole copy, even on the same devices and layout. With tp > 1 each
    rank's tensor-parallel shard is what is divided over dp (FSDP over the dp dimension of a dp × tp mesh, as
    torchtitan does); not with pipeline stages (pp = 1), nor with ``zero``, which it includes."""

    def __post_init__(self) -> None:
        if isinstance(self.mesh, (list, tuple)):
            object.__setattr__(self, "mesh", DeviceSet(tuple(self.mesh)))
        super().__post_init__()

    def validate(self) -> None:
        lay = self.layout
        if lay.size != len(self.mesh):
            fail(
                "layout",
                f"dp={lay.dp} × tp={lay.tp} × pp={lay.pp} = {lay.size} device{'s' * (lay.size != 1)}, "
                f"but the mesh {self.mesh.text} has {len(self.mesh)}",
            )
        if self.fsdp and lay.pp > 1:
            fail(
                "fsdp",
                f"does not combine with pipeline stages; with pp={lay.pp} use zero instead "
                "(valid with fsdp: pp=1, any dp and tp)",
            )
        if self.fsdp and self.zero:
            fail("zero", "fsdp shards the optimizer state already; give one of zero and fsdp")

    @classmethod
    def parse(cls, text: str) -> Allocation:
        """``"0-3:dp2tp2"``, ``"4-7"`` (dp fills the mesh), ``"0,2:dp2mb4"`` → an allocation."""
        devices, _, layout_text = str(text).partition(":")
        mesh = DeviceSet.parse(devices)
        layout, micro_batches, recompute, zero, fsdp = (
            _parse_layout(layout_text.strip(), len(mesh))
            if layout_text.strip()
            else (Layout(dp=len(mesh)), 1, False, False, False)
        )
        return cls(mesh, layout, micro_batches, recompute, zero, fsdp)

    @functools.cached_property
    def text(self) -> str:
        """The compact form :meth:`parse` reads, e.g. ``"0-7:dp4tp2mb2"`` (made once)."""
        return f"{self.mesh.text}:{_layout_text(self.layout, self.micro_batches, self.recompute, self.zero, self.fsdp)}"

    @property
    def optimizer_shards(self) -> int:
        """Data-parallel ranks the optimizer state is divided over when this allocation trains: dp under ZeRO-1
        (``zero``) or FSDP, else 1."""
        return self.layout.dp if self.zero or self.fsdp else 1

    @property
    def param_shards(self) -> int:
        """Data-parallel ranks the weights and gradients are divided over: dp under FSDP, else 1."""
        return self.layout.dp if self.fsdp else 1

    @functools.cached_property
    def shards(self) -> Allocation:
        """This allocation reduced to what decides which part of a model each device holds: devices, layout
        and FSDP, with the call's options (micro-batches, recompute, ZeRO) at their defaults. Two allocations
        with equal shards hold a model alike, so nothing moves between them; an FSDP allocation holds no whole
        weights, so it shares its shards with no other kind."""
        if self.micro_batches == 1 and not (self.recompute or self.zero):
            return self
        return Allocation(self.mesh, self.layout, fsdp=self.fsdp)

    @property
    def devices(self) -> tuple[int, ...]:
        """The mesh's device indices, sorted (``mesh[rank]`` is rank's device)."""
        return self.mesh.devices

    def device(self, coords: Coords) -> int:
        """The device of the rank at ``coords`` (``(pp, dp, tp)``)."""
        try:
            return self.mesh[self.layout.rank(coords)]
        except ConfigError as err:
            raise ConfigError(f"{err} ({self.text})") from None

    def coords(self, device: int) -> Coords:
        """``(pp, dp, tp)`` of the rank on ``device``."""
        if device not in self.mesh:
            raise ConfigError(f"device {device} is not in the mesh {self.mesh.text}")
        return self.layout.coords(self.mesh.devices.index(device))

    def replicas(self) -> list[tuple[int, ...]]:
        """The devices of each data-parallel replica, by dp rank (a replica can run rows on its own)."""
        out: dict[int, list[int]] = {}
        for device in self.devices:
            out.setdefault(self.coords(device).dp, []).append(device)
        return [tuple(out[r]) for r in sorted(out)]

    def publishes(self, device: int) -> bool:
        """Whether ``device`` reports a call's results: one per data-parallel replica, tensor rank 0 of the last
        pipeline stage (the others hold the same results, or none)."""
        coords = self.coords(device)
        return coords.tp == 0 and coords.pp == self.layout.pp - 1

    def dp_split(self, state: bool = False) -> str:
        """How the data-parallel ranks divide what each (pp, tp) shard holds: ``"rows"`` (FSDP: dim-0 blocks),
        ``"flat"`` (ZeRO-1's optimizer state: blocks of the flattened shard; ``state`` only) or ``"none"``
        (every replica holds it whole). ``state``: of the optimizer state (Adam's moments, master weights)
        rather than of the weights."""
        if self.fsdp and self.layout.dp > 1:
            return "rows"
        if state and self.zero and self.layout.dp > 1:
            return "flat"
        return "none"
