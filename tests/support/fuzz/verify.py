"""Speculative entries (docs/speculative.md): mamba2_/gdn_/kda_verify and commit_drafts on a
cache with a history of verifies and commits (the conventional baseline's entries: snapshot.py,
on this module's Spec), each with zero to two arguments replaced by a drawn variant, against the
float64 references. On CUDA the entries keep to the AOT `sanitizer` preset: its head shapes and
flags, L = 4, T = 2 or 4, BF16 activations, replay plans (the preset has no conventional module
with drafts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from replayssm_jit import (
    commit_drafts,
    gdn_verify,
    kda_verify,
    mamba2_verify,
    plan_decode,
)
from replayssm_jit.reference import (
    GDNSequence,
    KDASequence,
    Mamba2Sequence,
    gdn_gates,
    gdn_step,
    kda_gates,
    kda_step,
    mamba2_step,
    root_path,
)

from ..checks import rel_err
from .core import Call, Validity, entry, tensors_identical
from .decode import DTYPES, STATE_DTYPES, tolerance
from .families import ADAPTERS, Adapter
from .values import tensor_variant

F64, I32 = torch.float64, torch.int32
VERIFY = {"mamba2": mamba2_verify, "gdn": gdn_verify, "kda": kda_verify}
INDEX = ("num_drafts", "parents", "num_accepted", "accepted_path", "snapshot_slots")
SLOT_TENSORS = ("state", "rec_x", "rec_b", "rec_dt", "rec_u", "rec_k", "rec_g", "cursors")
NAMES = ("plan", "tensors", "slot_indices", "out", "seed", *INDEX, *SLOT_TENSORS)


@dataclass
class Spec:
    """A CPU cache of one family with drafts T >= 2, its plan, and one reference sequence (with
    its pending verify: t and parents, or None) per live slot."""

    fam: Adapter
    device: str
    shape: dict
    options: dict
    act: torch.dtype
    state_dtype: torch.dtype
    L: int
    T: int
    pad: int
    tensors: dict
    plan: object
    params: dict
    gen: torch.Generator
    live: list[int]
    seqs: dict
    pending: dict
    epochs: dict

    def drafts(self, batch: int) -> dict:
        """Fresh per-row inputs with a draft dim: [batch, T, ...]."""
        tok = self.fam.token(self.gen, batch * self.T, self.shape, self.options, self.act,
                             self.device)  # fmt: skip
        return {k: v.view(batch, self.T, *v.shape[1:]) for k, v in tok.items()}

    def ix(self, values) -> torch.Tensor:
        """An int32 index tensor of `values` on the entry's device."""
        return torch.tensor(values, dtype=I32, device=self.device)

    @property
    def other_device(self) -> str:
        return "meta" if self.device == "cpu" else "cpu"

    @property
    def ref_params(self) -> dict:
        return {k: v.cpu() for k, v in self.params.items()}

    def ref_inputs(self, args: dict, index) -> dict:
        """The reference's inputs of rows / drafts `index` from the call's arguments."""
        a = {k: v.detach().cpu() for k, v in args.items() if isinstance(v, torch.Tensor)}
        if self.fam.name == "mamba2":
            z = a.get("z")
            return dict(x=a["x"][index], dt=a["dt"][index], B=a["B"][index], C=a["C"][index],
                        z=None if z is None else z[index])  # fmt: skip
        if "a" in a:
            gates = kda_gates if self.fam.per_channel else gdn_gates
            g, beta = gates(a["A_log"], a["a"][index], a["dt_bias"], a["b"][index])
        else:
            g, beta = a["g"][index], a["beta"][index]
        return dict(q=a["q"][index], k=a["k"][index], v=a["v"][index], g=g, beta=beta)

    def sequence(self, checkpoint: torch.Tensor):
        p, o = self.ref_params, self.options
        if self.fam.name == "mamba2":
            return Mamba2Sequence(checkpoint, p["A"], p.get("D"), p.get("dt_bias"),
                                  o.get("dt_softplus", True), L=self.L, T=self.T)  # fmt: skip
        l2norm = o.get("use_qk_l2norm", True)
        cls = KDASequence if self.fam.per_channel else GDNSequence
        return cls(checkpoint, scale=o.get("scale"), use_qk_l2norm=l2norm, L=self.L, T=self.T)

    def conv(self, state: torch.Tensor, inputs: dict):
        """One float64 conventional step of one row: (output, new state)."""
        p, o = self.ref_params, self.options
        one = {k: None if v is None else v[None] for k, v in inputs.items()}
        if self.fam.name == "mamba2":
            y, s = mamba2_step(state[None], one["x"], one["dt"], p["A"], one["B"], one["C"],
                               p.get("D"), one["z"], p.get("dt_bias"),
                               o.get("dt_softplus", True))  # fmt: skip
        else:
            step = kda_step if self.fam.per_channel else gdn_step
            y, s = step(state[None], one["q"], one["k"], one["v"], one["g"], one["beta"],
                        o.get("scale"), o.get("use_qk_l2norm", True))  # fmt: skip
        return y[0], s[0]


