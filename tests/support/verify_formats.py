"""Speculative schedules on e4m3 / NVFP4 checkpoints and read copies (the torch path), against a
float64 emulation that rounds only where the path stores a checkpoint.

The emulation keeps, per slot, the decoded carried copy and read copy (float64) and the committed
records since the last flush as float64 records: Mamba-2's (alpha, dt x, B) depend on the
inputs only; a delta-rule record keeps the u its verify computed, from the copy that verify read
(the read copy, or the folded carried state after an early flush). A verify replays from the copy
it reads (read copy in separate mode, else the checkpoint) through the committed records, then
runs each draft conventionally from its parent's state (the snapshot recurrence); an early flush
folds the committed records into the carried copy (separate delta: every u recomputed from it)
and the drafts run from that float64 state. After a flush the stored copies must be within one
code of the emulation's folded state, and the emulation continues from what was stored.
"""

from __future__ import annotations

import torch

from replayssm_jit import (
    gdn_decode,
    gdn_layout,
    gdn_verify,
    kda_decode,
    kda_layout,
    kda_verify,
    mamba2_decode,
    mamba2_layout,
    mamba2_verify,
)
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.torch_path.checkpoint import Copy, load_state

F32, F64 = torch.float32, torch.float64
DTYPES = {"f32": F32, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn,
          "nvfp4": torch.float4_e2m1fn_x2}  # fmt: skip


def decoded(tensors, prefix: str, slots) -> torch.Tensor:
    """A copy ("state" or "read") of `slots` as float64 (the torch path's own decode: exact)."""
    return load_state(Copy.named(tensors, prefix), slots).to(F64)


def code_step(got: torch.Tensor, want: torch.Tensor, fmt: str, block=None) -> torch.Tensor:
    """One code of `fmt` at each value of float64 heads [..., rows, cols], at the larger of
    |got| and |want|: a bound on a stored value's distance from the FP32 value it encodes (RN:
    half a code, a tie possibly decided the other way by the FP32 value; SR: under one code).
    bf16 2^(e - 7); e4m3 the code's step at |value| / (row amax / 448) (subnormal below 2^-6),
    times that scale; NVFP4 the e2m1 gap (0.5 below 2, 1 below 4, else 2) at |value| / S,
    times S, the stored block multiplier (`block`, e4m3 block code times head scale)."""
    mag = torch.maximum(got.abs(), want.abs())
    if fmt == "f32":
        return 1e-5 * mag + 1e-7
    if fmt == "bf16":
        return torch.exp2(torch.floor(torch.log2(mag.clamp_min(2.0**-126))) - 7)
    if fmt == "e4m3":
        scale = want.abs().amax(-1, keepdim=True) / 448
        q = (mag / scale.clamp_min(1e-30)).clamp_min(2.0**-6)
        return 1.01 * torch.exp2(torch.floor(torch.log2(q)) - 3) * scale
    q = mag / block.clamp_min(1e-30)
    gap = torch.where(q < 2, 0.5, torch.where(q < 4, 1.0, 2.0))
    return 1.01 * gap * block


def stored_block(tensors, prefix: str, slot: int) -> torch.Tensor | None:
    """An NVFP4 copy's block multipliers of `slot`, one per value (None for other formats)."""
    blocks = tensors.get(f"{prefix}_block_scale")
    if blocks is None:
        return None
    head = tensors[f"{prefix}_scale"][slot].to(F64)[:, None, None]
    return (blocks[slot].to(F64) * head).repeat_interleave(16, dim=-1)


def assert_within_one_code(got, want, fmt, what, block=None):
    assert bool(torch.isfinite(got).all()), f"{what}: not finite"
    excess = ((got - want).abs() - code_step(got, want, fmt, block)).max().item()
    assert excess <= 0, f"{what}: a value is more than one {fmt} code away ({excess:.3e} over)"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.to(F64) - want).norm() / want.norm().clamp_min(1e-300)).item()


def softplus(x):
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


class Mamba2Fam:
    name, nvfp4 = "mamba2", True
    H, G, P, N = 2, 1, 32, 32
    options = dict(has_D=True, has_z=False, has_dt_bias=True, dt_softplus=True)  # noqa: RUF012
    verify_op, decode_op = staticmethod(mamba2_verify), staticmethod(mamba2_decode)
    torch_verify = staticmethod(torch_path.mamba2_verify)

    def layout(self, state, read, L, T):
        return mamba2_layout(num_heads=self.H, headdim=self.P, dstate=self.N, ngroups=self.G,
                             window=L, drafts=T, act_dtype=F32, state_dtype=DTYPES[state],
                             read_dtype=read and DTYPES[read])  # fmt: skip

    def state_shape(self):
        return (self.H, self.P, self.N)

    def params(self, gen):
        H = self.H
        return dict(A=-(0.5 + torch.rand(H, generator=gen)), D=torch.randn(H, generator=gen),
                    dt_bias=0.1 * torch.randn(H, generator=gen))  # fmt: skip

    def drafts(self, gen, *lead):
        H, G, P, N = self.H, self.G, self.P, self.N
        return dict(x=torch.randn(*lead, H, P, generator=gen),
                    dt=torch.rand(*lead, H, generator=gen) * 2 - 2.5,
                    B=0.5 * torch.randn(*lead, G, N, generator=gen),
                    C=0.5 * torch.randn(*lead, G, N, generator=gen))  # fmt: skip

    def token(self, d, p, r, j):
        """Draft j of row r as float64: (alpha, value, key, query, skip)."""
        per = self.H // self.G
        dt = softplus(d["dt"][r, j].double() + p["dt_bias"].double())  # [H]
        alpha = torch.exp(dt * p["A"].double())[:, None, None]
        val = dt[:, None] * d["x"][r, j].double()
        key = d["B"][r, j].double().repeat_interleave(per, 0)
        query = d["C"][r, j].double().repeat_interleave(per, 0)
        return dict(alpha=alpha, val=val, key=key, q=query,
                    skip=p["D"].double()[:, None] * d["x"][r, j].double())  # fmt: skip

    def apply(self, s, rec):
        return rec["alpha"] * s + rec["val"][..., None] * rec["key"][:, None]

    def draft(self, s, tok):
        s = self.apply(s, tok)
        return (s @ tok["q"][..., None]).squeeze(-1) + tok["skip"], s, tok

    def refold(self, s, recs, separate):
        for rec in recs:
            s = self.apply(s, rec)
        return s


