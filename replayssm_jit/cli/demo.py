"""The main job: decode a stack of SSM layers at a model's head shapes, once conventionally and
once with ReplaySSM, and report how far apart they are and the bytes each would move per step.

Backends: "cuda" (the kernels), "cpu" (the same API on CPU tensors: the PyTorch path) and
"reference" (the float64 oracles); "auto" takes cuda where a GPU is present, else cpu.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from replayssm_jit.core.dtypes import MAX_WINDOW
from replayssm_jit.core.models import MODELS, ModelShape, get_model
from replayssm_jit.families import GDN, KDA, MAMBA2, HeadShape, get_family
from replayssm_jit.ops.plan import MAX_BATCH
from replayssm_jit.reference import (
    GDNSequence,
    KDASequence,
    Mamba2Sequence,
    gdn_gates,
    gdn_step,
    kda_gates,
    kda_step,
    mamba2_step,
)


class DemoLayer:
    """Random projections from the hidden vector [batch, value_heads * d_v] to one layer's
    token inputs (`projections`: name, rows, scale), and its per-head parameters."""

    def __init__(self, model: ModelShape, gen: torch.Generator):
        self.model = model
        hidden = model.value_heads * model.d_v

        def randn(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float64)

        self.proj = {
            name: randn(rows, hidden) * scale * hidden**-0.5
            for name, rows, scale in self.projections(model)
        }
        self.params = self.draw_params(model, randn, gen)

    def project(self, h: torch.Tensor, name: str, *per_row: int) -> torch.Tensor:
        """h through projection `name`, viewed as [batch, *per_row]."""
        y = h @ self.proj[name].T
        return y.view(h.shape[0], *per_row) if per_row else y


class Mamba2Layer(DemoLayer):
    family = MAMBA2

    @staticmethod
    def projections(m):
        return (("B", m.key_heads * m.d_k, 1.0), ("C", m.key_heads * m.d_k, 1.0),
                ("dt", m.value_heads, 0.3))  # fmt: skip

    @staticmethod
    def draw_params(m, randn, gen):
        H = m.value_heads
        return {
            "A": -(0.5 + torch.rand(H, generator=gen, dtype=torch.float64)),
            "D": randn(H),
            "dt_bias": randn(H) * 0.1 - 1.0,
        }

    def inputs(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        m = self.model
        return {
            "x": h.view(h.shape[0], m.value_heads, m.d_v),
            "dt": self.project(h, "dt"),
            "B": self.project(h, "B", m.key_heads, m.d_k),
            "C": self.project(h, "C", m.key_heads, m.d_k),
        }

    def reference_step(self, state, inp):
        return mamba2_step(state, **inp, **self.params, dt_softplus=True)

    def reference_sequence(self, checkpoint, window):
        return Mamba2Sequence(checkpoint, L=window, T=1, dt_softplus=True, **self.params)

    @staticmethod
    def sequence_inputs(inp):
        return inp

    @staticmethod
    def wrapper_class():
        from replayssm_jit import Mamba2DecodeWrapper

        return Mamba2DecodeWrapper

    def run(self, wrapper, t, p, slots):
        return wrapper.run(
            t["x"], t["dt"], p["A"], t["B"], t["C"], slots, D=p["D"], dt_bias=p["dt_bias"]
        )


class GDNLayer(DemoLayer):
    # The family (its decay_per_channel sets the gate's width) and its reference forms.
    family = GDN
    gates = staticmethod(gdn_gates)
    step = staticmethod(gdn_step)
    sequence_class = GDNSequence

    @classmethod
    def gate_shape(cls, m) -> tuple[int, ...]:
        return (m.value_heads, m.d_k) if cls.family.decay_per_channel else (m.value_heads,)

    @classmethod
    def projections(cls, m):
        qk = m.key_heads * m.d_k
        return (
            ("q", qk, 1.0),
            ("k", qk, 1.0),
            ("a", math.prod(cls.gate_shape(m)), 1.0),
            ("b", m.value_heads, 1.0),
        )

    @classmethod
    def draw_params(cls, m, randn, gen):
        HV = m.value_heads
        return {
            "A_log": torch.log(torch.rand(HV, generator=gen, dtype=torch.float64) * 4 + 0.5),
            "dt_bias": randn(math.prod(cls.gate_shape(m))) * 0.1,
        }

    def inputs(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        m = self.model
        return {
            "q": self.project(h, "q", m.key_heads, m.d_k),
            "k": self.project(h, "k", m.key_heads, m.d_k),
            "v": h.view(h.shape[0], m.value_heads, m.d_v),
            "a": self.project(h, "a", *self.gate_shape(m)),
            "b": self.project(h, "b"),
        }

    def sequence_inputs(self, inp):
        g, beta = self.gates(self.params["A_log"], inp["a"], self.params["dt_bias"], inp["b"])
        return {"q": inp["q"], "k": inp["k"], "v": inp["v"], "g": g, "beta": beta}

    def reference_step(self, state, inp):
        return self.step(state, **self.sequence_inputs(inp))

    @classmethod
    def reference_sequence(cls, checkpoint, window):
        return cls.sequence_class(checkpoint, L=window, T=1)

    @staticmethod
    def wrapper_class():
        from replayssm_jit import GDNDecodeWrapper

        return GDNDecodeWrapper

    def run(self, wrapper, t, p, slots):
        return wrapper.run(
            t["q"], t["k"], t["v"], slots, a=t["a"], b=t["b"], A_log=p["A_log"],
            dt_bias=p["dt_bias"],
        )  # fmt: skip


class KDALayer(GDNLayer):
    """GDN's layer with KDA's per-channel gate: a [batch, HV, K], dt_bias [HV * K]."""

    family = KDA
    gates = staticmethod(kda_gates)
    step = staticmethod(kda_step)
    sequence_class = KDASequence

    @staticmethod
    def wrapper_class():
        from replayssm_jit import KDADecodeWrapper

        return KDADecodeWrapper


# The demo's per-family adapters, keyed by the registry's Family.
LAYERS = {layer.family: layer for layer in (Mamba2Layer, GDNLayer, KDALayer)}


class ReferenceBackend:
    """float64 oracles: batched conventional steps, and one ReplaySSM sequence per row."""

    name = "reference (float64 PyTorch oracles, CPU)"

    def __init__(self, layers, batch, window, init):
        self.layers = layers
        self.conv_states = [s.clone() for s in init]
        self.seqs = [
            [layer.reference_sequence(s[b], window) for b in range(batch)]
            for s, layer in zip(init, layers)
        ]
        self.flushes = self.held = 0

    def conventional(self, i: int, inp: dict) -> torch.Tensor:
        y, self.conv_states[i] = self.layers[i].reference_step(self.conv_states[i], inp)
        return y

    def replay(self, i: int, inp: dict) -> torch.Tensor:
        tok = self.layers[i].sequence_inputs(inp)
        ys = []
        for b, seq in enumerate(self.seqs[i]):
            self.held += seq.n
            ys.append(seq.step(**{k: v[b] for k, v in tok.items()}))
            self.flushes += seq.last_step_flushed
        return torch.stack(ys)


class KernelBackend:
    """The package's own API in float32 (wrappers over the functional ops): a conventional and
    a ReplaySSM cache per layer, on CUDA (the kernels) or the CPU (the PyTorch path)."""

    def __init__(self, layers, batch, window, init, device: torch.device):
        self.layers, self.device = layers, device
        if device.type == "cuda":
            self.name = f"cuda (replayssm-jit kernels on {torch.cuda.get_device_name(device)})"
        else:
            self.name = "cpu (replayssm-jit's PyTorch path on CPU tensors)"
        from replayssm_jit import SlotCache
        from replayssm_jit.families.layout import family_layout

        def cache(model):
            shape = (model.key_heads, model.value_heads, model.d_k, model.d_v)
            layout = family_layout(
                model.family, window=window, state_dtype=torch.float32, act_dtype=torch.float32,
                **dict(zip(get_family(model.family).shape_args, shape)),
            )  # fmt: skip
            return SlotCache(layout, batch, device=device)

        self.caches = {
            mode: [cache(layer.model) for layer in layers] for mode in ("conventional", "replay")
        }
        self.wrappers = {mode: [] for mode in self.caches}
        for mode, caches in self.caches.items():
            for layer, cache, s in zip(layers, caches, init):
                self.slots = cache.allocate(batch)
                cache.reset(self.slots, s.float())
                wrapper = layer.wrapper_class()(cache, mode=mode)
                wrapper.plan(batch)
                self.wrappers[mode].append(wrapper)
        self.flushes = self.held = 0

    def _run(self, mode, i, inp):
        layer = self.layers[i]
        p = {k: v.float().to(self.device).contiguous() for k, v in layer.params.items()}
        t = {k: v.float().to(self.device).contiguous() for k, v in inp.items()}
        return layer.run(self.wrappers[mode][i], t, p, self.slots).double().cpu()

    def conventional(self, i, inp):
        return self._run("conventional", i, inp)

    def replay(self, i, inp):
        cursors = self.caches["replay"][i].cursors
        epochs = int(cursors[:, 1].sum())
        self.held += int(cursors[:, 0].sum())
        y = self._run("replay", i, inp)
        self.flushes += int(cursors[:, 1].sum()) - epochs  # a flush advances its slot's epoch
        return y


def traffic_estimate(model: ModelShape, mean_held: float, flush_fraction: float) -> dict:
    """An analytic estimate, not a measurement, of the bytes one layer moves per sequence per
    step with an fp32 state and bf16 activations: conventional reads and writes the state;
    ReplaySSM reads the checkpoint, writes it at a flush, reads the held records and writes one."""
    s = model.state_bytes(4)
    shape = HeadShape(model.key_heads, model.value_heads, model.d_k, model.d_v)
    record = sum(  # one ring row of each ring
        torch.Size(ring.per_slot_shape(shape, 1)).numel()
        * ring.torch_dtype(torch.bfloat16).itemsize
        for ring in get_family(model.family).rings
    )
    replay = s + flush_fraction * s + record * (mean_held + 1)
    return {"conventional": 2 * s, "replay": replay, "record": record}


def run_demo(model_name: str, batch: int, steps: int, window: int, layers: int, backend: str,
             seed: int) -> dict:  # fmt: skip
    model = get_model(model_name)
    gen = torch.Generator().manual_seed(seed)
    stack = [LAYERS[get_family(model.family)](model, gen) for _ in range(layers)]
    shape = (batch, model.value_heads, model.d_v, model.d_k)
    init = [0.1 * torch.randn(shape, generator=gen, dtype=torch.float64) for _ in stack]
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "reference":
        engine = ReferenceBackend(stack, batch, window, init)
    else:
        engine = KernelBackend(stack, batch, window, init, torch.device(backend))
    started = time.perf_counter()
    h = torch.randn(batch, model.value_heads * model.d_v, generator=gen, dtype=torch.float64)
    worst = 0.0
    for _ in range(steps):
        h = _next_hidden(h, torch.randn(h.shape, generator=gen, dtype=torch.float64))
        for i, layer in enumerate(stack):
            # Teacher-forced: both methods see the same layer inputs, so the difference measures
            # the decode methods, not how the (chaotic) layer stack amplifies it.
            inp = layer.inputs(h)
            y_conv = engine.conventional(i, inp)
            y_rep = engine.replay(i, inp)
            worst = max(worst, ((y_rep - y_conv).norm() / y_conv.norm()).item())
            h = _next_hidden(h, y_conv)
    layer_steps = steps * layers * batch
    flush_fraction, mean_held = engine.flushes / layer_steps, engine.held / layer_steps
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
        "mean_held": mean_held,
        "bytes": traffic_estimate(model, mean_held, flush_fraction),
    }


def _next_hidden(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = h + y.reshape(h.shape)
    return z / z.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m replayssm_jit demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--model", default="nemotron-3-nano-4b", help=f"one of {sorted(MODELS)} (or short aliases)"
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--window", type=int, default=16, help="replay window L (1-256)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--backend", choices=("auto", "cuda", "cpu", "reference"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("batch", "steps", "window", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected >= 1, got {getattr(args, name)}")
    if args.window > MAX_WINDOW:
        parser.error(f"--window: expected at most {MAX_WINDOW}, got {args.window}")
    if args.batch > MAX_BATCH:
        parser.error(
            f"--batch: expected at most {MAX_BATCH} (a plan's largest batch), got {args.batch}"
        )
    if not -(2**63) <= args.seed < 2**64:  # (what torch.Generator.manual_seed takes)
        parser.error(f"--seed: expected an int in [-2**63, 2**64), got {args.seed}")
    try:
        get_model(args.model)
    except ValueError as exc:
        parser.error(f"--{exc}")
    if args.backend == "cuda" and not torch.cuda.is_available():
        parser.error("--backend cuda: no CUDA device is available here (try --backend cpu)")
    r = run_demo(
        args.model, args.batch, args.steps, args.window, args.layers, args.backend, args.seed
    )
    b = r["bytes"]
    print(
        f"model      {r['model']}: {r['layers']} SSM layers, batch {r['batch']}, "
        f"{r['steps']} steps, L={r['window']}"
    )
    print(f"backend    {r['backend']}")
    print(
        f"agreement  max relative difference, ReplaySSM vs conventional outputs: {r['max_rel_diff']:.2e}"
    )
    print(
        f"flushes    {100 * r['flush_fraction']:.1f}% of layer steps; "
        f"{r['mean_held']:.2f} records held on average"
    )
    print("traffic    estimated from the model shape (not measured), bytes per layer per sequence")
    print("           per step with an fp32 state:")
    print(f"             conventional {b['conventional'] / 1e6:8.3f} MB (read + write)")
    print(
        f"             ReplaySSM    {b['replay'] / 1e6:8.3f} MB (checkpoint read, flush write, records)"
        f"  -> {b['conventional'] / b['replay']:.2f}x less"
    )
    print(f"time       {r['seconds']:.1f} s")
    return 0
