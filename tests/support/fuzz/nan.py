"""NaN / Inf decode inputs: a fault stays in its own batch row, and out of every other slot."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from .core import Call, entry, tensors_identical
from .decode import OP_ARGS, draw_scenario

PER_HEAD = ("A", "D", "dt_bias", "A_log")


@entry(
    "decode.nan", covers=("mamba2_decode", "gdn_decode", "Mamba2DecodeWrapper", "GDNDecodeWrapper")
)
def build_nan(draw, device):
    """The next step twice, on the cache and on a bit-identical twin of its tensors (through
    the op), with NaN / Inf in one place of the first: a row's input, a named slot's checkpoint
    or held records, an unnamed slot's tensors, or a per-head parameter. Other rows' outputs
    and other slots' tensors must come out bit-identical to the twin's (a per-head parameter
    reaches every row: then only the unnamed slots), and every cursor too (a value never
    changes a flush decision)."""
    sc = draw_scenario(draw, device)
    sc.fam_value_heads = sc.cache.layout.shape.value_heads
    sc.fam_value_dim = sc.cache.layout.shape.value_dim
    slots = sc.draw_slots(draw)
    args = {**sc.token(), "slot_indices": slots}
    ids = slots.tolist()
    real_rows = [r for r, s in enumerate(ids) if s != sc.pad]
    named = {ids[r] for r in real_rows}
    unnamed = [s for s in range(sc.cache.num_slots) if s not in named]
    twin = {k: t.clone() for k, t in sc.cache.tensors.items()}
    value = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    params = sorted(n for n in PER_HEAD if n in args)
    wheres = [*(["row", "row", "slot"] if real_rows else []), *(["unnamed"] if unnamed else []),
              *(["param"] if params else [])]  # fmt: skip
    where = draw(st.sampled_from(wheres))
    faulted_row, faulted_slot = None, None
    if where == "row":
        faulted_row = draw(st.sampled_from(real_rows))
        name = draw(st.sampled_from(sorted(n for n, (per_row, _) in sc.fam.inputs.items()
                                           if per_row and n in args)))  # fmt: skip
        t = args[name].clone()
        flat = t[faulted_row].reshape(-1)
        flat[draw(st.integers(0, flat.numel() - 1))] = value
        args[name] = t
        faulted_slot = ids[faulted_row]
    elif where in ("slot", "unnamed"):
        faulted_slot = draw(st.sampled_from(sorted(named) if where == "slot" else unnamed))
        if where == "slot":
            faulted_row = ids.index(faulted_slot)
        held = int(sc.cache.cursors[faulted_slot, 0])
        choices = ["state"] + ([r for r in sc.cache.layout.ring_names] if held else [])
        name = draw(st.sampled_from(choices))
        t = sc.cache.tensors[name]
        block = t[faulted_slot] if name == "state" else t[faulted_slot][:, :held]
        flat = block.reshape(-1)
        i = draw(st.integers(0, flat.numel() - 1))
        with torch.no_grad():
            idx = torch.unravel_index(torch.tensor(i), block.shape)
            block[tuple(int(j) for j in idx)] = value
    else:
        name = draw(st.sampled_from(params))
        t = args[name].clone()
        t[draw(st.integers(0, t.numel() - 1))] = value
        args[name] = t
    clean_args = {k: (a.clone() if isinstance(a, torch.Tensor) else a) for k, a in args.items()}
    if where == "row" or where == "param":
        clean_args[name] = _finite_like(clean_args[name])
    before = {k: t.clone() for k, t in sc.cache.tensors.items()}

    def run():
        clean = sc.fam.op(sc.plan, **twin, **clean_args)
        dirty = sc.call(args)
        return clean, dirty

    def check(result):
        clean, dirty = (r.detach().cpu() for r in result)
        rows = [r for r in range(sc.batch) if r != faulted_row] if where != "param" else [
            r for r, s in enumerate(ids) if s == sc.pad]  # fmt: skip
        for r in rows:
            assert tensors_identical(dirty[r], clean[r]), f"row {r} differs ({where} {name})"
        keep = [s for s in range(sc.cache.num_slots) if s != faulted_slot]
        if where == "param":
            keep = unnamed
        for k, t in sc.cache.tensors.items():
            got, want = t.detach().cpu(), twin[k].detach().cpu()
            if k == "cursors":  # (the faulted slot's too: a value decides no flush)
                assert tensors_identical(got, want), "cursors differ"
            assert tensors_identical(got[keep], want[keep]), f"{k} of other slots differs"
        if where == "unnamed":
            assert tensors_identical(sc.cache.tensors[name][faulted_slot].cpu(),
                                     before[name][faulted_slot].cpu()), "unnamed slot written"  # fmt: skip

    def watch():
        return dict(sc.cache.tensors)

    return Call(run, (*OP_ARGS, *sc.fam.inputs), watch=watch, check=check, valid=None,
                why=f"{value} in {where} {name}")  # fmt: skip


def _finite_like(t: torch.Tensor) -> torch.Tensor:
    """`t` with its non-finite entries replaced by 0.5 (the clean twin's inputs)."""
    return torch.where(torch.isfinite(t), t, torch.full_like(t, 0.5))
