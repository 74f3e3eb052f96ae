"""Mutation testing of the critical modules: `make mutation` (issue 21).

Tool: mutmut 3.8.1 (pinned here and in the Makefile; `make mutation` installs it into .venv when
missing; it is no dependency of `make test`).

What it does:

1. Stages a copy of the project under build/mutation/stage (build/ is gitignored) with the
   layout the installed package has: pdchat/engine, pdchat/bench, pdchat/kernels, pdchat/chatapp, pdchat/themes
   (+ an empty pdchat/__init__.py), tests/, and pyproject.toml with a [tool.mutmut] section.
   The repository has no pdchat/ folder (setuptools' package-dir maps it), and mutmut needs one.
2. Runs `mutmut run --max-children 1` there (one worker by default, `--workers N` for more;
   OMP/MKL threads 1: one worker leaves the second core of a 2-core machine free). mutmut
   copies the stage into stage/mutants/, puts that folder
   first on sys.path, and runs pytest in it, so `pdchat.engine` is imported from the mutated copy,
   not from the editable install in .venv (whose finder sits at the END of sys.meta_path).
   `--self-check` proves it: it plants a deliberately wrong line in the staged sampler and checks
   that a test in the mutants/ copy fails on it.
3. Writes build/mutation/report.md: tool and version, modules, per module and in total the
   mutants, killed, survived, timeouts, kill rate, and every survivor with its diff and its
   explanation from tools/mutation_survivors.toml (matched by function and mutated line, not by
   mutant number, so an explanation goes stale, and is reported UNEXPLAINED, when the code moves).

Exit status: 0 when the kill rate reaches --min-rate (90 %) and every survivor is explained.

    python tools/mutation.py                 # full run (18 min with --workers 2 on 2 cores)
    python tools/mutation.py --report-only   # rebuild the report from the last run
    python tools/mutation.py --resume [--workers 2]   # go on with an interrupted run
    python tools/mutation.py --rerun NAME..  # re-sync tests/ into the last stage, re-run mutants
    python tools/mutation.py --self-check    # prove the tests see mutated code
    python tools/mutation.py --check MUTANT [TEST..]   # do the current tests kill this mutant?
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path

MUTMUT_VERSION = "3.8.1"
ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "mutation"
STAGE = WORK / "stage"
REPORT = WORK / "report.md"
SURVIVORS = ROOT / "tools" / "mutation_survivors.toml"

# The critical modules (repository path -> module name in the staged package).
MODULES = {
    "engine/sampler.py": "pdchat.engine.sampler",
    "engine/spec.py": "pdchat.engine.spec",
    "engine/block_manager.py": "pdchat.engine.block_manager",
    "engine/scheduler.py": "pdchat.engine.scheduler",
    "engine/step_cost.py": "pdchat.engine.step_cost",
    "chatapp/serve/errors.py": "pdchat.chatapp.serve.errors",
}
PACKAGES = {"engine": "pdchat/engine", "bench": "pdchat/bench", "kernels": "pdchat/kernels", "chatapp": "pdchat/chatapp",
            "themes": "pdchat/themes"}
# Fast, relevant tests. The two tests on the real default model (`default_engine`, 25-30 s each,
# and a download on a fresh machine) are left out: the random:tiny tests cover the same paths.
TESTS = [
    "tests/engine/test_sampler.py",
    "tests/engine/test_spec.py",
    "tests/engine/test_spec_distribution.py",
    "tests/engine/test_block_manager.py",
    "tests/engine/test_scheduler.py",
    "tests/engine/test_preemption.py",
    "tests/engine/test_fault_isolation.py",
    "tests/engine/test_lossless.py",
    "tests/engine/test_step_cost.py",
    "tests/chatapp/test_server_errors.py",
]
DESELECT = "not default_model"

ORDER_PLUGIN = "mutation_order"
ORDER_PLUGIN_SOURCE = '''"""pytest plugin (staged by tools/mutation.py): run the fastest tests first.

