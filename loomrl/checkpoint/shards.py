"""Sharded checkpoints: each process writes the part of a trained role's state it owns; nothing is gathered.

A role's state is its weights and its optimizer state (Adam's two moments, and the fp32 master weights of 16-bit
weights), each a set of tensors named and shaped like the weights
(:func:`loomrl.parallel.role_state.state_tensors`, the sets a plan change moves). A process holds a piece of
each set as its training allocation divides it: its pipeline stage's parameters, its tensor-parallel slice, and
the data-parallel split (:meth:`loomrl.plan.plan.Allocation.dp_split`: FSDP's dim-0 blocks, ZeRO-1's flat blocks
of the optimizer state, or whole replicas). :func:`loomrl.plan.shards.shard_intervals` already says which flat
intervals of the full tensor that piece is, for any (layout, rank, split). So a shard file records the layout,
the rank and the splits it was written under and the full shape of every tensor, and a reader recomputes the
intervals and places each piece, whatever layout it resumes on.

The files of role ``R`` inside a checkpoint directory:

- ``R/weights-rNNNNN.safetensors`` and ``R/optim-rNNNNN.safetensors``: rank N's pieces (rank within the role's
  training mesh), keyed ``kind/name`` (``weights/model.norm.weight``, ``exp_avg/...``, ``exp_avg_sq/...``,
  ``master/...``). A piece other ranks hold too is written once: a parameter tensor parallelism replicates by
  tensor-parallel rank 0, a piece every data-parallel replica holds whole by one replica, chosen per parameter
  (by a checksum of its name) so that the replicas share the writing;
- ``R/config.json``: the model's Hugging Face config.

``index.json`` (written once every shard is, by :mod:`loomrl.checkpoint.store`) holds per role the model class, the
optimizer's hyper-parameters and each file's description. :func:`export_role` assembles a role into the
``save_pretrained`` form (``loomrl export``). A writer holds nothing but its own pieces (on CPU devices they
are its state itself, written without a copy); a resuming process reads only the ranges of the files that hold
its own part in the layout it resumes on (:func:`load_role_shards`). :func:`read_role` (the export, inspection)
assembles whole tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zlib
from collections.abc import Callable, Collection, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from loomrl.checkpoint.adapters import export_adapters
from loomrl.errors import CheckpointError
from loomrl.models.heads import tied_embeddings
from loomrl.models.lora import adapter_description, moving_parameters
from loomrl.parallel.role_state import MOMENTS, init_state, state_steps, state_tensors
from loomrl.parallel.zero import MASTER
from loomrl.plan.layout import Layout
from loomrl.plan.shards import shard_intervals, shard_numel, tp_dim

INDEX_FILE = "index.json"
FORMAT = "loomrl-sharded/1"
TOKENIZER_DIR = "tokenizer"
GENERATION_FILE = "generation_config.json"
"""A role's generation config (eos ids, sampling defaults), kept beside its config for the export."""
_HASH_CHUNK = 1 << 20


# --- where a process's pieces sit -------------------------------------------------------------------------


def place_of(alloc: Any, device: int) -> dict[str, Any]:
    """How ``device``'s pieces of a role sit in the role's training allocation: its layout, the device's rank in
    the mesh and how the data-parallel ranks divide the weights and the optimizer state."""
    lay = alloc.layout
    return {
        "layout": {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "reverse": lay.reverse},
        "rank": alloc.devices.index(device),
        "weights_split": alloc.dp_split(),
        "state_split": alloc.dp_split(state=True),
    }


WHOLE = {
    "layout": {"dp": 1, "tp": 1, "pp": 1, "reverse": False},
    "rank": 0,
    "weights_split": "none",
    "state_split": "none",
}
"""A single process holding everything (the reference executor)."""


def _duplicate(name: str, place: Mapping[str, Any], split: str) -> bool:
    """Whether another rank writes this piece: a parameter tensor parallelism replicates (tp rank 0 writes it),
    the input embedding on a later pipeline stage (a tied embedding's copy on the last stage: the first stage
    writes it), or a piece every data-parallel replica holds whole (the replica its name's checksum picks writes
    it)."""
    layout = Layout(**place["layout"])
    pp, dp, tp = layout.coords(place["rank"])
    if (tp > 0 and tp_dim(name) is None) or (pp > 0 and "embed_tokens" in name.split(".")):
        return True
    return split == "none" and dp != zlib.crc32(name.encode()) % layout.dp


