"""A model's decode step with random weights, its SSM layers on replayssm_jit's public ops.

Weights are drawn once per model (seeded) and shared by every Replica; a Replica holds one
mode's engine-owned state: each SSM layer's slot tensors (allocated from its layout), conv
states, KV caches, the token buffer and the step counters, all on the device. `step()` is one
decode step (a verify and its commit in the speculative modes) with no host sync on CUDA, so
one CUDA graph per batch size replays it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.profiler import record_function

from replayssm_jit import (
    commit_snapshots,
    gdn_decode,
    gdn_layout,
    gdn_snapshot_verify,
    gdn_verify,
    kda_decode,
    kda_layout,
    kda_snapshot_verify,
    kda_verify,
    mamba2_decode,
    mamba2_layout,
    mamba2_snapshot_verify,
    mamba2_verify,
    plan_decode,
    reset_slots,
)
from replayssm_jit.families.spec import check_cuda_spec

from . import vllm_path
from .configs import ModelConfig, SSMConfig
from .layers import (
    MLP,
    Attention,
    ExpertBank,
    Init,
    MoE,
    SSMMixer,
    SSMWeights,
    StepContext,
    rms_norm,
    ssm_state_shape,
)
from .vllm_path import unsupported

F32, BF16, E4M3 = torch.float32, torch.bfloat16, torch.float8_e4m3fn
SPEC_DRAFTS = 4
SSM_PATHS = ("ops", "vllm")
BROKEN = (None, "skip_prefill_state", *vllm_path.BROKEN)


@dataclass(frozen=True)
class Mode:
    """How the SSM layers keep their state; everything else in the step is the same.

    plan_mode: plan_decode's mode. window: None for the config's L (1 for conventional). drafts:
    T of the speculative modes (tokens verified a step, the bonus token included). snapshot: the
    conventional spec baseline (one state slot per draft, commit_snapshots)."""

    name: str
    plan_mode: str
    state_dtype: torch.dtype = F32
    read_dtype: torch.dtype | None = None
    stochastic_rounding: bool = False
    drafts: int = 1
    snapshot: bool = False
    what: str = ""

    @property
    def replay(self) -> bool:
        return self.plan_mode == "replay"

    @property
    def speculative(self) -> bool:
        return self.drafts > 1


MODES = {
    m.name: m
    for m in (
        Mode("conventional", "conventional",
             what="FP32 state read and written every step (our conventional kernels)"),
        Mode("replay_fp32", "replay", what="ReplaySSM, FP32 checkpoint, flush every L steps"),
        Mode("replay_bf16", "replay", state_dtype=BF16, stochastic_rounding=True,
             what="ReplaySSM, BF16 checkpoint stored with stochastic rounding at each flush"),
        Mode("separate_e4m3", "replay", read_dtype=E4M3,
             what="ReplaySSM, FP32 checkpoint carries the recurrence, e4m3 read copy serves "
                  "non-flush steps"),
        Mode("spec_replay", "replay", drafts=SPEC_DRAFTS,
             what=f"T = {SPEC_DRAFTS}: our verify with the fused commit (num_accepted)"),
        Mode("spec_snapshot", "conventional", drafts=SPEC_DRAFTS, snapshot=True,
             what=f"T = {SPEC_DRAFTS}: conventional baseline, one state snapshot per draft, "
                  "commit_snapshots"),
    )
}  # fmt: skip

_OPS = {
    "mamba2": (mamba2_layout, mamba2_decode, mamba2_verify, mamba2_snapshot_verify),
    "gdn": (gdn_layout, gdn_decode, gdn_verify, gdn_snapshot_verify),
    "kda": (kda_layout, kda_decode, kda_verify, kda_snapshot_verify),
}


def get_mode(name: str) -> Mode:
    if name not in MODES:
        raise ValueError(f"mode: expected one of {list(MODES)}, got {name!r}")
    return MODES[name]


def make_layout(s: SSMConfig, mode: Mode, window: int, act_dtype: torch.dtype):
    """The layer's CacheLayout in `mode` (conventional modes: window 1, the state alone)."""
    make = _OPS[s.family][0]
    if s.family == "mamba2":
        shape = dict(num_heads=s.heads, headdim=s.value_dim, dstate=s.key_dim, ngroups=s.key_heads)
    else:
        shape = dict(num_k_heads=s.key_heads, num_v_heads=s.heads, head_k_dim=s.key_dim,
                     head_v_dim=s.value_dim)  # fmt: skip
    extra = {"read_dtype": mode.read_dtype} if mode.read_dtype is not None else {}
    return make(**shape, window=window if mode.replay else 1, drafts=mode.drafts,
                state_dtype=mode.state_dtype, act_dtype=act_dtype, **extra)  # fmt: skip


