"""One engine layer's ReplaySSM pool (the engine's state tensor plus our rings and cursors), its
plans per batch size, and the launch through the registered torch.library ops."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replayssm_jit.families.layout import POOL_LAYOUTS, CacheLayout
from replayssm_jit.integrations.vllm.rows import LayerRows
from replayssm_jit.ops.library import OPS
from replayssm_jit.ops.plan import plan_decode

__all__ = ["ReplaySSMLayer"]


class ReplaySSMLayer:
    """A layer's pool and plans. `state` is the engine's own state tensor ([slots, H, P, N] or
    [slots, HV, V, K]; packed, or a view into the engine's cache pages); the rings and cursors
    are made here (zero: every slot starts empty) unless `tensors` gives them (views into the
    same pages: integrations/vllm/pages.py). plan_options go to plan_decode (family flags,
    scale, lower_bound); pad_slot_id is the engine's (vLLM's null block 0, SGLang's -1)."""

    def __init__(
        self,
        layout: CacheLayout,
        state: torch.Tensor,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        pad_slot_id: int,
        check_slot_values: bool = True,
        **plan_options,
    ) -> None:
        if not isinstance(layout, CacheLayout):
            raise TypeError(f"layout: expected a CacheLayout, got {type(layout).__name__}")
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"state: expected a torch.Tensor, got {type(state).__name__}")
        pool = dict(tensors or {})
        if not pool:
            for t in layout.tensors():
                if t.name != "state":
                    shape = t.shape(state.shape[0])
                    pool[t.name] = torch.zeros(shape, dtype=t.dtype, device=state.device)
            POOL_LAYOUTS.set(pool["cursors"], layout)
        pool["state"] = state
        layout.check_tensors(pool, device=state.device)
        self.layout, self.pool, self.device = layout, pool, state.device
        self.pad_slot_id, self.check_slot_values = pad_slot_id, check_slot_values
        self.plan_options = plan_options
        # The family flags the plans will carry (dt_softplus, sr, ...), checked per call.
        self.flags = frozenset(layout.family.plan_flags(plan_options, layout.shape)[0])
        self._rows: dict[int, LayerRows] = {}

    @property
    def state(self) -> torch.Tensor:
        return self.pool["state"]

    def rows(self, batch: int) -> LayerRows:
        """The plan and buffers of `batch` rows, made at the first call (call prepare() for
        every captured batch size before a CUDA-graph capture)."""
        rows = self._rows.get(batch)
        if rows is None:
            rows = self.prepare(batch)
        return rows

    def prepare(self, *batch_sizes: int) -> LayerRows:
        for batch in batch_sizes:
            plan = plan_decode(self.layout, batch, device=self.device, pad_slot_id=self.pad_slot_id,
                               check_slot_values=self.check_slot_values,
                               **self.plan_options)  # fmt: skip
            self._rows[batch] = LayerRows.make(plan)
        return self._rows[batch_sizes[-1]]

    def check_state(self, state: object) -> None:
        """The engine's state must be this layer's (the rings and cursors belong to it)."""
        if torch.compiler.is_compiling() or state is self.pool["state"]:
            return
        mine = (self.state.data_ptr(), self.state.shape, self.state.dtype)
        if not isinstance(state, torch.Tensor) or (state.data_ptr(), state.shape,
                                                   state.dtype) != mine:  # fmt: skip
            got = list(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(
                f"state: expected this layer's state tensor {list(self.state.shape)} at "
                f"{self.state.data_ptr():#x} (its rings and cursors are registered with it), "
                f"got {got}"
            )

    def launch(self, rows: LayerRows, op: str, **inputs) -> None:
        """replayssm::<family>_<op> with this layer's pool and `inputs` (out included)."""
        fn = OPS[f"{self.layout.family.name}_{op}"]
        fn(rows.handle, **self.pool, **inputs)
