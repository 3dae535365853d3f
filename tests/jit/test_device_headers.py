"""Device headers on the CPU: small host programs, built with nvcc against the templates, check
the split records kernels' shared-memory bound, the lane layout, the FP8 and NVFP4 codecs and the
NVFP4 state kernel's occupancy request against their Python mirrors."""

import subprocess

import pytest
import torch

from replayssm_jit.core.dtypes import CHUNK_VALUES, CPP_TYPES
from replayssm_jit.core.tiles import lanes_per_row, rows_tilings
from replayssm_jit.families import get_family
from replayssm_jit.families.spec import (
    gdn_spec,
    kda_spec,
    mamba2_spec,
)


def _run_nvcc_program(tmp_path, name: str, body: str) -> list[int]:
    """Compile a host program (templates on the include path) with nvcc, run it, and return the
    integers it prints."""
    import tvm_ffi.libinfo

    from replayssm_jit.jit.build import template_root

    source = tmp_path / f"{name}.cu"
    source.write_text(body)
    exe = tmp_path / name
    subprocess.run(
        ["nvcc", "-std=c++17", "--expt-relaxed-constexpr", f"-I{template_root()}",
         f"-I{tvm_ffi.libinfo.find_include_path()}", str(source), "-o", str(exe)],
        check=True, capture_output=True,
    )  # fmt: skip
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.mark.nvcc
def test_split_records_shared_bytes_bounds_the_kernels(tmp_path):
    """Family.records_shared_bytes (the launch policy's fit check) is an upper bound on the
    records kernels' compiled shared memory, and a tight one, on both sides of the choice to
    stage the held x / u rows in shared memory (super120b L = 8 and qwen4b L = 16 do, super120b
    L = 16 and qwen122b L = 16 read them through L2), separate mode's held Gram included."""
    specs = [
        mamba2_spec(headdim=64, dstate=128, heads_per_group=16, window=8),
        mamba2_spec(headdim=64, dstate=128, heads_per_group=16, window=16),
        mamba2_spec(headdim=64, dstate=128, heads_per_group=16, window=32),
        gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, window=16),
        gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=4, window=16),
        gdn_spec(
            head_k_dim=128, head_v_dim=128, value_heads_per_key_head=4, window=16, read_dtype="e4m3"
        ),
        gdn_spec(
            head_k_dim=128, head_v_dim=128, value_heads_per_key_head=1, window=16, read_dtype="e4m3"
        ),
        mamba2_spec(headdim=80, dstate=128, heads_per_group=12, window=16, act_dtype="f32"),
        mamba2_spec(headdim=24, dstate=64, heads_per_group=2, window=4, act_dtype="f32"),
        gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=4, window=32),
        gdn_spec(
            head_k_dim=64, head_v_dim=64, value_heads_per_key_head=2, window=1, act_dtype="f32"
        ),
        kda_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=1, window=16),
        kda_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, window=32),
    ]
    lines = []
    for s in specs:
        act, cap = CPP_TYPES[s.act_dtype], s.capacity
        if s.family == "mamba2":
            dims = f"{s.value_dim}, {s.key_dim}, {s.heads_per_key}, {s.window}, {cap}, {act}, float, true, true, true"
            kern = f"mamba2::Records<{dims}>"
        elif s.family == "gdn":
            dims = f"{s.key_dim}, {s.value_dim}, {s.heads_per_key}, {s.window}, {cap}, {act}, float, true, true"
            separate = ", false, true" if s.read_dtype else ""  # PER_CHANNEL, SEPARATE
            kern = f"gdn::Records<{dims}, 8{separate}>"
            few_warps = f"gdn::Records<{dims}, 4{separate}>"  # bounded too, not tightly
            lines.append(f'  std::printf("%zu\\n", {few_warps}::kSmemBytes);')
        else:  # KDA: the GDN records kernel with per-channel decays
            dims = f"{s.key_dim}, {s.value_dim}, {s.heads_per_key}, {s.window}, {cap}, {act}, float, true, true"
            kern = f"gdn::Records<{dims}, 8, true>"
        lines.append(f'  std::printf("%zu\\n", {kern}::kSmemBytes);')
    compiled = _run_nvcc_program(
        tmp_path,
        "sizes",
        '#include <cstdio>\n#include "mamba2/split_kernel.cuh"\n#include "gdn/split_kernel.cuh"\n'
        "using namespace replayssm;\nint main() {\n" + "\n".join(lines) + "\n}\n",
    )
    sizes = iter(compiled)
    for spec in specs:
        bound = get_family(spec.family).records_shared_bytes(spec)
        if spec.family == "gdn":
            few_warps_size = next(sizes)
            assert few_warps_size <= bound, (spec.uri, few_warps_size, bound)
        size = next(sizes)
        assert size <= bound <= size + 256, (spec.uri, size, bound)
    assert next(sizes, None) is None


