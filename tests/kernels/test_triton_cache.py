"""Triton's kernel cache travels without its intermediate forms and still hits: a real kernel compiled for an H100
or H200 (sm_90) by Triton's own ptxas, no GPU needed, packed, restored on a "fresh machine" (the same HOME after
its cache is gone) and compiled again, which must load it rather than compile."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from triton_cache import CACHE, INTERMEDIATE, pack, unpack  # noqa: E402

COMPILE = textwrap.dedent("""
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def add(x, y, out, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(out + i, tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)

    src = ASTSource(add, signature={"x": "*fp16", "y": "*fp16", "out": "*fp16", "n": "i32", "BLOCK": "constexpr"},
                    constexprs={"BLOCK": 128})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    print(kernel.asm["cubin"].hex())
""")


def compile_in(home: Path) -> bytes:
    script = home.parent / "compile_add.py"  # Triton reads a kernel's source from its file
    script.write_text(COMPILE)
    env = {**os.environ, "HOME": str(home), "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_CACHE_DIR", None)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return bytes.fromhex(done.stdout.strip())


def files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_a_packed_cache_without_intermediate_forms_still_hits(tmp_path):
    home = tmp_path / "home"
    cubin = compile_in(home)
    cache = home / CACHE
    raw = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    assert any(p.suffix == ".ptx" and p.stat().st_size for p in cache.rglob("*"))

    out = tmp_path / "triton-cache.tgz"
    total, size = pack(home, out, limit=2**20)
    assert total == raw and out.stat().st_size == size
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert all(name.startswith(".triton/cache/") for name in members)
        emptied = [m for name, m in members.items() if Path(name).suffix in INTERMEDIATE]
        assert emptied and all(m.size == 0 for m in emptied)
        binary = next(name for name in members if name.endswith(".cubin"))
        assert tar.extractfile(binary).read() == cubin

    # the next machine: the same HOME, no cache until the archive is unpacked
    subprocess.run(["rm", "-rf", str(home / ".triton")], check=True)
    assert unpack(out, home) == len(members)
    before = files(cache)
    assert compile_in(home) == cubin
    assert files(cache) == before  # loaded: nothing compiled, nothing rewritten, the emptied forms still empty


def test_an_archive_over_the_limit_is_not_written(tmp_path):
    home = tmp_path / "home"
    kernel = home / CACHE / "ABC"
    kernel.mkdir(parents=True)
    (kernel / "k.cubin").write_bytes(os.urandom(64 * 1024))
    (kernel / "k.ptx").write_text("// ptx\n" * 10_000)
    out = tmp_path / "triton-cache.tgz"
    total, size = pack(home, out, limit=32 * 1024)
    assert total == 64 * 1024 + 70_000 and size > 32 * 1024
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # nothing written, no partial left
    assert pack(tmp_path / "nowhere", out, limit=2**20) is None


def test_the_engine_reports_poll_brings_tritons_kernels_back(tmp_path):
    """benchmarks/gpu_report.sh's last poll: the report's log and JSON, and Triton's kernels beside them."""
    run, out, home = tmp_path / "run", tmp_path / "out", tmp_path / "home"
    run.mkdir()
    (run / "report.log").write_text("## Summary\nengine: 9,984 output tok/s\n")
    (run / "gpu_report.json").write_text("{}")
    kernel = home / CACHE / "ABC"
    kernel.mkdir(parents=True)
    (kernel / "k.cubin").write_bytes(b"\x7fELF" + os.urandom(1000))
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_report.sh"), "poll"], capture_output=True, text=True,
                          env={**os.environ, "RUN_DIR": str(run), "OUT": str(out), "HOME": str(home)}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "FINISHED" in done.stdout and "9,984" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["gpu_report.json", "report.log", "triton-engine.tgz"]
    with tarfile.open(out / "triton-engine.tgz") as tar:
        assert tar.extractfile(".triton/cache/ABC/k.cubin").read() == (kernel / "k.cubin").read_bytes()


def test_unpacking_merges_and_keeps_what_the_machine_has(tmp_path):
    """A kernel's files are named by its hash: the machine's own (here a whole PTX where the archive's is emptied)
    are kept, what it lacks is added."""
    home, other = tmp_path / "home", tmp_path / "other"
    for h in (home, other):
        (h / CACHE / "ABC").mkdir(parents=True)
        (h / CACHE / "ABC" / "k.cubin").write_bytes(b"cubin")
    (home / CACHE / "ABC" / "k.ptx").write_text("// PTX")
    (home / CACHE / "DEF").mkdir()
    (home / CACHE / "DEF" / "j.cubin").write_bytes(b"another")
    out = tmp_path / "a.tgz"
    pack(home, out, limit=2**20)
    (other / CACHE / "ABC" / "k.ptx").write_text("// compiled here")
    assert unpack(out, other) == 1
    assert (other / CACHE / "ABC" / "k.ptx").read_text() == "// compiled here"
    assert (other / CACHE / "DEF" / "j.cubin").read_bytes() == b"another"


def test_an_archive_reaching_outside_the_cache_is_refused_whole(tmp_path):
    archive = tmp_path / "bad.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in (".triton/cache/ABC/k.cubin", ".bashrc"):
            info = tarfile.TarInfo(name)
            info.size = 4
            tar.addfile(info, io.BytesIO(b"data"))
    home = tmp_path / "home"
    home.mkdir()
    with pytest.raises(ValueError, match=r"bad\.tgz: \.bashrc is not inside \.triton/cache"):
        unpack(archive, home)
    assert list(home.iterdir()) == []  # nothing written
