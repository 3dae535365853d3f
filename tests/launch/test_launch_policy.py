"""The launch policy on the CPU: kernel selection, tiles, flags, LaunchConfig overrides and the
REPLAYSSM_LAUNCH variable (policy sms = 132, an H200)."""

import re

import pytest
import torch

from replayssm_jit import LaunchConfig, gdn_layout, mamba2_layout, plan_decode
from replayssm_jit.core.launch_flags import cpp_flag_constants
from replayssm_jit.core.tiles import MAX_CTA_SHARED_BYTES, lane_values
from replayssm_jit.families import get_family
from replayssm_jit.families.spec import gdn_spec, mamba2_spec, spec_tilings
from replayssm_jit.launch import policy
from replayssm_jit.launch.config import LAUNCH_ENV, parse_launch, resolve_config
from replayssm_jit.launch.policy import (
    FLAG_CAPPED_STATE_REGISTERS,
    FLAG_FEW_RECORDS_WARPS,
    FLAG_FLUSH_EVERY_STEP,
    FLAG_OVERLAP_PRIOR_KERNEL,
    FLAG_SPECULATIVE_RECORDS,
    FLAG_SPLIT,
    MAX_LANE_VALUES,
    SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM,
    Launch,
    can_split,
    choose_replay_kernel,
    choose_rows_per_cta,
    launch_flags,
    verify_launch_flags,
)

SMS = 132  # an H200
AUTO = LaunchConfig()

pytestmark = pytest.mark.usefixtures("no_launch_env")


def launch(spec, batch, heads, *, replay=True, **config) -> Launch:
    return policy.choose_launch(
        spec, batch, heads, SMS, replay=replay, config=LaunchConfig(**config)
    )


def flags(spec, batch, heads, *, replay=True, **config) -> int:
    return launch(spec, batch, heads, replay=replay, **config).flag_bits


def records_shared_bytes(spec) -> int:
    return get_family(spec.family).records_shared_bytes(spec)


def super120b(**kwargs):
    return mamba2_spec(headdim=64, dstate=128, heads_per_group=16, **kwargs)


def nano4b(**kwargs):
    return mamba2_spec(headdim=80, dstate=128, heads_per_group=12, **kwargs)


def qwen4b(**kwargs):
    return gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, **kwargs)


def qwen122b(**kwargs):
    return gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=4, **kwargs)


def test_replay_kernel_heuristic():
    spec = super120b()
    chosen = launch(spec, 256, 128)
    assert chosen.kernel == "split" and chosen.flag_bits & FLAG_SPLIT and chosen.rows_per_cta == 64
    # 2048 records CTAs on 132 SMs: only the held ring rows are read
    assert not chosen.flag_bits & FLAG_SPECULATIVE_RECORDS
    assert choose_replay_kernel(spec, 256, 128, SMS, AUTO) == "split"
    # batch 8: 1024 (row, head) pairs, still split, whole heads per state CTA; 64 records CTAs
    chosen = launch(spec, 8, 128)
    assert chosen.flag_bits & FLAG_SPLIT and chosen.rows_per_cta == 64
    assert chosen.flag_bits & FLAG_SPECULATIVE_RECORDS
    # one sequence (128 pairs on 132 SMs), FP32 checkpoints: the per-item kernel flushing every
    # token, with nothing held to load speculatively
    chosen = launch(spec, 1, 128)
    assert chosen.kernel == "flush-every-step"
    assert chosen.flag_bits == FLAG_FLUSH_EVERY_STEP | FLAG_OVERLAP_PRIOR_KERNEL
    assert choose_replay_kernel(spec, 1, 128, SMS, AUTO) == "flush-every-step"
    # so do one BF16 or FP16 copy (rounded every token, as the conventional step rounds it)
    for state in ("bf16", "f16"):
        chosen = launch(super120b(state_dtype=state), 1, 128)
        assert chosen.kernel == "flush-every-step" and chosen.rows_per_cta == 16
    # e4m3 and NVFP4 checkpoints and read copies keep their window: the per-item kernel, speculative
    for narrow in (dict(state_dtype="e4m3"), dict(state_dtype="nvfp4"),
                   dict(state_dtype="f32", read_dtype="e4m3"), dict(state_dtype="bf16", read_dtype="e4m3")):  # fmt: skip
        chosen = launch(super120b(**narrow), 1, 128)
        assert chosen.kernel == "per-item", narrow
        assert chosen.flag_bits == FLAG_SPECULATIVE_RECORDS | FLAG_OVERLAP_PRIOR_KERNEL
    # the conventional step is never split; GDN splits too
    conventional = launch(spec, 256, 128, replay=False)
    assert conventional.kernel == "conventional" and not conventional.flag_bits & FLAG_SPLIT
    assert launch(qwen4b(), 256, 32).flag_bits & FLAG_SPLIT


