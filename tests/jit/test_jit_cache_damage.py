"""The JIT cache with damaged or stale modules, on the CPU (issue 21 §5): rebuilt or refused, never
loaded; AOT modules likewise, and modules whose archs do not cover the ones asked for.
"""

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from support.jit_cache import OTHER, SMALL, build_folder, sha

from replayssm_jit.cli.aot import parse_spec
from replayssm_jit.jit import build
from replayssm_jit.jit.aot import build_aot

# --- 2. damaged or stale modules ------------------------------------------------------------

DAMAGES = ["truncated", "empty", "flipped-byte", "stale", "other-spec", "no-manifest",
           "torn-manifest", "old-manifest", "missing-module"]  # fmt: skip


def _damage(folder: Path, spec, how: str, tiny: bytes) -> str:
    """Damage the build in `folder`; return what the refusal must say."""
    so, manifest_path = folder / f"{spec.uri}.so", folder / build.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    if how == "truncated":
        so.write_bytes(tiny[: len(tiny) // 2])
        return f"{so} is truncated or damaged: {len(tiny) // 2} bytes, its manifest records {len(tiny)}"
    if how == "empty":
        so.write_bytes(b"")
        return f"{so} is truncated or damaged: 0 bytes, its manifest records {len(tiny)}"
    if how == "flipped-byte":  # same size; likely still loadable, so only the hash stops it
        data = bytearray(tiny)
        data[len(data) // 2] ^= 0xFF
        so.write_bytes(bytes(data))
        return f"{so} is corrupt: sha256 {sha(bytes(data))[:16]}..., its manifest records {sha(tiny)[:16]}..."
    if how == "stale":
        # a whole, self-consistent build of other source or flags: loadable, but not this one
        stale, old = tiny + b"\0" * 64, "0123456789abcdef"  # another source's
        so.write_bytes(stale)
        manifest.update(digest=old, so_size=len(stale), so_sha256=sha(stale))
        manifest_path.write_text(json.dumps(manifest))
        return f"{so} is stale: built from source digest {old!r}"
    if how == "other-spec":  # another spec's module and manifest copied here
        other = parse_spec(OTHER)
        manifest.update(uri=other.uri, digest=build.source_digest(other))
        manifest_path.write_text(json.dumps(manifest))
        return f"{manifest_path} describes {other.uri!r}, expected {spec.uri!r}"
    if how == "no-manifest":
        manifest_path.unlink()
        return f"{so} has no {build.MANIFEST} beside it"
    if how == "torn-manifest":
        manifest_path.write_text(manifest_path.read_text()[:20])
        return f"{manifest_path} is damaged: expected a JSON object"
    if how == "old-manifest":  # written before the manifest recorded the module's hash
        del manifest["so_size"], manifest["so_sha256"]
        manifest_path.write_text(json.dumps(manifest))
        return f"{manifest_path} records no size and sha256 of {so.name}"
    if how == "missing-module":
        so.unlink()
        return f"{so} is missing (its {build.MANIFEST} is there)"
    raise AssertionError(how)


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_cache_module_is_rebuilt_not_loaded(
    jit_cache, fake_compiler, loads, tiny_so, caplog, damage
):
    spec = parse_spec(SMALL)
    so = build.build(spec)
    assert build.find_prebuilt(spec) == so and len(fake_compiler.builds()) == 1
    why = _damage(so.parent, spec, damage, tiny_so)
    with caplog.at_level(logging.WARNING, logger="replayssm_jit"):
        assert build.find_prebuilt(spec) is None
    assert why in caplog.text
    module = build.load_module(spec)
    assert len(fake_compiler.builds()) == 2, "the damaged module must be rebuilt"
    assert loads == [(str(so), sha(tiny_so))], "only the rebuilt module may be loaded"
    assert module.answer(1) == 42 and build.find_prebuilt(spec) == so


@pytest.mark.parametrize("jit", ["disabled", "enabled"])
@pytest.mark.parametrize("damage", ["none", *DAMAGES])
def test_damaged_aot_module_is_refused(
    jit_cache, fake_compiler, loads, tiny_so, tmp_path, monkeypatch, caplog, damage, jit
):
    """A damaged AOT module is never loaded: with JIT disabled the JITDisabledError names it
    and what is wrong; otherwise a warning does and the JIT cache builds the module."""
    spec = parse_spec(SMALL)
    aot = tmp_path / "aot"
    (aot_so,) = build_aot([spec], aot, jobs=1, archs=["9.0a"])
    why = _damage(aot_so.parent, spec, damage, tiny_so) if damage != "none" else None
    monkeypatch.setenv("REPLAYSSM_AOT_DIR", str(aot))
    jit_so = build_folder(spec) / f"{spec.uri}.so"
    if jit == "disabled":
        monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    if damage == "none":
        assert build.load_module(spec).answer(1) == 42
        assert loads == [(str(aot_so), sha(tiny_so))] and not jit_cache.exists()
    elif jit == "disabled":
        with pytest.raises(build.JITDisabledError) as info:
            build.load_module(spec)
        assert spec.uri in str(info.value) and why in str(info.value), str(info.value)
        assert loads == [] and not jit_cache.exists()
    else:
        with caplog.at_level(logging.WARNING, logger="replayssm_jit"):
            assert build.load_module(spec).answer(1) == 42
        assert f"skipping AOT module: {why}" in caplog.text
        assert loads == [(str(jit_so), sha(tiny_so))] and len(fake_compiler.builds()) == 2


@pytest.mark.parametrize(
    "requested, usable",
    [("9.0a", True), ("10.0a", True), ("10.0a 9.0a", True), ("8.0", False), ("9.0a 12.0a", False)],
)
def test_multi_arch_aot_module_serves_any_subset_of_its_archs(
    jit_cache, fake_compiler, loads, tiny_so, tmp_path, monkeypatch, requested, usable
):
    """An AOT module built for 9.0a and 10.0a loads with JIT disabled for a request of either or
    both (a device's own arch is such a request); one asking for an arch it lacks is refused,
    naming the archs on both sides."""
    spec = parse_spec(SMALL)
    aot = tmp_path / "aot"
    (aot_so,) = build_aot([spec], aot, jobs=1, archs=["9.0a", "10.0a"])
    monkeypatch.setenv("REPLAYSSM_AOT_DIR", str(aot))
    monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    monkeypatch.setenv("REPLAYSSM_CUDA_ARCH_LIST", requested)
    if usable:
        assert build.find_prebuilt(spec) == aot_so
        assert build.load_module(spec).answer(1) == 42
        assert loads == [(str(aot_so), sha(tiny_so))]
        return
    assert build.find_prebuilt(spec) is None
    with pytest.raises(build.JITDisabledError) as info:
        build.load_module(spec)
    assert (
        f"{aot_so} is built for ['9.0a', '10.0a'], which lacks {requested.split()[-1]!r} of "
        f"the archs asked for, {requested.split()!r} (REPLAYSSM_CUDA_ARCH_LIST, else the GPU's)"
    ) in str(info.value), str(info.value)
    assert loads == []


def test_cache_module_lacking_a_requested_arch_is_rebuilt_for_it(
    jit_cache, fake_compiler, monkeypatch
):
    """The JIT cache's module for 9.0a serves 9.0a; a request for 9.0a and 10.0a rebuilds it for
    both, after which a 10.0a request is served without a build."""
    spec = parse_spec(SMALL)
    build.build(spec)
    monkeypatch.setenv("REPLAYSSM_CUDA_ARCH_LIST", "9.0a 10.0a")
    assert build.find_prebuilt(spec) is None
    build.build(spec)
    monkeypatch.setenv("REPLAYSSM_CUDA_ARCH_LIST", "10.0a")
    assert build.find_prebuilt(spec) is not None
    build.build(spec)
    assert len(fake_compiler.builds()) == 2, fake_compiler.builds()
    manifest = json.loads((build_folder(spec) / build.MANIFEST).read_text())
    assert manifest["archs"] == ["9.0a", "10.0a"]


def test_a_module_replaced_while_loading_is_an_error(jit_cache, fake_compiler, monkeypatch):
    """The bytes hashed are the bytes loaded: a module swapped for another file between the hash
    and dlopen raises instead of returning whatever was loaded."""
    spec = parse_spec(SMALL)
    so = build.build(spec)
    real = build._dlopen

    def swap_then_load(path):
        other = path.with_name("other.so")
        shutil.copy(path, other)
        os.replace(other, path)  # same bytes, another file
        return real(path)

    monkeypatch.setattr(build, "_dlopen", swap_then_load)
    with pytest.raises(build.JITCacheError, match=f"{so} was replaced while it was being loaded"):
        build.load_module(spec)
    assert spec.uri not in build._LOADED
