"""Slot lifecycle on engine-owned tensors (issue 21, section 6: engine fault sequences).

An engine allocates a layer's slot tensors from the layout and moves sequences through them:
starts (reset_slots), forks (copy_slots), preemptions, recycled slots and padded batch rows.
Every scenario runs the functional decode ops beside a float64 conventional reference per
sequence and requires:

* every sequence's every output within the tolerance of its reference (1e-5 for FP32
  checkpoints), and every checkpoint that a step has just flushed within it too;
* every slot the scenario never names (and a reserved pad slot) bit-identical at the end, and
  every lifecycle call writes only its target slots;
* pad rows exactly zero.

The unnamed slots start with random bits (random cursor words too); the slots a scenario uses
start with NaN rings, so a step that read a ring row its cursor does not hold would show. The
CPU path runs here; the `gpu` variants run the same scenarios through the CUDA kernels (split and
per-item: at these batches the launch policy would flush every token, holding no records), and
a padded run inside a captured CUDA graph.

Not covered yet: a speculative verify whose commit never comes (needs the speculative ops).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replayssm_jit import (
    LaunchConfig,
    Mamba2DecodeCache,
    SlotCache,
    copy_slots,
    gdn_decode,
    gdn_layout,
    mamba2_decode,
    mamba2_layout,
    plan_decode,
    reset_slots,
)
from replayssm_jit.reference import gdn_gates, gdn_step, mamba2_step

pytestmark = pytest.mark.usefixtures("no_launch_env", "single_thread")

GPU = pytest.mark.gpu
# (device, LaunchConfig kernel): the CPU path has one kernel's semantics (per-item).
DEVICES = [
    pytest.param(("cpu", "auto"), id="cpu"),
    pytest.param(("cuda", "per-item"), id="cuda-per-item", marks=GPU),
    pytest.param(("cuda", "split"), id="cuda-split", marks=GPU),
]
CASES = [(1, "f32"), (4, "f32"), (16, "f32"), (4, "bf16")]  # (window L, checkpoint dtype)
STATE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
# (output, checkpoint) relative error bounds; the 16-bit ones as in tests/mamba2/test_mamba2_gpu.py.
TOL = {"f32": (1e-5, 1e-5), "bf16": (3e-2, 2e-2)}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (got.double() - ref.double()).norm()
    return (diff / ref.double().norm().clamp_min(1e-300)).item()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN == NaN here, unlike torch.equal on floats)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in tensors.items()}


def assert_slots_kept(before: dict, tensors: dict, slots) -> None:
    """Every tensor's rows of `slots` have the bits they had in `before`."""
    slots = sorted(slots)
    if not slots:
        return
    for name, t in tensors.items():
        index = torch.tensor(slots, dtype=torch.long, device=t.device)
        if not same_bits(t[index], before[name][index]):
            changed = [s for s in slots if not same_bits(t[s], before[name][s])]
            raise AssertionError(f"{name} of slots {changed} changed")


# ---------------------------------------------------------------------------------------------
# The two families, engine-style: layout, plan, parameters, tokens, the op, the reference
# ---------------------------------------------------------------------------------------------


class Mamba2:
    """The odd test shape of tests/mamba2/test_mamba2_gpu.py (H = 6, P = 24, N = 64, G = 3) with z."""

    name = "mamba2"
    heads, headdim, dstate, groups = 6, 24, 64, 3

    def layout(self, window, state_dtype):
        return mamba2_layout(num_heads=self.heads, headdim=self.headdim, dstate=self.dstate,
                             ngroups=self.groups, window=window, state_dtype=state_dtype,
                             act_dtype=torch.float32)  # fmt: skip

    def plan_options(self):
        return dict(has_z=True)

    def params(self, gen, dev):
        H = self.heads
        return dict(
            A=-(0.5 + 1.5 * torch.rand(H, generator=gen, device=dev)),
            D=torch.randn(H, generator=gen, device=dev),
            dt_bias=0.1 * torch.randn(H, generator=gen, device=dev),
        )

    def token(self, batch, gen, dev):
        H, P, N, G = self.heads, self.headdim, self.dstate, self.groups
        return dict(
            x=torch.randn(batch, H, P, generator=gen, device=dev),
            z=torch.randn(batch, H, P, generator=gen, device=dev),
            dt=torch.randn(batch, H, generator=gen, device=dev) * 0.5 - 1.0,
            B=torch.randn(batch, G, N, generator=gen, device=dev) / N**0.25,
            C=torch.randn(batch, G, N, generator=gen, device=dev) / N**0.25,
        )

    def decode(self, plan, tensors, params, tok, slot_indices, out, workspace):
        mamba2_decode(plan, **tensors, **params, **tok, slot_indices=slot_indices, out=out,
                      workspace=workspace)  # fmt: skip

    def reference(self, states, params, tok):
        return mamba2_step(states, tok["x"], tok["dt"], params["A"], tok["B"], tok["C"],
                           D=params["D"], z=tok["z"], dt_bias=params["dt_bias"], dt_softplus=True)  # fmt: skip


