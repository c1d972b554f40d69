"""The Blackwell (sm_100a) W4A4 kernel's CPU-checkable half: the layout and encoding functions of
nvfp4_moe_sm100.h (compiled here with gcc, the same code the kernel calls) against an independent Python
reading of the PTX ISA's tcgen05 rules (shared memory descriptor, instruction descriptor for
.kind::mxf4nvf4, the canonical K-major layout without swizzling, the scale factors' tensor-memory
arrangement for scale_vec::4X), one CTA's tile replayed through those rules against the torch reference,
the ctypes structs, launch grids, and the selection (only on a 10.x device, only when checked, never on
9.x). tests/kernels/test_cuda_sm100_gpu.py runs the kernel on a Blackwell device."""
from __future__ import annotations

import ctypes
import dataclasses
import json
import subprocess

import pytest
import torch
from kernel_cases import host_cc

from namazu.kernels import backends
from namazu.kernels import cubin_loader as cl
from namazu.kernels import cuda_decode as cd
from namazu.kernels import cuda_sm100 as bw
from namazu.kernels import moe_dispatch as md
from namazu.quant.nvfp4 import e2m1_decode

HEADER = cl.CSRC / "nvfp4_moe_sm100.h"
DESC_CASES = [(0x400, 128, 512), (0x2500, 128, 512), (0x3FFF0, 2048, 16), (0x10, 16, 0x3FFF0)]
INSTR_CASES = [(128, 128), (128, 64), (128, 256), (256, 256)]


# ---- an independent reading of the PTX ISA ---------------------------------------------------------------

def bitfields(fields: list[tuple[int, int, int]]) -> int:
    out = 0
    for lo, width, value in fields:
        assert 0 <= value < 2 ** width, (lo, width, value)
        out |= value << lo
    return out


def ptx_smem_desc(start: int, lbo: int, sbo: int, swizzle: int = 0) -> int:
    """Table "Shared memory descriptor layout": matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4."""
    enc = lambda x: (x & 0x3FFFF) >> 4  # noqa: E731
    return bitfields([(0, 14, enc(start)), (16, 14, enc(lbo)), (32, 14, enc(sbo)), (46, 3, 0b001),
                      (49, 3, 0), (52, 1, 0), (53, 8, 0), (61, 3, swizzle)])


def ptx_instr_desc_mxf4nvf4(m: int, n: int) -> int:
    """Table "Instruction descriptor format for .kind::mxf4 and .kind::mxf4nvf4", dense, E2M1 x E2M1, UE4M3
    scales (bit 23 = 0), K-major A and B (no transpose), SFA/SFB ID 0 (scale_vec::4X), K = 64."""
    e2m1 = 1
    return bitfields([(2, 1, 0), (4, 2, 0), (7, 3, e2m1), (10, 2, e2m1), (13, 1, 0), (14, 1, 0), (15, 1, 0),
                      (16, 1, 0), (17, 6, n >> 3), (23, 1, 0), (27, 2, m >> 7), (29, 2, 0), (31, 1, 0)])


def cute_offset(shape, stride, idx: int) -> int:
    """A CuTe mode evaluated at a 1-D index (colexicographic: the leftmost sub-mode varies fastest)."""
    if isinstance(shape, int):
        assert 0 <= idx < shape
        return idx * stride
    off = 0
    for s, d in zip(shape, stride):
        size = s if isinstance(s, int) else int(torch.tensor(s).prod())
        off += cute_offset(s, d, idx % size)
        idx //= size
    return off


def canonical_k_major_byte(row: int, kel: int, lbo: int, sbo: int, rows: int = 128, kels: int = 64) -> int:
    """Byte holding E2M1 element (row, kel) of a K-major, non-swizzled operand: the PTX ISA's canonical
    layout ((8,m),(T,2k)):((1T,SBO),(1,LBO)) in elements, T = 128 / 4 = 32; two elements per byte."""
    t = 32
    m, k2 = rows // 8, kels // t
    elem = (cute_offset((8, m), (t, sbo * 2), row) + cute_offset((t, k2), (1, lbo * 2), kel))
    return elem // 2


