import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from replayssm_jit.launch.environment import reload_launch_environment

# Every folder's tests import the shared scaffolding as `support.x`, under any import mode.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    has_nvcc = shutil.which("nvcc") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "nvcc" in item.keywords and not has_nvcc:
            item.add_marker(pytest.mark.skip(reason="needs nvcc"))


@pytest.fixture
def jit_cache(tmp_path, monkeypatch):
    """An empty, private JIT cache and no AOT directories."""
    monkeypatch.setenv("REPLAYSSM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("REPLAYSSM_AOT_DIR", "")
    monkeypatch.setenv("REPLAYSSM_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.delenv("REPLAYSSM_DISABLE_JIT", raising=False)
    from replayssm_jit.jit import build

    build._LOADED.clear()
    yield tmp_path / "cache"
    build._LOADED.clear()


TINY_SOURCE = """#include <tvm/ffi/function.h>
int tiny_answer(int x) { return x + 41; }
TVM_FFI_DLL_EXPORT_TYPED_FUNC(answer, tiny_answer);
"""


@pytest.fixture(scope="session")
def tiny_so(tmp_path_factory) -> bytes:
    """The bytes of a real tvm-ffi module (answer(x) = x + 41), built once with the host C++
    compiler (seconds)."""
    if not (shutil.which("c++") or shutil.which("g++")) or not shutil.which("ninja"):
        pytest.skip("needs a host C++ compiler and ninja to build a tiny tvm-ffi module")
    import tvm_ffi.cpp

    root = tmp_path_factory.mktemp("tiny")
    (root / "tiny.cc").write_text(TINY_SOURCE)
    path = tvm_ffi.cpp.build(
        "tiny", cpp_files=[str(root / "tiny.cc")], build_directory=str(root / "build")
    )
    return Path(path).read_bytes()


@pytest.fixture(scope="session")
def aot_split_modules(tmp_path_factory):
    """AOT builds (sm_90a, nvcc) of one split-capable module per family, made once per session
    and in parallel (each takes about half a minute): the `ci` preset's Mamba-2 spec (super120b
    heads, L = 16) and qwen4b's GDN spec (L = 16). Returns (aot_dir, {family: (spec, so_path)})."""
    from replayssm_jit.families.spec import gdn_spec
    from replayssm_jit.jit.aot import build_aot
    from replayssm_jit.jit.presets import preset_specs

    specs = [
        preset_specs(["ci"])[0],
        gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, window=16),
    ]
    aot = tmp_path_factory.mktemp("aot")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REPLAYSSM_CACHE_DIR", str(aot.parent / "aot-build-cache"))
        built = build_aot(specs, aot, jobs=len(specs), archs=["9.0a"])
    by_name = {path.name: path for path in built}
    return aot, {s.family: (s, by_name[f"{s.uri}.so"]) for s in specs}


# ---------------------------------------------------------------------------------------------
# Reference-oracle test helpers (tests/reference/test_reference_*.py): relative-error check and
# the random flush / speculative schedule driver.
# ---------------------------------------------------------------------------------------------


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """norm(actual - expected) / norm(expected), in float64."""
    diff = actual.to(torch.float64) - expected.to(torch.float64)
    return float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(expected.double()))