def test_policy_takes_the_sm_count():
    """sms is an argument: the same batch splits on a chip it fills and not on a bigger one."""
    spec = super120b()
    assert choose_replay_kernel(spec, 1, 128, 128, AUTO) == "split"
    assert choose_replay_kernel(spec, 1, 128, 129, AUTO) == "flush-every-step"
    assert policy.sm_count(torch.device("cpu")) == SMS


def test_replay_kernel_override():
    spec = qwen4b()
    chosen = launch(spec, 256, 32, kernel="per-item")
    assert chosen.kernel == "per-item" and not chosen.flag_bits & FLAG_SPLIT
    assert chosen.rows_per_cta in [r for r, _ in spec_tilings(spec)]
    chosen = launch(spec, 256, 32, kernel="flush-every-step")
    assert chosen.flag_bits == FLAG_FLUSH_EVERY_STEP | FLAG_OVERLAP_PRIOR_KERNEL
    with pytest.raises(
        ValueError, match=r"^config.kernel: expected 'auto' or one of .*, got 'fast'"
    ):
        LaunchConfig(kernel="fast")
    # the conventional step ignores a ReplaySSM kernel choice
    assert launch(spec, 256, 32, replay=False, kernel="split").kernel == "conventional"


def test_split_kernel_forced():
    spec = super120b()
    chosen = launch(spec, 256, 128, kernel="split")
    # the state kernel runs on the per-item tiles
    assert chosen.flag_bits & FLAG_SPLIT and chosen.rows_per_cta == 64
    assert launch(spec, 1, 128, kernel="split").rows_per_cta == 16
    # the conventional step is never split
    assert not flags(spec, 256, 128, replay=False, kernel="split") & FLAG_SPLIT
    chosen = launch(qwen4b(), 256, 32, kernel="split")
    assert chosen.flag_bits & FLAG_SPLIT and chosen.rows_per_cta == 64


def test_split_needs_the_records_in_shared_memory():
    # dstate 1024, L = 128: the group's 128 bf16 B records alone are 256 KiB
    wide = mamba2_spec(headdim=64, dstate=1024, heads_per_group=8, window=128)
    assert records_shared_bytes(wide) > MAX_CTA_SHARED_BYTES and not can_split(wide)
    assert not flags(wide, 256, 128) & FLAG_SPLIT
    with pytest.raises(
        ValueError, match=r"^config\.kernel: 'split' needs .* got 8 heads and \d+ bytes"
    ):
        launch(wide, 256, 128, kernel="split")
    # more heads per group than the records CTA has threads, however small the ring
    many = mamba2_spec(headdim=16, dstate=16, heads_per_group=512, window=1)
    assert records_shared_bytes(many) <= MAX_CTA_SHARED_BYTES and not can_split(many)
    with pytest.raises(ValueError, match=r"^config\.kernel: .*got 512 heads"):
        launch(many, 4, 512, kernel="split")
    assert not flags(many, 4, 512) & FLAG_SPLIT
    # the model shapes fit with room to spare
    assert records_shared_bytes(super120b(window=32)) < 96 * 1024
    assert records_shared_bytes(qwen122b(window=32)) < 96 * 1024
    assert can_split(super120b(window=32)) and can_split(qwen122b(window=32))