def draw_spec(draw, device: str, *, snapshot: bool = False) -> Spec:
    fam = ADAPTERS[draw(st.sampled_from(sorted(ADAPTERS)))]
    shape = draw(st.sampled_from(fam.shapes[device]))
    if device == "cuda":  # the sanitizer preset's speculative specs: L = 4, T = 2 and 4
        L, T = 4, draw(st.sampled_from([2, 4]))
    else:
        L, T = draw(st.sampled_from([1, 2, 4])), draw(st.integers(2, 4))
    act, state_dtype = draw(st.sampled_from(DTYPES[device])), draw(st.sampled_from(STATE_DTYPES))
    options = fam.draw_options(draw, device, state_dtype)
    pad = draw(st.sampled_from([-1, 0]))
    nlive = draw(st.integers(1, 3))
    num_slots = 1 + nlive + (nlive * T + 1 if snapshot else 2)
    layout = fam.cache_cls.make_layout(**shape, window=L, drafts=T, state_dtype=state_dtype,
                                       act_dtype=act)  # fmt: skip
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    tensors = layout.allocate(num_slots, device)
    tensors["state"].copy_(0.3 * torch.randn(tensors["state"].shape, generator=gen))
    for name in layout.ring_names:  # a read of a row no record was written to shows NaN
        tensors[name].fill_(float("nan"))
    epoch0 = torch.randint(-(2**31), 2**31, (num_slots,), generator=gen)
    tensors["cursors"][:, 1] = epoch0.to(device=device, dtype=I32)
    # (on CUDA a conventional plan of a T-draft layout would load a module the preset lacks)
    modes = ["replay", "conventional"] if snapshot and device == "cpu" else ["replay"]
    mode = draw(st.sampled_from(modes))
    batch = nlive + draw(st.integers(0, 1))
    plan = plan_decode(layout, batch, device=device, mode=mode, pad_slot_id=pad, **options)
    live = draw(st.permutations([s for s in range(num_slots) if s != pad]))[:nlive]
    params = fam.params(gen, shape, options, device)
    epochs = {s: int(tensors["cursors"][s, 1]) for s in live}
    sc = Spec(fam, device, shape, options, act, state_dtype, L, T, pad, tensors, plan, params,
              gen, live, {}, dict.fromkeys(live), epochs)  # fmt: skip
    sc.seqs = {s: sc.sequence(tensors["state"][s].cpu().to(F64)) for s in live}
    return sc


def draw_rows(draw, sc: Spec) -> list[int]:
    rows = list(sc.live) + [sc.pad] * (sc.plan.batch_size - len(sc.live))
    return [rows[i] for i in draw(st.permutations(range(len(rows))))]


def _wrap(epoch: int) -> int:
    return (epoch + 2**31) % 2**32 - 2**31


def _chain_prefix(pending) -> int:
    t, plist = pending
    a = 0
    while a < t and (plist is None or plist[a] == a - 1):
        a += 1
    return a


# --- verify and commit ------------------------------------------------------------------------


