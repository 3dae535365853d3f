"""SGLang's decode and EAGLE tree-verify call sites on SGLangLayer (pad id -1), through the
same layer code as vLLM's calls (integrations/vllm: layer.py, rows.py, mamba2.py, gdn.py).

SGLang's current calls (read from its code: docs/integrations.md), on SGLangLayer:
    slots = layer.pad_rows(mamba_cache_indices, num_live)      rows >= num_live -> -1
    layer.selective_state_update(ssm_state, x, dt, A, B, C, D, z=, dt_bias=, dt_softplus=,
        state_batch_indices=, out=)                     Mamba-2: x [bs, H, P] a step, or
        [bs, T, H, P] with disable_state_update=True, retrieve_parent_token= a tree verify
    layer.decode(q, k, v, a, b, A_log=, dt_bias=, ssm_states=, cache_indices=, query_start_loc=)
    layer.packed_decode(mixed_qkv, a, b, A_log=, dt_bias=, scale=, ssm_states=,
                        cache_indices=, num_v_heads=, head_v_dim=)
    (the three steps also take mamba_track_mask=forward_batch.mamba_track_mask on a layer made
    with track_prefix=True: its True rows flush, so ssm_states[cache_indices[i]] is the whole
    state when SGLang's track_mamba_states_if_needed copies it)
    layer.target_verify(A_log, dt_bias, q, k, v, a, b, ssm_states=, cache_indices=,
                        query_start_loc=, cache_steps=, retrieve_parent_token=)   GDN tree verify
    layer.update_mamba_state_after_mtp_verify(last_correct_step_indices)   the verify's commit
SGLang pads a CUDA graph's rows with req_pool_indices 0, a real request's entry, so its
mamba_cache_indices name a live slot there: the pad rows are known only by position (rows
past the batch's live count), which pad_rows maps to -1 on the device. The tree verify keeps
its drafts as records: intermediate_states_buffer is None (sglang_tree.py says why).

Also: mamba_slots(req_pool_indices, req_to_mamba_slot, num_live), -1 for padding (no layer).
Deprecated: mamba2_decode_step and gdn_decode_step, the older plan-and-pool entries (they wrap
vllm.mamba2_selective_state_update / gdn_fused_recurrent); use SGLangLayer.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from replayssm_jit.core.checks import check_bool, check_tensor
from replayssm_jit.families.layout import CacheLayout
from replayssm_jit.integrations import vllm
from replayssm_jit.integrations.sglang_tree import TreeRows, check_tree_arguments
from replayssm_jit.integrations.vllm.gdn import gdn_call, gdn_packed_call
from replayssm_jit.integrations.vllm.layer import ReplaySSMLayer
from replayssm_jit.integrations.vllm.mamba2 import mamba2_call
from replayssm_jit.integrations.vllm.rows import INT32_MAX, INT32_MIN, narrow_to_int32
from replayssm_jit.ops.plan import DecodePlan

__all__ = [
    "PAD_SLOT_ID",
    "SGLangLayer",
    "gdn_decode_step",
    "mamba2_decode_step",
    "mamba_slots",
]

PAD_SLOT_ID = -1  # SGLang marks padded decode rows (CUDA-graph batch padding) with -1


def mamba_slots(
    req_pool_indices: torch.Tensor,
    req_to_mamba_slot: torch.Tensor,
    num_live: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """[batch] int32 slot ids: req_to_mamba_slot[req_pool_indices[b]], or PAD_SLOT_ID where the
    request index is negative or the row is at or past num_live (SGLang pads a CUDA graph's
    rows with request index 0, a live request's; give num_live there). No host sync."""
    for name, t in (
        ("req_pool_indices", req_pool_indices),
        ("req_to_mamba_slot", req_to_mamba_slot),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name}: expected an int32 or int64 tensor, got {t!r:.60}")
        if t.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {list(t.shape)}")
    idx = req_pool_indices.long()
    looked_up = req_to_mamba_slot.long()[idx.clamp(min=0)]
    pad = idx < 0
    if num_live is not None:
        pad = pad | (torch.arange(idx.shape[0], device=idx.device) >= num_live)
    slots = torch.where(pad, torch.full_like(looked_up, PAD_SLOT_ID), looked_up)
    # Saturated, not wrapped: an id past int32 stays out of range (2**32 + 1 is not slot 1).
    return slots.clamp_(INT32_MIN, INT32_MAX).to(torch.int32)


def mamba2_decode_step(plan: DecodePlan, pool: Mapping[str, torch.Tensor], *args,
                       cache_indices: torch.Tensor, **kwargs) -> torch.Tensor:  # fmt: skip
    """Deprecated: use SGLangLayer.selective_state_update. The older plan-and-pool entry:
    vllm.mamba2_selective_state_update's arguments with cache_indices and pads -1."""
    _deprecated("mamba2_decode_step", "SGLangLayer.selective_state_update")
    cache_indices = vllm.slot_ids("cache_indices", cache_indices, plan)  # (errors name ours)
    return vllm.mamba2_selective_state_update(plan, pool, *args, state_batch_indices=cache_indices,
                                              null_block_id=PAD_SLOT_ID, **kwargs)  # fmt: skip


def gdn_decode_step(plan: DecodePlan, pool: Mapping[str, torch.Tensor], *args,
                    cache_indices: torch.Tensor, use_qk_l2norm_in_kernel: bool = True,
                    **kwargs) -> torch.Tensor:  # fmt: skip
    """Deprecated: use SGLangLayer.decode / target_verify. The older plan-and-pool entry:
    vllm.gdn_fused_recurrent's arguments with cache_indices, pads -1 and l2norm by default."""
    _deprecated("gdn_decode_step", "SGLangLayer.decode")
    cache_indices = vllm.slot_ids("cache_indices", cache_indices, plan)  # (errors name ours)
    return vllm.gdn_fused_recurrent(plan, pool, *args, ssm_state_indices=cache_indices,
                                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                    pad_id=PAD_SLOT_ID, **kwargs)  # fmt: skip


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"sglang.{old} is deprecated: use {new}", DeprecationWarning, stacklevel=3)


