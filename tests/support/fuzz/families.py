"""Per-family adapters of the decode entries: shapes, plan options, inputs and the float64
reference step. A family joins the decode entries by adding an adapter to ADAPTERS."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from replayssm_jit import (
    GDNDecodeCache,
    GDNDecodeWrapper,
    KDADecodeCache,
    KDADecodeWrapper,
    Mamba2DecodeCache,
    Mamba2DecodeWrapper,
    gdn_decode,
    kda_decode,
    mamba2_decode,
)
from replayssm_jit.reference import (
    gdn_gates,
    gdn_step_pool,
    kda_gates,
    kda_step_pool,
    mamba2_step_pool,
)


def _softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.softplus(x.double())


@dataclass(frozen=True)
class Adapter:
    """One family for the decode entries.

    shapes: per device, the head shapes drawn (CUDA: those of the AOT `sanitizer` preset, so the
    GPU run loads a bounded set of modules). inputs: name -> (per-row?, layout requirement) of
    every token input and parameter the op may take. positional: wrapper.run's positional
    arguments before slot_indices. records: ring name -> whether a non-flush step appends this
    token's input to it exactly (else in FP32, compared by relative error).
    """

    name: str
    cache_cls: type
    wrapper_cls: type
    op: object
    shapes: dict
    inputs: dict
    positional: tuple[str, ...]
    records: dict

    @property
    def per_channel(self) -> bool:
        """A decay per key channel (KDA): a, g [batch, HV, K] and dt_bias [HV * K]."""
        return self.name == "kda"

    # --- plan options ----------------------------------------------------------------------
    def draw_options(self, draw, device: str, state_dtype: torch.dtype) -> dict:
        sixteen = state_dtype != torch.float32
        if device == "cuda":  # (the sanitizer preset rounds BF16 checkpoints stochastically)
            sixteen = state_dtype == torch.bfloat16
        sr = sixteen and draw(st.booleans())
        opts: dict = {"stochastic_rounding": sr}
        # (the sanitizer preset's stochastic-rounding modules read the seed on the device)
        if sr and (device == "cuda" or draw(st.booleans())):
            opts["device_seed"] = True
        if self.name == "mamba2":
            if device == "cuda":  # the sanitizer preset's flags: d, dt_bias, dt_softplus, z
                opts.update(has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True)
            else:
                for k in ("has_D", "has_z", "has_dt_bias", "dt_softplus"):
                    opts[k] = draw(st.booleans())
        else:
            if device == "cuda":
                opts.update(use_qk_l2norm=True, gates_in_kernel=True)
            else:
                opts["use_qk_l2norm"] = draw(st.booleans())
                opts["gates_in_kernel"] = draw(st.booleans())
            if draw(st.booleans()):
                opts["scale"] = draw(st.sampled_from([0.25, 1.0, 0.1, 2]))
        return opts

    def planned(self, options: dict) -> set[str]:
        """The optional inputs a plan with `options` takes."""
        if self.name == "mamba2":
            names = {"has_D": "D", "has_z": "z", "has_dt_bias": "dt_bias"}
            defaults = {"has_D": True, "has_z": False, "has_dt_bias": True}
            return {n for o, n in names.items() if options.get(o, defaults[o])}
        if options.get("gates_in_kernel", True):
            return {"a", "b", "A_log", "dt_bias"}
        return {"g", "beta"}

    def optional_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.inputs if n not in self.positional)

    # --- inputs ----------------------------------------------------------------------------
    def params(self, gen, shape: dict, options: dict, device: str) -> dict:
        """Per-head parameters (float32) the plan takes."""
        planned = self.planned(options)
        if self.name == "mamba2":
            H = shape["num_heads"]
            p = {"A": -(0.5 + torch.rand(H, generator=gen))}
            if "D" in planned:
                p["D"] = torch.randn(H, generator=gen)
            if "dt_bias" in planned:
                p["dt_bias"] = torch.randn(H, generator=gen) * 0.1
        else:
            HV = shape["num_v_heads"]
            biases = HV * shape["head_k_dim"] if self.per_channel else HV
            p = {}
            if "A_log" in planned:
                p["A_log"] = torch.log(torch.rand(HV, generator=gen) * 4 + 0.5)
                p["dt_bias"] = torch.randn(biases, generator=gen) * 0.1
        return {k: v.to(device) for k, v in p.items()}

    def token(self, gen, batch: int, shape: dict, options: dict, act, device: str) -> dict:
        """One batch of per-row inputs."""
        planned = self.planned(options)

        def rn(*s, scale=1.0):
            return torch.randn(*s, generator=gen) * scale

        if self.name == "mamba2":
            H, G = shape["num_heads"], shape["ngroups"]
            P, N = shape["headdim"], shape["dstate"]
            t = {
                "x": rn(batch, H, P).to(act),
                "dt": rn(batch, H, scale=0.5),
                "B": rn(batch, G, N).to(act),
                "C": rn(batch, G, N).to(act),
            }
            if "z" in planned:
                t["z"] = rn(batch, H, P).to(act)
        else:
            H, HV = shape["num_k_heads"], shape["num_v_heads"]
            K, V = shape["head_k_dim"], shape["head_v_dim"]
            # Without the in-kernel L2 norm, keys of norm about 1 keep the delta rule stable.
            qk = 1.0 if options.get("use_qk_l2norm", True) else K**-0.5
            t = {
                "q": rn(batch, H, K, scale=qk).to(act),
                "k": rn(batch, H, K, scale=qk).to(act),
                "v": rn(batch, HV, V).to(act),
            }
            decays = (batch, HV, K) if self.per_channel else (batch, HV)
            if "a" in planned:
                t["a"], t["b"] = rn(*decays), rn(batch, HV)
            else:
                t["g"] = -torch.nn.functional.softplus(rn(*decays))
                t["beta"] = torch.sigmoid(rn(batch, HV))
        return {k: v.to(device) for k, v in t.items()}

    def fresh(self, name: str, gen, batch: int, shape: dict, act, device: str) -> torch.Tensor:
        """A valid value of input `name` (for one the plan does not take)."""
        everything = {"has_D": True, "has_z": True, "has_dt_bias": True}
        if name in ("g", "beta"):
            everything = {"gates_in_kernel": False}
        values = {
            **self.token(gen, batch, shape, everything, act, device),
            **self.params(gen, shape, everything, device),
        }
        return values[name]

    # --- the reference ---------------------------------------------------------------------
    def reference(self, pool: torch.Tensor, slots: torch.Tensor, args: dict, options: dict,
                  pad: int) -> torch.Tensor:  # fmt: skip
        """The float64 conventional pool step on `pool` (CPU, updated in place)."""
        a = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        if self.name == "mamba2":
            return mamba2_step_pool(
                pool, slots, a["x"], a["dt"], a["A"], a["B"], a["C"], D=a.get("D"),
                z=a.get("z"), dt_bias=a.get("dt_bias"),
                dt_softplus=options.get("dt_softplus", True), pad_slot_id=pad,
            )  # fmt: skip
        gates, step_pool = (
            (kda_gates, kda_step_pool) if self.per_channel else (gdn_gates, gdn_step_pool)
        )
        if "a" in a:
            g, beta = gates(a["A_log"], a["a"], a["dt_bias"], a["b"])
        else:
            g, beta = a["g"], a["beta"]
        return step_pool(
            pool, slots, a["q"], a["k"], a["v"], g, beta, scale=options.get("scale"),
            use_qk_l2norm=options.get("use_qk_l2norm", True), pad_slot_id=pad,
        )  # fmt: skip

    def record_values(self, args: dict, options: dict) -> dict[str, torch.Tensor]:
        """ring name -> this token's record per row, [batch, heads, ...] (CPU, float64)."""
        a = {k: v.cpu() for k, v in args.items() if isinstance(v, torch.Tensor)}
        if self.name == "mamba2":
            dt = a["dt"].double()
            if "dt_bias" in a:
                dt = dt + a["dt_bias"].double()
            if options.get("dt_softplus", True):
                dt = _softplus(dt)
            return {"rec_x": a["x"], "rec_b": a["B"], "rec_dt": dt}
        if "a" in a:
            gates = kda_gates if self.per_channel else gdn_gates
            g, _ = gates(a["A_log"], a["a"], a["dt_bias"], a["b"])
        else:
            g = a["g"].double()
        return {"rec_k": a["k"], "rec_g": g}