def _verify_args(draw, sc: Spec, rows: list[int], *, trees: bool) -> dict:
    """Valid verify arguments; a fused commit only where every pending verify is a chain."""
    T, batch = sc.T, len(rows)
    args = {**sc.drafts(batch), **sc.params, "slot_indices": sc.ix(rows)}
    if draw(st.booleans()):
        args["num_drafts"] = sc.ix([draw(st.integers(0, T)) for _ in rows])
    if trees and draw(st.booleans()):
        args["parents"] = sc.ix([[draw(st.integers(-1, j - 1)) for j in range(T)] for _ in rows])
    if draw(st.booleans()):
        fused = [draw(st.integers(0, _chain_prefix(sc.pending[s]))) if sc.pending.get(s) else 0
                 for s in rows]  # fmt: skip
        args["num_accepted"] = sc.ix(fused)
    return args


def _commit_args(draw, sc: Spec, rows: list[int]) -> dict:
    paths = []
    for s in rows:
        p = sc.pending.get(s)
        if not p:
            paths.append([])
        elif p[1] is None:
            paths.append(list(range(draw(st.integers(0, p[0])))))
        else:
            node = draw(st.integers(-1, p[0] - 1))
            paths.append([] if node < 0 else root_path(p[1], node))
    args = {"num_accepted": sc.ix([len(p) for p in paths]), "slot_indices": sc.ix(rows)}
    if any(sc.pending.get(s) and sc.pending[s][1] for s in rows) or draw(st.booleans()):
        fill = draw(st.integers(0, sc.T - 1))  # (entries past a are never read)
        args["accepted_path"] = sc.ix([p + [fill] * (sc.T - len(p)) for p in paths])
    return args


def _check_verify(sc: Spec, args: dict, before: dict, out) -> None:
    """A successful verify against the reference sequences and the cursor rule; the references
    then follow it."""
    T, rows = sc.T, args["slot_indices"].tolist()
    assert isinstance(out, torch.Tensor) and out.dtype == sc.act
    assert out.shape == (len(rows), T, *before["state"].shape[1:3])
    assert out.device.type == sc.device
    out = out.cpu()
    tol = tolerance(sc.act, sc.state_dtype)
    nd, par, acc = (args.get(k) for k in ("num_drafts", "parents", "num_accepted"))
    got, want = [], []
    for b, s in enumerate(rows):
        if s == sc.pad:
            assert bool((out[b] == 0).all()), "pad row not zero"
            continue
        seq, t = sc.seqs[s], T if nd is None else int(nd[b])
        if acc is not None and sc.pending[s]:
            seq.commit(list(range(int(acc[b]))))
        else:
            seq.drop_pending()
        flush = seq.n + t >= sc.L + T
        plist = None if par is None else par[b, :t].tolist()
        if t:
            want.append(seq.verify(parents=plist, **sc.ref_inputs(args, (b, slice(0, t)))))
            got.append(out[b, :t])
        assert bool((out[b, t:] == 0).all()), f"row {b}: drafts past t = {t} not zero"
        sc.pending[s] = (t, plist) if t else None
        sc.epochs[s] = _wrap(sc.epochs[s] + int(flush))
        assert sc.tensors["cursors"][s].tolist() == [seq.n, sc.epochs[s], 0, t], f"slot {s}"
        if flush:
            err = rel_err(sc.tensors["state"][s], seq.checkpoint)
            assert err <= tol, f"slot {s}: checkpoint relative error {err:.2e} after a flush"
            seq.checkpoint = (
                sc.tensors["state"][s].cpu().to(F64)
            )  # (the stored rounding, from here)
        else:
            assert tensors_identical(sc.tensors["state"][s], before["state"][s]), f"state {s}"
    if got:
        err = rel_err(torch.cat([g.reshape(-1) for g in got]),
                      torch.cat([w.reshape(-1) for w in want]))  # fmt: skip
        assert err <= tol, f"draft outputs: relative error {err:.2e} > {tol:.0e}"
    _check_unnamed(sc, before, rows)