mutmut runs a mutant's tests with -x, so a kill by a quick unit test ends the run at once. The
durations are the ones mutmut measured on the clean code (mutants/mutmut-stats.json).
"""
import json
from pathlib import Path


def pytest_collection_modifyitems(session, config, items):
    stats = Path("mutmut-stats.json")
    if stats.exists():
        duration = json.loads(stats.read_text()).get("duration_by_test", {})
        items.sort(key=lambda item: duration.get(item.nodeid, 0.0))
'''

KILLED = {1, 3}
TIMEOUT = {36, 24, -24, 152, 255}
SURVIVED = {0}
NO_TESTS = {5, 33}


def mutmut_bin() -> Path:
    return Path(sys.executable).parent / "mutmut"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
             PYTHONDONTWRITEBYTECODE="1", NO_COLOR="1")
    e.pop("PYTHONPATH", None)
    return e


def check_mutmut() -> str:
    try:
        out = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('mutmut'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    except subprocess.CalledProcessError:
        sys.exit(f"mutmut is not installed: {sys.executable} -m pip install mutmut=={MUTMUT_VERSION}")
    if out != MUTMUT_VERSION:
        print(f"warning: mutmut {out} installed, the report was tuned on {MUTMUT_VERSION}", file=sys.stderr)
    return out


# ---- staging -------------------------------------------------------------------------------
def staged(path: str) -> str:
    """Where a repository file sits in the staged package: engine/spec.py -> pdchat/engine/spec.py."""
    top, rest = path.split("/", 1)
    return f"{PACKAGES[top]}/{rest}"


def _ignore(_dir, names):
    return [n for n in names if n in ("__pycache__", ".pytest_cache") or n.endswith((".pyc", ".so"))]


def stage() -> None:
    if STAGE.exists():
        shutil.rmtree(STAGE)
    (STAGE / "pdchat").mkdir(parents=True)
    (STAGE / "pdchat" / "__init__.py").write_text('"""Staged for mutation testing (tools/mutation.py)."""\n')
    for src, dst in PACKAGES.items():
        shutil.copytree(ROOT / src, STAGE / dst, ignore=_ignore)
    shutil.copytree(ROOT / "tests", STAGE / "tests", ignore=_ignore)
    only = ", ".join(f'"{staged(p)}"' for p in MODULES)
    selection = ", ".join(f'"{t}"' for t in TESTS)
    pyproject = (ROOT / "pyproject.toml").read_text()
    pyproject += f"""

# ---- added by tools/mutation.py ----
[tool.mutmut]
source_paths = ["pdchat"]
only_mutate = [{only}]
also_copy = ["{ORDER_PLUGIN}.py"]
# -p {ORDER_PLUGIN}: the fastest tests first, so that with mutmut's -x a killed mutant costs little.
# --timeout: a test that a mutant sends into an endless loop fails after 60 s (the slowest test
# takes about 12 s here), instead of burning the run; it counts as killed.
pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-p", "{ORDER_PLUGIN}", "--timeout", "60"]
pytest_add_cli_args_test_selection = [{selection}, "-k", "{DESELECT}"]
use_git_change_detection = false
# A mutant's tests get (estimated time + 5 s) x 3 x 2 CPU seconds before they count as a timeout.
timeout_multiplier = 3.0
timeout_constant = 5.0
"""
    (STAGE / "pyproject.toml").write_text(pyproject)
    (STAGE / f"{ORDER_PLUGIN}.py").write_text(ORDER_PLUGIN_SOURCE)


def sync_tests() -> None:
    """Copy the current tests into an existing stage (and its mutants/ copy) for --rerun. The
    map of which tests run which function is dropped with the old tests: mutmut rebuilds it."""
    for base in (STAGE, STAGE / "mutants"):
        if base.exists():
            shutil.rmtree(base / "tests", ignore_errors=True)
            shutil.copytree(ROOT / "tests", base / "tests", ignore=_ignore)
    (STAGE / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)


def run_mutmut(names: list[str], workers: int = 1) -> int:
    cmd = [str(mutmut_bin()), "run", "--max-children", str(workers), *names]
    print("$", " ".join(cmd), f"(in {STAGE.relative_to(ROOT)})", flush=True)
    return subprocess.run(cmd, cwd=STAGE, env=env()).returncode


def check(name: str, tests: list[str]) -> int:
    """Run the CURRENT tests against one mutant of the last run (a scratch copy: the run's own
    mutants/ tree is left alone). Returns pytest's exit status: 1 = the tests kill it."""
    scratch = WORK / "check"
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(STAGE / "mutants" / "pdchat", scratch / "pdchat", ignore=_ignore)
    shutil.copytree(ROOT / "tests", scratch / "tests", ignore=_ignore)
    shutil.copy(STAGE / "pyproject.toml", scratch / "pyproject.toml")
    code = ("import sys; sys.path.insert(0, '.'); import pytest; "
            f"sys.exit(pytest.main(['-x', '-q', '-p', 'no:cacheprovider', *{tests!r}]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=scratch, env={**env(), "MUTANT_UNDER_TEST": name},
                       capture_output=True, text=True)
    print(r.stdout[-1500:])
    print(f"{name}: {'KILLED' if r.returncode == 1 else 'NOT killed'} by {' '.join(tests)} (exit {r.returncode})")
    return r.returncode