class GDN:
    """The k64 test shape of tests/gdn/test_gdn_gpu.py (H = 4, HV = 8, K = V = 64), raw gates."""

    name = "gdn"
    k_heads, v_heads, kdim, vdim = 4, 8, 64, 64

    def layout(self, window, state_dtype):
        return gdn_layout(num_k_heads=self.k_heads, num_v_heads=self.v_heads, head_k_dim=self.kdim,
                          head_v_dim=self.vdim, window=window, state_dtype=state_dtype,
                          act_dtype=torch.float32)  # fmt: skip

    def plan_options(self):
        return {}

    def params(self, gen, dev):
        HV = self.v_heads
        return dict(
            A_log=torch.log(0.5 + torch.rand(HV, generator=gen, device=dev)),
            dt_bias=0.5 * torch.rand(HV, generator=gen, device=dev) - 0.25,
        )

    def token(self, batch, gen, dev):
        H, HV, K, V = self.k_heads, self.v_heads, self.kdim, self.vdim
        return dict(
            q=torch.randn(batch, H, K, generator=gen, device=dev),
            k=torch.randn(batch, H, K, generator=gen, device=dev),
            v=torch.randn(batch, HV, V, generator=gen, device=dev),
            a=-4.0 + 3.0 * torch.rand(batch, HV, generator=gen, device=dev),
            b=torch.randn(batch, HV, generator=gen, device=dev),
        )

    def decode(self, plan, tensors, params, tok, slot_indices, out, workspace):
        gdn_decode(plan, **tensors, **params, **tok, slot_indices=slot_indices, out=out,
                   workspace=workspace)  # fmt: skip

    def reference(self, states, params, tok):
        g, beta = gdn_gates(params["A_log"], tok["a"], params["dt_bias"], tok["b"])
        return gdn_step(states, tok["q"], tok["k"], tok["v"], g, beta)


FAMILIES = [pytest.param(Mamba2(), id="mamba2"), pytest.param(GDN(), id="gdn")]


def engine_tensors(layout, num_slots, gen, device, window) -> dict[str, torch.Tensor]:
    """Every slot tensor with random bits, cursors included (word 0 a valid held count)."""
    tensors = {}
    for t in layout.tensors():
        shape = t.shape(num_slots)
        if t.name == "cursors":
            words = torch.randint(0, 1000, shape, generator=gen, device=device)
            words[:, 0] = torch.randint(0, window, (num_slots,), generator=gen, device=device)
            tensors[t.name] = words.to(torch.int32)
        else:
            tensors[t.name] = torch.randn(shape, generator=gen, device=device).to(t.dtype)
    return tensors


# ---------------------------------------------------------------------------------------------
# An engine: slot tensors, one plan, sequences in slots, each with its float64 reference state
# ---------------------------------------------------------------------------------------------


