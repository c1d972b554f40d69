"""The CUDA NVFP4 grouped GEMM of namazu/csrc as a cubin, loaded and launched through cuda-python's driver
bindings on torch's current stream: no torch extension built against the machine's torch, and the launch
is an ordinary kernel on the current stream, so it is captured by a CUDA graph like any other.

  compile_cubin()   nvcc -cubin for sm_90a (cached by the sources' hash); needs only the toolkit
  kernel_names()    the two kernel instantiations (gate_up, down) read from the cubin's ELF symbols
  GemmArgs          the C struct Nvfp4GemmArgs of nvfp4_grouped_gemm.h, byte for byte (ctypes)
  CubinGroupedGemm  cuModuleLoadData + cuModuleGetFunction once, then cuLaunchKernel per call with the
                    grid and block of the C launcher (nvfp4_grouped_gemm_sm90)

The torch binding (kernels/cuda_moe.py, namazu._nvfp4_cuda) stays as the fallback. On a machine without
a driver everything up to `CubinGroupedGemm` (which calls cuInit) runs, and the tests cover it there.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = ("nvfp4_grouped_gemm.cu", "nvfp4_grouped_gemm.h")
ARCH = "sm_90a"
BLOCK_M = 16        # NVFP4_GEMM_BLOCK_M
BLOCK_N = 64        # kBlockN of the .cu
THREADS = 128       # kThreads of the .cu
K_ALIGN = 128       # NVFP4_GEMM_K_ALIGN
KERNEL = "nvfp4_grouped_gemm_kernel"


class GemmArgs(ctypes.Structure):
    """Nvfp4GemmArgs (nvfp4_grouped_gemm.h): nine pointers, five int64, one int (natural alignment)."""

    _fields_ = [("a", ctypes.c_void_p), ("sorted_pairs", ctypes.c_void_p), ("block_expert", ctypes.c_void_p),
                ("total_rows", ctypes.c_void_p), ("w_packed", ctypes.c_void_p), ("w_scale", ctypes.c_void_p),
                ("w_gs", ctypes.c_void_p), ("topk_weights", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("max_rows", ctypes.c_int64), ("num_pairs", ctypes.c_int64), ("top_k", ctypes.c_int64),
                ("k_dim", ctypes.c_int64), ("n_out", ctypes.c_int64), ("gate_up", ctypes.c_int)]


def find_nvcc() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for cand in ([str(Path(cuda_home) / "bin" / "nvcc")] if cuda_home else []) + [shutil.which("nvcc") or ""]:
        if cand and os.access(cand, os.X_OK):
            return cand
    raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH): the cubin cannot be compiled")


def sources_digest(sources: tuple[str, ...] = SOURCES, arch: str = ARCH) -> str:
    """Hash of the kernel sources and target: names a cubin, and ties a recorded tuning table to them."""
    return hashlib.sha256(b"".join((CSRC / s).read_bytes() for s in sources) + arch.encode()).hexdigest()[:16]


def compile_cubin(cache_dir: str | Path | None = None, nvcc: str | None = None, sources: tuple[str, ...] = SOURCES,
                  arch: str = ARCH) -> Path:
    """Compiles sources[0] (its headers after it) to a cubin for `arch` (default: the grouped GEMM for
    sm_90a); reuses the cached one while the sources match."""
    digest = sources_digest(sources, arch)
    cache = Path(cache_dir or Path(tempfile.gettempdir()) / "namazu-cubin")
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{Path(sources[0]).stem}-{arch}-{digest}.cubin"
    if out.is_file():
        return out
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [nvcc or find_nvcc(), "-cubin", f"-gencode=arch=compute_{arch[3:]},code={arch}", "-O3",
           "-o", str(tmp), str(CSRC / sources[0])]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
    tmp.replace(out)
    return out


def elf_function_symbols(image: bytes) -> list[str]:
    """Names of the FUNC symbols of a 64-bit little-endian ELF image (a cubin)."""
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF image")
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for sh_type, offset, size, link, entsize in ((s[1], s[4], s[5], s[6], s[9]) for s in sections):
        if sh_type != 2:            # SHT_SYMTAB
            continue
        str_off = sections[link][4]
        for j in range(size // (entsize or 24)):
            st_name, st_info = struct.unpack_from("<IB", image, offset + j * (entsize or 24))
            if st_info & 0xF == 2:  # STT_FUNC
                end = image.index(b"\0", str_off + st_name)
                names.append(image[str_off + st_name:end].decode())
    return names


def kernel_names(image: bytes) -> dict[bool, str]:
    """{gate_up: mangled name} of the two template instantiations (ILb1E: true, ILb0E: false)."""
    found = {}
    for name in elf_function_symbols(image):
        if KERNEL in name:
            if "ILb1E" in name:
                found[True] = name
            elif "ILb0E" in name:
                found[False] = name
    if set(found) != {True, False}:
        raise RuntimeError(f"the cubin lacks the {KERNEL}<true/false> instantiations (found {sorted(found.values())})")
    return found


def launch_shape(max_rows: int, n_out: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of one launch, as nvfp4_grouped_gemm_sm90 computes them."""
    return (max_rows // BLOCK_M, -(-n_out // BLOCK_N), 1), (THREADS, 1, 1)


def check_args(args: GemmArgs) -> None:
    """The C launcher's size checks (it returns cudaErrorInvalidValue; here a named error)."""
    if args.k_dim <= 0 or args.k_dim % K_ALIGN:
        raise ValueError(f"k_dim {args.k_dim} must be a positive multiple of {K_ALIGN}")
    if args.n_out <= 0 or args.top_k <= 0 or args.max_rows % BLOCK_M:
        raise ValueError(f"n_out {args.n_out}, top_k {args.top_k} must be positive and max_rows {args.max_rows} "
                         f"a multiple of {BLOCK_M}")


def _check(result) -> object:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err!r}")
    return rest[0] if len(rest) == 1 else rest