def test_speculative_flag_threshold_and_override():
    no_overlap = LaunchConfig(overlap_prior_kernel=False)  # (its bit checked on its own)
    limit = SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM * SMS
    spec_split = FLAG_SPLIT | FLAG_SPECULATIVE_RECORDS
    assert launch_flags("split", limit - 1, SMS, no_overlap) == spec_split
    assert launch_flags("split", limit, SMS, no_overlap) == FLAG_SPLIT
    assert launch_flags("per-item", 10 * limit, SMS, no_overlap) == FLAG_SPECULATIVE_RECORDS
    assert launch_flags("flush-every-step", 1, SMS, no_overlap) == FLAG_FLUSH_EVERY_STEP
    on = LaunchConfig(overlap_prior_kernel=False, speculative_records=True)
    assert launch_flags("split", limit, SMS, on) == spec_split
    off = LaunchConfig(overlap_prior_kernel=False, speculative_records=False)
    assert launch_flags("split", 1, SMS, off) == FLAG_SPLIT
    assert launch_flags("per-item", 1, SMS, off) == 0
    with pytest.raises(ValueError, match=r"^config.speculative_records: expected 'auto' or a bool"):
        LaunchConfig(speculative_records="yes")


def test_few_records_warps_for_gdn_at_large_batch():
    qwen, m2, big = qwen4b(), super120b(), qwen122b()
    few = FLAG_FEW_RECORDS_WARPS
    # qwen4b: 16 key heads per batch row; 8 CTAs per SM on 132 SMs from 1056 items (batch 66)
    assert flags(qwen, 256, 32) & few
    assert not flags(qwen, 65, 32) & few
    assert flags(qwen, 66, 32) & few
    assert not flags(qwen, 8, 32) & few
    assert not flags(qwen, 256, 32, replay=False) & few
    assert not flags(m2, 256, 128) & few  # Mamba-2: never
    # qwen122b: four value heads per key head, 4 rows per thread of a 4-warp CTA: 8 warps
    assert not flags(big, 256, 64) & few
    assert flags(big, 256, 64, records_warps=4) & few
    assert flags(qwen, 8, 32, records_warps=4) & few
    assert not flags(qwen, 256, 32, records_warps=8) & few
    assert not flags(m2, 256, 128, records_warps=8) & few
    with pytest.raises(ValueError, match=r"^config\.records_warps: expected one of \[8, 4\] .*16"):
        launch(qwen, 256, 32, records_warps=16)
    with pytest.raises(ValueError, match=r"^config\.records_warps"):  # whatever the kernel
        launch(qwen, 1, 32, records_warps=16)
    # Mamba-2 compiles 8-warp records CTAs only
    with pytest.raises(ValueError, match=r"^config\.records_warps: expected one of \[8\] .*got 4"):
        launch(m2, 256, 128, records_warps=4)
    with pytest.raises(
        ValueError, match=r"^config.records_warps: expected 'auto' or a positive int"
    ):
        LaunchConfig(records_warps=0)


