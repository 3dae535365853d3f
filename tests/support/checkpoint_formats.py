"""Shared scaffolding of the checkpoint-format tests (test_checkpoint_formats_*.py): the Mamba-2
and delta-rule (GDN, KDA) families as those tests drive them: cache and wrapper types, dimensions,
fresh random tokens, the wrapper's run and the float64 pool step of the reference package.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from replayssm_jit import (
    GDNDecodeCache,
    GDNDecodeWrapper,
    KDADecodeCache,
    KDADecodeWrapper,
    Mamba2DecodeCache,
    Mamba2DecodeWrapper,
)
from replayssm_jit.reference.gdn import gdn_step_pool
from replayssm_jit.reference.kda import kda_step_pool
from replayssm_jit.reference.mamba2 import mamba2_step_pool

F32, F64 = torch.float32, torch.float64


class Mamba2Family:
    cache_type, wrapper_type = Mamba2DecodeCache, Mamba2DecodeWrapper
    options: ClassVar[dict] = dict(has_D=True, has_z=False, has_dt_bias=True, dt_softplus=True)

    def __init__(self, device, gen, heads=4, groups=2):
        self.device, self.gen = device, gen
        self.H, self.G, self.P, self.N = heads, groups, 64, 128
        self.dims = dict(num_heads=heads, headdim=self.P, dstate=self.N, ngroups=groups)
        self.A = -(0.5 + torch.rand(heads, generator=gen))
        self.D = torch.randn(heads, generator=gen)
        self.dt_bias = 0.1 * torch.randn(heads, generator=gen)

    @property
    def state_shape(self):
        return (self.H, self.P, self.N)

    def tokens(self, batch):
        g, dev = self.gen, self.device
        return dict(
            x=torch.randn(batch, self.H, self.P, generator=g).to(dev),
            dt=(torch.rand(batch, self.H, generator=g) * 2 - 2.5).to(dev),
            A=self.A.to(dev),
            B=(0.5 * torch.randn(batch, self.G, self.N, generator=g)).to(dev),
            C=(0.5 * torch.randn(batch, self.G, self.N, generator=g)).to(dev),
            D=self.D.to(dev),
            dt_bias=self.dt_bias.to(dev),
        )

    def run(self, wrapper, tok, slots):
        tok = dict(tok)
        return wrapper.run(tok.pop("x"), tok.pop("dt"), tok.pop("A"), tok.pop("B"), tok.pop("C"),
                           slots, **tok)  # fmt: skip

    def reference(self, pool, slots, tok):
        t = {k: v.cpu() for k, v in tok.items()}
        return mamba2_step_pool(pool, slots, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"],
                                None, t["dt_bias"], True)  # fmt: skip


class DeltaFamily:
    options: ClassVar[dict] = dict(use_qk_l2norm=True, gates_in_kernel=False)

    def __init__(self, device, gen, per_channel):
        self.device, self.gen, self.per_channel = device, gen, per_channel
        self.H, self.HV, self.K, self.V = 1, 2, 128, 128
        self.dims = dict(num_k_heads=1, num_v_heads=2, head_k_dim=128, head_v_dim=128)
        self.cache_type = KDADecodeCache if per_channel else GDNDecodeCache
        self.wrapper_type = KDADecodeWrapper if per_channel else GDNDecodeWrapper
        self.step_pool = kda_step_pool if per_channel else gdn_step_pool

    @property
    def state_shape(self):
        return (self.HV, self.V, self.K)

    def tokens(self, batch):
        g, dev = self.gen, self.device
        gate = (batch, self.HV, self.K) if self.per_channel else (batch, self.HV)
        return dict(
            q=torch.randn(batch, self.H, self.K, generator=g).to(dev),
            k=torch.randn(batch, self.H, self.K, generator=g).to(dev),
            v=torch.randn(batch, self.HV, self.V, generator=g).to(dev),
            g=(-0.3 * torch.rand(gate, generator=g)).to(dev),
            beta=torch.rand(batch, self.HV, generator=g).to(dev),
        )

    def run(self, wrapper, tok, slots):
        tok = dict(tok)
        return wrapper.run(tok.pop("q"), tok.pop("k"), tok.pop("v"), slots, **tok)

    def reference(self, pool, slots, tok):
        t = {k: v.cpu() for k, v in tok.items()}
        return self.step_pool(pool, slots, t["q"], t["k"], t["v"], t["g"], t["beta"],
                              self.K**-0.5, True)  # fmt: skip
