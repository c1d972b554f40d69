"""The CUDA NVFP4 decode kernels' CPU-checkable half (namazu/kernels/cuda_decode.py): the decode layout
against ModelOpt's dequantization, the kernel's K-order trick replayed with the mma.m16n8k16 fragment
layout of the PTX ISA, the ctypes structs against the C header, the cubin's kernels, and the selection
table (loading, refusing a failed variant or a stale table, the fallback to the grouped GEMM, the wiring
into the cuda backend). tests/kernels/test_cuda_decode_gpu.py runs every variant on a device."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
from kernel_cases import host_cc

from namazu.kernels import backends
from namazu.kernels import cubin_loader as cl
from namazu.kernels import cuda_decode as cd
from namazu.kernels import moe_dispatch as md
from namazu.quant.nvfp4 import dequantize_weight, e2m1_decode


def weights(e=3, h=384, i=256, seed=0):
    return md.random_nvfp4_weights(e, h, i, seed=seed)


def test_prepack_round_trips_and_checks_shapes():
    w = weights()
    tiles = cd.prepack(w.w13_packed, w.w13_scale)
    assert tiles.shape == (3, 2 * 256 // 8, 384 // 128, cd.TILE_BYTES) and tiles.dtype == torch.uint8
    q, s = cd.unpack(tiles)
    assert torch.equal(q, w.w13_packed) and torch.equal(s, w.w13_scale.view(torch.uint8))
    with pytest.raises(ValueError, match="K % 128"):
        cd.prepack(w.w13_packed[:, :, :32], w.w13_scale[:, :, :4])   # K = 64


@pytest.mark.parametrize("expert,tile,chunk,lane", [(0, 0, 0, 0), (2, 5, 2, 31), (1, 63, 1, 13), (2, 17, 0, 6)])
def test_each_lane_reads_its_rows_values(expert, tile, chunk, lane):
    """What the kernel's byte offsets give lane (g, t) is row 8*tile + g, k = 128*chunk + 32t .. +31, as
    ModelOpt's dequantization (without the global scale) says."""
    w = weights()
    tiles = cd.prepack(w.w13_packed, w.w13_scale)
    dense = dequantize_weight(w.w13_packed[expert], w.w13_scale[expert], torch.tensor(1.0), dtype=torch.float32)
    g, t = lane // 4, lane % 4
    want = dense[8 * tile + g, 128 * chunk + 32 * t:128 * chunk + 32 * t + 32]
    assert torch.equal(cd.lane_values(tiles, expert, tile, chunk, lane), want)


def mma_m16n8k16(a_regs, b_regs):
    """D = A B for one warp from its fragments, as the PTX ISA lays them out for .bf16 m16n8k16
    (row.col): lane (g, t) holds A[g][2t..2t+1], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..] in a0..a3 and
    B[2t..2t+1][g], B[2t+8..2t+9][g] in b0, b1; returns D [16, 8]."""
    a = torch.zeros(16, 16)
    b = torch.zeros(16, 8)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a0, a1, a2, a3 = a_regs[lane]
        a[g, 2 * t:2 * t + 2], a[g + 8, 2 * t:2 * t + 2] = a0, a1
        a[g, 2 * t + 8:2 * t + 10], a[g + 8, 2 * t + 8:2 * t + 10] = a2, a3
        b0, b1 = b_regs[lane]
        b[2 * t:2 * t + 2, g], b[2 * t + 8:2 * t + 10, g] = b0, b1
    return a @ b


def test_kernel_k_order_gives_the_true_product():
    """The kernel feeds step s of lane t with real k = 32t + 4s + {0,1} (slots 2t, 2t+1) and + {2,3} (slots
    2t+8, 2t+9) for A and B alike; replaying its register choices (A words 2s and 2s+1 of the lane's 32
    values, weight bytes 2s and 2s+1 of its 16, scale s < 4 ? first : second) through the ISA's fragment
    layout must give A @ W^T of one 16 x 8 x 128 tile."""
    w = weights(e=1, h=128, i=8)
    tiles = cd.prepack(w.w13_packed, w.w13_scale)   # 16 rows: 2 tiles
    dense = dequantize_weight(w.w13_packed[0], w.w13_scale[0], torch.tensor(1.0), dtype=torch.float32)
    a_rows = torch.randn(16, 128, generator=torch.Generator().manual_seed(3)).bfloat16().float()
    for tile in range(2):
        acc = torch.zeros(16, 8)
        lane_w = [cd.lane_values(tiles, 0, tile, 0, lane) for lane in range(32)]
        for s in range(8):
            a_regs, b_regs = [], []
            for lane in range(32):
                g, t = lane // 4, lane % 4
                lo, hi = a_rows[g, 32 * t:32 * t + 32], a_rows[g + 8, 32 * t:32 * t + 32]
                j = 4 * s
                a_regs.append((lo[j:j + 2], hi[j:j + 2], lo[j + 2:j + 4], hi[j + 2:j + 4]))
                wv = lane_w[lane]
                b_regs.append((wv[4 * s:4 * s + 2], wv[4 * s + 2:4 * s + 4]))
            acc += mma_m16n8k16(a_regs, b_regs)
        torch.testing.assert_close(acc, a_rows @ dense[8 * tile:8 * tile + 8].T, rtol=1e-5, atol=1e-4)