def _assert_rel(actual, expected, tol=1e-12, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert float(torch.linalg.vector_norm(expected.double())) > 0, f"{what}: zero reference"
    err = _rel_err(actual, expected)
    assert err == err and err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


@pytest.fixture
def assert_rel():
    """``assert_rel(actual, expected, tol=1e-12, what="")``: relative-error check that fails on
    NaN, on shape mismatch and on an all-zero reference."""
    return _assert_rel


def _randint(gen, lo, hi):  # inclusive
    return int(torch.randint(lo, hi + 1, (), generator=gen))


def _chance(gen, p):
    return float(torch.rand((), generator=gen, dtype=torch.float64)) < p


def _run_schedule(
    seq, state, conv, tokens, gen, steps, *, p_flush=0.05, p_spec=0.3, p_tree=0.5, tol=1e-12
):
    """Drive a reference ``ReplaySequence`` and the conventional recurrence side by side.

    seq: the sequence helper (its checkpoint equals ``state`` at the start); conv(state, **tok)
    -> (out, new_state) for ONE unbatched token; tokens(T) -> dict of [T, ...] fresh inputs.
    Each iteration may flush explicitly, then either steps one token or verifies T in 1..seq.T
    drafts (chain or random tree), checks every draft output against the conventional recurrence
    along its root path, and commits a random prefix / root path. The expected n (window policy,
    early flush) is tracked independently; whenever the reference folds, its checkpoint must
    equal the conventional state. Returns counts of what happened.
    """
    n = 0
    stats = dict(steps=0, tokens=0, explicit=0, window=0, early=0, chain=0, tree=0, accepted=0)

    def check_fold(what):
        assert seq.n == 0
        _assert_rel(seq.checkpoint, state, tol, what)

    for it in range(steps):
        if _chance(gen, p_flush):
            seq.flush()
            n = 0
            stats["explicit"] += 1
            check_fold(f"iter {it}: checkpoint after flush()")
        if _chance(gen, p_spec):
            t = _randint(gen, 1, seq.T)
            drafts = tokens(t)
            tree = _chance(gen, p_tree)
            parents = [_randint(gen, -1, j - 1) for j in range(t)] if tree else None
            plist = parents if tree else list(range(-1, t - 1))
            outs = seq.verify(parents=parents, **drafts)
            if n + t >= seq.L + seq.T:
                n = 0
                stats["early"] += 1
                check_fold(f"iter {it}: checkpoint after early flush")
            paths = []
            for j in range(t):  # root path of draft j, walked here independently of the reference
                path = [j]
                while plist[path[0]] >= 0:
                    path.insert(0, plist[path[0]])
                paths.append(path)
                s = state
                for i in path:
                    out, s = conv(s, **{k: v[i] for k, v in drafts.items()})
                _assert_rel(outs[j], out, tol, f"iter {it}: draft {j} of {plist}")
            if tree:
                pick = _randint(gen, -1, t - 1)
                accepted = [] if pick < 0 else paths[pick]
                seq.commit(accepted)
                stats["tree"] += 1
            else:
                accepted = list(range(_randint(gen, 0, t)))
                seq.commit(len(accepted))
                stats["chain"] += 1
            for i in accepted:
                _, state = conv(state, **{k: v[i] for k, v in drafts.items()})
            n += len(accepted)
            stats["accepted"] += len(accepted)
            stats["tokens"] += len(accepted)
        else:
            tok = {k: v[0] for k, v in tokens(1).items()}
            out = seq.step(**tok)
            ref, state = conv(state, **tok)
            _assert_rel(out, ref, tol, f"iter {it}: step output")
            stats["steps"] += 1
            stats["tokens"] += 1
            n = 0 if n + 1 >= seq.L else n + 1
            assert seq.last_step_flushed == (n == 0)
            if n == 0:
                stats["window"] += 1
                check_fold(f"iter {it}: checkpoint after flush step")
        assert seq.n == n, f"iter {it}: n = {seq.n}, expected {n}"
    _assert_rel(seq.materialize(), state, tol, "final state")
    return stats


@pytest.fixture
def run_schedule():
    """The random flush / speculative schedule driver of the reference tests (``_run_schedule``)."""
    return _run_schedule


@pytest.fixture
def single_thread():
    """Run on one intra-op thread: the references' many small float64 ops are far faster so
    (and do not thrash when the 2-core CI box is busy)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _launch_environment_read_afresh():
    """Each test starts from the launch variables as they are now (the package reads them once:
    launch/environment.py)."""
    reload_launch_environment()


@pytest.fixture
def launch_env():
    """set(name, value or None): set or unset a launch variable (REPLAYSSM_LAUNCH,
    REPLAYSSM_TUNING) and have the package read it again; each is restored after the test."""
    saved: dict[str, str | None] = {}

    def set_variable(name: str, value: str | None) -> None:
        saved.setdefault(name, os.environ.get(name))
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        reload_launch_environment()

    yield set_variable
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    reload_launch_environment()


@pytest.fixture
def no_launch_env(launch_env):
    """No REPLAYSSM_LAUNCH from the caller's environment: the launch policy's own choices."""
    from replayssm_jit.launch.config import LAUNCH_ENV

    launch_env(LAUNCH_ENV, None)


@pytest.fixture(params=["split", "per-item"])
def replay_kernel(request, launch_env):
    """Run the test once per ReplaySSM kernel (REPLAYSSM_LAUNCH="kernel=...", which fills the
    kernel of every plan whose LaunchConfig leaves it "auto")."""
    from replayssm_jit.launch.config import LAUNCH_ENV

    launch_env(LAUNCH_ENV, f"kernel={request.param}")
    return request.param


# ---------------------------------------------------------------------------------------------
# Hypothesis profiles (HYPOTHESIS_PROFILE selects one; "ci" by default): "ci" keeps the fuzzing of
# tests/ops/test_fuzz_entries.py well under two minutes on two cores, "long" runs many more
# examples.
# ---------------------------------------------------------------------------------------------


from hypothesis import HealthCheck, settings  # noqa: E402

_SLOW_DRAWS = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci", max_examples=200, deadline=None, print_blob=True, suppress_health_check=_SLOW_DRAWS
)
settings.register_profile(
    "long", max_examples=2000, deadline=None, print_blob=True, suppress_health_check=_SLOW_DRAWS
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter):
    """How many fuzzed calls ran this session (support/fuzz/core.py counts them), per entry."""
    core = sys.modules.get("support.fuzz.core")
    if core is None or not core.COUNTS:
        return
    counts = core.COUNTS
    names = sorted({name for name, _ in counts})
    total = sum(counts.values())
    terminalreporter.write_sep(
        "-", f"fuzzed calls: {total} ({settings().max_examples} examples per entry)"
    )
    for name in names:
        ok, err = counts[name, "ok"], counts[name, "error"]
        terminalreporter.write_line(
            f"{name:28s} {ok + err:6d} calls: {ok:6d} succeeded, {err:6d} rejected"
        )
