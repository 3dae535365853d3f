"""Slot lifecycle scenarios on engine-owned tensors (issue 21, section 6: engine fault sequences).

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
from support.checks import rel_err
from support.lifecycle import (
    FAMILIES,
    GDN,
    GPU,
    Mamba2,
    assert_slots_kept,
    engine_tensors,
    same_bits,
    snapshot,
)

from replayssm_jit import LaunchConfig, SlotCache, copy_slots, plan_decode, reset_slots

pytestmark = pytest.mark.usefixtures("no_launch_env", "single_thread")

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
