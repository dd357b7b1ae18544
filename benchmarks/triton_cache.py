"""Triton's kernel cache small enough to travel in one call to a GPU machine: each kernel's binary and metadata
whole, its intermediate forms (source, TTIR, TTGIR, LLVM IR, PTX) emptied.

A vLLM server's first start on a fresh machine spends about a minute compiling the model's Triton kernels, and the
cache it leaves (86 MB) cannot travel. Triton loads a kernel from its cache only when every file its group names
exists, but it reads only the binary and the metadata: emptied files keep each group whole and the cache hits.
Stdlib only, so that it runs on the GPU machine as a script: `python3 triton_cache.py HOME OUT [--limit-mib N]`.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
from pathlib import Path

CACHE = Path(".triton") / "cache"  # under HOME, where Triton keeps it unless TRITON_CACHE_DIR says otherwise
INTERMEDIATE = {".source", ".ttir", ".ttgir", ".llir", ".ptx", ".amdgcn"}


def pack(home: Path, out: Path, limit: int) -> tuple[int, int] | None:
    """Writes `out` (a .tgz to unpack into HOME) where it stays within `limit` bytes; returns (bytes in the cache,
    bytes packed), or None where HOME holds no cache."""
    root = home / CACHE
    if not root.is_dir():
        return None
    partial = out.with_name(out.name + ".partial")
    total = 0
    with tarfile.open(partial, "w:gz", compresslevel=9) as tar:
        for path in sorted(root.rglob("*")):
            if not path.is_file() or path.name == "lock":
                continue
            total += path.stat().st_size
            info = tar.gettarinfo(path, arcname=str(path.relative_to(home)))
            if path.suffix in INTERMEDIATE:
                info.size = 0
                tar.addfile(info, io.BytesIO())
            else:
                with path.open("rb") as f:
                    tar.addfile(info, f)
    size = partial.stat().st_size
    if size > limit:
        partial.unlink()
    else:
        os.replace(partial, out)
    return total, size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("home", type=Path, help="the folder holding .triton/cache")
    p.add_argument("out", type=Path, help="the archive to write (unpack it into HOME on the next machine)")
    p.add_argument("--limit-mib", type=float, default=13.0, help="write nothing where the archive would be larger")
    args = p.parse_args(argv)
    done = pack(args.home, args.out, int(args.limit_mib * 2**20))
    if done is None:
        print(f"Triton's cache: none under {args.home}")
        return 0
    total, size = done
    verdict = f"over {args.limit_mib:g} MiB: not brought back" if size > args.limit_mib * 2**20 else args.out.name
    print(f"Triton's cache: {total / 1e6:.1f} MB, {size / 1e6:.1f} MB packed without intermediate forms ({verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
