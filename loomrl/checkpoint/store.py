"""Atomic, resumable checkpoints of a training run.

A checkpoint is one directory, ``RUN_DIR/checkpoints/iter_000010/``. Sharded (:func:`save_sharded_checkpoint`,
the form the executors write) it holds:

- per trained role (``actor/``, ``critic/``...) the shards every process wrote of the part of the weights and
  optimizer state it owns, and the model's config, described by ``index.json``
  (:mod:`loomrl.checkpoint.shards`); ``loomrl export`` writes a role's Hugging Face form from them;
- ``tokenizer/``, ``state.json``, ``rng.pt`` and ``manifest.json``, as below.

In the full form (:func:`save_checkpoint`: every role gathered whole onto one process, as runs wrote before
sharded checkpoints; still loaded) it holds:

- one sub-directory per model role (``actor/``, ``critic/``, ...), each a self-contained Hugging Face
  checkpoint (``save_pretrained`` with safetensors, plus the tokenizer), so
  ``AutoModelForCausalLM.from_pretrained(".../iter_000010/actor")`` loads the trained policy;
- ``optimizers.pt``: ``{"optimizers": {role: state_dict}}``;
- ``state.json``: the iteration and whatever JSON-serialisable progress the trainer passes (data position...);
- ``rng.pt``: Python, NumPy (when importable), torch CPU and CUDA (when available) generator states;
- ``manifest.json``: every other file of the checkpoint with its size and SHA-256, written last.

Everything is written into ``iter_XXXXXX.tmp-<pid>`` and renamed into place, so a directory with a final
name is always complete; a crash mid-write leaves only a ``.tmp-`` directory, which is ignored (and removed by
the next save once its writer is gone). ``checkpoints/latest`` names the newest checkpoint and is itself
replaced atomically; pruned checkpoints are renamed away before they are deleted, so a crash mid-deletion never
leaves a half-deleted directory under a final name.

The manifest guards against what atomic renames cannot: a file damaged or truncated after the save (a disk, a
copy, a sync to object storage, someone's editor). Loading checks every listed file's size and checksum first
and fails with one line naming the file. Checkpoints written before manifests existed have none and still load,
unverified (with a warning), so older runs keep resuming. A checkpoint never holds NaN or inf: the save refuses
non-finite weights or optimizer state before touching the disk, leaving the previous checkpoint in place.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.optim import Optimizer
from transformers import PreTrainedModel

from loomrl.checkpoint.shards import (
    INDEX_FILE,
    TOKENIZER_DIR,
    WHOLE,
    check_finite,
    check_pieces,
    export_role,
    file_entry,
    load_role_shards,
    merge_index,
    role_pieces,
    write_role_shards,
)
from loomrl.errors import CheckpointError
from loomrl.run_dir import RunDir

try:  # NumPy is optional: only its global generator is captured, and only when it is installed.
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torch wheels in practice
    np = None

LATEST_FILE = "latest"
STATE_FILE = "state.json"
OPTIMIZERS_FILE = "optimizers.pt"
RNG_FILE = "rng.pt"
MANIFEST_FILE = "manifest.json"
PENDING_FILE = "pending.pt"
"""An asynchronous run's batches generated ahead of their iterations (:func:`read_pending`)."""
EXPORT_DIR = "hf"
"""Where a sharded checkpoint's roles are exported by default (``iter_N/hf/actor``), outside its manifest."""
_NAME_RE = re.compile(r"^iter_(\d+)$")
_LEFTOVER_RE = re.compile(r"^(iter_\d+|latest)\.(tmp|stale)-(\d+)$")
"""A save's unfinished directory or ``latest``, or a pruned checkpoint being deleted, of the process with that
pid."""


def checkpoint_name(iteration: int) -> str:
    """Directory name of the checkpoint taken after ``iteration``."""
    return f"iter_{iteration:06d}"


