"""tools/gpu_check.py, the parts that run without a GPU: the import path it makes when pdchat is
not installed, its report, and its refusal on a machine with no GPU."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import gpu_check  # noqa: E402


def test_linked_package_imports_pdchat_where_it_is_not_installed(tmp_path) -> None:
    bare = shutil.which("python3", path="/usr/bin:/bin")
    probe = subprocess.run([bare, "-c", "import pdchat"], capture_output=True) if bare else None
    if probe is None or probe.returncode == 0:
        pytest.skip("no system python3 without pdchat installed to try the links with")
    shim = gpu_check.linked_package()
    # settings.py imports nothing outside the standard library, so a bare python3 can load it
    code = "import pdchat.engine.settings as s, pdchat.themes.palette; print(s.DEFAULT_MODEL)"
    got = subprocess.run([bare, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(shim)))
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "smollm2-135m"
    assert sorted(p.name for p in (shim / "pdchat").iterdir()) == sorted(gpu_check.PACKAGES)


def test_report_renders_the_bench_rows_and_the_figures() -> None:
    report = {"environment": {"gpu": "NVIDIA H200", "driver": "580.1"},
              "stages": {"bench_gpu": {"suite": "gpu", "decode": {"rows": [
                  {"model": "random:llama-1b", "decode_tok_s": 1234.5, "roofline": 0.71}]},
                  "goals": {"1b_roofline": 0.71, "1b_roofline_met": True}, "seconds": 80.0},
                  "tests": {"tests": 70, "failures": 1, "failed": ["a::b"], "seconds": 50.0},
                  "lab": {"error": "timed out after 240 s", "seconds": 240.0}}}
    md = gpu_check.markdown(report)
    assert "- gpu: NVIDIA H200" in md and "- driver: 580.1" in md
    assert "| model | decode_tok_s | roofline |" in md and "| random:llama-1b | 1,234.5 | 0.710 |" in md
    assert "**goals**: 1b_roofline 0.710, 1b_roofline_met True" in md
    assert "- failures: 1" in md and "- error: timed out after 240 s" in md
    assert md.index("## bench_gpu") < md.index("## tests") < md.index("## lab")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_says_so_and_checks_nothing(tmp_path) -> None:
    got = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 2
    assert "no CUDA GPU" in got.stderr
    assert not (tmp_path / "report.json").exists()


def test_an_unknown_stage_is_a_usage_error(tmp_path) -> None:
    got = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--out", str(tmp_path),
                          "--stages", "bench_gpu,benchmark"], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2
    assert "unknown stage(s) benchmark" in got.stderr and "bench_gpu, tests, toggles, spec, lab" in got.stderr