def test_e2m1_table_matches_the_format():
    # The .cu builds its byte table from e2m1_value; the same rule here must give the format's 16 values.
    def e2m1_value(code):
        mag = code & 7
        v = 0.5 * mag if mag < 2 else (1 + 0.5 * (mag & 1)) * 2.0 ** ((mag >> 1) - 1)
        return -v if code & 8 else v
    assert [e2m1_value(c) for c in range(16)] == e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist()


def test_register_fp4_expansion_is_exact_for_every_input(tmp_path):
    """nvfp4_e2m1_bf16.h (the prmt variants' FP4 expansion), built for the host with its C __byte_perm,
    over all 65,536 pairs of packed bytes: each of the four bf16 results equals the format's value."""
    cc = host_cc("the kernel header's host-side rules")
    src = tmp_path / "conv.c"
    src.write_text(f'#include <stdio.h>\n#include "{cl.CSRC / "nvfp4_e2m1_bf16.h"}"\n'
                   'int main(void) { for (unsigned w = 0; w < 65536; ++w) { uint32_t lo, hi;'
                   ' nvfp4_e2m1x4_to_bf16(w, &lo, &hi); printf("%u %u\\n", lo, hi); } return 0; }\n')
    res = subprocess.run([cc, "-std=c11", "-O1", str(src), "-o", str(tmp_path / "conv")], capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr
    out = subprocess.run([str(tmp_path / "conv")], capture_output=True, text=True).stdout.split()
    words = torch.tensor([int(v) for v in out], dtype=torch.int64).reshape(65536, 2)
    halves = torch.stack([words & 0xFFFF, words >> 16], dim=2).reshape(65536, 4)   # v0, v1, v2, v3
    got = (halves.to(torch.int32) << 16).view(torch.float32)                       # bf16 bits -> fp32
    w = torch.arange(65536, dtype=torch.int64)
    codes = torch.stack([(w >> (4 * j)) & 0xF for j in range(4)], dim=1).to(torch.uint8)
    want = e2m1_decode(codes)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))   # -0.0 for code 8 too


@pytest.mark.parametrize("struct,c_name", [(cd.DecodeArgs, "Nvfp4DecodeArgs"),
                                           (cd.ReduceArgs, "Nvfp4DecodeReduceArgs")])