def refusal(cfg: ModelConfig, mode: Mode, device: torch.device | str = "cpu") -> str | None:
    """Why `mode` cannot run for `cfg` on `device` (the layout refuses its head tile or family,
    at this size or at the real model's; on CUDA, a module the kernels do not build, such as
    KDA's read copy), or None."""
    for s in (cfg.ssm, cfg.full_ssm):
        if s is None:
            continue
        try:
            layout = make_layout(s, mode, cfg.window, BF16)
            if torch.device(device).type == "cuda":
                check_cuda_spec(plan_decode(layout, 1, device="cpu", **plan_options(s, mode)).spec)
        except ValueError as e:
            return f"{mode.name} refused for {s.family} {ssm_state_shape(s)}: {e}"
    return None


def plan_options(s: SSMConfig, mode: Mode) -> dict:
    if s.family == "mamba2":  # the gate is applied by the gated norm, as Nemotron-H does
        opts = dict(has_D=True, has_z=False, has_dt_bias=True, dt_softplus=True)
    else:
        opts = dict(use_qk_l2norm=True, gates_in_kernel=True)
    if mode.stochastic_rounding:
        opts["stochastic_rounding"] = True
    return opts


class SSMBinding:
    """One SSM layer's op in a mode, on engine-owned slot tensors: rows use slots 0..batch-1;
    the snapshot baseline's drafts slots batch + T b + j."""

    def __init__(self, s: SSMConfig, mode: Mode, window: int, batch: int,
                 device: torch.device, act_dtype: torch.dtype, params: dict,
                 prev_accepted: torch.Tensor):  # fmt: skip
        self.s, self.mode, self.params = s, mode, params
        self.layout = make_layout(s, mode, window, act_dtype)
        num_slots = batch * (1 + mode.drafts) if mode.snapshot else batch
        self.pool = self.layout.allocate(num_slots, device)
        # Graphs read nothing on the host: the CPU path checks slot values and cursors.
        self.plan = plan_decode(self.layout, batch, device=device, mode=mode.plan_mode,
                                check_slot_values=device.type == "cpu",
                                **plan_options(s, mode))  # fmt: skip
        self.slots = torch.arange(batch, dtype=torch.int32, device=device)
        self.snapshot_slots = (
            batch + torch.arange(batch * mode.drafts, dtype=torch.int32, device=device)
        ).view(batch, mode.drafts)
        _, self.decode_op, self.verify_op, self.snapshot_op = _OPS[s.family]
        # A conventional step takes the checkpoint alone; a replay step the whole pool.
        names = self.layout.checkpoint_names if not mode.replay else tuple(self.pool)
        self.step_tensors = {n: self.pool[n] for n in names}
        self.prev_accepted = prev_accepted

    def load_prefill(self, initial_state: torch.Tensor | None) -> None:
        """The prefill's final state into the slots (reset_slots, the public load path)."""
        reset_slots(self.layout, self.pool, self.slots, initial_state=initial_state,
                    check_slot_values=self.plan.check_slot_values)  # fmt: skip

    def __call__(self, inputs: dict, t: int) -> torch.Tensor:
        args = {**inputs, **self.params, "slot_indices": self.slots}
        if t == 1:
            return self.decode_op(self.plan, **self.step_tensors, **args)
        if self.mode.snapshot:
            return self.snapshot_op(self.plan, state=self.pool["state"], **args,
                                    snapshot_slots=self.snapshot_slots)  # fmt: skip
        return self.verify_op(self.plan, **self.pool, **args, num_accepted=self.prev_accepted)

    def commit(self, accepted: torch.Tensor) -> None:
        """The snapshot baseline copies the accepted draft's state; ours commits inside the next
        verify (num_accepted, the replica's shared prev_accepted)."""
        if self.mode.snapshot:
            commit_snapshots(self.plan, state=self.pool["state"],
                             snapshot_slots=self.snapshot_slots, num_accepted=accepted,
                             slot_indices=self.slots)  # fmt: skip

    def bytes_per_sequence(self) -> int:
        """Slot bytes one sequence holds: the layout's slot (the checkpoint alone where the mode
        is conventional) plus the snapshot baseline's T draft states."""
        per = {t.name: t.dtype.itemsize * _prod(t.per_slot_shape) for t in self.layout.tensors()}
        own = sum(per[n] for n in self.step_tensors)
        if self.mode.snapshot:
            own += self.mode.drafts * per["state"]
        return own


