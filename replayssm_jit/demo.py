"""The main job: decode a stack of SSM layers at a model's head shapes, once conventionally and
once with ReplaySSM, and report how far apart they are and the state bytes each moved per step.

The CUDA kernels run where a GPU is present; elsewhere the float64 references do, and the
demo says which ran.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from replayssm_jit.models import MODELS, ModelShape, get_model
from replayssm_jit.reference import GDNSequence, Mamba2Sequence, gdn_gates, gdn_step, mamba2_step


@dataclass
class LayerWeights:
    """Random projections from the hidden vector to one SSM layer's inputs."""

    proj: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]


def _make_layers(model: ModelShape, layers: int, gen: torch.Generator, dtype) -> list[LayerWeights]:
    G, H, N, P = model.key_heads, model.value_heads, model.d_k, model.d_v
    hidden = H * P

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=dtype) * scale

    out = []
    for _ in range(layers):
        if model.family == "mamba2":
            proj = {
                "B": rand(G * N, hidden, scale=hidden**-0.5),
                "C": rand(G * N, hidden, scale=hidden**-0.5),
                "dt": rand(H, hidden, scale=0.3 * hidden**-0.5),
            }
            params = {
                "A": -(0.5 + torch.rand(H, generator=gen, dtype=dtype)),
                "D": rand(H),
                "dt_bias": rand(H, scale=0.1) - 1.0,
            }
        else:
            proj = {
                "q": rand(G * N, hidden, scale=hidden**-0.5),
                "k": rand(G * N, hidden, scale=hidden**-0.5),
                "a": rand(H, hidden, scale=hidden**-0.5),
                "b": rand(H, hidden, scale=hidden**-0.5),
            }
            params = {
                "A_log": torch.log(torch.rand(H, generator=gen, dtype=dtype) * 4 + 0.5),
                "dt_bias": rand(H, scale=0.1),
            }
        out.append(LayerWeights(proj, params))
    return out