def test_capped_state_registers_for_gdn_at_large_batch():
    qwen, m2 = qwen4b(), super120b()
    capped = FLAG_CAPPED_STATE_REGISTERS
    # qwen4b: 32 value heads x 2 tiles of 64 rows per batch row; FP32 checkpoints: 64 CTAs per
    # SM on 132 SMs from 8448 CTAs (batch 132); BF16: 12 per SM from 1584 CTAs (batch 25)
    assert flags(qwen, 256, 32) & capped
    assert flags(qwen, 132, 32) & capped
    assert not flags(qwen, 131, 32) & capped
    assert not flags(qwen, 8, 32) & capped
    qwen_bf16 = qwen4b(state_dtype="bf16")
    assert flags(qwen_bf16, 25, 32) & capped
    assert not flags(qwen_bf16, 24, 32) & capped
    assert not flags(qwen, 256, 32, replay=False) & capped
    assert not flags(m2, 256, 128) & capped  # Mamba-2: never
    assert flags(qwen, 8, 32, capped_state_registers=True) & capped
    assert not flags(qwen, 1, 32, capped_state_registers=True) & capped  # no split kernel
    assert not flags(qwen, 256, 32, capped_state_registers=False) & capped
    assert not flags(m2, 256, 128, capped_state_registers=False) & capped
    # Mamba-2 has no capped-registers state kernel: asking for it is an error, whatever the kernel
    for batch in (1, 256):
        with pytest.raises(ValueError, match=r"^config\.capped_state_registers: expected False"):
            launch(m2, batch, 128, capped_state_registers=True)
    with pytest.raises(
        ValueError, match=r"^config.capped_state_registers: expected 'auto' or a bool, got 'yes'"
    ):
        LaunchConfig(capped_state_registers="yes")


def test_overlap_prior_kernel_by_default_and_override():
    qwen, m2 = qwen4b(), super120b()
    overlap = FLAG_OVERLAP_PRIOR_KERNEL
    for spec, heads in ((qwen, 32), (m2, 128)):
        for batch in (1, 8, 256):  # the conventional step: always
            assert flags(spec, batch, heads, replay=False) & overlap
        # ReplaySSM: the per-item kernel flushing every token at batch 1, the split one beyond
        assert flags(spec, 1, heads) & overlap
        assert not flags(spec, 8, heads) & overlap
    # the split step from 4 records CTAs per SM (528 on 132 SMs): qwen4b has 16 key heads,
    # super120b 8 groups per batch row
    assert flags(qwen, 33, 32) & overlap
    assert not flags(qwen, 32, 32) & overlap
    assert flags(m2, 66, 128) & overlap
    assert not flags(m2, 64, 128) & overlap
    assert flags(qwen, 256, 32) & overlap
    assert flags(qwen, 256, 32, kernel="per-item") & overlap
    assert flags(qwen, 8, 32, overlap_prior_kernel=True) & overlap
    assert not flags(qwen, 1, 32, overlap_prior_kernel=False) & overlap
    assert not flags(qwen, 256, 32, overlap_prior_kernel=False) & overlap
    assert not flags(m2, 1, 128, replay=False, overlap_prior_kernel=False) & overlap
    with pytest.raises(
        ValueError, match=r"^config.overlap_prior_kernel: expected 'auto' or a bool"
    ):
        LaunchConfig(overlap_prior_kernel="on")


def test_launch_flag_bits_match_the_kernels():
    """launch/policy.py's FLAG_* constants are the bindings' kFlag* bits (rendered into every
    module from core/launch_flags.py; tests/families/test_schema.py reads them from rendered modules)."""
    header = cpp_flag_constants()
    bits = {
        re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper(): int(value)
        for name, value in re.findall(r"constexpr int64_t kFlag(\w+) = (\d+);", header)
    }
    python = {
        name.removeprefix("FLAG_"): getattr(policy, name)
        for name in dir(policy)
        if name.startswith("FLAG_")
    }
    assert bits and bits == python


def test_lane_values_and_the_bf16_gdn_tile():
    # fp32 [64, 128] head on 4 warps (128 lanes): 64 values per lane, whatever the lane layout
    assert lane_values(64, 4, 128) == 64
    # bf16 [128, 128] head on 4 warps: 128 values per lane, too many
    assert lane_values(128, 4, 128) == 128 > MAX_LANE_VALUES
    qwen_bf16 = qwen4b(state_dtype="bf16")
    # the per-item tile, for the conventional step and for ReplaySSM alike
    assert launch(qwen_bf16, 256, 32, replay=False).rows_per_cta == 64
    assert launch(qwen_bf16, 256, 32).rows_per_cta == 64


