"""The conventional baseline's entries (mamba2_/gdn_/kda_snapshot_verify, commit_snapshots) on
verify.py's Spec and draws: a snapshot per draft into spare slots, then the chosen snapshot's
commit, against the float64 references."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from replayssm_jit import (
    commit_snapshots,
    gdn_snapshot_verify,
    kda_snapshot_verify,
    mamba2_snapshot_verify,
)

from ..checks import rel_err
from .core import Call, Validity, entry, tensors_identical
from .decode import tolerance
from .verify import (
    F64,
    INDEX,
    NAMES,
    Spec,
    common_variant,
    draw_rows,
    draw_spec,
    draw_variants,
    editable,
    index_variant,
)

SNAPSHOT = {
    "mamba2": mamba2_snapshot_verify,
    "gdn": gdn_snapshot_verify,
    "kda": kda_snapshot_verify,
}


def _snapshot_slots(draw, sc: Spec, rows: list[int]) -> torch.Tensor:
    spare = draw(st.permutations([s for s in range(sc.tensors["state"].shape[0])
                                  if s not in sc.live and s != sc.pad]))  # fmt: skip
    it = iter(spare)
    return sc.ix([[next(it) if s != sc.pad else sc.pad for _ in range(sc.T)] for s in rows])


def _check_snapshot(sc: Spec, args: dict, before: dict, out) -> None:
    T, rows, snaps = sc.T, args["slot_indices"].tolist(), args["snapshot_slots"].cpu()
    assert isinstance(out, torch.Tensor) and out.dtype == sc.act
    assert out.device.type == sc.device
    out = out.cpu()
    tol = tolerance(sc.act, sc.state_dtype)
    nd = args.get("num_drafts")
    written = set()
    for b, s in enumerate(rows):
        if s == sc.pad:
            assert bool((out[b] == 0).all()), "pad row not zero"
            continue
        t, state = T if nd is None else int(nd[b]), before["state"][s].cpu().to(F64)
        for j in range(t):
            y, state = sc.conv(state, sc.ref_inputs(args, (b, j)))
            assert rel_err(out[b, j], y) <= tol, f"row {b} draft {j}"
            snap = int(snaps[b, j])
            assert rel_err(sc.tensors["state"][snap], state) <= tol, f"snapshot {snap}"
            written.add(snap)
        assert bool((out[b, t:] == 0).all()), f"row {b}: drafts past t = {t} not zero"
    for s in range(before["state"].shape[0]):
        if s not in written:
            for name, t in sc.tensors.items():
                assert tensors_identical(t[s], before[name][s]), f"{name} of slot {s}"


def _check_commit_snapshots(sc: Spec, args: dict, before: dict) -> None:
    rows, snaps, acc = args["slot_indices"].tolist(), args["snapshot_slots"], args["num_accepted"]
    copied = {}
    for b, s in enumerate(rows):
        if s != sc.pad and int(acc[b]) > 0:
            copied[s] = int(snaps[b, int(acc[b]) - 1])
    state = sc.tensors["state"]
    for s in range(state.shape[0]):
        want = before["state"][copied.get(s, s)]
        assert tensors_identical(state[s], want), f"state of slot {s}"
    for name, t in sc.tensors.items():
        if name != "state":
            assert tensors_identical(t, before[name]), name


@entry("snapshot.op", covers=("mamba2_snapshot_verify", "gdn_snapshot_verify",
                             "kda_snapshot_verify", "commit_snapshots"), weight=0.5)  # fmt: skip
def build_snapshot(draw, device):
    sc = draw_spec(draw, device, snapshot=True)
    target = draw(st.sampled_from(["snapshot", "commit"]))
    rows, v = draw_rows(draw, sc), Validity()
    snaps = _snapshot_slots(draw, sc, rows)
    if target == "snapshot":
        args = {**sc.drafts(len(rows)), **sc.params, "slot_indices": sc.ix(rows),
                "snapshot_slots": snaps}  # fmt: skip
        if draw(st.booleans()):
            args["num_drafts"] = sc.ix([draw(st.integers(0, sc.T)) for _ in rows])
        kinds = ["snapshot_value", "snapshot_slots", "num_drafts", "input", "drafts_dim",
                 "slots", "out", "plan"]  # fmt: skip
    else:
        acc = sc.ix([draw(st.integers(0, sc.T)) for _ in rows])
        args = {"state": sc.tensors["state"], "snapshot_slots": snaps, "num_accepted": acc,
                "slot_indices": sc.ix(rows)}  # fmt: skip
        kinds = ["snapshot_value", "snapshot_slots", "num_accepted", "slots"]
    plan = sc.plan
    for kind in sorted(draw_variants(draw, v, kinds), key=lambda k: k == "snapshot_value"):
        if kind == "snapshot_value":
            if not all(editable(args.get(k)) for k in ("snapshot_slots", "num_drafts",
                                                        "num_accepted")):  # fmt: skip
                continue
            if args.get("snapshot_slots") is None or (
                target == "commit" and args.get("num_accepted") is None
            ):
                continue
            ids = args["slot_indices"].tolist()
            b = draw(st.sampled_from([b for b, s in enumerate(ids) if s != sc.pad]))
            s2 = args["snapshot_slots"].clone()
            if target == "snapshot":
                t = sc.T if args.get("num_drafts") is None else int(args["num_drafts"][b])
                j = t - 1
            else:
                j = int(args["num_accepted"][b]) - 1
            if j < 0:
                continue
            bad = draw(st.sampled_from(["live", "range", "pad", "twice"]))
            others = [int(x) for x in s2[b, :j]] if target == "snapshot" else []
            value = {"live": sc.live[0], "range": sc.tensors["state"].shape[0], "pad": sc.pad,
                     "twice": others[0] if others else sc.live[0]}[bad]  # fmt: skip
            s2[b, j] = value
            args["snapshot_slots"] = s2
            v.mark(False, f"snapshot_slots[{b}, {j}] = {value} ({bad})")
        elif kind in INDEX:
            index_variant(draw, args, kind, v, required=kind != "num_drafts")
        else:
            plan = common_variant(draw, sc, args, v, kind, any_mode=True) or plan
    before = {k: t.clone() for k, t in sc.tensors.items()}
    watched = {f"arg.{k}": a for k, a in args.items() if isinstance(a, torch.Tensor)}

    def run():
        if target == "snapshot":
            state = {"state": sc.tensors["state"]}
            return SNAPSHOT[sc.fam.name](plan, **state, **args)
        return commit_snapshots(plan, **args)

    def check(result):
        if target == "snapshot":
            _check_snapshot(sc, args, before, result)
        else:
            _check_commit_snapshots(sc, args, before)

    return Call(run, NAMES + tuple(sc.fam.inputs), watch=lambda: {**sc.tensors, **watched},
                check=check, valid=v.valid, why=v.why)  # fmt: skip
