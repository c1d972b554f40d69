import os
import sys

# Test helpers (oracle checkpoint builders) live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, Triton kernels can only run in its interpreter, and Triton fixes interpreter vs compiler
# when it is first imported (its own library included): set it before any test module imports triton.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
