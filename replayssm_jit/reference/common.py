"""Shared helpers for the float64 reference oracles (the math: docs/design.md).

Notation (1-based positions): records 1..n follow the checkpoint S_c, and
``a(i:j) = prod_{m=i..j} alpha_m``, an empty product being 1. Every decay product here is formed as
``exp(sum of log-decays)``, never as a product of rounded factors.

Everything computes in float64. Nothing in the fast path imports this package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from replayssm_jit.core import checks

F64 = torch.float64


# ---------------------------------------------------------------------------------------------
# Argument checks (every error is a ValueError that names the argument)
# ---------------------------------------------------------------------------------------------


def check_tensor(name: str, t, shape: Sequence[int | None], *, optional: bool = False) -> None:
    """A floating tensor of ``shape`` (``None`` entries match any size), in the library's one
    error style (replayssm_jit.core.checks): TypeError for a wrong type, ValueError for a wrong shape."""
    if t is None:
        if optional:
            return
        raise ValueError(f"{name}: expected a tensor, got None")
    checks.check_tensor(name, t, shape=shape)
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")


def check_divides(name: str, n_small: int, n_big: int, what: str) -> None:
    """Check the GQA grouping: ``n_small`` heads/groups must divide ``n_big``."""
    if n_small < 1 or n_big % n_small != 0:
        raise ValueError(f"{name}: {what} ({n_small}) must divide {n_big}")


def check_slots(slot_indices, num_slots: int, batch: int, pad_slot_id: int) -> list[int]:
    """Validate ``slot_indices`` [batch] (int) against a pool of ``num_slots``; return it as a list.

    Each entry is ``pad_slot_id`` (a padded row) or a slot in ``[0, num_slots)``; non-pad slots must
    be distinct (two rows writing one slot is a caller bug).
    """
    if not isinstance(slot_indices, torch.Tensor):
        raise ValueError(
            f"slot_indices: expected a torch.Tensor, got {type(slot_indices).__name__}"
        )
    if (
        slot_indices.is_floating_point()
        or slot_indices.is_complex()
        or slot_indices.dtype == torch.bool
    ):
        raise ValueError(f"slot_indices: expected an integer dtype, got {slot_indices.dtype}")
    if tuple(slot_indices.shape) != (batch,):
        raise ValueError(
            f"slot_indices: expected shape ({batch},), got {tuple(slot_indices.shape)}"
        )
    slots = [int(s) for s in slot_indices.tolist()]
    seen: set[int] = set()
    for s in slots:
        if s == pad_slot_id:
            continue
        if not 0 <= s < num_slots:
            raise ValueError(
                f"slot_indices: expected values in [0, {num_slots}) or pad_slot_id={pad_slot_id}, "
                f"got {s}"
            )
        if s in seen:
            raise ValueError(f"slot_indices: slot {s} appears twice among non-pad rows")
        seen.add(s)
    return slots


# ---------------------------------------------------------------------------------------------
# Small math helpers
# ---------------------------------------------------------------------------------------------


def f64(t: torch.Tensor | None, *, copy: bool = False) -> torch.Tensor | None:
    """Upcast to float64 (``None`` passes through). ``copy`` forces a fresh tensor."""
    return None if t is None else t.to(F64, copy=copy)


def expand_heads(t: torch.Tensor, n_heads: int, dim: int) -> torch.Tensor:
    """Repeat the ``n_in`` groups along ``dim`` to ``n_heads`` heads: head h reads group
    ``h // (n_heads // n_in)`` (the Mamba-2 ngroups / GDN GVA convention)."""
    return t.repeat_interleave(n_heads // t.shape[dim], dim=dim)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (the FLA / GDN convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def segment_decays(log_alpha: torch.Tensor) -> torch.Tensor:
    """All segment decays of a window, from cumulative sums of log-decays.

    log_alpha: [n, *rest], row m-1 is record m's log-decay (``rest`` = [H] scalar decay, or [H, K]
    per-channel decay). Returns ``seg`` [n+1, n+1, *rest] (float64) with
    ``seg[j, i] = a(i+1:j)`` for ``0 <= i <= j <= n`` (so ``seg[j, j] = 1`` and ``seg[j, 0] = a(1:j)``,
    the checkpoint's decay), and ``0`` above the diagonal.
    """
    la = f64(log_alpha)
    cum = torch.cat(
        [la.new_zeros((1, *la.shape[1:])), la.cumsum(0)]
    )  # cum[j] = sum_{m<=j} log alpha_m
    n1 = cum.shape[0]
    diff = cum[:, None] - cum[None, :]  # [j, i] -> sum_{m=i+1..j} log alpha_m
    lower = torch.ones(n1, n1, dtype=torch.bool, device=la.device).tril()
    lower = lower.reshape(n1, n1, *([1] * (la.dim() - 1)))
    return torch.exp(torch.where(lower, diff, torch.full_like(diff, -torch.inf)))


def decays_to_end(log_alpha: torch.Tensor) -> torch.Tensor:
    """Row n of ``segment_decays``, without the [n+1, n+1] matrix: [n+1, *rest], entry i = a(i+1:n).

    Entry 0 is a(1:n) (the checkpoint's decay), entry n is 1. Each entry is exp of a suffix sum.
    """
    la = f64(log_alpha)
    suffix = la.flip(0).cumsum(0).flip(0)  # suffix[i] = sum_{m=i+1..n} log alpha_m (1-based m)
    return torch.exp(torch.cat([suffix, la.new_zeros((1, *la.shape[1:]))]))


def unrolled_apply(
    checkpoint: torch.Tensor,
    log_alpha: torch.Tensor,
    vals: torch.Tensor,
    keys: torch.Tensor,
    query: torch.Tensor,
) -> torch.Tensor:
    """``S_n @ query`` from the checkpoint and n records, WITHOUT materialising S_n.

    checkpoint [H, V, K]; log_alpha [n, H] (scalar decay per head) or [n, H, K] (per channel);
    vals [n, H, V] (v for Mamba-2, u for GDN/KDA); keys [n, H, K] (already expanded to H heads);
    query [H, K]. Returns [H, V] (float64):

    * scalar:      a(1:n) (S_c q) + sum_i a(i+1:n) (k_i . q) v_i
    * per channel: S_c (a(1:n) * q) + sum_i ((k_i * a(i+1:n)) . q) v_i
    """
    s_c, vals, keys, q = f64(checkpoint), f64(vals), f64(keys), f64(query)
    dec = decays_to_end(log_alpha)  # [n+1, H] or [n+1, H, K]
    if dec.dim() == 2:
        out = dec[0][:, None] * torch.einsum("hvk,hk->hv", s_c, q)
        w = dec[1:] * torch.einsum("ihk,hk->ih", keys, q)  # [n, H]: a(i+1:n) (k_i . q)
    else:
        out = torch.einsum("hvk,hk->hv", s_c, dec[0] * q)
        w = torch.einsum("ihk,hk->ih", dec[1:] * keys, q)
    return out + torch.einsum("ih,ihv->hv", w, vals)


def unrolled_fold(
    checkpoint: torch.Tensor, log_alpha: torch.Tensor, vals: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """The flush: S_n from the checkpoint and n records (shapes as ``unrolled_apply``) -> [H, V, K].

    * scalar:      a(1:n) S_c + sum_i a(i+1:n) v_i k_i^T
    * per channel: S_c Diag(a(1:n)) + sum_i v_i (k_i * a(i+1:n))^T
    """
    s_c, vals, keys = f64(checkpoint), f64(vals), f64(keys)
    dec = decays_to_end(log_alpha)
    if dec.dim() == 2:
        return dec[0][:, None, None] * s_c + torch.einsum("ih,ihv,ihk->hvk", dec[1:], vals, keys)
    return s_c * dec[0][:, None, :] + torch.einsum("ihv,ihk->hvk", vals, dec[1:] * keys)


# ---------------------------------------------------------------------------------------------
# Records (stacked per-token inputs of the replay window, oldest first)
# ---------------------------------------------------------------------------------------------


class Records:
    """Base of the per-family record dataclasses. Every field is a tensor whose dim 0 indexes
    records (tokens), oldest first. A single token's record has ``n == 1``.

    ``recs[i]`` (int: kept as n=1), ``recs[a:b]``, ``recs[[i, j]]`` / long or bool tensor select
    records; ``recs.cat(other, ...)`` and ``Cls.stack([r0, r1, ...])`` concatenate.
    """

    def _fields(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @property
    def n(self) -> int:
        return self._fields()[0].shape[0]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx):
        if isinstance(idx, int):
            i = idx + self.n if idx < 0 else idx
            if not 0 <= i < self.n:
                raise IndexError(f"record index {idx} out of range for n={self.n}")
            idx = slice(i, i + 1)
        elif isinstance(idx, (list, tuple)):
            idx = torch.tensor(idx, dtype=torch.long, device=self._fields()[0].device)
        return type(self)(*(t[idx] for t in self._fields()))

    def cat(self, *others: Records) -> Records:
        parts = [self, *others]
        return type(self)(*(torch.cat(ts) for ts in zip(*(p._fields() for p in parts))))

    @classmethod
    def stack(cls, records: Sequence[Records]):
        if not records:
            raise ValueError("records: need at least one record to stack")
        return records[0].cat(*records[1:])


def cat_records(*parts: Records | None) -> Records | None:
    """Concatenate, skipping ``None`` (an empty window is ``None`` throughout the references)."""
    parts = [p for p in parts if p is not None and p.n > 0]
    if not parts:
        return None
    return parts[0].cat(*parts[1:])


# ---------------------------------------------------------------------------------------------
# Draft trees
# ---------------------------------------------------------------------------------------------


def parse_parents(parents, num_drafts: int) -> list[int]:
    """Validate a draft tree: ``parents[j]`` in ``[-1, j)`` (-1 attaches to the committed prefix).

    ``None`` means a chain, ``[-1, 0, 1, ..., T-2]``. Returns a list of ints.
    """
    if parents is None:
        return list(range(-1, num_drafts - 1))
    if isinstance(parents, torch.Tensor):
        if parents.is_floating_point() or parents.dim() != 1:
            raise ValueError(
                f"parents: expected a 1-D integer tensor, got {parents.dtype} "
                f"{tuple(parents.shape)}"
            )
        parents = parents.tolist()
    parents = [int(p) for p in parents]
    if len(parents) != num_drafts:
        raise ValueError(f"parents: expected length {num_drafts}, got {len(parents)}")
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"parents: parents[{j}] must be -1 or in [0, {j}), got {p}")
    return parents


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[T, T] bool, ``mask[j, i]`` = draft i is draft j or one of its ancestors.

    Because ``parents[j] < j``, ``mask[j].nonzero()`` lists j's path root first.
    """
    t = len(parents)
    mask = torch.eye(t, dtype=torch.bool)
    for j, p in enumerate(parents):
        if p >= 0:
            mask[j] |= mask[p]
    return mask


def root_path(parents: list[int], j: int) -> list[int]:
    """Draft indices from the root to draft ``j`` (inclusive), root first."""
    return ancestor_mask(parents)[j].nonzero().flatten().tolist()


# ---------------------------------------------------------------------------------------------
# Pools
# ---------------------------------------------------------------------------------------------


def pool_step(
    state_pool, slot_indices, pad_slot_id, step, batched: dict, out_shape
) -> torch.Tensor:
    """Run a conventional ``step(state [b, ...], **batched_rows) -> (out, new_state)`` on a pool.

    Rows whose slot is ``pad_slot_id`` get a zero output and write nothing; the others read
    ``state_pool[slot]``, and the new state is written back in the pool's dtype. Slots no row names
    are never touched. Returns the float64 output of shape ``out_shape`` (batch first).
    """
    batch = out_shape[0]
    slots = check_slots(slot_indices, state_pool.shape[0], batch, pad_slot_id)
    out = torch.zeros(out_shape, dtype=F64, device=state_pool.device)
    active = [b for b, s in enumerate(slots) if s != pad_slot_id]
    if not active:
        return out
    rows = torch.tensor(active, dtype=torch.long, device=state_pool.device)
    sel = torch.tensor([slots[b] for b in active], dtype=torch.long, device=state_pool.device)
    sub = {k: None if v is None else v[rows.to(v.device)] for k, v in batched.items()}
    o, new_state = step(state_pool[sel], **sub)
    out[rows] = o
    state_pool[sel] = new_state.to(state_pool.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# One sequence's ReplaySSM state, with the default window policy
# ---------------------------------------------------------------------------------------------


class ReplaySequence:
    """Checkpoint S_c (float64) + committed records (n of them), capacity ``L + T``.

    Policy (kernels must match it):

    * ``step``: appends the token's record; if ``n + 1 >= L`` it is a **flush step**: the n held
      records plus the current token are folded into S_c and n becomes 0. The output does not
      depend on whether the step flushes. ``L == 1`` flushes on every step.
    * ``flush()``: folds all held records, n = 0 (a no-op when n == 0).
    * ``verify(parents=None, **drafts)``: t = leading dim of the draft inputs (1 <= t <= T).
      **Early flush** first when ``n + t >= capacity``: the ring would keep no free row, so the
      n held records are folded (never the drafts) and n becomes 0. Without it, a commit leaves
      ``n <= L + T - 1`` and a following ``step`` replays at most ``L + T`` records with its own
      token (docs/speculative.md). Returns the outputs of all t drafts; holds their records
      until ``commit`` or ``drop_pending``.
    * ``commit(accepted)``: an int count a (chain: keep drafts 0..a-1), or for any verify a list
      of draft indices forming a root-to-node path (gather that path's records). n += accepted.
      Rejected records are dropped. No flush happens in commit.
    * ``drop_pending()``: the drafts of a verify whose commit never comes are dropped and
      nothing is committed (what a standard step does first); a no-op without a pending verify.
    * ``step`` and ``flush`` refuse to run while a verify is pending (commit or drop it first).

    Subclasses bind a family through ``_token``, ``_drafts`` and ``_fold``.
    """

    def __init__(self, checkpoint: torch.Tensor, L: int = 16, T: int = 4):
        if L < 1:
            raise ValueError(f"L: expected >= 1, got {L}")
        if T < 1:
            raise ValueError(f"T: expected >= 1, got {T}")
        self.checkpoint = f64(checkpoint, copy=True)
        self.records = None  # committed records, None when n == 0
        self.L, self.T = L, T
        self.last_step_flushed = False
        self._pending = None  # (draft_records, parents, tree) between verify and commit

    # --- family hooks ------------------------------------------------------------------------
    def _token(self, held, **inputs):  # -> (output, record of this token)
        raise NotImplementedError

    def _drafts(self, held, parents, **inputs):  # parents: list; -> (outputs [T, ...], records)
        raise NotImplementedError

    def _fold(self, checkpoint, records):  # -> new checkpoint
        raise NotImplementedError

    # --- policy ------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return 0 if self.records is None else self.records.n

    @property
    def capacity(self) -> int:
        return self.L + self.T

    def _check_no_pending(self, what: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{what}: commit() the pending verify first")

    def step(self, **inputs) -> torch.Tensor:
        self._check_no_pending("step")
        out, rec = self._token(self.records, **inputs)
        self.records = cat_records(self.records, rec)
        self.last_step_flushed = self.records.n >= self.L  # i.e. old n + 1 >= L
        if self.last_step_flushed:
            self.flush()
        return out

    def flush(self) -> None:
        self._check_no_pending("flush")
        if self.records is not None:
            self.checkpoint = self._fold(self.checkpoint, self.records)
            self.records = None

    def verify(self, parents=None, **drafts) -> torch.Tensor:
        self._check_no_pending("verify")
        first = next(v for v in drafts.values() if v is not None)
        t = first.shape[0]
        if not 1 <= t <= self.T:
            raise ValueError(f"drafts: expected 1..{self.T} draft tokens, got {t}")
        plist = parse_parents(parents, t)
        if self.n + t >= self.capacity:  # early flush: no free ring row would be left
            self.flush()
        outs, draft_records = self._drafts(self.records, plist, **drafts)
        self._pending = (draft_records, plist, parents is not None)
        return outs

    def commit(self, accepted) -> None:
        if self._pending is None:
            raise RuntimeError("commit: no pending verify")
        draft_records, plist, tree = self._pending
        t = len(plist)
        if isinstance(accepted, torch.Tensor):
            accepted = accepted.tolist()
        if isinstance(accepted, int):
            if tree:
                raise ValueError("accepted: a tree verify needs the accepted root-to-node path")
            if not 0 <= accepted <= t:
                raise ValueError(f"accepted: expected a count in [0, {t}], got {accepted}")
            path = list(range(accepted))
        else:
            path = [int(i) for i in accepted]
            for pos, i in enumerate(path):
                want = -1 if pos == 0 else path[pos - 1]
                if not 0 <= i < t or plist[i] != want:
                    raise ValueError(f"accepted: {path} is not a root-to-node path of the drafts")
        self._pending = None
        if path:
            self.records = cat_records(self.records, draft_records[path])

    def drop_pending(self) -> None:
        self._pending = None

    def materialize(self) -> torch.Tensor:
        """The current state S_n (float64); for tests only, changes nothing."""
        if self.records is None:
            return self.checkpoint.clone()
        return self._fold(self.checkpoint, self.records)
