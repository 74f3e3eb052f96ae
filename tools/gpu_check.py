"""`make gpu-check`: everything pdchat can check on a CUDA GPU, in one command, into one report.

For whoever has a GPU: it installs nothing and needs no network (torch, triton and transformers
must be there; the chat app's packages need not be: the engine and the benches import without
them). It runs, each stage in its own process with a time limit so one failure or hang costs
only its stage:
  1. `pdchat bench gpu`: bandwidth, decode per model shape (graphs on/off, Hugging Face), the
     roofline fraction, prefill vs decode, 256-request throughput;
  2. the GPU tests: the Triton kernels (bf16 cases included), decode graphs, the Triton path vs
     PyTorch's on real shapes, telemetry (tests/kernels/test_triton_*.py, tests/engine/test_cuda_graphs.py,
     tests/engine/test_decode_ahead.py, tests/gpu/);
  3. the toggles, spec and lab suites on the GPU (quick sizes).
and writes report.json (every figure) and report.md (the tables) with the device, driver and
versions. Exit status 1 when a test or a stage failed, 2 where there is no GPU.
Usage: python3 tools/gpu_check.py [--out DIR] [--budget-s S] [--quick] [--stages a,b]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "bench", "kernels", "themes", "chatapp")
GPU_TESTS = ["tests/kernels/test_triton_attention.py", "tests/kernels/test_triton_layers.py",
             "tests/kernels/test_triton_decode.py", "tests/engine/test_cuda_graphs.py",
             "tests/engine/test_decode_ahead.py", "tests/gpu"]
# (stage, seconds it may take at most): the bench first, since its figures are the goals
SUITE_MODEL = "random:smollm2-135m"
STAGES = (("bench_gpu", 300), ("tests", 180), ("toggles", 150), ("spec", 120), ("lab", 150))


def import_path() -> str:
    """A PYTHONPATH under which `import pdchat` works: the installed package if there is one,
    else links to this checkout's folders (pyproject maps pdchat.<folder> to <folder>/)."""
    probe = subprocess.run([sys.executable, "-c", "import pdchat.engine"], capture_output=True)
    return str(REPO) if probe.returncode == 0 else f"{linked_package()}{os.pathsep}{REPO}"


def linked_package() -> Path:
    """A temporary folder holding pdchat/ as links to this checkout's folders."""
    shim = Path(tempfile.mkdtemp(prefix="pdchat-path-"))
    (shim / "pdchat").mkdir()
    for name in PACKAGES:
        (shim / "pdchat" / name).symlink_to(REPO / name)
    return shim


def environment() -> dict[str, Any]:
    import importlib.metadata as md
    import torch
    env: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": sys.version.split()[0],
                           "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("triton", "transformers", "nvidia-ml-py"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            env[dist] = "not installed"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        env["driver"] = smi.stdout.strip() if smi.returncode == 0 else f"unknown ({smi.stderr.strip()})"
    except (OSError, subprocess.TimeoutExpired) as e:
        env["driver"] = f"unknown ({e})"
    return env


def run_stage(name: str, quick: bool, out: Path) -> None:
    """In a child process: one bench suite on the GPU, its result written to `out` as JSON."""
    from pdchat.bench import run_suite
    from pdchat.engine import EngineConfig

    def progress(what: str, fraction: float) -> None:
        print(f"  [{name}] {what} ({fraction:.0%})", flush=True)

    suite = "gpu" if name == "bench_gpu" else name
    # The default model's shape with random weights: the machine may have no network for a download.
    config = EngineConfig(device="cuda", model=SUITE_MODEL)
    if suite != "gpu":
        out.write_text(json.dumps(run_suite(suite, config, quick=True, progress=progress), indent=1, default=str))
        return
    from pdchat.bench import gpu
    result: dict[str, Any] = {}
    for section, value in gpu.parts(config, quick, progress):     # kept as measured: a timeout loses one part
        result[section] = value
        out.write_text(json.dumps(result, indent=1, default=str))


def _tests(env: dict[str, str], limit: float, out: Path) -> dict[str, Any]:
    import importlib.util
    import xml.etree.ElementTree as ET
    junit = out / "tests.xml"
    junit.unlink(missing_ok=True)                    # an old run's results must not stand in
    # Workers compile the Triton kernels' many variants in parallel (minutes one after another).
    workers = ["-n", "8"] if importlib.util.find_spec("xdist") else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, f"--junitxml={junit}",
           *GPU_TESTS]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
    (out / "tests.log").write_text(proc.stdout + proc.stderr)
    result: dict[str, Any] = {"exit_code": proc.returncode, "summary": (proc.stdout.strip().splitlines() or [""])[-1]}
    if junit.exists():
        suite = ET.parse(junit).getroot().find("testsuite")
        result.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        result["failed"] = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                            if case.find("failure") is not None or case.find("error") is not None]
    return result


