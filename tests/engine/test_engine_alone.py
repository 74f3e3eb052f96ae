"""The engine where only its own packages are installed (a lent GPU box has torch, transformers,
rich, but not the chat app's textual, platformdirs, gguf, fastapi, uvicorn): importing it, running
a request and importing the benches must not need them."""
from __future__ import annotations

import json
import subprocess
import sys

from pdchat.engine import paths

UI_PACKAGES = ("textual", "platformdirs", "gguf", "fastapi", "uvicorn", "pytest_textual_snapshot")

BLOCK = """
import sys
BLOCKED = set(sys.argv[1:])

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Block())
"""

SCRIPT = BLOCK + """
from pdchat.engine import Engine, SamplingParams
with Engine(model="random:tiny", telemetry=False, kv_cache_mb=8) as engine:
    out = engine.generate(["hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
assert len(out.token_ids) == 4, out
import pdchat.bench.baseline, pdchat.bench.toggles, pdchat.bench.lab
print("loaded:", sorted(m for m in BLOCKED if m in sys.modules))
"""


def test_the_engine_and_the_benches_run_without_the_ui_packages():
    done = subprocess.run([sys.executable, "-c", SCRIPT, *UI_PACKAGES], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded: []" in done.stdout


def test_the_bench_command_runs_without_the_ui_packages():
    script = BLOCK + """
from pdchat.chatapp.cli.main import main
code = main(["bench", "toggles", "--quick", "--model", "random:tiny", "--json"])
print("loaded:", sorted(m for m in BLOCKED if m in sys.modules))
sys.exit(code)
"""
    done = subprocess.run([sys.executable, "-c", script, *UI_PACKAGES], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout[:done.stdout.rindex("loaded:")])
    assert report["suite"] == "toggles" and report["chunked_prefill"]["rows"]
    assert done.stdout.rstrip().endswith("loaded: []")


def test_without_platformdirs_the_xdg_folders_stand_in(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "platformdirs", None)
    monkeypatch.delenv("PDCHAT_CACHE_DIR", raising=False)
    monkeypatch.delenv("PDCHAT_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "d"))
    assert paths.cache_dir() == tmp_path / "c" / "pdchat" and paths.cache_dir().is_dir()
    assert paths.data_dir() == tmp_path / "d" / "pdchat"
    assert paths.models_dir() == tmp_path / "c" / "pdchat" / "models"