# ---- self-check ----------------------------------------------------------------------------
def self_check() -> int:
    """Plant an obviously wrong sampler in a fresh mutmut tree and show that the tests fail on it.

    mutmut runs pytest with cwd = mutants/ and mutants/ first on sys.path; the same is done here.
    """
    stage()
    mut = STAGE / "mutants"
    shutil.copytree(STAGE, mut, ignore=lambda d, n: ["mutants"] if Path(d) == STAGE else [])
    target = mut / "pdchat" / "engine" / "sampler.py"
    text = target.read_text()
    wrong = text.replace("return probs\n\n\ndef usable", "return probs * 0 + 1.0 / probs.shape[-1]\n\n\ndef usable")
    assert wrong != text, "self-check anchor not found in engine/sampler.py"
    target.write_text(wrong)
    test = "tests/engine/test_sampler.py::test_top_p_keeps_the_boundary_token"
    code = ("import sys; sys.path.insert(0, '.'); import pytest, pdchat.engine.sampler as s; "
            "print('sampler imported from', s.__file__); "
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {test!r}]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=mut, env=env(), capture_output=True, text=True)
    print(r.stdout[-2000:], r.stderr[-2000:])
    where = re.search(r"sampler imported from (\S+)", r.stdout)
    ok = where is not None and Path(where.group(1)).resolve().is_relative_to(mut.resolve()) and r.returncode == 1
    print("self-check:", "OK: the tests import and fail on the mutated copy" if ok else "FAILED")
    return 0 if ok else 1


# ---- report --------------------------------------------------------------------------------
def load_results() -> dict[str, int | None]:
    results: dict[str, int | None] = {}
    for path in MODULES:
        meta = STAGE / "mutants" / (staged(path) + ".meta")
        if not meta.exists():
            sys.exit(f"no results for {path}: run `make mutation` first")
        results.update(json.loads(meta.read_text())["exit_code_by_key"])
    return results


def status(code: int | None) -> str:
    if code in KILLED:
        return "killed"
    if code in TIMEOUT:
        return "timeout"
    if code in SURVIVED:
        return "survived"
    if code in NO_TESTS:
        return "no tests"
    if code is None:
        return "not checked"
    return f"other ({code})"


def module_of(name: str) -> str:
    return name.split(".x_")[0].split(".xǁ")[0].rsplit(".", 1)[0] if ".x" in name else name


def function_of(name: str) -> str:
    return re.sub(r"__mutmut_\d+$", "", name)


def diff_of(name: str) -> str:
    r = subprocess.run([str(mutmut_bin()), "show", name], cwd=STAGE, env=env(), capture_output=True, text=True)
    lines = r.stdout.splitlines()
    # drop mutmut's header line and the file headers; keep the hunk
    return "\n".join(l for l in lines if not l.startswith(("# ", "---", "+++"))).strip()


def changed_lines(diff: str) -> tuple[str, str]:
    minus = " / ".join(l[1:].strip() for l in diff.splitlines() if l.startswith("-"))
    plus = " / ".join(l[1:].strip() for l in diff.splitlines() if l.startswith("+"))
    return minus, plus


def load_explanations() -> list[dict]:
    if not SURVIVORS.exists():
        return []
    return tomllib.loads(SURVIVORS.read_text()).get("survivor", [])


def explain(name: str, diff: str, explanations: list[dict]) -> dict | None:
    minus, plus = changed_lines(diff)
    for e in explanations:
        if e.get("function") and not function_of(name).endswith(e["function"]):
            continue
        if e.get("minus", "").strip() == minus and e.get("plus", "").strip() == plus:
            return e
    return None


def rate(c: Counter) -> float:
    """Kill rate over the checked mutants (a partial, interrupted run leaves some unchecked)."""
    n = sum(c.values()) - c["not checked"]
    return 100.0 * (c["killed"] + c["timeout"]) / n if n else 0.0


def tally(results: dict[str, int]) -> dict[str, Counter]:
    """Mutant outcomes per module."""
    mods = {m: Counter() for m in MODULES.values()}
    for name, code in results.items():
        mod = next(m for m in MODULES.values() if name.startswith(m + "."))
        mods[mod][status(code)] += 1
    return mods


def survivor_rows(results: dict[str, int]) -> list[tuple[str, str, str, dict | None]]:
    """(name, status, diff, explanation or None) of every surviving mutant, in source order."""
    explanations = load_explanations()
    survivors = sorted((n for n, code in results.items() if status(code) not in ("killed", "timeout", "not checked")),
                       key=lambda n: (module_of(n), function_of(n), int(n.rsplit("_", 1)[-1])))
    rows = []
    for name in survivors:
        diff = diff_of(name)
        rows.append((name, status(results[name]), diff, explain(name, diff, explanations)))
    return rows


