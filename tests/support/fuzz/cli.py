"""Command-line entries: `python -m replayssm_jit demo|aot|autotune ...` through the in-process entry
(replayssm_jit.__main__.main), with the work itself (run_demo, build_aot) stubbed out, so
that only the argument handling runs.

A bad command line must end as argparse ends one: SystemExit(2) with the usage and an
"error:" line on stderr and no traceback (a clear error for a command line); `--help` exits
with 0. A good one must reach the stubbed work with the arguments as given.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import torch
from hypothesis import strategies as st

from replayssm_jit.__main__ import main
from replayssm_jit.cli import aot as aot_module
from replayssm_jit.cli import autotune as autotune_module
from replayssm_jit.cli import demo as demo_module
from replayssm_jit.core.models import ALIASES, MODELS, get_model

from .core import Call, EnvPatch, Validity, entry

MAX_BATCH = 65535
GOOD_INTS = {
    "batch": ("1", "2", "16", "65535", "1_0", "２", "+3", " 4"),
    "steps": ("1", "3", "10000"),
    "window": ("1", "16", "256"),
    "layers": ("1", "2"),
    "seed": ("0", "-1", "7", str(2**64 - 1), str(-(2**63))),
}
INT_TEXTS = ("1", "2", "16", "0", "-1", "256", "257", "65535", "65536", "1_0", "２", "+3",
             " 4", "abc", "1.5", "", "1e3", "9" * 25, "-9" * 1)  # fmt: skip


def _as_int(text: str) -> int | None:
    """What argparse's type=int makes of `text` (None: rejected)."""
    try:
        return int(text)
    except ValueError:
        return None


class Stub:
    """Stands in for a module function for the span of a `with` block, recording its calls."""

    def __init__(self, module, name: str, result):
        self.module, self.name, self.result, self.calls = module, name, result, []

    def __enter__(self):
        self.saved = getattr(self.module, self.name)
        setattr(self.module, self.name, self)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.saved)

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


FAKE_DEMO = {
    "model": "m", "backend": "b", "batch": 1, "steps": 1, "layers": 1, "window": 1,
    "max_rel_diff": 0.0, "seconds": 0.0, "flush_fraction": 0.0, "mean_held": 0.0,
    "bytes": {"conventional": 2.0, "replay": 1.0, "record": 1.0},
}  # fmt: skip


def argparse_exit(exc: BaseException, out: io.StringIO, err: io.StringIO, command: str) -> None:
    """`exc` is argparse's clear end of a command line."""
    assert isinstance(exc, SystemExit), f"{type(exc).__name__}: {exc}"
    if exc.code == 0:
        assert "usage:" in out.getvalue(), "--help without the usage"
        return
    assert exc.code == 2, f"exit code {exc.code}"
    text = err.getvalue()
    assert f"usage: python -m replayssm_jit {command}" in text and "error:" in text, text
    assert "Traceback" not in text


def _cli_call(argv, v: Validity, command: str, stubs, check, env=None) -> Call:
    out, err = io.StringIO(), io.StringIO()

    def run():
        out.seek(0), out.truncate(), err.seek(0), err.truncate()
        with contextlib.ExitStack() as stack:
            for stub in stubs:
                stack.enter_context(stub)
            stack.enter_context(EnvPatch(env or {}))
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
            return main(argv)

    def clear(exc):
        argparse_exit(exc, out, err, command)

    def checked(rc):
        assert rc == 0, f"rc {rc}; stderr {err.getvalue()!r}"
        check(out.getvalue())

    return Call(run, (), check=checked, valid=v.valid, why=v.why, clear=clear,
                errors=(SystemExit,))  # fmt: skip