def _stage_result(target: Path, code: int | None, stderr: str) -> dict[str, Any]:
    """What a stage left in its JSON file (all of it, or the parts measured before it failed),
    with the error's last line when it failed."""
    result = json.loads(target.read_text()) if target.exists() else {}
    if code not in (0, None):
        result["error"] = (stderr.strip().splitlines() or [f"exit code {code}"])[-1]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "build" / "gpu-check"), help="folder for the report")
    parser.add_argument("--budget-s", type=float, default=1500, help="stop starting stages past this time")
    parser.add_argument("--quick", action="store_true", help="smaller bench sizes (a smoke run)")
    parser.add_argument("--stages", default=",".join(s for s, _ in STAGES), help="comma-separated subset")
    parser.add_argument("--stage", help=argparse.SUPPRESS)            # internal: run one suite here
    parser.add_argument("--stage-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        run_stage(args.stage, args.quick, Path(args.stage_out))
        return 0
    chosen = args.stages.split(",")
    if unknown := set(chosen) - {s for s, _ in STAGES}:
        parser.error(f"unknown stage(s) {', '.join(sorted(unknown))}; the stages: {', '.join(s for s, _ in STAGES)}")
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=import_path(), PYTHONUNBUFFERED="1")
    report: dict[str, Any] = {"environment": environment(), "stages": {}}
    if "gpu" not in report["environment"]:
        print("gpu-check: torch sees no CUDA GPU here; nothing to check", file=sys.stderr)
        return 2
    for name, limit in STAGES:
        if name not in chosen:
            continue
        left = args.budget_s - (time.monotonic() - started)
        if left < 30:
            report["stages"][name] = {"skipped": f"out of time ({args.budget_s:.0f} s budget)"}
            continue
        print(f"gpu-check: {name} (at most {min(limit, left):.0f} s)", flush=True)
        t0 = time.monotonic()
        try:
            if name == "tests":
                result = _tests(env, min(limit, left), out)
            else:
                target = out / f"{name}.json"
                target.unlink(missing_ok=True)
                cmd = [sys.executable, __file__, "--stage", name, "--stage-out", str(target)] + \
                      (["--quick"] if args.quick else [])
                proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=min(limit, left), capture_output=True, text=True)
                (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
                result = _stage_result(target, proc.returncode, proc.stderr)
        except subprocess.TimeoutExpired:
            result = _stage_result(out / f"{name}.json", None, "")
            result["error"] = f"timed out after {min(limit, left):.0f} s"
        result["seconds"] = round(time.monotonic() - t0, 1)
        report["stages"][name] = result
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str))     # each stage, kept
        (out / "report.md").write_text(markdown(report))
        print(f"gpu-check: {name} done in {result['seconds']} s", flush=True)
    print(markdown(report))
    tests = report["stages"].get("tests", {})
    failed = tests.get("failures") or tests.get("errors") or tests.get("exit_code")
    return 1 if failed or any("error" in r for r in report["stages"].values()) else 0


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def _table(rows: list[dict[str, Any]]) -> list[str]:
    keys = list(rows[0])
    return ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] + \
           ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]


def markdown(report: dict[str, Any]) -> str:
    """The report for people: the environment, then each stage's tables and figures."""
    lines = ["# pdchat gpu-check", ""]
    lines += [f"- {k}: {v}" for k, v in report["environment"].items()]
    for name, result in report["stages"].items():
        lines += ["", f"## {name}", ""]
        for key, value in result.items():
            if key in ("machine", "suite"):
                continue
            if isinstance(value, dict) and isinstance(value.get("rows"), list) and value["rows"]:
                lines += [f"**{key}**", ""] + _table(value["rows"]) + [""]
                value = {k: v for k, v in value.items() if k != "rows"}
                if not value:
                    continue
            if isinstance(value, dict):
                lines += [f"**{key}**: " + ", ".join(f"{k} {_cell(v)}" for k, v in value.items()
                                                     if not isinstance(v, (dict, list)))]
            else:
                lines.append(f"- {key}: {_cell(value)}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
