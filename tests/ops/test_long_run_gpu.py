"""Long runs (issue 21, section 4).

CPU: a smoke run of benchmarks/long_run_drift.py (tiny shapes, a few windows of steps), its
command's JSON and plot, and its float64 step against the reference package's.
GPU (marked gpu): the script's drift run at a Mamba-2 and a GDN model shape for a few thousand
steps, and 10,000 mixed decode steps (sequences of random lengths reset between steps, rows
joining and skipping steps, so cursors are staggered and every launch mixes flushing and
non-flushing rows, with padded rows, several windows) after which the pad slot and every
unnamed slot are bit-identical and every live cursor holds the expected counts; and 10,000 steps
mixing standard and verify steps (chains, trees, per-row draft counts, fused, explicit and missing
commits), with a short CPU run of the same schedule.
"""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch
from support.checks import rel_err
from support.lifecycle import GDN, Mamba2, assert_slots_kept, engine_tensors, snapshot
from support.paths import BENCHMARKS
from support.verify_schedule import GDNFamily, Mamba2Family

from replayssm_jit import LaunchConfig, commit_drafts, plan_decode, reset_slots
from replayssm_jit.core.models import get_model
from replayssm_jit.reference import gdn_gates, gdn_step, mamba2_step

pytestmark = pytest.mark.usefixtures("no_launch_env", "single_thread")

SCRIPT = BENCHMARKS / "long_run_drift.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("long_run_drift", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


drift = _load_script()
SERIES_KEYS = ("state_replay", "state_replay_row_max", "state_conventional", "out_replay_max",
               "out_replay_mean", "out_conventional_max", "out_conventional_mean")  # fmt: skip


# --- CPU: the drift script ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(drift.TINY))
def test_drift_smoke_run_on_cpu(name):
    r = drift.run_shape(drift.TINY[name], steps=48, batch=4, window=4, device="cpu",
                        sample_every=16)  # fmt: skip
    assert r["steps"] == 48 and not r["stopped_early"] and not r["cuda_graph"]
    assert r["kernel"] == "per-item" and r["conventional_kernel"] == "conventional"
    assert [s["step"] for s in r["series"]] == [8, 16, 32, 48] and r["final"] == r["series"][-1]
    for s in r["series"]:  # FP32 against float64: small, but not zero (the check is live)
        assert all(1e-9 < s[key] < 1e-5 for key in SERIES_KEYS), s
    lo, hi = r["decay_range"]
    assert 0.99 <= lo <= hi <= 0.999
    json.dumps(r)


