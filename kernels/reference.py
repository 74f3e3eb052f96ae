"""Pure-PyTorch paged KV store and paged attention: the semantics every kernel must match.

Cache layout (per layer): k_cache, v_cache = [num_blocks, block_size, kv_heads, head_dim].
A sequence's token at position p lives in block block_table[p // block_size], row p % block_size;
its "slot" is block * block_size + row.

A batch is flat and ragged: sequence i owns queries q[query_start_loc[i]:query_start_loc[i+1]]
(n_i tokens), and after the store its cache holds context_lens[i] = c_i tokens, the n_i new ones
last. Query j of sequence i sits at position c_i - n_i + j and attends to keys 0..that position
(causal with offset). This one rule covers a prefill chunk over a cached prefix, a single-token
decode, and a k+1-token speculative verification.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


NO_TOKEN = -1      # a row's token where its logits are unusable (the engine's sampler fails that request alone)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> each row's argmax [B] (int64, on logits' device: the first of equal
    largest values); NO_TOKEN for a row holding a NaN. argmax takes a NaN as the largest value, so
    such a row picks a NaN: one pass, not three; and no wait for the device (a decode graph runs
    this inside its replay: engine/cuda_graphs.py)."""
    best = logits.argmax(-1)
    ok = ~torch.isnan(logits.gather(1, best.unsqueeze(1)).squeeze(1))
    return best.masked_fill(~ok, NO_TOKEN)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write rows k[t], v[t] ([T, kv_heads, head_dim]) to slot slot_mapping[t]; slot -1 is skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` rows of one sequence's cache: [length, kv_heads, head_dim]."""
    bs = cache.shape[1]
    blocks = block_table[: (length + bs - 1) // bs]
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float, causal: bool = False) -> torch.Tensor:
    """q: [B, H, n, D], k/v: [B, KVH, c, D] -> [B, H, n, D], grouped-query heads shared."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


# A prompt over a cached prefix as two flash calls merged by their log-sum-exp, where the CPU's
# flash kernel is available: with a mask SDPA computes (on a CPU, materializes) every score of the
# n x c matrix, twice the causal work for a long prompt after a short prefix (a 2,853-token prompt
# after 192 cached: 158 -> 81 ms a layer). Below SPLIT_MIN_QUERIES queries the masked call is as
# fast or faster (measured per layer, SmolLM2-135M's heads, 2026-11-24, 2-core EPYC with AVX-512).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
SPLIT_MIN_QUERIES = 768


def _after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [1, H, n, D] at the last n of c positions, k/v: [1, KVH, c, D] -> [1, H, n, D]: every
    query sees the c - n prefix keys whole and the n new ones causally."""
    if q.shape[1] != k.shape[1]:                         # grouped-query heads, as enable_gqa shares them
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    p = k.shape[2] - q.shape[2]
    o1, l1 = _FLASH_CPU(q, k[:, :, :p], v[:, :, :p], scale=scale)[:2]
    o2, l2 = _FLASH_CPU(q, k[:, :, p:], v[:, :, p:], is_causal=True, scale=scale)[:2]
    lse = torch.logaddexp(l1, l2)
    out = o1.float() * (l1 - lse).exp().unsqueeze(-1) + o2.float() * (l2 - lse).exp().unsqueeze(-1)
    return out.to(q.dtype)


@functools.lru_cache(maxsize=4)     # (a few: each can be n x c bytes, up to 768 x the context)
def _after_cached(n: int, c: int, device: torch.device) -> torch.Tensor:
    """The mask of n queries at the end of c positions; every layer of a forward asks for the same."""
    return torch.ones(n, c, dtype=torch.bool, device=device).tril(c - n)


def host_lengths(query_start_loc: torch.Tensor, context_lens: torch.Tensor, query_lens_host: list[int] | None,
                 context_lens_host: list[int] | None) -> tuple[list[int], list[int]]:
    """Each sequence's query and context length as Python ints: the given lists, else read back."""
    return (query_lens_host or (query_start_loc[1:] - query_start_loc[:-1]).tolist(),
            context_lens_host or context_lens.tolist())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, *,
                    query_lens_host: list[int] | None = None,
                    context_lens_host: list[int] | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """q: [T, H, D] -> out [T, H, D]. The *_host lists, when given, spare a device->host copy.

    num_splits: for a decode-only batch, how many parts of each context a backend that splits
    attention uses (the Triton kernels; a CUDA graph fixes it, since a replay reads no length on
    the host). Any count gives this result; a backend that does not split ignores it."""
    qlens, clens = host_lengths(query_start_loc, context_lens, query_lens_host, context_lens_host)
    out = torch.empty_like(q)
    if all(n == 1 for n in qlens):
        return _decode(q, k_cache, v_cache, block_tables, clens, scale, out)
    start = 0
    for i, (n, c) in enumerate(zip(qlens, clens)):
        qi = q[start:start + n].transpose(0, 1).unsqueeze(0)                  # [1, H, n, D]
        ki = _gather(k_cache, block_tables[i], c).transpose(0, 1).unsqueeze(0)  # [1, KVH, c, D]
        vi = _gather(v_cache, block_tables[i], c).transpose(0, 1).unsqueeze(0)
        if n == c:
            oi = _sdpa(qi, ki, vi, None, scale, causal=n > 1)
        elif n >= SPLIT_MIN_QUERIES and _FLASH_CPU is not None and q.device.type == "cpu":
            oi = _after_prefix(qi, ki, vi, scale)
        else:
            oi = _sdpa(qi, ki, vi, _after_cached(n, c, q.device), scale)
        out[start:start + n] = oi[0].transpose(0, 1)
        start += n
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            clens: list[int], scale: float, out: torch.Tensor) -> torch.Tensor:
    """All sequences have one query: gather them padded to the longest and attend in one call."""
    B = len(clens)
    bs = k_cache.shape[1]
    max_c = max(clens)
    tables = block_tables[:, : (max_c + bs - 1) // bs]
    flat = tables.reshape(-1)                         # index_select is far cheaper than fancy indexing
    k = k_cache.index_select(0, flat).view(B, -1, *k_cache.shape[2:])[:, :max_c].transpose(1, 2)  # [B, KVH, c, D]
    v = v_cache.index_select(0, flat).view(B, -1, *v_cache.shape[2:])[:, :max_c].transpose(1, 2)
    mask = None
    if min(clens) != max_c:
        lens = torch.tensor(clens, device=q.device)
        mask = (torch.arange(max_c, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    o = _sdpa(q.view(B, q.shape[1], 1, q.shape[2]), k, v, mask, scale)       # [B, H, 1, D]
    out.copy_(o.view(B, q.shape[1], q.shape[2]))
    return out


# ---- the rest of a transformer layer's ops (the CPU kernels' twins) -----------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), normalised in fp32 whatever the dtype (as Hugging Face's Llama does);
    the fused aten op gives the same bits as the spelled-out formula."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (x + delta, rms_norm(x + delta))."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (half-split layout of Hugging Face Llama). q: [T, H, D], k: [T, KVH, D],
    cos/sin: [T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.shape[0]
    if x.device.type == "cpu" and 1 < rows < 4:
        # CPU BLAS runs a 2- or 3-row product as that many matrix-vector passes, each reading the
        # whole weight (2-3.5x a single row, measured); padded to 4 rows it is one matrix product.
        padded = torch.cat([x, x.new_zeros(4 - rows, x.shape[1])])
        return F.linear(padded, weight, bias)[:rows]
    return F.linear(x, weight, bias)


# Int8 weights: canonical form is (q int8 [N, K], scales fp32 [N]), weight ~= scales[:, None] * q.
# Each backend packs it into the layout its matmul wants; this one uses aten's int8 matmul,
# which is fast with bf16 activations on CPU (its fp32 path is not).

def _act_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if device.type == "cpu" else dtype


def pack_int8(q: torch.Tensor, scales: torch.Tensor, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return q, scales.to(_act_dtype(q.device, act_dtype))


def unpack_int8(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return packed, scales.float()


def linear_int8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    if packed.shape[1] % 16:
        # aten's kernel needs a width that is a multiple of 16 (it crashes otherwise): dequantize.
        return F.linear(x, packed.to(x.dtype) * scales.to(x.dtype)[:, None], bias)
    y = torch.ops.aten._weight_int8pack_mm(x.to(scales.dtype), packed, scales).to(x.dtype)
    return y + bias if bias is not None else y


# Exact int8 blocks: an fp32 matrix whose every 32 weights of a row are one scale times integers in
# -127..127 (a GGUF Q8_0 matrix read as fp32), held as (q int8 [layouts, N, K], scales fp32
# [layouts, N, K / 32]): weight == scales * q exactly, at a quarter of the bytes a layout. Layout 0
# is by rows; a backend may hold the same blocks a second time in a layout of its own (the C one:
# by panels of outputs, for products of a few rows), as it may exact Q4 blocks (below). A backend
# that finds the form (`exact_int8_blocks`) multiplies by it from then on; this one leaves every
# matrix as it is.
EXACT_BLOCK = 32


def exact_int8_blocks(weight: torch.Tensor, multiplied: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(`multiplied`: whether products will read the blocks, or only lookups: a backend holds its
    own layout for products only then.)"""
    return None


def exact_rows(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact blocks of either form as held, in their rows' layout: int8 q [N, K] and scales [N, K /
    32]; Q4 nibbles [N, K / 2] and (d, m) [N, K / 32, 2]."""
    if q.dim() != 3 or scales.shape[:2] != q.shape[:2]:
        raise ValueError(f"exact blocks are held by layouts ([layouts, N, ...]), not as {tuple(q.shape)} "
                         f"and {tuple(scales.shape)}")
    return q[0], scales[0]


def dequantize_exact_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weights of exact blocks in their rows' layout (exact_rows; rows of them: an
    embedding's lookups too)."""
    return (q.float().unflatten(-1, (-1, EXACT_BLOCK)) * scales.unsqueeze(-1)).flatten(-2)


def linear_exact_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T + bias for W held in exact int8 blocks (as held, above)."""
    return linear(x, dequantize_exact_int8(*exact_rows(q, scales)).to(x.dtype), bias)


# Exact Q4 blocks: an fp32 matrix whose every 32 weights of a row are d * u + m with u in 0..15 and
# d * u exact in fp32 (a GGUF Q4_1 matrix read as fp32), held as (nibbles uint8 [layouts, N, K / 2],
# (d, m) fp32 [layouts, N, K / 32, 2]): 0.75 bytes a weight a layout, layout 0 by rows (the nibbles
# in the int4 layout below). As for exact int8 blocks, this backend never finds the form
# (`exact_q4_blocks`); the C one does.
def exact_q4_blocks(weight: torch.Tensor, multiplied: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
    return None


def q4_1_weights(w: torch.Tensor) -> torch.Tensor:
    """What w quantized to GGUF's Q4_1 reads as in fp32: per 32 weights of a row d * u + m, u in
    0..15, d and m fp16 (m the group's least weight): a matrix of the exact Q4 form."""
    groups = w.float().reshape(-1, EXACT_BLOCK)
    low = groups.amin(dim=1).half().float()
    d = ((groups.amax(dim=1) - low) / 15).half().float()
    u = torch.round((groups - low[:, None]) / d[:, None]).clamp(0, 15)
    return (u * d[:, None] + low[:, None]).view_as(w)


def dequantize_exact_q4(q: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The fp32 weights of exact Q4 blocks in their rows' layout (exact_rows; rows of them: an
    embedding's lookups too)."""
    u = unpack_int4(q).float().unflatten(-1, (-1, EXACT_BLOCK))
    return (u * dm[..., :1] + dm[..., 1:]).flatten(-2)       # (d * u exact: one rounding, as in C)


def linear_exact_q4(x: torch.Tensor, q: torch.Tensor, dm: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T + bias for W held in exact Q4 blocks (as held, above)."""
    return linear(x, dequantize_exact_q4(*exact_rows(q, dm)).to(x.dtype), bias)


def int8_supported(device: torch.device) -> bool:
    """Whether this torch build runs the int8 weight-only matmul on the device."""
    try:
        x = torch.zeros(1, 32, dtype=torch.bfloat16, device=device)
        q = torch.zeros(8, 32, dtype=torch.int8, device=device)
        torch.ops.aten._weight_int8pack_mm(x, q, torch.ones(8, dtype=torch.bfloat16, device=device))
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


# Int4 weights, one form for every backend (cpu_kernels.c reads it as it is): groups of 32 weights
# of a row, w = d * u + m with u in 0..15 and (d, m) per group in bf16. Packed: u two to a byte, 16
# bytes a group, byte i holding weight i in its low nibble and weight 16 + i in its high one;
# params [N, K / 32, 2] = (d, m). 0.625 bytes a weight, like llama.cpp's Q4_1.
INT4_GROUP = 32


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """u uint8 [N, K] in 0..15 -> packed uint8 [N, K / 2]."""
    N, K = u.shape
    g = u.view(N, K // INT4_GROUP, 2, INT4_GROUP // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(N, K // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K / 2] -> u uint8 [N, K] in 0..15."""
    N, half = packed.shape
    g = packed.view(N, half // (INT4_GROUP // 2), 1, INT4_GROUP // 2)
    return torch.cat([g & 15, g >> 4], dim=2).reshape(N, half * 2)


def dequantize_int4(packed: torch.Tensor, params: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    u = unpack_int4(packed)
    N, K = u.shape
    p = params.to(dtype)
    return (u.view(N, K // INT4_GROUP, INT4_GROUP).to(dtype) * p[:, :, :1] + p[:, :, 1:]).view(N, K)


def linear_int4(x: torch.Tensor, packed: torch.Tensor, params: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_int4(packed, params, x.dtype), bias)


# ---- whole layers ----------------------------------------------------------------------------
# A backend may run every block of a forward in one call (the CPU kernels do, for small batches,
# where Python's per-op overhead rivals the arithmetic). Here there is no such path: the model
# runs its blocks op by op, with the functions above.

def prepare_layers(layers: list, num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> None:
    """layers: model.LayerWeights per block -> the backend's plan for run_layers (None: no plan)."""
    return None


def run_layers(plan: object | None, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               batch: object) -> bool:
    """Run every block in place on x (the residual stream) and h (its normalised form); False when
    the backend cannot for this batch, and the model runs the blocks itself."""
    return False


def tile_seconds() -> float | None:
    """Seconds the last run_layers that ran spent in the attention of sequences of several queries
    (prefill slices, verifies), where the backend times it; None here."""
    return None


def decode_forward(plan: object | None, head: object, input_ids: torch.Tensor, positions: torch.Tensor,
                   batch: object) -> torch.Tensor | None:
    """A whole decode step's fp32 logits in one call (see triton_decode); None when the backend
    has no such path, and the model runs the step op by op."""
    return None
