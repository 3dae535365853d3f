"""SGLang's EAGLE tree verify on a ReplaySSM layer: its tree-verify arguments mapped onto the
verify op's draft tree, and its post-verify state update mapped onto commit_drafts.

SGLang's verify (read from its code: docs/integrations.md) runs T tokens per request with
disable_state_update=True, writes the state after every token into intermediate_states_buffer
(cache_steps steps per row), and reads retrieve_parent_token [bs, T]: token t > 0 starts from
the state after token retrieve_parent_token[b, t] where that lies in [0, T), else from the state
after token t - 1; token 0 starts from the slot's state. After verification,
update_mamba_state_after_mtp_verify copies the buffer's state at each row's last accepted step
(last_correct_step_indices, -1 for none) into the slot.

Here the drafts stay pending as records, so no buffer is written and none is read: the engine
passes intermediate_states_buffer=None, and the commit walks the tree from the last accepted
step to the root on the device and commits that path (commit_drafts with accepted_path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayssm_jit.families.schema import commit_ring_roles
from replayssm_jit.integrations.vllm.layer import ReplaySSMLayer
from replayssm_jit.integrations.vllm.rows import LayerRows, reads_device_values
from replayssm_jit.ops.library import OPS

__all__ = ["TreeRows", "check_tree_arguments"]


def check_tree_arguments(
    T: int,
    disable_state_update: bool,
    intermediate_states_buffer: object,
    cache_steps: object,
    intermediate_state_indices: object,
    retrieve_parent_token: object,
) -> None:
    """The tree-verify inputs ReplaySSM takes as SGLang passes them, or a clear refusal."""
    if T == 1 and retrieve_parent_token is not None:
        raise ValueError(
            f"retrieve_parent_token: expected None for a one-token step (a tree needs the "
            f"layout's drafts tokens per row), got {getattr(retrieve_parent_token, 'shape', None)}"
        )
    if T > 1 and not disable_state_update:
        raise ValueError(
            f"disable_state_update: expected True for a {T}-token verify (the drafts stay "
            f"pending until update_mamba_state_after_mtp_verify commits the accepted path), "
            f"got {disable_state_update}"
        )
    if T == 1 and disable_state_update:
        raise ValueError(
            "disable_state_update: expected False for a one-token step (a step commits its "
            "token; a verify has the layout's drafts tokens per row), got True"
        )
    if intermediate_states_buffer is not None:
        got = getattr(intermediate_states_buffer, "shape", type(intermediate_states_buffer))
        raise ValueError(
            f"intermediate_states_buffer: expected None (ReplaySSM writes no per-step states: "
            f"the drafts are kept as records and committed by "
            f"update_mamba_state_after_mtp_verify), got {got}"
        )
    if intermediate_state_indices is not None:
        raise ValueError(
            f"intermediate_state_indices: expected None (no intermediate_states_buffer is "
            f"written), got {getattr(intermediate_state_indices, 'shape', None)}"
        )
    if cache_steps is not None and (T == 1 or int(cache_steps) != T):
        raise ValueError(
            f"cache_steps: expected None or {T} (the tokens per row of this verify), got "
            f"{cache_steps}"
        )


@dataclass(eq=False)
class TreeRows:
    """Buffers of one batch size for the tree verify and its commit (made once, before a
    CUDA-graph capture; nothing is allocated per call)."""

    rows: LayerRows
    parents: torch.Tensor  # [batch, T] int32: the verify op's parents (-1: the slot's state)
    prev: torch.Tensor  # [1, T] int32: t - 1, where a parent outside [0, T) continues from
    slots: torch.Tensor  # [batch] int32: the last verify's slots, which the commit updates
    cu: torch.Tensor  # [batch + 1] int32: 0, T, 2T, ...: the verify's uniform rows
    ext: torch.Tensor  # [batch, T + 1] int64: parents with column T = -1 (the walk's sink)
    outside: torch.Tensor  # [batch, T] bool: parents outside [0, T)
    neg: torch.Tensor  # [batch, 1] bool: the walk's steps past the root
    node: torch.Tensor  # [batch, 1] int64: the walk's current step, T once past the root
    hop: torch.Tensor  # [batch, 1] int64: its parent (gather's output may not alias its index)
    mark: torch.Tensor  # [batch, T + 1] int32: steps on the accepted path (column T: sink)
    key: torch.Tensor  # [batch, T] int64: sort keys, the path's steps first
    ordered: torch.Tensor  # [batch, T] int64: the sorted keys
    order: torch.Tensor  # [batch, T] int64: torch.sort's indices output
    path: torch.Tensor  # [batch, T] int32: the accepted root-to-node path
    accepted: torch.Tensor  # [batch] int32: its length
    rings: tuple  # (commit_drafts' ring argument, the pool's ring name), read once (no dynamo
    # break on the layout's cached property per call)

    @classmethod
    def make(cls, rows: LayerRows) -> TreeRows:
        batch, T, dev = rows.plan.batch_size, rows.plan.layout.drafts, rows.plan.device

        def z(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=dev)

        steps = torch.arange(T, dtype=torch.int32, device=dev)
        return cls(rows, z(batch, T, dtype=torch.int32), (steps - 1)[None, :].contiguous(),
                   z(batch, dtype=torch.int32),
                   torch.arange(0, batch * T + 1, T, dtype=torch.int32, device=dev),
                   z(batch, T + 1), z(batch, T, dtype=torch.bool), z(batch, 1, dtype=torch.bool),
                   z(batch, 1), z(batch, 1), z(batch, T + 1, dtype=torch.int32),
                   z(batch, T), z(batch, T), z(batch, T), z(batch, T, dtype=torch.int32),
                   z(batch, dtype=torch.int32),
                   commit_ring_roles(rows.plan.layout.ring_names))  # fmt: skip

    def map_parents(self, retrieve_parent_token: object, slots: torch.Tensor) -> torch.Tensor:
        """[batch, T] int32 parents from SGLang's retrieve_parent_token ([bs, T], None for a
        chain), as SGLang's kernel reads it; the verify's slots are kept for the commit."""
        batch, T = self.parents.shape
        self.slots.copy_(slots)
        if retrieve_parent_token is None:
            self.parents.copy_(self.prev.expand(batch, T))
        else:
            p = _index("retrieve_parent_token", retrieve_parent_token, (batch, T))
            if reads_device_values(self.rows.plan):
                _check_parents(p.tolist(), slots.tolist(), self.rows.plan.pad_slot_id)
            # int64 values clamp before the narrowing copy (2**32 + 1 would read as step 1).
            if p.dtype == torch.int64:
                p = torch.clamp(p, -1, T, out=self.key)  # (key is free until the commit)
            # Values outside [0, T) all become -1 (T + 1 classes mod T + 1), then t - 1: the
            # previous step, where SGLang's kernel continues from.
            self.parents.copy_(p).clamp_(-1, T).add_(1).remainder_(T + 1).sub_(1)
            torch.lt(self.parents, 0, out=self.outside)
            torch.where(self.outside, self.prev, self.parents, out=self.parents)
        self.parents[:, 0] = -1  # token 0 starts from the slot's state
        return self.parents

    def commit(self, layer: ReplaySSMLayer, last_correct_step_indices: object) -> None:
        """Commit each row's root-to-node path to its last accepted step (-1: none)."""
        batch, T = self.parents.shape
        last = _index("last_correct_step_indices", last_correct_step_indices, (None,))
        n = last.shape[0]
        if n > batch:
            raise ValueError(
                f"last_correct_step_indices: expected at most {batch} rows (the verify's), got {n}"
            )
        if reads_device_values(self.rows.plan):
            bad = [(b, s) for b, s in enumerate(last.tolist()) if not -1 <= s < T]
            if bad:
                raise ValueError(
                    f"last_correct_step_indices: expected a step in [-1, {T}) per row, got "
                    f"{bad[0][1]} in row {bad[0][0]}"
                )
        # Rows past SGLang's request count accept nothing (its CUDA-graph pads).
        self.node.fill_(T)
        self.node[:n, 0].copy_(last)
        torch.lt(self.node, 0, out=self.neg)
        self.node.masked_fill_(self.neg, T).clamp_(max=T)
        self.ext[:, :T].copy_(self.parents)
        self.ext[:, T] = -1
        self.mark.zero_()
        for _ in range(T):  # a path has at most T steps: parents[t] < t
            self.mark.scatter_(1, self.node, 1)
            torch.gather(self.ext, 1, self.node, out=self.hop)
            torch.lt(self.hop, 0, out=self.neg)
            self.node.copy_(self.hop).masked_fill_(self.neg, T)
        torch.sum(self.mark[:, :T], dim=1, out=self.accepted)
        # The marked steps in increasing order come first: a root-to-node path (parents < t).
        # key = t + T * (1 - mark): t on the path, t + T off it
        self.key.copy_(self.mark[:, :T]).mul_(-T).add_(self.prev).add_(T + 1)
        torch.sort(self.key, dim=1, out=(self.ordered, self.order))
        self.path.copy_(self.ordered.remainder_(T))
        pool = layer.pool
        rings = {arg: pool[name] for arg, name in self.rings}
        OPS["commit_drafts"](self.rows.handle, cursors=pool["cursors"], **rings,
                             num_accepted=self.accepted, slot_indices=self.slots,
                             accepted_path=self.path, parents=self.parents)  # fmt: skip


def _index(name: str, t: object, shape: tuple) -> torch.Tensor:
    """An int32/int64 tensor of at least `shape` (None: any length), cut to it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype int32 or int64, got {t.dtype}")
    ok = t.dim() == len(shape) and all(
        want is None or (t.shape[0] >= want if d == 0 else t.shape[d] == want)
        for d, want in enumerate(shape)
    )
    if not ok:
        want = ", ".join("n" if s is None else str(s) for s in shape)
        raise ValueError(f"{name}: expected shape [{want}], got {list(t.shape)}")
    return t if shape[0] is None else t[: shape[0]]


def _check_parents(given: list, slots: list, pad: int) -> None:
    """A parent in [0, T) must be an earlier step: SGLang's kernel would read a state this
    verify has not written yet."""
    T = len(given[0]) if given else 0
    for b, row in enumerate(given):
        if slots[b] == pad:
            continue
        for t in range(1, T):
            if 0 <= row[t] < T and row[t] >= t:
                raise ValueError(
                    f"retrieve_parent_token: expected an earlier step (< {t}) or a value "
                    f"outside [0, {T}) at [{b}, {t}], got {row[t]}"
                )