def test_structs_match_the_c_header(tmp_path, struct, c_name):
    import ctypes
    cc = host_cc("the kernel header's host-side rules")
    from test_cubin_loader import _cuda_include
    inc = _cuda_include()
    fields = [f for f, _ in struct._fields_]
    prints = "".join(f'printf("%zu %zu ", offsetof({c_name}, {f}), sizeof((({c_name}*)0)->{f}));' for f in fields)
    src = tmp_path / "layout.c"
    src.write_text(f'#include <stdio.h>\n#include <stddef.h>\n#include "{cl.CSRC / "nvfp4_moe_decode.h"}"\n'
                   f'int main(void) {{ {prints} printf("%zu", sizeof({c_name})); return 0; }}\n')
    res = subprocess.run([cc, "-std=c11", f"-I{inc}", str(src), "-o", str(tmp_path / "layout")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    *got, size = map(int, subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True).stdout.split())
    assert got == [x for f in fields for x in (getattr(struct, f).offset, getattr(struct, f).size)]
    assert size == ctypes.sizeof(struct)


def test_cubin_has_every_variant_and_the_shapes_match_the_source():
    try:
        nvcc = cl.find_nvcc()
    except RuntimeError:
        pytest.skip("nvcc is not installed here")
    cubin = cd.compile_decode_cubin(nvcc=nvcc)   # the cache gpu-check's build stage fills (keyed by the sources)
    assert cd.kernel_names() <= set(cl.elf_function_symbols(cubin.read_bytes()))
    src = (cl.CSRC / "nvfp4_moe_decode.cu").read_text()
    line = next(x for x in src.splitlines() if x.startswith("#define NVFP4_DECODE_VARIANTS(X)"))
    assert line.split("X(", 1)[0] + "".join(f"X({nt}, {w}) " for nt, w in cd.SHAPES).rstrip() == line


def test_prefill_cubin_has_its_kernels():
    try:
        nvcc = cl.find_nvcc()
    except RuntimeError:
        pytest.skip("nvcc is not installed here")
    image = cd.compile_prefill_cubin(nvcc=nvcc).read_bytes()
    assert cd.prefill_kernel_names() <= set(cl.elf_function_symbols(image))
    assert len(cd.prefill_kernel_names()) == 2 * len(cd.PREFILL_BLOCKS)
    # gate_up CTAs own 64 outputs (64 gate + 64 up rows), down CTAs 128; 256 threads.
    assert cd.prefill_grid(cd.PrefillVariant(128), 1024, 2048, True) == ((8, 32, 1), (256, 1, 1))
    assert cd.prefill_grid(cd.PrefillVariant(64), 1024, 7168, False) == ((16, 56, 1), (256, 1, 1))


def test_variant_names_and_grid():
    v = cd.Variant.parse("nt4_w8_prmt_s2")
    assert (v.nt, v.warps, v.split, v.dq, v.kernel) == (4, 8, 2, "prmt", "nvfp4_decode_gemm_nt4_w8_prmt")
    assert {x.name for x in cd.VARIANTS} == {f"nt{a}_w{b}_{d}_s{s}" for a, b in cd.SHAPES for d in ("lut", "prmt")
                                             for s in cd.SPLITS}
    with pytest.raises(ValueError, match="not compiled"):
        cd.Variant.parse("nt4_w4_fast_s1")
    with pytest.raises(ValueError, match="not compiled"):
        cd.Variant.parse("nt3_w4_lut_s1")
    with pytest.raises(ValueError, match="not a decode variant"):
        cd.Variant.parse("fast")
    assert cd.parse_variant("pf_m64") == cd.PrefillVariant(64)
    assert cd.parse_variant("nt2_w4_lut_s1") == cd.Variant(2, 4, 1)
    # 4096 rows / (8 * 4 * 8) columns per CTA = 16; 3 K splits; 64 padded rows = 4 blocks.
    assert cd.launch_grid(v, 4096, 64) == ((16, 2, 4), (256, 1, 1))
    assert cd.launch_grid(cd.Variant(2, 4, 1), 100 * 8, 16) == ((13, 1, 1), (128, 1, 1))


# ---- the selection table ---------------------------------------------------------------------------------

DEVICE, CAP = "NVIDIA H200", (9, 0)


def fake_table(**over) -> dict:
    checked = {"nt4_w4_lut_s4": True, "nt8_w4_prmt_s2": True, "nt2_w4_lut_s8": False, "pf_m128": True,
               "pf_m64": False}
    buckets = [(1, "nt4_w4_lut_s4"), (8, "nt2_w4_lut_s8"), (32, "default"), (64, "nt8_w4_prmt_s2"),
               (1024, "pf_m64"), (cd.NO_LIMIT, "pf_m128")]
    t = cd.table_dict(DEVICE, CAP, checked, buckets)
    t.update(over)
    return t


def test_table_chooses_by_bucket_and_refuses_failed_variants():
    t = cd.SelectionTable(fake_table())
    assert t.choose(1) == cd.Variant(4, 4, 4)
    assert t.choose(2) is None          # the 8-token bucket's variant failed its check: the default runs
    assert t.choose(20) is None         # the grouped GEMM measured fastest there
    assert t.choose(64) == cd.Variant(8, 4, 2, "prmt")
    assert t.choose(65) is None         # pf_m64 failed its check
    assert t.choose(4096) == t.choose(10 ** 6) == cd.PrefillVariant(128)   # the last bucket: every larger batch
    short = fake_table(buckets=[{"max_tokens": 8, "variant": "nt4_w4_lut_s4"}])
    assert cd.SelectionTable(short).choose(9) is None   # past the table
    unchecked = fake_table(checked={"nt4_w4_lut_s4": True})
    assert cd.SelectionTable(unchecked).choose(64) is None   # never checked = never chosen


@pytest.mark.parametrize("over,match", [({"version": 0}, "version"), ({"checked": {"nt9_w1_lut_s1": True}}, "compiled"),
                                        ({"buckets": [{"max_tokens": 8, "variant": "nt4_w4_lut_s1"},
                                                      {"max_tokens": 8, "variant": "nt4_w4_lut_s2"}]}, "ascending"),
                                        ({"buckets": [{"max_tokens": 128, "variant": "nt4_w4_lut_s1"}]}, "up to 64"),
                                        ({"checked": {"pf_m32": True}}, "row blocks")])
def test_table_rejects_malformed(over, match):
    with pytest.raises(ValueError, match=match):
        cd.SelectionTable(fake_table(**over))


def test_table_applies_only_to_its_device_and_sources():
    t = cd.SelectionTable(fake_table())
    here = cd.table_digest()
    assert t.applies_to(DEVICE, CAP, here) == ""
    assert "this is NVIDIA H100" in t.applies_to("NVIDIA H100", CAP, here)
    assert "(10, 0)" in t.applies_to(DEVICE, (10, 0), here)
    assert "kernel sources" in t.applies_to(DEVICE, CAP, "0" * 16)


@pytest.fixture
def on_fake_device(monkeypatch, tmp_path):
    """select_decode as on an H200, with the table of NAMAZU_CUDA_MOE_TABLE (x stays a CPU tensor whose
    device type claims cuda: nothing is launched)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: DEVICE)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: CAP)
    monkeypatch.setattr(cd, "_STATE", {})
    path = tmp_path / "table.json"
    monkeypatch.setenv(cd.TABLE_ENV, str(path))

    class X:
        def __init__(self, n):
            self.shape = (n, 512)
            self.device = torch.device("cuda", 0)
    return path, X


def test_select_decode_reads_the_recorded_table(on_fake_device):
    path, X = on_fake_device
    w = weights(e=4, h=512, i=256)
    path.write_text(json.dumps({"cuda_moe_table": fake_table()}))   # gpu-check's tune.json form
    assert cd.select_decode(X(1), w) == cd.Variant(4, 4, 4)
    assert cd.select_decode(X(4), w) is None                     # failed variant: default
    assert cd.select_decode(X(cd.MAX_DECODE_TOKENS + 1), w) is None   # the failed pf_m64
    assert cd.select_decode(X(2048), w) == cd.PrefillVariant(128)
    w4a4 = md.random_nvfp4_weights(4, 512, 256)
    w4a4.a13_scale = torch.ones(4)
    assert cd.select_decode(X(1), w4a4) is None


@pytest.mark.parametrize("content", [None, "not json", json.dumps(fake_table(device="NVIDIA H100")),
                                     json.dumps(fake_table(sources="0" * 16))])
def test_select_decode_falls_back_without_a_usable_table(on_fake_device, content, caplog):
    path, X = on_fake_device
    if content is not None:
        path.write_text(content)
    with caplog.at_level("INFO"):
        assert cd.select_decode(X(1), weights(e=4, h=512, i=256)) is None
    assert "grouped GEMM" in caplog.text or "not used" in caplog.text


def test_cuda_backend_takes_the_decode_kernel_when_the_table_picks_one(monkeypatch):
    calls = []
    monkeypatch.setattr(cd, "select_decode", lambda x, w: cd.Variant(4, 4, 2) if x.shape[0] <= 8 else None)
    monkeypatch.setattr(cd, "decode_moe_nvfp4", lambda x, *a, cache=None: calls.append(("decode", a[-1])) or x)
    from namazu.kernels import cuda_moe
    monkeypatch.setattr(cuda_moe, "cuda_moe_nvfp4", lambda x, *a: calls.append(("grouped",)) or x)
    cache = cd.DecodePrepackCache()
    w = weights(e=4, h=512, i=256)
    backends._cuda_nvfp4(cache, torch.zeros(8, 512), None, None, w)
    backends._cuda_nvfp4(cache, torch.zeros(9, 512), None, None, w)
    assert calls == [("decode", cd.Variant(4, 4, 2)), ("grouped",)]


def test_prepack_cache_reuses_and_invalidates():
    cache = cd.DecodePrepackCache()
    w = weights()
    first = cache.get(w)
    assert cache.get(w) is first
    w.w2_packed.add_(1)   # an in-place write (a loader filling the buffer)
    second = cache.get(w)
    assert second is not first and torch.equal(cd.unpack(second.w2)[0], w.w2_packed)