def _prod(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


class Weights:
    """A model's random weights (seeded; every mode and replica shares them). MoE layers share
    one expert bank where `share_experts` (the 120B models' experts would not fit one GPU with
    the states; each layer keeps its own router, shared expert and projections)."""

    def __init__(self, cfg: ModelConfig, device, dtype: torch.dtype, seed: int = 0,
                 share_experts: bool = False, draft_width: int = 256):  # fmt: skip
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.share_experts = share_experts
        init = Init(seed, self.device, dtype)
        d = cfg.hidden
        self.embed = init.weight(cfg.vocab, d, fan_in=1)
        self.blocks = []
        bank = None
        for mixer, ffn in cfg.blocks:
            block = {}
            if mixer == "ssm":
                block["ssm"] = SSMWeights(cfg, init)
            elif mixer == "attn":
                block["attn"] = Attention(cfg.attn, cfg, init)
            if ffn == "mlp":
                block["mlp"] = MLP(d, cfg.mlp_intermediate, cfg.mlp_gated, init)
            elif ffn == "moe":
                if bank is None or not share_experts:
                    bank = ExpertBank(cfg.moe, cfg.moe.latent or d, init)
                block["moe"] = MoE(cfg.moe, d, bank, init)
            self.blocks.append(block)
        self.norm = torch.ones(d, device=self.device, dtype=dtype)
        self.lm_head = init.weight(d, cfg.vocab)
        # The stand-in drafter: one small MLP head on the last hidden state and the last token.
        width = min(draft_width, d)
        self.draft_in = init.weight(d, width)
        self.draft_out = init.weight(width, cfg.vocab)

    def nbytes(self) -> int:
        """Bytes the replica's weights occupy (a shared bank counted once)."""
        seen, total = set(), 0
        for t in _tensors_of(self):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.nbytes
        return total


def _tensors_of(obj, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_of(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_of(v, depth + 1)
    elif hasattr(obj, "__dict__") and depth < 4:
        for v in vars(obj).values():
            yield from _tensors_of(v, depth + 1)


def acceptance_probs(mean: float, T: int = SPEC_DRAFTS) -> list[float]:
    """P(a = 1..T) of the accepted length a (the bonus token counted, as vLLM's
    num_accepted_tokens): draft 1 is accepted with p1 = 0.95 (Table 10's T = 2 mean, 1.95) and
    each later draft, given its predecessors, with the p that makes the mean `mean`."""
    p1 = 0.95
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisect p: the mean rises with it
        p = (lo + hi) / 2
        cont = [p1] + [p] * (T - 2)
        reach, m = 1.0, 1.0
        for c in cont:
            reach *= c
            m += reach
        lo, hi = (p, hi) if m < mean else (lo, p)
    probs, reach = [], 1.0
    for c in [p1] + [p] * (T - 2):
        probs.append(reach * (1 - c))
        reach *= c
    probs.append(reach)
    return probs


class Replica:
    """One mode's engine state over `weights`, at one batch size and context.

    broken: a deliberately wrong variant for the tests ("skip_prefill_state": the slots start
    from zero instead of the prefill's state; "num_accepted_off_by_one": the vLLM path's
    num_accepted_tokens without the bonus token). attention: "sdpa" (torch) or "flashinfer" (its
    batch decode for one-token GQA steps; MLA and drafts stay on SDPA). ssm_path: "ops" (the
    functional ops) or "vllm" (the vLLM adapter, vllm_path.py, where the mode has one; else the
    ops, with the reason in `ssm_path_note`). pad_rows: on the vLLM path, the last rows are a
    CUDA-graph batch's pads on the null block (their SSM output is zero, their tokens unused)."""

    def __init__(self, weights: Weights, mode: Mode | str, batch: int, context: int, *,
                 seed: int = 1, ring: int = 256, accept_steps: int = 4096,
                 broken: str | None = None, attention: str = "sdpa",
                 ssm_path: str = "ops", pad_rows: int = 0):  # fmt: skip
        cfg, dev = weights.cfg, weights.device
        if attention not in ("sdpa", "flashinfer"):
            raise ValueError(f"attention: expected 'sdpa' or 'flashinfer', got {attention!r}")
        self.w, self.cfg, self.batch, self.context = weights, cfg, batch, context
        self.mode = get_mode(mode) if isinstance(mode, str) else mode
        why = refusal(cfg, self.mode, dev)
        if why:
            raise ValueError(f"mode: {why}")
        if broken not in BROKEN:
            raise ValueError(f"broken: expected one of {BROKEN}, got {broken!r}")
        if ssm_path not in SSM_PATHS:
            raise ValueError(f"ssm_path: expected one of {SSM_PATHS}, got {ssm_path!r}")
        self.ssm_path_note = unsupported(self.mode) if ssm_path == "vllm" else None
        self.ssm_path = "ops" if self.ssm_path_note else ssm_path
        if broken in vllm_path.BROKEN and not (self.ssm_path == "vllm" and self.mode.speculative):
            raise ValueError(
                f"broken: expected {broken!r} only with ssm_path 'vllm' in a speculative mode "
                f"with an adapter, got ssm_path {ssm_path!r} and mode {self.mode.name!r}"
            )
        self.ring = max(1, min(ring, context // 2))
        self.T = self.mode.drafts
        self.ctx = StepContext(
            pos=torch.zeros(batch, dtype=torch.int64, device=dev),
            accepted=torch.ones(batch, dtype=torch.int64, device=dev),
        )
        self.prev_accepted = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.step_index = torch.zeros((), dtype=torch.int64, device=dev)
        self.emitted = torch.zeros((), dtype=torch.int64, device=dev)
        # The prompt's state: the same draws in every mode, so tokens compare across modes.
        data = Init(seed, dev, weights.dtype)
        self.vllm = None
        if self.ssm_path == "vllm":
            self.vllm = vllm_path.VLLMPath(batch, self.T, dev, pad_rows=pad_rows, broken=broken
                                           if broken in vllm_path.BROKEN else None)  # fmt: skip
        elif pad_rows:
            raise ValueError(
                f"pad_rows: expected 0 unless the SSM layers run through the vLLM adapter, got "
                f"{pad_rows} with ssm_path {self.ssm_path!r}"
            )
        self.layers = []
        for block in weights.blocks:
            layer = dict(block)
            if "ssm" in block:
                sw = block["ssm"]
                if self.vllm is None:
                    binding = SSMBinding(cfg.ssm, self.mode, cfg.window, batch, dev,
                                         weights.dtype, sw.params, self.prev_accepted)  # fmt: skip
                else:
                    binding = self.vllm.bind(
                        cfg.ssm, make_layout(cfg.ssm, self.mode, cfg.window, weights.dtype),
                        plan_options(cfg.ssm, self.mode), sw.params, dev.type == "cpu",
                    )  # fmt: skip
                state0 = data.weight(batch, *ssm_state_shape(cfg.ssm), fan_in=1).float()
                conv0 = data.weight(batch, sw.conv_dim, cfg.ssm.conv - 1, fan_in=1)
                binding.load_prefill(None if broken == "skip_prefill_state" else state0)
                layer["binding"] = binding
                layer["mixer"] = SSMMixer(sw, conv0, binding)
            if "attn" in block:
                layer["cache"] = block["attn"].new_cache(batch, context, data)
            self.layers.append(layer)
        self.attn_decode = self._attention_decode(attention)
        self.tokens = torch.randint(cfg.vocab, (batch, self.T), generator=data.gen, device=dev)
        self.logits = torch.zeros(batch, self.T, cfg.vocab, device=dev)
        self.targets = torch.zeros(batch, self.T, dtype=torch.int64, device=dev)
        probs = torch.tensor(acceptance_probs(cfg.accept_mean), device=dev)
        self.accept_probs = probs.tolist()
        draws = torch.multinomial(probs, accept_steps * batch, replacement=True, generator=data.gen)
        self.accept_table = (draws + 1).view(accept_steps, batch)

    def _attention_decode(self, attention: str):
        """FlashInfer's decode shared by the GQA layers, or None (SDPA)."""
        if attention == "sdpa":
            return None
        from .flashinfer_decode import FlashInferDecode, available

        a = self.cfg.attn
        if not available() or self.w.device.type != "cuda":
            raise ValueError("attention: 'flashinfer' needs flashinfer-python and a CUDA device")
        if a.kv_lora_rank:
            raise ValueError(f"attention: {self.cfg.name}'s MLA layers decode through SDPA only")
        return FlashInferDecode(self.batch, self.context, a.q_heads, a.kv_heads, a.head_dim,
                                self.w.dtype, a.head_dim**-0.5, self.w.device)  # fmt: skip

    # -- the step ------------------------------------------------------------------------------

    def _forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if "mixer" in layer:
                with record_function("e2e.ssm"):
                    h = h + layer["mixer"].forward(rms_norm(h, self.w.norm), self.ctx)
            if "attn" in layer:
                with record_function("e2e.attn"):
                    h = h + layer["attn"].forward(rms_norm(h, self.w.norm), self.ctx,
                                                  layer["cache"], self.ring,
                                                  self.attn_decode)  # fmt: skip
            for kind in ("mlp", "moe"):
                if kind in layer:
                    with record_function(f"e2e.{kind}"):
                        h = h + layer[kind].forward(rms_norm(h, self.w.norm))
        return h

    def _draft(self, h_last: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """T - 1 draft tokens from the stand-in drafter, each fed the previous one."""
        out = []
        for _ in range(self.T - 1):
            x = torch.relu((h_last + self.w.embed[token]) @ self.w.draft_in)
            token = torch.argmax((x @ self.w.draft_out).float(), dim=-1)
            out.append(token)
        return torch.stack(out, dim=1)

    @torch.no_grad()
    def step(self) -> None:
        """One decode step (a verify and its commit in the speculative modes): logits and
        targets into their buffers, the next tokens into `tokens`, cursors advanced, all on
        the device."""
        with record_function("e2e.embed"):
            h = self.w.embed[self.tokens]
        h = self._forward(h)
        with record_function("e2e.head"):
            logits = (rms_norm(h, self.w.norm) @ self.w.lm_head).float()
            targets = torch.argmax(logits, dim=-1)
            self.logits.copy_(logits)
            self.targets.copy_(targets)
        if self.T == 1:
            self.tokens.copy_(targets)
            self.ctx.pos.add_(1)
            self.emitted.add_(self.batch)
            return
        with record_function("e2e.commit"):
            index = torch.remainder(self.step_index, self.accept_table.shape[0]).view(1)
            accepted = self.accept_table.index_select(0, index).view(-1)
            self.ctx.accepted.copy_(accepted)
            for layer in self.layers:
                if "mixer" in layer:
                    layer["mixer"].commit(self.ctx)
                    layer["binding"].commit(accepted.to(torch.int32))
            self.prev_accepted.copy_(accepted)  # our verify's fused commit, next step
            if self.vllm is not None:  # vLLM's num_accepted_tokens for the next call
                self.vllm.commit(accepted.to(torch.int32))
            last = (accepted - 1).view(-1, 1)
            bonus = targets.gather(1, last).view(-1)
            h_last = h.gather(1, last[:, :, None].expand(-1, 1, h.shape[-1])).squeeze(1)
        with record_function("e2e.draft"):
            drafts = self._draft(h_last, bonus)
            self.tokens.copy_(torch.cat([bonus[:, None], drafts], dim=1))
        self.ctx.pos.add_(accepted)
        self.step_index.add_(1)
        self.emitted.add_(accepted.sum())

    # -- accounting ----------------------------------------------------------------------------

    def bytes_per_sequence(self) -> dict[str, int]:
        """Per-sequence bytes of the SSM slots (and conv states) and the KV caches."""
        ssm = conv = kv = 0
        for layer in self.layers:
            if "binding" in layer:
                ssm += layer["binding"].bytes_per_sequence()
                cs = layer["mixer"].conv_state
                conv += cs[0].nbytes
            if "cache" in layer:
                kv += sum(c[0].nbytes for c in layer["cache"].values())
        return {"ssm_slots": ssm, "conv_states": conv, "kv_cache": kv}