class Engine:
    """Runs batches of sequences through the op and their references side by side.

    used: the slots the scenario may name (their rings start NaN); every other slot, and a
    reserved pad slot, must keep its random bits (`finish`). With use_graph, every step after
    the first replays one captured CUDA graph over static buffers (slot ids in a device
    buffer, so padded rows move between replays).
    """

    def __init__(self, fam, device, kernel, *, window, state, used, num_slots=8, batch=4,
                 pad_slot_id=-1, seed=0, use_graph=False):  # fmt: skip
        self.fam, self.device, self.window, self.batch = fam, torch.device(device), window, batch
        self.pad, self.use_graph = pad_slot_id, use_graph
        self.tol_out, self.tol_state = TOL[state]
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.order = torch.Generator().manual_seed(seed + 1)  # row permutations
        self.layout = fam.layout(window, STATE_DTYPES[state])
        self.tensors = engine_tensors(self.layout, num_slots, self.gen, device, window)
        for name in self.layout.ring_names:
            self.tensors[name][torch.tensor(used, device=device)] = float("nan")
        self.kept = [s for s in range(num_slots) if s not in used]
        self.initial = snapshot(self.tensors)
        self.plan = plan_decode(
            self.layout, batch, device=device, pad_slot_id=pad_slot_id,
            check_slot_values=not use_graph, config=LaunchConfig(kernel=kernel),
            **fam.plan_options(),
        )  # fmt: skip
        if self.device.type == "cuda":
            assert self.plan.backend == "cuda" and self.plan.kernel == kernel, self.plan.kernel
        self.workspace = torch.empty(self.plan.workspace_floats, device=device)
        self.params = fam.params(self.gen, device)
        shape = self.layout.shape
        self.out = torch.empty(batch, shape.value_heads, shape.value_dim, device=device)
        self.ref: dict[str, torch.Tensor] = {}  # sequence -> float64 state
        self.slot: dict[str, int] = {}  # sequence -> its slot
        self.worst: dict[str, float] = {}  # sequence -> worst output error so far
        self.flush_checks = 0
        self.graph = None
        self.static = None

    # --- lifecycle --------------------------------------------------------------------------
    def start(self, seq: str, slot: int, initial: torch.Tensor | None = None) -> None:
        """`seq` begins in `slot` (reset_slots): from `initial` (its float64 state) or zero."""
        before = snapshot(self.tensors)
        ids = torch.tensor([slot], dtype=torch.int32, device=self.device)
        init = None if initial is None else initial[None]
        reset_slots(self.layout, self.tensors, ids, init, pad_slot_id=self.pad)
        others = [s for s in range(self.num_slots) if s != slot]
        assert_slots_kept(before, self.tensors, others)
        assert self.tensors["cursors"][slot].tolist() == [0, 0, 0, 0]
        self.adopt(seq, slot, initial)

    def adopt(self, seq: str, slot: int, initial: torch.Tensor | None = None) -> None:
        """Track `seq` in `slot` (already reset) from `initial` or zero."""
        zero = torch.zeros(self.tensors["state"].shape[1:], dtype=torch.float64, device=self.device)
        self.ref[seq] = zero if initial is None else initial.double().clone()
        self.slot[seq] = slot
        self.worst.setdefault(seq, 0.0)

    def stop(self, seq: str) -> None:
        """`seq` leaves its slot (finished or preempted); the slot's tensors stay as they are."""
        del self.slot[seq]

    @property
    def num_slots(self) -> int:
        return self.tensors["state"].shape[0]

    def held(self, seq: str) -> int:
        return int(self.tensors["cursors"][self.slot[seq], 0])

    # --- a decode step ------------------------------------------------------------------------
    def step(self, seqs, *, tie=None, check=True) -> dict[str, torch.Tensor]:
        """One step of `seqs` (the other rows padded, rows in random order). tie: {seq: other}
        gives seq the other's token. Returns each sequence's output row. check: True (every
        sequence), False or the sequences whose output, and checkpoint where the step has just
        flushed it, must be within the tolerance."""
        checked = set(seqs) if check is True else set(check or ())
        rows = [self.slot[s] for s in seqs] + [self.pad] * (self.batch - len(seqs))
        perm = torch.randperm(self.batch, generator=self.order).tolist()
        row_slots = [rows[i] for i in perm]
        row_of = {s: row_slots.index(self.slot[s]) for s in seqs}
        tok = self.fam.token(self.batch, self.gen, self.device)
        for seq, other in (tie or {}).items():
            for t in tok.values():
                t[row_of[seq]] = t[row_of[other]]
        ids = torch.tensor(row_slots, dtype=torch.int32, device=self.device)
        self.out.fill_(float("nan"))
        self._decode(tok, ids)
        pads = [i for i, s in enumerate(row_slots) if s == self.pad]
        assert torch.equal(self.out[pads], torch.zeros_like(self.out[pads])), "pad rows"
        live = torch.tensor([row_of[s] for s in seqs], dtype=torch.long, device=self.device)
        states = torch.stack([self.ref[s] for s in seqs])
        y, new = self.fam.reference(states, self.params, {k: v[live] for k, v in tok.items()})
        outs = {}
        for i, s in enumerate(seqs):
            self.ref[s] = new[i]
            outs[s] = self.out[row_of[s]].clone()
            err = rel_err(outs[s], y[i])
            self.worst[s] = max(self.worst[s], err) if err == err else float("nan")
            if s in checked:
                assert err <= self.tol_out, f"{s}: output error {err:.2e}"
                if self.held(s) == 0:  # just flushed: the checkpoint is the state
                    state_err = rel_err(self.tensors["state"][self.slot[s]], new[i])
                    assert state_err <= self.tol_state, f"{s}: checkpoint error {state_err:.2e}"
                    self.flush_checks += 1
        return outs

    def _decode(self, tok, ids) -> None:
        if not self.use_graph:
            self.fam.decode(self.plan, self.tensors, self.params, tok, ids, self.out,
                            self.workspace)  # fmt: skip
            return
        if self.static is None:  # the first step runs eagerly on the static buffers
            self.static = ({k: v.clone() for k, v in tok.items()}, ids.clone())
            static_tok, static_ids = self.static
            self.fam.decode(self.plan, self.tensors, self.params, static_tok, static_ids,
                            self.out, self.workspace)  # fmt: skip
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.fam.decode(self.plan, self.tensors, self.params, static_tok, static_ids,
                                self.out, self.workspace)  # fmt: skip
            return
        static_tok, static_ids = self.static
        for k, v in tok.items():
            static_tok[k].copy_(v)
        static_ids.copy_(ids)
        self.graph.replay()
        torch.cuda.synchronize()

    def finish(self) -> None:
        """Every slot never named (and a reserved pad slot) holds its first bits."""
        assert_slots_kept(self.initial, self.tensors, self.kept)