def _check_commit(sc: Spec, args: dict, before: dict) -> None:
    rows = args["slot_indices"].tolist()
    acc, path = args["num_accepted"], args.get("accepted_path")
    for b, s in enumerate(rows):
        if s == sc.pad:
            continue
        seq, a, n = sc.seqs[s], int(acc[b]), sc.seqs[s].n
        accepted = list(range(a)) if path is None else path[b, :a].tolist()
        if sc.pending[s]:
            seq.commit(accepted)
        sc.pending[s] = None
        assert sc.tensors["cursors"][s].tolist() == [seq.n, sc.epochs[s], 0, 0], f"slot {s}"
        for name in sc.plan.layout.ring_names:
            ring, old = sc.tensors[name][s], before[name][s]
            for i, j in enumerate(accepted):
                assert tensors_identical(ring[:, n + i], old[:, n + j]), f"{name} row {n + i}"
        assert tensors_identical(sc.tensors["state"][s], before["state"][s]), f"state {s}"
    _check_unnamed(sc, before, rows)


def _check_unnamed(sc: Spec, before: dict, rows: list[int]) -> None:
    for s in range(before["state"].shape[0]):
        if s in rows and s != sc.pad:
            continue
        for name, t in sc.tensors.items():
            assert tensors_identical(t[s], before[name][s]), f"{name} of unnamed slot {s}"


def draw_history(draw, sc: Spec, *, leave_pending: bool) -> None:
    """Valid verifies (trees committed at once, chains now and then left pending) and commits;
    with `leave_pending`, the last is a verify whose drafts stay pending."""
    steps = draw(st.integers(0, 3))
    for i in range(steps + int(leave_pending)):
        last = i == steps
        rows = draw_rows(draw, sc)
        trees = last and leave_pending
        args = _verify_args(draw, sc, rows, trees=trees)
        before = {k: t.clone() for k, t in sc.tensors.items()}
        out = VERIFY[sc.fam.name](sc.plan, **sc.tensors, **args)
        _check_verify(sc, args, before, out)
        if not last and draw(st.booleans()):
            cargs = _commit_args(draw, sc, rows)
            before = {k: t.clone() for k, t in sc.tensors.items()}
            commit_drafts(sc.plan, sc.tensors, **cargs)
            _check_commit(sc, cargs, before)


def index_variant(draw, args: dict, name: str, v: Validity, *, required: bool) -> None:
    t = args.get(name)
    kind = draw(st.sampled_from(["none", "dtype", "shape", "strided", "list"]))
    if t is None and kind != "none":
        return
    if kind == "none":
        args[name] = None
        v.mark(not required, f"{name} None")
    elif kind == "dtype":
        args[name] = t.to(draw(st.sampled_from([torch.int64, torch.int16, torch.float32])))
        v.mark(False, f"{name} dtype")
    elif kind == "shape":
        args[name] = torch.cat([t, t[:1]])
        v.mark(False, f"{name} shape")
    elif kind == "strided":
        wide = torch.stack([t, t], dim=-1)[..., 0]
        args[name] = wide
        v.mark(wide.is_contiguous(), f"{name} strided")
    else:
        args[name] = t.tolist()
        v.mark(False, f"{name} as a list")


def editable(t: object) -> bool:
    """An index argument a value variant may edit: absent, or an int32 tensor of its shape."""
    return t is None or (isinstance(t, torch.Tensor) and t.dtype == I32 and t.is_contiguous())


