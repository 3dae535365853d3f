"""A layer's ReplaySSM slot tensors inside vLLM's cache pages (issue 36, "vLLM cache pages").

vLLM asks each Mamba layer for its per-block state shapes and dtypes (get_state_shape,
get_state_dtype), declares them in the layer's MambaSpec, allocates one page per block and views
the i-th tensor with as_strided at the sum of the earlier tensors' bytes, slot stride = the
(padded) page in elements of its dtype. `page_entries` appends the layout's rings, scales and
cursors to vLLM's own entries (conv state, SSM state) so that the profiler counts them and the
runner carves them out of the same page; `page_tensors` names the runner's views. The kernels take
every tensor's slot stride, so nothing else changes (docs/integrations-vllm-pages.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from replayssm_jit.families.layout import CacheLayout

__all__ = ["PageEntries", "page_entries", "page_tensors"]


@dataclass(frozen=True)
class PageEntries:
    """What a layer declares: shapes and dtypes (vLLM's, then ours, with uint8 pad entries where
    an offset needs aligning), the layout tensor name of each entry (None for vLLM's own and the
    pads), and the bytes one page holds before vLLM pads it."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    names: tuple[str | None, ...]
    page_bytes: int


def page_entries(
    layout: CacheLayout,
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    *,
    state_index: int = -1,
) -> PageEntries:
    """vLLM's entries of a layer (`shapes`, `dtypes`: what its get_state_shape and
    get_state_dtype return, conv state first) with the layout's other tensors appended: the
    16-byte aligned ones first, in layout order, then the scalar rings; a uint8 [pad] entry
    wherever the running byte offset would leave one misaligned, and one at the end that makes
    the page a multiple of 16 bytes. `state_index`: which of vLLM's
    entries is the SSM state (it must be the layout's [H, P, N] / [HV, V, K] of its state dtype)."""
    if not isinstance(layout, CacheLayout):
        raise TypeError(f"layout: expected a CacheLayout, got {type(layout).__name__}")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    dtypes = list(dtypes)
    if len(shapes) != len(dtypes) or not shapes:
        raise ValueError(
            f"shapes, dtypes: expected one dtype per shape (vLLM's entries), got {len(shapes)} "
            f"shapes and {len(dtypes)} dtypes"
        )
    state = next(t for t in layout.tensors() if t.name == "state")
    if shapes[state_index] != state.per_slot_shape or dtypes[state_index] != state.dtype:
        raise ValueError(
            f"shapes[{state_index}]: expected the SSM state {list(state.per_slot_shape)} "
            f"{state.dtype} (the layout's), got {list(shapes[state_index])} {dtypes[state_index]}"
        )
    names: list[str | None] = [None] * len(shapes)
    names[state_index] = "state"
    offset = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))
    ours = [t for t in layout.tensors() if t.name != "state"]
    for t in sorted(ours, key=lambda t: -t.alignment):  # (stable: layout order within each)
        pad = -offset % t.alignment
        if pad:
            shapes.append((pad,))
            dtypes.append(torch.uint8)
            names.append(None)
            offset += pad
        shapes.append(t.per_slot_shape)
        dtypes.append(t.dtype)
        names.append(t.name)
        offset += math.prod(t.per_slot_shape) * t.dtype.itemsize
    # The page (vLLM's slot stride) a multiple of every alignment: a model without attention
    # pages, whose page vLLM does not pad, declares it so.
    tail = -offset % max(t.alignment for t in ours)
    if tail:
        shapes.append((tail,))
        dtypes.append(torch.uint8)
        names.append(None)
        offset += tail
    return PageEntries(tuple(shapes), tuple(dtypes), tuple(names), offset)


def page_tensors(entries: PageEntries, kv_cache: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The layout's tensors by name from the runner's views of a layer's page (its kv_cache list,
    one view per declared entry), for ReplaySSMLayer(tensors=...) or the functional ops."""
    if len(kv_cache) != len(entries.names):
        raise ValueError(
            f"kv_cache: expected {len(entries.names)} views (one per declared entry), got "
            f"{len(kv_cache)}"
        )
    return {name: t for name, t in zip(entries.names, kv_cache) if name is not None}