def test_engine_detects_a_wrong_kernel_step():
    """The engine's checks fail on a perturbed state (so a passing scenario means something)."""
    eng = Engine(Mamba2(), "cpu", "auto", window=1, state="f32", used=[2])
    eng.start("A", 2)
    eng.step(["A"])
    eng.tensors["state"][2] *= 1.001
    with pytest.raises(AssertionError, match="A: output error"):
        eng.step(["A"])
    eng = Engine(GDN(), "cpu", "auto", window=4, state="f32", used=[2])
    eng.tensors["state"][5].add_(1.0)
    with pytest.raises(AssertionError, match=r"state of slots \[5\] changed"):
        eng.finish()


# ---------------------------------------------------------------------------------------------
# Section 6 scenarios
# ---------------------------------------------------------------------------------------------


def mid_window_steps(window: int) -> int:
    """A step count that leaves records held (for L > 1): past two flushes, not at a third."""
    return 2 * window + window // 2 + 1


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("window,state", CASES)
@pytest.mark.parametrize("fam", FAMILIES)
def test_preemption_then_resume_in_another_slot(fam, dev, window, state):
    """A decodes mid-window, is preempted, its slot goes to B; A resumes later in another slot
    from its exact state at preemption and continues as if it had decoded straight through."""
    eng = Engine(fam, *dev, window=window, state=state, used=[2, 5, 6])
    prompt = torch.randn(eng.tensors["state"].shape[1:], generator=eng.gen, device=eng.device)
    eng.start("A", 2, prompt.double())
    eng.start("C", 5)
    n = mid_window_steps(window)
    for t in range(n):
        eng.step(["A", "C"] if t else ["A"])  # C runs one step behind: staggered flushes
    assert eng.held("A") == n % window and (window == 1 or eng.held("A") > 0)
    at_preemption = eng.ref["A"].clone()  # what the engine keeps (recomputes) for A
    eng.stop("A")
    eng.start("B", 2)  # the freed slot, records still held, goes to a new sequence
    for _ in range(window + 3):
        eng.step(["B", "C"])
    eng.start("A", 6, at_preemption)
    for _ in range(2 * window + 3):
        eng.step(["A", "B", "C"])
    assert eng.flush_checks > 0
    eng.finish()


