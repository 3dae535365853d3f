"""Autotuning the verify (issue 39: every (family, B, T) picks the fastest, by the policy and
autotune): LaunchConfig's verify fields, the "verify" candidates and tuning entries, plan_decode
reading them, and the timed verify. Timings come from a stand-in timer; the GPU test re-times."""

from __future__ import annotations

import json

import pytest
import torch

from replayssm_jit import LaunchConfig, gdn_layout, kda_layout, mamba2_layout, plan_decode
from replayssm_jit.cli import autotune
from replayssm_jit.families.spec import spec_tilings
from replayssm_jit.launch import policy, tuning
from replayssm_jit.launch.config import parse_launch

pytestmark = pytest.mark.usefixtures("no_launch_env")


def super120b(**kw):
    return mamba2_layout(num_heads=128, headdim=64, dstate=128, ngroups=8, **kw)


@pytest.fixture(autouse=True)
def no_tuning_env(launch_env):
    launch_env(tuning.TUNING_ENV, None)


def test_verify_fields_are_checked_and_parsed():
    assert LaunchConfig(verify_kernel="split", verify_rows_per_cta=16).verify_kernel == "split"
    with pytest.raises(ValueError, match=r"config.verify_kernel: expected 'auto' or one of"):
        LaunchConfig(verify_kernel="flush-every-step")
    with pytest.raises(ValueError, match=r"config.verify_rows_per_cta: expected 'auto' or a posi"):
        LaunchConfig(verify_rows_per_cta=0)
    parsed = parse_launch("verify_kernel=per-item,verify_rows_per_cta=32")
    assert (parsed.verify_kernel, parsed.verify_rows_per_cta) == ("per-item", 32)


def test_the_policy_takes_the_verify_fields_before_kernel():
    spec = plan_decode(super120b(window=16, drafts=4), 256, device="cpu").spec
    choose = policy.choose_verify_kernel
    assert choose(spec, 256, 128, 132, LaunchConfig()) == "split"  # the policy's at batch 256
    assert choose(spec, 256, 128, 132, LaunchConfig(verify_kernel="per-item")) == "per-item"
    both = LaunchConfig(kernel="split", verify_kernel="per-item")
    assert choose(spec, 256, 128, 132, both) == "per-item"
    assert choose(spec, 1, 128, 132, LaunchConfig(verify_kernel="split")) == "split"


def test_a_verify_choice_the_spec_lacks_is_refused_on_every_device():
    kda = kda_layout(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, drafts=2)
    spec = plan_decode(kda, 8, device="cpu").spec
    assert not policy.can_split_verify(spec)  # (KDA verifies with the per-item kernel only)
    with pytest.raises(ValueError, match=r"config.verify_kernel: expected 'per-item' or 'auto'"):
        plan_decode(kda, 8, device="cpu", config=LaunchConfig(verify_kernel="split"))
    layout = super120b(window=16, drafts=4)
    tiles = [r for r, _ in spec_tilings(plan_decode(layout, 8, device="cpu").spec)]
    bad = max(tiles) * 2
    with pytest.raises(ValueError, match=rf"config.verify_rows_per_cta: expected one of .* {bad}"):
        plan_decode(layout, 8, device="cpu", config=LaunchConfig(verify_rows_per_cta=bad))


def test_verify_candidates_cover_each_verify_kernel_and_tile():
    spec = plan_decode(super120b(window=16, drafts=4), 256, device="cpu").spec
    tiles = {r for r, _ in spec_tilings(spec)}
    got = {(c.verify_kernel, c.verify_rows_per_cta) for c in tuning.candidates(spec, "verify")}
    assert got == {(k, r) for k in ("per-item", "split") for r in tiles}
    # Only the verify fields: the step's own launch stays the policy's (or its own entries').
    assert all(c.kernel == "auto" and c.rows_per_cta == "auto"
               for c in tuning.candidates(spec, "verify"))  # fmt: skip


def verify_timer(fastest):
    """10 us, or 1 us where the config's (verify_kernel, verify_rows_per_cta) is `fastest`."""
    return lambda plan, c: 1.0 if (c.verify_kernel, c.verify_rows_per_cta) == fastest else 10.0