def _layer_inputs(model: ModelShape, w: LayerWeights, h: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token inputs of one layer from hidden h [batch, H*P] (engine shapes)."""
    batch = h.shape[0]
    G, H, N, P = model.key_heads, model.value_heads, model.d_k, model.d_v
    if model.family == "mamba2":
        return {
            "x": h.view(batch, H, P),
            "dt": h @ w.proj["dt"].T,
            "B": (h @ w.proj["B"].T).view(batch, G, N),
            "C": (h @ w.proj["C"].T).view(batch, G, N),
        }
    g, beta = gdn_gates(
        w.params["A_log"], h @ w.proj["a"].T, w.params["dt_bias"], h @ w.proj["b"].T
    )
    return {
        "q": (h @ w.proj["q"].T).view(batch, G, N),
        "k": (h @ w.proj["k"].T).view(batch, G, N),
        "v": h.view(batch, H, P),
        "g": g.to(h.dtype),
        "beta": beta.to(h.dtype),
    }


def _next_hidden(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = h + y.reshape(h.shape)
    return z / z.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()


class ReferenceBackend:
    """float64 references: batched conventional steps, and one ReplaySSM sequence per row."""

    name = "reference (float64 PyTorch, CPU): no GPU found"

    def __init__(self, model, layers, batch, window, gen):
        self.model = model
        shape = (batch, model.value_heads, model.d_v, model.d_k)
        init = [torch.randn(shape, generator=gen, dtype=torch.float64) * 0.1 for _ in layers]
        self.conv_states = [s.clone() for s in init]
        if model.family == "mamba2":
            self.seqs = [
                [
                    Mamba2Sequence(s[b], L=window, T=1, dt_softplus=True, **w.params)
                    for b in range(batch)
                ]
                for s, w in zip(init, layers)
            ]
        else:
            self.seqs = [[GDNSequence(s[b], L=window, T=1) for b in range(batch)] for s in init]
        self.flushes = 0

    def conventional(self, layer: int, w: LayerWeights, inp: dict) -> torch.Tensor:
        if self.model.family == "mamba2":
            y, self.conv_states[layer] = mamba2_step(
                self.conv_states[layer], **inp, **w.params, dt_softplus=True
            )
        else:
            y, self.conv_states[layer] = gdn_step(self.conv_states[layer], **inp)
        return y

    def replay(self, layer: int, w: LayerWeights, inp: dict) -> torch.Tensor:
        ys = []
        for b, seq in enumerate(self.seqs[layer]):
            ys.append(seq.step(**{k: v[b] for k, v in inp.items()}))
            self.flushes += seq.last_step_flushed
        return torch.stack(ys)


class CudaBackend:
    """Our kernels in float32: a conventional-mode cache and a ReplaySSM-mode cache."""

    name = "cuda (replayssm-jit kernels, fp32 state and activations)"

    def __init__(self, model, layers, batch, window, gen):
        from replayssm_jit import Mamba2DecodeCache, Mamba2DecodeWrapper

        if model.family != "mamba2":
            raise NotImplementedError(
                "the CUDA demo runs the Mamba-2 models; GDN runs on the reference"
            )
        self.model, self.batch = model, batch
        kw = dict(
            num_heads=model.value_heads,
            headdim=model.d_v,
            dstate=model.d_k,
            ngroups=model.key_heads,
            window=window,
            state_dtype=torch.float32,
            act_dtype=torch.float32,
            device="cuda",
        )
        self.caches = {
            mode: [Mamba2DecodeCache(batch, **kw) for _ in layers]
            for mode in ("conventional", "replay")
        }
        self.slots = torch.arange(batch, dtype=torch.int32, device="cuda")
        for i, _ in enumerate(layers):
            init = torch.randn(
                (batch, model.value_heads, model.d_v, model.d_k), generator=gen, dtype=torch.float64
            )
            for mode in self.caches:
                self.caches[mode][i].reset(self.slots, (0.1 * init).float().cuda())
        self.wrappers = {}
        for mode, caches in self.caches.items():
            self.wrappers[mode] = [Mamba2DecodeWrapper(c, mode=mode) for c in caches]
            for wrapper in self.wrappers[mode]:
                wrapper.plan(batch)
        self.flushes = 0

    def _run(self, mode, layer, w, inp):
        p = {k: v.float().cuda().contiguous() for k, v in w.params.items()}
        t = {k: v.float().cuda().contiguous() for k, v in inp.items()}
        y = self.wrappers[mode][layer].run(
            t["x"], t["dt"], p["A"], t["B"], t["C"], self.slots, D=p["D"], dt_bias=p["dt_bias"]
        )
        return y.double().cpu()

    def conventional(self, layer, w, inp):
        return self._run("conventional", layer, w, inp)

    def replay(self, layer, w, inp):
        held = self.caches["replay"][layer].cursors[:, 0]
        self.flushes += int((held + 1 >= self.caches["replay"][layer].window).sum())
        return self._run("replay", layer, w, inp)


def state_bytes_per_step(
    model: ModelShape, window: int, flush_fraction: float, state_size: int = 4
) -> dict:
    """Bytes one layer moves per sequence per step (DESIGN §5): state, plus the ReplaySSM records."""
    s = model.state_bytes(state_size)
    if model.family == "mamba2":  # x [H,P] bf16, B [G,N] bf16, dt [H] f32
        record = (
            model.value_heads * model.d_v * 2
            + model.key_heads * model.d_k * 2
            + model.value_heads * 4
        )
    else:  # u [HV,V] f32, k [H,K] bf16, g [HV] f32
        record = (
            model.value_heads * model.d_v * 4
            + model.key_heads * model.d_k * 2
            + model.value_heads * 4
        )
    mean_records = (window - 1) / 2
    replay = s + flush_fraction * s + record * (mean_records + 1)
    return {"conventional": 2 * s, "replay": replay, "record": record}


def run_demo(
    model_name: str, batch: int, steps: int, window: int, layers: int, backend: str, seed: int
) -> dict:
    model = get_model(model_name)
    gen = torch.Generator().manual_seed(seed)
    weights = _make_layers(model, layers, gen, torch.float64)
    use_cuda = backend == "cuda" or (
        backend == "auto" and torch.cuda.is_available() and model.family == "mamba2"
    )
    engine = (CudaBackend if use_cuda else ReferenceBackend)(model, weights, batch, window, gen)
    started = time.perf_counter()
    h = torch.randn(batch, model.value_heads * model.d_v, generator=gen, dtype=torch.float64)
    worst = 0.0
    for _ in range(steps):
        h = _next_hidden(h, torch.randn(h.shape, generator=gen, dtype=torch.float64))
        for i, w in enumerate(weights):
            # Teacher-forced: both methods see the same layer inputs, so the difference measures
            # the decode methods, not how the (chaotic) layer stack amplifies it.
            inp = _layer_inputs(model, w, h)
            y_conv = engine.conventional(i, w, inp)
            y_rep = engine.replay(i, w, inp)
            worst = max(worst, ((y_rep - y_conv).norm() / y_conv.norm()).item())
            h = _next_hidden(h, y_conv)
    flush_fraction = engine.flushes / (steps * layers * batch)
    return {
        "model": model.name,
        "backend": engine.name,
        "batch": batch,
        "steps": steps,
        "layers": layers,
        "window": window,
        "max_rel_diff": worst,
        "seconds": time.perf_counter() - started,
        "flush_fraction": flush_fraction,
        "bytes": state_bytes_per_step(model, window, flush_fraction),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m replayssm_jit demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--model", default="nemotron-3-nano-4b", help=f"one of {sorted(MODELS)} (or short aliases)"
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--window", type=int, default=16, help="replay window L")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--backend", choices=("auto", "cuda", "reference"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("batch", "steps", "window", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected >= 1, got {getattr(args, name)}")
    r = run_demo(
        args.model, args.batch, args.steps, args.window, args.layers, args.backend, args.seed
    )
    b = r["bytes"]
    print(
        f"model      {r['model']}: {r['layers']} SSM layers, batch {r['batch']}, {r['steps']} steps, L={r['window']}"
    )
    print(f"backend    {r['backend']}")
    print(
        f"agreement  max relative difference, ReplaySSM vs conventional outputs: {r['max_rel_diff']:.2e}"
    )
    print(f"flushes    {100 * r['flush_fraction']:.1f}% of layer steps")
    print("traffic    state bytes per layer per sequence per step (fp32 state):")
    print(f"             conventional {b['conventional'] / 1e6:8.3f} MB (read + write)")
    print(
        f"             ReplaySSM    {b['replay'] / 1e6:8.3f} MB (checkpoint read, flush write, records)"
        f"  -> {b['conventional'] / b['replay']:.2f}x less"
    )
    print(f"time       {r['seconds']:.1f} s")
    return 0