def save_checkpoint(
    run_dir: str | os.PathLike,
    iteration: int,
    models: Mapping[str, PreTrainedModel],
    tokenizer: Any | None,
    optimizers: Mapping[str, Optimizer],
    state: Mapping[str, Any],
    keep_last: int = 2,
    pending: Any = None,
) -> Path:
    """Write a complete checkpoint of the run after ``iteration`` and return its directory (with ``pending``,
    an asynchronous run's batches generated ahead, as :data:`PENDING_FILE`).

    ``tokenizer`` (may be None) is saved into every role directory so each one loads on its own.
    After the new checkpoint is in place, all but the ``keep_last`` newest are deleted; the one just
    written is never deleted. Non-finite weights or optimizer state raise a :class:`CheckpointError` naming
    the role and tensor before anything is written.
    """
    # Serialise and check first so a non-JSON or non-finite value fails before anything touches the disk.
    state_json = state_json_of(state, iteration, keep_last)
    opt_states = {role: opt.state_dict() for role, opt in optimizers.items()}
    for role, model in models.items():
        check_finite(model.state_dict(), f"{role} weight", "")
    for role, opt_state in opt_states.items():
        check_finite(opt_state, f"{role} optimizer state", "")
    tmp = begin_save(run_dir, iteration)
    for role, model in models.items():
        role_dir = tmp / role
        model.save_pretrained(role_dir, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(role_dir)
    torch.save({"optimizers": opt_states}, tmp / OPTIMIZERS_FILE)
    return _finish(tmp, iteration, state_json, keep_last, {}, pending)


def save_sharded_checkpoint(
    run_dir: str | os.PathLike,
    iteration: int,
    roles: Mapping[str, tuple[torch.nn.Module, Any]],
    tokenizer: Any | None,
    state: Mapping[str, Any],
    keep_last: int = 2,
    pending: Any = None,
) -> Path:
    """Write a sharded checkpoint of ``roles`` (role → (model, optimizer), held whole by this one process, as
    the reference executor holds them) and return its directory; the executors on several processes use
    :func:`begin_save`, :func:`~loomrl.checkpoint.shards.write_role_shards` and :func:`finish_sharded_save`.
    Non-finite values raise before anything is written, as in :func:`save_checkpoint`."""
    state_json = state_json_of(state, iteration, keep_last)
    pieces = {}
    for role, (model, optimizer) in roles.items():
        pieces[role] = role_pieces(model, optimizer, WHOLE, next(model.parameters()).dtype)
        check_pieces(role, pieces[role])
    tmp = begin_save(run_dir, iteration)
    parts = {
        role: [write_role_shards(tmp, role, model, optimizer, WHOLE, pieces[role])]
        for role, (model, optimizer) in roles.items()
    }
    return finish_sharded_save(tmp, iteration, state_json, tokenizer, parts, keep_last, pending)


def begin_save(run_dir: str | os.PathLike, iteration: int) -> Path:
    """The empty ``iter_N.tmp-<pid>`` directory a save writes into (this process's pid: it finishes the save)."""
    ckpt_root = RunDir(run_dir).checkpoints
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f"{checkpoint_name(iteration)}.tmp-{os.getpid()}"
    if tmp.exists():  # left by an earlier crash of a process that happened to have our pid
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def finish_sharded_save(
    tmp: Path,
    iteration: int,
    state_json: str,
    tokenizer: Any | None,
    parts: Mapping[str, list[Mapping[str, Any]]],
    keep_last: int,
    pending: Any = None,
) -> Path:
    """Complete a sharded save whose shards are in ``tmp`` (``parts``: every writer's results, by role): the
    index, tokenizer, RNG, state and manifest (the shards' checksums as their writers computed them), then the
    rename into place, ``latest`` and pruning."""
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / TOKENIZER_DIR)
    _write_text_synced(tmp / INDEX_FILE, json.dumps(merge_index(parts), indent=1))
    known = {
        rel: entry for results in parts.values() for result in results for rel, entry in result["manifest"].items()
    }
    return _finish(tmp, iteration, state_json, keep_last, known, pending)


def state_json_of(state: Mapping[str, Any], iteration: int, keep_last: int) -> str:
    """``state.json``'s text (raises for a value JSON cannot hold, or a ``keep_last`` below 1)."""
    if keep_last < 1:
        raise CheckpointError(f"save_checkpoint: keep_last must be >= 1, got {keep_last}")
    return json.dumps({**state, "iteration": iteration}, indent=2, sort_keys=True)


