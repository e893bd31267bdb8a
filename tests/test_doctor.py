"""``kalos doctor`` on this machine (no GPU), the GPU diagnosis with made-up probe results, and
the latency plot of ``kalos bench --plot``.

The doctor runs as a real process: healthy (exit 0) on a fresh home, with a sidecar and a
store it reports on; unhealthy (exit 1, problems listed) for a world-readable store, a runtime
directory of the wrong mode, and a fake ``nvidia-smi`` that sees a GPU beside this CPU-only
torch, the "nvidia-smi works but CUDA is unavailable" trap.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import DEADLINE_S, short_tempdir

from kalos.tools.doctor import NOTE, OK, PROBLEM, SmiInfo, TorchInfo, diagnose_gpu


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kalos", "doctor", *map(str, args)], capture_output=True,
                          text=True, timeout=DEADLINE_S * 3, env=env)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KALOS_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_doctor_on_this_machine_is_healthy(runtime_dir, home):
    out = doctor("--name", "nobody-here")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "no problems found" in text
    assert "/dev/shm is writable" in text
    assert f"{runtime_dir} is yours, mode 0700" in text
    assert "no store at" in text and "no sidecar named 'nobody-here' is running" in text
    assert "native scores for passes of 2-64 queries" in text  # (this install built kalos.engine._dots)
    if not Path("/dev/nvidia0").exists():
        assert "no NVIDIA GPU visible" in text and "runs on the CPU" in text


def test_the_command_doctor_suggests_starts_a_sidecar_on_a_fresh_store(runtime_dir, home):
    import shlex

    from kalos import Client, SidecarUnavailable

    name = f"doc-fresh-{os.getpid()}"
    report = json.loads(doctor("--name", name, "--json").stdout)
    [finding] = [f for f in report["findings"] if f["area"] == "sidecar"]
    assert finding["fix"].startswith("start one: kalos serve"), finding
    words = shlex.split(finding["fix"].removeprefix("start one: "))
    proc = subprocess.Popen([sys.executable, "-m", *words], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        def serving() -> bool:
            assert proc.poll() is None, f"{finding['fix']!r} failed: {proc.stderr.read()}"
            try:
                with Client(name, timeout=DEADLINE_S) as client:
                    return client.dim == 384
            except SidecarUnavailable:
                return False

        from conftest import wait_until

        wait_until(serving, f"the sidecar started by {finding['fix']!r}")
        assert (home / "memories.db").exists()
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    # The store now exists: the suggestion no longer passes --dim (it would be checked, not needed).
    report = json.loads(doctor("--name", name, "--json").stdout)
    [finding] = [f for f in report["findings"] if f["area"] == "sidecar"]
    assert finding["fix"] == f"start one: kalos serve --name {name}"


def test_serve_on_a_fresh_store_names_the_dim_flag(runtime_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "kalos", "serve", "--store", str(tmp_path / "new.db"), "--name",
                          f"doc-nodim-{os.getpid()}"], capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "pass --dim 384 to create it" in out.stderr and "--dim D" in out.stderr, out.stderr
    assert not (tmp_path / "new.db").exists()


def test_doctor_reports_the_store_and_the_sidecar(sidecars, home):
    store = home / "memories.db"
    sidecars.start(store, name="doc-sc", dim=16)
    from kalos import Client

    with Client("doc-sc", timeout=DEADLINE_S) as c:
        c.add(np.eye(16, dtype=np.float32)[:3], namespace="notes")
    out = doctor("--name", "doc-sc", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["healthy"] is True
    by_area = {}
    for f in report["findings"]:
        by_area.setdefault(f["area"], []).append(f)
    [store_finding] = by_area["store"]
    assert store_finding["status"] == OK and "integrity ok, 3 memories of dim 16" in store_finding["message"]
    assert "notes 3" in store_finding["message"]
    assert by_area["sidecar"][0]["status"] == OK and "serves 3 memories (dim 16)" in by_area["sidecar"][0]["message"]
    assert any("not 384" in f["message"] for f in by_area["text API"])


def test_a_world_readable_store_is_a_problem(sidecars, home):
    store = home / "memories.db"
    proc = sidecars.start(store, name="doc-perm", dim=4)
    proc.stop()
    os.chmod(store, 0o644)
    out = doctor("--name", "doc-perm")
    assert out.returncode == 1
    assert "other users can read the memories" in out.stdout and "chmod 600" in out.stdout
    assert "1 problem(s) found" in out.stdout


def test_a_foreign_file_as_store_is_a_problem(runtime_dir, home):
    home.mkdir(mode=0o700)
    bogus = home / "memories.db"
    bogus.write_bytes(b"not a database at all" * 10)
    os.chmod(bogus, 0o600)
    out = doctor()
    assert out.returncode == 1
    assert "cannot open" in out.stdout


def test_a_runtime_dir_of_the_wrong_mode_is_a_problem(home, monkeypatch):
    path = short_tempdir("kd")
    try:
        os.chmod(path, 0o755)
        monkeypatch.setenv("KALOS_RUNTIME_DIR", path)
        out = doctor()
        assert out.returncode == 1
        assert "mode 0700" in out.stdout and "runtime dir" in out.stdout
    finally:
        os.rmdir(path)


def test_nvidia_smi_works_but_torch_is_cpu_only(runtime_dir, home, tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.version.cuda:
        pytest.skip("this torch is a CUDA build: the trap needs a CPU-only one")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  --query-gpu*) echo "NVIDIA H200, 550.54.15, 143771 MiB" ;;\n'
        '  *) echo "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4 |" ;;\n'
        "esac\n"
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = doctor(env=env)
    assert out.returncode == 1, out.stdout
    assert "1 NVIDIA GPU(s): NVIDIA H200 (143771 MiB); driver 550.54.15, which supports CUDA up to 12.4" in out.stdout
    assert "nvidia-smi works but CUDA is unavailable" in out.stdout and "CPU-only build" in out.stdout
    assert "CUDA 12.4 or older" in out.stdout


# -- the diagnosis itself, with made-up probe results -------------------------------------------

H200 = SmiInfo(["NVIDIA H200 (143771 MiB)"], "535.104.05", "12.2")


def statuses(findings):
    return [(f.area, f.status) for f in findings]


def test_driver_older_than_torchs_cuda_runtime():
    torch = TorchInfo("2.13.0+cu126", "12.6", cuda_available=False)
    findings = diagnose_gpu(H200, torch, env={})
    assert statuses(findings) == [("GPU", OK), ("CUDA", PROBLEM)]
    assert "supports CUDA up to 12.2" in findings[1].message and "built for CUDA 12.6" in findings[1].message
    assert "update the NVIDIA driver" in findings[1].fix


def test_devices_hidden_by_cuda_visible_devices():
    torch = TorchInfo("2.13.0+cu121", "12.1", cuda_available=False)
    findings = diagnose_gpu(H200, torch, env={"CUDA_VISIBLE_DEVICES": ""})
    assert findings[-1].status == PROBLEM and "CUDA_VISIBLE_DEVICES" in findings[-1].message


def test_versions_fine_but_cuda_unavailable_names_the_init_error():
    torch = TorchInfo("2.13.0+cu121", "12.1", cuda_available=False, init_error="RuntimeError: no CUDA-capable device")
    findings = diagnose_gpu(H200, torch, env={})
    assert findings[-1].status == PROBLEM and "no CUDA-capable device" in findings[-1].message


def test_a_working_gpu():
    torch = TorchInfo("2.13.0+cu121", "12.1", cuda_available=True, device_count=1, devices=["NVIDIA H200"],
                      triton="3.6.0")
    findings = diagnose_gpu(H200, torch, env={})
    assert statuses(findings) == [("GPU", OK), ("PyTorch", OK)]
    assert "--device auto` uses cuda" in findings[1].message


def test_no_gpu_and_no_torch_is_fine():
    findings = diagnose_gpu(None, None, env={}, nvidia_devices=False)
    assert [f.status for f in findings] == [OK] and "runs on the CPU" in findings[0].message


def test_a_gpu_without_torch_is_a_problem():
    findings = diagnose_gpu(H200, None, env={})
    assert findings[-1].status == PROBLEM and "kalos-recall[gpu]" in findings[-1].fix


def test_nvidia_smi_failing_is_a_problem():
    smi = SmiInfo([], None, None, error="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")
    findings = diagnose_gpu(smi, TorchInfo("2.13.0+cpu", None, cuda_available=False), env={})
    assert findings[0].status == PROBLEM and "couldn't communicate" in findings[0].message
    assert all(f.status in (OK, NOTE, PROBLEM) for f in findings)


# -- kalos bench --plot: the latency CDF picture ------------------------------------------------


def test_latency_cdf_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from kalos.tools.plot import Panel, Series, plot_latency_cdfs

    rng = np.random.default_rng(1)
    panels = [
        Panel("end to end", [Series("baseline", rng.lognormal(-9, 0.3, 500), baseline=True),
                             Series("sidecar", rng.lognormal(-8, 0.4, 500))]),
        Panel("channel", [Series("ping", rng.lognormal(-11, 0.2, 200), baseline=True),
                          Series("cold", rng.lognormal(-9, 0.5, 5))]),
    ]
    path = plot_latency_cdfs(panels, tmp_path / "cdf.png", title="test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_an_install_without_the_native_scores_is_told_what_it_costs(monkeypatch):
    from kalos.engine import numpy_engine
    from kalos.tools.doctor import NOTE, check_cpu_scores

    monkeypatch.setattr(numpy_engine, "_dots", None)
    finding = check_cpu_scores()
    assert finding.status == NOTE and "not built" in finding.message and "C compiler" in finding.fix


# -- the fixes suggested for a store that is not one ---------------------------------------------


def _store_and_sidecar(store) -> list:
    from kalos.tools.doctor import check_all

    findings = check_all("doc-none", store, smi=None, torch=None)
    return [f for f in findings if f.area in ("store", "sidecar")]


def _all_text(findings) -> str:
    return "\n".join(f"{f.message} {f.fix or ''}" for f in findings)


def test_a_directory_as_store_is_named_as_such_without_chmod_or_serve(runtime_dir, tmp_path):
    directory = tmp_path / "stores"
    directory.mkdir(mode=0o755)
    findings = _store_and_sidecar(directory)
    problems = [f for f in findings if f.status == PROBLEM]
    assert len(problems) == 1 and "is a directory" in problems[0].message, findings
    assert str(directory / "memories.db") in problems[0].fix
    text = _all_text(findings)
    assert "chmod" not in text and "kalos serve" not in text, text


def test_a_foreign_file_is_not_offered_chmod_or_serve(runtime_dir, tmp_path):
    bogus = tmp_path / "notes.txt"
    bogus.write_text("hello\n")
    os.chmod(bogus, 0o644)
    findings = _store_and_sidecar(bogus)
    problems = [f for f in findings if f.status == PROBLEM]
    assert len(problems) == 1 and "not a Kalos store" in problems[0].message, findings
    assert "--store NEW.db --dim 384" in problems[0].fix
    text = _all_text(findings)
    assert "chmod" not in text and f"--store {bogus}" not in text, text


def test_a_missing_store_still_gets_the_serve_command(runtime_dir, tmp_path):
    findings = _store_and_sidecar(tmp_path / "fresh.db")
    [sidecar] = [f for f in findings if f.area == "sidecar"]
    assert sidecar.fix is not None and "kalos serve" in sidecar.fix and "--dim 384" in sidecar.fix


def test_a_postgres_store_without_the_driver_names_the_install(monkeypatch):
    from kalos.store import postgres
    from kalos.tools.doctor import check_pg_store

    monkeypatch.setattr(postgres, "psycopg", None)
    [finding], dim = check_pg_store("postgresql://u:secret@db.example/mem")
    assert finding.status == PROBLEM and dim is None
    assert finding.fix == "pip install 'kalos-recall[postgres]'" and "secret" not in finding.message
