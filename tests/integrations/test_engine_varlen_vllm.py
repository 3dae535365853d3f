"""vLLM's GDN and KDA MTP with varlen rows (rows of 1..T tokens packed back to back, cu_seqlens
not uniform), made as vLLM's fla ops are called, on the CPU path against the float64
references; pad rows (the null block) stay bit-identical and give zero output. A gather that
ignores the row layout is shown to fail the comparison."""

from __future__ import annotations

import pytest
import torch
from test_engine_calls_vllm import (
    F64,
    HV,
    I32,
    KH,
    SLOTS,
    TOL,
    K,
    T,
    V,
    assert_untouched,
    delta_oracle,
    delta_params,
    delta_tokens,
    gdn_setup,
    rel,
    snapshot,
)

from replayssm_jit.integrations.vllm.varlen import PackedRows

pytestmark = pytest.mark.usefixtures("no_launch_env")


def varlen_rounds(kda, rounds=6, seed=31):
    gen = torch.Generator().manual_seed(seed)
    _, layer, ssm_state = gdn_setup(T, kda=kda)
    A_log, dt_bias = delta_params(gen, kda)
    slots = [4, 0, 7, 1]  # row 1 is vLLM's pad (the null block)
    bs = len(slots)
    spec_state_indices_tensor = torch.tensor([[s, 8, 8] for s in slots], dtype=I32)
    num_accepted_tokens = torch.ones(bs, dtype=I32)
    ref = torch.zeros(SLOTS, HV, V, K, dtype=F64)
    before = snapshot(layer)
    for _ in range(rounds):
        lengths = torch.randint(1, T + 1, (bs,), generator=gen).tolist()
        lengths[1] = 1
        if sum(lengths) == bs * T:
            lengths[0] = 1
        n = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=I32)
        q, k, v, a, b = delta_tokens(gen, n, HV if kda else KH, kda)
        if kda:
            out = torch.full((1, n, HV, V), float("nan"))
            o, _ = layer.fused_recurrent_kda(
                q, k, v, a[None], b[None], A_log, dt_bias, -5.0, ssm_state, cu,
                spec_state_indices_tensor, num_accepted_tokens=num_accepted_tokens, out=out,
            )  # fmt: skip
            assert o is out
        else:
            o, _ = layer.fused_sigmoid_gating_delta_rule_update(
                A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v,
                initial_state=ssm_state, inplace_final_state=True, cu_seqlens=cu,
                ssm_state_indices=spec_state_indices_tensor,
                num_accepted_tokens=num_accepted_tokens, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
        assert o.shape == (1, n, HV, V)
        kept = []
        for r, s in enumerate(slots):
            lo, hi = int(cu[r]), int(cu[r + 1])
            if s == 0:
                assert torch.equal(o[0, lo:hi], torch.zeros(hi - lo, HV, V))
                kept.append(1)
                continue
            windows = []
            for j in range(lo, hi):
                one = [t[0, j][None, None] for t in (q, k, v)]
                expected = delta_oracle(ref, [s], *one, a[j][None, None], b[j][None, None],
                                        A_log, dt_bias, kda)  # fmt: skip
                assert rel(o[0, j], expected[0, 0]) < TOL, (r, j)
                windows.append(ref[s].clone())
            keep = int(torch.randint(1, hi - lo + 1, (1,), generator=gen))
            ref[s] = windows[keep - 1]
            kept.append(keep)
        num_accepted_tokens = torch.tensor(kept, dtype=I32)
    assert_untouched(before, layer, [0, 2, 3, 5, 6, 8])


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_delta_mtp_varlen_rows_as_vllm_packs_them(kda):
    varlen_rounds(kda)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_a_gather_that_ignores_the_rows_fails(kda, monkeypatch):
    """Gates copied in packed order (as if every row held T tokens) misplace later rows'."""

    def unordered(self, name, packed, tokens, dest):
        dest.view(-1, *dest.shape[2:])[:tokens].copy_(packed)
        return dest

    monkeypatch.setattr(PackedRows, "gather_gate", unordered)
    with pytest.raises(AssertionError):
        varlen_rounds(kda, rounds=2)


def test_varlen_rows_outside_0_to_T_tokens_are_refused():
    _, layer, ssm_state = gdn_setup(T)
    gen = torch.Generator().manual_seed(32)
    A_log, dt_bias = delta_params(gen)
    q, k, v, a, b = delta_tokens(gen, 5, KH)
    before = snapshot(layer)
    with pytest.raises(ValueError, match=r"cu_seqlens: expected 0 ... 5 with 0..3 tokens per row"):
        layer.fused_sigmoid_gating_delta_rule_update(
            A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v, initial_state=ssm_state,
            cu_seqlens=torch.tensor([0, 4, 5], dtype=I32),
            ssm_state_indices=torch.tensor([[2, 8, 8], [3, 8, 8]], dtype=I32),
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
    assert_untouched(before, layer, range(SLOTS))