def summary_lines(version: str, wall_s: str | None, mods: dict[str, Counter], total: Counter,
                  rows: list) -> list[str]:
    out = ["# Mutation testing report\n",
           f"- tool: mutmut {version} (`make mutation`, tools/mutation.py)",
           f"- modules: {', '.join(MODULES)}",
           f"- tests: {', '.join(Path(t).name for t in TESTS)} (`-k \"{DESELECT}\"`)",
           f"- wall time of the last full run: {wall_s}" if wall_s is not None else "- wall time: (not recorded)",
           "",
           "| module | mutants | not checked | killed | timeout | survived | no tests | kill rate |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for path, mod in MODULES.items():
        c = mods[mod]
        out.append(f"| {path} | {sum(c.values())} | {c['not checked']} | {c['killed']} | {c['timeout']} "
                   f"| {c['survived']} | {c['no tests']} | {rate(c):.1f} % |")
    out.append(f"| **total** | {sum(total.values())} | {total['not checked']} | {total['killed']} | "
               f"{total['timeout']} | {total['survived']} | {total['no tests']} | **{rate(total):.1f} %** |")
    out += ["", "Kill rate = (killed + timeout) / checked mutants. A timeout is a mutant whose tests hang "
            "(an endless loop): it is detected, so it counts as killed. 'no tests' = no selected test "
            "runs the function: counted as surviving."]
    since = sum(1 for r in rows if r[3] is not None and r[3]["kind"] == "killed since the run")
    if since:
        checked = sum(total.values()) - total["not checked"]
        out += ["", f"{since} survivors of this run are killed by tests added after it (verified with "
                f"`--check`): counting them, the kill rate is "
                f"{100.0 * (total['killed'] + total['timeout'] + since) / checked:.1f} %."]
    if total["not checked"]:
        out += ["", f"**PARTIAL RUN**: {total['not checked']} mutants were not checked (the run was "
                "stopped); the rate is over the checked ones."]
    return out


def survivor_lines(rows: list, unexplained: int) -> list[str]:
    out = ["", f"## Survivors ({len(rows)}, {unexplained} unexplained)", ""]
    for name, st, diff, e in rows:
        out.append(f"### `{name}` ({st})")
        out.append("```diff\n" + diff + "\n```")
        if e is None:
            out.append("**UNEXPLAINED**: add a test that kills it, or an entry in tools/mutation_survivors.toml.")
        else:
            out.append(f"**{e['kind']}**: {e['why'].strip()}")
        out.append("")
    return out


def write_report(version: str, wall_s: str | None, min_rate: float) -> int:
    """Write the report; 0 when the rate is met, every survivor explained and every mutant checked."""
    results = load_results()
    mods = tally(results)
    total = sum(mods.values(), Counter())
    rows = survivor_rows(results)
    unexplained = sum(e is None for *_, e in rows)
    summary = summary_lines(version, wall_s, mods, total, rows)
    WORK.mkdir(parents=True, exist_ok=True)
    REPORT.write_text("\n".join(summary + survivor_lines(rows, unexplained)) + "\n")
    print("\n".join(summary))
    print(f"\nreport: {REPORT.relative_to(ROOT)}")
    ok = rate(total) >= min_rate and unexplained == 0 and not total["not checked"]
    if not ok:
        print(f"FAIL: kill rate {rate(total):.1f} % (needs {min_rate} %), {unexplained} unexplained survivors, "
              f"{total['not checked']} mutants not checked")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--self-check", action="store_true")
    ap.add_argument("--rerun", nargs="+", metavar="MUTANT", help="re-run these mutants (globs ok) in the last stage")
    ap.add_argument("--check", nargs="+", metavar=("MUTANT", "TEST"),
                    help="run the current tests (pytest node ids) against one mutant of the last run")
    ap.add_argument("--resume", action="store_true",
                    help="go on with the last run in its stage (mutmut keeps every result it has)")
    ap.add_argument("--workers", type=int, default=1,
                    help="mutants tested at once (default 1: a core stays free; each worker uses one core)")
    ap.add_argument("--min-rate", type=float, default=90.0)
    args = ap.parse_args()
    version = check_mutmut()
    if args.self_check:
        return self_check()
    if args.check:
        return check(args.check[0], args.check[1:] or TESTS)
    record = WORK / "wall_s"          # "<seconds> s with <n> worker(s)" of the last full run
    if args.rerun:
        sync_tests()
        run_mutmut(args.rerun, args.workers)
    elif not args.report_only:
        if not args.resume:
            stage()
        elif not (STAGE / "mutants").exists():
            sys.exit("nothing to resume: run `make mutation` first")
        t0 = time.monotonic()
        rc = run_mutmut([], args.workers)
        wall = time.monotonic() - t0
        if args.resume and record.exists():
            wall += float(record.read_text().split()[0])          # the interrupted part counts too
        record.write_text(f"{wall:.0f} s with {args.workers} worker(s)\n")
        if rc != 0:
            print(f"mutmut exited with {rc}", file=sys.stderr)
    wall = record.read_text().strip() if record.exists() else None
    return write_report(version, wall, args.min_rate)


if __name__ == "__main__":
    sys.exit(main())
