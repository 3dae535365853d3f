"""Speculative decoding on one GPU: our verify step against our T = 1 step and our conventional
spec baseline (one state snapshot per draft, then a copy of the accepted one).

For each (shape, batch, T), FP32 checkpoints, L = 16, BF16 activations:
  * verify_mixed / verify_paper: our verify step with the previous step's accepted counts fused
    in (vLLM's num_accepted_tokens), timed over a steady-state cycle: the slots' cursors run
    through the same accept pattern for many steps before timing, so early flushes come at their
    natural rate, which is reported (flushes per row-step). Acceptance "mixed": uniform 1..T per
    row; "paper": the ReplaySSM paper's mean acceptance lengths (1.95 / 3.43 / 4.24 / 4.40 for
    T = 2 / 4 / 6 / 8), a per-row mix of the two nearest counts;
  * t1: our standard step (T = 1 layout), over L-step cycles with staggered cursors;
  * snapshot: the conventional spec baseline, snapshot_step then commit_snapshots;
  * tree (T = 8 only): a binary draft tree of depth 3 ([-1, 0, 0, 1, 1, 2, 2, 3]) verified and
    committed along a random root path (explicit commit), against the chain of 8 with fused
    commits;
  * GDN and KDA shapes, where fla-core is installed: fla_per_token_states, fla's
    fused_recurrent_gated_delta_rule (fused_recurrent_kda) run token by token from an initial
    state with each draft's state written (what a snapshot engine needs: T reads and T writes of
    the state), and fla_T_tokens, one call over the T drafts with the final state only (1 read +
    1 write; it cannot roll back, a floor for a conventional engine). KDA also gets
    fla_spec_decode, vLLM's call: one launch that reads the state of each row's last accepted
    token (num_accepted_tokens) and writes a state per draft into a (batch, T) slot table
    (ssm_state_indices); fla 0.6's GDN recurrence has no such form.
Every call is captured in a CUDA graph over disjoint slot sets (pool >= --min-pool-bytes) and
timed with CUDA events (harness.time_graph: median of --reps x --rounds replays).

    python benchmarks/bench_verify.py [--shapes super120b,...] [--batches 1,8,64,256] [--ts 2,4,8]
"""

from __future__ import annotations

import argparse
import inspect
import math
import random
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from harness import SCRATCH_DIR, copy_ceiling, environment, time_graph, write_results
from support.verify_schedule import GDNFamily, KDAFamily, Mamba2Family

from replayssm_jit import LaunchConfig, commit_drafts, commit_snapshots, plan_decode, reset_slots
from replayssm_jit.core.models import get_model
from replayssm_jit.families.spec import spec_tilings
from replayssm_jit.launch.config import parse_launch

PAPER_ACCEPTANCE = {2: 1.95, 4: 3.43, 6: 4.24, 8: 4.40}
TREE_8 = [-1, 0, 0, 1, 1, 2, 2, 3]
WINDOW = 16


def family_of(model):
    if model.family == "mamba2":
        return Mamba2Family(model.value_heads, model.d_v, model.d_k, model.key_heads)
    cls = KDAFamily if model.family == "kda" else GDNFamily
    return cls(model.key_heads, model.value_heads, model.d_k, model.d_v)


def acceptance(kind: str, T: int, batch: int, rng: random.Random) -> list[int]:
    if kind == "mixed":
        return [rng.randint(1, T) for _ in range(batch)]
    mean = PAPER_ACCEPTANCE[T]
    lo = math.floor(mean)
    return [min(T, lo + (1 if rng.random() < mean - lo else 0)) for _ in range(batch)]


def slot_sets(nsets: int, per_set: int, dev) -> list[torch.Tensor]:
    perm = torch.randperm(nsets * per_set, device=dev).to(torch.int32)
    return [perm[i * per_set : (i + 1) * per_set].contiguous() for i in range(nsets)]