def role_pieces(
    model: torch.nn.Module, optimizer: Any, place: Mapping[str, Any], dtype: torch.dtype
) -> dict[str, dict[str, torch.Tensor]]:
    """This process's pieces of a role, ``{"weights": {key: tensor}, "optim": {key: tensor}}``, on the CPU (no
    copy of a CPU tensor already in its form). ``dtype``: the run's weight type, that of the saved weights
    (FSDP's fp32 shards are rounded to it); when it is 16-bit the fp32 master weights are saved too."""
    kinds = ["weights", *MOMENTS] + ([MASTER] if dtype != torch.float32 else [])
    out: dict[str, dict[str, torch.Tensor]] = {"weights": {}, "optim": {}}
    for kind in kinds:
        split = place["weights_split"] if kind == "weights" else place["state_split"]
        for name, tensor in state_tensors(model, optimizer, kind).items():
            if tensor.numel() == 0 or _duplicate(name, place, split):
                continue
            # flat, so that a reader takes just the ranges it needs (safetensors slices the first dim)
            tensor = tensor.detach().to("cpu", dtype if kind == "weights" else None).contiguous().view(-1)
            out["weights" if kind == "weights" else "optim"][f"{kind}/{name}"] = tensor
    return out


def check_finite(value: Any, what: str, where: str = "") -> None:
    """Raise naming the first floating-point tensor in ``value`` (nested dicts and lists) holding NaN or inf."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(
                f"save_checkpoint: {what} '{where}' holds NaN or inf; refusing to save it "
                "(nothing written; earlier checkpoints are kept)"
            )
    elif isinstance(value, Mapping):
        for key, item in value.items():
            check_finite(item, what, f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_finite(item, what, f"{where}[{i}]")


def check_pieces(role: str, pieces: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Refuse non-finite pieces, named as the full-form checks name them (``actor weight 'model.norm.weight'``,
    ``actor optimizer state 'lm_head.weight.exp_avg'``)."""
    for key, tensor in pieces["weights"].items():
        check_finite(tensor, f"{role} weight", key.split("/", 1)[1])
    for key, tensor in pieces["optim"].items():
        kind, name = key.split("/", 1)
        check_finite(tensor, f"{role} optimizer state", f"{name}.{kind}")


# --- writing ----------------------------------------------------------------------------------------------


def write_role_shards(
    directory: Path,
    role: str,
    model: torch.nn.Module,
    optimizer: Any,
    place: Mapping[str, Any],
    pieces: Mapping[str, Mapping[str, torch.Tensor]],
) -> dict[str, Any]:
    """Write this process's ``pieces`` of ``role`` under ``directory/role/`` (flushed to disk) and return what
    the index and the manifest need: ``{"role": {...}, "files": {relative path: {index entry}},
    "manifest": {relative path: {"size", "sha256"}}}``."""
    role_dir = directory / role
    role_dir.mkdir(parents=True, exist_ok=True)
    rank = place["rank"]
    layers = int(model.config.num_hidden_layers)
    shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    written: dict[str, Any] = {}
    manifest: dict[str, Any] = {}
    for part in ("weights", "optim"):
        if not pieces[part]:
            continue
        rel = f"{role}/{part}-r{rank:05d}.safetensors"
        save_file(_unshared(pieces[part]), directory / rel)
        manifest[rel] = file_entry(directory / rel, sync=True)
        written[rel] = {
            **place,
            "num_layers": layers,
            "tied": tied_embeddings(model),
            "tensors": {key: shapes[key.split("/", 1)[1]] for key in pieces[part]},
        }
    if written:  # the params and steps ride with the first file (the weights when any)
        first = next(iter(written.values()))
        first["params"] = [name for name, _ in moving_parameters(model)]  # a LoRA role's: its adapters
        first["trainable"] = [name for name, p in model.named_parameters() if p.requires_grad]
        first["steps"] = state_steps(model, optimizer) if optimizer is not None else {}
    role_meta = {
        "class": _hf_class(model).__name__,
        "param_groups": [_hyper(g) for g in optimizer.param_groups[:1]] if optimizer is not None else [],
    }
    adapters = adapter_description(model)
    if adapters is not None:  # the shards hold the adapters only: what they adapt
        role_meta["adapters"] = adapters
    if rank == 0:
        model.config.to_json_file(role_dir / "config.json")
        manifest[f"{role}/config.json"] = file_entry(role_dir / "config.json", sync=True)
        generation = getattr(model, "generation_config", None)
        if generation is not None:  # its eos ids (several, for chat models) and sampling defaults ride along
            generation.to_json_file(role_dir / GENERATION_FILE)
            manifest[f"{role}/{GENERATION_FILE}"] = file_entry(role_dir / GENERATION_FILE, sync=True)
    return {"role": role_meta, "files": written, "manifest": manifest}


