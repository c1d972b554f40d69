"""namazu: an inference server for DeepSeek-V3 / Kimi-K2 class MoE models."""
import os
from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
requirements = [
    line.strip()
    for line in (here / "requirements.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]



def kernel_extensions() -> tuple[list, dict]:
    """The C++ kernels in namazu/csrc, built against the installed torch (the Makefile installs with
    --no-build-isolation so torch is importable here). The CPU NVFP4 MoE kernel is built everywhere;
    the CUDA one only where torch has CUDA and nvcc is found (NAMAZU_BUILD_CUDA=0 skips it).
    NAMAZU_BUILD_EXT=0 skips both (the torch backends still work)."""
    if os.environ.get("NAMAZU_BUILD_EXT", "1") == "0":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        print("namazu: torch is not importable at build time; skipping the C++ kernels "
              "(install with --no-build-isolation after torch to build them)")
        return [], {}
    csrc = "namazu/csrc"
    exts = [CppExtension(
        "namazu._nvfp4_cpu",
        [f"{csrc}/cpu/binding.cpp", f"{csrc}/cpu/nvfp4_moe_cpu.cpp", f"{csrc}/cpu/nvfp4_decode_cpu.cpp",
         f"{csrc}/cpu/small_gemm_bf16.cpp", f"{csrc}/cpu/small_gemm_bf16_op.cpp", f"{csrc}/cpu/packed_gemm_bf16.cpp",
         f"{csrc}/cpu/small_moe_bf16_op.cpp"],
        # No -march: the kernel picks its AVX2 / AVX-512 path at run time, so the build is portable.
        extra_compile_args=["-O3", "-fopenmp", "-Wno-maybe-uninitialized", "-Wno-uninitialized"],
        extra_link_args=["-fopenmp"],
    )]
    if torch.version.cuda and CUDA_HOME and os.environ.get("NAMAZU_BUILD_CUDA", "1") != "0":
        exts.append(CUDAExtension(
            "namazu._nvfp4_cuda",
            [f"{csrc}/cuda/binding.cpp", f"{csrc}/nvfp4_grouped_gemm.cu"],
            extra_compile_args={"cxx": ["-O3"],
                                "nvcc": ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo"]},
        ))
    return exts, {"build_ext": BuildExtension}


ext_modules, cmdclass = kernel_extensions()

setup(
    name="namazu",
    version="0.1.0",
    description="Inference server for DeepSeek-V3 / Kimi-K2 class Mixture-of-Experts models",
    packages=find_packages(include=["namazu", "namazu.*", "server", "server.*"]),
    package_data={"namazu": ["assets/**/*", "csrc/*", "csrc/**/*", "kernels/tables/*.json"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.10",
    install_requires=["torch>=2.5", *requirements],
)
