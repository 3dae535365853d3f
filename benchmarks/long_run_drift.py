"""Long-run drift of FP32 ReplaySSM against a float64 conventional decode (issue 21, section 4).

For each shape, `batch` sequences decode `steps` tokens three ways side by side on one device:
our ReplaySSM op (FP32 checkpoints, window L, the split kernel by default: at batch 8 the
launch policy would flush every token and hold nothing), the float64 conventional recurrence
(docs/design.md's math, one step at a time) and our FP32 conventional op (the drift any FP32
state has, for comparison). Sequence b starts at step b * L // batch, so every launch mixes
flushing and non-flushing rows. Every step draws fresh random inputs; each head's per-step decay
is log-uniform in [0.99, 0.999] and the state term dominates the output, so a rounding error
is remembered for hundreds to thousands of steps rather than forgotten at once.

At sample points (every --sample-every steps and at 2L, 4L, 8L, ...; all multiples of L):
  state drift  ||S - S64|| / ||S64|| over the batch: the ReplaySSM checkpoint against the float64
               state at each sequence's last flush (where the checkpoint is the state), and the
               FP32 conventional state against the current float64 state;
  output drift ||y - y64|| / ||y64|| per row and step: max and mean over every step since the
               previous sample.

    python benchmarks/long_run_drift.py [--steps 100000] [--batch 8] [--window 16]
        [--shapes nano4b,super120b,qwen4b,qwen122b] [--sample-every 2048] [--kernel split]
        [--device cuda] [--time-budget 120] [--seed 0] [--out DIR] [--no-graph]
        [--cpu-threads 1]
    python benchmarks/long_run_drift.py --device cpu --shapes tiny-mamba2,tiny-gdn --steps 512

Writes long_run_drift.json (date, device, torch, git commit, command line, per-shape series and
final values) and long_run_drift.png (drift vs step, log y) into --out (default
benchmarks/scratch/long_run, git-ignored), and prints a table. On a GPU every L steps (inputs
drawn on the device, all three decodes, the error sums) are one captured CUDA graph, and the
host syncs only at sample points; --time-budget stops a shape early (at a sample point).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from replayssm_jit import (
    LaunchConfig,
    gdn_decode,
    gdn_layout,
    mamba2_decode,
    mamba2_layout,
    plan_decode,
)
from replayssm_jit.core.models import ModelShape, get_model

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "scratch" / "long_run"
DEFAULT_SHAPES = "nano4b,super120b,qwen4b,qwen122b"
# Small shapes for a CPU smoke run (key heads, value heads, d_k, d_v as in models.ModelShape).
TINY = {
    "tiny-mamba2": ModelShape("tiny-mamba2", "mamba2", 1, 2, 4, 16, 16),
    "tiny-gdn": ModelShape("tiny-gdn", "gdn", 1, 2, 4, 16, 16),
}
DECAY_RATES = (1e-3, 1e-2)  # -log(per-step decay): decays in [0.990, 0.999]
F64 = torch.float64


def get_shape(name: str) -> ModelShape:
    return TINY[name] if name in TINY else get_model(name)


def _log_uniform(n: int, lo: float, hi: float, device) -> torch.Tensor:
    u = torch.rand(n, dtype=F64, device=device)
    return torch.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * u)


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y (y > 0): log(expm1(y)), in a form that keeps small y exact."""
    return y + torch.log(-torch.expm1(-y))


def _softplus64(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x.to(F64))