def merge_index(parts: Mapping[str, list[Mapping[str, Any]]]) -> dict[str, Any]:
    """The checkpoint's index from every process's :func:`write_role_shards` results, by role."""
    roles = {}
    for role, results in sorted(parts.items()):
        files = {rel: entry for result in results for rel, entry in sorted(result["files"].items())}
        roles[role] = {**results[0]["role"], "files": dict(sorted(files.items()))}
    return {"format": FORMAT, "roles": roles}


def _unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied or aliased parameters): such a one is copied."""
    seen, out = set(), {}
    for key, tensor in tensors.items():
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        out[key] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return out


def _hf_class(model: torch.nn.Module) -> type:
    """The Hugging Face class of a possibly wrapped model (FSDP2 makes a subclass of its own)."""
    return next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.")), type(model))


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer param group's hyper-parameters as JSON (tuples become lists, tensors numbers)."""

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.item()
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return {key: plain(value) for key, value in group.items() if key != "params"}


def file_entry(file: Path, sync: bool = False) -> dict[str, Any]:
    """A file's size and SHA-256 for the manifest (``sync``: flushed to disk on the way)."""
    digest = hashlib.sha256()
    with open(file, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
        if sync:
            os.fsync(fh.fileno())
    return {"size": file.stat().st_size, "sha256": digest.hexdigest()}


# --- reading ----------------------------------------------------------------------------------------------


def read_index(path: Path) -> dict[str, Any]:
    file = path / INDEX_FILE
    try:
        index = json.loads(file.read_text())
        if index.get("format") != FORMAT:
            raise ValueError(f"format {index.get('format')!r}, expected {FORMAT!r}")
        return index
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{file}: unreadable checkpoint index ({type(exc).__name__}: {exc})") from None


def _role_entry(path: Path, role: str) -> dict[str, Any]:
    roles = read_index(path)["roles"]
    if role not in roles:
        raise CheckpointError(f"{path / INDEX_FILE}: no saved model for role '{role}' (has {sorted(roles)})")
    return roles[role]


def load_role_shards(path: Path, role: str, model: torch.nn.Module, optimizer: Any, place: Mapping[str, Any]) -> None:
    """Copy into ``model`` and ``optimizer``, in place, the part of ``role``'s saved state this process holds
    where ``place`` puts it, whatever layout saved it: only the ranges it needs are read from the shard files,
    so a load holds this process's own shards and no more. The optimizer's state is made first
    (:func:`~loomrl.parallel.role_state.init_state`, at the saved step), as a plan change makes it."""
    entry = _role_entry(path, role)
    saved: dict[str, list] = {}
    steps: dict[str, float] = {}
    for rel, desc in entry["files"].items():
        for name, step in desc.get("steps", {}).items():
            steps[name] = max(step, steps.get(name, step))
        for key, _shape in desc["tensors"].items():
            saved.setdefault(key, []).append((rel, desc))
    if optimizer is not None and steps:
        init_state(model, optimizer, int(max(steps.values())))
        for group in optimizer.param_groups:
            for key, value in (entry["param_groups"] or [{}])[0].items():
                group[key] = tuple(value) if isinstance(value, list) else value
    layout, rank, layers = Layout(**place["layout"]), place["rank"], int(model.config.num_hidden_layers)
    tied = tied_embeddings(model)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    with ExitStack() as stack:
        handles: dict[str, Any] = {}

        def opened(rel: str):
            if rel not in handles:
                handles[rel] = stack.enter_context(safe_open(path / rel, "pt"))
            return handles[rel]

        for kind in ("weights", *MOMENTS, MASTER) if optimizer is not None else ("weights",):
            split = place["weights_split"] if kind == "weights" else place["state_split"]
            for name, target in state_tensors(model, optimizer, kind).items():
                key = f"{kind}/{name}"
                if key not in saved:
                    if kind == "weights":
                        raise CheckpointError(f"{path / INDEX_FILE}: no shard holds {role} weight '{name}'")
                    continue  # master weights of an fp32 run, moments of a parameter never stepped
                mine = shard_intervals(name, shapes[name], layout, rank, layers, split, tied)
                with torch.no_grad():
                    target.copy_(_gathered(path, key, shapes[name], mine, saved[key], opened).view(target.shape))


def _gathered(path: Path, key: str, shape: tuple, mine: list, sources: list, opened: Callable) -> torch.Tensor:
    """The elements at ``mine`` (intervals of the full tensor) of ``key``, read from the files that hold them."""
    kind, name = key.split("/", 1)
    out, filled = None, 0
    for rel, desc in sources:
        split = desc["weights_split"] if kind == "weights" else desc["state_split"]
        theirs = shard_intervals(
            name, shape, Layout(**desc["layout"]), desc["rank"], desc["num_layers"], split, desc.get("tied", False)
        )
        runs = _overlaps(mine, theirs)
        if not runs:
            continue
        try:
            piece = opened(rel).get_slice(key)
            if len(piece.get_shape()) != 1:  # not written flat: read it whole
                piece = opened(rel).get_tensor(key).reshape(-1)
            for at, start, n in runs:
                chunk = piece[start : start + n]
                if out is None:
                    out = torch.empty(shard_numel(mine), dtype=chunk.dtype)
                out[at : at + n] = chunk
                filled += n
        except (OSError, SafetensorError, ValueError, KeyError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"{path / rel}: unreadable shard ({first})") from None
    if filled != shard_numel(mine):
        raise CheckpointError(
            f"{path / INDEX_FILE}: the shards hold {filled} of the {shard_numel(mine)} elements of "
            f"'{key}' this process needs"
        )
    return out if out is not None else torch.empty(0)


def _overlaps(mine: list, theirs: list) -> list[tuple[int, int, int]]:
    """``(position in mine, position in theirs, length)`` of the elements two sorted interval lists share (runs
    contiguous in both merged), positions counted in each list's concatenation."""
    runs: list[list[int]] = []
    i = j = pos_m = pos_t = 0
    while i < len(mine) and j < len(theirs):
        (lo_m, hi_m), (lo_t, hi_t) = mine[i], theirs[j]
        lo, hi = max(lo_m, lo_t), min(hi_m, hi_t)
        if lo < hi:
            at, start = pos_m + lo - lo_m, pos_t + lo - lo_t
            if runs and runs[-1][0] + runs[-1][2] == at and runs[-1][1] + runs[-1][2] == start:
                runs[-1][2] += hi - lo
            else:
                runs.append([at, start, hi - lo])
        if hi_m <= hi_t:
            pos_m += hi_m - lo_m
            i += 1
        else:
            pos_t += hi_t - lo_t
            j += 1
    return [tuple(r) for r in runs]


def read_role(
    path: Path, role: str, names: Collection[str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Full weights and the full, name-keyed optimizer state (``FullOptimizerState``'s form) of ``role``, or of
    its parameters ``names`` only (a pipeline stage's), assembled from the shards of any layout (for the
    export and for inspection; a resumed run loads with :func:`load_role_shards`)."""
    entry = _role_entry(path, role)
    fulls, filled, params, trainable, steps = {}, {}, [], [], {}
    for rel, desc in entry["files"].items():
        params += [n for n in desc.get("params", ()) if n not in params]
        trainable += [n for n in desc.get("trainable", ()) if n not in trainable]
        for name, step in desc.get("steps", {}).items():
            steps[name] = max(step, steps.get(name, step))
        wanted = [(k, s) for k, s in desc["tensors"].items() if names is None or k.split("/", 1)[1] in names]
        if wanted:
            _read_file(path / rel, desc, wanted, fulls, filled)
    own = [n for n in (names if names is not None else params)]
    for key, full in fulls.items():
        if filled[key] != full.numel():
            raise CheckpointError(
                f"{path / INDEX_FILE}: the shards of {role} '{key}' hold {filled[key]} of its {full.numel()} elements"
            )
    missing = [n for n in own if n in params and f"weights/{n}" not in fulls]
    if missing:
        raise CheckpointError(f"{path / INDEX_FILE}: no shard holds {role} weight '{missing[0]}'")
    weights = {n: fulls[f"weights/{n}"] for n in own if f"weights/{n}" in fulls}
    state = {}
    for name in own:
        if f"{MOMENTS[0]}/{name}" in fulls:
            state[name] = {
                "step": torch.tensor(steps.get(name, 0.0), dtype=torch.float32),
                **{k: fulls[f"{k}/{name}"] for k in (*MOMENTS, MASTER) if f"{k}/{name}" in fulls},
            }
    groups = [
        {
            **{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()},
            "params": [n for n in own if n in trainable],
        }
        for g in entry["param_groups"]
    ]
    return weights, {"state": state, "param_groups": groups}


def _read_file(file: Path, desc: Mapping[str, Any], wanted: list, fulls: dict, filled: dict) -> None:
    """Place the ``wanted`` tensors of one shard file into their full tensors (created on first sight)."""
    layout = Layout(**desc["layout"])
    try:
        with safe_open(file, "pt") as fh:
            for key, shape in wanted:
                kind, name = key.split("/", 1)
                split = desc["weights_split"] if kind == "weights" else desc["state_split"]
                intervals = shard_intervals(
                    name, shape, layout, desc["rank"], desc["num_layers"], split, desc.get("tied", False)
                )
                data = fh.get_tensor(key).reshape(-1)
                if data.numel() != shard_numel(intervals):
                    raise CheckpointError(
                        f"{file}: '{key}' holds {data.numel()} elements, its shard of "
                        f"{tuple(shape)} {shard_numel(intervals)}"
                    )
                if key not in fulls:
                    fulls[key], filled[key] = torch.empty(shape, dtype=data.dtype), 0
                flat, at = fulls[key].view(-1), 0
                for lo, hi in intervals:
                    flat[lo:hi] = data[at : at + hi - lo]
                    at += hi - lo
                filled[key] += at
    except (OSError, SafetensorError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{file}: unreadable shard ({first})") from None


# --- the Hugging Face form --------------------------------------------------------------------------------


def export_role(path: Path, role: str, out: Path, form: str | None = None) -> Path:
    """Write ``role`` of the sharded checkpoint ``path`` as a ``save_pretrained`` directory ``out`` (with the
    tokenizer), which ``from_pretrained`` loads (:func:`loomrl.checkpoint.store.export_checkpoint` writes it aside and
    renames it into place). A LoRA role's ``form`` (:data:`~loomrl.checkpoint.adapters.EXPORT_FORMS`, ``merged``
    by default) is its adapters merged into the base or a PEFT adapter directory; a role without adapters has the
    merged form only."""
    entry = _role_entry(path, role)
    cls = getattr(transformers, entry["class"], None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(f"{path / INDEX_FILE}: '{entry['class']}' is not a transformers model class")
    if "adapters" not in entry and form not in (None, "merged"):
        raise CheckpointError(f"{path}: '{role}' trained every weight, it has no adapters (valid: merged)")
    weights, _ = read_role(path, role)
    if "adapters" in entry:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path / TOKENIZER_DIR)
        export_adapters(path, role, entry, weights, tokenizer, out, form or "merged")
        return out
    config = transformers.AutoConfig.from_pretrained(path / role)
    dtype = next(iter(weights.values())).dtype
    model = cls(config).to(dtype)
    try:
        model.load_state_dict(weights, strict=False)  # tied parameters are saved once, under one name
    except RuntimeError as exc:
        raise CheckpointError(
            f"{path / role}: the shards do not fit {cls.__name__} ({str(exc).splitlines()[0]})"
        ) from None
    if (path / role / GENERATION_FILE).is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path / role)
    model.save_pretrained(out, safe_serialization=True)
    if (path / TOKENIZER_DIR).is_dir():
        for file in (path / TOKENIZER_DIR).iterdir():
            shutil.copy2(file, out / file.name)
    return out
