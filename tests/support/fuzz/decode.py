"""Decode entries: wrapper.run() and the functional ops (mamba2_decode / gdn_decode) on a
cache with a history, with zero to two arguments replaced by a drawn variant, against the
float64 reference (NaN / Inf inputs: nan.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from replayssm_jit import LaunchConfig, SlotCache
from replayssm_jit.families.spec import spec_tilings

from ..checks import rel_err
from .core import Call, Validity, entry, snapshot, tensors_identical
from .families import ADAPTERS, Adapter, adapters_on
from .values import INT32_MAX, slot_tensor_variant, tensor_variant

DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SLOT_TENSORS = ("state", "rec_x", "rec_b", "rec_dt", "rec_u", "rec_k", "rec_g", "cursors")
OP_ARGS = ("plan", "slot_indices", "out", "workspace", "seed", *SLOT_TENSORS)
# Python's own argument binding errors name the argument too.
DEFAULT = object()  # (the scenario's own plan)
BINDING = re.compile(r"got (an unexpected keyword argument|multiple values for keyword argument) '")


def tolerance(act: torch.dtype, state: torch.dtype) -> float:
    """Relative error allowed against the float64 reference: FP32 rounding, plus one rounding of
    each 16-bit output and each 16-bit checkpoint write (a few steps' worth)."""
    tol = 2e-5
    tol += {torch.float32: 0.0, torch.bfloat16: 1e-2, torch.float16: 2e-3}[act]
    tol += {torch.float32: 0.0, torch.bfloat16: 4e-2, torch.float16: 6e-3}[state]
    return tol


@dataclass
class Scenario:
    """A cache of one family on one device with a wrapper planned over it, a history of valid
    steps behind it, and the float64 reference pool beside it."""

    fam: Adapter
    device: str
    shape: dict
    act: torch.dtype
    state_dtype: torch.dtype
    mode: str
    options: dict
    route: str  # "wrapper" (wrapper.run) or "op" (the functional op on the cache's tensors)
    cache: SlotCache
    wrapper: object
    params: dict
    gen: torch.Generator
    ref_pool: torch.Tensor
    steps: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def plan(self):
        return self.wrapper.decode_plan

    @property
    def batch(self) -> int:
        return self.plan.batch_size

    @property
    def pad(self) -> int:
        return self.cache.pad_slot_id

    @property
    def replay(self) -> bool:
        return self.mode == "replay"

    def real_slots(self) -> list[int]:
        return [s for s in range(self.cache.num_slots) if s != self.pad]

    def draw_slots(self, draw) -> torch.Tensor:
        """Distinct real slots and pad rows, in a drawn order."""
        real = self.real_slots()
        least_pads = max(0, self.batch - len(real))
        pads = draw(st.integers(least_pads, max(least_pads, min(self.batch, 2))))
        chosen = draw(st.permutations(real))[: self.batch - pads] + [self.pad] * pads
        order = draw(st.permutations(range(self.batch)))
        ids = [chosen[i] for i in order]
        return torch.tensor(ids, dtype=torch.int32, device=self.device)

    def token(self) -> dict:
        tok = self.fam.token(self.gen, self.batch, self.shape, self.options, self.act, self.device)
        return {**tok, **self.params}

    def call(self, args: dict, *, tensors: dict | None = None, plan=DEFAULT, kwargs=None):
        """One step through the drawn route; `args` holds the inputs by name, slot_indices, and
        out, workspace and seed where given."""
        kwargs = dict(kwargs or {})
        if self.route == "op":
            pool = self.cache.tensors if tensors is None else tensors
            return self.fam.op(self.plan if plan is DEFAULT else plan, **pool, **args, **kwargs)
        a = dict(args)
        positional = [a.pop(n) for n in (*self.fam.positional, "slot_indices")]
        return self.wrapper.run(*positional, **a, **kwargs)

    def step(self, slots: torch.Tensor, args: dict) -> torch.Tensor:
        """A valid step, mirrored on the reference pool."""
        out = self.call({**args, "slot_indices": slots})
        self.fam.reference(self.ref_pool, slots.long().cpu(), args, self.options, self.pad)
        self.steps += 1
        return out


def draw_scenario(draw, device: str, *, route: str | None = None) -> Scenario:
    fam = ADAPTERS[draw(st.sampled_from(adapters_on(device)))]
    shape = draw(st.sampled_from(fam.shapes[device]))
    if device == "cuda":  # the sanitizer preset: L = 4 (replay) or 1 (conventional), T = 1
        window, drafts = 4, 1
    else:
        window = draw(st.sampled_from([1, 2, 3, 4, 5, 8]))
        drafts = draw(st.integers(1, 3))
    act = draw(st.sampled_from(DTYPES[device]))
    state_dtype = draw(st.sampled_from(STATE_DTYPES))
    mode = draw(st.sampled_from(["replay", "replay", "conventional"]))
    options = fam.draw_options(draw, device, state_dtype)
    num_slots = draw(st.integers(2, 7))
    pad = draw(st.sampled_from([-1, -1, -1, 0, -(2**31)]))
    graph = device == "cpu" and draw(st.booleans())
    cache = fam.cache_cls(num_slots, **shape, window=window, drafts=drafts, state_dtype=state_dtype,
                          act_dtype=act, device=device, pad_slot_id=pad)  # fmt: skip
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    # Random checkpoints; rings poisoned (a step may read only the records it holds); epochs
    # anywhere in int32 (a flush wraps them); word 3 (pending drafts) anything: a step zeroes it.
    with torch.no_grad():
        cache.state.copy_(0.3 * torch.randn(cache.state.shape, generator=gen))
        for name in cache.layout.ring_names:
            cache.tensors[name].fill_(float("nan"))
        words = cache.cursors
        words[:, 0] = 0
        words[:, 1] = torch.randint(
            -(2**31), 2**31, (num_slots,), generator=gen, dtype=torch.int64
        ).to(torch.int32)
        words[:, 1][0] = INT32_MAX
        words[:, 2] = 0
        words[:, 3] = torch.randint(-(2**31), 2**31, (num_slots,), generator=gen, dtype=torch.int64).to(torch.int32)  # fmt: skip
    wrapper = fam.wrapper_cls(cache, mode=mode, use_cuda_graph=graph)
    free = len([s for s in range(num_slots) if s != pad])
    batch = draw(st.integers(1, free + 1))
    config = None
    kernels = ["auto", "auto", "flush-every-step", "per-item"]
    kernel = draw(st.sampled_from([*kernels, "split"]))
    if kernel != "auto" or draw(st.booleans()):
        spec_rows = None
        if draw(st.booleans()):
            probe = fam.wrapper_cls(cache, mode=mode)
            spec_rows = draw(
                st.sampled_from([r for r, _ in spec_tilings(probe.plan(1, **options))])
            )
        config = LaunchConfig(kernel=kernel, rows_per_cta=spec_rows or "auto")
    seed = draw(st.integers(-(2**70), 2**70))
    wrapper.plan(batch, config=config, seed=seed, **options)
    params = fam.params(gen, shape, options, device)
    sc = Scenario(fam, device, shape, act, state_dtype, mode, options,
                  route or draw(st.sampled_from(["wrapper", "op"])), cache, wrapper, params, gen,
                  cache.state.double().cpu().clone())  # fmt: skip
    for _ in range(draw(st.integers(0, min(window + 1, 6)))):
        sc.step(sc.draw_slots(draw), sc.token())
    return sc


def _watch(sc: Scenario, args: dict, pool: dict | None) -> dict:
    w = {f"cache.{k}": t for k, t in sc.cache.tensors.items()}
    w["cache._free"] = sc.cache._free
    w["wrapper._plan"], w["wrapper._out"] = sc.wrapper._plan, sc.wrapper._out
    w["wrapper._workspace"] = sc.wrapper._workspace
    for k, v in (pool or {}).items():
        if isinstance(v, torch.Tensor):
            w[f"pool.{k}"] = v
    for k, v in args.items():
        if isinstance(v, torch.Tensor):
            w[f"arg.{k}"] = v
    return w


# --- argument variants ------------------------------------------------------------------------


def _slot_variant(draw, sc: Scenario, slots: torch.Tensor, v: Validity) -> torch.Tensor:
    ids = slots.tolist()
    real = [i for i, s in enumerate(ids) if s != sc.pad]
    kind = draw(st.sampled_from(["range", "negative", "pad", "duplicate", "dtype", "shape",
                                 "strided", "offset", "none", "list", "device"]))  # fmt: skip
    n = sc.cache.num_slots
    if kind == "range":
        i = draw(st.integers(0, sc.batch - 1))
        ids[i] = draw(st.sampled_from([n, n + 1, INT32_MAX]))
        v.mark(False, f"slot id {ids[i]} of {n}")
    elif kind == "negative":
        i = draw(st.integers(0, sc.batch - 1))
        ids[i] = draw(st.sampled_from([-1, -2, -(2**31), -(2**31) + 1]))
        v.mark(ids[i] == sc.pad, f"slot id {ids[i]}")
    elif kind == "pad":
        i = draw(st.integers(0, sc.batch - 1))
        ids[i] = sc.pad
        v.mark(True, "pad row")
    elif kind == "duplicate":
        if len(real) >= 2:
            i, j = draw(st.permutations(real))[:2]
            ids[j] = ids[i]
            v.mark(False, f"slot {ids[i]} twice")
        elif sc.batch >= 2 and real:
            j = next(k for k in range(sc.batch) if k != real[0])
            ids[j] = ids[real[0]]
            v.mark(False, f"slot {ids[j]} twice")
    if kind in ("range", "negative", "pad", "duplicate"):
        return torch.tensor(ids, dtype=torch.int32, device=sc.device)
    if kind == "dtype":
        dtype = draw(st.sampled_from([torch.int64, torch.int16, torch.uint8, torch.float32,
                                      torch.bool]))  # fmt: skip
        v.mark(False, f"slot dtype {dtype}")
        return slots.to(dtype)
    if kind == "shape":
        v.mark(False, "slot shape")
        return draw(st.sampled_from([slots[None], torch.cat([slots, slots[:1]]), slots[:-1]]))
    if kind == "strided":
        wide = torch.stack([slots, slots], dim=1)[:, 0]
        v.mark(sc.batch == 1, "strided slot ids")
        return wide
    if kind == "offset":
        buf = torch.zeros(sc.batch + 1, dtype=torch.int32, device=sc.device)
        buf[1:] = slots
        v.mark(True, "slot ids at an odd offset")
        return buf[1:]
    if kind == "device":
        v.mark(False, "slot device")
        return slots.to(_other_device(sc.device))
    v.mark(False, f"slot ids as {kind}")
    return None if kind == "none" else ids


def _other_device(device: str) -> str:
    return "meta" if device == "cpu" else "cpu"


def _pool_variant(draw, sc: Scenario, name: str, v: Validity) -> object:
    """A copy of slot tensor `name` in another layout (or a wrong one)."""
    layout = next(t for t in sc.cache.layout.tensors() if t.name == name)
    optional = not sc.replay and name != "state"
    t, ok, label = slot_tensor_variant(
        draw,
        sc.cache.tensors[name],
        layout.alignment,
        optional=optional,
        other_device=_other_device(sc.device),
    )
    v.mark(ok, f"{name} {label}")
    return t


def _seed_variant(draw, sc: Scenario, v: Validity) -> object:
    device_seed = "device_seed" in sc.plan.spec.flags
    kind = draw(st.sampled_from(["none", "int", "huge", "bool", "float", "str", "tensor",
                                 "tensor-0d", "tensor-i32", "tensor-2", "tensor-device"]))  # fmt: skip
    value = {
        "none": None,
        "int": draw(st.integers(-(2**63), 2**63)),
        "huge": draw(st.sampled_from([2**64, -(2**64), 10**40])),
        "bool": True,
        "float": 1.0,
        "str": "1",
        "tensor": torch.tensor([draw(st.integers(-(2**63), 2**63 - 1))], device=sc.device),
        "tensor-0d": torch.tensor(7, device=sc.device),
        "tensor-i32": torch.tensor([7], dtype=torch.int32, device=sc.device),
        "tensor-2": torch.tensor([7, 8], device=sc.device),
        "tensor-device": torch.tensor([7], device=_other_device(sc.device)),
    }[kind]
    ok = kind in ("none", "int", "huge") or (device_seed and kind in ("tensor", "tensor-0d"))
    v.mark(ok, f"seed {kind}{' (device_seed)' if device_seed else ''}")
    return value


def _out_variant(draw, sc: Scenario, v: Validity) -> object:
    shape = (sc.batch, sc.fam_value_heads, sc.fam_value_dim)
    base = torch.full(shape, float("nan"), dtype=sc.act, device=sc.device)
    t, ok, label = tensor_variant(draw, base, "contiguous", other_device=_other_device(sc.device))
    if t is None:
        ok = True  # out=None: allocated (or the graph buffer)
    v.mark(ok, f"out {label}")
    return t


def _workspace_variant(draw, sc: Scenario, v: Validity) -> object:
    floats = sc.plan.workspace_floats
    size = draw(st.sampled_from([floats, floats + 5, max(floats - 1, 0), 0, 1]))
    base = torch.zeros(size, device=sc.device)
    kind = draw(st.sampled_from(["same", "stride-2", "dtype", "none", "device", "list"]))
    if kind == "same":
        v.mark(size >= floats, f"workspace of {size} for {floats}")
        return base
    if kind == "stride-2":
        t = torch.zeros(2 * size, device=sc.device)[::2]
        v.mark(size >= floats and (size <= 1), f"strided workspace of {size}")
        return t
    if kind == "dtype":
        v.mark(False, "workspace dtype")
        return base.double()
    if kind == "none":
        v.mark(True, "workspace None")
        return None
    if kind == "device":
        v.mark(False, "workspace device")
        return base.to(_other_device(sc.device))
    v.mark(False, "workspace list")
    return base.tolist()


def draw_decode_call(draw, sc: Scenario) -> Call:
    """The next step of `sc` with zero to two drawn variants, and its reference check."""
    fam, v = sc.fam, Validity()
    sc.fam_value_heads = sc.cache.layout.shape.value_heads
    sc.fam_value_dim = sc.cache.layout.shape.value_dim
    slots = sc.draw_slots(draw)
    args = {**sc.token(), "slot_indices": slots}
    pool = dict(sc.cache.tensors)
    plan, kwargs = DEFAULT, {}
    other = _other_device(sc.device)
    kinds = ["slots", "input", "input", "optional", "out", "seed", "kwarg"]
    if sc.route == "op":
        kinds += ["pool", "pool", "plan", "workspace"]
    if sc.replay:  # (a corrupted cursor faults its row alone, on every device)
        kinds += ["cursor"]
    kinds += ["cursor-unread"]
    late, used = [], set()
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2]))):
        kind = draw(st.sampled_from(kinds))
        if kind in used and kind not in ("input", "pool"):
            continue  # (one variant per argument: a later one would hide the earlier's mark)
        used.add(kind)
        if kind == "slots":
            args["slot_indices"] = _slot_variant(draw, sc, args["slot_indices"], v)
        elif kind == "input":
            name = draw(st.sampled_from(sorted(n for n in fam.inputs if n in args)))
            if name in used:
                continue
            used.add(name)
            _, req = fam.inputs[name]
            base = args[name]
            if draw(st.integers(0, 9)) == 0 and base.dtype.is_floating_point:
                t, ok, label = base.clone().requires_grad_(), True, "requires_grad"
            else:
                t, ok, label = tensor_variant(draw, base, req, other_device=other)
            args[name] = t
            v.mark(ok, f"{name} {label}")
        elif kind == "optional":
            name = draw(st.sampled_from(fam.optional_names()))
            if name in used:
                continue
            used.add(name)
            if name in args:
                del args[name]
                v.mark(False, f"planned {name} missing")
            else:
                args[name] = fam.fresh(name, sc.gen, sc.batch, sc.shape, sc.act, sc.device)
                v.mark(False, f"unplanned {name} given")
        elif kind == "out":
            args["out"] = _out_variant(draw, sc, v)
        elif kind == "seed":
            args["seed"] = _seed_variant(draw, sc, v)
        elif kind == "workspace":
            args["workspace"] = _workspace_variant(draw, sc, v)
        elif kind == "kwarg":
            name = draw(
                st.sampled_from(["foo", "slot", "Z", "state" if sc.route == "wrapper" else "bar"])
            )
            kwargs[name] = torch.zeros(1)
            v.mark(False, f"unknown keyword {name}")
        elif kind == "pool":
            name = draw(st.sampled_from(["state", *sc.cache.layout.ring_names, "cursors"]))
            if name in used:
                continue
            used.add(name)
            pool[name] = _pool_variant(draw, sc, name, v)
        elif kind == "plan":
            other_fam = next(a for a in ADAPTERS.values() if a is not fam)
            bad = draw(st.sampled_from(["other", "none", "layout", "dict"]))
            if bad == "other":
                ocache = other_fam.cache_cls(2, **other_fam.shapes[sc.device][0], device=sc.device)
                owrap = other_fam.wrapper_cls(ocache)
                owrap.plan(sc.batch)
                plan = owrap.decode_plan
            else:
                plan = {"none": None, "layout": sc.cache.layout, "dict": {}}[bad]
            v.mark(False, f"plan {bad}")
        else:
            late.append(kind)
    final = args.get("slot_indices")
    readable = (
        isinstance(final, torch.Tensor) and final.dtype == torch.int32 and final.dim() == 1
        and final.device.type == sc.device
    )  # fmt: skip
    named = {s for s in final.tolist() if s != sc.pad} if readable else None
    cursors = pool.get("cursors")
    for kind in late:  # garbage in a cursor's held count, where it is read and where it is not
        if not isinstance(cursors, torch.Tensor) or cursors.dtype != torch.int32 or named is None:
            continue
        if kind == "cursor":
            ids = sorted(s for s in named if 0 <= s < cursors.shape[0])
            if ids:
                s = draw(st.sampled_from(ids))
                held = draw(st.sampled_from([-1, sc.cache.layout.capacity, 10**6, -(2**31)]))
                cursors[s, 0] = held
                # A corrupted cursor: a ValueError naming cursors, or (fault containment) a NaN
                # output row and nothing of the slot written; _check_step tells them apart.
                v.mark(None, f"slot {s} holding {held} records")
        else:
            unread = [s for s in range(cursors.shape[0]) if s not in named]
            if unread:
                s = draw(st.sampled_from(unread))
                cursors[s, 0] = draw(st.sampled_from([-1, 10**6]))
                v.mark(True, f"garbage cursor in unread slot {s}")
    watch_args = {k: a for k, a in args.items() if k != "out"}
    before_all = {k: t.clone() for k, t in sc.cache.tensors.items()}
    pool_before = {k: t.clone() for k, t in pool.items() if isinstance(t, torch.Tensor)}
    # The workspace is scratch a successful step may overwrite (the split kernel does); a call
    # that raises must still leave it unchanged (it stays in `_watch`).
    inputs_before = snapshot({k: a for k, a in watch_args.items()
                              if isinstance(a, torch.Tensor) and k != "workspace"})  # fmt: skip

    def run():
        tensors = pool if sc.route == "op" else None
        return sc.call(args, tensors=tensors, plan=plan, kwargs=kwargs)

    def check(result):
        _check_step(sc, args, pool if sc.route == "op" else sc.cache.tensors, pool_before,
                    before_all, inputs_before, result)  # fmt: skip

    def clear(exc):
        if BINDING.search(str(exc)):
            return
        from .core import assert_clear

        assert_clear(exc, (*OP_ARGS, *fam.inputs))

    return Call(run, names=(), watch=lambda: _watch(sc, watch_args, pool), check=check,
                valid=v.valid, why=v.why, clear=clear)  # fmt: skip