def recycle(fam, dev, window, state, reset, *, check_b=True) -> Engine:
    """Slot 1 serves A until records are held, is freed and handed to B by `reset(engine)`
    (which must leave B tracked in slot 1); B then decodes 2L + 2 steps beside C (B checked
    at every step where `check_b`). Returns the engine (B's worst output error in
    engine.worst["B"])."""
    eng = Engine(fam, *dev, window=window, state=state, used=[1, 3], num_slots=4)
    eng.start("A", 1)
    eng.start("C", 3)
    for t in range(mid_window_steps(window)):
        eng.step(["A", "C"] if t % 3 else ["A"])
    held = eng.held("A")
    assert window == 1 or held > 0
    eng.stop("A")
    reset(eng)
    for _ in range(2 * window + 2):
        eng.step(["B", "C"], check=True if check_b else ["C"])
    return eng


def reset_through_allocate(eng: Engine) -> None:
    cache = SlotCache.from_tensors(eng.layout, pad_slot_id=eng.pad, **eng.tensors)
    cache._free = [1]  # every other slot is in use (allocating them would zero them)
    slots = cache.allocate(1)
    assert slots.tolist() == [1] and cache.records_held(slots).tolist() == [0]
    eng.adopt("B", 1)


def reset_through_reset_slots(eng: Engine) -> None:
    eng.start("B", 1)


def reset_checkpoint_only(eng: Engine) -> None:
    """The bug vLLM and SGLang both shipped: the checkpoint zeroed, the cursor left alone."""
    eng.tensors["state"][1] = 0
    eng.adopt("B", 1)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("window,state", CASES)
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("via", [reset_through_allocate, reset_through_reset_slots],
                         ids=["allocate", "reset_slots"])  # fmt: skip
def test_a_recycled_slot_starts_clean(fam, dev, window, state, via):
    eng = recycle(fam, dev, window, state, via)
    assert eng.worst["B"] <= eng.tol_out and eng.worst["C"] <= eng.tol_out, eng.worst
    eng.finish()


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("window", [4, 16])
@pytest.mark.parametrize("fam", FAMILIES)
def test_skipping_the_cursor_reset_is_caught(fam, dev, window):
    """The recycling check can fail: with only the checkpoint zeroed, B replays A's held
    records (and flushes early), so its outputs are wrong by far more than the tolerance."""
    eng = recycle(fam, dev, window, "f32", reset_checkpoint_only, check_b=False)
    assert eng.worst["B"] > 1e-2 and eng.worst["C"] <= eng.tol_out, eng.worst


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("window,state", CASES)
@pytest.mark.parametrize("fam", FAMILIES)
def test_fork_mid_window(fam, dev, window, state):
    """A forks into F with records held: the slots are equal bit for bit, stay equal while they
    get the same tokens, and each follows its own reference once the tokens differ."""
    eng = Engine(fam, *dev, window=window, state=state, used=[1, 4, 6])
    eng.start("A", 1)
    eng.start("C", 6)
    for t in range(mid_window_steps(window)):
        eng.step(["A", "C"] if t > 1 else ["A"])
    assert window == 1 or eng.held("A") > 0
    before = snapshot(eng.tensors)
    src = torch.tensor([1], dtype=torch.int32, device=eng.device)
    copy_slots(eng.layout, eng.tensors, src, [4], pad_slot_id=eng.pad)
    assert_slots_kept(before, eng.tensors, [s for s in range(eng.num_slots) if s != 4])
    for name, t in eng.tensors.items():
        assert same_bits(t[4], t[1]), name
    eng.adopt("F", 4, eng.ref["A"])
    for _ in range(3):
        outs = eng.step(["A", "F", "C"], tie={"F": "A"})
        assert same_bits(outs["A"], outs["F"])
    for name, t in eng.tensors.items():
        assert same_bits(t[4], t[1]), name
    for _ in range(2 * window + 2):
        eng.step(["A", "F", "C"])
    assert rel_err(eng.ref["F"], eng.ref["A"]) > 1e-2  # (the two have diverged)
    eng.finish()


