"""What one path holds, as a value a history row stores and compares: its image and its mode.

An image is None (nothing there), the sha256 of a regular file's bytes (which names its blob), "symlink:" and the
link's target text, or "dir" for a folder. The mode is the permission bits of a file or folder (None for a symlink,
or where it was not recorded). A tree snapshot is {relative path: [image, mode]} of everything under a root.
"""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Iterator

DIR = "dir"
LINK = "symlink:"
CHUNK = 1 << 20

Image = tuple["str | None", "int | None"]


class TouchError(Exception):
    """A path cannot be recorded or changed as a step asks (a socket, a folder where a file should be, ...)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def is_blob(image: str | None) -> bool:
    """Whether the image is a regular file's content (a blob's name)."""
    return image is not None and image != DIR and not image.startswith(LINK)


def link(target: str) -> str:
    return LINK + target


def link_target(image: str) -> str:
    return image[len(LINK):]


def describe(image: str | None) -> str:
    if image is None:
        return "nothing"
    if image == DIR:
        return "a folder"
    if image.startswith(LINK):
        return f"a symlink to {link_target(image)!r}"
    return f"a file (sha256 {image[:12]})"


def mode_of(st: os.stat_result) -> int | None:
    return None if stat.S_ISLNK(st.st_mode) else stat.S_IMODE(st.st_mode)


def read(path: Path, lstat: os.stat_result | None = None) -> Image:
    """The image and mode at `path` now (files hashed). Something that is neither a file, a folder nor a symlink
    (a socket, a fifo) is a TouchError."""
    try:
        st = lstat or os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    if stat.S_ISLNK(st.st_mode):
        return link(os.readlink(path)), None
    if stat.S_ISDIR(st.st_mode):
        return DIR, stat.S_IMODE(st.st_mode)
    if stat.S_ISREG(st.st_mode):
        return sha256_file(path), stat.S_IMODE(st.st_mode)
    raise TouchError(f"{path}: neither a file, a folder nor a symlink")


def same(a: Image, b: Image) -> bool:
    """Equal images, and equal permission bits where both are known."""
    if a[0] != b[0]:
        return False
    return a[1] is None or b[1] is None or stat.S_IMODE(a[1]) == stat.S_IMODE(b[1])


def walk(root: Path) -> Iterator[tuple[str, Path, os.stat_result]]:
    """(relative path, path, lstat) of everything under `root`, parents before children; symlinks are not
    followed, and sockets, fifos and devices are left out (nothing a plugin can mean to change)."""
    stack = [Path(root)]
    while stack:
        folder = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            path = Path(entry.path)
            st = entry.stat(follow_symlinks=False)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                continue
            yield str(path.relative_to(root)), path, st
            if stat.S_ISDIR(st.st_mode):
                stack.append(path)


def spliced(path: Path, under: Path, written: Path) -> bool:
    """Whether the file holds what a rewrite in place of `under`'s bytes by `written`'s leaves when cut short: the
    first k bytes written, the rest of `under` after them (write_image writes from the start, then truncates)."""
    size, under_size, written_size = (os.path.getsize(p) for p in (path, under, written))
    if size > under_size:
        return size <= written_size and _first_difference(path, written, size) == size
    return size == under_size and _last_difference(path, under, size) < _first_difference(path, written, size)


def _first_difference(a: Path, b: Path, size: int) -> int:
    """The first offset below `size` where the files differ (one ending counts as differing), else `size`."""
    offset = 0
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while offset < size:
            x, y = fa.read(min(CHUNK, size - offset)), fb.read(min(CHUNK, size - offset))
            if x != y:
                lo, hi = 0, min(len(x), len(y))  # x[:lo] == y[:lo]; the first difference lies below hi (or at it)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if x[:mid] == y[:mid] else (lo, mid - 1)
                return offset + lo
            offset += len(x)
    return size


def _last_difference(a: Path, b: Path, size: int) -> int:
    """The last offset below `size` where the files (of at least `size` bytes) differ, else -1."""
    last, offset = -1, 0
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while offset < size:
            x, y = fa.read(min(CHUNK, size - offset)), fb.read(min(CHUNK, size - offset))
            if x != y:
                lo, hi = 0, len(x)  # x[hi:] == y[hi:]; find the smallest such hi
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (mid + 1, hi) if x[mid:] != y[mid:] else (lo, mid)
                last = offset + lo - 1
            offset += len(x)
    return last


def manifest_entries(manifest: dict) -> dict[str, list]:
    """{relative path: [image, mode]} of a tree snapshot, also one written before symlinks and folders were
    images (files, links and a list of folders)."""
    if "entries" in manifest:
        return manifest["entries"]
    entries = {rel: [digest, mode] for rel, (digest, mode) in manifest.get("files", {}).items()}
    entries.update({rel: [link(target), None] for rel, target in manifest.get("links", {}).items()})
    entries.update({rel: [DIR, None] for rel in manifest.get("dirs", [])})
    return entries


def escapes(root: Path, rel: str) -> bool:
    """Whether the symlink at `rel` leads outside `root` (followed through any further links)."""
    real_root = os.path.realpath(root)
    target = os.path.realpath(Path(root) / rel)
    return target != real_root and not target.startswith(real_root.rstrip(os.sep) + os.sep)


def inside(root: Path, path: Path) -> bool:
    """Whether `path`, as written, names something below `root`: under it, and without a `..`."""
    try:
        rel = Path(path).relative_to(root)
    except ValueError:
        return False
    return bool(rel.parts) and ".." not in rel.parts


def link_on_the_way(root: Path, path: Path, after: dict[Path, "str | None"] | None = None) -> Path | None:
    """The first folder between `root` and `path` that is a symlink: on disk now or, for a folder `after` gives the
    image of, once that image is in place (what lies beyond a link that is replaced is not looked at). A write
    through it would land wherever the link leads."""
    folder, beyond = Path(root), False
    for part in Path(path).relative_to(root).parts[:-1]:
        folder = folder / part
        if after is not None and folder in after:
            if after[folder] is not None and after[folder].startswith(LINK):
                return folder
            beyond = beyond or _is_link(folder)
        elif not beyond and _is_link(folder):
            return folder
    return None


def _is_link(path: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