@entry("cli.demo", covers=("python -m replayssm_jit demo",), devices=("cpu",))
def build_cli_demo(draw, device):
    v = Validity()
    argv = ["demo"]
    want = {"model": "nemotron-3-nano-4b", "batch": 2, "steps": 36, "window": 16, "layers": 2,
            "backend": "auto", "seed": 0}  # fmt: skip
    helped = False
    for _ in range(draw(st.integers(0, 5))):
        opt = draw(st.sampled_from(["--model", "--batch", "--steps", "--window", "--layers",
                                    "--backend", "--seed", "--bat", "--batch=3"]))  # fmt: skip
        if v.spend(draw):
            opt = draw(st.sampled_from(["--b", "--foo", "x", "-h", "value", opt]))
        if opt in ("--foo", "x", "--b"):
            argv += [opt, "1"]
            v.mark(False, f"option {opt}")
            continue
        if opt == "-h":
            argv.append(opt)
            helped = True
            continue
        if opt == "--batch=3":
            argv.append(opt)
            want["batch"] = 3
            continue
        odd = opt == "value"
        if odd:
            opt = draw(st.sampled_from(["--model", "--batch", "--window", "--backend", "--seed"]))
            if draw(st.integers(0, 3)) == 0 and opt != "--model":
                argv.append(opt)  # (no value: argparse's error)
                v.mark(False, f"{opt} without a value")
                continue
        name = "batch" if opt == "--bat" else opt[2:]
        if name == "model":
            value = draw(st.sampled_from(["llama", "", "NANO4B"] if odd else [*MODELS, *ALIASES]))
            want[name] = value
        elif name == "backend":
            value = draw(
                st.sampled_from(["tpu", "CPU", "cuda"] if odd else ["auto", "cpu", "reference"])
            )
            want[name] = value
            if value not in ("auto", "cpu", "reference", "cuda"):  # (argparse checks each one)
                v.mark(False, f"--backend {value!r}")
        else:
            value = draw(st.sampled_from(INT_TEXTS if odd else GOOD_INTS[name]))
            want[name] = _as_int(value)
            if want[name] is None:
                v.mark(False, f"{opt} {value!r}")
        argv += [opt, value]
    if helped:  # (argparse exits 0 at the -h, or 2 at an error before it)
        v = Validity()
        v.mark(None, "-h")
    else:
        model = want["model"]
        if ALIASES.get(model, model) not in MODELS:
            v.mark(False, f"model {model!r}")
        if want["backend"] not in ("auto", "cpu", "reference", "cuda"):
            v.mark(False, f"backend {want['backend']!r}")
        elif want["backend"] == "cuda":
            v.mark(torch.cuda.is_available(), "backend cuda")
        for name in ("batch", "steps", "layers", "window"):
            if want[name] is not None and want[name] < 1:
                v.mark(False, f"{name} {want[name]}")
        if want["window"] is not None and want["window"] > 256:
            v.mark(False, f"window {want['window']}")
        if want["batch"] is not None and want["batch"] > MAX_BATCH:
            v.mark(False, f"batch {want['batch']}")
        if want["seed"] is not None and not -(2**63) <= want["seed"] < 2**64:
            v.mark(False, f"seed {want['seed']}")
    stub = Stub(demo_module, "run_demo", FAKE_DEMO)

    def check(text):
        if helped:
            return
        assert len(stub.calls) == 1, stub.calls
        args, _ = stub.calls[0]
        order = ("model", "batch", "steps", "window", "layers", "backend", "seed")
        assert args == tuple(want[k] for k in order), (args, want)
        assert "agreement" in text

    return _cli_call(argv, v, "demo", [stub], check)


