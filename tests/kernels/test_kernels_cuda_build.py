"""Compile checks of the CUDA sources on machines without a GPU (they must build before gpu-check)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from kernel_cases import host_cc

CSRC = Path(__file__).resolve().parents[2] / "namazu" / "csrc"


def nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc is not installed here: the CUDA kernel is compile-checked where nvcc exists")
    return path


def test_grouped_gemm_compiles_for_sm90a(tmp_path):
    # The form HOPPER.md recommends for arch-specific (sm_90a) code; `-arch=sm_90a` is the same target.
    cmd = [nvcc(), "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-Xptxas", "-v", "-c",
           str(CSRC / "nvfp4_grouped_gemm.cu"), "-o", str(tmp_path / "gemm.o")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "spill" not in res.stderr or "0 bytes spill stores" in res.stderr
    assert "bytes stack frame" not in res.stderr or "0 bytes stack frame" in res.stderr


@pytest.mark.parametrize("source,kernels", [("nvfp4_moe_decode.cu", 10), ("nvfp4_moe_prefill.cu", 4)])
def test_device_chosen_kernels_compile_for_sm90a(tmp_path, source, kernels):
    """The split-K decode variants (4 tile shapes x 2 FP4 expansions + 2 reductions) and the large-batch
    kernels (2 row blocks x gate_up/down): no spills, no stack frame (a spill would put the
    register-resident weight stream or the accumulators through local memory)."""
    cmd = [nvcc(), "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-Xptxas", "-v", "-c",
           str(CSRC / source), "-o", str(tmp_path / "k.o")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    entries = res.stderr.count("Compiling entry function")
    assert entries == kernels, res.stderr
    assert res.stderr.count("0 bytes spill stores") == entries, res.stderr
    assert res.stderr.count("0 bytes stack frame") == entries, res.stderr


def cuobjdump() -> str:
    """cuobjdump from NAMAZU_CUOBJDUMP, PATH, beside nvcc, or the one triton's NVIDIA backend ships (the
    dev requirements install triton, so CI reads the SASS too)."""
    try:
        import triton
        shipped = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    except ImportError:
        shipped = None
    for cand in (os.environ.get("NAMAZU_CUOBJDUMP"), shutil.which("cuobjdump"),
                 str(Path(nvcc()).resolve().parent / "cuobjdump"), shipped):
        if cand and os.access(cand, os.X_OK):
            return cand
    pytest.skip("cuobjdump is not installed here (set NAMAZU_CUOBJDUMP): the SASS of the sm_100a cubin is not read")


@pytest.fixture(scope="module")
def sm100_build(tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("sm100") / "k.cubin"
    cmd = [nvcc(), "-cubin", "-gencode=arch=compute_100a,code=sm_100a", "-O3", "-Xptxas", "-v",
           str(CSRC / "nvfp4_moe_sm100.cu"), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stderr, out


def test_blackwell_kernel_compiles_for_sm100a(sm100_build):
    """The quantizer and the tcgen05 GEMMs (gate_up and down for each of the two scale arrangements): no
    spills, no stack frame, and nothing from nvcc or ptxas but its resource report (a warning there, e.g. of
    an unsupported qualifier or unreachable code, would mean wrong code)."""
    log, _ = sm100_build
    assert log.count("Compiling entry function") == 5, log
    assert log.count("0 bytes spill stores") == 5 and log.count("0 bytes stack frame") == 5, log
    noise = [ln for ln in log.splitlines() if ln.strip() and not ln.startswith("ptxas info")
             and "bytes stack frame" not in ln]
    assert noise == [], noise


def test_blackwell_sass_has_the_fp4_tensor_core_path(sm100_build):
    """SASS of the sm_100a cubin: the block-scaled MMA (UTCOMMA.4X: kind::mxf4nvf4 scale_vec::4X), its
    commit (UTCBAR), tensor-memory stores of the scales (STTM.x4, or single-column STTM for the `_sflane`
    arrangement) and loads of the accumulator (LDTM), the allocation (UTCATOMSWS), two MMAs per K stage in
    each GEMM."""
    _, cubin = sm100_build
    sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    kernels = {}
    for block in sass.split("Function : ")[1:]:
        kernels[block.split()[0]] = block
    gemms = [f"nvfp4_sm100_gemm_{op}{sf}" for sf in ("", "_sflane") for op in ("gate_up", "down")]
    assert set(kernels) == {"nvfp4_sm100_quant_act", *gemms}
    for name in gemms:
        body = kernels[name]
        assert body.count("UTCOMMA.4X ") == 2, name
        for op in ("UTCBAR", "LDTM.x16", "UTCATOMSWS", "LDGSTS"):
            assert op in body, (name, op)
        single = "STTM tmem" in body   # .x1: one word per lane
        assert (single, "STTM.x4 " in body) == ((True, False) if name.endswith("_sflane") else (False, True)), name
    assert "UTCOMMA" not in kernels["nvfp4_sm100_quant_act"]


def test_torch_cuda_binding_parses(tmp_path):
    """The binding needs a CUDA torch to build; here it is syntax-checked against the CPU torch's headers
    plus the CUDA toolkit's, with the one generated CUDA header the CPU wheel lacks stubbed."""
    homes = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", str(Path(nvcc()).resolve().parent.parent)]
    found = [Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda_runtime.h").exists()]
    if not found:
        pytest.skip(f"no CUDA headers (cuda_runtime.h) under any of {homes}")
    cuda_include = found[0]
    from torch.utils.cpp_extension import include_paths
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cxx = shutil.which("g++") or pytest.skip("no g++")
    cmd = [cxx, "-std=c++20", "-fsyntax-only", *(f"-I{p}" for p in include_paths()), f"-I{tmp_path}",
           f"-I{cuda_include}", f"-I{sysconfig.get_paths()['include']}", str(CSRC / "cuda" / "binding.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]


def test_cpu_kernel_header_is_plain_c(tmp_path):
    """The C ABI header must stay usable from C (no C++ in it) so other hosts can link the kernel."""
    cc = host_cc("the CPU kernel's C header and its plain-C use")
    src = tmp_path / "use.c"
    src.write_text(f'#include "{CSRC / "cpu" / "nvfp4_moe_cpu.h"}"\nint main(void) {{ return 0; }}\n')
    res = subprocess.run([cc, "-std=c11", "-fsyntax-only", str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
