"""scripts/sanitize_kernels.py on the CPU: --list, --check-preset against the AOT `sanitizer`
preset, and the schedules' own bookkeeping (--device cpu), the speculative configs included."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from support import aot_presets as aot
from support.paths import SCRIPTS

from replayssm_jit.families import FAMILIES

SCRIPT = SCRIPTS / "sanitize_kernels.py"
SPECULATIVE = list(FAMILIES)


@pytest.fixture(scope="module")
def sk():
    spec = importlib.util.spec_from_file_location("sanitize_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sanitize_kernels"] = module  # (dataclasses look their module up by name)
    spec.loader.exec_module(module)
    yield module
    for name in ("sanitize_kernels", "sanitize_configs", "sanitize_schedules"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def cfg(sk):
    """The script's config tables: scripts/sanitize_configs.py, as the script imported it."""
    return sys.modules["sanitize_configs"]


def test_list_names_every_speculative_config(sk, cfg, capsys):
    assert sk.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    configs = sk.all_configs(list(FAMILIES), quick=False)
    assert lines[-1].startswith(f"{len(configs)} configs (")
    assert f"{len({c.uri for c in configs})} specs" in lines[-1]
    spec = [c for c in configs if isinstance(c, sk.SpecConfig)]
    decode = [c for c in configs if not isinstance(c, sk.SpecConfig)]
    # Every family x op x verify kernel x drafts x checkpoint dtype, each in every compiled
    # verify tile; the split verify wherever the family has one.
    assert {c.family for c in spec} == set(SPECULATIVE) and "kda" in SPECULATIVE
    for family in SPECULATIVE:
        for op in sk.SPEC_OPS:
            for drafts in cfg.SPEC_DRAFTS:
                for state, sr in cfg.STATES:
                    if not cfg.format_supported(family, state, drafts):
                        continue
                    got = [c for c in spec if (c.family, c.op, c.drafts, c.state, c.sr)
                           == (family, op, drafts, state, sr)]  # fmt: skip
                    kernels = ["per-item"]
                    if op == "verify" and cfg.can_split_verify(got[0].spec):
                        kernels.append("split")
                    assert sorted({c.kernel for c in got}) == sorted(kernels)
                    tiles = [r for r, _ in cfg.spec_tilings(got[0].spec)]
                    for kernel in kernels:
                        rows = [c.rows_per_cta for c in got if c.kernel == kernel]
                        assert sorted(rows) == sorted(tiles)
                    assert all(f"_L{cfg.WINDOW}_T{drafts}_" in c.uri for c in got)
    assert any(c.kernel == "split" for c in spec if c.family == "mamba2")
    assert {c.spec.drafts for c in decode} == {1}
    listed = "\n".join(lines)
    assert all(c.name in listed for c in spec)


def test_list_selects_ops(sk, cfg, capsys):
    assert sk.main(["--list", "--ops", "verify", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(" verify " in line for line in lines[:-1])
    states = [s for s, _ in cfg.QUICK_STATES if cfg.format_supported("mamba2", s, 2)]
    per_kernel = len(cfg.SPEC_DRAFTS) * len(states) * 2  # two tiles each
    splits = sum(1 for f in SPECULATIVE if any(" verify split " in x and f in x for x in lines))
    # Every speculative family has a split verify but KDA (per item only).
    assert splits == len(SPECULATIVE) - 1 and not any("kda" in x and " split " in x for x in lines)
    assert len(lines) - 1 == per_kernel * (len(SPECULATIVE) + splits)
    assert sum(" verify split " in line for line in lines) == per_kernel * splits


def test_check_preset_matches_the_configs(sk, cfg, capsys):
    assert sk.main(["--check-preset"]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith(": ok")
    preset = aot.PRESETS["sanitizer"]()
    assert len(preset) == len({s.uri for s in preset})  # (no spec listed twice)
    assert {s.drafts for s in preset} == {1, *cfg.SPEC_DRAFTS}
    assert sk.main(["--check-preset", "--ops", "snapshot"]) == 0


def test_check_preset_names_a_missing_speculative_spec(sk, capsys, monkeypatch):
    full = aot.PRESETS["sanitizer"]
    monkeypatch.setitem(aot.PRESETS, "sanitizer", lambda: [s for s in full() if s.drafts != 4])
    assert sk.main(["--check-preset"]) == 1
    out = capsys.readouterr().out
    assert "not in preset 'sanitizer': " in out and "_T4_" in out
    assert "MISMATCH" in out


def test_speculative_schedules_run_on_the_cpu(sk, capsys):
    """Pad rows, the corrupted cursor, every draft count, early flushes, mixed launches, ring
    rows rewritten, tree compactions and fused commits: a config that misses one fails."""
    argv = ["--device", "cpu", "--ops", "verify", "snapshot", "--quick", "--shard", "0/4"]
    assert sk.main([*argv, "--outputs", "nan"]) == 0
    out = capsys.readouterr().out
    assert "0 failed, 0 not run" in out
    assert " verify " in out and " snapshot " in out
