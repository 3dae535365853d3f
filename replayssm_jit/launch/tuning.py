"""Tuning files: the launch candidates of a step, and the tuned choices a plan takes.

`python -m replayssm_jit autotune` (replayssm_jit/cli/autotune.py) times every candidate on the
present GPU and writes the fastest per (spec, mode, batch) to a JSON file. plan_decode reads the
file where one is given (`tuning=FILE`, or the
REPLAYSSM_TUNING environment variable) and falls back to the built-in policy for anything the
file does not cover: another device, spec or mode, or a batch above the largest one timed. A
batch takes the entry of the smallest timed batch at or above it. Fields the caller's
LaunchConfig fixes always win over the file. A replay plan with drafts also takes the file's
"verify" entries (`autotune --drafts T`), which set only the verify kernel and its tile.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path

import torch

from replayssm_jit.families.spec import KernelSpec, spec_tilings
from replayssm_jit.launch.config import AUTO, LaunchConfig
from replayssm_jit.launch.environment import TUNING_ENV, launch_environment
from replayssm_jit.launch.policy import can_split, can_split_verify, flushes_every_step_when_small

FORMAT_VERSION = 1

__all__ = [
    "FORMAT_VERSION", "TUNING_ENV", "Tuning", "candidates", "device_name", "load_tuning",
    "set_fields", "tuned_config",
]  # fmt: skip


def device_name(device: torch.device) -> str:
    """The name a tuning file is keyed by: the CUDA device's, or "cpu"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@dataclass(frozen=True)
class Tuning:
    """A loaded tuning file: the device it was measured on and, per (spec URI, mode), the
    (batch, LaunchConfig) entries in increasing batch."""

    path: str
    device: str
    entries: dict

    def config_for(self, spec: KernelSpec, mode: str, batch: int, device: torch.device):
        """The tuned LaunchConfig of a step, or None where the file does not cover it."""
        if device_name(device) != self.device:
            return None
        for timed, config in self.entries.get((spec.uri, mode), ()):
            if batch <= timed:
                return config
        return None


def _bad(path: str, what: str) -> ValueError:
    return ValueError(f"tuning: {path} is not a tuning file ({what})")


@lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int) -> Tuning:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"tuning: cannot read {path} as JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
        raise _bad(
            path,
            f"expected format {FORMAT_VERSION}, got {data.get('format') if isinstance(data, dict) else data!r}",
        )
    if not isinstance(data.get("device"), str) or not isinstance(data.get("entries"), list):
        raise _bad(path, "expected a 'device' string and an 'entries' list")
    entries: dict = {}
    for i, e in enumerate(data["entries"]):
        try:
            key = (str(e["uri"]), str(e["mode"]))
            batch = int(e["batch"])
            config = LaunchConfig(**e["config"])
        except (KeyError, TypeError, ValueError) as exc:
            raise _bad(path, f"entry {i}: {exc}") from None
        entries.setdefault(key, []).append((batch, config))
    for rows in entries.values():
        rows.sort(key=lambda r: r[0])
    return Tuning(path, data["device"], entries)


def load_tuning(path: object) -> Tuning:
    """The tuning file at `path` (a str or Path), read once per modification."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"tuning: expected a path (str or os.PathLike), got {type(path).__name__}")
    path = os.fspath(path)
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError as exc:
        raise ValueError(f"tuning: cannot read {path} ({exc.strerror})") from None
    return _load(path, mtime)


def tuned_config(config: LaunchConfig, tuning: object, spec: KernelSpec, mode: str, batch: int,
                 device: torch.device) -> LaunchConfig:  # fmt: skip
    """`config` with its "auto" fields taken from the tuning file (the argument, else
    REPLAYSSM_TUNING as read once (launch/environment.py), else none) where the file covers
    this step."""
    if tuning is None:
        tuning = launch_environment().tuning
        if tuning is None:
            return config
    loaded = tuning if isinstance(tuning, Tuning) else load_tuning(tuning)
    tuned = loaded.config_for(spec, mode, batch, device)
    if tuned is None:
        return config
    filled = {
        f.name: getattr(tuned, f.name)
        for f in fields(LaunchConfig)
        if getattr(config, f.name) == AUTO and getattr(tuned, f.name) != AUTO
    }
    return replace(config, **filled)


def candidates(spec: KernelSpec, mode: str) -> list[LaunchConfig]:
    """Every launch a step of `spec` can take: its compiled row tiles, and in replay mode each
    ReplaySSM kernel it has (flush-every-step where the policy may choose it:
    flushes_every_step_when_small);
    in "verify" mode (a spec with drafts) each verify kernel it has, with each tile."""
    tiles = [rows for rows, _ in spec_tilings(spec)]
    if mode == "verify":
        kernels = ["per-item", "split"] if can_split_verify(spec) else ["per-item"]
        return [
            LaunchConfig(verify_kernel=k, verify_rows_per_cta=r) for k in kernels for r in tiles
        ]
    if mode == "conventional":
        return [LaunchConfig(rows_per_cta=r) for r in tiles]
    kernels = ["per-item"]
    if flushes_every_step_when_small(spec):
        kernels.append("flush-every-step")
    if can_split(spec):
        kernels.append("split")
    return [LaunchConfig(kernel=k, rows_per_cta=r) for k in kernels for r in tiles]


def set_fields(config: LaunchConfig) -> dict:
    return {k: v for k, v in asdict(config).items() if v != AUTO}
