"""The cubin path of the CUDA grouped GEMM (namazu/kernels/cubin_loader.py), up to where a driver is
needed: the ctypes argument struct against the C header's layout (compiled with gcc), the cubin built with
nvcc and its kernels found by the ELF reader (checked against readelf), and a clear error without a driver."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from kernel_cases import host_cc

from namazu.kernels import cubin_loader as cl

FIELDS = [f for f, _ in cl.GemmArgs._fields_]


def _cuda_include() -> Path:
    for home in ("/usr/local/cuda",):
        inc = Path(home) / "include"
        if (inc / "cuda_runtime.h").is_file():
            return inc
    nvcc = shutil.which("nvcc")
    if nvcc:
        inc = Path(nvcc).resolve().parent.parent / "include"
        if (inc / "cuda_runtime.h").is_file():
            return inc
    pytest.skip("no CUDA headers here")


def test_args_struct_matches_the_c_header(tmp_path):
    cc = host_cc("the kernel header's host-side rules")
    prints = "".join(f'printf("%zu %zu ", offsetof(Nvfp4GemmArgs, {f}), sizeof(((Nvfp4GemmArgs*)0)->{f}));'
                     for f in FIELDS)
    src = tmp_path / "layout.c"
    src.write_text(f'#include <stdio.h>\n#include <stddef.h>\n#include "{cl.CSRC / "nvfp4_grouped_gemm.h"}"\n'
                   f'int main(void) {{ {prints} printf("%zu", sizeof(Nvfp4GemmArgs)); return 0; }}\n')
    exe = tmp_path / "layout"
    res = subprocess.run([cc, "-std=c11", f"-I{_cuda_include()}", str(src), "-o", str(exe)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    *fields, size = map(int, subprocess.run([str(exe)], capture_output=True, text=True).stdout.split())
    assert fields == [v for f in FIELDS for v in (getattr(cl.GemmArgs, f).offset, getattr(cl.GemmArgs, f).size)]
    assert size == ctypes_size()


def ctypes_size() -> int:
    import ctypes
    return ctypes.sizeof(cl.GemmArgs)


@pytest.fixture(scope="module")
def cubin(tmp_path_factory) -> Path:
    try:
        nvcc = cl.find_nvcc()
    except RuntimeError:
        pytest.skip("nvcc is not installed here")
    return cl.compile_cubin(tmp_path_factory.mktemp("cubin"), nvcc)


def test_cubin_holds_both_kernels(cubin):
    image = cubin.read_bytes()
    names = cl.kernel_names(image)
    assert set(names) == {True, False} and names[True] != names[False]
    readelf = shutil.which("readelf")
    if readelf:
        out = subprocess.run([readelf, "-sW", str(cubin)], capture_output=True, text=True).stdout
        funcs = {line.split()[-1] for line in out.splitlines() if " FUNC " in line}
        assert set(cl.elf_function_symbols(image)) == funcs
    # Cached by the sources' hash: a second call returns the same file without compiling.
    assert cl.compile_cubin(cubin.parent) == cubin


def test_launch_shape_and_checks():
    assert cl.launch_shape(64, 100) == ((4, 2, 1), (128, 1, 1))
    args = cl.GemmArgs(max_rows=32, num_pairs=20, top_k=2, k_dim=256, n_out=64, gate_up=1)
    cl.check_args(args)
    with pytest.raises(ValueError, match="k_dim"):
        cl.check_args(cl.GemmArgs(max_rows=32, top_k=2, k_dim=100, n_out=64))
    with pytest.raises(ValueError, match="max_rows"):
        cl.check_args(cl.GemmArgs(max_rows=30, top_k=2, k_dim=128, n_out=64))
    with pytest.raises(ValueError, match="ELF"):
        cl.elf_function_symbols(b"not a cubin")


def test_loading_needs_a_driver(cubin):
    """Without a driver the loader fails with a clear error; with one (gpu-check) it loads both kernels."""
    pytest.importorskip("cuda.bindings")
    import torch
    if torch.cuda.is_available():
        assert set(cl.CubinGroupedGemm(cubin).functions) == {True, False}
        return
    with pytest.raises(RuntimeError, match="libcuda|CUDA driver error|driver"):
        cl.CubinGroupedGemm(cubin)