def pool(layout, num_slots, dev, gen):
    tensors = layout.allocate(num_slots, dev)
    tensors["state"].normal_(0, 0.3, generator=gen)
    reset_slots(layout, tensors, torch.arange(num_slots, device=dev), tensors["state"].clone())
    return tensors


def flush_rate(tensors, calls, steps_per_pass, rows) -> float:
    """Flushes per row-step over one eager pass of `calls` (from the cursors' epochs)."""
    before = tensors["cursors"][:, 1].sum().item()
    for c in calls:
        c()
    torch.cuda.synchronize()
    return (tensors["cursors"][:, 1].sum().item() - before) / (steps_per_pass * rows)


def bench_config(name, batch, T, args, rng):
    model, dev = get_model(name), torch.device("cuda")
    fam = family_of(model)
    gen = torch.Generator(device=dev).manual_seed(batch * 7 + T)
    kw = dict(reps=args.reps, rounds=args.rounds)
    rows = []
    layout = fam.layout(WINDOW, T, torch.float32)
    slot_bytes = layout.bytes_per_slot()
    nsets = max(2, math.ceil(args.min_pool_bytes / (slot_bytes * batch)))
    params = fam.params(gen, dev)
    drafts = fam.drafts(batch, T, gen, dev, torch.bfloat16)
    state_bytes = model.state_bytes(4) * batch

    def row(kernel, us, **extra):
        rows.append(dict(shape=name, batch=batch, T=T, L=WINDOW, kernel=kernel, us=us,
                         state_gb=state_bytes / 1e9, **extra))  # fmt: skip

    # Our verify, steady state, two acceptance models (fused commit).
    tensors = pool(layout, nsets * batch, dev, gen)
    plan = plan_decode(layout, batch, device=dev, check_slot_values=False)
    sets = slot_sets(nsets, batch, dev)

    def scratch(plan):
        return torch.empty(plan.workspace_floats, dtype=torch.float32, device=dev)

    workspace = scratch(plan)
    for kind in ("mixed", "paper"):
        if kind == "paper" and T not in PAPER_ACCEPTANCE:
            continue
        steps = args.cycle_steps
        accepted = [torch.tensor(acceptance(kind, T, batch, rng), dtype=torch.int32, device=dev)
                    for _ in range(steps)]  # fmt: skip
        out = torch.empty(batch, T, *fam.state_shape()[:2], dtype=torch.bfloat16, device=dev)
        calls = [
            (
                lambda s=s, a=a, out=out: fam.verify(
                    plan, tensors, params, drafts, s, out=out, num_accepted=a, workspace=workspace
                )
            )
            for a in accepted
            for s in sets
        ]
        for _ in range(3):  # into the steady state
            for c in calls:
                c()
        rate = flush_rate(tensors, calls, steps * nsets, batch)
        t = time_graph(calls, **kw)
        mean_acc = sum(sum(a.tolist()) for a in accepted) / (steps * batch)
        # (verify_flag_bits None: a tree from before the verify had its own flags)
        row(f"verify_{kind}", t["us"], flush_rate=rate, mean_accepted=mean_acc,
            rows_per_cta=plan.verify_rows_per_cta, verify_kernel=plan.verify_kernel,
            verify_flag_bits=getattr(plan, "verify_flag_bits", None))  # fmt: skip

    def time_mixed(other):
        """us per step of `other` (a plan of another launch) in the mixed acceptance cycle."""
        ws = scratch(other)
        out = torch.empty(batch, T, *fam.state_shape()[:2], dtype=torch.bfloat16, device=dev)
        accepted = [torch.tensor(acceptance("mixed", T, batch, rng), dtype=torch.int32, device=dev)
                    for _ in range(args.cycle_steps)]  # fmt: skip
        calls = [
            (lambda s=s, a=a: fam.verify(other, tensors, params, drafts, s, out=out,
                                         num_accepted=a, workspace=ws))
            for a in accepted
            for s in sets
        ]  # fmt: skip
        for _ in range(3):
            for c in calls:
                c()
        return time_graph(calls, **kw)["us"]

    # The verify kernels the policy did not pick (--verify-kernels), mixed acceptance.
    for kernel in [k for k in args.verify_kernels.split(",") if k]:
        other = plan_decode(layout, batch, device=dev, check_slot_values=False,
                            config=LaunchConfig(kernel=kernel))  # fmt: skip
        if other.verify_kernel != plan.verify_kernel:
            row(f"verify_mixed_{other.verify_kernel}", time_mixed(other),
                rows_per_cta=other.verify_rows_per_cta, verify_kernel=other.verify_kernel)  # fmt: skip

    # The policy's verify under launch overrides (--verify-launches LABEL=SPEC;...), mixed acceptance.
    for entry in [e for e in args.verify_launches.split(";") if e]:
        label, spec = entry.split("=", 1)
        other = plan_decode(layout, batch, device=dev, check_slot_values=False,
                            config=parse_launch(spec, "--verify-launches"))  # fmt: skip
        row(f"verify_mixed_{label}", time_mixed(other), launch=spec,
            verify_flag_bits=getattr(other, "verify_flag_bits", None))  # fmt: skip

    # The other compiled row tiles of the verify kernel (--verify-tiles), mixed acceptance.
    for rows_per_cta in [int(r) for r in args.verify_tiles.split(",") if r]:
        compiled = [r for r, _ in spec_tilings(plan.spec)]
        if rows_per_cta == plan.verify_rows_per_cta or batch < 64 or rows_per_cta not in compiled:
            continue
        tiled = plan_decode(layout, batch, device=dev, check_slot_values=False,
                            config=LaunchConfig(rows_per_cta=rows_per_cta))  # fmt: skip
        row(f"verify_mixed_rows{rows_per_cta}", time_mixed(tiled), rows_per_cta=rows_per_cta)

    # Tree verify at T = 8 (explicit commit of a random root path) beside the chain.
    if T == 8 and args.baselines:
        tensors = pool(layout, nsets * batch, dev, gen)
        parents = torch.tensor([TREE_8] * batch, dtype=torch.int32, device=dev)
        paths, counts = [], []
        for _ in range(args.cycle_steps):
            p = torch.zeros(batch, T, dtype=torch.int32)
            c = torch.zeros(batch, dtype=torch.int32)
            for b in range(batch):
                node = rng.randrange(T)
                path = [node]
                while TREE_8[path[-1]] >= 0:
                    path.append(TREE_8[path[-1]])
                path = path[::-1]
                p[b, : len(path)] = torch.tensor(path)
                c[b] = len(path)
            paths.append(p.to(dev))
            counts.append(c.to(dev))
        out = torch.empty(batch, T, *fam.state_shape()[:2], dtype=torch.bfloat16, device=dev)
        calls = []
        for p, c in zip(paths, counts):
            for s in sets:
                calls.append(lambda s=s: fam.verify(plan, tensors, params, drafts, s, out=out,
                                                    parents=parents, workspace=workspace))  # fmt: skip
                calls.append(lambda s=s, p=p, c=c: commit_drafts(plan, tensors, num_accepted=c,
                                                                 slot_indices=s, accepted_path=p))  # fmt: skip
        for _ in range(3):
            for c in calls:
                c()
        t = time_graph(calls, **kw)
        row("tree_verify_commit", t["us"] * 2, mean_accepted=sum(c.sum().item() for c in counts)
            / (len(counts) * batch))  # fmt: skip

    # Our T = 1 step, staggered cursors over L-step cycles.
    layout1 = fam.layout(WINDOW, 1, torch.float32)
    nsets1 = max(2, math.ceil(args.min_pool_bytes / (layout1.bytes_per_slot() * batch)))
    tensors = pool(layout1, nsets1 * batch, dev, gen)
    plan1 = plan_decode(layout1, batch, device=dev, check_slot_values=False)
    sets1 = slot_sets(nsets1, batch, dev)
    token = {k: v[:, 0].contiguous() for k, v in drafts.items()}
    out1 = torch.empty(batch, *fam.state_shape()[:2], dtype=torch.bfloat16, device=dev)
    for s in sets1:  # cursors spread over 0..L-1, so each step flushes about 1/L of its rows
        tensors["cursors"][s.long(), 0] = (torch.arange(batch, device=dev) % WINDOW).to(torch.int32)
    step = fam.decode_op()
    calls = [(lambda s=s: step(plan1, **tensors, **params, **token, slot_indices=s, out=out1))
             for _ in range(WINDOW) for s in sets1]  # fmt: skip
    t = time_graph(calls, **kw)
    row("t1", t["us"], kernel_t1=plan1.kernel)

    # The conventional spec baseline: T snapshots per row, then the accepted one copied back.
    if not args.baselines:
        torch.cuda.empty_cache()
        return rows
    per_row = 1 + T
    nsets_c = max(2, math.ceil(args.min_pool_bytes / (model.state_bytes(4) * per_row * batch)))
    state = torch.empty((nsets_c * batch * per_row, *fam.state_shape()), device=dev)
    state.normal_(0, 0.3, generator=gen)
    cplan = plan_decode(layout, batch, device=dev, check_slot_values=False)  # (its module has them)
    perm = torch.randperm(nsets_c * batch * per_row, device=dev).to(torch.int32)
    blocks = perm.view(nsets_c, batch, per_row)
    accepted = torch.tensor(acceptance("mixed", T, batch, rng), dtype=torch.int32, device=dev)
    out = torch.empty(batch, T, *fam.state_shape()[:2], dtype=torch.bfloat16, device=dev)
    calls = []
    for blk in blocks:
        live, snaps = blk[:, 0].contiguous(), blk[:, 1:].contiguous()
        calls.append(lambda live=live, snaps=snaps: fam.snapshot(cplan, state, params, drafts,
                                                                  live, snaps, out=out))  # fmt: skip
        calls.append(
            lambda live=live, snaps=snaps: commit_snapshots(
                cplan, state=state, snapshot_slots=snaps, num_accepted=accepted, slot_indices=live
            )
        )
    t = time_graph(calls, **kw)
    row("snapshot", t["us"] * 2)
    t = time_graph(calls[0::2], **kw)
    row("snapshot_kernel_only", t["us"])
    calls = state = None  # the fla peers allocate their own states
    torch.cuda.empty_cache()
    if model.family in ("gdn", "kda") and args.fla:
        for peer, us in fla_rows(
            model.family, fam, batch, T, drafts, params, nsets_c, gen, args, rng
        ):
            row(peer, us)
    torch.cuda.empty_cache()
    return rows


