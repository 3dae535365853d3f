"""scripts/sanitize_kernels.py's schedules: run_config (decode) and run_spec_config (drafts)."""

from __future__ import annotations

import zlib
from dataclasses import replace

import torch
from sanitize_configs import (
    BATCH,
    FAULT_SLOT,
    FULL_STEPS,
    JOIN_STEPS,
    LIVE_SLOTS,
    NUM_SLOTS,
    OUT_OF_RANGE_IDS,
    PAD,
    PLAN_SEED,
    SPEC_CORRUPT,
    STEP_SEED,
    WINDOW,
    Config,
    SpecConfig,
    case_of,
    make_layout,
    plan_options,
)

from replayssm_jit import commit_drafts, plan_decode
from replayssm_jit.core.codecs import raw_bits
from replayssm_jit.reference import root_path

# ---------------------------------------------------------------------------------------------
# One config's schedule
# ---------------------------------------------------------------------------------------------


class ConfigFailed(AssertionError):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise ConfigFailed(what)


def run_config(cfg: Config, *, device: torch.device, steps: int, outputs: str,
               empty_rings: bool) -> None:  # fmt: skip
    case = case_of(cfg.family)
    gen = torch.Generator().manual_seed(zlib.crc32(cfg.name.encode()))
    layout = make_layout(cfg.family, cfg.state)
    plan = plan_decode(
        layout, BATCH, device=device, mode=cfg.mode, config=cfg.launch_config(),
        seed=PLAN_SEED, check_slot_values=False, **plan_options(cfg.family, cfg.sr),
    )  # fmt: skip
    check(plan.spec.uri == cfg.uri, f"planned {plan.spec.uri}, expected {cfg.uri}")
    if device.type == "cuda":
        got = (plan.kernel, plan.rows_per_cta, plan.flag_bits & cfg.fixed_bits)
        want = (cfg.kernel, cfg.rows_per_cta, cfg.flags & cfg.fixed_bits)
        check(got == want, f"planned (kernel, rows, flags) {got}, expected {want}")
    shape, act = layout.shape, layout.act_dtype
    replay = cfg.mode == "replay"
    # Speculative loads read every ring row, held or not, so their rings are always initialised;
    # --empty-rings leaves the others' rings uninitialised (initcheck: only held rows are read).
    rings_empty = empty_rings and replay and not cfg.speculative
    host: dict[str, torch.Tensor] = {}
    slot_tensors: dict[str, torch.Tensor] = {}
    for t in layout.tensors():
        checkpoint = t.name in layout.checkpoint_names
        if not checkpoint and not replay:
            continue
        if t.name == "cursors":
            host[t.name] = torch.zeros(t.shape(NUM_SLOTS), dtype=t.dtype)
        elif not checkpoint and rings_empty:
            slot_tensors[t.name] = torch.empty(t.shape(NUM_SLOTS), dtype=t.dtype, device=device)
            continue
        elif t.dtype == torch.float4_e2m1fn_x2:  # every byte is two valid e2m1 codes
            codes = torch.randint(0, 256, t.shape(NUM_SLOTS), generator=gen, dtype=torch.uint8)
            host[t.name] = codes.view(t.dtype)
        else:
            values = torch.randn(t.shape(NUM_SLOTS), generator=gen)
            host[t.name] = (values.abs() if t.name.endswith("scale") else values).to(t.dtype)
        slot_tensors[t.name] = host[t.name].to(device)
    params = {k: v.to(device) for k, v in case.params(shape, gen).items()}
    out_shape = (BATCH, shape.value_heads, shape.value_dim)
    held = dict.fromkeys(LIVE_SLOTS, 0)
    epochs = dict.fromkeys(LIVE_SLOTS, 0)
    corrupt_held = (WINDOW, layout.capacity, -1, -(2**31), 2**31 - 1)
    for step in range(steps):
        active = [s for s, join in zip(LIVE_SLOTS, JOIN_STEPS) if join <= step]
        faulted = [FAULT_SLOT] if replay else []
        if device.type == "cuda":
            faulted.append(OUT_OF_RANGE_IDS[step % len(OUT_OF_RANGE_IDS)])
        rows = active + faulted + [PAD] * (BATCH - len(active) - len(faulted))
        rows = [rows[i] for i in torch.randperm(BATCH, generator=gen).tolist()]
        slot_indices = torch.tensor(rows, dtype=torch.int32).to(device)
        if replay:  # a host-to-device copy of the slot's cursor row, not a kernel
            host["cursors"][FAULT_SLOT, 0] = corrupt_held[step % len(corrupt_held)]
            slot_tensors["cursors"][FAULT_SLOT].copy_(host["cursors"][FAULT_SLOT])
        tok = {k: v.to(device) for k, v in case.token(shape, BATCH, act, gen).items()}
        if outputs == "empty":
            out = torch.empty(out_shape, dtype=act, device=device)
        else:
            out = torch.full(out_shape, float("nan"), dtype=act).to(device)
        seed = None
        if step % 2 and cfg.sr:  # only device_seed modules read a seed tensor
            seed = torch.tensor([STEP_SEED + step], dtype=torch.int64).to(device)
        case.decode(
            plan, **slot_tensors, **params, **tok, slot_indices=slot_indices, out=out, seed=seed
        )
        got = out.cpu()  # a copy of the raw output: initcheck reports any element left unwritten
        live_rows = [i for i, s in enumerate(rows) if s in active]
        pad_rows = [i for i, s in enumerate(rows) if s == PAD]
        fault_rows = [i for i, s in enumerate(rows) if s in faulted]
        check(
            bool(torch.isfinite(got[live_rows]).all()),
            f"step {step}: output not finite (or left NaN)",
        )
        check(bool((got[pad_rows] == 0).all()), f"step {step}: pad rows not zero")
        check(bool(torch.isnan(got[fault_rows]).all()), f"step {step}: faulted rows not all NaN")
        for s in active:
            if cfg.kernel == "flush-every-step":
                epochs[s] += 1
            elif cfg.kernel != "conventional":
                flush = held[s] + 1 >= WINDOW
                held[s] = 0 if flush else held[s] + 1
                epochs[s] += int(flush)
    if device.type == "cuda":
        torch.cuda.synchronize()
    live = list(LIVE_SLOTS)
    untouched = [s for s in range(NUM_SLOTS) if s not in LIVE_SLOTS]
    final = {name: raw_bits(t.cpu()) for name, t in slot_tensors.items() if name in host}
    if layout.state_dtype != torch.float4_e2m1fn_x2:  # (e2m1 codes are all finite)
        check(bool(torch.isfinite(final["state"][live].view(layout.state_dtype).float()).all()),
              "live checkpoints not finite")  # fmt: skip
    for name, t in final.items():
        check(torch.equal(t[untouched], raw_bits(host[name])[untouched]),
              f"unnamed slots' {name} changed")  # fmt: skip
    if replay:
        want = [[held[s], epochs[s], 0, 0] for s in LIVE_SLOTS]
        got = final["cursors"][live].tolist()
        check(got == want, f"cursors {got}, expected {want}")


