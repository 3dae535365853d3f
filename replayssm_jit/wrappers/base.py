"""plan()/run() objects over the functional ops, shared by every family's wrapper."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replayssm_jit.core.checks import check_bool
from replayssm_jit.families.base import Family
from replayssm_jit.families.spec import KernelSpec
from replayssm_jit.launch.config import LaunchConfig
from replayssm_jit.ops.commit import commit_drafts
from replayssm_jit.ops.plan import MODES, DecodePlan, plan_decode
from replayssm_jit.ops.prefix import materialize_slots
from replayssm_jit.wrappers.cache import SlotCache


class DecodeWrapper:
    """plan() once per batch shape (choose and load the kernel), run() once per decode step.

    mode="replay": ReplaySSM (non-flush steps read the checkpoint and append a record; every
    L-th step of a slot flushes). Where a batch is too small to fill the GPU, steps with one
    FP32, BF16 or FP16 checkpoint flush every token instead (kernel "flush-every-step": no
    record stays held), so a 16-bit checkpoint is then rounded every token, as the conventional
    step rounds it; plan(config=LaunchConfig(kernel="per-item")) keeps the window.
    mode="conventional": read, update and write the state.
    use_cuda_graph=True: run() writes into a buffer fixed at plan() and never reads slot values
    on the host (that would sync), so a step can be captured in a CUDA graph; verify() likewise,
    into a [batch, T, ...] buffer of its own, where the cache has drafts T >= 2.
    Speculative decoding (caches with drafts=T >= 2, mode="replay"): verify() takes run()'s
    inputs with a draft dim and commit() accepts drafts of the last verify (docs/speculative.md).
    check_slot_values=False skips that read in eager mode too: out-of-range or repeated slot
    ids are then the caller's responsibility (shape, dtype and device are always checked).
    """

    family: Family

    def __init__(
        self,
        cache: SlotCache,
        *,
        mode: str = "replay",
        use_cuda_graph: bool = False,
        check_slot_values: bool = True,
    ) -> None:
        if not isinstance(cache, SlotCache) or cache.layout.family is not self.family:
            got = type(cache).__name__
            if isinstance(cache, SlotCache):
                got += f" of family {cache.layout.family.name!r}"
            raise TypeError(f"cache: expected a {self.family.name} SlotCache, got {got}")
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        check_bool("use_cuda_graph", use_cuda_graph)
        check_bool("check_slot_values", check_slot_values)
        self.cache, self.mode, self.use_cuda_graph = cache, mode, use_cuda_graph
        self.check_slot_values = check_slot_values and not use_cuda_graph
        self._plan: DecodePlan | None = None
        self._out: torch.Tensor | None = None
        self._verify_out: torch.Tensor | None = None
        self._workspace: torch.Tensor | None = None

    # --- what plan() chose ---------------------------------------------------------------
    @property
    def decode_plan(self) -> DecodePlan:
        if self._plan is None:
            raise RuntimeError("plan() has not been called")
        return self._plan

    @property
    def spec(self) -> KernelSpec | None:
        return self._plan.spec if self._plan else None

    @property
    def batch_size(self) -> int:
        return self._plan.batch_size if self._plan else 0

    @property
    def kernel(self) -> str:
        """ "conventional", "split" (a records kernel, then a state kernel), "per-item" or
        "flush-every-step"."""
        return self.decode_plan.kernel

    @property
    def backend(self) -> str:
        """ "cuda" (the kernels) or "cpu" (the PyTorch path); the rest of the plan's choices are
        in decode_plan (rows_per_cta, flags, workspace_floats)."""
        return self.decode_plan.backend

    @property
    def window(self) -> int:
        """Replay window of the kernels this wrapper runs (1 in conventional mode)."""
        return self.cache.window if self.mode == "replay" else 1

    def plan(self, batch_size: int, *, config: LaunchConfig | None = None, seed: int = 0,
             **options) -> KernelSpec:  # fmt: skip
        """Choose and load the kernel for `batch_size` rows; returns its spec. Nothing changes
        on error (the previous plan stays).

        options: the family's plan options (Family.plan_options and plan_scalars), e.g. for
            Mamba-2 has_D=True, has_z=False, has_dt_bias=True, dt_softplus=True; for GDN
            use_qk_l2norm=True, gates_in_kernel=True (raw a, b plus A_log, dt_bias; else g,
            beta), scale=K**-0.5; for both stochastic_rounding=False (bf16/fp16/e4m3
            checkpoints, and a read copy, rounded stochastically where stored: the noise is a
            hash of (seed, slot, element, flush epoch), so the same seed gives the same bits; a
            conventional step has no epoch, so give it a new seed each step); Mamba-2 with a
            read copy also read_copy_round_to_nearest=False (SR for the carried copy only); for
            both flush_mask=False (replay mode without drafts: run() then takes flush_mask
            [batch], whose nonzero rows flush at that step, as SGLang's prefix tracking needs).
        config: launch choices to fix (LaunchConfig; "auto" fields are the policy's).
        """
        plan = plan_decode(
            self.cache.layout, batch_size, device=self.cache.device, mode=self.mode,
            pad_slot_id=self.cache.pad_slot_id, check_slot_values=self.check_slot_values,
            config=config, seed=seed, **options,
        )  # fmt: skip
        workspace = torch.empty(plan.workspace_floats, dtype=torch.float32, device=plan.device)
        out = verify_out = None
        if self.use_cuda_graph:
            shape = self.cache.layout.shape
            row = (shape.value_heads, shape.value_dim)
            out = torch.empty((batch_size, *row), dtype=self.cache.act_dtype, device=plan.device)
            if self.mode == "replay" and plan.spec.has_verify:
                drafts = (batch_size, self.cache.drafts, *row)
                verify_out = torch.empty(drafts, dtype=self.cache.act_dtype, device=plan.device)
        self._plan, self._workspace, self._out = plan, workspace, out
        self._verify_out = verify_out
        return plan.spec

    def _planned(self, call: str) -> DecodePlan:
        if self._plan is None:
            raise RuntimeError(f"{call}() called before plan()")
        return self._plan

    def _run(self, op, **inputs) -> torch.Tensor:
        plan = self._planned("run")
        if inputs.get("out") is None:
            inputs["out"] = self._out
        return op(plan, **self.cache.tensors, **inputs, workspace=self._workspace)

    def _verify(self, op, **inputs) -> torch.Tensor:
        plan = self._planned("verify")
        if inputs.get("out") is None:
            inputs["out"] = self._verify_out
        return op(plan, **self.cache.tensors, **inputs, workspace=self._workspace)

    def materialize(
        self, slots: torch.Tensor | Sequence[int], **params: torch.Tensor
    ) -> torch.Tensor:
        """The FP32 state of each slot at its current position, changing nothing
        (ops.prefix.materialize_slots; Mamba-2 takes A). Store it as a prefix state; load it
        with cache.reset(slots, state)."""
        return materialize_slots(self._planned("materialize"), self.cache.tensors, slots, **params)

    def commit(
        self,
        num_accepted: torch.Tensor,
        slot_indices: torch.Tensor,
        accepted_path: torch.Tensor | None = None,
        parents: torch.Tensor | None = None,
    ) -> None:
        """Commit the accepted drafts of each row's last verify (ops.commit.commit_drafts):
        num_accepted [batch] int32, the count per row; accepted_path [batch, T] int32, a tree's
        accepted root-to-node path (draft indices, root first), or None for chains, with the
        verify's parents [batch, T] int32 (the path is checked against them). Everything is
        checked first; on error nothing is touched."""
        commit_drafts(self._planned("commit"), **self.cache.tensors, num_accepted=num_accepted,
                      slot_indices=slot_indices, accepted_path=accepted_path,
                      parents=parents)  # fmt: skip
