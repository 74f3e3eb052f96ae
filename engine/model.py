"""One Llama-family transformer (Llama 2/3, Mistral, SmolLM, Qwen2/2.5, Qwen3) over a paged KV cache.

The batch is flat: T tokens from any number of sequences, each with its own position. Attention
is delegated to a backend that writes the new K/V rows into the paged cache and attends over it,
so the same forward serves prefill chunks, decodes and speculative verification. A backend may
also run all blocks in one call (the CPU kernels do for small batches); the op-by-op forward here
is what it must compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Iterator, Mapping, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pdchat import kernels
from pdchat.kernels import reference
from .model_config import ModelConfig

Kernels = SimpleNamespace   # the ops of one backend (pdchat.kernels.load)


@dataclass
class AttentionBatch:
    """Where a forward's T tokens go in the paged KV cache, and what they attend to (built by the
    model runner; semantics in kernels/reference.py)."""
    k_cache: torch.Tensor          # [layers, blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor     # [T] int64, -1 = do not store
    block_tables: torch.Tensor     # [S, max_blocks] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    context_lens: torch.Tensor     # [S] int32
    query_lens_host: list[int]
    context_lens_host: list[int] | None
    scale: float
    # A decode batch replayed from a CUDA graph: its attention's fixed context split count
    # (num_splits in kernels/reference.py), and no host lengths, which a replay could not update.
    decode_splits: int | None = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ops: Kernels) -> torch.Tensor:
        """Store this layer's new K/V, then attend: q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        ops.store_kv(k, v, k_cache, v_cache, self.slot_mapping)
        return ops.paged_attention(q, k_cache, v_cache, self.block_tables, self.query_start_loc, self.context_lens,
                                   self.scale, query_lens_host=self.query_lens_host,
                                   context_lens_host=self.context_lens_host, num_splits=self.decode_splits)


# (weight, scales, bias): scales None for full-precision weights, else quantized ones as the backend stores them.
LinearWeights = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


class LayerWeights(NamedTuple):
    """One block's tensors in the order its forward uses them, for backends that run whole layers."""
    qkv: LinearWeights
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: LinearWeights
    norm_mlp: torch.Tensor
    gate_up: LinearWeights
    down: LinearWeights
    next_norm: torch.Tensor


class HeadWeights(NamedTuple):
    """The tensors around the blocks, for backends that run a whole decode step: the embedding,
    the first block's norm, the vocabulary product and RoPE's cos and sin for every position."""
    embed: torch.Tensor
    first_norm: torch.Tensor
    lm_head: LinearWeights
    rope_table: tuple[torch.Tensor, torch.Tensor]