class DeltaFam:
    nvfp4 = True
    KH, HV, K, V = 1, 2, 32, 32
    options = dict(use_qk_l2norm=True, gates_in_kernel=False)  # noqa: RUF012

    def __init__(self, per_channel: bool):
        self.per_channel = per_channel
        self.name = "kda" if per_channel else "gdn"
        self.verify_op = kda_verify if per_channel else gdn_verify
        self.decode_op = kda_decode if per_channel else gdn_decode
        self.torch_verify = torch_path.kda_verify if per_channel else torch_path.gdn_verify

    def layout(self, state, read, L, T):
        make = kda_layout if self.per_channel else gdn_layout
        return make(num_k_heads=self.KH, num_v_heads=self.HV, head_k_dim=self.K,
                    head_v_dim=self.V, window=L, drafts=T, act_dtype=F32,
                    state_dtype=DTYPES[state], read_dtype=read and DTYPES[read])  # fmt: skip

    def state_shape(self):
        return (self.HV, self.V, self.K)

    def params(self, gen):
        return {}

    def drafts(self, gen, *lead):
        KH, HV, K, V = self.KH, self.HV, self.K, self.V
        gate = (*lead, HV, K) if self.per_channel else (*lead, HV)
        return dict(q=torch.randn(*lead, KH, K, generator=gen),
                    k=torch.randn(*lead, KH, K, generator=gen),
                    v=torch.randn(*lead, HV, V, generator=gen),
                    g=-0.3 * torch.rand(gate, generator=gen),
                    beta=torch.rand(*lead, HV, generator=gen))  # fmt: skip

    def token(self, d, p, r, j):
        per = self.HV // self.KH

        def unit(x):
            x = x.double().repeat_interleave(per, 0)
            return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

        g = d["g"][r, j].double()
        alpha = torch.exp(g)[:, None, :] if self.per_channel else torch.exp(g)[:, None, None]
        return dict(alpha=alpha, key=unit(d["k"][r, j]), q=unit(d["q"][r, j]) * self.K**-0.5,
                    v=d["v"][r, j].double(), beta=d["beta"][r, j].double()[:, None])  # fmt: skip

    def apply(self, s, rec):  # a committed record: its u as computed when it was a draft
        return rec["alpha"] * s + rec["u"][..., None] * rec["key"][:, None]

    def draft(self, s, tok):
        s = tok["alpha"] * s
        u = tok["beta"] * (tok["v"] - (s @ tok["key"][..., None]).squeeze(-1))
        rec = {**tok, "u": u}
        s = s + u[..., None] * tok["key"][:, None]
        return (s @ tok["q"][..., None]).squeeze(-1), s, rec

    def refold(self, s, recs, separate):
        for rec in recs:  # separate mode recomputes each u from the carried copy
            s = self.draft(s, rec)[1] if separate else self.apply(s, rec)
        return s


FAMS = {"mamba2": Mamba2Fam, "gdn": lambda: DeltaFam(False), "kda": lambda: DeltaFam(True)}


class SlotModel:
    """One slot's emulation: decoded copies, committed and pending float64 records."""

    def __init__(self, fam, tensors, slot, separate):
        self.fam, self.slot, self.separate = fam, slot, separate
        self.committed, self.pending = [], []
        self.reload(tensors)

    def reload(self, tensors):
        index = torch.tensor([self.slot])
        self.carried = decoded(tensors, "state", index)[0]
        self.read = decoded(tensors, "read", index)[0] if self.separate else self.carried

    def commit(self, path):
        self.committed += [self.pending[i] for i in path]
        self.pending = []

    def verify(self, toks, parents, flush):
        """The drafts' float64 outputs; with `flush` the folded carried state too (else None)."""
        folded = None
        if flush:
            folded = self.fam.refold(self.carried, self.committed, self.separate)
            base, self.committed = folded, []
        else:
            base = self.read
            for rec in self.committed:
                base = self.fam.apply(base, rec)
        states, outs, self.pending = [], [], []
        for j, tok in enumerate(toks):
            y, s, rec = self.fam.draft(base if parents[j] < 0 else states[parents[j]], tok)
            states.append(s)
            outs.append(y)
            self.pending.append(rec)
        return outs, folded