def _finish(
    tmp: Path, iteration: int, state_json: str, keep_last: int, known: Mapping[str, Any], pending: Any = None
) -> Path:
    """The RNG, state, pending batches (where given) and manifest files of a save in ``tmp``, then its rename into
    place, ``latest``, pruning."""
    torch.save(_capture_rng(), tmp / RNG_FILE)
    if pending is not None:
        torch.save(pending, tmp / PENDING_FILE)
    _write_text_synced(tmp / STATE_FILE, state_json)
    _write_manifest(tmp, known)
    ckpt_root = tmp.parent
    final = ckpt_root / checkpoint_name(iteration)
    _move_into_place(tmp, final)
    _write_atomic(ckpt_root / LATEST_FILE, final.name + "\n")
    _prune(ckpt_root, keep=final, keep_last=keep_last)
    return final


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of the run, or None if it has none.

    Trusts ``checkpoints/latest`` when it names a complete checkpoint; otherwise (file missing, corrupt,
    or naming a deleted directory) falls back to the highest-numbered complete ``iter_*`` directory.
    Choosing reads no file contents; :func:`load_checkpoint` (or :func:`verify_checkpoint`) checks them.
    """
    ckpt_root = RunDir(run_dir).checkpoints
    if not ckpt_root.is_dir():
        return None
    try:
        named = (ckpt_root / LATEST_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        named = ""
    if _NAME_RE.match(named) and _is_complete(ckpt_root / named):
        return ckpt_root / named
    found = _list_checkpoints(ckpt_root)
    return found[-1][1] if found else None


def load_checkpoint(
    path: str | os.PathLike,
    models: Mapping[str, PreTrainedModel],
    optimizers: Mapping[str, Optimizer],
    restore_rng: bool = True,
    places: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint in place into ``models`` and ``optimizers``; return its state.

    The returned dict is the saved ``state`` plus ``"iteration"``. From a sharded checkpoint each process reads only
    the part of the state it holds: ``places`` says, per role, where the process sits in the role's training
    layout (:func:`~loomrl.checkpoint.shards.place_of`; by default it holds the whole role). Roles present in the
    checkpoint but
    not passed are left alone, so a run may resume only the models it still trains. Every file is checked
    against the manifest (:func:`verify_checkpoint`) before anything is loaded, so a damaged checkpoint
    changes nothing.
    """
    path = Path(path)
    verify_checkpoint(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / STATE_FILE}: unreadable checkpoint state ({exc})") from None
    if (path / INDEX_FILE).is_file():
        _load_sharded(path, models, optimizers, places or {})
    else:
        for role, model in models.items():
            _load_model_weights(path / role, model)
        opt_states = _torch_load(path / OPTIMIZERS_FILE)
        _load_state_dicts(path / OPTIMIZERS_FILE, "optimizers", opt_states, optimizers)
    if restore_rng:
        _restore_rng(_torch_load(path / RNG_FILE), path / RNG_FILE)
    return state