@pytest.mark.nvcc
def test_lane_layout_matches_the_python_mirror(tmp_path):
    """launch.tiles.lanes_per_row (which decides the compiled tilings) matches RowTiling's lanes
    per row, narrow (ReplaySSM) and wide (conventional), for every tiling of the model and test
    shapes."""
    shapes = [(64, 128), (80, 128), (128, 128), (64, 64), (24, 64)]  # [rows, cols] per head
    cases, lines = [], []
    for rows, cols in shapes:
        for state, cpp in (("f32", "float"), ("bf16", "__nv_bfloat16"), ("nvfp4", "nvfp4x2")):
            values = CHUNK_VALUES[state]
            if cols % values:
                continue
            for tile, warps in rows_tilings(rows, cols, values):
                narrow = lanes_per_row(tile // warps, cols, values)
                wide = min(32, cols // values)
                cases.append((narrow, wide))
                for flag in ("false", "true"):
                    lines.append(
                        f'  std::printf("%d\\n", RowTiling<{cpp}, {cols}, {tile}, {warps}, {flag}>::kLanesPerRow);'
                    )
    compiled = _run_nvcc_program(
        tmp_path,
        "lanes",
        '#include <cstdio>\n#include "common/replay.cuh"\nusing namespace replayssm;\n'
        "int main() {\n" + "\n".join(lines) + "\n}\n",
    )
    assert compiled == [lanes for case in cases for lanes in case]
    assert any(narrow < wide for narrow, wide in cases), "narrow rows must differ somewhere"


@pytest.mark.nvcc
def test_nvfp4_decode_header_matches_the_integer_reference(tmp_path):
    """templates/common/nvfp4.cuh (compiled by nvcc, run on the host) decodes every byte in every
    position of a word under every e4m3 block code and a few head scales to the bits of
    reference.precision's nvfp4_decode_bits (itself held equal to the table decode)."""
    from replayssm_jit.reference import precision as P

    heads = [1.0, 0.0078125, 3.75e-3, 2.5e4]
    body = (
        '#include <cstdio>\n#include "common/nvfp4.cuh"\nusing namespace replayssm::nvfp4;\n'
        "int main() {\n  const float heads[] = {"
        + ", ".join(f"{h!r}f" for h in heads)
        + "};\n  for (float head : heads)\n    for (uint32_t code = 0; code < 256; ++code) {\n"
        "      const float s = block_multiplier(code, head);\n"
        "      for (uint32_t b = 0; b < 256; b += 2) {  // bytes b, b + 1, 255 - b, 254 - b\n"
        "        const uint32_t word = b | (b + 1) << 8 | (255 - b) << 16 | (254 - b) << 24;\n"
        "        float v[8];\n        decode_word(word, s, v);\n"
        "        for (float x : v) {\n          uint32_t u;\n          memcpy(&u, &x, 4);\n"
        '          std::printf("%u\\n", u);\n        }\n      }\n    }\n}\n'
    )
    got = torch.tensor(_run_nvcc_program(tmp_path, "nvfp4", body), dtype=torch.int64)
    b = torch.arange(0, 256, 2)
    packed = torch.stack((b, b + 1, 255 - b, 254 - b), dim=-1).to(torch.uint8).view(-1, 8)
    want = []
    for head in heads:
        for code in range(256):
            block = torch.full((packed.shape[0], 1), code, dtype=torch.uint8)
            values = P.nvfp4_decode_bits(packed, block, torch.tensor(head))
            want.append(values.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF)
    want = torch.cat([w.flatten() for w in want])
    nan_got = (got & 0x7FFFFFFF) > 0x7F800000
    nan_want = (want & 0x7FFFFFFF) > 0x7F800000
    assert torch.equal(nan_got, nan_want)
    assert torch.equal(got[~nan_got], want[~nan_want])


def _nvfp4_test_heads() -> torch.Tensor:
    """FP32 heads [heads, 4 rows, 32 values] for the NVFP4 encoder: blocks of very different
    magnitudes (so that block scales round, underflow to 0 and saturate their values), an
    all-zero block, a zero head, a head below the head-scale floor, and exact grid values."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 4, 32, generator=gen)
    x = x * 2.0 ** torch.randint(-12, 12, (6, 4, 2), generator=gen).float().repeat_interleave(
        16, -1
    )
    x[0, 1, :16] = 0.0
    x[1] = 0.0
    x[2] *= 1e-38
    x[3, 0, :8] = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x[4, 2, 3] = -0.0
    return x.to(torch.float32)


@pytest.mark.nvcc
@pytest.mark.parametrize("sr", [False, True])
def test_nvfp4_encode_header_matches_the_reference_encoder(tmp_path, sr):
    """templates/common/nvfp4.cuh's head scale, block scale codes and e2m1 codes (RN, and SR
    with given bits), compiled by nvcc and run on the host, equal reference.precision's
    nvfp4_encode bit for bit."""
    from replayssm_jit.reference import precision as P

    x = _nvfp4_test_heads()
    bits = torch.randint(0, 2**16, x.shape, generator=torch.Generator().manual_seed(5))
    flat = ", ".join(f"{v.item().hex()}f" if v.item() == v.item() else "0.f" for v in x.flatten())
    bit_list = ", ".join(str(b) for b in bits.flatten().tolist())
    heads = x.shape[0]
    body = (
        '#include <cstdio>\n#include "common/nvfp4.cuh"\nusing namespace replayssm;\n'
        f"const float x[] = {{{flat}}};\nconst unsigned bits[] = {{{bit_list}}};\n"
        f"int main() {{\n  for (int h = 0; h < {heads}; ++h) {{\n"
        "    const float* v = x + h * 128;\n    float amax = 0.f;\n"
        "    for (int i = 0; i < 128; ++i) amax = fmaxf(amax, fabsf(v[i]));\n"
        "    const float head = nvfp4::head_scale(amax);\n"
        '    std::printf("%u\\n", fp8::bits_of(head));\n'
        "    for (int b = 0; b < 8; ++b) {\n      float block_amax = 0.f;\n"
        "      for (int i = 0; i < 16; ++i) block_amax = fmaxf(block_amax, fabsf(v[16 * b + i]));\n"
        "      const unsigned code = nvfp4::block_code(block_amax, head);\n"
        "      const float inverse = nvfp4::block_inverse(code, head);\n"
        '      std::printf("%u\\n", code);\n'
        "      for (int i = 0; i < 16; ++i)\n"
        f'        std::printf("%u\\n", nvfp4::encode<{str(sr).lower()}>(v[16 * b + i], inverse, '
        "bits[h * 128 + 16 * b + i]));\n    }\n  }\n}\n"
    )
    got = torch.tensor(_run_nvcc_program(tmp_path, f"nvfp4_encode_{sr}", body), dtype=torch.int64)
    got = got.view(heads, 1 + 8 * 17)
    want = P.nvfp4_encode(x.double(), head_dims=2, bits=bits if sr else None)
    head_bits = want.head_scale.to(torch.float32).view(torch.int32).to(torch.int64).flatten()
    assert torch.equal(got[:, 0], head_bits & 0xFFFFFFFF)
    per_block = got[:, 1:].view(heads, 8, 17)
    assert torch.equal(per_block[..., 0], want.block_scales.view(heads, 8).to(torch.int64))
    codes = P.unpack_nibbles(want.packed).view(heads, 8, 16)
    assert torch.equal(per_block[..., 1:], codes)


def _fp8_test_values() -> torch.Tensor:
    """FP32 values for the e4m3 encoder: every code's value, its neighbours' midpoints and one
    FP32 ulp either side of them, random values over the whole range (subnormal, normal, past
    448), and the specials."""
    from replayssm_jit.reference import precision as P

    grid = P.e4m3_decode(torch.arange(0x7F, dtype=torch.uint8)).to(torch.float32)
    mids = (grid[:-1].double() + grid[1:].double()).div(2).to(torch.float32)
    near = torch.cat([grid, mids, torch.nextafter(mids, torch.tensor(0.0)),
                      torch.nextafter(mids, torch.tensor(1e9))])  # fmt: skip
    gen = torch.Generator().manual_seed(8)
    scales = 2.0 ** torch.randint(-14, 10, (2048,), generator=gen).float()
    rand = torch.rand(2048, generator=gen) * scales
    specials = torch.tensor([0.0, 1e-40, 2.0**-10, 448.0, 460.0, 464.0, 480.0, 1e30,
                             float("inf"), float("nan")])  # fmt: skip
    values = torch.cat([near, rand, specials])
    return torch.cat([values, -values])


@pytest.mark.nvcc
def test_fp8_header_matches_the_reference_encoder_and_decoder(tmp_path):
    """templates/common/fp8.cuh (compiled by nvcc, run on the host): decode of every code, and
    the RN and SR (16 random bits per value) encoders over edge and random values, bit for bit
    against reference.precision's e4m3_decode / e4m3_encode; a row's scale and codes against
    fp8_encode."""
    from replayssm_jit.reference import precision as P

    values = _fp8_test_values()
    n = values.numel()
    gen = torch.Generator().manual_seed(9)
    bits = torch.randint(0, 2**16, (n,), generator=gen)
    bits[:8] = torch.tensor([0, 1, 2**15, 2**16 - 1, 0, 1, 2**15, 2**16 - 1])
    rows = (
        torch.randn(6, 64, generator=gen) * torch.tensor([1e-3, 1.0, 3e2, 1e5, 0.0, 1e-41])[:, None]
    )
    as_u32 = lambda t: ", ".join(f"{int(u) & 0xFFFFFFFF}u" for u in t.view(torch.int32).tolist())  # noqa: E731
    body = (
        '#include <cstdio>\n#include <cmath>\n#include "common/fp8.cuh"\nusing namespace replayssm::fp8;\n'
        f"static const uint32_t kValues[] = {{{as_u32(values)}}};\n"
        f"static const uint32_t kBits[] = {{{', '.join(f'{b}u' for b in bits.tolist())}}};\n"
        f"static const uint32_t kRows[] = {{{as_u32(rows.flatten())}}};\n"
        "int main() {\n"
        '  for (uint32_t c = 0; c < 256; ++c) std::printf("%u\\n", bits_of(decode(c, 1.f)));\n'
        f"  for (int i = 0; i < {n}; ++i) {{\n"
        "    const float q = float_from_bits(kValues[i]);\n"
        '    std::printf("%u %u\\n", encode<false>(q), encode<true>(q, kBits[i]));\n  }\n'
        "  for (int r = 0; r < 6; ++r) {\n    float amax = 0.f;\n"
        "    for (int c = 0; c < 64; ++c) amax = fmaxf(amax, fabsf(float_from_bits(kRows[r * 64 + c])));\n"
        "    const float scale = row_scale(amax);\n"
        '    std::printf("%u\\n", bits_of(scale));\n'
        "    for (int c = 0; c < 64; ++c)\n"
        '      std::printf("%u\\n", encode<false>(float_from_bits(kRows[r * 64 + c]) * row_inverse(scale)));\n'
        "  }\n}\n"
    )
    got = _run_nvcc_program(tmp_path, "fp8", body)
    decoded = torch.tensor(got[:256], dtype=torch.int64).to(torch.int32).view(torch.float32)
    want = P.e4m3_decode(torch.arange(256, dtype=torch.uint8)).to(torch.float32)
    assert torch.equal(decoded.isnan(), want.isnan())
    assert torch.equal(
        decoded[~want.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32)
    )
    codes = torch.tensor(got[256 : 256 + 2 * n], dtype=torch.int64).view(n, 2)
    assert torch.equal(codes[:, 0], P.e4m3_encode(values.double()).to(torch.int64))
    assert torch.equal(codes[:, 1], P.e4m3_encode(values.double(), bits).to(torch.int64))
    rest = torch.tensor(got[256 + 2 * n :], dtype=torch.int64).view(6, 65)
    ref = P.fp8_encode(rows)
    assert torch.equal(rest[:, 0].to(torch.int32).view(torch.float32), ref.scale.flatten())
    assert torch.equal(rest[:, 1:], ref.codes.to(torch.int64))


@pytest.mark.nvcc
def test_nvfp4_state_kernel_asks_for_two_ctas_per_sm(tmp_path):
    """The split GDN/KDA state kernel of a whole-head (8-warp) tile asks the register allocator
    for two CTAs per SM where a copy is NVFP4 (its SR flush store would otherwise take the
    non-flush rows to one CTA), and leaves the others to it."""
    state = "gdn::State<128, 128, 4, 16, 17, 128, 8, __nv_bfloat16"
    tail = "true, true, true, false"  # L2NORM, GATES_IN_KERNEL, SR, CAPPED_REGISTERS
    kernels = [
        f"{state}, nvfp4x2, {tail}>",
        f"{state}, float, {tail}, false, nvfp4x2>",
        f"{state}, nvfp4x2, {tail}, true>",  # KDA
        f"{state}, float, {tail}>",
        f"{state}, float, {tail}, false, e4m3>",
    ]
    lines = [f'  std::printf("%d\\n", {k}::kMinBlocks);' for k in kernels]
    got = _run_nvcc_program(
        tmp_path,
        "min_blocks",
        '#include <cstdio>\n#include "gdn/split_kernel.cuh"\nusing namespace replayssm;\n'
        "int main() {\n" + "\n".join(lines) + "\n}\n",
    )
    assert got == [2, 2, 2, 0, 0]