def padded_run(eng: Engine, steps: int) -> None:
    """Sequences join at staggered steps, finish, and their slots are recycled, with at least
    half the rows padded in every step."""
    eng.start("A", 1)
    for t in range(steps):
        if t == 1:
            eng.start("B", 2)
        if t == 3:
            eng.start("C", 3)
        if t == steps // 2:
            eng.stop("A")
            eng.start("D", 5)
        if t == 3 * steps // 4:
            eng.stop("B")
            eng.start("E", 1)  # A's old slot
        eng.step(sorted(eng.slot))
    assert eng.flush_checks > 0


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("window,state", CASES)
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("pad", [0, -1], ids=["pad0-vllm", "pad-1-sglang"])
def test_padded_rows_leave_other_slots_bit_identical(fam, dev, window, state, pad):
    """Slot 0 (vLLM's reserved pad slot, or just unnamed) and every unnamed slot keep their
    bits through many padded steps."""
    eng = Engine(fam, *dev, window=window, state=state, used=[1, 2, 3, 5], batch=6,
                 pad_slot_id=pad)  # fmt: skip
    padded_run(eng, max(3 * window + 7, 24))
    eng.finish()


@GPU
@pytest.mark.parametrize("kernel", ["per-item", "split"])
@pytest.mark.parametrize("window,state", [(4, "f32"), (16, "f32"), (4, "bf16")])
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("pad", [0, -1], ids=["pad0-vllm", "pad-1-sglang"])
def test_padded_rows_in_a_cuda_graph(fam, kernel, window, state, pad):
    """The same run, every step a replay of one captured graph: the slot ids (pads moving
    between rows) and tokens are refilled in place, slots reset between replays."""
    eng = Engine(fam, "cuda", kernel, window=window, state=state, used=[1, 2, 3, 5], batch=6,
                 pad_slot_id=pad, use_graph=True)  # fmt: skip
    padded_run(eng, max(4 * window + 7, 40))
    assert eng.graph is not None
    eng.finish()


# ---------------------------------------------------------------------------------------------
# The ops' contract: what they write, and arguments checked before anything changes
# ---------------------------------------------------------------------------------------------


def small_tensors(device, num_slots=6, window=4, family=None):
    fam = family or Mamba2()
    layout = fam.layout(window, torch.float32)
    gen = torch.Generator(device=device).manual_seed(3)
    return layout, engine_tensors(layout, num_slots, gen, device, window)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("fam", FAMILIES)
def test_reset_slots_writes_only_the_checkpoints_and_cursors_of_its_slots(fam, dev):
    layout, tensors = small_tensors(dev, family=fam)
    before = snapshot(tensors)
    reset_slots(layout, tensors, torch.tensor([4, 1], device=dev))  # int64 ids are fine
    init = torch.randn(1, *tensors["state"].shape[1:], dtype=torch.float64)  # on the CPU
    reset_slots(layout, tensors, [2], init)
    assert torch.equal(tensors["state"][[4, 1]], torch.zeros_like(tensors["state"][[4, 1]]))
    assert torch.equal(tensors["state"][2], init[0].to(device=dev, dtype=torch.float32))
    assert torch.equal(tensors["cursors"][[1, 2, 4]], torch.zeros(3, 4, dtype=torch.int32,
                                                                  device=dev))  # fmt: skip
    for name in layout.ring_names:  # stale ring rows stay (the cursor holds none of them)
        assert same_bits(tensors[name], before[name]), name
    assert_slots_kept(before, tensors, [0, 3, 5])
    # The rings may be left out: only the checkpoints and cursors are written.
    reset_slots(layout, {"state": tensors["state"], "cursors": tensors["cursors"]}, [0])
    assert tensors["cursors"][0].tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("fam", FAMILIES)
def test_copy_slots_copies_every_tensor_of_a_slot(fam, dev):
    layout, tensors = small_tensors(dev, family=fam)
    before = snapshot(tensors)
    copy_slots(layout, tensors, [3, 3, 0], torch.tensor([5, 1, 2], device=dev))
    for name, t in tensors.items():
        for src, dst in ((3, 5), (3, 1), (0, 2)):
            assert same_bits(t[dst], before[name][src]), (name, dst)
    assert_slots_kept(before, tensors, [0, 3, 4])
    copy_slots(layout, tensors, [], [])  # nothing to copy