def test_drift_command_writes_json_and_plot(tmp_path):
    rc = drift.main(["--device", "cpu", "--shapes", "tiny-gdn,tiny-mamba2", "--steps", "24",
                     "--window", "4", "--batch", "2", "--sample-every", "8",
                     "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    payload = json.loads((tmp_path / "long_run_drift.json").read_text())
    env = payload["environment"]
    assert {"date_utc", "device", "torch", "git_commit", "command"} <= set(env)
    assert env["device"] == "cpu" and "--shapes" in env["command"]
    assert [r["shape"] for r in payload["shapes"]] == ["tiny-gdn", "tiny-mamba2"]
    assert all(r["final"]["step"] == 24 for r in payload["shapes"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "long_run_drift.png").stat().st_size > 0


def test_drift_reference_step_is_the_reference_packages():
    """The script's in-place float64 step (fast, graph-capturable) against the oracles."""
    gen = torch.Generator().manual_seed(0)
    for name in sorted(drift.TINY):
        shape = drift.TINY[name]
        torch.manual_seed(1)
        drv = drift.DRIVERS[shape.family](shape, 3, 4, torch.device("cpu"))
        drv.draw()
        s = drv.layout.shape
        state = torch.randn(3, s.value_heads, s.value_dim, s.key_dim, generator=gen,
                            dtype=torch.float64)  # fmt: skip
        ours, y = state.clone(), torch.empty(3, s.value_heads, s.value_dim, dtype=torch.float64)
        drv.reference(ours, y)
        if shape.family == "mamba2":
            y_ref, new = mamba2_step(state, drv.x, drv.dt, drv.A, drv.B, drv.C, D=drv.D,
                                     dt_bias=drv.dt_bias, dt_softplus=True)  # fmt: skip
        else:
            g, beta = gdn_gates(drv.A_log, drv.a, drv.dt_bias, drv.b)
            y_ref, new = gdn_step(state, drv.q, drv.k, drv.v, g, beta)
        assert rel_err(ours, new) < 1e-13 and rel_err(y, y_ref) < 1e-13, name


def test_sample_points_are_flush_boundaries():
    points = drift.sample_steps(100_000, 16, 2050)
    assert all(p % 16 == 0 for p in points) and max(points) == 100_000
    assert {32, 64, 2064, 4128, 99_072} <= points
    assert len(points) < 80


# --- GPU: the drift run ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["nano4b", "qwen4b"])
def test_drift_run_on_gpu_stays_at_fp32_rounding(model):
    r = drift.run_shape(get_model(model), steps=4096, device="cuda", sample_every=1024)
    assert r["cuda_graph"] and r["kernel"] == "split" and r["steps"] == 4096, r
    for s in r["series"]:
        assert all(1e-9 < s[key] < 1e-5 for key in SERIES_KEYS), s


# --- GPU: 10,000 mixed steps -----------------------------------------------------------------

STEPS = 10_000


def mixed_schedule(live, batch, steps, window, pad, seed):
    """(rows, resets, counts): rows[t] the slot of every row at step t (pads included, at least
    one a step), resets[t] the slots whose sequence starts before step t (a finished one's slot
    takes a new sequence), counts[s] the steps slot s's current sequence has taken."""
    rng = random.Random(seed)
    remaining = {s: rng.randint(1, 6 * window) for s in live}
    counts = dict.fromkeys(live, 0)
    rows, resets = [], {}
    for t in range(steps):
        ending = [s for s in live if remaining[s] == 0]
        for s in ending:
            remaining[s], counts[s] = rng.randint(1, 6 * window), 0
        if ending:
            resets[t] = ending
        running = [s for s in live if rng.random() < 0.7][: batch - 1]  # others skip this step
        for s in running:
            remaining[s] -= 1
            counts[s] += 1
        row = running + [pad] * (batch - len(running))
        rng.shuffle(row)
        rows.append(row)
    return rows, resets, counts


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["split", "per-item"])
@pytest.mark.parametrize("window", [1, 4, 16])
@pytest.mark.parametrize(
    "fam", [pytest.param(Mamba2(), id="mamba2"), pytest.param(GDN(), id="gdn")]
)
@pytest.mark.parametrize("pad", [0, -1], ids=["pad0-vllm", "pad-1-sglang"])
def test_pad_and_unnamed_slots_bit_identical_after_10000_mixed_steps(fam, window, kernel, pad):
    dev, num_slots, batch = torch.device("cuda"), 24, 12
    gen = torch.Generator(device=dev).manual_seed(window)
    layout = fam.layout(window, torch.float32)
    tensors = engine_tensors(layout, num_slots, gen, dev, window)
    live = list(range(2, 2 + 14))  # slot 0 (the pad slot or unnamed), 1 and 16.. unnamed
    kept = [s for s in range(num_slots) if s not in live]
    for name in layout.ring_names:  # a live slot reads only rows its cursor holds
        tensors[name][live] = float("nan")
    reset_slots(layout, tensors, live)
    initial = snapshot(tensors)
    plan = plan_decode(layout, batch, device=dev, pad_slot_id=pad, check_slot_values=False,
                       config=LaunchConfig(kernel=kernel), **fam.plan_options())  # fmt: skip
    assert plan.kernel == kernel
    rows, resets, counts = mixed_schedule(live, batch, STEPS, window, pad, seed=window)
    ids = torch.tensor(rows, dtype=torch.int32, device=dev)
    pad_rows = (ids == pad)[:, :, None, None]
    params = fam.params(gen, dev)
    workspace = torch.empty(plan.workspace_floats, device=dev)
    out = torch.empty(batch, layout.shape.value_heads, layout.shape.value_dim, device=dev)
    nonzero_pads = torch.zeros((), dtype=torch.int64, device=dev)
    unwritten = torch.zeros((), dtype=torch.int64, device=dev)
    for t in range(STEPS):
        if t in resets:
            reset_slots(layout, tensors, torch.tensor(resets[t], device=dev), pad_slot_id=pad)
        tok = fam.token(batch, gen, dev)
        out.fill_(float("nan"))
        fam.decode(plan, tensors, params, tok, ids[t], out, workspace)
        nonzero_pads += torch.where(pad_rows[t], out, 0.0).ne(0).sum()  # (NaN counts too)
        unwritten += torch.where(pad_rows[t], 0.0, out).isnan().sum()
    torch.cuda.synchronize()
    assert nonzero_pads.item() == 0 and unwritten.item() == 0
    assert_slots_kept(initial, tensors, kept)
    cursors = tensors["cursors"][live].tolist()
    expected = [[counts[s] % window, counts[s] // window, 0, 0] for s in live]
    assert cursors == expected


# --- 10,000 mixed standard and speculative steps ---------------------------------------------


def mixed_speculative_run(fam, device, *, steps, window, T, pad, seed, config=None):
    """Standard steps and verify steps (chains and trees, per-row draft counts, fused or explicit
    commits, commits that never come) over rows that join, skip and restart; outputs poisoned
    before every call. Returns (kept slots changed?, pad outputs not zero, outputs unwritten,
    live cursors out of range), all to be zero/False."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    rng = random.Random(seed)
    layout = fam.layout(window, T, torch.float32, act_dtype=torch.float32)
    num_slots, batch = 20, 8
    tensors = layout.allocate(num_slots, dev)
    for name, t in tensors.items():
        if name != "cursors":
            t.copy_(torch.randn(t.shape, generator=gen, device=dev))
    live = list(range(2, 14))  # slots 0, 1 and 14.. are never named
    kept = [s for s in range(num_slots) if s not in live]
    reset_slots(layout, tensors, live, pad_slot_id=pad)
    initial = snapshot(tensors)
    plan = plan_decode(layout, batch, device=dev, pad_slot_id=pad, check_slot_values=False,
                       config=config)  # fmt: skip
    params = fam.params(gen, dev)
    workspace = torch.empty(plan.workspace_floats, device=dev)
    shape = fam.state_shape()[:2]
    out1 = torch.empty(batch, *shape, device=dev)
    outT = torch.empty(batch, T, *shape, device=dev)
    bad = {"pad": 0, "unwritten": 0}
    pending = dict.fromkeys(live, 0)  # drafts each slot's last verify left uncommitted
    chosen = {}  # slot -> the accept count its next verify commits (fused)
    for _ in range(steps):
        if rng.random() < 0.02:
            restarted = rng.sample(live, 3)
            reset_slots(layout, tensors, restarted, pad_slot_id=pad)
            pending.update(dict.fromkeys(restarted, 0))
        running = rng.sample(live, rng.randint(1, batch))
        rows = running + [pad] * (batch - len(running))
        rng.shuffle(rows)
        ids = torch.tensor(rows, dtype=torch.int32, device=dev)
        is_pad = torch.tensor([r == pad for r in rows], device=dev)
        drafts = fam.drafts(batch, T, gen, dev, torch.float32)
        if rng.random() < 0.5:  # a standard step (drops any pending drafts)
            token = {k: v[:, 0] for k, v in drafts.items()}
            out1.fill_(float("nan"))
            fam.decode_op()(plan, **tensors, **params, **token, slot_indices=ids, out=out1,
                            workspace=workspace)  # fmt: skip
            out = out1
            pending.update(dict.fromkeys(running, 0))
        else:
            t = [rng.randint(0, T) for _ in rows]
            tree = rng.random() < 0.3
            parents = None
            if tree:
                parents = torch.tensor([[rng.randint(-1, j - 1) for j in range(T)] for _ in rows],
                                       dtype=torch.int32, device=dev)  # fmt: skip
            fused = [min(chosen.get(r, 0), pending.get(r, 0)) for r in rows]
            outT.fill_(float("nan"))
            fam.verify(plan, tensors, params, drafts, ids, out=outT,
                       num_drafts=torch.tensor(t, dtype=torch.int32, device=dev), parents=parents,
                       num_accepted=torch.tensor(fused, dtype=torch.int32, device=dev),
                       workspace=workspace)  # fmt: skip
            out = outT
            for r, n in zip(rows, t):
                if r != pad:
                    pending[r] = n
            acc = [rng.randint(0, n) for n in t]
            chosen = {}
            if tree:  # draft 0 is always a root: accept it or nothing, by its path
                path = torch.zeros(batch, T, dtype=torch.int32, device=dev)
                first = [min(a, 1) for a in acc]
                commit_drafts(plan, tensors, slot_indices=ids, accepted_path=path,
                              num_accepted=torch.tensor(first, dtype=torch.int32, device=dev))  # fmt: skip
                pending.update(dict.fromkeys(running, 0))
            elif rng.random() < 0.5:
                chosen = {r: a for r, a in zip(rows, acc) if r != pad}  # fused into the next verify
            elif rng.random() < 0.8:
                commit_drafts(plan, tensors, slot_indices=ids,
                              num_accepted=torch.tensor(acc, dtype=torch.int32, device=dev))  # fmt: skip
                pending.update(dict.fromkeys(running, 0))
            # else: the commit never comes; the next step drops it or a verify replaces it
        pad_out = out[is_pad]
        bad["pad"] += int((pad_out != 0).sum())  # (NaN counts too)
        bad["unwritten"] += int(out[~is_pad].isnan().sum())
    cursors = tensors["cursors"][live].tolist()
    out_of_range = [c for c in cursors if not (0 <= c[0] < layout.capacity and 0 <= c[3] <= T)]
    assert_slots_kept(initial, tensors, kept)
    return bad, out_of_range


@pytest.mark.parametrize("fam", [Mamba2Family(6, 16, 32, 3), GDNFamily(2, 4, 32, 32)],
                         ids=["mamba2", "gdn"])  # fmt: skip
def test_mixed_standard_and_speculative_steps_on_cpu(fam):
    """The schedule of the GPU test below, short, on the CPU path (it checks the schedule too)."""
    bad, out_of_range = mixed_speculative_run(fam, "cpu", steps=150, window=4, T=2, pad=-1, seed=1)
    assert bad == {"pad": 0, "unwritten": 0} and not out_of_range


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "per-item"])
@pytest.mark.parametrize("pad", [0, -1], ids=["pad0-vllm", "pad-1-sglang"])
@pytest.mark.parametrize("fam", [Mamba2Family(128, 64, 128, 8), GDNFamily(16, 32, 128, 128)],
                         ids=["super120b", "qwen4b"])  # fmt: skip
def test_pad_and_unnamed_slots_bit_identical_after_10000_standard_and_speculative_steps(
    fam, pad, kernel
):
    config = LaunchConfig(kernel=kernel) if kernel != "auto" else None
    bad, out_of_range = mixed_speculative_run(fam, "cuda", steps=STEPS, window=4, T=2, pad=pad,
                                              seed=7, config=config)  # fmt: skip
    assert bad == {"pad": 0, "unwritten": 0} and not out_of_range
