"""A `random:<preset>` model as a GGUF that llama.cpp runs, quantized by llama.cpp's own quantizer:
the llama.cpp peer of `pdchat bench baseline` on the same weights as ours. A model converted
from a GGUF (the default model) is requantized from that file instead.

The weights are written in float16 as llama.cpp's converter lays them out (its names; for the
llama architecture the q/k rows reordered for its interleaved RoPE; llama-3 RoPE scaling as
per-frequency factors), then `llama_model_quantize` makes the Q4_0 file and the float16 one is
deleted. The vocabulary is a placeholder of the model's size (the bench feeds token ids, never
text): the 256 byte tokens, then named tokens. Files are cached by preset and seed.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from pdchat.engine.loader import LoadedModel, load_hf_state_dict
from pdchat.engine.model_source import source_gguf
from pdchat.engine.paths import cache_dir

ARCHITECTURES = ("llama", "mistral", "qwen2")     # what the export knows how to lay out
QUANT_TYPE = "Q4_0"
HF_TO_GGUF = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


# GGUF hyperparameters (GGUFWriter.add_<key>) from our ModelConfig's fields
HPARAMS = {"context_length": "max_position", "embedding_length": "hidden_size", "block_count": "num_layers",
           "feed_forward_length": "intermediate_size", "head_count": "num_heads", "head_count_kv": "num_kv_heads",
           "key_length": "head_dim", "value_length": "head_dim", "rope_dimension_count": "head_dim",
           "rope_freq_base": "rope_theta", "layer_norm_rms_eps": "rms_norm_eps", "vocab_size": "vocab_size"}


class ExportUnavailable(RuntimeError):
    """No peer file can be made here (no GGUF of a real model, an architecture the export does not
    lay out, no llama.cpp quantizer)."""


def peer_gguf(loaded: LoadedModel, threads: int, say: Callable[[str], None]) -> Path:
    """The model's weights as a Q4_0 GGUF made by llama.cpp's quantizer, once (cached): a random
    model exported first; a model converted from a GGUF (the default model) requantized from that
    file, its real vocabulary kept."""
    files = loaded.files
    folder = cache_dir() / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    if files.random_preset is None:
        source = source_gguf(files.name, say=say)
        if source is None:
            raise ExportUnavailable(f"no GGUF for {files.name!r} (llama.cpp reads GGUF only; pass --model FILE.gguf)")
        st = source.stat()
        key = hashlib.sha1(f"{source.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
        out = folder / f"{source.stem}-{key}.{QUANT_TYPE}.gguf"
        if not out.is_file():
            say(f"quantizing {source.name} to {QUANT_TYPE} with llama.cpp's quantizer (once)…")
            _quantize(source, out, threads)
        return out
    arch = loaded.hf_config["model_type"]
    if arch not in ARCHITECTURES:
        raise ExportUnavailable(f"the GGUF export lays out {', '.join(ARCHITECTURES)}, not {arch}")
    out = folder / f"{files.random_preset}-seed{loaded.seed}.{QUANT_TYPE}.gguf"
    if not out.is_file():
        f16 = out.with_suffix(".f16.partial")
        try:
            say(f"writing {files.name} as GGUF for llama.cpp (once)…")
            _write_f16(loaded, arch, f16)
            say(f"quantizing it to {QUANT_TYPE} with llama.cpp's quantizer…")
            _quantize(f16, out, threads)
        finally:
            f16.unlink(missing_ok=True)
    return out


def _write_f16(loaded: LoadedModel, arch: str, path: Path) -> None:
    import gguf
    cfg, hf_cfg = loaded.config, loaded.hf_config
    gguf_arch = "llama" if arch == "mistral" else arch
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_name(loaded.files.name)
    for key, field in HPARAMS.items():
        getattr(writer, f"add_{key}")(getattr(cfg, field))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _add_vocab(writer, gguf, cfg.vocab_size, hf_cfg)
    for name, tensor in _gguf_tensors(loaded, arch):
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_vocab(writer: Any, gguf: Any, size: int, hf_cfg: dict[str, Any]) -> None:
    """A SentencePiece-style placeholder vocabulary: llama.cpp insists on the byte tokens."""
    eos = hf_cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    bos = hf_cfg.get("bos_token_id")
    tokens = [f"<0x{i:02X}>" for i in range(256)] + [f"<t{i}>" for i in range(256, size)]
    types = [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (size - 256)
    for special in (bos, eos):
        if special is not None and 256 <= special < size:
            types[special] = gguf.TokenType.CONTROL
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * size)
    writer.add_token_types(types)
    if bos is not None:
        writer.add_bos_token_id(bos)
    if eos is not None:
        writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)


def _gguf_tensors(loaded: LoadedModel, arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, array) for every weight: matrices float16, norms and biases float32."""
    cfg = loaded.config
    state = load_hf_state_dict(loaded.files, torch.device("cpu"), torch.float32, loaded.seed)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for hf_name in list(state.keys()):
        tensor = state[hf_name]
        name = names.get(hf_name) or _layer_name(hf_name)
        if arch != "qwen2" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_heads if "attn_q" in name else cfg.num_kv_heads
            tensor = _interleave_rope_rows(tensor, heads)
        matrix = tensor.dim() == 2
        yield name, tensor.to(torch.float16 if matrix else torch.float32).numpy()
    factors = _rope_factors(cfg)
    if factors is not None:
        yield "rope_freqs.weight", factors


def _layer_name(hf_name: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight"""
    _, _, index, rest = hf_name.split(".", 3)
    for hf, ours in HF_TO_GGUF.items():
        if rest.startswith(hf):
            return f"blk.{index}.{ours}{rest[len(hf):]}"
    raise ExportUnavailable(f"no GGUF name for {hf_name}")


def _interleave_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face rotates the two halves of each head; llama.cpp's llama RoPE rotates adjacent
    pairs: the same function once each head's rows are reordered."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_factors(cfg: Any) -> np.ndarray | None:
    """llama-3 RoPE scaling as llama.cpp reads it: base frequency / scaled frequency, per pair."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    dim = cfg.head_dim
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return (base / cfg.rope_inv_freq()).float().numpy()


# Run apart: llama.cpp's quantizer logs every tensor to stderr (it would tear the bench's
# progress bar and the app), and its library stays out of our process.
_QUANTIZE = """
import ctypes, sys
import llama_cpp
src, dst, threads, ftype = sys.argv[1:]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
params.nthread = int(threads)
params.allow_requantize = True          # a GGUF that is already quantized (Q4_1, ...)
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))
"""


def _quantize(src: Path, dst: Path, threads: int) -> None:
    partial = dst.with_suffix(".partial")
    done = subprocess.run([sys.executable, "-c", _QUANTIZE, str(src), str(partial), str(threads), QUANT_TYPE],
                          capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        if "No module named 'llama_cpp'" in done.stderr:
            raise ExportUnavailable("llama-cpp-python is not installed")
        raise ExportUnavailable(f"llama.cpp's quantizer failed on {src}: {done.stderr.strip()[-400:]}")
    partial.replace(dst)                        # atomic: never a half-written file under the final name