def verify_checkpoint(path: str | os.PathLike, role: str | None = None) -> None:
    """Check every file the checkpoint's manifest lists (only ``role``'s directory when given): present, of its
    size, of its SHA-256.

    Raises a one-line :class:`CheckpointError` naming the first file that is missing or damaged. Files not in
    the manifest (an ``eval.json`` written next to the models later) are not checked. A checkpoint without a
    manifest (written before manifests existed) passes unverified, with a warning.
    """
    path = Path(path)
    if not _is_complete(path):
        raise CheckpointError(f"{path}: not a complete checkpoint (missing directory or {STATE_FILE})")
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        warnings.warn(
            f"{path}: no {MANIFEST_FILE} (saved before checkpoints had one); loading it unverified", stacklevel=2
        )
        return
    try:
        files = json.loads(manifest.read_text())["files"]
        listed = [(name, int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{manifest}: unreadable manifest ({type(exc).__name__}: {exc})") from None
    fallback = f"delete {path.name} to resume from the checkpoint before it"
    if role is not None:  # with what reading a role needs besides its own files
        listed = [
            entry
            for entry in listed
            if entry[0].startswith((f"{role}/", f"{TOKENIZER_DIR}/")) or entry[0] == INDEX_FILE
        ]
    for name, size, digest in listed:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from checkpoint (listed in {MANIFEST_FILE}); {fallback}")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"{file}: {actual} bytes, {MANIFEST_FILE} says {size} (damaged since it was saved); {fallback}"
            )
        if file_entry(file)["sha256"] != digest:
            raise CheckpointError(
                f"{file}: SHA-256 does not match {MANIFEST_FILE} (damaged since it was saved); {fallback}"
            )


def export_checkpoint(
    path: str | os.PathLike, role: str, out: str | os.PathLike | None = None, form: str | None = None
) -> Path:
    """Verify ``role``'s files of the checkpoint ``path`` and write the role as a Hugging Face directory that
    ``from_pretrained`` loads: ``out``, by default ``path/hf/role``, kept there for later calls (a checkpoint
    in the full form has it as ``path/role`` already, copied to ``out`` when one is given). ``form``: a LoRA
    role's ``merged`` (the default) or ``adapter`` (a PEFT adapter directory, by default ``path/hf/role-adapter``;
    :mod:`loomrl.checkpoint.adapters`)."""
    path = Path(path)
    verify_checkpoint(path, role)
    sharded = (path / INDEX_FILE).is_file()
    if out is None:
        adapter = form == "adapter"
        out = path / EXPORT_DIR / (f"{role}-adapter" if adapter else role) if sharded else path / role
        done = ("adapter_model.safetensors",) if adapter else ("model.safetensors", "model.safetensors.index.json")
        if (out / ("adapter_config.json" if adapter else "config.json")).is_file() and (
            not sharded or any((out / f).is_file() for f in done)
        ):
            return out
    out = Path(out)
    if not sharded and not (path / role / "config.json").is_file():
        raise CheckpointError(f"{path / role}: no saved model for role '{role}' (config.json missing)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if sharded:
        export_role(path, role, tmp, form)
    else:
        if form == "adapter":
            raise CheckpointError(f"{path}: a checkpoint in the full form holds no adapters (valid: merged)")
        shutil.copytree(path / role, tmp)
    _move_into_place(tmp, out)
    return out


# --- integrity ------------------------------------------------------------------------------------


def _write_manifest(directory: Path, known: Mapping[str, Any]) -> None:
    """List every file under ``directory`` with its size and SHA-256, flushing each to disk on the way, so the
    rename that follows publishes only durable data; ``known``: files their writers hashed and flushed already
    (the shards of other processes)."""
    files = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = file.relative_to(directory).as_posix()
        files[rel] = dict(known[rel]) if rel in known else file_entry(file, sync=True)
    for sub in {p.parent for p in directory.rglob("*")}:
        _fsync_dir(sub)
    _write_text_synced(directory / MANIFEST_FILE, json.dumps({"format": 1, "files": files}, indent=1))


def _load_sharded(
    path: Path,
    models: Mapping[str, torch.nn.Module],
    optimizers: Mapping[str, Any],
    places: Mapping[str, Mapping[str, Any]],
) -> None:
    """Each role's part of the saved state, in place (:func:`~loomrl.checkpoint.shards.load_role_shards`)."""
    for role in sorted(set(models) | set(optimizers)):
        # optimizers may come wrapped for the full form (FullOptimizerState): the shards go into what it wraps
        optimizer = getattr(optimizers.get(role), "optimizer", optimizers.get(role))
        model = models.get(role, getattr(optimizers.get(role), "model", None))
        if model is None:
            raise CheckpointError(f"{path}: loading the optimizer state of '{role}' needs its model")
        load_role_shards(path, role, model, optimizer, places.get(role, WHOLE))


def _load_model_weights(role_dir: Path, model: PreTrainedModel) -> None:
    """Copy the weights saved in ``role_dir`` into ``model`` without replacing the module object.

    Reading model.safetensors directly would be cheaper, but ``save_pretrained`` may rename or re-split
    weights into the model's original hub format (transformers' weight conversions, sharding), so the
    file's keys need not match ``model.state_dict()``. Loading a copy with ``from_pretrained`` undoes
    exactly those transformations; the copy lives on CPU only until its tensors are copied over.
    """
    if not (role_dir / "config.json").is_file():
        raise CheckpointError(f"{role_dir}: no saved model for this role (config.json missing)")
    try:
        loaded = type(model).from_pretrained(role_dir, dtype=model.dtype)
        # The full-state-dict setter copies into plain and tensor-parallel (DTensor) parameters alike.
        # A pipeline stage takes its own parameters (it holds a subset, under their global names).
        own = set(model.state_dict())
        weights = {k: v for k, v in loaded.state_dict().items() if k in own}
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=True))
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{role_dir}: cannot load weights into {type(model).__name__} ({first_line})") from None


def read_pending(path: str | os.PathLike) -> Any:
    """The batches an asynchronous run had generated ahead when checkpoint ``path`` was taken (None without)."""
    file = Path(path) / PENDING_FILE
    return _torch_load(file) if file.exists() else None


def _torch_load(file: Path) -> Any:
    # weights_only: these files hold only tensors and plain containers, and refusing pickled code
    # means a tampered checkpoint cannot run anything on load.
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing from checkpoint") from None
    except Exception as exc:  # torch raises several unrelated types for truncated or foreign files
        raise CheckpointError(f"{file}: unreadable ({type(exc).__name__})") from None


