"""Where the Triton kernel tests run: compiled on a CUDA GPU, or in Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET where there is no GPU)."""
from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
TRUNCATES = "Triton's interpreter truncates fp32->bf16 where the GPU rounds to nearest even"
# bf16 results are checked on a GPU only
DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRET, reason=TRUNCATES))]
