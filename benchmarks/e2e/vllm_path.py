"""The replica's SSM layers driven through replayssm_jit's vLLM adapter (`--ssm-path vllm`).

Each layer's state tensor is registered with one ReplaySSMBackend per replica and called as
vLLM's model code calls its kernel (engine code read: docs/integrations.md):

    Mamba-2  mamba_mixer2._run_decode -> selective_state_update(state, x, dt, A, B, C, D, z=None,
             dt_bias=, dt_softplus=True, state_batch_indices=, dst_state_batch_indices=, out=)
             with A [H, P, N], D, dt_bias [H, P] and dt [tokens, H, P] head-expanded (stride 0)
    GDN      fused_sigmoid_gating_delta_rule_update(A_log=, a=, b=, dt_bias=, q=, k=, v=,
             initial_state=, inplace_final_state=True, cu_seqlens=, ssm_state_indices=,
             num_accepted_tokens=, use_qk_l2norm_in_kernel=True), raw gates, q [1, tokens, H, K]
    KDA      fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state,
             cu_seqlens, ssm_state_indices, num_accepted_tokens=), raw g, beta

Slots follow vLLM's block table: block 0 is the null block (never a request's; pad rows name it),
so row b holds block b + 1. MTP packs a verify's T tokens per row as [batch * T, ...] with
cu_seqlens = 0, T, 2T, ..., state indices [batch, 1 + T] (column 0 the request's block; the
per-draft columns name the null block: ReplaySSM keeps drafts in the ring) and vLLM's
num_accepted_tokens (the previous verify's kept tokens, bonus included, 1 after prefill).

Modes without an adapter fall back to the ops (VLLMPath.unsupported says why).
"""

from __future__ import annotations

import math

import torch

from replayssm_jit import reset_slots
from replayssm_jit.integrations.vllm import NULL_BLOCK_ID, ReplaySSMBackend

BROKEN = ("num_accepted_off_by_one",)


def unsupported(mode) -> str | None:
    """Why `mode`'s SSM layers cannot run through the vLLM adapter, or None."""
    if mode.snapshot:
        return ("the conventional snapshot baseline (one state slot per draft, "
                "commit_snapshots) is vLLM's own MTP kernel path; the adapter keeps drafts in "
                "the ring and refuses per-draft destination blocks")  # fmt: skip
    if not mode.replay:
        return ("the adapter plans ReplaySSM only (plan_decode's mode is not among "
                "VLLMLayer's plan options); conventional is vLLM's own kernel in an engine")  # fmt: skip
    return None


class VLLMPath:
    """One replica's engine-side metadata, shared by its SSM layers as vLLM's attention metadata
    is: the backend, block indices, cu_seqlens and num_accepted_tokens."""

    def __init__(self, batch: int, drafts: int, device: torch.device,
                 broken: str | None = None, pad_rows: int = 0):  # fmt: skip
        if broken not in (None, *BROKEN):
            raise ValueError(f"broken: expected None or one of {BROKEN}, got {broken!r}")
        if not 0 <= pad_rows < batch:
            raise ValueError(f"pad_rows: expected 0..{batch - 1} (batch {batch}), got {pad_rows}")
        self.batch, self.T, self.device, self.broken = batch, drafts, device, broken
        self.live_rows = batch - pad_rows
        self.backend = ReplaySSMBackend()
        blocks = torch.arange(1, batch + 1, dtype=torch.int32, device=device)
        # A CUDA-graph batch's pad rows name the null block, as vLLM pads them.
        blocks[self.live_rows :] = NULL_BLOCK_ID
        self.live = blocks != NULL_BLOCK_ID
        if drafts > 1:  # [batch, 1 + T]: the per-draft columns are the null block, unused
            spare = torch.full((batch, drafts), NULL_BLOCK_ID, dtype=torch.int32, device=device)
            self.state_indices = torch.cat([blocks[:, None], spare], dim=1)
        else:
            self.state_indices = blocks
        self.blocks = blocks
        self.query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device) * drafts
        # vLLM's count after a prefill is 1: nothing pending, nothing committed.
        self.num_accepted_tokens = torch.ones(batch, dtype=torch.int32, device=device)

    def commit(self, accepted: torch.Tensor) -> None:
        """The verify's kept tokens (bonus included) for the next call, as vLLM's rejection
        sampler hands them on; the broken variant forgets the bonus token (clamped to vLLM's
        minimum 1, so only the token comparison can catch it)."""
        if self.broken == "num_accepted_off_by_one":
            accepted = (accepted - 1).clamp_(min=1)
        self.num_accepted_tokens.copy_(accepted)
        self.num_accepted_tokens.masked_fill_(~self.live, 1)  # vLLM fills pad rows with 1

    def bind(self, s, layout, plan_options: dict, params: dict, check_values: bool):
        return VLLMBinding(self, s, layout, plan_options, params, check_values)