class SGLangLayer(ReplaySSMLayer):
    """One layer with SGLang's calls (pad id -1): Mamba-2's selective_state_update, GDN's
    kernel-dispatcher decode and packed_decode. pad_rows keeps a
    [max_bs] int32 buffer and a row-number buffer, so that the mapping allocates nothing.

    track_prefix=True (SGLang's prefix tracking; a layout with drafts=1): the layer's plans
    take a flush mask, and its steps accept SGLang's mamba_track_mask ([bs] bool on the
    device, False on pad rows); a True row flushes at that token, so its checkpoint in the
    engine's state tensor is the whole state when SGLang copies it to its track slot."""

    def __init__(
        self,
        layout: CacheLayout,
        state: torch.Tensor,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        max_batch: int,
        track_prefix: bool = False,
        **plan_options,
    ) -> None:
        check_bool("track_prefix", track_prefix)
        if track_prefix:
            if isinstance(layout, CacheLayout) and layout.drafts != 1:
                raise ValueError(
                    f"track_prefix: expected False with drafts={layout.drafts} (a verify forces "
                    "no flush; SGLang tracks a speculative run's states after the verify, which "
                    "update_mamba_state_after_mtp_verify refuses), got True"
                )
            plan_options = {**plan_options, "flush_mask": True}
        super().__init__(layout, state, tensors, pad_slot_id=PAD_SLOT_ID, **plan_options)
        self.track_prefix = track_prefix
        dev = state.device
        self._row = torch.arange(max_batch, dtype=torch.int32, device=dev)
        self._is_pad = torch.zeros(max_batch, dtype=torch.bool, device=dev)
        self._slots = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self._wide = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self._tree: dict[int, TreeRows] = {}
        self._last_tree: TreeRows | None = None  # the verify update_mamba_state_... commits

    def pad_rows(
        self, mamba_cache_indices: torch.Tensor, num_live: int | torch.Tensor
    ) -> torch.Tensor:
        """[bs] int32 slots: mamba_cache_indices where the row is live (row < num_live, an int
        or a device scalar, so a graph replay may change it), PAD_SLOT_ID past it. A pad row
        then never aliases the live slot its request index 0 names."""
        if not isinstance(mamba_cache_indices, torch.Tensor) or mamba_cache_indices.dim() != 1:
            raise ValueError(
                f"mamba_cache_indices: expected a [bs] tensor, got {mamba_cache_indices!r:.60}"
            )
        if mamba_cache_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"mamba_cache_indices: expected dtype int32 or int64, got "
                f"{mamba_cache_indices.dtype}"
            )
        bs = mamba_cache_indices.shape[0]
        if bs > self._row.shape[0]:
            raise ValueError(
                f"mamba_cache_indices: expected at most max_batch={self._row.shape[0]} rows, "
                f"got {bs}"
            )
        is_pad = torch.ge(self._row[:bs], num_live, out=self._is_pad[:bs])
        slots = narrow_to_int32("mamba_cache_indices", mamba_cache_indices, self._slots[:bs],
                                self._wide, self._reads_values())  # fmt: skip
        return slots.masked_fill_(is_pad, PAD_SLOT_ID)

    def _reads_values(self) -> bool:
        """Whether index values may be read on the host, as the ops decide (plan-free)."""
        if torch.compiler.is_compiling():
            return False
        return self.device.type == "cpu" or (
            self.check_slot_values and not torch.cuda.is_current_stream_capturing()
        )

    def track_mask(self, mamba_track_mask: object, batch: int | None) -> torch.Tensor | None:
        """SGLang's mamba_track_mask as the step's flush mask, checked and passed as is (no
        copy, no host read): None, or on a track_prefix layer a contiguous [batch] bool (or
        uint8) tensor on the layer's device."""
        if mamba_track_mask is None:
            return None
        if not self.track_prefix:
            raise ValueError(
                "mamba_track_mask: expected None (a layer made without track_prefix=True never "
                "forces a flush, so a tracked state would miss its held records), got a tensor"
            )
        return check_tensor("mamba_track_mask", mamba_track_mask, shape=(batch,),
                            dtype=(torch.bool, torch.uint8), device=self.device,
                            contiguous=True)  # fmt: skip

    def selective_state_update(
        self,
        state: torch.Tensor,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor | None = None,
        z: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        dt_softplus: bool = False,
        state_batch_indices: torch.Tensor | None = None,
        pad_slot_id: int = PAD_SLOT_ID,
        out: torch.Tensor | None = None,
        disable_state_update: bool = False,
        intermediate_states_buffer: torch.Tensor | None = None,
        cache_steps: int | None = None,
        retrieve_parent_token: torch.Tensor | None = None,
        intermediate_state_indices: torch.Tensor | None = None,
        mamba_track_mask: torch.Tensor | None = None,
    ) -> None:
        """SGLang's Mamba-2 call (a Mamba-2 layer's SGLangLayer), pads -1.

        A step: x, z, out [bs, H, P]; dt [bs, H, P] head-expanded; B, C [bs, G, N];
        state_batch_indices [bs] or [bs, 1]; mamba_track_mask [bs] bool (a track_prefix layer):
        True rows flush at this token. EAGLE's tree verify: x, z, out [bs, T, H, P], dt
        [bs, T, H, P], B, C [bs, T, G, N] (T the layout's drafts), disable_state_update=True,
        retrieve_parent_token [bs, T] (None: a chain), cache_steps None or T; the drafts stay
        pending until update_mamba_state_after_mtp_verify. intermediate_states_buffer and
        intermediate_state_indices must be None (ReplaySSM writes no per-step states).
        """
        if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4):
            raise ValueError(f"x: expected [bs, H, P] or [bs, T, H, P], got {x!r:.60}")
        T = x.shape[1] if x.dim() == 4 else 1
        check_tree_arguments(T, disable_state_update, intermediate_states_buffer, cache_steps,
                             intermediate_state_indices, retrieve_parent_token)  # fmt: skip
        if x.dim() == 3:
            mask = self.track_mask(mamba_track_mask, x.shape[0])
            mamba2_call(self, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                        state_batch_indices, None, pad_slot_id, out, None, None,
                        flush_mask=mask)  # fmt: skip
            return
        if mamba_track_mask is not None:
            raise ValueError(
                "mamba_track_mask: expected None with a tree verify (its drafts stay pending; "
                "nothing flushes), got a tensor"
            )
        tree = self.tree_rows(x.shape[0], T, "x")
        if not isinstance(out, torch.Tensor) or out.shape != x.shape or not out.is_contiguous():
            raise ValueError(
                f"out: expected a contiguous {list(x.shape)} tensor (written in place), got "
                f"{getattr(out, 'shape', out)}"
            )
        slots = tree.rows.slot_ids("state_batch_indices", state_batch_indices)
        parents = tree.map_parents(retrieve_parent_token, slots)
        # [bs, T, ...] as the packed [bs * T, ...] rows of vLLM's MTP call (views where strided)
        x, dt, B, C, z, out = (None if t is None else t.flatten(0, 1)
                               for t in (x, dt, B, C, z, out))  # fmt: skip
        mamba2_call(self, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                    None, pad_slot_id, out, None, tree.cu, parents=parents)  # fmt: skip
        self._last_tree = tree

    def tree_rows(self, batch: int, tokens: int, name: str) -> TreeRows:
        """The tree verify's buffers of `batch` rows (made at the first call; prepare() before
        a CUDA-graph capture makes them for each size)."""
        if tokens != self.layout.drafts:
            raise ValueError(
                f"{name}: expected {self.layout.drafts} tokens per row (the layout's drafts), "
                f"got {tokens}"
            )
        tree = self._tree.get(batch)
        if tree is None:
            tree = self._tree[batch] = TreeRows.make(self.rows(batch))
        return tree

    def prepare(self, *batch_sizes: int):
        rows = super().prepare(*batch_sizes)
        if self.layout.drafts > 1:
            for batch in batch_sizes:
                self._tree[batch] = TreeRows.make(self._rows[batch])
        return rows

    def update_mamba_state_after_mtp_verify(
        self,
        last_correct_step_indices: torch.Tensor,
        mamba_track_indices: torch.Tensor | None = None,
        mamba_steps_to_track: torch.Tensor | None = None,
        model: object = None,
    ) -> None:
        """SGLang's post-verify update for this layer: each row of the last tree verify keeps
        the root-to-node path to last_correct_step_indices[b] (-1: nothing; rows past its
        length accept nothing), a cursor move with no state copied. `model` is SGLang's, whose
        layers it walks; call this per layer. Prefix tracking's inputs are not supported."""
        _no_extras("update_mamba_state_after_mtp_verify",
                   {"mamba_track_indices": mamba_track_indices,
                    "mamba_steps_to_track": mamba_steps_to_track})  # fmt: skip
        if not isinstance(last_correct_step_indices, torch.Tensor):
            raise TypeError(
                f"last_correct_step_indices: expected a torch.Tensor, got "
                f"{type(last_correct_step_indices).__name__}"
            )
        tree, self._last_tree = self._last_tree, None
        if tree is None:
            raise ValueError(
                "last_correct_step_indices: expected a tree verify since the last commit, got none"
            )
        tree.commit(self, last_correct_step_indices)

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_states: torch.Tensor,
        cache_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        mamba_track_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """The dispatcher's GDN decode: q, k [1, B, H, K], v [1, B, HV, V], a, b [B, HV] raw
        gates, one token per row (query_start_loc 0..B); returns o [1, B, HV, V].
        mamba_track_mask [B] bool (a track_prefix layer): True rows flush at this token."""
        _no_extras("decode", kwargs)
        batch = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
        mask = self.track_mask(mamba_track_mask, batch)  # (q's shape is checked below)
        o, _ = gdn_call(self, A_log, a, b, dt_bias, q, k, v, 1.0, 20.0, None, ssm_states, True,
                        query_start_loc, cache_indices, None, True, False,
                        flush_mask=mask)  # fmt: skip
        return o

    def packed_decode(
        self,
        mixed_qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        scale: float,
        ssm_states: torch.Tensor,
        cache_indices: torch.Tensor,
        num_v_heads: int,
        head_v_dim: int,
        mamba_track_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """The dispatcher's packed GDN decode from conv1d's [B, 2*H*K + HV*V] output; returns
        o [1, B, HV, V] (a view of [B, 1, HV, V], as SGLang's kernel returns it).
        mamba_track_mask as decode's."""
        _no_extras("packed_decode", kwargs)
        shape = self.layout.shape
        if (num_v_heads, head_v_dim) != (shape.value_heads, shape.value_dim):
            raise ValueError(
                f"num_v_heads, head_v_dim: expected {shape.value_heads}, {shape.value_dim} (the "
                f"layout's), got {num_v_heads}, {head_v_dim}"
            )
        batch = mixed_qkv.shape[0]
        mask = self.track_mask(mamba_track_mask, batch)
        # The output SGLang's own kernel allocates and returns.
        out = torch.empty(batch, 1, num_v_heads, head_v_dim, dtype=mixed_qkv.dtype,
                          device=mixed_qkv.device)  # fmt: skip
        gdn_packed_call(self, mixed_qkv, a, b, A_log, dt_bias, scale, ssm_states, out,
                        cache_indices, True, flush_mask=mask)  # fmt: skip
        return out.transpose(0, 1)

    def target_verify(
        self,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        ssm_states: torch.Tensor,
        cache_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        intermediate_states_buffer: torch.Tensor | None = None,
        intermediate_state_indices: torch.Tensor | None = None,
        cache_steps: int | None = None,
        retrieve_parent_token: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """The dispatcher's GDN tree verify: q, k [1, bs * T, H, K], v [1, bs * T, HV, V], raw
        gates a, b [bs * T, HV], query_start_loc [bs + 1] (T tokens per row, the layout's
        drafts), retrieve_parent_token [bs, T] (None: a chain); returns o [1, bs * T, HV, V].
        The drafts stay pending until update_mamba_state_after_mtp_verify;
        intermediate_states_buffer and intermediate_state_indices must be None."""
        _no_extras("target_verify", kwargs)
        if not isinstance(query_start_loc, torch.Tensor) or query_start_loc.dim() != 1:
            raise ValueError(f"query_start_loc: expected [bs + 1], got {query_start_loc!r:.60}")
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError(f"q: expected [1, bs * T, H, K], got {getattr(q, 'shape', q)}")
        batch = query_start_loc.shape[0] - 1
        T = q.shape[1] // max(batch, 1)
        check_tree_arguments(T, True, intermediate_states_buffer, cache_steps,
                             intermediate_state_indices, retrieve_parent_token)  # fmt: skip
        tree = self.tree_rows(batch, T, "q")
        slots = tree.rows.slot_ids("cache_indices", cache_indices)
        parents = tree.map_parents(retrieve_parent_token, slots)
        o, _ = gdn_call(self, A_log, a, b, dt_bias, q, k, v, 1.0, 20.0, None, ssm_states, True,
                        query_start_loc, cache_indices, None, True, False,
                        parents=parents)  # fmt: skip
        self._last_tree = tree
        return o


def _no_extras(call: str, kwargs: dict) -> None:
    """Keyword inputs this adapter does not implement (prefix tracking's masks, ...) refuse."""
    given = sorted(k for k, v in kwargs.items() if v is not None)
    if given:
        raise TypeError(f"{call}: expected no further inputs (not supported yet), got {given}")
