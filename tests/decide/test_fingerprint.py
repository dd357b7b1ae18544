import time

import pytest

from orchestrator import fingerprint as fp

SMI = """#!/bin/sh
if [ "$1" = "--query-gpu=name,driver_version" ]; then
  echo "NVIDIA H200, 580.159.04"
  echo "NVIDIA H200, 580.159.04"
  exit 0
fi
echo "| NVIDIA-SMI 580.159.04             Driver Version: 580.159.04     CUDA Version: 13.0     |"
"""


@pytest.fixture
def fresh():
    fp.fingerprint(refresh=True)
    yield
    fp.fingerprint(refresh=True)


def fake_smi(tmp_path, monkeypatch, body):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(body)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


def test_gpu_driver_and_cuda_from_nvidia_smi(tmp_path, monkeypatch, fresh):
    fake_smi(tmp_path, monkeypatch, SMI)
    governor = tmp_path / "governor"
    governor.write_text("performance\n")
    monkeypatch.setattr(fp, "GOVERNOR", governor)
    info = fp.fingerprint(refresh=True)
    assert (info["gpu"], info["gpu_count"], info["gpu_driver"], info["cuda"]) == ("NVIDIA H200", 2, "580.159.04", "13.0")
    assert info["cpu_governor"] == "performance"
    assert info["cpus"] >= 1
    assert info["torch"] is not None and info["torch"].startswith("2.")
    assert info["host"]


def test_without_a_gpu_or_governor(tmp_path, monkeypatch, fresh):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(fp, "GOVERNOR", tmp_path / "absent")
    info = fp.fingerprint(refresh=True)
    assert (info["gpu"], info["gpu_count"], info["gpu_driver"], info["cuda"], info["cpu_governor"]) == (None, 0, None, None, None)
    assert "vllm" in info  # recorded even when absent, so installing it later shows up as a change


def test_the_cpu_model_from_cpuinfo(tmp_path, monkeypatch, fresh):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC  9654 96-Core Processor\n\n"
                       "processor\t: 1\nmodel name\t: AMD EPYC  9654 96-Core Processor\n")
    monkeypatch.setattr(fp, "CPUINFO", cpuinfo)
    assert fp.fingerprint(refresh=True)["cpu"] == "AMD EPYC 9654 96-Core Processor"
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")  # arm64 names no model
    assert fp.fingerprint(refresh=True)["cpu"] is None
    monkeypatch.setattr(fp, "CPUINFO", tmp_path / "absent")
    assert fp.fingerprint(refresh=True)["cpu"] is None


def test_a_hanging_nvidia_smi_is_cut_off(tmp_path, monkeypatch, fresh):
    fake_smi(tmp_path, monkeypatch, "#!/bin/sh\nsleep 30\n")
    monkeypatch.setattr(fp, "NVIDIA_SMI_TIMEOUT", 0.5)
    start = time.monotonic()
    assert fp.fingerprint(refresh=True)["gpu"] is None
    assert time.monotonic() - start < 5


def test_fingerprint_is_cached_until_refreshed(tmp_path, monkeypatch, fresh):
    first = fp.fingerprint()
    first["host"] = "mutated"
    assert fp.fingerprint()["host"] != "mutated"


BASE = {"host": "a", "gpu": "NVIDIA H200", "gpu_count": 1, "gpu_driver": "570", "cuda": "12.8", "torch": "2.5.1",
        "triton": "3.1", "vllm": "0.8.0", "cpu_governor": None, "cpu": "AMD EPYC 9654 96-Core Processor", "cpus": 16,
        "python": "3.11.7"}


def test_identical_fingerprints_are_fresh():
    assert fp.differences(BASE, dict(BASE)) == {}
    assert not fp.is_stale(BASE, dict(BASE))
    assert fp.describe(BASE, dict(BASE)) == ""


@pytest.mark.parametrize("key, value", [("gpu", "NVIDIA A100"), ("gpu_driver", "575"), ("vllm", "0.9.0"),
                                        ("torch", "2.6.0"), ("host", "b"), ("cpu_governor", "powersave"),
                                        ("gpu_count", 2), ("cpu", "Intel(R) Xeon(R) Platinum 8480+"),
                                        ("cpus", 8)])
def test_a_change_that_moves_speed_is_stale(key, value):
    now = {**BASE, key: value}
    assert fp.is_stale(BASE, now)
    assert fp.differences(BASE, now) == {key: (BASE[key], value)}
    assert fp.describe(BASE, now) == f"{key} {BASE[key]} -> {value}"


def test_python_and_unknown_keys_do_not_make_stale():
    assert not fp.is_stale(BASE, {**BASE, "python": "3.12.0", "platform": "x"})
    older = {k: v for k, v in BASE.items() if k not in ("cpu_governor", "cpu", "cpus")}
    assert not fp.is_stale(older, {**BASE, "cpu_governor": "performance", "cpus": 4})


def test_no_recorded_fingerprint_is_stale():
    assert fp.is_stale(None, BASE)
    assert fp.is_stale(None)


def test_against_the_current_environment_by_default(fresh):
    assert not fp.is_stale(fp.fingerprint())
    assert fp.is_stale({**fp.fingerprint(), "torch": "0.0.1"})


def test_the_gpus_clocks_now_are_read_field_by_field(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, """#!/bin/sh
case "$1" in --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_event_reasons.active)
  echo "1980, 3201, 61, 512.34, 0x0000000000000000"
  echo "1755, 3201, 83, [N/A], 0x0000000000000040";;
esac
""")
    assert fp.gpu_now() == [
        {"sm_mhz": 1980.0, "memory_mhz": 3201.0, "temperature_c": 61.0, "power_w": 512.34,
         "clock_events": "0x0000000000000000"},
        {"sm_mhz": 1755.0, "memory_mhz": 3201.0, "temperature_c": 83.0, "power_w": None,
         "clock_events": "0x0000000000000040"}]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert fp.gpu_now() is None
