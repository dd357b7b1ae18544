"""Engine tests run on the CPU in float32; Triton variants run under its interpreter, which reads
TRITON_INTERPRET when a kernel is defined, so it is set before any kernel module is imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