def test_bf16_checkpoints_split_too():
    chosen = launch(super120b(state_dtype="bf16"), 256, 128)
    assert chosen.flag_bits & FLAG_SPLIT and chosen.rows_per_cta == 64


def test_mamba2_conventional_step_takes_smaller_tiles_at_small_batch():
    spec = super120b()
    # batch 8: 16-row tiles (4096 CTAs) rather than 64 (1024); batch 1, where no tile gives 16
    # CTAs per SM: the largest that gives 2 (16 rows, 512 CTAs on 132 SMs; 32 rows give 256)
    assert launch(spec, 8, 128, replay=False).rows_per_cta == 16
    assert launch(spec, 1, 128, replay=False).rows_per_cta == 16
    assert launch(nano4b(), 1, 96, replay=False).rows_per_cta == 20  # 384 CTAs
    # from batch 64 the grid fills the chip with the largest tile, as before
    assert launch(spec, 64, 128, replay=False).rows_per_cta == 64
    # the ReplaySSM kernels keep TARGET_CTAS_PER_SM
    assert launch(spec, 8, 128).rows_per_cta == 64
    # GDN's conventional step keeps it too
    assert launch(qwen4b(), 8, 32, replay=False).rows_per_cta == 64


def test_flush_every_step_tiles():
    # GDN: the largest tile giving every SM one CTA (qwen122b batch 1: 32 rows, 256 CTAs on 132
    # SMs; qwen4b: 16 rows, 256 CTAs, as 32 would give 128)
    chosen = launch(qwen122b(), 1, 64)
    assert chosen.flag_bits & FLAG_FLUSH_EVERY_STEP and chosen.rows_per_cta == 32
    chosen = launch(qwen4b(), 1, 32)
    assert chosen.flag_bits & FLAG_FLUSH_EVERY_STEP and chosen.rows_per_cta == 16
    # Mamba-2 keeps two CTAs per SM (super120b: 16 rows, 512 CTAs; nano4b: 20 rows, 384)
    chosen = launch(super120b(), 1, 128)
    assert chosen.flag_bits & FLAG_FLUSH_EVERY_STEP and chosen.rows_per_cta == 16
    assert launch(nano4b(), 1, 96).rows_per_cta == 20
    # BF16 checkpoints take the same tiles; e4m3 ones keep the window on the per-item kernel,
    # with the ReplaySSM target
    chosen = launch(qwen122b(state_dtype="bf16"), 1, 64)
    assert chosen.flag_bits & FLAG_FLUSH_EVERY_STEP and chosen.rows_per_cta == 32
    chosen = launch(qwen122b(state_dtype="e4m3"), 1, 64)
    assert not chosen.flag_bits & (FLAG_FLUSH_EVERY_STEP | FLAG_SPLIT) and chosen.rows_per_cta == 16


def test_gdn_separate_per_item_tile_gives_one_cta_per_sm():
    """GDN separate mode's per-item step (batch 1) takes the largest tile giving every SM one CTA
    (qwen122b: 32 rows, 256 CTAs; its flush forms the held weights in every CTA), not the
    one-copy step's 16."""
    chosen = launch(qwen122b(read_dtype="e4m3"), 1, 64)
    assert not chosen.flag_bits & (FLAG_FLUSH_EVERY_STEP | FLAG_SPLIT) and chosen.rows_per_cta == 32
    assert launch(qwen122b(read_dtype="e4m3"), 8, 64).flag_bits & FLAG_SPLIT