def active_weights(linear: nn.Module) -> LinearWeights:
    """The weights a linear layer's next forward uses (a QuantLinear says so itself)."""
    active = getattr(linear, "active_weights", None)
    return active() if active is not None else (linear.weight, None, linear.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch,
                ops: Kernels) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:     # per head, as rows of head_dim values
            q = ops.rms_norm(q.reshape(-1, self.head_dim), self.q_norm.weight, self.q_norm.eps).view_as(q)
            k = ops.rms_norm(k.reshape(-1, self.head_dim), self.k_norm.weight, self.k_norm.eps).view_as(k)
        q, k = ops.rope(q, k, cos, sin)
        out = batch.attend(self.layer, q, k, v, ops)
        return self.o(out.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: Kernels) -> torch.Tensor:
        return self.down(ops.silu_mul(self.gate_up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.norm_attn = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.norm_mlp = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, h: torch.Tensor, next_norm: RMSNorm, cos: torch.Tensor,
                sin: torch.Tensor, batch: AttentionBatch, ops: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream, h: its normalised form -> the same two after this block, h
        normalised by `next_norm` (each residual add is fused with the norm that follows it)."""
        x, h = ops.add_rms_norm(x, self.attn(h, cos, sin, batch, ops), self.norm_mlp.weight, self.norm_mlp.eps)
        return ops.add_rms_norm(x, self.mlp(h, ops), next_norm.weight, next_norm.eps)

    def weights(self, next_norm: RMSNorm) -> LayerWeights:
        attn = self.attn
        return LayerWeights(active_weights(attn.qkv),
                            attn.q_norm.weight if attn.q_norm is not None else None,
                            attn.k_norm.weight if attn.k_norm is not None else None,
                            active_weights(attn.o), self.norm_mlp.weight, active_weights(self.mlp.gate_up),
                            active_weights(self.mlp.down), next_norm.weight)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # An explicit (empty) weight skips Embedding's random init, which on the meta device
        # pulls in torch._dynamo and costs over a second at start-up; weights are loaded anyway.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # What each weight's shape must be, whatever form (or device) a loader holds it in.
        self.param_shapes = {name: tuple(p.shape) for name, p in self.named_parameters()}
        self.ops: Kernels = kernels.load("torch")     # the engine picks the device's backend
        self.quant_switch = None      # quant.QuantSwitch once the loader wraps the linears
        self._plans_for: tuple[int, int] | None = None   # (backend, weight version) of _plans
        self._plans: dict[str, object] = {}
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None     # see _rope_table
        with torch.device("cpu"):   # real numbers even when built on the meta device
            self.register_buffer("inv_freq", cfg.rope_inv_freq(), persistent=False)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.norm.weight.dtype
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normalised). on_layer(n)
        is told after each of the first n layers ran (op by op only: a one-call forward is short)."""
        ops = self.ops
        cos, sin = self._rope_rows(positions, batch)
        x = self.embed(input_ids)
        first = self.layers[0].norm_attn
        h = ops.rms_norm(x, first.weight, first.eps)
        if ops.run_layers(self._layer_plan(), x, h, cos, sin, batch):
            return h
        for n, (block, next_norm) in enumerate(zip(self.layers, self._norms_after()), 1):
            x, h = block(x, h, next_norm, cos, sin, batch, ops)
            if on_layer is not None:
                on_layer(n)
        return h

    def _head_weights(self, max_positions: int) -> HeadWeights | None:
        """None when the embedding has no full-precision weight (held quantized or in exact
        blocks: its rows are then rebuilt op by op)."""
        embed = self.embed.weight
        if embed is None:
            return None
        if self.lm_head is None:                  # tied, bare model
            lm_head = (embed, None, None)
        else:                                     # a loader's head; a tied one projects with the embedding
            lm_head = active_weights(getattr(self.lm_head, "embed", self.lm_head))
        return HeadWeights(embed, self.layers[0].norm_attn.weight, lm_head, self._rope_table(max_positions))

    def _rope_table(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """rope()'s cos and sin for positions 0..positions-1 at least, kept: a whole decode step
        looks its row up on the device (a replayed step's positions are not known on the host), and
        every forward its rows. Grown to the next power of two, so a conversation growing a token
        a step rebuilds it a few times, not every step."""
        cached = self._rope_cache
        stale = cached is None or cached[0].device != self.inv_freq.device or cached[0].dtype != self.norm.weight.dtype
        if stale or cached[0].shape[0] < positions:
            size = 1 << max(positions - 1, 255).bit_length()
            self._rope_cache = self.rope(torch.arange(size, device=self.inv_freq.device))
        return self._rope_cache

    def _rope_rows(self, positions: torch.Tensor, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """rope(positions), as rows of the table: the same numbers (each row is rope() of its
        position), looked up in 0.03 ms where computing them took 0.085 of a 6.4 ms decode step
        (int8 weights, 2-core AMD EPYC, 2026-11-27). Computed where the host does not know the
        lengths (a graph's capture)."""
        if not batch.context_lens_host:
            return self.rope(positions)
        cos, sin = self._rope_table(max(batch.context_lens_host))
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _norms_after(self) -> list[RMSNorm]:
        return [b.norm_attn for b in self.layers[1:]] + [self.norm]

    def _layer_plan(self) -> object | None:
        """The backend's prepared form of every block's active weights, for running all layers in
        one call (None: it runs them op by op). Cached per weight set: a self-draft flips int8 on
        and off every step."""
        switch = self.quant_switch
        mode, version = (switch.mode, switch.version) if switch is not None else ("none", 0)
        if self._plans_for != (id(self.ops), version):
            self._plans_for, self._plans = (id(self.ops), version), {}
        if mode not in self._plans:
            cfg = self.cfg
            weights = [block.weights(norm) for block, norm in zip(self.layers, self._norms_after())]
            self._plans[mode] = self.ops.prepare_layers(weights, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                        cfg.rms_norm_eps)
        return self._plans[mode]

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                      max_positions: int) -> torch.Tensor:
        """A decode step's fp32 logits [T, vocab], every position below max_positions: in one call
        where the backend runs the whole step (the Triton kernels, for one row of full-precision
        weights), else op by op."""
        plan, head = self._layer_plan(), self._head_weights(max_positions)
        if plan is not None and head is not None:
            logits = self.ops.decode_forward(plan, head, input_ids, positions, batch)
            if logits is not None:
                return logits
        return self.logits(self(input_ids, positions, batch))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:                  # tied, and not wrapped by the loader (bare model)
            return F.linear(hidden, self.embed.weight).float()
        return self.lm_head(hidden).float()

    # ---- weights ---------------------------------------------------------------------------
    @torch.no_grad()
    def load_hf_state_dict(self, hf: Mapping[str, torch.Tensor],
                           place: Callable[[str, torch.Tensor], None] | None = None) -> None:
        """Weights named as in Hugging Face checkpoints, fused into ours (q/k/v, gate/up), one
        tensor at a time: `hf` may read each one only when it is looked up (checkpoint.py).
        place(name, tensor) stores each (the loader's, which may quantize); by default it is
        copied into the parameter."""
        params = dict(self.named_parameters())
        for name, tensor in self._from_hf(hf):
            if self.param_shapes[name] != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {self.param_shapes[name]}")
            if place is not None:
                place(name, tensor)
            else:
                params[name].copy_(tensor)

    def _from_hf(self, hf: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """(our parameter name, its tensor) for every weight, each Hugging Face name looked up once."""
        cfg = self.cfg

        def take(name: str) -> torch.Tensor:
            try:
                return hf[name]
            except KeyError:
                raise KeyError(f"weight {name!r} missing from checkpoint") from None

        embed = take("model.embed_tokens.weight")
        yield "embed.weight", embed
        if not cfg.tie_embeddings:
            yield "lm_head.weight", take("lm_head.weight") if "lm_head.weight" in hf else embed
        del embed        # a 128K-token vocabulary is 1 GB in fp32: never held through the whole load
        yield "norm.weight", take("model.norm.weight")
        for i in range(cfg.num_layers):
            p, a = f"model.layers.{i}.", f"layers.{i}."
            attn = p + "self_attn."
            yield a + "attn.qkv.weight", torch.cat([take(attn + f"{n}_proj.weight") for n in "qkv"])
            if cfg.qkv_bias:
                yield a + "attn.qkv.bias", torch.cat([take(attn + f"{n}_proj.bias") for n in "qkv"])
            if cfg.qk_norm:
                yield a + "attn.q_norm.weight", take(attn + "q_norm.weight")
                yield a + "attn.k_norm.weight", take(attn + "k_norm.weight")
            yield a + "attn.o.weight", take(attn + "o_proj.weight")
            yield a + "mlp.gate_up.weight", torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            yield a + "mlp.down.weight", take(p + "mlp.down_proj.weight")
            yield a + "norm_attn.weight", take(p + "input_layernorm.weight")
            yield a + "norm_mlp.weight", take(p + "post_attention_layernorm.weight")

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())
