"""No unchecked cast and no silent drop in the current adapters (VLLMLayer, SGLangLayer): int64
slot ids past int32 raise where values are read and saturate where they are not (a wrap would
name another request's slot), counts below int32 do not wrap to positive ones, and
non-integer indices, counts and row offsets are refused by name. Each guard is shown failing
on a deliberately broken narrowing (a plain copy)."""

from __future__ import annotations

import pytest
import torch
from test_engine_calls_vllm import (
    HV,
    I32,
    I64,
    KH,
    SLOTS,
    Mamba2Params,
    T,
    assert_untouched,
    delta_params,
    delta_tokens,
    gdn_setup,
    m2_setup,
    m2_tokens,
    snapshot,
)

from replayssm_jit.integrations import sglang
from replayssm_jit.integrations.vllm import rows as rows_module
from replayssm_jit.integrations.vllm.rows import INT32_MAX

pytestmark = pytest.mark.usefixtures("no_launch_env")
WRAPS_TO_1 = 2**32 + 1  # int64 whose low 32 bits name slot 1


def m2_step(layer, ssm_state, indices, **kw):
    gen = torch.Generator().manual_seed(41)
    A, D, dt_bias = Mamba2Params(gen).expanded()
    x, dt, B, C = m2_tokens(gen, indices.shape[0])
    layer.selective_state_update(ssm_state, x, dt[:, :, None].expand(-1, -1, x.shape[2]), A, B,
                                 C, D, z=None, dt_bias=dt_bias, dt_softplus=True,
                                 state_batch_indices=indices, out=torch.empty_like(x),
                                 **kw)  # fmt: skip


def plain_copy(name, src, dst, wide, reads):
    return dst.copy_(src)  # the broken narrowing: int64 wraps


@pytest.mark.parametrize("reads", [True, False], ids=["values_read", "graph_replay"])
@pytest.mark.parametrize("broken", [False, True], ids=["adapter", "broken_copy"])
def test_int64_slot_ids_past_int32_never_name_another_slot(reads, broken, monkeypatch):
    _, layer, ssm_state = m2_setup()
    # Where values are not read (CUDA graph replay; dynamo), only the saturation guards.
    monkeypatch.setattr(rows_module, "reads_device_values", lambda plan: reads)
    if broken:
        monkeypatch.setattr(rows_module, "narrow_to_int32", plain_copy)
    before = snapshot(layer)
    try:
        m2_step(layer, ssm_state, torch.tensor([WRAPS_TO_1, 2], dtype=I64))
    except ValueError as e:  # raised by the adapter (values read) or the op (out of range)
        assert "int32 range" in str(e) or "slot" in str(e)
    touched = not all(torch.equal(before[n][1], t[1]) for n, t in layer.pool.items())
    assert touched == broken  # the broken copy writes slot 1: this guard catches it


def test_int64_counts_below_int32_do_not_wrap(monkeypatch):
    _, layer, _ = m2_setup(T)
    rows = layer.rows(2)
    monkeypatch.setattr(rows_module, "reads_device_values", lambda plan: False)
    slots = torch.tensor([3, 4], dtype=I32)
    cursors = layer.pool["cursors"].clone()
    cursors[3, 3] = cursors[4, 3] = T  # T drafts pending in both slots (cursor word 3)
    counts = torch.tensor([-(2**32) + 2, 2], dtype=I64)
    accepted = rows.accepted_from_engine(counts, cursors, slots)
    assert accepted.tolist() == [0, 2]
    # The broken form (int64 counts narrowed as they are) wraps the first to 2 drafts kept.
    wrapped = torch.minimum(counts, rows.pending).to(torch.int32)
    assert wrapped.tolist() == [2, 2]