MAMBA2 = Adapter(
    name="mamba2",
    cache_cls=Mamba2DecodeCache,
    wrapper_cls=Mamba2DecodeWrapper,
    op=mamba2_decode,
    shapes={
        "cpu": (
            dict(ngroups=1, num_heads=1, dstate=16, headdim=16),
            dict(ngroups=2, num_heads=4, dstate=16, headdim=16),
            dict(ngroups=1, num_heads=3, dstate=32, headdim=8),
            dict(ngroups=3, num_heads=6, dstate=64, headdim=24),
        ),
        "cuda": (dict(ngroups=2, num_heads=4, dstate=64, headdim=64),),
    },
    inputs={
        "x": (True, "aligned"),
        "dt": (True, "any"),
        "A": (False, "contiguous"),
        "B": (True, "aligned"),
        "C": (True, "aligned"),
        "D": (False, "contiguous"),
        "z": (True, "aligned"),
        "dt_bias": (False, "contiguous"),
    },
    positional=("x", "dt", "A", "B", "C"),
    records={"rec_x": True, "rec_b": True, "rec_dt": False},
)

GDN = Adapter(
    name="gdn",
    cache_cls=GDNDecodeCache,
    wrapper_cls=GDNDecodeWrapper,
    op=gdn_decode,
    shapes={
        "cpu": (
            dict(num_k_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16),
            dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16),
            dict(num_k_heads=1, num_v_heads=3, head_k_dim=32, head_v_dim=8),
            dict(num_k_heads=2, num_v_heads=2, head_k_dim=64, head_v_dim=24),
        ),
        "cuda": (dict(num_k_heads=1, num_v_heads=2, head_k_dim=128, head_v_dim=64),),
    },
    inputs={
        "q": (True, "aligned"),
        "k": (True, "aligned"),
        "v": (True, "aligned"),
        "a": (True, "any"),
        "b": (True, "any"),
        "A_log": (False, "contiguous"),
        "dt_bias": (False, "contiguous"),
        "g": (True, "any"),
        "beta": (True, "any"),
    },
    positional=("q", "k", "v"),
    records={"rec_k": True, "rec_g": False},
)

KDA = Adapter(
    name="kda",
    cache_cls=KDADecodeCache,
    wrapper_cls=KDADecodeWrapper,
    op=kda_decode,
    shapes={"cpu": GDN.shapes["cpu"]},  # (no CUDA shapes: the sanitizer preset has no KDA yet)
    inputs={**GDN.inputs, "a": (True, "inner"), "g": (True, "inner")},
    positional=GDN.positional,
    records=GDN.records,
)

ADAPTERS = {a.name: a for a in (MAMBA2, GDN, KDA)}


def adapters_on(device: str) -> list[str]:
    """The names of the adapters with shapes on `device`, sorted."""
    return sorted(name for name, a in ADAPTERS.items() if device in a.shapes)