def test_mamba2_windowed_per_item_tile_gives_one_cta_per_sm():
    """Mamba-2's windowed per-item step (batch 1 with an e4m3 or NVFP4 checkpoint or a read
    copy) takes the largest tile giving every SM one CTA: super120b 32 rows (256 CTAs; 64 rows
    would leave 4 SMs idle); an NVFP4 copy its whole head (its only tile); one FP32 or BF16
    copy still flushes every step on 16."""
    for spec, rows in ((super120b(state_dtype="e4m3"), 32), (super120b(read_dtype="e4m3"), 32),
                       (super120b(read_dtype="nvfp4"), 64)):  # fmt: skip
        chosen = launch(spec, 1, 128)
        assert not chosen.flag_bits & (FLAG_FLUSH_EVERY_STEP | FLAG_SPLIT), spec
        assert chosen.rows_per_cta == rows, spec
    every = launch(super120b(state_dtype="bf16"), 1, 128)
    assert every.flag_bits & FLAG_FLUSH_EVERY_STEP and every.rows_per_cta == 16


def test_rows_per_cta_override():
    """(Was test_gdn_cpu.py's, on REPLAYSSM_GDN_ROWS_PER_CTA.)"""
    spec = qwen4b()
    tilings = spec_tilings(spec)
    options = [r for r, _ in tilings]
    four_warp = [r for r, w in tilings if w == 4]  # the policy prefers 4-warp tiles
    # plenty of CTAs: big tiles; one sequence: split rows
    assert choose_rows_per_cta(spec, "conventional", 256, 32, SMS, AUTO) == four_warp[0]
    assert choose_rows_per_cta(spec, "conventional", 1, 32, SMS, AUTO) == four_warp[-1]
    assert launch(spec, 256, 32, replay=False, rows_per_cta=options[1]).rows_per_cta == options[1]
    assert launch(spec, 256, 32, rows_per_cta=options[1]).rows_per_cta == options[1]
    expected = re.escape(f"expected one of {options} (compiled into {spec.uri}), got 24")
    with pytest.raises(ValueError, match=rf"^config\.rows_per_cta: {expected}$"):
        launch(spec, 256, 32, replay=False, rows_per_cta=24)
    with pytest.raises(
        ValueError, match=r"^config.rows_per_cta: expected 'auto' or a positive int"
    ):
        LaunchConfig(rows_per_cta=-1)


# --- REPLAYSSM_LAUNCH ----------------------------------------------------------------------


def test_launch_env_parses():
    assert parse_launch("") == LaunchConfig()
    assert parse_launch(" kernel=split , rows_per_cta=16,records_warps=4") == LaunchConfig(
        kernel="split", rows_per_cta=16, records_warps=4
    )
    parsed = parse_launch(
        "speculative_records=0,overlap_prior_kernel=true,capped_state_registers=1"
    )
    assert parsed == LaunchConfig(
        speculative_records=False, overlap_prior_kernel=True, capped_state_registers=True
    )
    assert parse_launch("speculative_records=auto,rows_per_cta=auto") == LaunchConfig()


@pytest.mark.parametrize(
    "text, match",
    [
        ("kernel", "expected field=value pairs"),
        ("bogus=1", "expected field=value pairs"),
        ("kernel=fast", "kernel: expected 'auto' or one of"),
        ("rows_per_cta=-3", "rows_per_cta: expected 'auto' or a positive int"),
        ("records_warps=four", "records_warps: expected 'auto' or a positive int"),
        ("speculative_records=yes", "speculative_records expected 0, 1, true, false or auto"),
    ],
)
def test_launch_env_bad_text_names_the_variable(launch_env, text, match):
    with pytest.raises(ValueError, match=rf"^{LAUNCH_ENV}: .*{match}"):
        parse_launch(text)
    launch_env(LAUNCH_ENV, text)
    with pytest.raises(ValueError, match=rf"^{LAUNCH_ENV}: .*{match}"):
        resolve_config(None)
    layout = mamba2_layout(num_heads=4, headdim=8, dstate=16, ngroups=2, window=4)
    with pytest.raises(ValueError, match=rf"^{LAUNCH_ENV}: "):
        plan_decode(layout, 2, device="cpu")