def fla_rows(
    family, fam, batch, T, drafts, params, nsets, gen, args, rng
) -> list[tuple[str, float]]:
    """fla's spec forms (see the module docstring) over `nsets` rotating FP32 states."""
    try:
        if family == "kda":
            from fla.ops.kda import fused_recurrent_kda as fla_fn
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as spec_fn
        else:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fn

            spec_fn = None
    except ImportError as exc:
        print(f"  fla unavailable: {exc}", flush=True)
        return []
    v_first = "state_v_first" in inspect.signature(fla_fn).parameters
    shape = (fam.HV, fam.V, fam.K) if v_first else (fam.HV, fam.K, fam.V)
    states = [torch.randn((batch, *shape), generator=gen, device="cuda") for _ in range(nsets)]
    q, k, v, a, b = (drafts[n] for n in ("q", "k", "v", "a", "b"))
    kw = dict(scale=fam.K**-0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=params["A_log"], dt_bias=params["dt_bias"], use_beta_sigmoid_in_kernel=True,
              **(dict(state_v_first=True) if v_first else {}))  # fmt: skip

    def run(h, lo, hi):
        return fla_fn(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g=a[:, lo:hi], beta=b[:, lo:hi],
                      initial_state=h, output_final_state=True, **kw)  # fmt: skip

    def per_token(h):
        def call():
            state = h
            for j in range(T):
                _, state = run(state, j, j + 1)

        return call

    peers = [
        ("fla_per_token_states", [per_token(h) for h in states]),
        ("fla_T_tokens", [lambda h=h: run(h, 0, T) for h in states]),
    ]
    if spec_fn is not None:
        pool = torch.randn((nsets * batch * T, *shape), generator=gen, device="cuda")
        tables = (
            torch.randperm(nsets * batch * T, device="cuda").to(torch.int32).view(nsets, batch, T)
        )
        accepted = torch.tensor(
            acceptance("mixed", T, batch, rng), dtype=torch.int32, device="cuda"
        )

        def spec(table):
            return spec_fn(q, k, v, a, b, initial_state=pool, inplace_final_state=True,
                           ssm_state_indices=table, num_accepted_tokens=accepted, **kw)  # fmt: skip

        peers.append(("fla_spec_decode", [lambda t=t: spec(t) for t in tables]))
    rows = []
    for name, calls in peers:
        try:  # a peer's failure must not lose this config's other rows
            rows.append((name, time_graph(calls, reps=args.reps, rounds=args.rounds)["us"]))
        except Exception:
            traceback.print_exc()
            return rows
    outputs = [run(states[0], 0, T)[0]] + ([spec(tables[0])[0]] if spec_fn is not None else [])
    assert all(torch.isfinite(o.float()).all() for o in outputs), "fla: non-finite output"
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="super120b,nano4b,qwen4b,qwen122b,kimi48b")
    p.add_argument("--batches", default="256,64,8,1")
    p.add_argument("--ts", default="2,4,8")
    p.add_argument("--verify-kernels", default="split,per-item",
                   help="verify kernels also timed where the policy picks another")  # fmt: skip
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cycle-steps", type=int, default=8)
    p.add_argument(
        "--verify-tiles", default="", help="other verify row tiles to time (batch >= 64)"
    )
    p.add_argument("--verify-launches", default="",
                   help="LABEL=SPEC;...: the policy's verify also timed under LaunchConfig SPEC")  # fmt: skip
    p.add_argument("--no-baselines", dest="baselines", action="store_false",
                   help="skip the tree verify, the snapshot baseline and fla (T = 1 stays)")  # fmt: skip
    p.add_argument("--min-pool-bytes", type=float, default=1.0e9)
    p.add_argument(
        "--no-fla", dest="fla", action="store_false", help="skip fla's GDN and KDA peers"
    )
    p.add_argument("--out", type=Path, default=SCRATCH_DIR)
    args = p.parse_args(argv)
    rng = random.Random(0)
    payload = {"environment": environment(), "command": " ".join(sys.argv),
               "copy": copy_ceiling(), "rows": []}  # fmt: skip
    print(f"copy ceiling measured: {payload['copy']['tbps']:.2f} TB/s", flush=True)
    # Largest batches first: they carry the targets, and a cut-short run keeps them.
    for batch in map(int, args.batches.split(",")):
        for name in args.shapes.split(","):
            for T in map(int, args.ts.split(",")):
                try:
                    rows = bench_config(name, batch, T, args, rng)
                except Exception as exc:  # one failed config must not lose the others
                    traceback.print_exc()
                    payload["rows"].append(dict(shape=name, batch=batch, T=T, error=repr(exc)))
                    continue
                payload["rows"] += rows
                summary = "  ".join(f"{r['kernel']}={r['us']:.1f}" for r in rows)
                print(f"{name} b={batch} T={T}: {summary}", flush=True)
                write_results(args.out / "verify.json", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