def bad_calls(layout, tensors):
    """(op, args, kwargs, error, message pattern) for reset_slots and copy_slots."""
    state = tensors["state"]
    init = torch.zeros(1, *state.shape[1:])
    return [
        (reset_slots, ("layout", tensors, [0]), {}, TypeError, "^layout: expected a CacheLayout"),
        (reset_slots, (layout, [state], [0]), {}, TypeError, "^tensors: expected a mapping"),
        (reset_slots, (layout, {**tensors, "rec_X": state}, [0]), {}, ValueError,
         r"^tensors: expected names from \['state', .*got \['rec_X'\]"),
        (reset_slots, (layout, {**tensors, "cursors": None}, [0]), {}, TypeError,
         "^cursors: expected a torch.Tensor, got NoneType"),
        (reset_slots, (layout, {**tensors, "state": state[:5]}, [0]), {}, ValueError,
         r"^rec_x: expected 5 slots \(as state\), got 6"),
        (reset_slots, (layout, {**tensors, "state": state.double()}, [0]), {}, TypeError,
         "^state: expected dtype torch.float32, got torch.float64"),
        (reset_slots, (layout, tensors, [6]), {}, ValueError,
         r"^slots: expected slot ids in \[0, 6\), got 6$"),
        (reset_slots, (layout, tensors, [-1]), {}, ValueError, r"^slots: .* got -1$"),
        (reset_slots, (layout, tensors, [0]), dict(pad_slot_id=0), ValueError,
         r"^slots: expected slot ids in \[0, 6\) other than pad_slot_id=0, got 0$"),
        (reset_slots, (layout, tensors, [2, 2]), {}, ValueError,
         "^slots: expected distinct slot ids, got 2 twice$"),
        (reset_slots, (layout, tensors, [1.0]), {}, TypeError, "^slots: expected int slot ids"),
        (reset_slots, (layout, tensors, [True]), {}, TypeError, "^slots: expected int slot ids"),
        (reset_slots, (layout, tensors, torch.tensor([0.0])), {}, TypeError,
         "^slots: expected an integer tensor, got dtype torch.float32$"),
        (reset_slots, (layout, tensors, torch.tensor([[0]])), {}, ValueError,
         r"^slots: expected a 1-D tensor, got shape \[1, 1\]$"),
        (reset_slots, (layout, tensors, 0), {}, TypeError,
         "^slots: expected an int tensor or a list of ints, got int$"),
        (reset_slots, (layout, tensors, [0, 1], init), {}, ValueError,
         r"^initial_state: expected shape \[2, "),
        (reset_slots, (layout, tensors, [0], init.int()), {}, TypeError,
         "^initial_state: expected a floating dtype, got torch.int32$"),
        (reset_slots, (layout, tensors, [0]), dict(pad_slot_id=1.0), TypeError,
         "^pad_slot_id: expected an int"),
        (reset_slots, (layout, tensors, [0]), dict(check_slot_values=1), TypeError,
         "^check_slot_values: expected a bool"),
        (reset_slots, (layout, tensors, [0]), dict(check_slot_values=False), TypeError,
         r"^slots: expected an int tensor on cpu \(check_slot_values=False\), got list$"),
        (copy_slots, (layout, tensors, [0], [1, 2]), {}, ValueError,
         r"^dst: expected 1 slot ids \(as src\), got 2$"),
        (copy_slots, (layout, tensors, [0, 1], [2, 2]), {}, ValueError,
         "^dst: expected distinct slot ids, got 2 twice$"),
        (copy_slots, (layout, tensors, [0, 1], [2, 0]), {}, ValueError,
         "^dst: expected slot ids not in src, got 0$"),
        (copy_slots, (layout, tensors, [7], [1]), {}, ValueError,
         r"^src: expected slot ids in \[0, 6\), got 7$"),
        (copy_slots, (layout, tensors, [1], [0]), dict(pad_slot_id=0), ValueError,
         r"^dst: expected slot ids in \[0, 6\) other than pad_slot_id=0, got 0$"),
        (copy_slots, (layout, {k: v for k, v in tensors.items() if k != "rec_dt"}, [0], [1]), {},
         TypeError, "^rec_dt: expected a torch.Tensor, got NoneType"),
    ]  # fmt: skip


