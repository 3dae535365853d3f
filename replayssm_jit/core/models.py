"""SSM layer shapes of the models we target (ReplaySSM paper, Table 5)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    family: str  # "mamba2", "gdn" or "kda"
    ssm_layers: int
    key_heads: int  # Mamba-2: groups G; GDN / KDA: key heads H
    value_heads: int  # Mamba-2: heads H; GDN / KDA: value heads HV
    d_k: int  # Mamba-2: dstate N; GDN / KDA: K
    d_v: int  # Mamba-2: headdim P; GDN / KDA: V

    def state_bytes(self, bytes_per_element: int = 4) -> int:
        """Bytes of recurrent state per sequence per layer."""
        return self.value_heads * self.d_v * self.d_k * bytes_per_element


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("nemotron-3-nano-4b", "mamba2", 21, 8, 96, 128, 80),
        ModelShape("nemotron-3-super-120b", "mamba2", 40, 8, 128, 128, 64),
        ModelShape("qwen3.5-4b", "gdn", 24, 16, 32, 128, 128),
        ModelShape("qwen3.5-122b", "gdn", 36, 16, 64, 128, 128),
        # Kimi-Linear-48B-A3B: 20 of its 27 layers are KDA (3 KDA : 1 MLA).
        ModelShape("kimi-linear-48b", "kda", 20, 32, 32, 128, 128),
    )
}
ALIASES = {
    "nano4b": "nemotron-3-nano-4b",
    "super120b": "nemotron-3-super-120b",
    "qwen4b": "qwen3.5-4b",
    "qwen122b": "qwen3.5-122b",
    "kimi48b": "kimi-linear-48b",
}


def get_model(name: str) -> ModelShape:
    key = ALIASES.get(name, name)
    if key not in MODELS:
        raise ValueError(f"model: expected one of {sorted(MODELS) + sorted(ALIASES)}, got {name!r}")
    return MODELS[key]
