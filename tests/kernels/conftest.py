"""Kernel tests run Triton's interpreter on CPU when there is no GPU (toy sizes, see the tests).

The switch must be set before any kernel module is imported: @triton.jit reads it at decoration.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