def _expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, groups, n] -> [b, heads, n], head h reading group h // (heads // groups)."""
    b, groups, n = t.shape
    return t[:, :, None, :].expand(b, groups, heads // groups, n).reshape(b, heads, n)


# ---------------------------------------------------------------------------------------------
# The families: inputs (static buffers refilled in place), our two ops, the float64 step
# ---------------------------------------------------------------------------------------------


class Mamba2Drift:
    """Mamba-2 at `shape`: A in -[0.5, 2] per head, dt = softplus(dt_raw + dt_bias) with dt_bias
    placing dt * |A| at the head's decay rate, dt_raw ~ 0.1 N(0, 1); D = 0 (the output is the
    state's and this token's term only); x ~ N(0, 1), B, C ~ N(0, 1) / N^(1/4)."""

    def __init__(self, shape: ModelShape, batch: int, window: int, device: torch.device):
        G, H, N, P = shape.key_heads, shape.value_heads, shape.d_k, shape.d_v
        self.H, self.G, self.N, self.P = H, G, N, P
        self.layout = mamba2_layout(num_heads=H, headdim=P, dstate=N, ngroups=G, window=window,
                                    act_dtype=torch.float32)  # fmt: skip
        self.rates = _log_uniform(H, *DECAY_RATES, device)
        a = 0.5 + 1.5 * torch.rand(H, dtype=F64, device=device)
        self.A = (-a).float()
        self.dt_bias = _inverse_softplus(self.rates / a).float()
        self.D = torch.zeros(H, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        self.x = torch.empty(batch, H, P, **f32)
        self.dt = torch.empty(batch, H, **f32)
        self.B = torch.empty(batch, G, N, **f32)
        self.C = torch.empty(batch, G, N, **f32)

    def draw(self) -> None:
        self.x.normal_()
        self.dt.normal_().mul_(0.1)
        self.B.normal_().mul_(self.N**-0.25)
        self.C.normal_().mul_(self.N**-0.25)

    def decode(self, plan, tensors, ids, out, workspace) -> None:
        mamba2_decode(plan, **tensors, x=self.x, dt=self.dt, A=self.A, B=self.B, C=self.C,
                      D=self.D, dt_bias=self.dt_bias, slot_indices=ids, out=out,
                      workspace=workspace)  # fmt: skip

    def reference(self, state: torch.Tensor, y: torch.Tensor) -> None:
        """One float64 conventional step of every row: state [b, H, P, N] and y [b, H, P]
        (float64) updated in place: S <- exp(dt A) S + dt x B^T, y = S C + D x."""
        b, H, P, N = state.shape
        dt = _softplus64(self.dt.to(F64) + self.dt_bias.to(F64))  # [b, H]
        alpha = torch.exp(dt * self.A.to(F64))
        x = self.x.to(F64)
        keys = _expand_groups(self.B.to(F64), H)
        query = _expand_groups(self.C.to(F64), H)
        state.mul_(alpha[..., None, None])
        state.view(b * H, P, N).baddbmm_((dt[..., None] * x).reshape(b * H, P, 1),
                                         keys.reshape(b * H, 1, N))  # fmt: skip
        y.copy_((state @ query[..., None]).squeeze(-1) + self.D.to(F64)[:, None] * x)


class GDNDrift:
    """GDN at `shape`: raw gates in the kernel, A_log = 0 and dt_bias placing -g = softplus(a +
    dt_bias) at the head's decay rate, a ~ 0.1 N(0, 1); b ~ -3 + 0.5 N(0, 1) (beta near 0.05,
    so the delta rule's own forgetting stays slow); q, k, v ~ N(0, 1), q and k normalised in the
    kernel, q scaled by K^-1/2."""

    def __init__(self, shape: ModelShape, batch: int, window: int, device: torch.device):
        H, HV, K, V = shape.key_heads, shape.value_heads, shape.d_k, shape.d_v
        self.H, self.HV, self.K, self.V = H, HV, K, V
        self.layout = gdn_layout(num_k_heads=H, num_v_heads=HV, head_k_dim=K, head_v_dim=V,
                                 window=window, act_dtype=torch.float32)  # fmt: skip
        self.rates = _log_uniform(HV, *DECAY_RATES, device)
        self.A_log = torch.zeros(HV, device=device)
        self.dt_bias = _inverse_softplus(self.rates).float()
        self.scale = K**-0.5
        f32 = dict(dtype=torch.float32, device=device)
        self.q = torch.empty(batch, H, K, **f32)
        self.k = torch.empty(batch, H, K, **f32)
        self.v = torch.empty(batch, HV, V, **f32)
        self.a = torch.empty(batch, HV, **f32)
        self.b = torch.empty(batch, HV, **f32)

    def draw(self) -> None:
        self.q.normal_()
        self.k.normal_()
        self.v.normal_()
        self.a.normal_().mul_(0.1)
        self.b.normal_().mul_(0.5).sub_(3.0)

    def decode(self, plan, tensors, ids, out, workspace) -> None:
        gdn_decode(plan, **tensors, q=self.q, k=self.k, v=self.v, a=self.a, b=self.b,
                   A_log=self.A_log, dt_bias=self.dt_bias, slot_indices=ids, out=out,
                   workspace=workspace)  # fmt: skip

    def reference(self, state: torch.Tensor, y: torch.Tensor) -> None:
        """One float64 conventional step of every row: state [b, HV, V, K] and y [b, HV, V]
        (float64) updated in place: S <- alpha S; u = beta (v - S k); S <- S + u k^T; y = S q."""
        b, HV, V, K = state.shape
        g = -torch.exp(self.A_log.to(F64)) * _softplus64(self.a.to(F64) + self.dt_bias.to(F64))
        beta = torch.sigmoid(self.b.to(F64))
        q, k = self.q.to(F64), self.k.to(F64)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * self.scale
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        keys, query = _expand_groups(k, HV), _expand_groups(q, HV)
        state.mul_(torch.exp(g)[..., None, None])
        u = beta[..., None] * (self.v.to(F64) - (state @ keys[..., None]).squeeze(-1))
        state.view(b * HV, V, K).baddbmm_(u.reshape(b * HV, V, 1), keys.reshape(b * HV, 1, K))
        y.copy_((state @ query[..., None]).squeeze(-1))


DRIVERS = {"mamba2": Mamba2Drift, "gdn": GDNDrift}


# ---------------------------------------------------------------------------------------------
# One shape's run
# ---------------------------------------------------------------------------------------------


def _row_rel_err(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[b] float64: ||got[i] - ref[i]|| / ||ref[i]||."""
    diff = (got.to(F64) - ref).flatten(1).norm(dim=1)
    return diff / ref.flatten(1).norm(dim=1).clamp_min(1e-300)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.to(F64) - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def sample_steps(total: int, window: int, every: int) -> set[int]:
    """Sample points: 2L, 4L, 8L, ... and multiples of `every` (rounded up to L), and the end."""
    every = max(window, -(-every // window) * window)
    points = {total, *range(every, total + 1, every)}
    step = 2 * window
    while step < total:
        points.add(step)
        step *= 2
    return {p for p in points if p <= total}


class Run:
    """The tensors and the step of one shape's run (see run_shape)."""

    def __init__(self, shape, batch, window, device, kernel):
        self.device, self.batch, self.window = device, batch, window
        self.drv = DRIVERS[shape.family](shape, batch, window, device)
        layout = self.drv.layout
        self.tensors = layout.allocate(batch, device)  # slot b serves row b
        self.conv_state = torch.zeros_like(self.tensors["state"])
        self.ref = torch.zeros(self.conv_state.shape, dtype=F64, device=device)
        self.ref_at_flush = torch.zeros_like(self.ref)
        self.replay_plan = plan_decode(layout, batch, device=device, check_slot_values=False,
                                       config=LaunchConfig(kernel=kernel))  # fmt: skip
        self.conv_plan = plan_decode(layout, batch, device=device, mode="conventional",
                                     check_slot_values=False)  # fmt: skip
        self.workspace = torch.empty(self.replay_plan.workspace_floats, device=device)
        s = layout.shape
        self.out = torch.empty(batch, s.value_heads, s.value_dim, device=device)
        self.conv_out = torch.empty_like(self.out)
        self.y = torch.empty(self.out.shape, dtype=F64, device=device)
        self.ids = torch.arange(batch, dtype=torch.int32, device=device)
        self.starts = [b * window // batch for b in range(batch)]
        # Output error sums since the last sample: [max replay, sum replay, max conv, sum conv].
        self.acc = torch.zeros(4, dtype=F64, device=device)
        # Rows flushing at the step after `t` steps, by t mod L (t >= L: every row has started).
        self.flush_rows = [
            torch.tensor([b for b, s0 in enumerate(self.starts) if (j - s0 + 1) % window == 0],
                         dtype=torch.long, device=device)
            for j in range(window)
        ]  # fmt: skip

    def step(self, t: int) -> None:
        """Global step t (0-based): every row that has started decodes one token."""
        drv = self.drv
        drv.draw()
        if t >= self.window:  # steady state: every row, nothing read on the host
            drv.decode(self.replay_plan, self.tensors, self.ids, self.out, self.workspace)
            drv.decode(self.conv_plan, {"state": self.conv_state}, self.ids, self.conv_out,
                       self.workspace)  # fmt: skip
            drv.reference(self.ref, self.y)
            rows = self.flush_rows[t % self.window]
            self.ref_at_flush.index_copy_(0, rows, self.ref.index_select(0, rows))
            self._accumulate(slice(None))
            return
        active = [b for b, s0 in enumerate(self.starts) if s0 <= t]
        ids = torch.tensor([b if b in active else -1 for b in range(self.batch)],
                           dtype=torch.int32, device=self.device)  # fmt: skip
        drv.decode(self.replay_plan, self.tensors, ids, self.out, self.workspace)
        drv.decode(self.conv_plan, {"state": self.conv_state}, ids, self.conv_out, self.workspace)
        new = self.ref.clone()
        drv.reference(new, self.y)
        rows = torch.tensor(active, dtype=torch.long, device=self.device)
        self.ref[rows] = new[rows]
        flushing = [b for b in active if (t - self.starts[b] + 1) % self.window == 0]
        self.ref_at_flush[flushing] = self.ref[flushing]
        self._accumulate(rows)

    def _accumulate(self, rows) -> None:
        for i, out in ((0, self.out), (2, self.conv_out)):
            err = _row_rel_err(out[rows], self.y[rows])
            torch.maximum(self.acc[i], err.max(), out=self.acc[i])
            self.acc[i + 1].add_(err.sum())

    def sample(self, steps_done: int, rows_in_interval: int) -> dict:
        """The drift after `steps_done` steps (a multiple of L); resets the output sums."""
        flushed = [b for b, s0 in enumerate(self.starts) if steps_done - s0 >= self.window]
        index = torch.tensor(flushed, dtype=torch.long, device=self.device)
        ckpt, ref = self.tensors["state"][index], self.ref_at_flush[index]
        acc = self.acc.tolist()
        self.acc.zero_()
        return {
            "step": steps_done,
            "state_replay": _rel_err(ckpt, ref),
            "state_replay_row_max": _row_rel_err(ckpt, ref).max().item(),
            "state_conventional": _rel_err(self.conv_state, self.ref),
            "out_replay_max": acc[0],
            "out_replay_mean": acc[1] / max(rows_in_interval, 1),
            "out_conventional_max": acc[2],
            "out_conventional_mean": acc[3] / max(rows_in_interval, 1),
        }


def run_shape(
    shape: ModelShape,
    *,
    steps: int = 100_000,
    batch: int = 8,
    window: int = 16,
    device: torch.device | str = "cuda",
    sample_every: int = 2048,
    kernel: str = "split",
    seed: int = 0,
    time_budget: float | None = None,
    use_graph: bool | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Drift of one shape over `steps` decode steps (rounded up to a multiple of `window`, at
    least 2 windows).

    use_graph: capture every L steps as one CUDA graph (default: on a CUDA device).
    time_budget: seconds after which the run stops at the next sample point.
    Returns the shape's record: its settings, kernel, timing, `series` (one dict per sample
    point: state_replay, state_replay_row_max, state_conventional, out_replay_max/_mean,
    out_conventional_max/_mean) and `final` (the last sample).
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    use_graph = cuda if use_graph is None else use_graph
    total = max(-(-steps // window), 2) * window
    points = sample_steps(total, window, sample_every)
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.manual_seed(seed)
        run = Run(shape, batch, window, device, kernel)
        series: list[dict] = []
        start = time.perf_counter()
        rows_in_interval = 0
        for t in range(window):  # sequences join: eager, with padded rows
            run.step(t)
            rows_in_interval += sum(s0 <= t for s0 in run.starts)
        done = window
        chunk = _chunk(run, use_graph)
        stopped_early = False
        while done < total:
            chunk(done)
            done += window
            rows_in_interval += window * batch
            if done in points:
                series.append(run.sample(done, rows_in_interval))
                rows_in_interval = 0
                elapsed = time.perf_counter() - start
                if log:
                    s = series[-1]
                    log(f"  {shape.name} step {done}: state {s['state_replay']:.2e}, "
                        f"out max {s['out_replay_max']:.2e} ({elapsed:.0f} s)")  # fmt: skip
                if time_budget is not None and elapsed > time_budget and done < total:
                    stopped_early = True
                    break
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        del chunk  # (the graph, before the generator's state is restored)
    plan = run.replay_plan
    decays = torch.exp(-run.drv.rates)
    return {
        "shape": shape.name,
        "family": shape.family,
        "dims": {
            "key_heads": shape.key_heads,
            "value_heads": shape.value_heads,
            "d_k": shape.d_k,
            "d_v": shape.d_v,
        },
        "batch": batch,
        "window": window,
        "kernel": plan.kernel,
        "rows_per_cta": plan.rows_per_cta,
        "conventional_kernel": run.conv_plan.kernel,
        "cuda_graph": use_graph,
        "steps_requested": steps,
        "steps": done,
        "stopped_early": stopped_early,
        "seconds": seconds,
        "us_per_step": seconds / done * 1e6,
        "decay_range": [decays.min().item(), decays.max().item()],
        "series": series,
        "final": series[-1] if series else None,
    }


def _chunk(run: Run, use_graph: bool) -> Callable[[int], None]:
    """A function running the L steps after `t` steps (t >= L, a multiple of L)."""
    window = run.window

    def eager(t: int) -> None:
        for j in range(window):
            run.step(t + j)

    if not use_graph:
        return eager
    # The first chunk runs eagerly on a side stream (libraries set up their per-stream state,
    # e.g. cuBLAS workspaces, outside capture), then the same steps are captured on it.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager(window)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        eager(window)  # (recorded, not run: any chunk's steps use the same rows and buffers)
    first = [True]

    def replay(t: int) -> None:
        if first[0]:  # the warm-up already ran these steps
            first[0] = False
            return
        graph.replay()

    return replay


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def _sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, cwd=ROOT, capture_output=True, text=True,
                              timeout=20).stdout.strip()  # fmt: skip
    except Exception as exc:
        return f"unavailable: {exc}"


def environment(device: torch.device, argv: list[str]) -> dict:
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "host": platform.node(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "git_commit": os.environ.get("REPLAYSSM_GIT_COMMIT")
        or _sh("git rev-parse --verify -q HEAD")
        or "unknown",
        "command": shlex.join([sys.executable, str(Path(__file__).resolve()), *argv]),
    }


def _prebuild(shapes: list[ModelShape], args) -> None:
    """Load (AOT, else JIT-compile) every module the run needs, in parallel."""
    from replayssm_jit.jit.build import load_module

    specs = {}
    for shape in shapes:
        layout = DRIVERS[shape.family](shape, args.batch, args.window, torch.device("cpu")).layout
        for mode, config in (("replay", LaunchConfig(kernel=args.kernel)), ("conventional", None)):
            spec = plan_decode(layout, args.batch, device="cpu", mode=mode, config=config).spec
            specs[spec.uri] = spec
    with ThreadPoolExecutor(min(8, len(specs))) as pool:
        list(pool.map(load_module, specs.values()))


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    fig, (ax_state, ax_out) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for i, r in enumerate(results):
        steps = [s["step"] for s in r["series"]]
        color = f"C{i}"
        ax_state.plot(steps, [s["state_replay"] for s in r["series"]], color=color,
                      label=f"{r['shape']} ReplaySSM")  # fmt: skip
        ax_state.plot(steps, [s["state_conventional"] for s in r["series"]], color=color,
                      linestyle="--", label=f"{r['shape']} FP32 conventional")  # fmt: skip
        ax_out.plot(steps, [s["out_replay_max"] for s in r["series"]], color=color,
                    label=f"{r['shape']} ReplaySSM")  # fmt: skip
        ax_out.plot(steps, [s["out_conventional_max"] for s in r["series"]], color=color,
                    linestyle="--", label=f"{r['shape']} FP32 conventional")  # fmt: skip
    window, batch = results[0]["window"], results[0]["batch"]
    ax_state.set_title(f"checkpoint drift vs float64 (batch {batch}, L = {window})")
    ax_out.set_title("output drift vs float64: max over each interval")
    for ax in (ax_state, ax_out):
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.grid(True, which="both", alpha=0.3)
    ax_state.set_ylabel("relative error")
    ax_out.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def table(results: list[dict]) -> str:
    head = ("shape", "kernel", "steps", "state ReplaySSM", "state FP32 conv", "out max ReplaySSM",
            "out max FP32 conv", "s")  # fmt: skip
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in results:
        f = r["final"] or {}
        peak = max((s["out_replay_max"] for s in r["series"]), default=float("nan"))
        peak_conv = max((s["out_conventional_max"] for s in r["series"]), default=float("nan"))
        lines.append(" | ".join([
            r["shape"], r["kernel"], f"{r['steps']}{' (stopped)' if r['stopped_early'] else ''}",
            f"{f.get('state_replay', float('nan')):.2e}",
            f"{f.get('state_conventional', float('nan')):.2e}",
            f"{peak:.2e}", f"{peak_conv:.2e}", f"{r['seconds']:.1f}",
        ]))  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100_000, help="decode steps per shape")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--window", type=int, default=16, help="replay window L")
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help=f"comma-separated models.py presets or {sorted(TINY)}")  # fmt: skip
    p.add_argument("--sample-every", type=int, default=2048, help="steps between samples")
    p.add_argument("--kernel", default="split", choices=["split", "per-item"],
                   help="the ReplaySSM kernel (fixed: the policy flushes every token at batch 8)")  # fmt: skip
    p.add_argument("--device", default="cuda")
    p.add_argument("--time-budget", type=float, default=120.0,
                   help="seconds per shape; the run stops at the next sample point past it")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-graph", action="store_true", help="run eagerly on CUDA too")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch threads with --device cpu (the CPU path's steps are small)")  # fmt: skip
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the JSON and plot")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    shapes = [get_shape(name.strip()) for name in args.shapes.split(",") if name.strip()]
    if device.type == "cpu":
        torch.set_num_threads(args.cpu_threads)
    if device.type == "cuda":
        t0 = time.perf_counter()
        _prebuild(shapes, args)
        print(f"modules loaded in {time.perf_counter() - t0:.0f} s")
    results = []
    for shape in shapes:
        print(f"{shape.name}: {args.steps} steps, batch {args.batch}, L = {args.window}")
        results.append(run_shape(
            shape, steps=args.steps, batch=args.batch, window=args.window, device=device,
            sample_every=args.sample_every, kernel=args.kernel, seed=args.seed,
            time_budget=args.time_budget, use_graph=False if args.no_graph else None, log=print,
        ))  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(device, argv), "settings": {**vars(args), "out": str(args.out)},
               "shapes": results}  # fmt: skip
    json_path = args.out / "long_run_drift.json"
    json_path.write_text(json.dumps(payload, indent=1))
    print(table(results))
    print(f"wrote {json_path}")
    png = args.out / "long_run_drift.png"
    if plot(results, png):
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