def test_bad_arguments_are_named_and_change_nothing():
    layout, tensors = small_tensors("cpu")
    before = snapshot(tensors)
    calls = bad_calls(layout, tensors)
    for op, args, kwargs, error, match in calls:
        with pytest.raises(error, match=match):
            op(*args, **kwargs)
        assert_slots_kept(before, tensors, range(6))


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=GPU)])
def test_unchecked_slot_ids_are_used_as_given(dev):
    """check_slot_values=False reads no id on the host (no sync): the ids must be a tensor on
    the tensors' device, and are then the caller's responsibility."""
    layout, tensors = small_tensors(dev)
    before = snapshot(tensors)
    ids = torch.tensor([3], dtype=torch.int32, device=dev)
    reset_slots(layout, tensors, ids, check_slot_values=False)
    copy_slots(layout, tensors, ids, ids + 1, check_slot_values=False)
    assert tensors["cursors"][3].tolist() == [0, 0, 0, 0]
    for name, t in tensors.items():
        assert same_bits(t[4], t[3]), name
    assert_slots_kept(before, tensors, [0, 1, 2, 5])
    if dev == "cuda":
        with pytest.raises(ValueError, match="^slots: expected device cuda"):
            reset_slots(layout, tensors, ids.cpu(), check_slot_values=False)


def test_cache_fork_and_reset():
    cache = Mamba2DecodeCache(5, num_heads=4, headdim=16, dstate=16, ngroups=2, window=4,
                              device="cpu", pad_slot_id=0)  # fmt: skip
    a = cache.allocate(1)
    cache.state[a.long()] = 1.5
    cache.cursors[a.long(), 0] = 2
    with pytest.raises(ValueError, match=r"^dst: expected allocated slot ids, got 2 \(free\)$"):
        cache.fork(a, [2])
    with pytest.raises(ValueError, match=r"^src: expected allocated slot ids, got 3 \(free\)$"):
        cache.fork([3], [2])
    with pytest.raises(ValueError, match="^dst: .* other than pad_slot_id=0, got 0$"):
        cache.fork(a, [0])
    b = cache.allocate(2)
    with pytest.raises(ValueError, match="^dst: expected slot ids not in src"):
        cache.fork(torch.cat([a, a]), [int(a), int(b[0])])
    cache.fork(torch.cat([a, a]), b)
    for name, t in cache.tensors.items():
        assert torch.equal(t[b.long()], t[a.long()].expand_as(t[b.long()])), name
    assert cache.records_held(b).tolist() == [2, 2]
    with pytest.raises(ValueError, match="^slots: expected distinct slot ids, got 2 twice$"):
        cache.reset([2, 2])
    cache.reset(b[:1])
    assert cache.records_held(b).tolist() == [0, 2]


@settings(max_examples=120, deadline=None)
@given(
    op=st.sampled_from(["reset", "copy"]),
    src=st.lists(st.integers(-2, 7), max_size=4),
    dst=st.lists(st.integers(-2, 7), max_size=4),
    as_tensor=st.booleans(),
    pad=st.sampled_from([None, -1, 0]),
)
def test_fuzzed_slot_ids_succeed_or_raise_and_change_nothing(op, src, dst, as_tensor, pad):
    layout, tensors = small_tensors("cpu")
    before = snapshot(tensors)
    ids = (lambda v: torch.tensor(v, dtype=torch.int32)) if as_tensor else list
    try:
        if op == "reset":
            reset_slots(layout, tensors, ids(src), pad_slot_id=pad)
        else:
            copy_slots(layout, tensors, ids(src), ids(dst), pad_slot_id=pad)
    except (TypeError, ValueError) as exc:
        assert str(exc).split(":")[0] in ("slots", "src", "dst"), str(exc)
        assert_slots_kept(before, tensors, range(6))
        return
    targets = set(src) if op == "reset" else set(dst)
    assert all(0 <= s < 6 and s != pad for s in targets)
    assert_slots_kept(before, tensors, [s for s in range(6) if s not in targets])