@pytest.mark.parametrize(
    "kw, error, message",
    [
        (
            {"num_accepted_tokens": torch.tensor([1.0, 1.0])},
            TypeError,
            "num_accepted_tokens: expected dtype int32 or int64, got torch.float32",
        ),
        (
            {"num_accepted_tokens": torch.tensor([True, True])},
            TypeError,
            "num_accepted_tokens: expected dtype int32 or int64, got torch.bool",
        ),
        (
            {"cu_seqlens": torch.tensor([0.0, 3.0, 6.0])},
            TypeError,
            "cu_seqlens: expected dtype int32 or int64, got torch.float32",
        ),
        (
            {"state_batch_indices": torch.tensor([[1.0, 7, 8], [2, 7, 8]])},
            TypeError,
            "state_batch_indices: expected dtype int32 or int64, got torch.float32",
        ),
    ],
    ids=["float_counts", "bool_counts", "float_cu_seqlens", "float_indices"],
)
def test_mamba2_mtp_refuses_non_integer_indices(kw, error, message):
    _, layer, ssm_state = m2_setup(T)
    args = dict(num_accepted_tokens=torch.ones(2, dtype=I32),
                cu_seqlens=torch.tensor([0, T, 2 * T], dtype=I32),
                state_batch_indices=torch.tensor([[1, 7, 8], [2, 7, 8]], dtype=I32))  # fmt: skip
    args.update(kw)
    indices = args.pop("state_batch_indices")
    before = snapshot(layer)
    gen = torch.Generator().manual_seed(42)
    A, D, dt_bias = Mamba2Params(gen).expanded()
    x, dt, B, C = m2_tokens(gen, 2 * T)
    with pytest.raises(error, match=message):
        layer.selective_state_update(ssm_state, x, dt[:, :, None].expand(-1, -1, x.shape[2]), A,
                                     B, C, D, z=None, dt_bias=dt_bias, dt_softplus=True,
                                     state_batch_indices=indices, out=torch.empty_like(x),
                                     **args)  # fmt: skip
    assert_untouched(before, layer, range(SLOTS))


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_delta_calls_refuse_float_counts_and_wrapping_ids(kda):
    _, layer, ssm_state = gdn_setup(T, kda=kda)
    gen = torch.Generator().manual_seed(43)
    A_log, dt_bias = delta_params(gen, kda)
    q, k, v, a, b = delta_tokens(gen, 2 * T, HV if kda else KH, kda)
    cu = torch.tensor([0, T, 2 * T], dtype=I32)

    def call(indices, counts):
        if kda:
            return layer.fused_recurrent_kda(q, k, v, a[None], b[None], A_log, dt_bias, -5.0,
                                             ssm_state, cu, indices,
                                             num_accepted_tokens=counts)  # fmt: skip
        return layer.fused_sigmoid_gating_delta_rule_update(
            A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v, initial_state=ssm_state,
            cu_seqlens=cu, ssm_state_indices=indices, num_accepted_tokens=counts,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    before = snapshot(layer)
    with pytest.raises(TypeError, match="num_accepted_tokens: expected dtype int32 or int64"):
        call(torch.tensor([2, 3], dtype=I32), torch.tensor([1.5, 1.0]))
    with pytest.raises(ValueError, match="ssm_state_indices: expected slot ids in the int32"):
        call(torch.tensor([WRAPS_TO_1, 3], dtype=I64), torch.ones(2, dtype=I32))
    assert_untouched(before, layer, range(SLOTS))


def test_sglang_pad_rows_and_mamba_slots_never_wrap():
    layout = sglang.SGLangLayer  # (the layer's own buffers; no plan is needed)
    _, m2, ssm_state = m2_setup()
    layer = layout(m2.layout, ssm_state, max_batch=4, dt_softplus=True)
    with pytest.raises(ValueError, match="mamba_cache_indices: expected slot ids in the int32"):
        layer.pad_rows(torch.tensor([WRAPS_TO_1, 2], dtype=I64), 2)
    with pytest.raises(TypeError, match="mamba_cache_indices: expected dtype int32 or int64"):
        layer.pad_rows(torch.tensor([1.0, 2.0]), 2)
    table = torch.tensor([WRAPS_TO_1, 5], dtype=I64)
    got = sglang.mamba_slots(torch.tensor([0, 1, 0]), table, 2)
    assert got.tolist() == [INT32_MAX, 5, -1]  # (a plain .to(int32) gives [1, 5, -1])
    assert table.to(torch.int32).tolist()[0] == 1


def test_sglang_tree_inputs_never_wrap():
    from replayssm_jit import mamba2_layout

    layout = mamba2_layout(num_heads=4, headdim=8, dstate=16, ngroups=2, window=4, drafts=4)
    layer = sglang.SGLangLayer(layout, torch.zeros(SLOTS, 4, 8, 16), max_batch=2,
                               dt_softplus=True)  # fmt: skip
    tree = layer.tree_rows(2, 4, "x")
    slots = torch.tensor([3, -1], dtype=I32)
    # 2**32 lies outside [0, T): step 2 continues from step 1 (a wrap would read step 0).
    parents = tree.map_parents(torch.tensor([[-1, 0, 2**32, 1]] * 2, dtype=I64), slots)
    assert parents[0].tolist() == [-1, 0, 1, 1]
    layer._last_tree = tree
    with pytest.raises(TypeError, match="last_correct_step_indices: expected dtype int32 or int64"):
        layer.update_mamba_state_after_mtp_verify(torch.tensor([1.0, -1.0]))
