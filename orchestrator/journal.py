"""Content-addressed snapshots (state/blobs/<sha256>) and the per-step record of touched paths.

A path's pre-image is durable before the path is touched, and so is the image about to be written over it, so
whatever instant the process dies at, recovery (recovery.py) can put back the last kept state and tell the
command's own writes, a write interrupted half-way included, from anyone else's. Images (images.py) are files with
their bytes, symlinks with their target text and folders, each with its mode: measurement arms switch all of them,
and rollback restores them.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Callable

from orchestrator import images
from orchestrator.errors import UserError
from orchestrator.images import DIR, LINK, Image, TouchError, sha256_file  # noqa: F401 - TouchError re-exported
from orchestrator.intents import Intents
from orchestrator.store import Store

TMP_SUFFIX = ".orch-tmp"
CHUNK = images.CHUNK
ROW_KEYS = ("root", "path", "before", "before_mode", "after", "after_mode", "sealed")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int | None = None, durable: bool = False) -> None:
    """Whole-file replace through a temporary file and a rename."""
    forget_bytecode(path)
    tmp = path.with_name(f".{path.name}{TMP_SUFFIX}")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    if mode is not None:
        os.chmod(tmp, stat.S_IMODE(mode))
    elif path.exists():
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
    os.replace(tmp, path)


def write_image(path: Path, data: bytes, mode: int | None = None) -> None:
    """Put bytes into a target file. Every such write is journaled first, so recovery repairs a torn one;
    rewriting in place avoids freeing and reallocating the file's blocks (20x cheaper for large files).
    A hard-linked file is replaced by a rename instead, so its other names keep their bytes."""
    forget_bytecode(path)
    try:
        st = path.lstat()
    except FileNotFoundError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        write_atomic(path, data, mode)
        return
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate()
    if mode is not None and stat.S_IMODE(st.st_mode) != stat.S_IMODE(mode):
        os.chmod(path, stat.S_IMODE(mode))


def forget_bytecode(path: Path) -> None:
    """Delete the cached bytecode of a Python module about to be rewritten, for every interpreter. Python trusts a
    cache whose source has the size and the whole-second modification time it was compiled from, so a module
    rewritten with the same size within that second would otherwise run its old code."""
    if path.suffix != ".py":
        return
    folders = {path.parent / "__pycache__"}
    try:
        folders.add(Path(importlib.util.cache_from_source(str(path))).parent)  # PYTHONPYCACHEPREFIX
    except NotImplementedError:
        pass
    for folder in folders:
        for cached in folder.glob(f"{glob.escape(path.stem)}.*.pyc"):
            cached.unlink(missing_ok=True)


def _beyond(path: Path, link: Path) -> str:
    try:
        leads = f"a symlink to {os.readlink(link)!r}"
    except OSError:
        leads = "a symlink"
    return f"{path} lies beyond {link}, {leads}"


def _is_digest(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _depth(item: tuple) -> int:
    return len(item[0].parts)


def _kind(image: str | None) -> str | None:
    return None if image is None else "dir" if image == DIR else "link" if image.startswith(LINK) else "file"


def _kind_on_disk(st: os.stat_result) -> str:
    return "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else "file"


class BlobError(UserError):
    """Blobs an image needs are missing or do not hash to their names: nothing was written."""

    def __init__(self, problems: list[tuple[Path, str, str]]):
        self.problems = problems  # (blob, what it holds, why it cannot be used)
        super().__init__("refused, nothing was changed: " + "; ".join(
            f"{blob} is {why}: it holds {what}" for blob, what, why in problems) +
            ". The state folder is damaged: put the blob back from a backup, or restore the file by hand")


class OutsideRoot(UserError):
    """Recorded paths would be written outside their target roots: nothing was written (`partly`: the rest of the
    batch, a link having appeared on the way while it was written)."""

    def __init__(self, problems: list[str], partly: bool = False):
        super().__init__(("stopped half-way (`orchestrator recover` finishes once the link is gone): " if partly else
                          "refused, nothing was changed: ") + "; ".join(problems) + ". A recorded path is written "
                         "only inside its target root, through real folders: put back the folder a symlink "
                         "replaced, or restore the file by hand")


class Journal:
    """`roots`: where each root named in the history is (roots.bind): rows hold a root's name and a path inside it."""

    def __init__(self, store: Store, state_dir: Path, roots: dict[str, Path]):
        self.store = store
        self.roots = {name: Path(path) for name, path in roots.items()}
        self.state_dir = Path(state_dir)
        self.blobs = self.state_dir / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.intents = Intents(self.state_dir)
        self._verified: set[str] = set()
        self.watchers: list[Callable[[], None]] = []

    def watch(self, before_change: Callable[[], None]) -> None:
        """Call `before_change` before any byte of a target root may change: images shown or restored, and
        pre-images recorded (an apply step writes right after). A live server of the state on disk is
        stopped there, so that no server ever outlives the state it serves."""
        self.watchers.append(before_change)

    def _changing(self) -> None:
        for before_change in self.watchers:
            before_change()

    def path(self, row: dict) -> Path:
        """Where a files row's path is on disk; OutsideRoot where the row leads out of its root (an absolute path
        or a `..`: a damaged or tampered history)."""
        root = self.roots[row["root"]]
        path = root / row["path"]
        if not images.inside(root, path):
            raise OutsideRoot([f"the recorded path {row['path']!r} of root {row['root']!r} leads outside the target "
                               f"root {root}"])
        return path

    def check_paths(self, items: list[tuple[Path, str | None, int | None]]) -> None:
        """OutsideRoot naming each path of `items` that is not inside a root, or lies beyond a folder that is a
        symlink and stays one once `items` are in place."""
        after = {path: image for path, image, _ in items}
        problems = []
        for path in after:
            root = self._root_of(path)
            if root is None:
                problems.append(f"{path} is not inside a target root ({', '.join(map(str, self.roots.values()))})")
            elif (link := images.link_on_the_way(root, path, after)) is not None:
                problems.append(_beyond(path, link))
        if problems:
            raise OutsideRoot(problems)

    def _root_of(self, path: Path) -> Path | None:
        """The innermost root `path` is inside of."""
        return max((r for r in self.roots.values() if images.inside(r, path)), key=lambda r: len(r.parts), default=None)

    # blobs
    def put_file(self, path: Path) -> str:
        """Store a file's bytes as a blob named by their hash; the name is that of the bytes copied, hashed as
        they are written, so a blob always hashes to its name."""
        digest = sha256_file(path)
        blob = self.blobs / digest
        if not blob.exists():
            tmp = self.blobs / f".{digest}{TMP_SUFFIX}"
            copied = hashlib.sha256()
            try:
                with open(path, "rb") as src, open(tmp, "wb") as dst:
                    while chunk := src.read(CHUNK):
                        copied.update(chunk)
                        dst.write(chunk)
                    dst.flush()
                    os.fsync(dst.fileno())
            except OSError as e:
                tmp.unlink(missing_ok=True)
                if e.filename is None:  # a failed write names no file: name the blob being written
                    e.filename = str(tmp)
                raise
            digest = copied.hexdigest()  # the file changed after it was hashed: these are the bytes kept
            blob = self.blobs / digest
            os.replace(tmp, blob)
            _fsync_dir(self.blobs)
            self._verified.add(digest)
        return digest

    def put_bytes(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        blob = self.blobs / digest
        if not blob.exists():
            write_atomic(blob, data, durable=True)
            _fsync_dir(self.blobs)
            self._verified.add(digest)
        return digest

    def blob(self, digest: str, what: str = "a recorded image") -> bytes:
        why = self.blob_problem(digest)
        if why:
            raise BlobError([(self.blobs / digest, what, why)])
        return (self.blobs / digest).read_bytes()

    def blob_problem(self, digest: str) -> str | None:
        """Why the blob cannot be trusted (missing, or its bytes hash to another name), None when it can; a
        blob checked once is not hashed again by this process."""
        if digest in self._verified:
            return None
        try:
            actual = sha256_file(self.blobs / digest)
        except FileNotFoundError:
            return "missing"
        except OSError as e:
            return f"unreadable ({e.strerror or e})"
        if actual != digest:
            return f"damaged (its bytes hash to {actual})"
        self._verified.add(digest)
        return None

    def check_blobs(self, needed: list[tuple[str, Path]]) -> None:
        """BlobError naming every blob of (digest, path it restores) that cannot be trusted."""
        problems = [(self.blobs / d, f"the image of {p}", why) for d, p in needed if (why := self.blob_problem(d))]
        if problems:
            raise BlobError(problems)

    def keep(self, path: Path) -> Image:
        """The image at `path`, a file's bytes stored as a blob first."""
        st = os.lstat(path) if os.path.lexists(path) else None
        if st is not None and stat.S_ISREG(st.st_mode):
            return self.put_file(path), stat.S_IMODE(st.st_mode)
        return images.read(path, st)

    def current(self, row: dict) -> Image:
        """What a row's path holds now."""
        try:
            return images.read(self.path(row))
        except (TouchError, OSError) as e:
            return f"unreadable: {e}", None

    # recording, before a step touches anything
    def track_writes(self, step_id: int, writes: list[tuple[str, Path, str, bytes | None, bytes]]) -> None:
        """Before declarative steps write (root name, root, path, bytes there now, bytes to write): record in one go
        each path's pre-image, the folders to be created, and the bytes to write with those they are written over,
        both as blobs. Recovery then knows a path holding either, or a mix of the two that a write cut short
        leaves, for the step's own doing."""
        self._changing()
        known = {(r["root"], r["path"]) for r in self.store.file_rows(step_id)}
        rows: list[dict] = []
        evidence: list[dict] = []
        for root_name, root, rel, old, new in writes:
            missing = self._missing_folders(root, rel)
            evidence += [{"root": root_name, "path": str(d), "writes": images.DIR} for d in missing]
            if (root_name, rel) not in known:
                rows += self._pre_rows(step_id, root_name, root, rel, missing, known)
            evidence.append({"root": root_name, "path": rel, "writes": self.put_bytes(new),
                             "over": None if old is None else self.put_bytes(old)})
        self.record(step_id, rows, evidence)

    def track_images(self, step_id: int, paths: list[tuple[str, str, str | None, int | None]]) -> None:
        """Record what (root name, path) pairs hold now, whatever they are, and the image and mode each is about to
        be switched to (a rollback of a kept plugin)."""
        known = {(r["root"], r["path"]) for r in self.store.file_rows(step_id)}
        rows = []
        for root_name, rel, image, mode in paths:
            if (root_name, rel) not in known:
                known.add((root_name, rel))
                before, before_mode = self.keep(self.path({"root": root_name, "path": rel}))
                rows.append(dict(step_id=step_id, root=root_name, path=rel, before=before, before_mode=before_mode,
                                 after=image, after_mode=mode, sealed=1))
        self.record(step_id, rows)

    def record(self, step_id: int, rows: list[dict], evidence: list[dict] = ()) -> None:
        """Add path rows of a step: announced in the intent log first, with `evidence` (images about to be
        written), then committed to the database."""
        if not rows and not evidence:
            return
        identity = self.identity(step_id)
        self.intents.add([{**identity, **{k: r.get(k) for k in ROW_KEYS}} for r in rows] +
                         [{**identity, **e} for e in evidence])
        if rows:
            self.store.add_files(rows)

    def identity(self, step_id: int) -> dict:
        """What names a step in the intent log: its id, its run and its plugin (ids are reused by a history that
        lost its last commits)."""
        step = self.store.step(step_id)
        return {"step": step_id, "run": step["run_id"], "plugin": step["plugin"]}

    @staticmethod
    def _missing_folders(root: Path, rel: str) -> list[Path]:
        """The folders above `rel` that do not exist yet, shallowest first (TouchError: a file is in the way)."""
        missing = []
        parent = Path(rel).parent
        while str(parent) not in ("", "."):
            if os.path.lexists(root / parent):
                if not (root / parent).is_dir():
                    raise TouchError(f"{rel}: {parent} is a file, not a folder")
                break
            missing.append(parent)
            parent = parent.parent
        return missing[::-1]

    def _pre_rows(self, step_id: int, root_name: str, root: Path, rel: str, missing: list[Path],
                  known: set) -> list[dict]:
        """Rows for a file a declarative step will write, and for the folders it needs created."""
        full = root / rel
        if full.is_symlink():
            raise TouchError(f"{rel}: refusing to change a symlink")
        if (link := images.link_on_the_way(root, full)) is not None:
            raise TouchError(f"{rel}: {link.relative_to(root)} is a symlink; steps change paths inside real folders "
                             "only")
        if full.is_dir():
            raise TouchError(f"{rel}: is a folder, not a file")
        if os.path.lexists(full) and not full.is_file():
            raise TouchError(f"{rel}: is not a regular file")
        rows = []
        for d in missing:
            if (root_name, str(d)) not in known:
                known.add((root_name, str(d)))
                rows.append(dict(step_id=step_id, root=root_name, path=str(d), before=None, before_mode=None))
        tree = self._tree_over(step_id, root)
        if tree is not None:  # an earlier command step of this step already recorded the true pre-image
            before, mode = tree.get(rel, (None, None))
        else:
            before, mode = self.keep(full) if full.exists() else (None, None)
        known.add((root_name, rel))
        rows.append(dict(step_id=step_id, root=root_name, path=rel, before=before, before_mode=mode))
        return rows

    def _tree_over(self, step_id: int, root: Path) -> dict | None:
        """The snapshot entries of the step's tree of this folder (under any of its root names), if it has one."""
        for tree in self.store.tree_rows(step_id):
            if self.roots.get(tree["root"]) == root:
                return self.entries(tree)
        return None

    def entries(self, tree: dict) -> dict[str, list]:
        return images.manifest_entries(json.loads(self.blob(tree["manifest"], "the snapshot of a whole root")))

    def track_tree(self, step_id: int, root_name: str, root: Path) -> str:
        """Record a whole root before a command or hook that may change anything in it: each path's image and when
        it last changed (its ctime, for the keeper of the step's process to compare). Returns the snapshot's blob."""
        self._changing()
        for tree in self.store.tree_rows(step_id):
            if tree["root"] == root_name:
                return tree["manifest"]
        entries, ctimes = {}, {}
        for rel, path, st in images.walk(root):
            entries[rel] = list(self.keep(path) if stat.S_ISREG(st.st_mode) else images.read(path, st))
            ctimes[rel] = st.st_ctime_ns
        digest = self.put_bytes(json.dumps({"entries": entries, "ctimes": ctimes}, sort_keys=True).encode())
        self.intents.add([{**self.identity(step_id), "root": root_name, "tree": digest}])
        self.store.add_tree(step_id, root_name, digest)
        return digest

    def seal(self, step_id: int) -> None:
        """After apply: fold what command steps changed into per-path rows and record every post-image. A symlink
        a command created or changed that leads outside its root is a TouchError (the step fails)."""
        recorded = {self.path(r) for r in self.store.file_rows(step_id)}
        new_rows = []
        for tree in self.store.tree_rows(step_id):
            root = self.roots[tree["root"]]
            pre = self.entries(tree)
            now = {rel: images.read(path, st) for rel, path, st in images.walk(root)}
            for rel in sorted(set(pre) | set(now)):
                before, after = tuple(pre.get(rel, (None, None))), now.get(rel, (None, None))
                if images.same(before, after) or root / rel in recorded:
                    continue
                if after[0] is not None and after[0].startswith(LINK) and images.escapes(root, rel):
                    raise TouchError(f"{rel}: a symlink to {images.link_target(after[0])!r}, which leads outside "
                                     f"the target root {root}")
                try:
                    rel.encode("utf-8")
                except UnicodeEncodeError:
                    raise TouchError(f"{rel.encode('utf-8', 'surrogateescape')!r}: a file name that is not UTF-8 "
                                     "text, which the history cannot record") from None
                recorded.add(root / rel)
                new_rows.append(dict(step_id=step_id, root=tree["root"], path=rel, before=before[0],
                                     before_mode=before[1]))
        with self.store.transaction():
            self.store.add_files(new_rows)
            for r in self.store.file_rows(step_id):
                after, mode = self.keep(self.path(r))
                self.store.set_file(r["id"], after=after, after_mode=mode, sealed=1)

    def collect(self) -> tuple[int, int]:
        """Delete the blobs nothing needs any more; (blobs removed, bytes freed). Needed are the images of kept
        plugins (to roll them back and to measure without them), those of unfinished steps and of the intent log
        (to recover), with the snapshots they name. Call only while holding the state lock."""
        needed: set[str] = set()
        manifests: set[str] = set()
        unfinished = [s["id"] for s in self.store.open_steps()]
        for step_id in [r["step_id"] for r in self.store.deployed().values()] + unfinished:
            for r in self.store.file_rows(step_id):
                needed.update(i for i in (r["before"], r["after"]) if images.is_blob(i))
        for step_id in unfinished:  # a kept step's rows say all it changed; its snapshot is history
            manifests.update(t["manifest"] for t in self.store.tree_rows(step_id))
        for record in self.intents.read():
            needed.update(i for i in (record.get(k) for k in ("before", "after", "writes", "over"))
                          if isinstance(i, str) and images.is_blob(i))
            if isinstance(record.get("tree"), str):
                manifests.add(record["tree"])
        for manifest in manifests:
            needed.add(manifest)
            if not self.blob_problem(manifest):
                needed.update(image for image, _ in self.entries({"manifest": manifest}).values() if images.is_blob(image))
        removed = freed = 0
        for blob in self.blobs.iterdir():
            leftover = blob.name.startswith(".") and blob.name.endswith(TMP_SUFFIX)  # of a write that died
            if blob.name in needed or not (leftover or _is_digest(blob.name)):
                continue
            freed += blob.lstat().st_size
            blob.unlink()
            removed += 1
        return removed, freed

    def settle(self) -> None:
        """With no step open and the write-ahead log copied into the database file, the history is whole where
        damage to that log cannot reach it: the intent log is emptied."""
        if not self.store.open_steps() and self.store.checkpoint():
            self.intents.clear()

    # putting images on disk
    def put(self, items: list[tuple[Path, str | None, int | None]]) -> None:
        """Make each path hold its (image, mode), each file whole or not at all (a new file renamed into place);
        blobs are checked before anything is written."""
        self._changing()
        self._apply(items, atomic=True)

    def show(self, step_id: int, image: str) -> None:
        """Put the step's pre- or post-images on disk; the step row says which, before any byte moves."""
        self._changing()
        self.store.set_step(step_id, image=image)
        side = ("before", "before_mode") if image == "pre" else ("after", "after_mode")
        self._apply([(self.path(r), r[side[0]], r[side[1]]) for r in self.store.file_rows(step_id)])

    def _apply(self, items: list[tuple[Path, str | None, int | None]], atomic: bool = False) -> None:
        """Make each path hold its image: what is in the way goes first (deepest first), then folders, symlinks
        and files are put in place (shallowest first), then folder modes are set (a read-only folder last).
        Files are rewritten in place, or with `atomic` through a new file renamed into place. Every blob to be
        written is checked first (BlobError, nothing changed)."""
        self.check_paths(items)
        beyond = {path for path, _, _ in items if self.link_on_the_way(path)}  # of a link replaced here
        self.check_blobs([(image, path) for path, image, _ in items if images.is_blob(image)])
        for path, image, _ in sorted(items, key=_depth, reverse=True):
            if path in beyond:
                continue  # not in the target: the link is removed, never followed
            try:
                st = os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if image is None or _kind_on_disk(st) != _kind(image):
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(path)  # what is left inside is not recorded: a probe's cache, say
                else:
                    path.unlink()
        for path, image, mode in sorted(items, key=_depth):
            if image is not None:
                if (link := self.link_on_the_way(path)) is not None:  # made a link since it was checked
                    raise OutsideRoot([_beyond(path, link)], partly=True)
                self._place(path, image, mode, atomic)
        for path, image, mode in sorted(items, key=_depth, reverse=True):
            if image == DIR and mode is not None and stat.S_IMODE(os.lstat(path).st_mode) != stat.S_IMODE(mode):
                os.chmod(path, stat.S_IMODE(mode))

    def link_on_the_way(self, path: Path) -> Path | None:
        return images.link_on_the_way(self._root_of(path), path)

    def _place(self, path: Path, image: str, mode: int | None, atomic: bool) -> None:
        if image == DIR:
            path.mkdir(parents=True, exist_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if image.startswith(LINK):
            target = images.link_target(image)
            if path.is_symlink() and os.readlink(path) == target:
                return
            forget_bytecode(path)  # a module that is a link: Python checks the file it leads to
            if os.path.lexists(path):
                path.unlink()
            os.symlink(target, path)
            return
        tmp = path.with_name(f".{path.name}{TMP_SUFFIX}")
        if tmp.is_file() and not tmp.is_symlink():
            tmp.unlink()
        (write_atomic if atomic else write_image)(path, self.blob(image), mode)
