"""Tensor checks shared by the test suites: bit-for-bit equality and relative error against a
float64 reference."""

from __future__ import annotations

import math

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN == NaN here, unlike torch.equal on floats)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert same_bits(actual, expected), f"{what}: bits differ"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """norm(got - ref) / norm(ref) in float64, on the CPU (NaN stays NaN, so `<= tol` fails)."""
    diff = (got.double().cpu() - ref.double().cpu()).norm()
    return (diff / ref.double().cpu().norm().clamp_min(1e-300)).item()


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float) -> None:
    """norm(actual - expected) / norm(expected) <= tol; fails on NaN / inf and on a zero
    reference."""
    a, e = actual.to(torch.float64), expected.to(torch.float64)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert bool(torch.isfinite(a).all()), f"{what}: non-finite values"
    ref = float(torch.linalg.vector_norm(e))
    assert ref > 0 and math.isfinite(ref), f"{what}: reference norm {ref}"
    err = float(torch.linalg.vector_norm(a - e)) / ref
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"
