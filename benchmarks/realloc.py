"""Parameter reallocation throughput vs the loopback gloo broadcast bandwidth, measured in one run.

    .venv/bin/python benchmarks/realloc.py [--model llama-10m] [--world 4] [--exclude 'o_proj|down_proj']
    .venv/bin/python benchmarks/realloc.py --model llama2-7b --layers 2 --world 2

Spawns ``--world`` gloo processes on 127.0.0.1 (one torch thread each). First rank 0 broadcasts a buffer to
all ranks; its delivered rate, size × (world − 1) / time, is the bandwidth the reallocations are measured
against. Then, for several pairs of layouts on the mesh 0..world−1, the model's parameter shapes (float32,
random contents) are moved by :func:`loomrl.parallel.realloc_exec.execute_reallocation`: one warm-up run with
checksum verification whose result every rank also compares with the direct slice of the full parameters,
then timed repeats, every rank starting at one agreed instant of the machine's monotonic clock and a repeat
lasting until the slowest rank has finished (the reference broadcast is timed the same way). The model is a
zoo model, or a LLaMA-2 preset of the planner (``llama2-7b``: the true shapes of a 7B model's layers, the
layer count cut by ``--layers`` to fit this machine).

Each pair is timed twice. "ms": the reallocation writes straight into the destination copy's parameters
(``out=``), their memory resident, as it is under a GPU's caching allocator; shards that are a contiguous span
of the device's source shard are views of it (the plan aliases them), as in the runtime. "refill ms": what the runtime
does
on CPU devices, where the copy's parameters were freed after their last use (``release_storage``) and the
reallocation takes their memory back first, so the operating system's page faults (zero-filling every page)
are paid too. Delivered rate = ``plan.bytes_moved(4)`` / time. "wire ms" times the same messages sent and
received alone (no packing, unpacking, staging, local copies or new shards). The planner's own time is measured in
the parent process, alone. The way back (tp → dp) is timed as a copy, though returning to the training layout in
practice only frees buffers.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time
import zlib
from functools import partial
from typing import Any, NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rich.console import Console  # noqa: E402

from loomrl.errors import ConfigError  # noqa: E402
from loomrl.models.presets import MODEL_PRESETS  # noqa: E402
from loomrl.models.tokenizer import build_char_tokenizer  # noqa: E402
from loomrl.models.zoo import ZOO, parameter_shapes  # noqa: E402
from loomrl.parallel import realloc_exec  # noqa: E402
from loomrl.parallel.realloc_exec import build_broadcast_groups, execute_reallocation  # noqa: E402
from loomrl.parallel.spawn import run_world  # noqa: E402
from loomrl.plan.allocation import Allocation  # noqa: E402
from loomrl.plan.layout import Layout  # noqa: E402
from loomrl.plan.model_shape import ModelShape  # noqa: E402
from loomrl.plan.realloc_plan import ReallocPlan, plan_reallocation  # noqa: E402
from loomrl.plan.shards import pp_stages, tp_dim  # noqa: E402
from loomrl.report import summary_table  # noqa: E402

TIMEOUT_S = 600


class Pair(NamedTuple):
    """One benchmarked reallocation: a label and its source and destination placements."""

    label: str
    src: Allocation
    dst: Allocation


class Setup(NamedTuple):
    """What every spawned rank needs; picklable."""

    shapes: dict[str, tuple[int, ...]]
    num_layers: int
    pairs: list[Pair]
    world: int
    broadcast_bytes: int
    repeats: int


def _name(layout: Layout, fsdp: bool = False) -> str:
    parts = [f"{dim}{getattr(layout, dim)}" for dim in ("pp", "dp", "tp") if getattr(layout, dim) > 1]
    return ("fsdp " if fsdp else "") + ("".join(parts) or "single")


def layout_pairs(world: int, num_layers: int) -> list[Pair]:
    """Training layouts to generation layouts (and one way back), on the mesh 0..world−1."""
    mesh = tuple(range(world))
    half = world // 2
    candidates = [
        (Layout(dp=world), False, Layout(tp=world), ""),
        (Layout(dp=half, tp=2), False, Layout(tp=world), ""),
        (Layout(tp=world), False, Layout(dp=world), " (copy back)"),
        (Layout(dp=world), True, Layout(dp=half, tp=2), ""),
        (Layout(pp=2, dp=half), False, Layout(tp=world), ""),
        (Layout(dp=half, tp=2), True, Layout(dp=half, tp=2), " (whole copy)"),
    ]
    pairs = []
    for src, fsdp, dst, note in candidates:
        if (
            src.size != world
            or dst.size != world
            or num_layers % src.pp
            or (src == dst and not fsdp)
            or (fsdp and src.dp == 1)
        ):
            continue  # an odd world, a layer count the pipeline stages do not divide, nothing to move
        pairs.append(
            Pair(f"{_name(src, fsdp)} → {_name(dst)}{note}", Allocation(mesh, src, fsdp=fsdp), Allocation(mesh, dst))
        )
    return pairs


def _one_node(device: int) -> int:
    return 0  # every process is on this machine


def make_plan(setup: Setup, pair: Pair) -> ReallocPlan:
    return plan_reallocation(setup.shapes, setup.num_layers, pair.src, pair.dst, _one_node)


def direct_slice(
    full: torch.Tensor, name: str, placement: Allocation, rank: int, num_layers: int
) -> torch.Tensor | None:
    """What ``rank`` of ``placement`` holds of ``full``, by tensor slicing (None: on another pipeline stage)."""
    layout = placement.layout
    pp_rank, dp_rank, tp_rank = layout.coords(rank)
    if pp_rank not in pp_stages(name, num_layers, layout.pp):
        return None
    part, dim = full, tp_dim(name)
    if dim is not None and layout.tp > 1:
        step = -(-full.shape[dim] // layout.tp)  # torch.chunk's block size
        start = min(tp_rank * step, full.shape[dim])
        part = full.narrow(dim, start, min(step, full.shape[dim] - start))
    if placement.fsdp and layout.dp > 1:  # FSDP2: a torch.chunk block of dim 0
        step = -(-part.shape[0] // layout.dp)
        start = min(dp_rank * step, part.shape[0])
        part = part.narrow(0, start, min(step, part.shape[0] - start))
    return part.contiguous()


def full_parameter(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A parameter's full values, the same on every rank (seeded by its name): made when needed, so no rank
    holds the whole model at once."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def _shards(setup: Setup, placements: tuple[Allocation, ...], rank: int) -> list[dict[str, torch.Tensor]]:
    """What ``rank`` holds of every parameter in each placement, by slicing the parameter's full values."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in placements]
    for name, shape in setup.shapes.items():
        full = full_parameter(name, shape)
        for held, placement in zip(out, placements):
            part = direct_slice(full, name, placement, rank, setup.num_layers)
            if part is not None:
                held[name] = part
    return out


