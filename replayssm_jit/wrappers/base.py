"""plan()/run() machinery shared by every family's decode wrapper."""

from __future__ import annotations

import torch

from replayssm_jit.checks import check_slot_indices
from replayssm_jit.jit.build import load_module
from replayssm_jit.ops import tiling
from replayssm_jit.spec import KernelSpec, split_workspace_floats
from replayssm_jit.wrappers.cache import SlotCache

MODES = ("replay", "conventional")


class DecodeWrapper:
    """plan() once per batch shape (choose and load the kernel), run() once per decode step.

    mode="replay": ReplaySSM (non-flush steps read the checkpoint and append a record; every
    L-th step of a slot flushes). At batches too small to fill the GPU, steps with FP32
    checkpoints flush every token instead (`kernel == "flush-every-step"`: the cursor stays at
    zero records and the epoch counts steps). At batch 1 on the H200 that is faster than
    replaying a window; outputs differ only in FP32 rounding order (the GPU tests hold both to
    the float64 reference).
    mode="conventional": read, update and write the state.
    With use_cuda_graph=True, run() writes into a fixed output buffer and does not read slot
    values on the host (that would sync), so a step can be captured in a CUDA graph.
    check_slot_values=False skips that read in eager mode too: out-of-range or repeated slot ids
    are then the caller's responsibility (shape, dtype and device are always checked).
    """

    def __init__(
        self,
        cache: SlotCache,
        *,
        mode: str = "replay",
        use_cuda_graph: bool = False,
        check_slot_values: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self.cache, self.mode, self.use_cuda_graph = cache, mode, use_cuda_graph
        self.check_slot_values = check_slot_values and not use_cuda_graph
        self.spec: KernelSpec | None = None
        self.batch_size = 0
        self.rows_per_cta = 0
        self.launch_flags = 0
        self.seed = 0
        self._module = None
        self._out: torch.Tensor | None = None
        self._workspace: torch.Tensor | None = None

    @property
    def window(self) -> int:
        """Replay window of the kernels this wrapper runs (1 in conventional mode)."""
        return self.cache.window if self.mode == "replay" else 1

    @staticmethod
    def _check_batch_size(batch_size: object) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")

    @property
    def kernel(self) -> str:
        """Which kernel run() launches: "split" (a records kernel, then a state kernel),
        "per-item", or "flush-every-step" (the per-item kernel flushing every token, so that no
        record stays held; small batches with FP32 checkpoints)."""
        if self.launch_flags & tiling.FLAG_SPLIT:
            return "split"
        if self.launch_flags & tiling.FLAG_FLUSH_EVERY_STEP:
            return "flush-every-step"
        return "per-item"

    def _plan(self, spec: KernelSpec, batch_size: int, seed: int) -> None:
        """Choose the launch for `batch_size` rows (ops/tiling.py), load the module; graph mode
        also gets its output buffer."""
        c = self.cache
        heads = c.state.shape[1]  # H (Mamba-2) or HV (GDN)
        rows, flags = tiling.choose_launch(
            spec, batch_size, heads, c.device, replay=self.mode == "replay"
        )
        self._module = load_module(spec)
        self.spec, self.batch_size, self.rows_per_cta = spec, batch_size, rows
        self.launch_flags = flags
        self.seed = int(seed) & (2**63 - 1)
        self._out = None
        # The split kernel's records -> state hand-over (every replay_step binding takes one).
        floats = split_workspace_floats(spec, batch_size, heads) if flags & tiling.FLAG_SPLIT else 0
        self._workspace = torch.empty(floats, dtype=torch.float32, device=c.device)
        if self.use_cuda_graph:
            self._out = torch.empty(
                (batch_size, *self._out_row_shape()), dtype=c.act_dtype, device=c.device
            )

    def _begin_run(
        self, lead: torch.Tensor, slot_indices: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        """Checks shared by every run(); returns the output buffer to use."""
        if self.spec is None:
            raise RuntimeError("run() called before plan()")
        if lead.dim() < 1 or lead.shape[0] != self.batch_size:
            raise ValueError(
                f"batch: expected {self.batch_size} rows as planned, got shape {list(lead.shape)}"
            )
        c = self.cache
        check_slot_indices(
            slot_indices, self.batch_size, c.num_slots, c.pad_slot_id, c.device,
            read_values=self.check_slot_values,
        )  # fmt: skip
        if out is not None:
            return out
        if self._out is not None:
            return self._out
        return torch.empty(
            lead.shape[:1] + self._out_row_shape(), dtype=c.act_dtype, device=lead.device
        )

    def _launch(self, inputs: tuple, out: torch.Tensor, slot_indices: torch.Tensor) -> None:
        """Every module binds conventional_step(state, *inputs, *tail) and
        replay_step(state, *rings (in the cache's order), cursors, *inputs, *tail, workspace),
        with the family's token inputs first and tail = (out, slot_indices, pad_slot_id, seed,
        rows, flags)."""
        c = self.cache
        tail = (out, slot_indices, c.pad_slot_id, self.seed, self.rows_per_cta, self.launch_flags)
        if self.mode == "replay":
            self._module.replay_step(
                c.state, *c.rings.values(), c.cursors, *inputs, *tail, self._workspace
            )
        else:
            self._module.conventional_step(c.state, *inputs, *tail)

    def _out_row_shape(self) -> tuple[int, ...]:
        raise NotImplementedError
