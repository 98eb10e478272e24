"""``loomrl import-gguf``: a GGUF file, or a pretrained name, converted once into a checkpoint directory."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from loomrl.errors import ConfigError
from loomrl.models.pretrained import PRETRAINED, import_gguf, pretrained_dir

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    if args.source not in PRETRAINED and not args.source.endswith(".gguf"):
        raise ConfigError(
            f"import-gguf: '{args.source}' is neither a .gguf file nor a pretrained name ({', '.join(PRETRAINED)})"
        )
    if args.source not in PRETRAINED and not args.out:
        raise ConfigError(f"import-gguf {args.source}: give the directory to write (loomrl import-gguf FILE OUT)")
    start = time.perf_counter()
    if args.out is None:  # a pretrained name's cache entry
        path = Path(pretrained_dir(args.source, verify=True))
    else:
        gguf = PRETRAINED[args.source].path() if args.source in PRETRAINED else args.source
        path = import_gguf(gguf, args.out)
    print(f"{path}  ({time.perf_counter() - start:.1f} s; checksums in {path}/loomrl_import.json)")
    return 0