START_DELAY_S = 0.01
"""How far ahead rank 0 sets the common start of a timed repeat."""


def _common_start() -> float:
    """An instant of ``time.perf_counter`` shortly ahead, the same on every rank.

    Rank 0 picks it and broadcasts it; perf_counter is CLOCK_MONOTONIC, one clock for every process of this
    machine. Starting every rank at one instant, rather than when each leaves a barrier (gloo releases them
    up to several ms apart on a loaded machine), keeps the skew of the barrier out of the times.
    """
    start = torch.tensor([time.perf_counter() + START_DELAY_S], dtype=torch.float64)
    dist.broadcast(start, src=0)
    return float(start)


def _best_time(fn, repeats: int, before=lambda: None) -> float:
    """Best over ``repeats`` of the time from a common start until the slowest rank has finished ``fn``
    (``before`` runs ahead of each repeat, untimed)."""
    best = float("inf")
    for _ in range(repeats):
        before()
        dist.barrier()
        start = _common_start()
        time.sleep(max(0.0, start - time.perf_counter()))
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's end
        best = min(best, float(elapsed))
    return best


def broadcast_rate(nbytes: int, world: int, repeats: int) -> float:
    """Delivered bytes/s of rank 0 broadcasting ``nbytes`` to every other rank of the default group."""
    buffer = torch.ones(nbytes, dtype=torch.uint8) if dist.get_rank() == 0 else torch.empty(nbytes, dtype=torch.uint8)
    dist.broadcast(buffer, src=0)  # warm-up: connections and pages
    seconds = _best_time(lambda: dist.broadcast(buffer, src=0), repeats)
    return nbytes * (world - 1) / seconds