def _check_step(sc: Scenario, args, pool, pool_before, cache_before, inputs_before, out):
    """A successful step against the reference and the documented cursor and ring rules."""
    from .core import assert_unchanged

    fam = sc.fam
    assert_unchanged(inputs_before, {k: args[k] for k in inputs_before}, "inputs")
    slots = args["slot_indices"]
    slots_l = (slots if isinstance(slots, torch.Tensor) else torch.tensor(slots)).long().cpu()
    batch = sc.batch
    assert isinstance(out, torch.Tensor) and out.shape == (
        batch,
        sc.fam_value_heads,
        sc.fam_value_dim,
    )
    assert out.dtype == sc.act and out.device.type == sc.device
    assert not out.requires_grad, "out takes part in autograd"
    if isinstance(args.get("out"), torch.Tensor):
        assert out is args["out"]
    elif sc.wrapper.use_cuda_graph and sc.route == "wrapper":
        assert out is sc.wrapper._out
    for name, t in pool.items():
        if t is None:
            continue
        assert not t.requires_grad and t.grad_fn is None, f"{name} takes part in autograd"
    ref = fam.reference(sc.ref_pool, slots_l, {k: a.detach() for k, a in args.items()
                                               if isinstance(a, torch.Tensor)}, sc.options, sc.pad)  # fmt: skip
    pad_rows = slots_l == sc.pad
    real_rows = ~pad_rows
    got = out.detach().cpu()
    assert torch.equal(got[pad_rows], torch.zeros_like(got[pad_rows])), "pad rows not zero"
    tol = tolerance(sc.act, sc.state_dtype)
    cap, window = sc.cache.layout.capacity, sc.cache.layout.window
    if sc.replay and isinstance(pool.get("cursors"), torch.Tensor):
        held_of = pool_before["cursors"][:, 0].cpu()
        corrupt = torch.tensor([bool(r) and not 0 <= int(held_of[s]) < window
                                for r, s in zip(real_rows.tolist(), slots_l.tolist())])  # fmt: skip
        real_rows = real_rows & ~corrupt
    if real_rows.any():
        assert torch.isfinite(got[real_rows]).all(), "non-finite output"
        err = rel_err(got[real_rows], ref[real_rows])
        assert err <= tol, f"output relative error {err:.2e} > {tol:.0e}"
    named = sorted(set(slots_l[real_rows].tolist()))
    unnamed = [s for s in range(sc.cache.num_slots) if s not in named]
    for name, t in pool.items():
        if t is None:
            continue
        before = pool_before[name].cpu()
        now = t.detach().cpu()
        assert tensors_identical(now[unnamed], before[unnamed]), f"{name} of unnamed slots changed"
    if not sc.replay:
        for name in (*sc.cache.layout.ring_names, "cursors"):
            t = pool.get(name)
            if t is not None:
                assert tensors_identical(t.cpu(), pool_before[name].cpu()), (
                    f"conventional step changed {name}"
                )
    records = fam.record_values(args, sc.options)
    every = sc.plan.kernel == "flush-every-step"
    for row in torch.nonzero(slots_l != sc.pad).flatten().tolist():
        s = int(slots_l[row])
        state = pool["state"][s].detach().cpu()
        if sc.replay and not 0 <= int(pool_before["cursors"][s, 0]) < window:
            # A corrupted cursor faults its row alone: NaN out, nothing of the slot written.
            assert torch.isnan(got[row]).all(), f"row {row} of a corrupted cursor not NaN"
            for name, t in pool.items():
                if t is not None:
                    assert tensors_identical(t[s].cpu(), pool_before[name][s].cpu()), name
            continue
        if not sc.replay:
            err = rel_err(state, sc.ref_pool[s])
            assert err <= tol, f"slot {s} state relative error {err:.2e}"
            continue
        w_before = pool_before["cursors"][s].cpu().tolist()
        w_now = pool["cursors"][s].cpu().tolist()
        held = w_before[0]
        flush = held + 1 >= window or every
        epoch = (w_before[1] + 1 + 2**31) % 2**32 - 2**31 if flush else w_before[1]
        want = [0 if flush else held + 1, epoch, 0, 0]  # (a step drops pending drafts)
        assert w_now == want, f"slot {s} cursor {w_before} -> {w_now}, expected {want}"
        if flush:
            err = rel_err(state, sc.ref_pool[s])
            assert err <= tol, f"slot {s} checkpoint relative error {err:.2e} after a flush"
            continue
        assert tensors_identical(state, pool_before["state"][s].cpu()), (
            f"slot {s} checkpoint written"
        )
        for ring, exact in fam.records.items():
            now = pool[ring][s].detach().cpu()
            rec = records[ring][row]
            if exact:
                assert tensors_identical(now[:, held], rec.to(now.dtype)), f"{ring} row {held}"
            else:
                assert rel_err(now[:, held], rec) <= 1e-5, f"{ring} row {held}"
            if sc.device == "cpu":
                rest = [r for r in range(cap) if r != held]
                assert tensors_identical(now[:, rest], pool_before[ring][s].cpu()[:, rest]), ring


@entry("decode.run", covers=("Mamba2DecodeWrapper", "GDNDecodeWrapper", "KDADecodeWrapper"))
def build_run(draw, device):
    return draw_decode_call(draw, draw_scenario(draw, device, route="wrapper"))


@entry("decode.op", covers=("mamba2_decode", "gdn_decode", "kda_decode", "DecodePlan"))
def build_op(draw, device):
    return draw_decode_call(draw, draw_scenario(draw, device, route="op"))
