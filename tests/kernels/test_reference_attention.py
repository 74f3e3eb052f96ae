"""The reference's split path (a long prompt over a cached prefix as two flash calls merged by
log-sum-exp) gives the masked path's answer."""
from __future__ import annotations

import pytest
import torch

from pdchat.kernels import reference

from .batch import Batch


@pytest.mark.skipif(reference._FLASH_CPU is None, reason="this torch has no CPU flash attention op")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kv_heads,group", [(3, 3), (4, 1)])
def test_split_after_a_prefix_matches_the_masked_path(monkeypatch, dtype, tol, kv_heads, group):
    # one long prompt after a prefix, a short one (masked path either way) and a fresh prompt
    b = Batch([40, 9, 33], [100, 30, 33], kv_heads, group, head_dim=32, block_size=8, dtype=dtype)
    args = (*b.args("cpu"), 32 ** -0.5)
    monkeypatch.setattr(reference, "SPLIT_MIN_QUERIES", 10**9)
    masked = reference.paged_attention(*args, query_lens_host=b.qlens, context_lens_host=b.clens)
    monkeypatch.setattr(reference, "SPLIT_MIN_QUERIES", 16)
    calls = []
    after_prefix = reference._after_prefix
    monkeypatch.setattr(reference, "_after_prefix", lambda *a: calls.append(1) or after_prefix(*a))
    split = reference.paged_attention(*args, query_lens_host=b.qlens, context_lens_host=b.clens)
    assert len(calls) == 1                          # only the 40-query prompt over 60 cached keys
    assert split.dtype == dtype
    torch.testing.assert_close(split.float(), masked.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(masked.float(), b.expected(32 ** -0.5), atol=tol, rtol=tol)