def _spec_text(draw, v: Validity) -> tuple[str, bool | None]:
    """An --spec text: FAMILY:key=value,... with what it breaks marked (dims the spec alone
    judges are left unsure)."""
    family = draw(st.sampled_from(["mamba2", "gdn"]))
    if v.spend(draw):
        family = draw(st.sampled_from(["kda", "", "Mamba2"]))
    dims = {
        "mamba2": {"headdim": "64", "dstate": "128", "heads_per_group": "16"},
        "gdn": {"head_k_dim": "128", "head_v_dim": "128", "value_heads_per_key_head": "2"},
    }.get(family, {"headdim": "64"})
    items = dict(dims)
    if family not in ("mamba2", "gdn"):
        v.mark(False, f"--spec family {family!r}")
    kind = draw(st.sampled_from(["ok", "ok", "window", "flags", "dtype"]))
    if v.spend(draw):
        kind = draw(st.sampled_from(["drop", "bad-int", "unknown", "no-equals", "window", "dtype"]))
    if kind == "drop":
        del items[draw(st.sampled_from(sorted(items)))]
        v.mark(False, "--spec without a dim")
    elif kind == "bad-int":
        key = draw(st.sampled_from(sorted(items)))
        items[key] = draw(st.sampled_from(["²", "x", "-4", "0", "4.0"]))
        v.mark(False, f"--spec {key}={items[key]}")
    elif kind == "unknown":
        items["foo"] = "1"
        v.mark(False, "--spec foo")
    elif kind == "window":
        items["window"] = draw(st.sampled_from(["1", "16", "256", "0", "257", "²"]))
        v.mark(items["window"] in ("1", "16", "256"), f"--spec window={items['window']}")
    elif kind == "flags":
        good = {
            "mamba2": ["d", "z", "dt_bias", "dt_softplus"],
            "gdn": ["qk_l2norm", "gates_in_kernel"],
        }
        flags = draw(st.lists(st.sampled_from([*good.get(family, ["d"]), "bogus"]), max_size=3))
        items["flags"] = "+".join(flags)
        if "bogus" in flags:
            v.mark(False, "--spec flag bogus")
    elif kind == "dtype":
        items["state_dtype"] = draw(st.sampled_from(["f32", "bf16", "f16", "fp8", "float32"]))
        v.mark(items["state_dtype"] in ("f32", "bf16", "f16"), f"--spec {items['state_dtype']}")
    text = f"{family}:" + ",".join(f"{k}={x}" for k, x in items.items())
    if kind == "no-equals":
        text += ",window"
        v.mark(False, "--spec item without '='")
    return text


@entry("cli.aot", covers=("python -m replayssm_jit aot",), devices=("cpu",))
def build_cli_aot(draw, device):
    v = Validity()
    argv = ["aot"]
    texts = [_spec_text(draw, v) for _ in range(draw(st.integers(0, 2)))]
    for text in texts:
        argv += ["--spec", text]
    presets = draw(st.lists(st.sampled_from(["ci", "h200", "models"]), max_size=2))
    if v.spend(draw):
        presets.append("bogus")
    for p in presets:
        argv += ["--preset", p]
    if "bogus" in presets:
        v.mark(False, "--preset bogus")
    listing = draw(st.booleans())
    if listing:
        argv.append("--list")
    out = draw(st.sampled_from([None, "/nonexistent/replayssm-aot-out"]))
    if out:
        argv += ["--out", out]
    elif not listing:
        v.mark(False, "no --out")
    jobs = draw(st.sampled_from(["0", "-2", "x"] if v.spend(draw) else [None, "1", "4"]))
    if jobs is not None:
        argv += ["--jobs", jobs]
        v.mark(_as_int(jobs) is not None and _as_int(jobs) >= 1, f"--jobs {jobs}")
    env = {}
    if not listing and draw(st.integers(0, 4)) == 0:
        env["REPLAYSSM_MAX_JOBS"] = draw(st.sampled_from(["2", "abc", "0"]))
        env["REPLAYSSM_CUDA_ARCH_LIST"] = draw(st.sampled_from(["9.0a", "sm90", "8.0,9.0a"]))
        if jobs is None and env["REPLAYSSM_MAX_JOBS"] == "abc":
            v.mark(False, "REPLAYSSM_MAX_JOBS=abc")
        if env["REPLAYSSM_CUDA_ARCH_LIST"] == "sm90":
            v.mark(False, "REPLAYSSM_CUDA_ARCH_LIST=sm90")
    stub = Stub(aot_module, "build_aot", [])

    def check(text):
        if listing:
            uris = text.split()
            assert uris and len(set(uris)) == len(uris) and not stub.calls
            return
        assert len(stub.calls) == 1
        (specs, out_dir, n_jobs, archs), _ = stub.calls[0]
        assert specs and out_dir == Path(out) and n_jobs >= 1 and archs

    return _cli_call(argv, v, "aot", [stub], check, env)


