"""The replica's layers: weights drawn at a config's sizes and the work of one decode step.

Each forward takes hidden states [batch, t, hidden] (t = 1 for a decode step, T for a verify)
and a StepContext holding the step's device tensors (positions, accepted counts), so a step has
no host sync and can be captured in a CUDA graph. Every layer labels its work with
torch.profiler.record_function ("e2e.<kind>"), which costs nothing outside a profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from .configs import AttnConfig, ModelConfig, MoEConfig, SSMConfig


class Init:
    """Seeded random weights, drawn in a fixed order so that every mode gets the same model."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype):
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.device, self.dtype = device, dtype

    def weight(self, *shape: int, fan_in: int | None = None, scale: float = 1.0) -> torch.Tensor:
        fan = fan_in if fan_in is not None else shape[-2]
        w = torch.randn(*shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return (w * (scale / math.sqrt(fan))).to(self.dtype)

    def uniform(self, *shape: int, lo: float, hi: float) -> torch.Tensor:
        u = torch.rand(*shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return lo + (hi - lo) * u


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@dataclass
class StepContext:
    """Device tensors a step reads: `pos` [batch] int64, tokens written to the KV caches so far
    (the cache ring's cursor); `accepted` [batch] int64, tokens the step keeps (1 in a decode
    step; a verify's draw, set before commit())."""

    pos: torch.Tensor
    accepted: torch.Tensor


# ---------------------------------------------------------------------------------------------
# SSM mixers: input projection, causal conv1d step, the op (a callable the replica binds to a
# mode), gated norm, output projection
# ---------------------------------------------------------------------------------------------


class SSMWeights:
    """One SSM layer's weights: in_proj, conv (its own width), the family's parameters, the
    gated norm and out_proj."""

    def __init__(self, cfg: ModelConfig, init: Init):
        s, d = cfg.ssm, cfg.hidden
        self.s = s
        if s.family == "mamba2":
            inner, bc = s.heads * s.value_dim, s.key_heads * s.key_dim
            self.conv_dim = inner + 2 * bc
            # z, x, B, C, dt (Mamba-2's in_proj order)
            self.split = (inner, inner, bc, bc, s.heads)
            self.params = dict(
                A=-init.uniform(s.heads, lo=1.0, hi=16.0),
                D=torch.ones(s.heads, device=init.device),
                dt_bias=init.uniform(s.heads, lo=-4.0, hi=-2.0),  # softplus -> dt in ~0.02..0.13
            )
            self.norm_groups = s.key_heads
        else:
            qk, vv = s.key_heads * s.key_dim, s.heads * s.value_dim
            self.conv_dim = 2 * qk + vv
            per_channel = s.family == "kda"
            gate_a = s.heads * s.key_dim if per_channel else s.heads
            # q, k, v (convolved), z (the output gate), a (decay), b (beta)
            self.split = (qk, qk, vv, vv, gate_a, s.heads)
            self.params = dict(
                A_log=torch.log(init.uniform(s.heads, lo=1.0, hi=16.0))
                if not per_channel
                else torch.log(init.uniform(s.heads, lo=0.05, hi=0.3)),
                dt_bias=init.uniform(gate_a, lo=-0.5, hi=0.5),
            )
            self.norm_groups = 0
        self.in_proj = init.weight(d, sum(self.split))
        self.conv_w = init.weight(self.conv_dim, s.conv, fan_in=s.conv)
        self.conv_b = init.weight(self.conv_dim, fan_in=1, scale=0.1)
        norm_width = s.heads * s.value_dim if s.family == "mamba2" else s.value_dim
        self.norm_w = torch.ones(norm_width, device=init.device, dtype=init.dtype)
        self.out_proj = init.weight(s.heads * s.value_dim, d)


def conv_window(conv_state: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """[batch, C, W - 1 + t]: the conv state followed by the t new inputs xs [batch, t, C]."""
    return torch.cat([conv_state, xs.transpose(1, 2).to(conv_state.dtype)], dim=2)


def conv_apply(window: torch.Tensor, w: torch.Tensor, b: torch.Tensor, t: int) -> torch.Tensor:
    """silu(causal conv1d) of the window's last t positions: [batch, t, C]."""
    width = w.shape[1]
    taps = window.unfold(2, width, 1)[:, :, -t:, :]  # [batch, C, t, W]
    y = (taps * w[None, :, None, :]).sum(-1) + b[None, :, None]
    return F.silu(y).transpose(1, 2)


def conv_keep(conv_state: torch.Tensor, window: torch.Tensor, accepted: torch.Tensor) -> None:
    """conv_state <- the W - 1 inputs ending at each row's accepted[b]-th new token (on the
    device: a verify's rejected drafts leave the conv state as the accepted prefix left it)."""
    keep = conv_state.shape[2]
    idx = accepted.view(-1, 1, 1) + torch.arange(keep, device=window.device).view(1, 1, -1)
    conv_state.copy_(window.gather(2, idx.expand(-1, window.shape[1], -1)))


class SSMMixer:
    """One SSM layer's step. `op(inputs, t)` is the mode's SSM call (replica.SSMBinding): it
    takes the family's token inputs with a leading [batch] (t = 1) or [batch, T] and returns the
    output [batch, (T,) HV, V]."""

    def __init__(self, w: SSMWeights, conv_state: torch.Tensor, op):
        self.w, self.conv_state, self.op = w, conv_state, op
        self.window: torch.Tensor | None = None

    def forward(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        w, s = self.w, self.w.s
        batch, t, _ = h.shape
        with record_function("e2e.ssm.proj"):
            parts = list(torch.split(h @ w.in_proj, w.split, dim=-1))
        if s.family == "mamba2":
            z, x, B, C, dt = parts
            mixed = torch.cat([x, B, C], dim=-1)
        else:
            q, k, v, z, a, b = parts
            mixed = torch.cat([q, k, v], dim=-1)
        with record_function("e2e.ssm.conv"):
            window = conv_window(self.conv_state, mixed)
            conv = conv_apply(window, w.conv_w, w.conv_b, t).to(h.dtype)
            if t == 1:
                self.conv_state.copy_(window[:, :, 1:])
            else:
                self.window = window  # commit() keeps the accepted prefix
        lead = (batch,) if t == 1 else (batch, t)
        # The ops take FP32 gates; an engine's call (vllm_path) takes them in the model dtype.
        gate = (lambda g: g) if getattr(self.op, "model_dtype_gates", False) else torch.Tensor.float
        if s.family == "mamba2":
            inner, bc = s.heads * s.value_dim, s.key_heads * s.key_dim
            xs, Bs, Cs = torch.split(conv, (inner, bc, bc), dim=-1)
            inputs = dict(
                x=xs.reshape(*lead, s.heads, s.value_dim).contiguous(),
                B=Bs.reshape(*lead, s.key_heads, s.key_dim).contiguous(),
                C=Cs.reshape(*lead, s.key_heads, s.key_dim).contiguous(),
                dt=gate(dt).reshape(*lead, s.heads).contiguous(),
            )
        else:
            qk = s.key_heads * s.key_dim
            qs, ks, vs = torch.split(conv, (qk, qk, s.heads * s.value_dim), dim=-1)
            gate_shape = (*lead, s.heads, s.key_dim) if s.family == "kda" else (*lead, s.heads)
            inputs = dict(
                q=qs.reshape(*lead, s.key_heads, s.key_dim).contiguous(),
                k=ks.reshape(*lead, s.key_heads, s.key_dim).contiguous(),
                v=vs.reshape(*lead, s.heads, s.value_dim).contiguous(),
                a=gate(a).reshape(gate_shape).contiguous(),
                b=gate(b).reshape(*lead, s.heads).contiguous(),
            )
        with record_function("e2e.ssm.op"):
            y = self.op(inputs, t).reshape(batch, t, s.heads, s.value_dim)
        with record_function("e2e.ssm.norm_out"):
            z = z.reshape(batch, t, s.heads, s.value_dim)
            if s.family == "mamba2":  # RMSNormGated: norm(y * silu(z)) per group of heads
                g = (y * F.silu(z)).reshape(batch, t, w.norm_groups, -1)
                out = rms_norm(g, torch.ones((), device=h.device, dtype=h.dtype))
                out = out.reshape(batch, t, -1) * w.norm_w
            elif s.family == "gdn":  # norm(o) * silu(z) per head
                out = (rms_norm(y, w.norm_w) * F.silu(z)).reshape(batch, t, -1)
            else:  # KDA: norm(o) * sigmoid(gate) per head
                out = (rms_norm(y, w.norm_w) * torch.sigmoid(z)).reshape(batch, t, -1)
            return out @ w.out_proj

    def commit(self, ctx: StepContext) -> None:
        """After a verify: the conv state of the accepted prefix."""
        if self.window is not None:
            conv_keep(self.conv_state, self.window, ctx.accepted)


def ssm_state_shape(s: SSMConfig) -> tuple[int, int, int]:
    """The per-slot state the prefill hands over (Mamba-2 [H, P, N], GDN/KDA [HV, V, K])."""
    return (s.heads, s.value_dim, s.key_dim)


# ---------------------------------------------------------------------------------------------
# Attention over a KV cache ring prefilled to the context
# ---------------------------------------------------------------------------------------------


class Attention:
    """GQA (with Qwen3.5's output gate) or MLA decoded in its latent space, over a KV cache of
    exactly `context` tokens (the replica's, per layer): the prompt is random, and each step
    overwrites the oldest of the last `ring` entries, so every step attends to `context` tokens
    (a fixed shape for the graph; RoPE is left out: elementwise, well under 1% of a step)."""

    def __init__(self, a: AttnConfig, cfg: ModelConfig, init: Init):
        d = cfg.hidden
        self.a = a
        if a.kv_lora_rank:
            qd = a.nope_dim + a.rope_dim
            self.wq = init.weight(d, a.q_heads * qd)
            self.w_dkv = init.weight(d, a.kv_lora_rank + a.rope_dim)
            self.w_uk = init.weight(a.q_heads, a.nope_dim, a.kv_lora_rank)  # absorbed into q
            self.w_uv = init.weight(a.q_heads, a.kv_lora_rank, a.v_head_dim)  # into the output
            self.wo = init.weight(a.q_heads * a.v_head_dim, d)
            self.scale = qd**-0.5
        else:
            hd = a.head_dim
            self.wq = init.weight(d, a.q_heads * hd * (2 if a.output_gate else 1))
            self.wkv = init.weight(d, 2 * a.kv_heads * hd)
            self.wo = init.weight(a.q_heads * hd, d)
            self.scale = hd**-0.5

    def cache_shapes(self, batch: int, context: int) -> dict[str, tuple[int, ...]]:
        """The layer's KV cache: MLA keeps the latent and the rope key, one "head" a token."""
        a = self.a
        if a.kv_lora_rank:
            return {"cache": (batch, 1, context, a.kv_lora_rank + a.rope_dim)}
        return {n: (batch, a.kv_heads, context, a.head_dim) for n in ("k_cache", "v_cache")}

    def new_cache(self, batch: int, context: int, init: Init) -> dict[str, torch.Tensor]:
        """A cache prefilled with a random prompt of `context` tokens."""
        return {
            n: init.weight(*shape, fan_in=1)
            for n, shape in self.cache_shapes(batch, context).items()
        }

    @staticmethod
    def _slots(ctx: StepContext, t: int, context: int, ring: int) -> torch.Tensor:
        """[batch, t] cache positions the step's tokens write (the ring's next t entries)."""
        j = torch.arange(t, device=ctx.pos.device)
        return (context - ring) + (ctx.pos[:, None] + j[None, :]) % ring

    @staticmethod
    def _mask(slots: torch.Tensor, t: int, context: int) -> torch.Tensor | None:
        """Draft j sees the cache and drafts 0..j, not the later drafts' entries."""
        if t == 1:
            return None
        batch = slots.shape[0]
        owner = torch.full((batch, context), -1, dtype=torch.int64, device=slots.device)
        owner.scatter_(1, slots, torch.arange(t, device=slots.device).expand(batch, t))
        j = torch.arange(t, device=slots.device)
        return (owner[:, None, :] <= j[None, :, None])[:, None]  # [batch, 1, t, context]

    def forward(self, h: torch.Tensor, ctx: StepContext, cache: dict, ring: int,
                decode=None) -> torch.Tensor:  # fmt: skip
        """decode: FlashInfer's batch decode (flashinfer_decode.py) for one-token GQA steps, or
        None (torch SDPA; drafts and MLA always take SDPA)."""
        a = self.a
        batch, t, _ = h.shape
        context = next(iter(cache.values())).shape[2]
        slots = self._slots(ctx, t, context, ring)
        rows = torch.arange(batch, device=h.device)[:, None].expand(batch, t)
        mask = self._mask(slots, t, context)
        if a.kv_lora_rank:
            q = (h @ self.wq).view(batch, t, a.q_heads, a.nope_dim + a.rope_dim)
            q_lat = torch.einsum("btqn,qnr->btqr", q[..., : a.nope_dim], self.w_uk)
            q = torch.cat([q_lat, q[..., a.nope_dim :]], dim=-1).transpose(1, 2)
            kv = cache["cache"]
            kv[rows, 0, slots] = (h @ self.w_dkv).to(kv.dtype)
            o = F.scaled_dot_product_attention(
                q, kv, kv[..., : a.kv_lora_rank], attn_mask=mask,
                scale=self.scale, enable_gqa=True,
            )  # fmt: skip
            o = torch.einsum("bqtr,qrv->btqv", o, self.w_uv).reshape(batch, t, -1)
            return o @ self.wo
        hd = a.head_dim
        q = h @ self.wq
        gate = None
        if a.output_gate:
            q, gate = q.chunk(2, dim=-1)
        q = q.view(batch, t, a.q_heads, hd).transpose(1, 2)
        k, v = (h @ self.wkv).view(batch, t, 2, a.kv_heads, hd).unbind(2)
        k_cache, v_cache = cache["k_cache"], cache["v_cache"]
        k_cache[rows, :, slots] = k.to(k_cache.dtype)
        v_cache[rows, :, slots] = v.to(v_cache.dtype)
        if decode is not None and t == 1:
            o = decode(q[:, :, 0].contiguous(), k_cache, v_cache).reshape(batch, t, -1)
        else:
            o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
                                               scale=self.scale, enable_gqa=True)  # fmt: skip
            o = o.transpose(1, 2).reshape(batch, t, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return o @ self.wo


# ---------------------------------------------------------------------------------------------
# MLP and MoE
# ---------------------------------------------------------------------------------------------


class MLP:
    """SwiGLU (gated) or relu² (Nemotron)."""

    def __init__(self, d: int, inter: int, gated: bool, init: Init):
        self.gated = gated
        self.w_in = init.weight(d, inter * (2 if gated else 1))
        self.w_out = init.weight(inter, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        u = h @ self.w_in
        if self.gated:
            g, u = u.chunk(2, dim=-1)
            u = F.silu(g) * u
        else:
            u = F.relu(u).square()
        return u @ self.w_out


class ExpertBank:
    """All routed experts' weights, [E, out, in] each (the grouped GEMM reads them transposed).
    BF16 on the GPU (FP8 block-scaled experts are not implemented here: BF16 reads twice their
    bytes, so the MoE time is an upper bound and the speedups conservative)."""

    def __init__(self, m: MoEConfig, d_in: int, init: Init):
        self.m = m
        width = m.intermediate * (2 if m.gated else 1)
        self.w1 = init.weight(m.experts, width, d_in, fan_in=d_in)
        self.w2 = init.weight(m.experts, d_in, m.intermediate, fan_in=m.intermediate)

    def nbytes(self) -> int:
        return self.w1.nbytes + self.w2.nbytes


def grouped_experts(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, offs) -> torch.Tensor:
    """x [rows, in] sorted by expert, w [E, out, in]: each row through its expert. CUDA: one
    torch._grouped_mm (offs: int32 cumulative row counts, on the device) in BF16, a gathered bmm
    otherwise; CPU: a loop over the experts that got rows (it reads the ids on the host)."""
    if x.is_cuda and x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if x.is_cuda:  # (FP32 correctness runs: _grouped_mm is BF16-only; gather each row's expert)
        return torch.bmm(w[ids], x[:, :, None]).squeeze(2)
    out = x.new_empty(x.shape[0], w.shape[1])
    for e in torch.unique(ids).tolist():
        sel = (ids == e).nonzero().squeeze(1)
        out[sel] = x[sel] @ w[e].t()
    return out


class MoE:
    """Top-k routing over all experts (softmax over the k picked), a grouped GEMM per
    projection, an optional shared expert and Nemotron-3-Super's latent projections."""

    def __init__(self, m: MoEConfig, d: int, bank: ExpertBank, init: Init):
        self.m, self.bank = m, bank
        self.router = init.weight(d, m.experts)
        self.shared = MLP(d, m.shared, m.gated, init) if m.shared else None
        self.lat_in = init.weight(d, m.latent) if m.latent else None
        self.lat_out = init.weight(m.latent, d) if m.latent else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        m = self.m
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        with record_function("e2e.moe.route"):
            weights, ids = torch.topk((x @ self.router).float(), m.top_k, dim=-1)
            weights = torch.softmax(weights, dim=-1).to(x.dtype)
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            token = order // m.top_k
            sorted_ids = flat[order]
            counts = torch.zeros(m.experts, dtype=torch.int32, device=x.device)
            counts.index_add_(0, sorted_ids.int(), torch.ones_like(sorted_ids, dtype=torch.int32))
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xe = x @ self.lat_in if self.lat_in is not None else x
        with record_function("e2e.moe.experts"):
            u = grouped_experts(xe[token], self.bank.w1, sorted_ids, offs)
            if m.gated:
                g, u = u.chunk(2, dim=-1)
                u = F.silu(g) * u
            else:
                u = F.relu(u).square()
            y = grouped_experts(u, self.bank.w2, sorted_ids, offs)
            y = y * weights.reshape(-1)[order, None]
            out = torch.zeros_like(xe).index_add_(0, token, y)
        if self.lat_out is not None:
            out = out @ self.lat_out
        if self.shared is not None:
            out = out + self.shared.forward(x)
        return out.reshape(shape)
