"""The Hopper NVFP4 kernels chosen on the device: split-K decode (namazu/csrc/nvfp4_moe_decode.cu, 1-64
tokens), large-batch grouped GEMM (nvfp4_moe_prefill.cu, 64/128-row blocks), and the table that picks one.

  prepack / DecodePrepackCache   ModelOpt tensors -> the GPU decode layout (nvfp4_moe_decode.h), once per
                                 layer, on the device with torch (a reshape and a permute)
  Variant                        a compiled decode tile shape (n8 tiles per warp, warps per CTA) and a K split
  PrefillVariant                 a large-batch kernel's row block (64 or 128)
  CubinDecode / CubinPrefill     the cubins' kernels through cuda-python; `moe` runs one layer on a variant
  SelectionTable                 what bench/tune_cuda_moe.py measured on a device: which variants passed
                                 their check against the torch reference there, and the fastest of them
                                 per token bucket; `choose` refuses a variant that failed and anything
                                 when the table is for another device or other kernel sources
  select_decode                  the real path's question (backends.py's cuda NVFP4): which variant, if
                                 any, runs this call; None means the default, the 16-row grouped GEMM
  Sm100Variant / select_w4a4     the Blackwell W4A4 kernel (kernels/cuda_sm100.py): named in a table
                                 recorded on a compute capability 10.x device only, chosen only there and
                                 only if it passed its check on that device; never on 9.x

No table or a stale one: the grouped GEMM (cuda_moe.py) runs at every size, as before.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from namazu.kernels import cubin_loader as cl
from namazu.kernels.moe_dispatch import block_dispatch
from namazu.kernels.moe_types import NVFP4MoEWeights

logger = logging.getLogger(__name__)

SOURCES = ("nvfp4_moe_decode.cu", "nvfp4_moe_decode.h", "nvfp4_e2m1_bf16.h")
PREFILL_SOURCES = ("nvfp4_moe_prefill.cu", "nvfp4_grouped_gemm.h")
PREFILL_BLOCKS = (64, 128)
ARCH = "sm_90a"
BLOCK_M, TILE_K, TILE_ROWS, TILE_BYTES = 16, 128, 8, 576   # nvfp4_moe_decode.h
MAX_DECODE_TOKENS = 64
NO_LIMIT = 2 ** 31 - 1   # max_tokens of a table's last bucket: every larger batch
SHAPES = ((2, 4), (4, 4), (8, 4), (4, 8))   # NVFP4_DECODE_VARIANTS of the .cu, in its order
DEQUANT = ("lut", "prmt")   # FP4 expansion: shared-memory byte table, or register byte permutes
SPLITS = (1, 2, 4, 8)
TABLE_ENV = "NAMAZU_CUDA_MOE_TABLE"
TABLE_DIR = Path(__file__).resolve().parent / "tables"
TABLE_VERSION = 1
SM100_SOURCES = ("nvfp4_moe_sm100.cu", "nvfp4_moe_sm100.h")
SM100_ARCH = "sm_100a"
SM100_MAJOR = 10   # compute capability major of the devices the sm_100a cubin runs on (B200, GB200)


@dataclass(frozen=True)
class Variant:
    nt: int       # n8 tiles per warp
    warps: int    # warps per CTA
    split: int    # K splits
    dq: str = "lut"

    @property
    def name(self) -> str:
        return f"nt{self.nt}_w{self.warps}_{self.dq}_s{self.split}"

    @property
    def kernel(self) -> str:
        return f"nvfp4_decode_gemm_nt{self.nt}_w{self.warps}_{self.dq}"

    @classmethod
    def parse(cls, name: str) -> Variant:
        m = re.fullmatch(r"nt(\d+)_w(\d+)_([a-z]+)_s(\d+)", name)
        if m is None:
            raise ValueError(f"not a decode variant name: {name!r} (want nt<N>_w<W>_<lut|prmt>_s<S>)")
        v = cls(int(m[1]), int(m[2]), int(m[4]), m[3])
        if (v.nt, v.warps) not in SHAPES or v.dq not in DEQUANT or v.split < 1:
            raise ValueError(f"decode variant {name!r} is not compiled (shapes {SHAPES}, {DEQUANT}, split >= 1)")
        return v


VARIANTS = tuple(Variant(nt, w, s, dq) for nt, w in SHAPES for dq in DEQUANT for s in SPLITS)


@dataclass(frozen=True)
class PrefillVariant:
    block_m: int   # rows per CTA (the dispatch's block_m)

    @property
    def name(self) -> str:
        return f"pf_m{self.block_m}"

    def kernel(self, gate_up: bool) -> str:
        return f"nvfp4_prefill_gemm_m{self.block_m}_{'gate_up' if gate_up else 'down'}"


PREFILL_VARIANTS = tuple(PrefillVariant(b) for b in PREFILL_BLOCKS)


SM100_SF = ("x4", "lane")   # scale-factor arrangements in tensor memory (nvfp4_moe_sm100.h)


@dataclass(frozen=True)
class Sm100Variant:
    """The Blackwell W4A4 grouped GEMM (nvfp4_moe_sm100.cu): one MMA tile of 128 rows per CTA, the block
    scales in tensor memory as 32 x 4 words duplicated in every lane partition (`x4`, the default) or one
    word per lane = row (`lane`); the device check tells which the MMA reads."""
    sf: str = "x4"

    @property
    def name(self) -> str:
        return "bw_w4a4_m128" + ("" if self.sf == "x4" else f"_sf{self.sf}")

    def kernel(self, gate_up: bool) -> str:
        return f"nvfp4_sm100_gemm_{'gate_up' if gate_up else 'down'}" + ("" if self.sf == "x4" else f"_sf{self.sf}")


SM100_VARIANTS = tuple(Sm100Variant(sf) for sf in SM100_SF)
ANY_VARIANT = Variant | PrefillVariant | Sm100Variant


def parse_variant(name: str) -> ANY_VARIANT:
    """A decode (nt<N>_w<W>_s<S>), large-batch (pf_m<BM>) or Blackwell (bw_w4a4_m128) variant by name;
    raises if it is not compiled."""
    if name.startswith("bw_"):
        found = [v for v in SM100_VARIANTS if v.name == name]
        if not found:
            raise ValueError(f"Blackwell variant {name!r} is not compiled ({[v.name for v in SM100_VARIANTS]})")
        return found[0]
    m = re.fullmatch(r"pf_m(\d+)", name)
    if m is None:
        return Variant.parse(name)
    if int(m.group(1)) not in PREFILL_BLOCKS:
        raise ValueError(f"large-batch variant {name!r} is not compiled (row blocks {PREFILL_BLOCKS})")
    return PrefillVariant(int(m.group(1)))


def table_digest(capability: tuple[int, int] = (9, 0)) -> str:
    """The kernel sources a table measured: all of the device's kernels (the sm_90a ones, or the sm_100a one
    on a 10.x device), so an edit of any of them invalidates it."""
    if capability[0] == SM100_MAJOR:
        return cl.sources_digest(SM100_SOURCES, SM100_ARCH)
    return cl.sources_digest(SOURCES + PREFILL_SOURCES, ARCH)


CHECK_TOL = 1e-2   # relative error against torch_moe_nvfp4 a variant must stay under on the device


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Partials and outputs (a seam for tests that poison them to prove every element is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def launch_grid(v: Variant, rows: int, max_rows: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of one split-K GEMM, as nvfp4_decode_moe_sm90 computes them."""
    cols = TILE_ROWS * v.nt * v.warps
    return (-(-rows // cols), v.split, max_rows // BLOCK_M), (32 * v.warps, 1, 1)


def reduce_grid(total: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    return (min(total // 256 + 1, 4096), 1, 1), (256, 1, 1)


# ---- the decode layout ----------------------------------------------------------------------------------

def prepack(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 [E, R, K/2] nibbles + e4m3 [E, R, K/16] scales -> uint8 [E, R/8, K/128, 576] tiles: row r of a
    tile is its 64 ModelOpt bytes at r*64, then the 8 rows' 8 scales at 512 + r*8."""
    e, r, kb = packed.shape
    k = 2 * kb
    if r % TILE_ROWS or k % TILE_K or tuple(scale.shape) != (e, r, k // 16):
        raise ValueError(f"the GPU decode layout needs rows % {TILE_ROWS} == 0 and K % {TILE_K} == 0 and "
                         f"scales [E, R, K/16]; got nibbles {tuple(packed.shape)}, scales {tuple(scale.shape)}")
    c = k // TILE_K
    q = packed.reshape(e, r // 8, 8, c, 64).permute(0, 1, 3, 2, 4).reshape(e, r // 8, c, 512)
    s = scale.view(torch.uint8).reshape(e, r // 8, 8, c, 8).permute(0, 1, 3, 2, 4).reshape(e, r // 8, c, 64)
    return torch.cat([q, s], dim=-1).contiguous()


def unpack(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `prepack` (ModelOpt nibbles and uint8 scale codes), for tests."""
    e, rt, c, _ = tiles.shape
    q = tiles[..., :512].reshape(e, rt, c, 8, 64).permute(0, 1, 3, 2, 4).reshape(e, rt * 8, c * 64)
    s = tiles[..., 512:].reshape(e, rt, c, 8, 8).permute(0, 1, 3, 2, 4).reshape(e, rt * 8, c * 8)
    return q, s


def lane_values(tiles: torch.Tensor, expert: int, tile: int, chunk: int, lane: int) -> torch.Tensor:
    """fp32 [32]: the weights lane `lane` feeds the tensor cores from one tile (real k = 32t .. 32t+31 of
    row g), read with the kernel's own byte offsets (lane*16 nibbles, 512 + g*8 + 2t scales); a test
    checks them against ModelOpt's dequantization, so the layout and the kernel's reading of it agree."""
    from namazu.quant.nvfp4 import e2m1_decode
    g, t = lane // 4, lane % 4
    raw = tiles[expert, tile, chunk]
    nib = raw[lane * 16:(lane + 1) * 16].to(torch.int64)
    codes = torch.stack([nib & 0xF, nib >> 4], dim=1).reshape(32)
    sc = raw[512 + g * 8 + 2 * t:512 + g * 8 + 2 * t + 2].view(torch.float8_e4m3fn).float()
    return e2m1_decode(codes.to(torch.uint8)) * sc.repeat_interleave(16)


@dataclass(frozen=True)
class DecodeWeights:
    w13: torch.Tensor   # [E, 2I/8, H/128, 576]
    w2: torch.Tensor    # [E, H/8, I/128, 576]


class DecodePrepackCache:
    """One decode layout per layer, keyed by the ModelOpt tensors it came from (as cpu_decode.PrepackCache:
    an in-place write bumps their version and invalidates the entry; freeing them drops it)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, tuple, DecodeWeights]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, w: NVFP4MoEWeights) -> DecodeWeights:
        src = (w.w13_packed, w.w13_scale, w.w2_packed, w.w2_scale)
        key, stamp = id(w.w13_packed), tuple((t.data_ptr(), t._version) for t in src)
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is w.w13_packed and hit[1] == stamp:
            return hit[2]
        d = DecodeWeights(prepack(w.w13_packed, w.w13_scale), prepack(w.w2_packed, w.w2_scale))
        entries = self._entries
        entries[key] = (weakref.ref(w.w13_packed, lambda _r, k=key: entries.pop(k, None)), stamp, d)
        return d


# ---- the kernels through cuda-python --------------------------------------------------------------------

class DecodeArgs(ctypes.Structure):
    """Nvfp4DecodeArgs (nvfp4_moe_decode.h)."""

    _fields_ = [("a", ctypes.c_void_p), ("sorted_pairs", ctypes.c_void_p), ("block_expert", ctypes.c_void_p),
                ("total_rows", ctypes.c_void_p), ("w_tiles", ctypes.c_void_p), ("partial", ctypes.c_void_p),
                ("max_rows", ctypes.c_int64), ("num_pairs", ctypes.c_int64), ("a_div", ctypes.c_int64),
                ("k_dim", ctypes.c_int64), ("rows", ctypes.c_int64), ("split", ctypes.c_int64)]


class ReduceArgs(ctypes.Structure):
    """Nvfp4DecodeReduceArgs (nvfp4_moe_decode.h)."""

    _fields_ = [("partial", ctypes.c_void_p), ("w_gs", ctypes.c_void_p), ("pair_expert", ctypes.c_void_p),
                ("topk_weights", ctypes.c_void_p), ("out", ctypes.c_void_p), ("num_pairs", ctypes.c_int64),
                ("top_k", ctypes.c_int64), ("rows", ctypes.c_int64), ("split", ctypes.c_int64)]


def compile_decode_cubin(cache_dir: str | Path | None = None, nvcc: str | None = None) -> Path:
    return cl.compile_cubin(cache_dir, nvcc, sources=SOURCES, arch=ARCH)


def compile_prefill_cubin(cache_dir: str | Path | None = None, nvcc: str | None = None) -> Path:
    return cl.compile_cubin(cache_dir, nvcc, sources=PREFILL_SOURCES, arch=ARCH)


def kernel_names() -> set[str]:
    return {v.kernel for v in VARIANTS} | {"nvfp4_decode_reduce_gate_up", "nvfp4_decode_reduce_down"}


def prefill_kernel_names() -> set[str]:
    return {v.kernel(gu) for v in PREFILL_VARIANTS for gu in (True, False)}


def prefill_grid(v: PrefillVariant, max_rows: int, n_out: int, gate_up: bool):
    """(grid, block) of one large-batch launch, as nvfp4_prefill_gemm_sm90 computes them."""
    cols = 64 if gate_up else 128
    return (max_rows // v.block_m, -(-n_out // cols), 1), (256, 1, 1)


class _Cubin:
    """A cubin loaded into torch's context (the device's primary context), its named kernels resolved."""

    def __init__(self, image: bytes, names: set[str], what: str):
        from cuda.bindings import driver

        self.driver = driver
        missing = names - set(cl.elf_function_symbols(image))
        if missing:
            raise RuntimeError(f"the {what} cubin lacks the kernels {sorted(missing)}")
        cl._check(driver.cuInit(0))
        device = cl._check(driver.cuDeviceGet(torch.cuda.current_device()))
        cl._check(driver.cuCtxSetCurrent(cl._check(driver.cuDevicePrimaryCtxRetain(device))))
        self.module = cl._check(driver.cuModuleLoadData(image))
        self.functions = {name: cl._check(driver.cuModuleGetFunction(self.module, name.encode())) for name in names}

    def _launch(self, name: str, grid, block, args: ctypes.Structure) -> None:
        params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        stream = torch.cuda.current_stream().cuda_stream
        cl._check(self.driver.cuLaunchKernel(self.functions[name], *grid, *block, 0, stream,
                                             ctypes.addressof(params), 0))


class CubinPrefill(_Cubin):
    """The large-batch kernels; `moe` is cuda_moe_nvfp4 (same contract) with the variant's row blocks."""

    def __init__(self, cubin: str | Path | None = None):
        super().__init__(Path(cubin or compile_prefill_cubin()).read_bytes(), prefill_kernel_names(), "large-batch")

    def moe(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: NVFP4MoEWeights,
            v: PrefillVariant) -> torch.Tensor:
        from namazu.kernels.cuda_moe import cuda_moe_nvfp4

        def gemm(*a) -> None:
            args = cl.gemm_args(*a)
            cl.check_args(args)
            if args.max_rows:
                self._launch(v.kernel(bool(args.gate_up)), *prefill_grid(v, args.max_rows, args.n_out,
                                                                         bool(args.gate_up)), args)
        return cuda_moe_nvfp4(x, topk_ids, topk_weights, w, gemm=gemm, block_m=v.block_m)


class CubinDecode(_Cubin):
    """The decode cubin; `moe` is the routed-experts layer on one split-K variant."""

    def __init__(self, cubin: str | Path | None = None):
        super().__init__(Path(cubin or compile_decode_cubin()).read_bytes(), kernel_names(), "decode")

    def _gemm(self, v: Variant, a: torch.Tensor, a_div: int, bd, tiles: torch.Tensor, rows: int) -> torch.Tensor:
        partial = _empty((v.split, bd.num_pairs, rows), torch.float32, a.device)
        args = DecodeArgs(a=a.data_ptr(), sorted_pairs=bd.sorted_pairs.data_ptr(),
                          block_expert=bd.block_expert.data_ptr(), total_rows=bd.total_rows.data_ptr(),
                          w_tiles=tiles.data_ptr(), partial=partial.data_ptr(), max_rows=bd.max_rows,
                          num_pairs=bd.num_pairs, a_div=a_div, k_dim=a.shape[1], rows=rows, split=v.split)
        self._launch(v.kernel, *launch_grid(v, rows, bd.max_rows), args)
        return partial

    def moe(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: NVFP4MoEWeights,
            d: DecodeWeights, v: Variant) -> torch.Tensor:
        """[N, H] in x's dtype; four launches, no host sync (CUDA-graph capturable)."""
        n, hidden = x.shape
        top_k, inter = topk_ids.shape[1], w.intermediate_size
        if n == 0:
            return torch.zeros_like(x)
        xb = x.to(torch.bfloat16).contiguous()
        bd = block_dispatch(topk_ids, w.num_experts, BLOCK_M)
        pair_expert = topk_ids.reshape(-1).to(torch.int32)
        tw = topk_weights.reshape(-1).float().contiguous()
        part = self._gemm(v, xb, top_k, bd, d.w13, 2 * inter)
        act = _empty((bd.num_pairs, inter), torch.bfloat16, x.device)
        gs13, gs2 = w.w13_gs.float().contiguous(), w.w2_gs.float().contiguous()
        red = ReduceArgs(partial=part.data_ptr(), w_gs=gs13.data_ptr(), pair_expert=pair_expert.data_ptr(),
                         topk_weights=None, out=act.data_ptr(), num_pairs=bd.num_pairs, top_k=top_k,
                         rows=2 * inter, split=v.split)
        self._launch("nvfp4_decode_reduce_gate_up", *reduce_grid(bd.num_pairs * inter), red)
        part2 = self._gemm(v, act, 1, bd, d.w2, hidden)
        out = _empty((n, hidden), torch.float32, x.device)
        red2 = ReduceArgs(partial=part2.data_ptr(), w_gs=gs2.data_ptr(), pair_expert=pair_expert.data_ptr(),
                          topk_weights=tw.data_ptr(), out=out.data_ptr(), num_pairs=bd.num_pairs, top_k=top_k,
                          rows=hidden, split=v.split)
        self._launch("nvfp4_decode_reduce_down", *reduce_grid(n * hidden), red2)
        # Freeing the temporaries while the launches are queued is safe: the caching allocator hands their
        # memory only to work queued later on the same stream.
        return out.to(x.dtype)


def check_shapes(w: NVFP4MoEWeights) -> None:
    if w.a13_scale is not None:
        raise ValueError("the CUDA NVFP4 decode kernel is weight-only (W4A16)")
    if w.hidden_size % TILE_K or w.intermediate_size % TILE_K:
        raise ValueError(f"the CUDA NVFP4 decode kernel needs hidden ({w.hidden_size}) and intermediate "
                         f"({w.intermediate_size}) sizes divisible by {TILE_K}")


# ---- the selection table --------------------------------------------------------------------------------

def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


DEFAULT = "default"   # a bucket where the grouped GEMM measured fastest


@dataclass(frozen=True)
class Bucket:
    max_tokens: int
    variant: ANY_VARIANT | None   # None: the default kernel


class SelectionTable:
    """A recorded tuning run (bench/tune_cuda_moe.py --out): JSON with `version`, `device`, `capability`,
    `sources` (the digest of the kernel sources it measured), `checked` {variant: passed?} and `buckets`
    [{max_tokens, variant}] ascending. `choose(n)` returns the bucket's variant only if it passed its check;
    a table for another device, capability or source digest chooses nothing. Optional `w4a4`: the W4A4
    kernel (a Blackwell variant, or `default` = none); Blackwell variants belong only to tables recorded on
    a 10.x device and Hopper variants only to 9.x ones, anything else is a malformed table."""

    def __init__(self, data: dict, origin: str = "<table>"):
        self.origin = origin
        if data.get("version") != TABLE_VERSION:
            raise ValueError(f"{origin}: table version {data.get('version')!r}, expected {TABLE_VERSION}")
        for key in ("device", "capability", "sources", "checked", "buckets"):
            if key not in data:
                raise ValueError(f"{origin}: missing field {key!r}")
        self.device, self.sources = str(data["device"]), str(data["sources"])
        self.capability = tuple(data["capability"])
        self.checked = {parse_variant(k): bool(v) for k, v in data["checked"].items()}
        self.buckets = [Bucket(int(b["max_tokens"]), None if b["variant"] == DEFAULT else parse_variant(b["variant"]))
                        for b in data["buckets"]]
        for b in self.buckets:
            if isinstance(b.variant, Variant) and b.max_tokens > MAX_DECODE_TOKENS:
                raise ValueError(f"{origin}: decode variant {b.variant.name} for up to {b.max_tokens} tokens "
                                 f"(the decode kernels cover up to {MAX_DECODE_TOKENS})")
        if [b.max_tokens for b in self.buckets] != sorted({b.max_tokens for b in self.buckets}):
            raise ValueError(f"{origin}: buckets must have strictly ascending max_tokens")
        w4a4 = data.get("w4a4", DEFAULT)
        self.w4a4 = None if w4a4 == DEFAULT else parse_variant(str(w4a4))
        if self.w4a4 is not None and not isinstance(self.w4a4, Sm100Variant):
            raise ValueError(f"{origin}: w4a4 names {self.w4a4.name}, not a W4A4 (Blackwell) kernel")
        if any(isinstance(b.variant, Sm100Variant) for b in self.buckets):
            raise ValueError(f"{origin}: buckets choose W4A16 kernels; the Blackwell W4A4 kernel goes in w4a4")
        blackwell = self.capability[:1] == (SM100_MAJOR,)
        for v in [*self.checked, self.w4a4, *(b.variant for b in self.buckets)]:
            if v is not None and isinstance(v, Sm100Variant) != blackwell:
                raise ValueError(f"{origin}: variant {v.name} cannot run on compute capability {self.capability}")

    @classmethod
    def load(cls, path: str | Path) -> SelectionTable:
        """A table file, or gpu-check's tune.json holding one under "cuda_moe_table"."""
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict) and "cuda_moe_table" in data:
            data = data["cuda_moe_table"]
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a CUDA MoE selection table")
        return cls(data, str(path))

    def applies_to(self, device: str, capability: tuple[int, int], sources: str) -> str:
        """'' when the table was measured on this device with these kernels, else why not."""
        if self.device != device or self.capability != tuple(capability):
            return f"measured on {self.device} {self.capability}, this is {device} {tuple(capability)}"
        if self.sources != sources:
            return f"measured kernel sources {self.sources}, these are {sources}"
        return ""

    def choose(self, num_tokens: int) -> ANY_VARIANT | None:
        for b in self.buckets:
            if num_tokens <= b.max_tokens:
                if b.variant is None:
                    return None
                if not self.checked.get(b.variant, False):
                    logger.warning("%s: variant %s of the %d-token bucket did not pass its check; using the "
                                   "default kernel", self.origin, b.variant.name, b.max_tokens)
                    return None
                return b.variant
        return None

    def choose_w4a4(self) -> Sm100Variant | None:
        """The W4A4 kernel, only if it passed its check on the device the table was recorded on."""
        if self.w4a4 is None:
            return None
        if not self.checked.get(self.w4a4, False):
            logger.warning("%s: W4A4 variant %s did not pass its check; W4A4 stays on the reference", self.origin,
                           self.w4a4.name)
            return None
        return self.w4a4


def default_table_path(device: str) -> Path:
    return Path(os.environ[TABLE_ENV]) if os.environ.get(TABLE_ENV) else TABLE_DIR / f"{device_slug(device)}.json"


_STATE: dict = {}


def _active_table(device_index: int) -> SelectionTable | None:
    """The table for this device (loaded once per process), or None with the reason logged once."""
    if device_index in _STATE:
        return _STATE[device_index]
    table = None
    name, cap = torch.cuda.get_device_name(device_index), torch.cuda.get_device_capability(device_index)
    path = default_table_path(name)
    if path.is_file():
        try:
            t = SelectionTable.load(path)
            why = t.applies_to(name, cap, table_digest(tuple(cap)))
            if why:
                logger.warning("CUDA MoE decode table %s not used: %s", path, why)
            else:
                table = t
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("CUDA MoE decode table %s not used: %s", path, exc)
    else:
        logger.info("no CUDA MoE decode table at %s: the grouped GEMM runs at every size", path)
    _STATE[device_index] = table
    return table


_KERNELS: dict = {}
_CACHE = DecodePrepackCache()


def select_decode(x: torch.Tensor, w: NVFP4MoEWeights) -> ANY_VARIANT | None:
    """The checked variant this device's table picks for x's token count, or None (the default kernel)."""
    if x.device.type != "cuda" or w.a13_scale is not None:
        return None
    if w.hidden_size % TILE_K or w.intermediate_size % TILE_K:
        return None
    table = _active_table(x.device.index if x.device.index is not None else torch.cuda.current_device())
    return table.choose(x.shape[0]) if table is not None else None


def select_w4a4(x: torch.Tensor, w: NVFP4MoEWeights) -> Sm100Variant | None:
    """The Blackwell W4A4 kernel for a W4A4 call on a 10.x device whose table says it passed its check there;
    None (the torch reference) everywhere else, 9.x included."""
    if x.device.type != "cuda" or w.a13_scale is None or w.a2_scale is None:
        return None
    if w.hidden_size % TILE_K or w.intermediate_size % TILE_K:
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] != SM100_MAJOR:
        return None
    table = _active_table(index)
    return table.choose_w4a4() if table is not None else None


def decode_moe_nvfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: NVFP4MoEWeights,
                     variant: ANY_VARIANT, cache: DecodePrepackCache | None = None) -> torch.Tensor:
    """The routed experts through one variant, decode or large-batch (each cubin loaded once per process)."""
    check_shapes(w)
    if isinstance(variant, PrefillVariant):
        if "prefill" not in _KERNELS:
            _KERNELS["prefill"] = CubinPrefill()
        return _KERNELS["prefill"].moe(x, topk_ids, topk_weights, w, variant)
    if x.shape[0] > MAX_DECODE_TOKENS:
        raise ValueError(f"the decode kernels take up to {MAX_DECODE_TOKENS} tokens, got {x.shape[0]}")
    if "decode" not in _KERNELS:
        _KERNELS["decode"] = CubinDecode()
    return _KERNELS["decode"].moe(x, topk_ids, topk_weights, w, (cache or _CACHE).get(w), variant)


# ---- checking a variant on the device (bench/tune_cuda_moe.py records the verdicts) ----------------------

# (tokens, hidden, inter, experts, top_k, experts receiving tokens): one and several 16-row blocks per
# expert, idle experts, K of 3 chunks (splits owning no chunk), the engine's tiny shapes.
CHECK_CASES = ((1, 512, 256, 16, 4, None), (5, 384, 256, 16, 4, None), (33, 512, 384, 16, 4, 5),
               (64, 1024, 512, 32, 8, None))


# The large-batch kernels' cases: several 64/128-row blocks per expert, ragged last blocks, idle experts,
# K of 8 to 16 chunks of 32.
PREFILL_CHECK_CASES = ((300, 512, 256, 8, 4, None), (1100, 384, 384, 16, 8, 12))


def check_variant(kernels: CubinDecode | CubinPrefill, v: ANY_VARIANT, device: str = "cuda") -> float:
    """The largest relative error of `v` against torch_moe_nvfp4 over its check cases (inf if non-finite)."""
    from namazu.kernels import moe_dispatch as md

    worst = 0.0
    cases = PREFILL_CHECK_CASES if isinstance(v, PrefillVariant) else CHECK_CASES
    for i, (n, h, inter, e, k, used) in enumerate(cases):
        g = torch.Generator(device=device).manual_seed(1000 + i)
        w = md.random_nvfp4_weights(e, h, inter, device=device, seed=2000 + i)
        x = torch.randn(n, h, generator=g, device=device).to(torch.bfloat16)
        pool = used or e
        ids = torch.rand(n, pool, generator=g, device=device).topk(k, dim=1).indices
        tw = torch.rand(n, k, generator=g, device=device) + 0.1
        if isinstance(v, PrefillVariant):
            out = kernels.moe(x, ids, tw, w, v).float()
        else:
            out = kernels.moe(x, ids, tw, w, DecodeWeights(prepack(w.w13_packed, w.w13_scale),
                                                           prepack(w.w2_packed, w.w2_scale)), v).float()
        ref = md.torch_moe_nvfp4(x, ids, tw, w).float()
        if not torch.isfinite(out).all():
            return float("inf")
        worst = max(worst, float((out - ref).norm() / ref.norm().clamp_min(1e-12)))
    return worst


def table_dict(device: str, capability: tuple[int, int], checked: dict[str, bool], buckets: list[tuple[int, str]],
               measured: dict | None = None, w4a4: str = DEFAULT) -> dict:
    """The JSON SelectionTable reads (`measured`: the timings behind the choice, kept for the record)."""
    return {"version": TABLE_VERSION, "device": device, "capability": list(capability),
            "sources": table_digest(tuple(capability)), "checked": checked,
            "buckets": [{"max_tokens": t, "variant": v} for t, v in buckets], "w4a4": w4a4,
            "measured": measured or {}}
