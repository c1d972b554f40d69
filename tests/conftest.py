import os
import sys

# The shared test harnesses (checkpoint builders, oracles, server and router harnesses) live in one place,
# importable by name from every test folder.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "harness"))

# Without a GPU, Triton kernels can only run in its interpreter, and Triton fixes interpreter vs compiler
# when it is first imported (its own library included): set it before any test module imports triton.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