def test_launch_env_fills_only_auto_fields(launch_env):
    launch_env(LAUNCH_ENV, "kernel=per-item,rows_per_cta=32,speculative_records=0")
    assert resolve_config(None) == LaunchConfig(
        kernel="per-item", rows_per_cta=32, speculative_records=False
    )
    given = LaunchConfig(kernel="split", overlap_prior_kernel=True)
    assert resolve_config(given) == LaunchConfig(
        kernel="split", rows_per_cta=32, speculative_records=False, overlap_prior_kernel=True
    )
    launch_env(LAUNCH_ENV, "  ")
    assert resolve_config(given) == given
    with pytest.raises(TypeError, match="^config: expected a LaunchConfig or None"):
        resolve_config({"kernel": "split"})


def test_launch_env_reaches_plan(launch_env):
    """plan_decode reads REPLAYSSM_LAUNCH (the CPU path honours the kernel choice that changes
    its semantics: flush-every-step), and a LaunchConfig field beats it."""
    layout = gdn_layout(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=16, window=4)
    assert plan_decode(layout, 2, device="cpu").kernel == "per-item"
    launch_env(LAUNCH_ENV, "kernel=flush-every-step")
    assert plan_decode(layout, 2, device="cpu").kernel == "flush-every-step"
    assert plan_decode(layout, 2, device="cpu", mode="conventional").kernel == "conventional"
    config = LaunchConfig(kernel="per-item")
    assert plan_decode(layout, 2, device="cpu", config=config).kernel == "per-item"