def _load_state_dicts(file: Path, section: str, saved: Any, targets: Mapping[str, Any]) -> None:
    """Load ``saved[section][role]`` into each target's ``load_state_dict``."""
    states = saved.get(section, {}) if isinstance(saved, dict) else None
    if states is None:
        raise CheckpointError(f"{file}: not a loomrl optimizer file (no '{section}' section)")
    for role, target in targets.items():
        if role not in states:
            raise CheckpointError(f"{file}: no {section[:-1]} state for role '{role}' (has {sorted(states)})")
        try:
            target.load_state_dict(states[role])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{file}: {section[:-1]} state for '{role}' does not fit ({exc})") from None


# --- random number generators ----------------------------------------------------------------------


def _capture_rng() -> dict[str, Any]:
    rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        # Stored as plain lists: weights_only loading accepts them, NumPy arrays it would refuse.
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        rng["numpy"] = (kind, keys.tolist(), pos, has_gauss, cached)
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _restore_rng(rng: Any, file: Path) -> None:
    if not isinstance(rng, dict) or "python" not in rng or "torch" not in rng:
        raise CheckpointError(f"{file}: not a loomrl RNG file")
    random.setstate(_as_tuples(rng["python"]))
    torch.set_rng_state(rng["torch"])
    if np is not None and "numpy" in rng:
        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    cuda_states = rng.get("cuda")
    if cuda_states is not None:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            # Resuming on different hardware is legitimate; only bitwise reproducibility is lost.
            warnings.warn(
                f"{file}: saved CUDA RNG state for {len(cuda_states)} devices not restored "
                f"({torch.cuda.device_count()} available)",
                stacklevel=3,
            )


def _as_tuples(value: Any) -> Any:
    """random.setstate insists on tuples, which a serialiser may hand back as lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# --- directory bookkeeping -------------------------------------------------------------------------


def _is_complete(path: Path) -> bool:
    # Only a finished save is renamed to a final name; state.json (in every checkpoint, with or without a
    # manifest) tells a checkpoint from some other directory.
    return path.is_dir() and (path / STATE_FILE).is_file()


def _list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``ckpt_root`` as (iteration, path), oldest first."""
    found = []
    for child in ckpt_root.iterdir():
        match = _NAME_RE.match(child.name)
        if match and _is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; a checkpoint already there (same iteration re-saved) is replaced."""
    if not final.exists():
        os.replace(tmp, final)
    else:
        # rename() cannot overwrite a non-empty directory, so park the old one first; during that instant
        # `latest` may dangle, which latest_checkpoint() survives by scanning.
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(final.parent)


def _prune(ckpt_root: Path, keep: Path, keep_last: int) -> None:
    """Delete all but the ``keep_last`` newest checkpoints, never ``keep``, and what crashed saves left.

    A checkpoint is renamed out of the ``iter_*`` names before its files go, so a crash mid-deletion leaves a
    ``.stale-`` directory, never a partial checkpoint that :func:`latest_checkpoint` could choose."""
    others = [p for _, p in _list_checkpoints(ckpt_root) if p != keep]
    for old in others[: max(len(others) - (keep_last - 1), 0)]:
        stale = old.with_name(f"{old.name}.stale-{os.getpid()}")
        if stale.exists():  # left by an earlier crash of a process that happened to have our pid
            shutil.rmtree(stale)
        os.replace(old, stale)
        shutil.rmtree(stale, ignore_errors=True)
    _remove_leftovers(ckpt_root)


def remove_leftovers(run_dir: str | os.PathLike) -> None:
    """Remove what saves and prunings cut short left in ``run_dir``'s checkpoints (``.tmp-`` and ``.stale-``
    entries of processes that are gone): a resumed run that writes no further checkpoint leaves none behind."""
    ckpt_root = RunDir(run_dir).checkpoints
    if ckpt_root.is_dir():
        _remove_leftovers(ckpt_root)


def _remove_leftovers(ckpt_root: Path) -> None:
    for child in ckpt_root.iterdir():
        match = _LEFTOVER_RE.match(child.name)
        if match and not _alive(int(match.group(3))):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (ours counts as alive: its directories are in use)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_text_synced(file: Path, text: str) -> None:
    with open(file, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _write_atomic(file: Path, text: str) -> None:
    tmp = file.with_name(f"{file.name}.tmp-{os.getpid()}")
    _write_text_synced(tmp, text)
    os.replace(tmp, file)
    _fsync_dir(file.parent)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; some file systems do not allow opening directories, which is fine.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
