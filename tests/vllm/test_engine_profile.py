"""benchmarks/vllm_h200/profile.py: a py-spy recording of vLLM's engine core as shares of its serving samples, and
`record` finding the newest process titled as the engine core (a real process, renamed as vLLM names it)."""
from __future__ import annotations

import gzip
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "benchmarks" / "vllm_h200" / "profile.py"

BOOT = "run_engine_core (core.py:1743);run_busy_loop (core.py:1802)"
STEP = BOOT + ";_process_engine_step (core.py:1860)"
RAW = "\n".join([
    f"{STEP};execute_model (gpu_model_runner.py:2164);forward (model.py:586);gdn (gdn.py:1387) 30",
    f"{STEP};execute_model (gpu_model_runner.py:2164);forward (model.py:586);moe (moe.py:273) 35",
    f"{STEP};schedule (scheduler.py:930) 15",
    f"{STEP};execute_model (gpu_model_runner.py:2164);synchronize (streams.py:254) 20",
    f"{BOOT};sleep (core.py:1127);cudaHostRegister (cuda_wrapper.py:226) 400",  # not serving: left out
    " 5",  # a sample without frames (py-spy writes one where it could not read the stack)
]) + "\n"


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROFILE), *args], capture_output=True, text=True, timeout=60, **kw)


def shares(stdout: str) -> dict[str, float]:
    inclusive = stdout.split("inclusive share:\n")[1].split("self share:")[0]
    return {line.split("%", 1)[1].strip(): float(line.split("%")[0]) for line in inclusive.splitlines()}


def test_the_serving_samples_are_summarised_and_the_rest_left_out(tmp_path):
    raw = tmp_path / "enginecore.txt.gz"
    raw.write_bytes(gzip.compress(RAW.encode()))
    done = run("summary", str(raw))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("100 samples hold '_process_engine_step' (505 in all)")
    got = shares(done.stdout)
    assert got["execute_model (gpu_model_runner.py:2164)"] == 85.0
    assert got["forward (model.py:586)"] == 65.0
    assert got["schedule (scheduler.py:930)"] == 15.0
    assert not any("run_busy_loop" in f or "cudaHostRegister" in f for f in got)  # in every sample, or not serving
    assert done.stdout.split("self share:\n")[1].splitlines()[0] == " 35.0%  moe (moe.py:273)"
    # another frame to keep samples by: the sleeping ones
    asleep = run("summary", str(raw), "--within", "sleep (core.py:1127)")
    assert shares(asleep.stdout) == {}  # every frame is in every sleeping sample


def test_a_bad_recording_names_its_file_and_line(tmp_path):
    raw = tmp_path / "enginecore.txt"
    raw.write_text(RAW + "not a stack\n")
    done = run("summary", str(raw))
    assert done.returncode == 2
    assert f"{raw}: line 7 is not" in done.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text(f"{BOOT};idle 10\n")
    assert "no sample holds a frame '_process_engine_step' (10 samples in all)" in run("summary", str(empty)).stdout


def test_record_samples_the_serving_engine_core_and_brings_it_back_packed(tmp_path):
    """A stand-in py-spy writes the recording py-spy would; the engine cores are real processes named as vLLM
    names them (prctl PR_SET_NAME): one busy, as a serving one is, started before one idle, as a sleeping one is,
    and the busy one is sampled."""
    py_spy = tmp_path / "py-spy"
    py_spy.write_text("#!/bin/sh\n# record --pid PID ... --output FILE\n"
                      'echo "$@" > "$(dirname "$0")/args"\n'
                      'for last; do :; done\n'
                      f"printf '%s\\n' '{STEP};schedule (scheduler.py:930) 7' > \"$last\"\n")
    py_spy.chmod(0o755)
    title = ("import ctypes, sys, time; ctypes.CDLL(None).prctl(15, b'VLLM::EngineCore', 0, 0, 0); "
             "open(sys.argv[1], 'w').close(); end = time.time() + 60\n"
             "while time.time() < end: sys.argv[2] == 'busy' or time.sleep(60)")
    cores = []
    try:
        for name in ("busy", "idle"):
            ready = tmp_path / name
            cores.append(subprocess.Popen([sys.executable, "-c", title, str(ready), name]))
            while not ready.exists():
                time.sleep(0.05)
        out = tmp_path / "out"
        done = run("record", str(out), "--seconds", "3", "--py-spy", str(py_spy))
        assert done.returncode == 0, done.stderr
        args = (tmp_path / "args").read_text().split()
        assert args[args.index("--pid") + 1] == str(cores[0].pid)  # the busy one, the older
        assert args[args.index("--duration") + 1] == "3"
        assert sorted(p.name for p in out.iterdir()) == ["enginecore-profile.txt.gz"]
        assert gzip.decompress((out / "enginecore-profile.txt.gz").read_bytes()).decode().endswith(" 7\n")
        assert "7 samples hold '_process_engine_step'" in done.stdout
    finally:
        for core in cores:
            core.kill()
            core.wait()
    # no engine core running: said, nothing written
    gone = run("record", str(tmp_path / "out2"), "--py-spy", str(py_spy))
    assert gone.returncode != 0 and "no process titled 'VLLM::EngineCor'" in gone.stderr
    assert not (tmp_path / "out2").exists()
