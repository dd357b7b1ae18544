"""Triton reads TRITON_INTERPRET when a kernel is defined: set it before any kernel module is imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