def test_verify_kernel_choice():
    """Mamba-2 and GDN verify with the split kernel from their families'
    verify_split_min_pairs_per_sm pairs per SM, per item below it or wherever config.kernel
    names another kernel."""
    sms = 132
    spec = super120b(window=16, drafts=4)
    threshold = get_family("mamba2").launch.verify_split_min_pairs_per_sm * sms
    assert policy.can_split_verify(spec)
    choose = policy.choose_verify_kernel
    below = -(-threshold // 128) - 1  # the largest batch under the threshold at 128 heads
    assert choose(spec, below, 128, sms, LaunchConfig()) == "per-item"
    assert choose(spec, below + 1, 128, sms, LaunchConfig()) == "split"
    assert choose(spec, 1, 128, sms, LaunchConfig(kernel="split")) == "split"
    for kernel in ("per-item", "flush-every-step"):
        assert choose(spec, 256, 128, sms, LaunchConfig(kernel=kernel)) == "per-item"
    gdn = qwen4b(window=16, drafts=4)
    assert policy.can_split_verify(gdn)
    assert choose(gdn, 256, 32, sms, LaunchConfig()) == "split"
    assert choose(gdn, 8, 32, sms, LaunchConfig()) == "split"  # 1.9 pairs per SM
    assert choose(gdn, 1, 64, sms, LaunchConfig()) == "per-item"
    assert choose(spec, 8, 128, sms, LaunchConfig()) == "per-item"  # Mamba-2 at 7.8
    # The records kernels' shared memory bounds where they are compiled to run.
    assert get_family("mamba2").verify_records_shared_bytes(spec) <= MAX_CTA_SHARED_BYTES
    assert get_family("gdn").verify_records_shared_bytes(gdn) <= MAX_CTA_SHARED_BYTES


def test_verify_flags_load_rings_early_only_at_small_batches():
    """The verify's flags: a programmatic launch as the step's rules; ring rows before the
    cursor read under SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM records CTAs per SM for either
    kernel (the per-item verify also runs KDA at large batches, where the bytes would cost)."""
    limit = SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM * SMS
    early, overlap = FLAG_SPECULATIVE_RECORDS, FLAG_OVERLAP_PRIOR_KERNEL
    assert verify_launch_flags("per-item", 8, SMS, AUTO) == early | overlap  # super120b, batch 1
    assert verify_launch_flags("per-item", limit - 1, SMS, AUTO) == early | overlap
    assert verify_launch_flags("per-item", limit, SMS, AUTO) == overlap
    assert verify_launch_flags("per-item", 32 * 256, SMS, AUTO) == overlap  # kimi48b, batch 256
    assert verify_launch_flags("split", 8 * 256, SMS, AUTO) == FLAG_SPLIT | overlap
    assert verify_launch_flags("split", 16 * 8, SMS, AUTO) == FLAG_SPLIT | early  # qwen4b, batch 8
    forced = LaunchConfig(speculative_records=True, overlap_prior_kernel=False)
    assert verify_launch_flags("per-item", 32 * 256, SMS, forced) == early
    off = LaunchConfig(speculative_records=False, overlap_prior_kernel=False)
    assert verify_launch_flags("per-item", 8, SMS, off) == 0


def planned_verify(spec, batch, heads, **config):
    """(verify kernel, verify row tile) of a CUDA plan (policy.sm_count patched to SMS)."""
    plan = policy.plan_launch(
        spec, batch, heads, torch.device("cuda"), replay=True, config=LaunchConfig(**config)
    )
    return plan.verify_kernel, plan.verify_rows_per_cta


def test_split_verify_halves_its_state_tile_under_8_ctas_per_sm(monkeypatch):
    """From T = 4, the split verify's state kernel takes half the split step's tile where that
    tile gives under 8 CTAs per SM (measured: GDN at batches 4-16, H100); T = 2, larger grids,
    Mamba-2 (split only from 8 pairs per SM) and an asked-for tile keep the step's."""
    monkeypatch.setattr(policy, "sm_count", lambda device: SMS)
    for T in (4, 8):
        assert planned_verify(qwen4b(window=16, drafts=T), 8, 32) == ("split", 32)  # 512 CTAs at 64
        assert planned_verify(qwen4b(window=16, drafts=T), 16, 32) == ("split", 32)
        assert planned_verify(qwen4b(window=16, drafts=T), 64, 32) == ("split", 64)
        assert planned_verify(qwen122b(window=16, drafts=T), 8, 64) == ("split", 32)
        assert planned_verify(qwen122b(window=16, drafts=T), 16, 64) == ("split", 64)  # 2,048 CTAs
        assert planned_verify(super120b(window=16, drafts=T), 16, 128) == ("split", 64)
    assert planned_verify(qwen4b(window=16, drafts=2), 8, 32) == ("split", 64)
    assert planned_verify(qwen4b(window=16, drafts=4), 8, 32, verify_rows_per_cta=64) == (
        "split",
        64,
    )
    assert planned_verify(qwen4b(window=16, drafts=4), 8, 32, rows_per_cta=16) == ("split", 16)


def test_per_item_verify_takes_32_rows_under_one_pair_per_sm(monkeypatch):
    """Under one (batch row, head) pair per SM the per-item verify takes the 32-row tile where
    compiled (measured at batch 1: super120b, qwen122b, kimi48b); an asked-for tile stands."""
    from replayssm_jit.families.spec import kda_spec

    kimi = kda_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=1, window=16, drafts=4)
    m2, nano = super120b(window=16, drafts=4), nano4b(window=16, drafts=4)
    assert policy.few_pairs_verify_rows(m2, 1, 128, SMS) == 32
    assert policy.few_pairs_verify_rows(m2, 2, 128, SMS) == 0  # 256 pairs on 132 SMs
    assert policy.few_pairs_verify_rows(kimi, 4, 32, SMS) == 32
    assert policy.few_pairs_verify_rows(nano, 1, 96, SMS) == 0  # no 32-row tile (80-row heads)
    monkeypatch.setattr(policy, "sm_count", lambda device: SMS)
    assert planned_verify(m2, 1, 128) == ("per-item", 32)
    assert planned_verify(m2, 8, 128) == ("per-item", 64)  # the CTAs-per-SM target's tile
    assert planned_verify(kimi, 1, 32) == ("per-item", 32)
    assert planned_verify(m2, 1, 128, verify_rows_per_cta=16) == ("per-item", 16)
    assert planned_verify(m2, 1, 128, rows_per_cta=8) == ("per-item", 8)
    assert planned_verify(m2, 1, 128, kernel="split")[0] == "split"