class VLLMBinding:
    """One SSM layer through the backend: the SSMMixer's op (inputs with a leading [batch] or
    [batch, T]; returns [batch, (T,) HV, V]) plus the replica's load/commit/bytes hooks."""

    model_dtype_gates = True  # dt, a, b come as vLLM passes them (the adapter copies to FP32)

    def __init__(self, path: VLLMPath, s, layout, plan_options: dict, params: dict,
                 check_values: bool):  # fmt: skip
        self.path, self.s, self.layout = path, s, layout
        # One slot per block, block 0 the null block (vLLM allocates it; no request holds it).
        self.pool = layout.allocate(path.batch + 1, path.device)
        self.layer = path.backend.register(self.pool["state"], layout, self.pool,
                                           check_slot_values=check_values,
                                           **plan_options)  # fmt: skip
        self.layer.prepare(path.batch)  # plans and index buffers before any graph capture
        self.stochastic_rounding = bool(plan_options.get("stochastic_rounding", False))
        self.lower_bound = plan_options.get("lower_bound")
        P, N = s.value_dim, s.key_dim
        if s.family == "mamba2":  # the mixer's head-expanded float32 views (stride 0)
            self.A = params["A"][:, None, None].expand(-1, P, N).to(torch.float32)
            self.D = params["D"][:, None].expand(-1, P)
            self.dt_bias = params["dt_bias"][:, None].expand(-1, P)
        else:
            self.A_log, self.dt_bias = params["A_log"], params["dt_bias"]
        self.out = None

    def load_prefill(self, initial_state: torch.Tensor | None) -> None:
        """The prefill's final state into the rows' blocks (reset_slots: the adapter has no load
        path of its own)."""
        live = self.path.live_rows  # (pad rows hold no request: nothing to load)
        state = None if initial_state is None else initial_state[:live]
        reset_slots(self.layout, self.pool, self.path.blocks[:live], initial_state=state,
                    check_slot_values=self.layer.check_slot_values)  # fmt: skip

    def commit(self, accepted: torch.Tensor) -> None:
        """Nothing per layer: the commit is fused in the next call (VLLMPath.commit)."""

    def bytes_per_sequence(self) -> int:
        """The layout's slot, counted as the ops path counts it (the null block is not a
        sequence's)."""
        return sum(t.dtype.itemsize * math.prod(t.per_slot_shape) for t in self.layout.tensors())

    def __call__(self, inputs: dict, t: int) -> torch.Tensor:
        path, s = self.path, self.s
        tokens = path.batch * t
        spec = t > 1
        cu = path.query_start_loc if spec else None
        accepted = path.num_accepted_tokens if spec else None
        if s.family == "mamba2":
            x = inputs["x"].reshape(tokens, s.heads, s.value_dim)
            if self.out is None or self.out.shape[0] != tokens:
                self.out = torch.empty_like(x)  # vLLM's preallocated_ssm_out_d
            dt = inputs["dt"].reshape(tokens, s.heads)[:, :, None]
            path.backend.selective_state_update(
                self.pool["state"], x, dt.expand(-1, -1, s.value_dim), self.A,
                inputs["B"].reshape(tokens, s.key_heads, s.key_dim),
                inputs["C"].reshape(tokens, s.key_heads, s.key_dim), self.D, z=None,
                dt_bias=self.dt_bias, dt_softplus=True,
                state_batch_indices=path.state_indices,
                dst_state_batch_indices=path.state_indices, out=self.out,
                num_accepted_tokens=accepted, cu_seqlens=cu,
                enable_stochastic_rounding=self.stochastic_rounding,
            )  # fmt: skip
            return self.out
        q, k, v = (inputs[n].reshape(1, tokens, *inputs[n].shape[-2:]) for n in ("q", "k", "v"))
        lead = inputs["b"].dim() - 1
        a = inputs["a"].reshape(tokens, *inputs["a"].shape[lead:])
        b = inputs["b"].reshape(tokens, s.heads)
        if spec:
            indices = path.state_indices
        else:
            indices, cu = path.blocks, path.query_start_loc  # non_spec_query_start_loc: 0..N
        if s.family == "gdn":
            o, _ = path.backend.fused_sigmoid_gating_delta_rule_update(
                A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,
                initial_state=self.pool["state"], inplace_final_state=True, cu_seqlens=cu,
                ssm_state_indices=indices, num_accepted_tokens=accepted,
                use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
        else:
            o, _ = path.backend.fused_recurrent_kda(
                q, k, v, a[None], b[None], self.A_log, self.dt_bias, self.lower_bound,
                self.pool["state"], cu, indices, num_accepted_tokens=accepted,
            )  # fmt: skip
        return o