def ptx_sf_lane_col(row: int) -> tuple[int, int]:
    """Where the MMA (M = 128, scale_vec::4X) reads row `row`'s scale word: lane row % 32 of a lane
    partition (duplicated in all four), column row // 32 from the scale operand's address."""
    return row % 32, row // 32


def lane_rule_sf(row: int) -> tuple[int, int]:
    """The other reading, which the `_sflane` kernels implement: row m in lane m, one column."""
    return row, 0


# ---- the header's functions, compiled with gcc ----------------------------------------------------------

@pytest.fixture(scope="module")
def header(tmp_path_factory) -> dict[str, list[int]]:
    cc = host_cc("the sm_100a header's layout rules")
    d = tmp_path_factory.mktemp("sm100")
    descs = "".join(f'P("desc", nvfp4_sm100_smem_desc({a}u, {lbo}u, {sbo}u));' for a, lbo, sbo in DESC_CASES)
    instrs = "".join(f'P("instr", nvfp4_sm100_instr_desc({m}u, {n}u));' for m, n in INSTR_CASES)
    src = d / "dump.c"
    src.write_text(f'''#include <stdio.h>
#include "{HEADER}"
#define P(k, v) printf("%s %llu\\n", k, (unsigned long long)(v))
int main(void) {{
  for (unsigned r = 0; r < 128; ++r) for (unsigned b = 0; b < 64; ++b) P("off", nvfp4_sm100_smem_offset(r, b));
  {descs} {instrs}
  for (unsigned l = 0; l < 32; ++l) for (unsigned c = 0; c < 4; ++c) P("sfrow", nvfp4_sm100_sf_row(l, c));
  for (unsigned w = 0; w < 4; ++w) for (unsigned l = 0; l < 32; ++l) P("sflane", nvfp4_sm100_sf_lane_row(w, l));
  for (unsigned s = 0; s < 2; ++s) for (unsigned j = 0; j < 2; ++j) {{
    P("sfa", nvfp4_sm100_sf_col(NVFP4_SM100_SFA_COL, s, j)); P("sfb", nvfp4_sm100_sf_col(NVFP4_SM100_SFB_COL, s, j)); }}
  P("taddr", nvfp4_sm100_tmem_addr(0x00000020u, 96, 5));
  for (int g = 1; g >= 0; --g) for (unsigned n = 0; n < 128; ++n) P("wrow", nvfp4_sm100_weight_row(g, 192, 2048, n));
  for (unsigned n = 0; n < 128; ++n) P("wtile", nvfp4_sm100_weight_row(1, 64, 128, n));
  P("cols", nvfp4_sm100_cols_per_cta(1)); P("cols", nvfp4_sm100_cols_per_cta(0));
  P("const", NVFP4_SM100_BM); P("const", NVFP4_SM100_BN); P("const", NVFP4_SM100_BK);
  P("const", NVFP4_SM100_THREADS); P("const", NVFP4_SM100_LBO); P("const", NVFP4_SM100_SBO);
  P("const", NVFP4_SM100_TMEM_COLS); P("const", NVFP4_SM100_ACC_COL);
  return 0;
}}
''')
    res = subprocess.run([cc, "-std=c11", "-Wall", "-Werror", str(src), "-o", str(d / "dump")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    out: dict[str, list[int]] = {}
    for line in subprocess.run([str(d / "dump")], capture_output=True, text=True, check=True).stdout.splitlines():
        key, value = line.split()
        out.setdefault(key, []).append(int(value))
    return out


def test_constants_match_the_python_side(header):
    bm, bn, bk, threads, lbo, sbo, tmem_cols, acc = header["const"]
    assert (bm, bn, bk, threads) == (bw.BM, bw.BN, bw.BK, bw.THREADS) == (128, 128, 128, 128)
    assert header["cols"] == [bw.cols_per_cta(True), bw.cols_per_cta(False)] == [64, 128]
    # Tensor memory: the accumulator's 128 fp32 columns and both stages' scale columns fit the allocation,
    # which must be a power of two in [32, 512] (tcgen05.alloc).
    cols = header["sfa"] + header["sfb"]
    assert acc == 0 and min(cols) >= bn and max(cols) + 4 <= tmem_cols
    assert tmem_cols & (tmem_cols - 1) == 0 and 32 <= tmem_cols <= 512
    assert len({c + i for c in cols for i in range(4)}) == 4 * len(cols)   # no two scale words share a column


def test_smem_descriptor_matches_the_ptx_table(header):
    assert header["desc"] == [ptx_smem_desc(a, lbo, sbo) for a, lbo, sbo in DESC_CASES]


def test_instruction_descriptor_matches_the_ptx_table(header):
    assert header["instr"] == [ptx_instr_desc_mxf4nvf4(m, n) for m, n in INSTR_CASES]
    # The shape the kernel issues is a valid dense cta_group::1 shape for kind::mxf4nvf4 (PTX ISA, matrix
    # shapes): M = 128, N in 8..256 in steps of 8, K = 64.
    assert bw.BN % 8 == 0 and 8 <= bw.BN <= 256 and bw.BM == 128


def test_stage_placement_is_what_the_descriptors_read(header):
    """load_stage writes row r, byte b of a stage at smem_offset(r, b); MMA j of the stage reads with a
    descriptor starting at j * 2 * LBO and the header's LBO/SBO. Reading that through the canonical layout
    must find every byte of the MMA's 128 x 32-byte K slice exactly where it was written."""
    off = torch.tensor(header["off"]).view(128, 64)
    assert sorted(off.flatten().tolist()) == list(range(128 * 64))   # a bijection onto the 8 KB stage
    _, _, _, _, lbo, sbo, _, _ = header["const"]
    for j in range(2):
        start = j * 2 * lbo
        for r in range(128):
            for b in range(32):
                assert start + canonical_k_major_byte(r, 2 * b, lbo, sbo) == off[r, 32 * j + b]
    # All 16-byte cp.async destinations are 16-byte aligned, as cp.async.cg ... 16 requires.
    assert (off[:, ::16] % 16 == 0).all()


def test_scale_words_land_where_the_mma_reads_them(header):
    """Warp w's thread t stores 4 words with tcgen05.st 32x32b.x4 at lane 32w + t, columns c = 0..3 of the
    operand's scale address: the words of rows sf_row(t, c). The MMA reads row m in lane m % 32 (any
    partition), column m // 32."""
    sf_row = torch.tensor(header["sfrow"]).view(32, 4)
    for lane in range(32):
        for c in range(4):
            assert ptx_sf_lane_col(int(sf_row[lane, c])) == (lane, c)
    assert sorted(sf_row.flatten().tolist()) == list(range(128))
    assert header["taddr"] == [(96 << 16) + 0x20 + 5]
    # the `_sflane` kernels: warp w's thread t stores row 32w + t's word in its own lane, one column
    assert [lane_rule_sf(r) for r in header["sflane"]] == [(lane, 0) for lane in range(128)]


def test_weight_rows_pair_gate_with_up(header):
    gate, down = header["wrow"][:128], header["wrow"][128:]
    assert gate == [192 + n for n in range(64)] + [2048 + 192 + n for n in range(64)]
    assert down == [192 + n for n in range(128)]


def mma_operand(smem: torch.Tensor, tm: torch.Tensor, idx: torch.Tensor, part: torch.Tensor, rule) -> torch.Tensor:
    """The 128 x 64 values an MMA multiplies: E2M1 pairs at the descriptor's bytes `idx` (low nibble first)
    times each row's scales, read from the tensor memory image `tm` [lane, column, byte] where `rule` puts
    them (ptx_sf_lane_col: row r in lane 32 * part[r] + r % 32, column r // 32; lane_rule_sf: lane r,
    column 0), byte = 16-value block."""
    byte = smem[idx].to(torch.int64)
    codes = torch.stack([byte & 0xF, byte >> 4], -1).reshape(128, 64).to(torch.uint8)
    spots = [rule(r) for r in range(128)]
    if rule is ptx_sf_lane_col:
        spots = [(32 * int(part[r]) + ln, c) for r, (ln, c) in enumerate(spots)]
    sf = torch.stack([tm[ln, c] for ln, c in spots])
    return e2m1_decode(codes).double() * sf.view(torch.float8_e4m3fn).double().repeat_interleave(16, dim=1)


def stored_scale_rows(header, arrangement: str) -> dict[tuple[int, int], int]:
    """{(lane, column): row} of the scale words one MMA's tcgen05.st calls leave in tensor memory, per the
    header: `x4` (every warp stores its partition's 32 lanes x 4 columns), `lane` (one column)."""
    if arrangement == "x4":
        rows = torch.tensor(header["sfrow"]).view(32, 4)
        return {(lane, c): int(rows[lane % 32, c]) for lane in range(128) for c in range(4)}
    return {(32 * w + t, 0): r for w in range(4) for t, r in enumerate(header["sflane"][32 * w:32 * w + 32])}


@pytest.mark.parametrize("arrangement,rule,right", [("x4", ptx_sf_lane_col, True), ("lane", lane_rule_sf, True),
                                                    ("x4", lane_rule_sf, False)])
def test_one_tile_replayed_through_the_ptx_rules_gives_the_reference(header, arrangement, rule, right):
    """One CTA of gate_up with K = 256 (two stages, both buffers) simulated as the PTX ISA defines the MMA:
    operands gathered from the shared memory images through the descriptors, scales from the tensor memory
    image the tcgen05.st pattern builds, products summed; alpha and the gate/up pairing of the epilogue;
    against the dequantized ModelOpt tensors. Each kernel variant's stores read by its own rule give the
    reference; read by the other rule they do not (the device check can tell the two apart)."""
    g = torch.Generator().manual_seed(5)
    k, n_out, n0, rows = 256, 128, 64, 128
    a_codes = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
    a_sf = (torch.rand(rows, k // 16, generator=g) * 8 + 0.5).to(torch.float8_e4m3fn)
    w_codes = torch.randint(0, 256, (2 * n_out, k // 2), generator=g, dtype=torch.uint8)
    w_sf = (torch.rand(2 * n_out, k // 16, generator=g) * 8 + 0.5).to(torch.float8_e4m3fn)
    alpha = 0.37
    off = torch.tensor(header["off"]).view(128, 64)
    wrow = torch.tensor(header["wtile"])   # MMA column -> weight row, from the header (n0 64, n_out 128)
    stored = stored_scale_rows(header, arrangement)
    _, _, _, _, lbo, sbo, _, _ = header["const"]
    acc = torch.zeros(128, 128, dtype=torch.float64)
    for s in range(k // 128):
        smem_a = torch.zeros(8192, dtype=torch.uint8)
        smem_b = torch.zeros(8192, dtype=torch.uint8)
        smem_a[off.flatten()] = a_codes[:, 64 * s:64 * s + 64].flatten()
        smem_b[off.flatten()] = w_codes[wrow][:, 64 * s:64 * s + 64].flatten()
        for j in range(2):
            # tensor memory scale image of this MMA: [4 partitions x 32 lanes, 4 columns] of 4-byte words
            tm_a = torch.zeros(128, 4, 4, dtype=torch.uint8)
            tm_b = torch.zeros(128, 4, 4, dtype=torch.uint8)
            word = 8 * s + 4 * j
            for (lane, c), r in stored.items():
                tm_a[lane, c] = a_sf.view(torch.uint8)[r, word:word + 4]
                tm_b[lane, c] = w_sf.view(torch.uint8)[wrow[r], word:word + 4]
            start = j * 2 * lbo
            idx = torch.tensor([[start + canonical_k_major_byte(r, 2 * b, lbo, sbo) for b in range(32)]
                                for r in range(128)])
            part = torch.randint(0, 4, (128,), generator=g)   # any lane partition holds the same words
            acc += mma_operand(smem_a, tm_a, idx, part, rule) @ mma_operand(smem_b, tm_b, idx, part, rule).T

    def deq(codes, sf):
        c = torch.stack([codes.long() & 0xF, codes.long() >> 4], -1).reshape(codes.shape[0], -1).to(torch.uint8)
        return e2m1_decode(c).double() * sf.double().repeat_interleave(16, dim=1)
    ref = deq(a_codes, a_sf) @ deq(w_codes, w_sf).T
    gate, up = alpha * acc[:, :64], alpha * acc[:, 64:]
    want = torch.cat([alpha * ref[:, n0:n0 + 64], alpha * ref[:, n_out + n0:n_out + n0 + 64]], 1)
    assert torch.allclose(torch.cat([gate, up], 1), want, rtol=1e-12, atol=1e-9) == right


def test_quantizer_rounding_matches_the_reference(tmp_path):
    """The quantizer's E2M1 rounding (nvfp4_sm100_e2m1_code, compiled with gcc) against
    namazu.quant.nvfp4.e2m1_encode on every bf16 value (signs, zeros, subnormals, inf, NaN) and on the 64
    fp32 neighbours either side of each decision bound (the ties and the values just off them)."""
    cc = host_cc("the sm_100a header's layout rules")
    from namazu.quant.nvfp4 import e2m1_encode
    bf16 = (torch.arange(65536, dtype=torch.int32) << 16).view(torch.float32)
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    around = (bounds.view(torch.int32)[:, None] + torch.arange(-64, 65)).view(torch.float32).flatten()
    x = torch.cat([bf16, around, -around])
    (tmp_path / "x.bin").write_bytes(x.numpy().tobytes())
    src = tmp_path / "enc.c"
    src.write_text(f'''#include <stdio.h>
#include "{HEADER}"
int main(void) {{
  FILE* f = fopen("{tmp_path / "x.bin"}", "rb"); float v;
  while (fread(&v, sizeof v, 1, f) == 1) putchar((int)nvfp4_sm100_e2m1_code(v));
  return 0;
}}
''')
    res = subprocess.run([cc, "-std=c11", "-O2", str(src), "-o", str(tmp_path / "enc")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    got = torch.frombuffer(bytearray(subprocess.run([str(tmp_path / "enc")], capture_output=True, check=True).stdout),
                           dtype=torch.uint8)
    assert got.numel() == x.numel()
    assert torch.equal(got, e2m1_encode(x))


@pytest.mark.parametrize("struct,c_name", [(bw.Sm100Args, "Nvfp4Sm100Args"), (bw.QuantArgs, "Nvfp4Sm100QuantArgs")])
def test_structs_match_the_c_header(tmp_path, struct, c_name):
    cc = host_cc("the sm_100a header's layout rules")
    fields = [f for f, _ in struct._fields_]
    prints = "".join(f'printf("%zu %zu ", offsetof({c_name}, {f}), sizeof((({c_name}*)0)->{f}));' for f in fields)
    src = tmp_path / "layout.c"
    src.write_text(f'#include <stdio.h>\n#include <stddef.h>\n#include "{HEADER}"\n'
                   f'int main(void) {{ {prints} printf("%zu", sizeof({c_name})); return 0; }}\n')
    res = subprocess.run([cc, "-std=c11", str(src), "-o", str(tmp_path / "layout")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    *got, size = map(int, subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True).stdout.split())
    assert got == [x for f in fields for x in (getattr(struct, f).offset, getattr(struct, f).size)]
    assert size == ctypes.sizeof(struct)


def test_grids():
    assert bw.gemm_grid(256, 2048, True) == ((2, 32, 1), (128, 1, 1))
    assert bw.gemm_grid(256, 7168, False) == ((2, 56, 1), (128, 1, 1))
    with pytest.raises(ValueError, match="multiple"):
        bw.gemm_grid(200, 2048, True)
    with pytest.raises(ValueError, match="multiple"):
        bw.gemm_grid(256, 96, False)
    # one thread per 16-value block, capped (the kernel grid-strides past the cap)
    assert bw.quant_grid(128, 7168) == ((448, 1, 1), (128, 1, 1))
    assert bw.quant_grid(128 * 64, 7168)[0] == (bw.MAX_QUANT_CTAS, 1, 1)


def test_check_shapes_wants_w4a4_and_aligned_sizes():
    w = md.random_nvfp4_weights(2, 256, 128)
    with pytest.raises(ValueError, match="W4A4"):
        bw.check_shapes(w)
    bw.check_shapes(dataclasses.replace(w, a13_scale=torch.ones(2), a2_scale=torch.ones(2)))
    w = md.random_nvfp4_weights(2, 256, 192)
    with pytest.raises(ValueError, match="divisible"):
        bw.check_shapes(dataclasses.replace(w, a13_scale=torch.ones(2), a2_scale=torch.ones(2)))


# ---- the host flow, with the kernels emulated by their contract --------------------------------------------

class EmulatedKernels(bw.CubinSm100):
    """CubinSm100 with its three launches replaced by torch code following the contract of
    nvfp4_moe_sm100.h: the real host flow (`moe`: dispatch, scales, alpha, buffers, the k-row sum) and the
    device-check code (check_quantize, check_sm100, gemm_errors) run on the CPU through it."""

    def __init__(self):   # no cubin, no driver
        pass

    def quantize(self, src, bd, input_scale, a_div):
        from namazu.quant.nvfp4 import pack_nibbles, quantize_activation
        k = src.shape[1]
        p = torch.arange(bd.max_rows)
        pair = bd.sorted_pairs.long()
        real = (p < bd.total_rows) & (pair < bd.num_pairs)
        src_row = pair.clamp(max=bd.num_pairs - 1) // a_div if a_div else p
        scale = input_scale[bd.block_expert.long()[p // bw.BM]]
        codes, sf = quantize_activation(src[src_row].float(), scale)
        return (torch.where(real[:, None], pack_nibbles(codes), 0),
                torch.where(real[:, None], sf.view(torch.uint8), 0).reshape(bd.max_rows, k // 16))

    def _gemm(self, v, a, bd, packed, scale, alpha, tw, out, gate_up):
        codes, sf = a
        n_out = out.shape[1]
        for b in range(int(bd.total_rows) // bw.BM):
            e, rows = int(bd.block_expert[b]), slice(b * bw.BM, (b + 1) * bw.BM)
            acc = bw._dequant_rows(codes[rows], sf[rows]) @ bw._dequant_rows(packed[e], scale[e]).T
            if gate_up:
                g, u = ((alpha[e] * acc[:, :n_out]).to(torch.bfloat16).float(),
                        (alpha[e] * acc[:, n_out:]).to(torch.bfloat16).float())
                out[rows] = (torch.nn.functional.silu(g) * u).to(torch.bfloat16)
            else:
                for r in range(bw.BM):
                    pair = int(bd.sorted_pairs[b * bw.BM + r])
                    if pair < bd.num_pairs:
                        out[pair] = alpha[e] * tw[pair] * acc[r]


def test_host_flow_matches_the_w4a4_reference_with_emulated_kernels():
    from kernel_cases import make_case, rel_err
    c = make_case(6, 256, 128, 8, 2, seed=77, w4a4=True)
    out = EmulatedKernels().moe(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    assert out.shape == c.x.shape and out.dtype == c.x.dtype
    assert rel_err(out, md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)) < 1e-2


def test_device_check_code_runs_and_passes_a_right_kernel():
    """What the tuner and the GPU test call, run here on the emulation: a right kernel passes every part."""
    k, v = EmulatedKernels(), cd.Sm100Variant()
    assert bw.check_quantize(k, "cpu") == 0
    assert bw.check_sm100(k, v, "cpu") < cd.CHECK_TOL
    for uniform in (False, True):
        errs = bw.gemm_errors(k, v, uniform=uniform, device="cpu")
        assert set(errs) == {"gate_up", "down"} and max(errs.values()) < 1e-3, errs   # bf16 ties only


def test_device_check_catches_a_kernel_reading_scales_of_other_rows():
    """An emulated kernel that reads row r's activation scales from row r ^ 1 (what a wrong tensor-memory
    arrangement does): the layer check fails, and the per-GEMM diagnosis says gate_up is right with uniform
    scales and wrong with random ones."""
    class WrongScales(EmulatedKernels):
        def _gemm(self, v, a, bd, *rest):
            codes, sf = a
            swap = torch.arange(sf.shape[0]) ^ 1
            super()._gemm(v, (codes, sf[swap]), bd, *rest)
    k, v = WrongScales(), cd.Sm100Variant()
    assert bw.check_sm100(k, v, "cpu") > cd.CHECK_TOL
    assert bw.gemm_errors(k, v, uniform=False, device="cpu")["gate_up"] > 1e-2
    assert bw.gemm_errors(k, v, uniform=True, device="cpu")["gate_up"] < 1e-3


# ---- selection --------------------------------------------------------------------------------------------

B200, BW_CAP = "NVIDIA B200", (10, 0)


def bw_table(**over) -> dict:
    t = cd.table_dict(B200, BW_CAP, {"bw_w4a4_m128": True}, [], w4a4="bw_w4a4_m128")
    t.update(over)
    return t


def test_table_format_gains_the_w4a4_entry():
    t = cd.SelectionTable(bw_table())
    assert t.choose_w4a4() == cd.Sm100Variant() and t.choose(1) is None
    assert cd.SelectionTable(bw_table(checked={"bw_w4a4_m128": False})).choose_w4a4() is None
    assert cd.SelectionTable(bw_table(checked={})).choose_w4a4() is None       # never checked = never chosen
    assert cd.SelectionTable(bw_table(w4a4="default")).choose_w4a4() is None
    old = bw_table()
    del old["w4a4"]                                                            # a table from before: none
    assert cd.SelectionTable(old).choose_w4a4() is None
    assert cd.parse_variant("bw_w4a4_m128") == cd.Sm100Variant()
    assert cd.parse_variant("bw_w4a4_m128_sflane") == cd.Sm100Variant("lane")
    assert cd.SelectionTable(bw_table(checked={"bw_w4a4_m128_sflane": True},
                                      w4a4="bw_w4a4_m128_sflane")).choose_w4a4() == cd.Sm100Variant("lane")
    assert [v.kernel(True) for v in cd.SM100_VARIANTS] == ["nvfp4_sm100_gemm_gate_up",
                                                          "nvfp4_sm100_gemm_gate_up_sflane"]


@pytest.mark.parametrize("over,match", [
    ({"capability": [9, 0]}, "cannot run"),                                   # the sm_100a kernel on Hopper
    ({"checked": {"bw_w4a4_m128": True, "nt4_w4_lut_s1": True}}, "cannot run"),   # Hopper code on Blackwell
    ({"buckets": [{"max_tokens": 8, "variant": "bw_w4a4_m128"}]}, "w4a4"),
    ({"w4a4": "nt4_w4_lut_s1"}, "not a W4A4"),
    ({"w4a4": "bw_w4a4_m64"}, "not compiled")])
def test_table_rejects_variants_for_the_wrong_architecture(over, match):
    with pytest.raises(ValueError, match=match):
        cd.SelectionTable(bw_table(**over))


def test_digest_covers_the_device_kernels():
    assert cd.table_digest(BW_CAP) == cl.sources_digest(cd.SM100_SOURCES, cd.SM100_ARCH)
    assert cd.table_digest((9, 0)) == cd.table_digest() != cd.table_digest(BW_CAP)
    assert bw_table()["sources"] == cd.table_digest(BW_CAP)


@pytest.fixture
def fake_device(monkeypatch, tmp_path):
    """select_w4a4 as on a device of the given name and capability (x only claims to be on cuda)."""
    state = {"name": B200, "cap": BW_CAP}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: state["name"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: state["cap"])
    monkeypatch.setattr(cd, "_STATE", {})
    path = tmp_path / "table.json"
    monkeypatch.setenv(cd.TABLE_ENV, str(path))

    class X:
        shape = (4, 512)
        device = torch.device("cuda", 0)
    w = md.random_nvfp4_weights(4, 512, 256)
    w4a4 = dataclasses.replace(w, a13_scale=torch.ones(4), a2_scale=torch.ones(4))
    return state, path, X(), w, w4a4


def test_select_w4a4_only_on_a_checked_blackwell(fake_device):
    state, path, x, w, w4a4 = fake_device
    path.write_text(json.dumps({"cuda_moe_table": bw_table()}))
    assert cd.select_w4a4(x, w4a4) == cd.Sm100Variant()
    assert cd.select_w4a4(x, w) is None              # W4A16: not this kernel
    assert cd.select_decode(x, w) is None            # and no Hopper variant on Blackwell
    cd._STATE.clear()
    path.write_text(json.dumps(bw_table(checked={"bw_w4a4_m128": False})))
    assert cd.select_w4a4(x, w4a4) is None
    cd._STATE.clear()
    path.write_text(json.dumps(bw_table(sources="0" * 16)))   # recorded from other kernel sources
    assert cd.select_w4a4(x, w4a4) is None


@pytest.mark.parametrize("name,cap", [("NVIDIA H200", (9, 0)), (B200, (9, 0)), ("NVIDIA B300", (10, 3))])
def test_select_w4a4_never_elsewhere(fake_device, name, cap):
    """A Blackwell table never selects on 9.x (even one claiming the same name) or on another device."""
    state, path, x, _, w4a4 = fake_device
    path.write_text(json.dumps(bw_table()))
    state["name"], state["cap"] = name, cap
    assert cd.select_w4a4(x, w4a4) is None


def test_select_w4a4_checks_the_capability_itself(fake_device, monkeypatch):
    """Even a table that (wrongly) applied to a 9.x device could not put the sm_100a kernel there."""
    state, _, x, _, w4a4 = fake_device
    monkeypatch.setattr(cd, "_active_table", lambda index: cd.SelectionTable(bw_table()))
    assert cd.select_w4a4(x, w4a4) == cd.Sm100Variant()
    state["cap"] = (9, 0)
    assert cd.select_w4a4(x, w4a4) is None


def test_cuda_backend_w4a4_takes_the_kernel_only_when_selected(monkeypatch):
    calls = []
    monkeypatch.setattr(cd, "select_w4a4", lambda x, w: cd.Sm100Variant() if x.shape[0] == 1 else None)
    monkeypatch.setattr(bw, "sm100_moe_nvfp4", lambda x, *a: calls.append("sm100") or x)
    monkeypatch.setattr(md, "torch_moe_nvfp4", lambda x, *a: calls.append("torch") or x)
    backends._cuda_w4a4(torch.zeros(1, 512), None, None, None)
    backends._cuda_w4a4(torch.zeros(2, 512), None, None, None)
    assert calls == ["sm100", "torch"]


def test_cubin_compiles_with_its_kernels(tmp_path):
    try:
        nvcc = cl.find_nvcc()
    except RuntimeError:
        pytest.skip("nvcc is not installed here: the sm_100a cubin is compile-checked where nvcc exists")
    cubin = bw.compile_sm100_cubin(tmp_path, nvcc)
    assert set(bw.KERNELS) <= set(cl.elf_function_symbols(cubin.read_bytes()))