class CubinGroupedGemm:
    """The cubin's two kernels loaded into the current context; `launch` runs one grouped GEMM."""

    def __init__(self, cubin: str | Path | None = None):
        from cuda.bindings import driver

        self.driver = driver
        image = Path(cubin or compile_cubin()).read_bytes()
        names = kernel_names(image)
        _check(driver.cuInit(0))
        import torch

        # The module loads into the current context, which must be torch's: the device's primary context
        # (torch creates it lazily, at its first allocation, so make it current here).
        device = _check(driver.cuDeviceGet(torch.cuda.current_device()))
        _check(driver.cuCtxSetCurrent(_check(driver.cuDevicePrimaryCtxRetain(device))))
        self.module = _check(driver.cuModuleLoadData(image))
        self.functions = {gate_up: _check(driver.cuModuleGetFunction(self.module, name.encode()))
                          for gate_up, name in names.items()}

    def launch(self, args: GemmArgs, stream: int | None = None) -> None:
        """Launches on `stream` (default: torch's current stream) without synchronising."""
        check_args(args)
        if args.max_rows == 0:
            return
        if stream is None:
            import torch
            stream = torch.cuda.current_stream().cuda_stream
        grid, block = launch_shape(args.max_rows, args.n_out)
        params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        _check(self.driver.cuLaunchKernel(self.functions[bool(args.gate_up)], *grid, *block, 0, stream,
                                          ctypes.addressof(params), 0))


def gemm_args(a, sorted_pairs, block_expert, total_rows, w_packed, w_scale, w_gs, topk_weights, out,
              num_pairs: int, top_k: int, gate_up: bool) -> GemmArgs:
    """The struct of one launch from device tensors (the torch binding's argument order)."""
    rows = w_packed.shape[1]
    return GemmArgs(a=a.data_ptr(), sorted_pairs=sorted_pairs.data_ptr(), block_expert=block_expert.data_ptr(),
                    total_rows=total_rows.data_ptr(), w_packed=w_packed.data_ptr(), w_scale=w_scale.data_ptr(),
                    w_gs=w_gs.data_ptr(), topk_weights=topk_weights.data_ptr() if topk_weights is not None else None,
                    out=out.data_ptr(), max_rows=sorted_pairs.shape[0], num_pairs=num_pairs, top_k=top_k,
                    k_dim=a.shape[1], n_out=rows // 2 if gate_up else rows, gate_up=int(gate_up))


_LOADED: CubinGroupedGemm | None = None


def cubin_moe_nvfp4(x, topk_ids, topk_weights, w):
    """The routed experts through the cubin (loaded once per process) on torch's current stream."""
    from namazu.kernels.cuda_moe import cuda_moe_nvfp4

    global _LOADED
    if _LOADED is None:
        _LOADED = CubinGroupedGemm()
    return cuda_moe_nvfp4(x, topk_ids, topk_weights, w, gemm=lambda *a: _LOADED.launch(gemm_args(*a)))