@entry("cli.main", covers=("python -m replayssm_jit",), devices=("cpu",))
def build_cli_main(draw, device):
    """The dispatcher: a command, --help, or none; a bad one gives the usage and returns 2."""
    argv = draw(st.sampled_from([[], ["bogus"], ["-h"], ["--help"], ["Demo"], ["demo", "--help"],
                                 ["aot", "--help"], [""]]))  # fmt: skip
    out, err = io.StringIO(), io.StringIO()

    def run():
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return main(argv)

    def check(rc):
        helped = bool(argv) and argv[0] in ("-h", "--help")
        if helped:
            assert rc == 0 and "usage:" in out.getvalue()
        else:
            assert rc == 2 and "usage:" in err.getvalue(), (rc, err.getvalue())

    def clear(exc):
        argparse_exit(exc, out, err, argv[0])

    return Call(run, (), check=check, clear=clear, errors=(SystemExit,))


@entry("cli.autotune", covers=("python -m replayssm_jit autotune",), devices=("cpu",))
def build_cli_autotune(draw, device):
    """The autotune command line with the timing stubbed out and a CUDA device pretended."""
    v = Validity()
    argv = ["autotune"]
    model = draw(st.sampled_from(["super120b", "qwen4b", "nemotron-3-nano-4b"]))
    if v.spend(draw):
        model = draw(st.sampled_from(["bogus", "", "Super120b"]))
        v.mark(False, f"--model {model!r}")
    if draw(st.integers(0, 5)):
        argv += ["--model", model]
    else:
        v.mark(False, "no --model")
    batches = draw(st.sampled_from(["1,8", "256", "64,1,64"]))
    if v.spend(draw):
        batches = draw(st.sampled_from(["0", "x", "", "65536", "1,,2"]))
        v.mark(False, f"--batches {batches!r}")
    argv += ["--batches", batches]
    window = draw(st.sampled_from(["16", "4"] + (["0", "x"] if v.spend(draw) else [])))
    argv += ["--window", window]
    v.mark(window in ("16", "4"), f"--window {window}")
    state = draw(st.sampled_from(["f32", "bf16"] + (["fp8", "float32"] if v.spend(draw) else [])))
    argv += ["--state-dtype", state]
    v.mark(state in ("f32", "bf16"), f"--state-dtype {state}")
    mode = draw(st.sampled_from(["replay", "conventional"] + (["Replay"] if v.spend(draw) else [])))
    argv += ["--mode", mode]
    v.mark(mode in ("replay", "conventional"), f"--mode {mode}")
    drafts = draw(st.sampled_from(["1", "4"] + (["0", "x"] if v.spend(draw) else [])))
    argv += ["--drafts", drafts]
    v.mark(drafts in ("1", "4"), f"--drafts {drafts}")
    v.mark(drafts != "4" or mode == "replay", f"--drafts 4 with --mode {mode}")
    out = Path(tempfile.gettempdir()) / "replayssm-fuzz-autotune.json"
    if draw(st.integers(0, 5)):
        argv += ["--out", str(out)]
    else:
        v.mark(False, "no --out")
    fake = {"format": 1, "device": "fuzz", "entries": []}
    tune = Stub(autotune_module, "tune", fake)
    cuda = Stub(torch.cuda, "is_available", True)
    device_index = Stub(torch.cuda, "current_device", 0)

    def check(text):
        assert len(tune.calls) == 1, tune.calls
        (layout, run_mode, run_batches, *_), _ = tune.calls[0]
        assert layout.window == int(window) and layout.family.name == get_model(model).family
        assert layout.drafts == int(drafts)
        assert run_mode == ("verify" if drafts == "4" else mode)
        assert run_batches == sorted({int(b) for b in batches.split(",")})
        assert json.loads(out.read_text()) == fake

    return _cli_call(argv, v, "autotune", [tune, cuda, device_index], check)