def test_tune_verify_keeps_the_fastest_and_plan_reads_it(tmp_path, planned_configs):
    layout = super120b(window=16, drafts=4)
    fastest = ("per-item", 16)
    result = autotune.tune(layout, "verify", [8, 256], torch.device("cpu"), verify_timer(fastest))
    for e in result["entries"]:
        assert e["mode"] == "verify" and e["us"] == 1.0 and e["default_us"] == 10.0
        assert e["config"] == {"verify_kernel": "per-item", "verify_rows_per_cta": 16}
        assert set(e["default"]) == {"verify_kernel", "verify_rows_per_cta"}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(result))
    seen = planned_configs
    plan_decode(layout, 64, device="cpu", tuning=str(path))
    assert (seen[-1].verify_kernel, seen[-1].verify_rows_per_cta) == fastest
    assert (seen[-1].kernel, seen[-1].rows_per_cta) == ("auto", "auto")
    # A field the caller fixes wins; a plan without drafts, or a conventional one, takes none.
    plan_decode(layout, 64, device="cpu", tuning=str(path),
                config=LaunchConfig(verify_kernel="split"))  # fmt: skip
    assert (seen[-1].verify_kernel, seen[-1].verify_rows_per_cta) == ("split", 16)
    plan_decode(layout, 64, device="cpu", tuning=str(path), mode="conventional")
    assert seen[-1] == LaunchConfig()
    plan_decode(super120b(window=16), 64, device="cpu", tuning=str(path))
    assert seen[-1] == LaunchConfig()


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_the_timed_verify_runs_and_commits_every_family(family, monkeypatch):
    """The verify the graph timer captures, run on the CPU path: T drafts per row in the ops'
    dtypes; a slot set's first verify accepts nothing (none pending after the reset), each later
    one 1..T drafts per row, which moves every row's cursor."""
    small = dict(head_k_dim=16, head_v_dim=16, act_dtype=torch.bfloat16, drafts=3)
    layout = {
        "mamba2": lambda: mamba2_layout(num_heads=4, headdim=8, dstate=16, ngroups=2,
                                        act_dtype=torch.bfloat16, drafts=3),
        "gdn": lambda: gdn_layout(num_k_heads=2, num_v_heads=4, **small),
        "kda": lambda: kda_layout(num_k_heads=2, num_v_heads=4, **small),
    }[family]()  # fmt: skip
    plan = plan_decode(layout, 5, device="cpu")
    op = autotune.family_ops(plan.family).verify
    calls = []

    class Recording:
        @staticmethod
        def verify(*args, **kw):
            token = kw["x" if family == "mamba2" else "q"]
            calls.append((kw["num_accepted"].clone(), token.shape, kw["cursors"]))
            return op(*args, **kw)

    monkeypatch.setattr(autotune, "family_ops", lambda fam: Recording)
    step, slot_sets = autotune.timed_verify(plan, layout, min_pool_bytes=1)
    assert len(slot_sets) == 2 and all(len(s) == 5 for s in slot_sets)
    for s in slot_sets:
        step(s)
        accepted, shape, cursors = calls[-1]
        assert shape[:2] == (5, 3) and accepted.dtype == torch.int32 and not accepted.any()
        before = cursors[s.long()].clone()
        step(s)
        accepted, _, _ = calls[-1]
        assert accepted.min() >= 1 and accepted.max() <= 3
        assert (cursors[s.long()] != before).any(dim=-1).all()  # every row committed


@pytest.mark.gpu
def test_tuned_verify_is_never_slower_than_the_policy():
    """On the GPU: the tuned verify launch, re-timed, is within noise of the policy's or faster."""
    layout = super120b(window=16, drafts=4)
    timer = autotune.graph_timer(layout, min_pool_bytes=4e8, timed=autotune.timed_verify)
    dev = torch.device("cuda")
    result = autotune.tune(layout, "verify", [8, 256], dev, timer)
    for e in result["entries"]:  # (re-timed: the file's own figures are a minimum by design)
        tuned = LaunchConfig(**e["config"])
        plans = [plan_decode(layout, e["batch"], device=dev, config=c, check_slot_values=False)
                 for c in (tuned, LaunchConfig())]  # fmt: skip
        us = [timer(p, c) for p, c in zip(plans, (tuned, LaunchConfig()))]
        assert us[0] <= us[1] * 1.05, (e, us)
