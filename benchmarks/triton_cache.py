"""Triton's kernel cache small enough to travel in one call to a GPU machine: each kernel's binary and metadata
whole, its intermediate forms (source, TTIR, TTGIR, LLVM IR, PTX) emptied.

A vLLM server's first start on a fresh machine spends about a minute compiling the model's Triton kernels, and the
cache it leaves (86 MB) cannot travel. Triton loads a kernel from its cache only when every file its group names
exists, but it reads only the binary and the metadata: emptied files keep each group whole and the cache hits.
Stdlib only, so that it runs on the GPU machine as a script:

    python3 triton_cache.py pack HOME OUT [--limit-mib N]   # OUT written only where it stays within N MiB
    python3 triton_cache.py unpack ARCHIVE HOME              # merged into HOME's cache, its own files kept
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


def unpack(archive: Path, home: Path) -> int:
    """Merges `archive` into HOME's cache and returns how many files it added. A kernel's files are named by its
    hash, so a file already there is the same kernel's and is kept (perhaps whole where the archive's is emptied)."""
    added = 0
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        for member in members:  # all checked before anything is written
            if not member.name.startswith(f"{CACHE}/") or ".." in Path(member.name).parts:
                raise ValueError(f"{archive}: {member.name} is not inside {CACHE}")
        for member in members:
            if member.isfile() and not (home / member.name).exists():
                tar.extract(member, home, filter="data")
                added += 1
    return added


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = p.add_subparsers(dest="verb", required=True)
    packing = verbs.add_parser("pack", help="HOME's cache into an archive")
    packing.add_argument("home", type=Path, help="the folder holding .triton/cache")
    packing.add_argument("out", type=Path, help="the archive to write (unpack it into HOME on the next machine)")
    packing.add_argument("--limit-mib", type=float, default=13.0, help="write nothing where the archive would be larger")
    unpacking = verbs.add_parser("unpack", help="an archive into HOME's cache")
    unpacking.add_argument("archive", type=Path)
    unpacking.add_argument("home", type=Path)
    args = p.parse_args(argv)
    if args.verb == "unpack":
        print(f"Triton's cache: {unpack(args.archive, args.home)} files restored into {args.home / CACHE}")
        return 0
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