def _verified_warm_up(plan: ReallocPlan, pair: Pair, source: dict, expected: dict, groups, rank: int) -> None:
    """One run with checksums, its result compared with the direct slices; raises on every rank if any differ."""
    out = execute_reallocation(plan, source, rank, groups=groups, verify=True)
    wrong = sorted(set(out) ^ set(expected))
    wrong += [name for name in expected if name in out and not torch.equal(out[name], expected[name])]
    ok = torch.tensor([0 if wrong else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not int(ok):
        raise RuntimeError(
            f"{pair.label}: destination shards differ from the direct slice "
            f"(rank {rank}: {wrong[:3] or 'another rank'})"
        )


def measure_pair(setup: Setup, pair: Pair, rank: int) -> dict[str, Any]:
    plan = make_plan(setup, pair)
    groups = build_broadcast_groups(plan)  # collective, once per plan, outside the timing
    source, expected = _shards(setup, (pair.src, pair.dst), rank)
    _verified_warm_up(plan, pair, source, expected, groups, rank)
    # the copy's parameters, written in place, as the runtime's workers do: their own memory, except the shards
    # the plan aliases (spans of the source shard), which the executor returns as views of the source
    targets = {name: t.clone() for name, t in expected.items() if not plan.aliased(rank, name)}
    del expected

    def move() -> None:
        execute_reallocation(plan, source, rank, groups=groups, out=targets)

    def free() -> None:
        for t in targets.values():
            t.untyped_storage().resize_(0)

    def refill() -> None:  # as the runtime does on CPU: take the freed memory back, then move
        for t in targets.values():
            t.untyped_storage().resize_(t.numel() * t.element_size())
        move()

    resident = _best_time(move, setup.repeats)
    return {
        "seconds": resident,
        "refill_seconds": _best_time(refill, setup.repeats, before=free),
        "wire_seconds": wire_time(plan, rank, groups, setup.repeats),
        "bytes_moved": plan.bytes_moved(4),
        "bytes_local": plan.bytes_local(4),
        "pieces": sum(not t.local for t in plan.transfers),
    }


def _blank(_flat: Any, entry: Any) -> torch.Tensor:
    """A stand-in for a direct entry's elements (only its size matters on the wire)."""
    return torch.empty(entry.numel)


def wire_time(plan: ReallocPlan, rank: int, groups, repeats: int) -> float:
    """Best time of the plan's messages alone going over the wire: the executor's own transfers (route buffers
    and direct entries), without packing, unpacking, local copies or new destination shards (a floor for the
    executor on this machine)."""
    schedule = realloc_exec.compile_program(plan, rank)
    buffers = schedule.buffers(lambda name: torch.float32, False, torch.device("cpu"))
    # every message as a buffer of its size: packed route buffers and direct entries alike
    sends = {
        route: [(tag, torch.empty_like(t)) for tag, t in realloc_exec._messages(rb, {}, _blank)]
        for route, rb in buffers.items()
        if route[0] == rank
    }
    recvs = {
        route: [(tag, torch.empty_like(t)) for tag, t in realloc_exec._messages(rb, {}, _blank)]
        for route, rb in buffers.items()
        if route[0] != rank
    }

    def transfer() -> None:
        started = realloc_exec._start_point_to_point(sends, recvs, None)
        for _, work in started + realloc_exec._start_broadcasts(sends, recvs, None, groups):
            if work is not None:
                work.wait()

    return _best_time(transfer, repeats)


def _body(rank: int, setup: Setup) -> dict[str, Any]:
    rate = broadcast_rate(setup.broadcast_bytes, setup.world, setup.repeats)
    return {"broadcast": rate, "pairs": [measure_pair(setup, pair, rank) for pair in setup.pairs]}


def run_ranks(setup: Setup) -> dict[str, Any]:
    """Spawn the ranks, return rank 0's measurements (identical on all ranks); raise if any rank failed."""
    try:
        return run_world(partial(_body, setup=setup), setup.world, timeout_s=TIMEOUT_S, group_timeout_s=120)[0]
    except RuntimeError as err:
        raise SystemExit(str(err)) from None


def planner_ms(setup: Setup, pair: Pair, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        make_plan(setup, pair)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def model_shapes(model: str, layers: int | None) -> tuple[dict[str, tuple[int, ...]], int]:
    """Parameter shapes and layer count of a zoo model or a planner preset, cut to ``layers`` if given."""
    if model in MODEL_PRESETS:
        shape = ModelShape.from_config(MODEL_PRESETS[model])
        count = shape.layers if layers is None else layers
        return shape.param_shapes(count), count
    if model not in ZOO:
        raise ConfigError(
            f"--model: '{model}' is not a zoo model or preset; zoo: {', '.join(ZOO)}; "
            f"presets: {', '.join(MODEL_PRESETS)}"
        )
    shapes, count, _ = parameter_shapes(model, build_char_tokenizer(), value=False)  # zoo models are untied
    if layers is None or layers >= count:
        return shapes, count
    kept = {
        name: s
        for name, s in shapes.items()
        if not (m := re.search(r"\.layers\.(\d+)\.", name)) or int(m.group(1)) < layers
    }
    return kept, layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="llama-10m",
        help=f"zoo model or LLaMA-2 preset whose parameter shapes are moved (presets: {', '.join(MODEL_PRESETS)})",
    )
    ap.add_argument("--layers", type=int, default=None, help="cut a model to this many layers (default: all)")
    ap.add_argument("--world", type=int, default=4, help="gloo processes (devices) on 127.0.0.1")
    ap.add_argument("--broadcast-mib", type=int, default=64, help="size of the reference broadcast")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (the best is kept)")
    ap.add_argument(
        "--exclude",
        default="",
        help="regex of parameter names to leave out, e.g. 'o_proj|down_proj' "
        "(the row-split weights, cut into one piece per row)",
    )
    args = ap.parse_args()
    if args.world < 2:
        ap.error(f"--world: {args.world} is too small; at least 2 processes are needed")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers: {args.layers} is too small; at least 1 layer is needed")
    try:
        shapes, num_layers = model_shapes(args.model, args.layers)
    except ConfigError as err:
        raise SystemExit(str(err)) from None
    shapes = {name: shape for name, shape in shapes.items() if not (args.exclude and re.search(args.exclude, name))}
    pairs = layout_pairs(args.world, num_layers)
    setup = Setup(shapes, num_layers, pairs, args.world, args.broadcast_mib * 2**20, args.repeats)
    plan_ms = [planner_ms(setup, pair) for pair in pairs]  # before the ranks start: alone on the machine
    measured = run_ranks(setup)
    bandwidth = measured["broadcast"]
    rows = []
    for pair, result, ms in zip(pairs, measured["pairs"], plan_ms):
        moved = result["bytes_moved"]
        rate = moved / result["seconds"] if moved else None
        refill_rate = moved / result["refill_seconds"] if moved else None
        rows.append(
            {
                "layout pair": pair.label,
                "MB moved": moved / 1e6,
                "ms": result["seconds"] * 1e3,
                "GB/s": rate / 1e9 if rate else None,
                "% of broadcast bw": f"{rate / bandwidth:.0%}" if rate else "",
                "refill ms": result["refill_seconds"] * 1e3,
                "% with refill": f"{refill_rate / bandwidth:.0%}" if refill_rate else "",
                "wire ms": result["wire_seconds"] * 1e3 if moved else None,
                "plan ms": ms,
            }
        )
    console = Console(width=130)  # the table is wider than rich's default 80 columns for a pipe
    n_params = sum(math.prod(shape) for shape in shapes.values())
    left_out = f", leaving out /{args.exclude}/" if args.exclude else ""
    console.print(
        f"model {args.model}: {n_params / 1e6:.1f}M params, {num_layers} layers, "
        f"{4 * n_params / 1e6:.1f} MB in float32{left_out}"
    )
    console.print(
        f"{args.world} gloo processes on 127.0.0.1, 1 torch thread each, {os.cpu_count()} cores; "
        f"best of {args.repeats} after a verified warm-up"
    )
    console.print(f"gloo broadcast of {args.broadcast_mib} MiB from rank 0: {bandwidth / 1e9:.2f} GB/s delivered")
    console.print(summary_table(rows, "parameter reallocation"))
    for pair, result in zip(pairs, measured["pairs"]):
        console.print(
            f"{pair.label}: {result['pieces']} network pieces, {result['bytes_local'] / 1e6:.1f} MB copied locally"
        )
    console.print(
        f"tp{args.world} → dp{args.world} is timed as a copy; going back to training only frees "
        "the new shards (plan.free_after)"
    )


if __name__ == "__main__":
    main()
