"""The vLLM plugin: declared as a vllm.general_plugins entry point, a no-op (with its reason)
without the setting or without vLLM, and with both it puts ReplaySSM's SSU backend in vLLM's
registry, whose instance takes ssu_dispatch's call and decodes on the CPU path. vLLM is absent
here: a stub with the names the plugin touches (MambaSSUBackend, _BACKEND_REGISTRY,
MambaBackendEnum) stands in, and the real import runs where vLLM is installed."""

from __future__ import annotations

import enum
import importlib.util
import logging
import sys
import types

import pytest
import torch
from support.paths import ROOT

from replayssm_jit.integrations.vllm import plugin
from replayssm_jit.reference.mamba2 import mamba2_step

tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)

H, G, P, N, SLOTS = 4, 2, 8, 16, 5

pytestmark = pytest.mark.usefixtures("no_launch_env")


def test_the_entry_point_is_declared_and_resolves():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["vllm.general_plugins"]["replayssm"]
    module, func = target.split(":")
    assert getattr(importlib.import_module(module), func) is plugin.register


def test_without_the_setting_nothing_registers(monkeypatch, caplog):
    monkeypatch.delenv("REPLAYSSM_VLLM", raising=False)
    with caplog.at_level(logging.INFO, "replayssm_jit.vllm"):
        assert plugin.register() is False
    assert "REPLAYSSM_VLLM=1" in caplog.text


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_the_plugin_is_a_no_op_that_says_so(monkeypatch, caplog):
    monkeypatch.setenv("REPLAYSSM_VLLM", "1")
    with caplog.at_level(logging.INFO, "replayssm_jit.vllm"):
        assert plugin.register() is False
    assert "not importable" in caplog.text


def stub_vllm(monkeypatch):
    """The vLLM names the plugin touches, as module objects in sys.modules."""

    class MambaBackendEnum(enum.Enum):
        TRITON = "triton"
        FLASHINFER = "flashinfer"

    class MambaSSUBackend:
        def __init__(self, mamba_config):
            self._mamba_config = mamba_config

    names = ["vllm", "vllm.config", "vllm.config.mamba", "vllm.model_executor",
             "vllm.model_executor.layers", "vllm.model_executor.layers.mamba",
             "vllm.model_executor.layers.mamba.ops", plugin.SSU_DISPATCH]  # fmt: skip
    mods = {name: types.ModuleType(name) for name in names}
    mods["vllm.config.mamba"].MambaBackendEnum = MambaBackendEnum
    ssu = mods[plugin.SSU_DISPATCH]
    ssu.MambaSSUBackend = MambaSSUBackend
    ssu._BACKEND_REGISTRY = {MambaBackendEnum.TRITON: object, MambaBackendEnum.FLASHINFER: object}
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return ssu, MambaBackendEnum


def test_with_vllm_the_backend_takes_ssu_dispatchs_call(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_VLLM", "1")
    monkeypatch.setenv("REPLAYSSM_VLLM_WINDOW", "4")
    monkeypatch.setattr(plugin.BACKEND, "_layers", {})
    ssu, enum_ = stub_vllm(monkeypatch)
    assert plugin.register() is True
    cls = ssu._BACKEND_REGISTRY[enum_.TRITON]
    assert (
        issubclass(cls, ssu.MambaSSUBackend) and ssu._BACKEND_REGISTRY[enum_.FLASHINFER] is object
    )
    backend = cls(mamba_config=None)
    assert backend.name == "replayssm"
    gen = torch.Generator().manual_seed(31)
    ssm_state = torch.zeros(SLOTS, H, P, N)
    A, D, dt_bias = -(0.5 + torch.rand(H, generator=gen)), torch.randn(H), torch.rand(H)
    ref = torch.zeros(SLOTS, H, P, N, dtype=torch.float64)
    idx = torch.tensor([2, 0, 4], dtype=torch.int32)
    for _ in range(6):
        x = torch.randn(3, H, P, generator=gen)
        dt = torch.rand(3, H, generator=gen)
        B, C = torch.randn(3, G, N, generator=gen), torch.randn(3, G, N, generator=gen)
        out = torch.empty(3, H, P)
        # ssu_dispatch.selective_state_update's call of the registered backend:
        backend(ssm_state, x, dt[:, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N),
                B, C, D[:, None].expand(-1, P), dt_bias[:, None].expand(-1, P), z=None,
                dt_softplus=True, state_batch_indices=idx, dst_state_batch_indices=idx,
                null_block_id=0, out=out, num_accepted_tokens=None, cu_seqlens=None,
                is_blackwell=False)  # fmt: skip
        live = [0, 2]
        o, new = mamba2_step(ref[[2, 4]], x[live], dt[live], A, B[live], C[live], D=D,
                             dt_bias=dt_bias, dt_softplus=True)  # fmt: skip
        ref[[2, 4]] = new
        err = torch.linalg.vector_norm(out[live].double() - o) / torch.linalg.vector_norm(o)
        assert err < 2e-5 and torch.equal(out[1], torch.zeros(H, P))
    assert plugin.BACKEND.layer(ssm_state).layout.window == 4


def test_with_the_real_vllm_the_backend_registers(monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("REPLAYSSM_VLLM", "1")
    from vllm.config.mamba import MambaBackendEnum
    from vllm.model_executor.layers.mamba.ops import ssu_dispatch

    saved = dict(ssu_dispatch._BACKEND_REGISTRY)
    try:
        assert plugin.register() is True
        assert ssu_dispatch._BACKEND_REGISTRY[MambaBackendEnum.TRITON].__name__ == (
            "ReplaySSMSSUBackend"
        )
    finally:
        ssu_dispatch._BACKEND_REGISTRY.clear()
        ssu_dispatch._BACKEND_REGISTRY.update(saved)
