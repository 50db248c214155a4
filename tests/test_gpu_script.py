"""bench/gpu.sh, the prepared CUDA check (issue #27 point 6), checked on its CPU half: the
argument handling, and one world-1 parity case and the step table on gloo, with the files it
writes. The CUDA half runs the same code with FZ3_DEVICE=cuda on a lent GPU."""
from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu.sh"


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "HOME": "/tmp"})


def test_usage_errors_name_the_argument_and_exit_2():
    r = run("--bogus")
    assert r.returncode == 2 and "unknown argument '--bogus'" in r.stderr and "--cpu" in r.stderr
    assert "--compiled" in r.stderr
    r = run("--out")
    assert r.returncode == 2 and "--out needs a folder" in r.stderr
    r = run("--help")
    assert r.returncode == 0 and "--quick" in r.stdout and "parity" in r.stdout and "--compiled" in r.stdout


def test_the_cpu_half_writes_its_files(tmp_path):
    r = run("--cpu", "--quick", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == {"env.txt", "parity.txt", "parity.xml", "steps.json",
                                                    "steps.log", "steps.md", "trace-deep-fz3-sharded.json",
                                                    "trace-deep-fz3-fused.json", "trace-deep-fsdp2.json"}
    assert "fz3 picks cpu backend gloo" in (tmp_path / "env.txt").read_text()
    suite = ET.parse(tmp_path / "parity.xml").getroot().find("testsuite")
    assert (int(suite.get("tests")), int(suite.get("failures")), int(suite.get("errors"))) == (1, 0, 0)
    rows = json.loads((tmp_path / "steps.json").read_text())
    assert {r["system"] for r in rows} == {"fz3", "fz3-sharded", "fz3-fused", "fz3-offload", "ddp", "fsdp2"} \
        and {r["model"] for r in rows} == {"deep"}
    assert all(r["median_ms"] > 0 and r["peak_mib"] > 0 and r["launches"] > 0 and r["syncs"] >= 1 for r in rows)
    traced = {r["system"]: r["overlap"] for r in rows if r["overlap"] is not None}
    assert set(traced) == {"fz3-sharded", "fz3-fused", "fsdp2"}, traced
    for system in ("fz3-sharded", "fz3-fused"):  # (FSDP2 at world 1 on gloo runs no collective)
        assert traced[system]["comm_events"] > 0 and 0 <= traced[system]["hidden_fraction"] <= 1, traced
    syncs = {r["system"]: r["syncs"] for r in rows}  # the harness's loss.item() is one of each
    assert (syncs["fz3-fused"], syncs["fz3-sharded"], syncs["ddp"]) == (1, 2, 1), syncs  # the verdict on the device
    assert len({round(r["last_loss"], 5) for r in rows}) == 1  # one rank, same data: same training
    assert "| deep | fz3 |" in (tmp_path / "steps.md").read_text()


def test_the_step_table_refuses_an_unknown_system():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_steps.py"), "--device", "cpu", "--systems", "fz3,dpp"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "['dpp'] not among ['ddp', 'ddp-compiled', 'fsdp2', 'fsdp2-compiled', 'fz3', 'fz3-compiled', 'fz3-fused', 'fz3-offload', 'fz3-sharded']" in r.stderr
