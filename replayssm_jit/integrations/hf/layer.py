"""One patched SSM mixer: its slot pool, plans, and which HF cache's state the slots hold."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from replayssm_jit.families.layout import CacheLayout
from replayssm_jit.integrations.hf.mixers import MixerAdapter, layout_of
from replayssm_jit.ops import materialize_slots, plan_decode, reset_slots
from replayssm_jit.ops.plan import DecodePlan
from replayssm_jit.ops.registry import family_ops

__all__ = ["NO_FORWARD", "PatchedLayer"]

NO_FORWARD = object()  # marks a mixer that had no instance-level forward before the patch


@dataclass(eq=False)
class PatchedLayer:
    """One mixer's decode through our ops.

    formats: the patch's state_dtype, read_dtype, window, stochastic_rounding and seed; the
    layout is rebuilt from them when the model's dtype or device changes after the patch.
    held_cache: the HF cache whose state the slots hold (None: they hold none); hf_state: that
    cache's SSM state tensor when the slots loaded it (a different tensor later means HF
    replaced it, e.g. beam search's reorder_cache).
    """

    mixer: torch.nn.Module
    adapter: MixerAdapter
    layout: CacheLayout
    mode: str
    formats: dict
    stagger_flushes: bool
    launch_config: object
    original_forward: Callable
    saved_instance_forward: object
    cache_kwarg: str = "cache"  # what the mixer's own forward calls its cache (older: cache_params)
    pool: dict[str, torch.Tensor] = field(default_factory=dict)
    plans: dict[int, DecodePlan] = field(default_factory=dict)
    slot_id_cache: dict[int, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    held_cache: weakref.ref | None = None
    hf_state: torch.Tensor | None = None
    decode_steps: int = 0

    @property
    def family(self) -> str:
        return self.adapter.family

    @property
    def stochastic_rounding(self) -> bool:
        return self.formats["stochastic_rounding"]

    @property
    def seed(self) -> int:
        return self.formats["seed"]

    @property
    def device(self) -> torch.device:
        return self.mixer.conv1d.weight.device

    @property
    def model_dtype(self) -> torch.dtype:
        return self.mixer.conv1d.weight.dtype

    # -- the patched forward ------------------------------------------------------------------

    def forward(self, hidden_states=None, cache=None, attention_mask=None, **kwargs):
        """The mixer's forward: our SSM step on a one-token cached decode, HF's own otherwise."""
        cache = kwargs.pop("cache_params", cache)  # (the name older callers use)
        if not self._is_cached_decode(hidden_states, cache, kwargs):
            if cache is not None:
                self._write_back_if_held(cache)
            kwargs[self.cache_kwarg] = cache
            return self.original_forward(hidden_states, attention_mask=attention_mask, **kwargs)
        self._follow_model()
        if self._held() is not cache:
            self._load(cache, batch=hidden_states.shape[0])
        else:
            self._check_state_not_replaced(cache)
        self.decode_steps += 1
        return self.adapter.step(self, hidden_states, cache, attention_mask)

    def _is_cached_decode(self, hidden_states, cache, kwargs) -> bool:
        """Whether HF would take its one-token recurrent path (the only one we replace)."""
        if cache is None or not isinstance(hidden_states, torch.Tensor) or self.mixer.training:
            return False
        if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            return False
        if kwargs.get("cu_seq_lens_q") is not None:  # packed sequences: HF's varlen path
            return False
        index = self.mixer.layer_idx
        return (
            not cache.is_recording_past(index)
            and cache.get_conv_state(index) is not None
            and cache.get_recurrent_state(index) is not None
        )

    # -- plans --------------------------------------------------------------------------------

    def plan(self, batch: int) -> DecodePlan:
        if batch not in self.plans:
            # The slot ids are ours (0..batch-1 or pads): no host read of them per step.
            self.plans[batch] = self.make_plan(batch, self.device)
        return self.plans[batch]

    def make_plan(self, batch: int, device) -> DecodePlan:
        return plan_decode(
            self.layout, batch, device=device, mode=self.mode, check_slot_values=False,
            config=self.launch_config, seed=self.seed, **self.plan_options(),
        )  # fmt: skip

    def plan_options(self) -> dict:
        """The family's plan() options that reproduce HF's gates and norms, and the rounding."""
        return self.adapter.plan_options | {"stochastic_rounding": self.stochastic_rounding}

    def step_seed(self) -> int | None:
        """The seed of the current decode step: None (the plan's) except for conventional SR,
        whose noise has no flush epoch to key it: each step then gets a seed of its own."""
        if not (self.stochastic_rounding and self.mode == "conventional"):
            return None
        return ((self.seed << 32) + self.decode_steps) & (2**63 - 1)

    def slot_ids(self, batch: int) -> torch.Tensor:
        """Rows 0..batch-1 hold slots 0..batch-1: made once per batch, not every step."""
        ids = self.slot_id_cache.get(batch)
        if ids is None or ids.device != self.device:
            ids = self.slot_id_cache[batch] = torch.arange(batch, dtype=torch.int32,
                                                          device=self.device)  # fmt: skip
        return ids

    # -- the model's dtype and device -----------------------------------------------------------

    def _follow_model(self) -> None:
        """After model.to(dtype / device) the layout follows: the held state is written back
        with the old layout, then the layout, plans and pool are made again."""
        if (self.layout.act_dtype, self.pool_device()) == (self.model_dtype, self.device):
            return
        try:
            layout = layout_of(self.mixer, self.adapter, self.formats)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"model: cast to {self.model_dtype} after hf.patch(), which the checkpoint "
                f"formats refuse at that dtype ({error}); patch after the final cast"
            ) from error
        held = self._held()
        if held is not None:
            self._write_back(held)
        self.layout, self.plans, self.pool = layout, {}, {}

    def pool_device(self) -> torch.device:
        return self.pool["state"].device if self.pool else self.device

    # -- slots --------------------------------------------------------------------------------

    def _held(self):
        return None if self.held_cache is None else self.held_cache()

    def _load(self, cache, batch: int) -> None:
        """Slots 0..batch-1 start from HF's current SSM state (what its prefill left)."""
        held = self._held()
        if held is not None:
            self._write_back(held)  # another cache takes the layer over: the old one gets its state
        if not self.pool or self.pool["state"].shape[0] != batch:
            self.pool = self.layout.allocate(batch, self.device)
        hf_state = cache.get_recurrent_state(self.mixer.layer_idx)
        # The delta rules: HF keeps [HV, K, V] per row, we keep [HV, V, K] (a transposed read).
        ours = hf_state.transpose(-1, -2) if self.adapter.hf_state_transposed else hf_state
        reset_slots(self.layout, self.pool, list(range(batch)), initial_state=ours)
        self.params = self.adapter.params(self.mixer)
        self.held_cache, self.hf_state = weakref.ref(cache), hf_state
        if self.stagger_flushes and self.mode == "replay":
            self._stagger(batch)

    def _check_state_not_replaced(self, cache) -> None:
        """HF's reorder_cache (beam search) and batch selection replace the cache's state tensor
        with a gather of its stale rows; our slots cannot follow that gather, so refuse."""
        if cache.get_recurrent_state(self.mixer.layer_idx) is self.hf_state:
            return
        self.held_cache, self.hf_state = None, None  # the stale state is HF's now: drop the slots
        raise RuntimeError(
            f"hf.patch: layer {self.mixer.layer_idx}'s SSM state in the HF cache was replaced "
            "between decode steps (beam search's reorder_cache, or a batch selection, gathers "
            "rows of it). The drop-in decodes from its own slots and does not follow that "
            "gather: use num_beams=1 (greedy or sampling), or unpatch(model) for beam search"
        )

    def _write_back_if_held(self, cache) -> None:
        if self._held() is cache:
            self._write_back(cache)

    def _write_back(self, cache) -> None:
        """HF's cache gets the slots' exact current states (checkpoint with held records folded
        in FP32); the slots are then released."""
        batch = self.pool["state"].shape[0]
        # (the step's plan where there is one: plans and pool are made and dropped together)
        plan = self.plans.get(batch) or self.make_plan(batch, self.pool_device())
        fold = {name: self.params[name] for name in family_ops(plan.family).fold_params}
        states = materialize_slots(plan, self.pool, list(range(batch)), **fold)
        hf_state = cache.get_recurrent_state(self.mixer.layer_idx)
        if hf_state is not None and hf_state is self.hf_state:
            hf_state.copy_(states.transpose(-1, -2) if self.adapter.hf_state_transposed else states)
        self.held_cache, self.hf_state = None, None

    def _stagger(self, batch: int) -> None:
        """Row r starts holding (r * L) // batch neutral records, so that rows flush at
        different steps and a launch mixes flush and non-flush rows."""
        window = self.layout.window
        offsets = [(row * window) // batch for row in range(batch)]
        pad = self.plan(batch).pad_slot_id
        for step in range(max(offsets)):
            slots = torch.tensor([r if offsets[r] > step else pad for r in range(batch)],
                                 dtype=torch.int32, device=self.device)  # fmt: skip
            self.adapter.neutral_step(self, batch, slots)
