"""``loomrl import-gguf``: a GGUF file, or a pretrained name, converted once into a checkpoint directory."""

from __future__ import annotations

import argparse
import time

from loomrl.errors import ConfigError
from loomrl.models.pretrained import PRETRAINED, cache_root, import_gguf

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    if args.source in PRETRAINED:
        gguf = PRETRAINED[args.source].path()
        out = args.out or cache_root() / "models" / args.source
    elif args.source.endswith(".gguf"):
        if not args.out:
            raise ConfigError(f"import-gguf {args.source}: give the directory to write (loomrl import-gguf FILE OUT)")
        gguf, out = args.source, args.out
    else:
        raise ConfigError(
            f"import-gguf: '{args.source}' is neither a .gguf file nor a pretrained name ({', '.join(PRETRAINED)})"
        )
    start = time.perf_counter()
    path = import_gguf(gguf, out)
    print(f"{path}  ({time.perf_counter() - start:.1f} s; checksums in {path}/loomrl_import.json)")
    return 0