def _or(t: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if t is None else t


def _value_variant(draw, sc: Spec, args: dict, v: Validity) -> None:
    """A device value the eager checks refuse, in a live row that reads it."""
    rows, T = args["slot_indices"].tolist(), sc.T
    live = [b for b, s in enumerate(rows) if s != sc.pad]
    kind = draw(st.sampled_from(["num_drafts", "parents", "num_accepted"]))
    if not all(editable(args.get(k)) for k in ("num_drafts", "parents", "num_accepted")):
        return  # (another variant already replaced one of them)
    b = draw(st.sampled_from(live))
    if kind == "num_drafts":
        nd = _or(args.get("num_drafts"), sc.ix([T] * len(rows))).clone()
        nd[b] = draw(st.sampled_from([T + 1, -1, 2**31 - 1]))
        args["num_drafts"] = nd
        v.mark(False, f"num_drafts {int(nd[b])}")
    elif kind == "parents":
        t = T if args.get("num_drafts") is None else int(args["num_drafts"][b])
        if t == 0:
            return
        par = _or(args.get("parents"), sc.ix([list(range(-1, T - 1))] * len(rows)))
        par = par.to(I32)
        j = draw(st.integers(0, t - 1))
        par[b, j] = draw(st.sampled_from([j, j + 1, -2]))
        args["parents"] = par
        v.mark(False, f"parents[{b}, {j}] = {int(par[b, j])}")
    else:
        p = sc.pending.get(rows[b])
        acc = _or(args.get("num_accepted"), sc.ix([0] * len(rows))).clone()
        acc[b] = draw(st.sampled_from([(p[0] if p else 0) + 1, -1]))
        args["num_accepted"] = acc
        v.mark(False, f"num_accepted {int(acc[b])} with {p[0] if p else 0} pending")


def common_variant(draw, sc: Spec, args: dict, v: Validity, kind: str, *, any_mode: bool) -> object:
    """Variants every speculative op shares; returns a replacement plan or None. any_mode:
    the op takes plans of either mode."""
    if kind == "input":
        name = draw(st.sampled_from(sorted(n for n, (per_row, _) in sc.fam.inputs.items()
                                           if per_row and n in args)))  # fmt: skip
        _, req = sc.fam.inputs[name]
        t, ok, label = tensor_variant(draw, args[name], req, other_device=sc.other_device)
        args[name] = t
        v.mark(ok, f"{name} {label}")
    elif kind == "drafts_dim":
        name = draw(st.sampled_from(sorted(n for n in ("x", "q", "dt", "a", "g") if n in args)))
        t = args[name]
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            return None  # (an input variant replaced it)
        args[name] = torch.cat([t, t[:, :1]], dim=1)
        v.mark(False, f"{name} with {sc.T + 1} drafts")
    elif kind == "slots":
        ids = args["slot_indices"].tolist()
        live = [b for b, s in enumerate(ids) if s != sc.pad]
        if len(ids) >= 2 and draw(st.booleans()):
            i = draw(st.sampled_from(live))
            j = next(k for k in range(len(ids)) if k != i)
            ids[j] = ids[i]
            v.mark(False, f"slot {ids[i]} twice")
        else:
            ids[draw(st.sampled_from(live))] = sc.tensors["state"].shape[0]
            v.mark(False, "slot id out of range")
        args["slot_indices"] = sc.ix(ids)
    elif kind == "out":
        out_shape = (len(args["slot_indices"]), sc.T, *sc.tensors["state"].shape[1:3])
        wrong = draw(st.sampled_from(["ok", "shape", "dtype"]))
        shape = out_shape if wrong != "shape" else out_shape[:1] + out_shape[2:]
        dtype = sc.act if wrong != "dtype" else torch.float64
        args["out"] = torch.full(shape, float("nan"), dtype=dtype, device=sc.device)
        v.mark(wrong == "ok", f"out {wrong}")
    elif kind == "plan":
        layout = sc.plan.layout
        # (on CUDA the other mode's module, L = 1 with drafts, is not in the preset)
        if sc.device == "cuda" or draw(st.booleans()):
            v.mark(False, "a T = 1 plan")
            one = sc.fam.cache_cls.make_layout(
                **sc.shape, window=sc.L, drafts=1, state_dtype=sc.state_dtype, act_dtype=sc.act
            )
            return plan_decode(one, sc.plan.batch_size, device=sc.device, pad_slot_id=sc.pad,
                               **sc.options)  # fmt: skip
        other = "conventional" if sc.plan.mode == "replay" else "replay"
        v.mark(any_mode, f"a {other} plan")
        return plan_decode(layout, sc.plan.batch_size, device=sc.device, mode=other,
                           pad_slot_id=sc.pad, **sc.options)  # fmt: skip
    return None


def draw_variants(draw, v: Validity, kinds: list[str]) -> list[str]:
    count = draw(st.sampled_from([0, 1, 1, 2]))
    return list(dict.fromkeys(draw(st.sampled_from(kinds)) for _ in range(count)))


def _mark_chain_commit_of_trees(sc: Spec, args: dict, v: Validity) -> None:
    """A commit without accepted_path accepts drafts 0..a-1: past the chain a pending tree
    starts with, that is not a path of it (the op knows the tree from its verify)."""
    acc, ids = args.get("num_accepted"), args["slot_indices"]
    tensors = all(isinstance(t, torch.Tensor) and editable(t) for t in (acc, ids))
    if not tensors or acc.shape != ids.shape:
        return  # (the call is refused for these already)
    for b, s in enumerate(ids.tolist()):
        p = sc.pending.get(s) if s != sc.pad else None
        if p and p[1] is not None and int(acc[b]) > _chain_prefix(p):
            v.mark(
                False,
                f"a chain commit of {int(acc[b])} past the tree's chain of {_chain_prefix(p)}",
            )


@entry("verify.op", covers=("mamba2_verify", "gdn_verify", "kda_verify", "commit_drafts"),
       weight=0.5)  # fmt: skip
def build_verify(draw, device):
    sc = draw_spec(draw, device)
    target = draw(st.sampled_from(["verify", "commit"]))
    draw_history(draw, sc, leave_pending=target == "commit")
    rows, v = draw_rows(draw, sc), Validity()
    if target == "verify":
        args = _verify_args(draw, sc, rows, trees=True)
        kinds = ["value", "num_drafts", "parents", "num_accepted", "input", "drafts_dim", "slots",
                 "out", "plan"]  # fmt: skip
    else:
        args = _commit_args(draw, sc, rows)
        kinds = ["num_accepted", "accepted_path", "commit_value", "slots", "plan"]
    plan = sc.plan
    # Device values last: an index variant drawn after one (None, say) would undo its bad value.
    for kind in sorted(draw_variants(draw, v, kinds), key=lambda k: k in ("value", "commit_value")):
        if kind == "value":
            _value_variant(draw, sc, args, v)
        elif kind in INDEX:
            index_variant(draw, args, kind, v, required=target == "commit" and
                           kind == "num_accepted")  # fmt: skip
        elif kind == "commit_value":
            if not (editable(args.get("num_accepted")) and editable(args.get("accepted_path"))):
                continue
            if args.get("num_accepted") is None:
                continue
            ids = args["slot_indices"].tolist()
            b = draw(st.sampled_from([b for b, s in enumerate(ids) if s != sc.pad]))
            p = sc.pending.get(ids[b])
            if p and p[0] >= 2 and draw(st.booleans()):
                acc, path = args["num_accepted"].clone(), sc.ix([[0] * sc.T] * len(ids))
                acc[b] = 2
                path[b, :2] = sc.ix(draw(st.sampled_from([[1, 1], [1, 0], [0, p[0]]])))
                args["num_accepted"], args["accepted_path"] = acc, path
                v.mark(False, f"path {path[b, :2].tolist()} of {p[0]} pending")
            else:
                acc = args["num_accepted"].clone()
                acc[b] = (p[0] if p else 0) + 1
                args["num_accepted"] = acc
                v.mark(False, f"num_accepted {int(acc[b])} above the pending drafts")
        else:
            plan = common_variant(draw, sc, args, v, kind, any_mode=False) or plan
    if target == "commit" and args.get("accepted_path") is None:
        _mark_chain_commit_of_trees(sc, args, v)
    before = {k: t.clone() for k, t in sc.tensors.items()}
    watched = {f"arg.{k}": a for k, a in args.items() if isinstance(a, torch.Tensor)}

    def run():
        if target == "verify":
            return VERIFY[sc.fam.name](plan, **sc.tensors, **args)
        return commit_drafts(plan, sc.tensors, **args)

    def check(result):
        if target == "verify":
            _check_verify(sc, args, before, result)
        else:
            _check_commit(sc, args, before)

    return Call(run, NAMES + tuple(sc.fam.inputs), watch=lambda: {**sc.tensors, **watched},
                check=check, valid=v.valid, why=v.why)  # fmt: skip