def _check_draft_outputs(got: torch.Tensor, rows: list[int], counts: list[int], live: list[int],
                         faulted: list[int], step: int) -> None:  # fmt: skip
    """Live rows: drafts j < t finite, the rest zero; pad rows zero; faulted rows all NaN."""
    for b, s in enumerate(rows):
        if s in live:
            t = counts[b]
            check(bool(torch.isfinite(got[b, :t]).all()), f"step {step}: row {b} not finite")
            check(bool((got[b, t:] == 0).all()), f"step {step}: row {b} drafts past {t} not zero")
        elif s == PAD:
            check(bool((got[b] == 0).all()), f"step {step}: pad row {b} not zero")
        elif s in faulted:
            check(bool(torch.isnan(got[b]).all()), f"step {step}: faulted row {b} not all NaN")


def run_spec_config(cfg: SpecConfig, *, device: torch.device, steps: int, outputs: str) -> None:
    """A speculative config's schedule: the decode schedule's rows (live slots joining at steps
    0, 1 and 3, pad rows, an out-of-range id on CUDA, slot 5's corrupted cursor for verify),
    per-row draft counts cycling through 0..T. verify: chains on even steps (every fourth one
    committed by commit_drafts, the others by the next verify's fused commit), trees on odd
    steps committed by commit_drafts with the deepest draft's root path; commits mostly accept
    everything, so that held records reach the early flush and later drafts rewrite ring rows.
    snapshot: each live slot's T snapshot slots after the pool's six, an out-of-range snapshot
    slot on CUDA (a write skipped), and slot 0 named by the rows that must not read theirs."""
    case = case_of(cfg.family)
    # Both verify kernels of a spec and tile run the same schedule (whose coverage is checked).
    gen = torch.Generator().manual_seed(zlib.crc32(replace(cfg, kernel="per-item").name.encode()))
    T, verify = cfg.drafts, cfg.op == "verify"
    layout = make_layout(cfg.family, cfg.state, T)
    plan = plan_decode(
        layout, BATCH, device=device, config=cfg.launch_config(), seed=PLAN_SEED,
        check_slot_values=False, **plan_options(cfg.family, cfg.sr),
    )  # fmt: skip
    check(plan.spec.uri == cfg.uri, f"planned {plan.spec.uri}, expected {cfg.uri}")
    if device.type == "cuda":
        rows = plan.verify_rows_per_cta
        check(rows == cfg.rows_per_cta, f"planned verify rows {rows}, expected {cfg.rows_per_cta}")
        if verify:
            check(plan.verify_kernel == cfg.kernel,
                  f"planned verify kernel {plan.verify_kernel}, expected {cfg.kernel}")  # fmt: skip
    num_slots = NUM_SLOTS + len(LIVE_SLOTS) * T
    host: dict[str, torch.Tensor] = {}
    for t in layout.tensors():
        if t.name == "cursors":
            host[t.name] = torch.zeros(t.shape(num_slots), dtype=t.dtype)
        else:  # (rings always initialised: which rows the verify kernels load is theirs to pick)
            host[t.name] = torch.randn(t.shape(num_slots), generator=gen).to(t.dtype)
    slot_tensors = {name: t.to(device) for name, t in host.items()}
    shape, act = layout.shape, layout.act_dtype
    params = {k: v.to(device) for k, v in case.params(shape, gen).items()}
    out_shape = (BATCH, T, shape.value_heads, shape.value_dim)
    held = dict.fromkeys(LIVE_SLOTS, 0)
    pending = dict.fromkeys(LIVE_SLOTS, 0)
    epochs = dict.fromkeys(LIVE_SLOTS, 0)
    snap_of = {s: [NUM_SLOTS + i * T + j for j in range(T)] for i, s in enumerate(LIVE_SLOTS)}
    written: set[int] = set()
    flushed: set[int] = set()
    seen = {"flush": 0, "mixed": 0, "rewrite": 0, "tree": 0, "fused": 0, "zero": 0}
    for step in range(steps):
        active = [s for s, join in zip(LIVE_SLOTS, JOIN_STEPS) if join <= step]
        faulted = [FAULT_SLOT] if verify else []
        if device.type == "cuda":  # (ids past this pool's end: the snapshot slots follow 0..5)
            out_of_range = (num_slots, *OUT_OF_RANGE_IDS[1:])
            faulted.append(out_of_range[step % len(out_of_range)])
        rows = active + faulted + [PAD] * (BATCH - len(active) - len(faulted))
        rows = [rows[i] for i in torch.randperm(BATCH, generator=gen).tolist()]
        slot_indices = torch.tensor(rows, dtype=torch.int32).to(device)
        counts = [(step + b) % (T + 1) for b in range(BATCH)]
        num_drafts = torch.tensor(counts, dtype=torch.int32).to(device)
        tok = case.token(shape, BATCH * T, act, gen)
        inputs = {k: v.view(BATCH, T, *v.shape[1:]).to(device) for k, v in tok.items()}
        if outputs == "empty":
            out = torch.empty(out_shape, dtype=act, device=device)
        else:
            out = torch.full(out_shape, float("nan"), dtype=act).to(device)
        live_rows = [(b, s) for b, s in enumerate(rows) if s in active]
        seen["zero"] += sum(counts[b] == 0 for b, _ in live_rows)
        if not verify:
            table = [[0] * T if s not in active else list(snap_of[s]) for s in rows]
            if device.type == "cuda" and step % 2 and live_rows:
                table[live_rows[0][0]][0] = num_slots + step  # (its write is skipped)
            snapshot_slots = torch.tensor(table, dtype=torch.int32).to(device)
            case.snapshot(plan, state=slot_tensors["state"], **params, **inputs,
                          slot_indices=slot_indices, snapshot_slots=snapshot_slots, out=out,
                          num_drafts=num_drafts)  # fmt: skip
            _check_draft_outputs(out.cpu(), rows, counts, active, faulted, step)
            for b, _ in live_rows:
                written.update(x for x in table[b][: counts[b]] if 0 <= x < num_slots)
            continue
        # A corrupted cursor before each step (a host-to-device copy of its row, not a kernel).
        bad_n, bad_p = SPEC_CORRUPT[step % len(SPEC_CORRUPT)](T)
        host["cursors"][FAULT_SLOT, 0], host["cursors"][FAULT_SLOT, 3] = bad_n, bad_p
        slot_tensors["cursors"][FAULT_SLOT].copy_(host["cursors"][FAULT_SLOT])
        tree = step % 2 == 1
        parents = None
        if tree and step % 4 == 1:  # two interleaved chains: every deeper path compacts
            table = [[-1, -1, *range(T - 2)] for _ in rows]
        elif tree:
            table = [[-1] + [int(torch.randint(-1, j, (1,), generator=gen)) for j in range(1, T)]
                     for _ in rows]  # fmt: skip
        if tree:
            parents = torch.tensor(table, dtype=torch.int32)
        accept = [pending.get(s, 0) - (pending.get(s, 0) // 2 if (step + b) % 3 == 0 else 0)
                  for b, s in enumerate(rows)]  # fmt: skip
        seed = None
        if step % 2 and cfg.sr:
            seed = torch.tensor([STEP_SEED + step], dtype=torch.int64).to(device)
        case.verify(
            plan, **slot_tensors, **params, **inputs, slot_indices=slot_indices, out=out,
            num_drafts=num_drafts, parents=None if parents is None else parents.to(device),
            num_accepted=torch.tensor(accept, dtype=torch.int32).to(device), seed=seed,
        )  # fmt: skip
        _check_draft_outputs(out.cpu(), rows, counts, active, faulted, step)
        flushes = []
        for b, s in live_rows:
            seen["fused"] += int(accept[b] > 0)
            held[s] += min(accept[b], pending[s])
            flush = held[s] + counts[b] >= WINDOW + T
            flushes.append(flush)
            if flush:
                held[s], epochs[s] = 0, epochs[s] + 1
                flushed.add(s)
            elif s in flushed and counts[b]:
                seen["rewrite"] += 1
            pending[s] = counts[b]
        seen["flush"] += sum(flushes)
        seen["mixed"] += int(any(flushes) and not all(flushes))
        if tree or step % 4 == 2:  # explicit commits: the tree's deepest path, or a chain's all
            paths = []
            for b, s in enumerate(rows):
                p = pending.get(s, 0) if s in active else 0
                if tree and p:
                    paths.append(root_path(table[b][:p], p - 1))
                else:
                    paths.append(list(range(p)))
            seen["tree"] += int(any(p != list(range(len(p))) for p in paths))  # (a compaction)
            accepted = torch.tensor([len(p) for p in paths], dtype=torch.int32).to(device)
            path = None
            if tree:
                padded = [p + [0] * (T - len(p)) for p in paths]
                path = torch.tensor(padded, dtype=torch.int32).to(device)
            commit_drafts(plan, slot_tensors, num_accepted=accepted, slot_indices=slot_indices,
                          accepted_path=path)  # fmt: skip
            for b, s in live_rows:
                held[s] += len(paths[b])
                pending[s] = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
    final = {name: t.cpu() for name, t in slot_tensors.items()}
    live = list(LIVE_SLOTS)
    if verify:
        check(bool(torch.isfinite(final["state"][live].float()).all()), "checkpoints not finite")
        want = [[held[s], epochs[s], 0, pending[s]] for s in LIVE_SLOTS]
        got = final["cursors"][live].tolist()
        check(got == want, f"cursors {got}, expected {want}")
        untouched = [s for s in range(num_slots) if s not in LIVE_SLOTS]
        if steps >= FULL_STEPS:  # the full schedule reaches every case it is written for
            check(all(seen.values()), f"the schedule missed a case: {seen}")
    else:
        check(bool(torch.isfinite(final["state"][sorted(written)].float()).all()),
              "snapshots not finite")  # fmt: skip
        untouched = [s for s in range(num_slots) if s not in written]
        for name in layout.ring_names + ("cursors",):  # (a snapshot writes checkpoints alone)
            check(torch.equal(final[name], host[name]), f"snapshot changed {name}")
    for name, t in final.items():
        check(torch.equal(t[untouched], host[name][untouched]), f"unwritten slots' {name} changed")
