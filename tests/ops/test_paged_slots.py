"""Slot tensors inside an engine's cache pages (issue 36, "vLLM cache pages").

vLLM allocates one padded page per block and views each per-layer tensor with as_strided: slot
(dim 0) stride = the whole page in elements of the tensor's dtype, each slot's block contiguous
at the tensor's offset in the page. Here every slot tensor of a layout (checkpoint, scales,
rings, cursors) is carved that way out of one uint8 [num_slots, page_bytes] buffer of random
bytes, and a schedule of decode steps, verifies, fused and explicit commits runs on it and on the
packed pool of layout.allocate with the same values. Required: every output and every tensor
(all slots, the unnamed ones included) bit-identical to the packed run's, and every page byte
that belongs to no tensor unchanged. A kernel-index helper that ignores the slot stride (the
torch path's `_slot_rows` patched to index densely) fails the same comparison.

The `gpu` variants run the same schedule through the CUDA kernels (per-item and split).
"""

from __future__ import annotations

import math

import pytest
import torch
from support.verify_schedule import GDNFamily, KDAFamily, Mamba2Family

from replayssm_jit import LaunchConfig, commit_drafts, plan_decode, reset_slots
from replayssm_jit.core.dtypes import TORCH_DTYPES

pytestmark = pytest.mark.usefixtures("no_launch_env", "single_thread")

GPU = pytest.mark.gpu
FAMILIES = {
    "mamba2": Mamba2Family(6, 16, 32, 3),
    "gdn": GDNFamily(2, 4, 32, 32),
    "kda": KDAFamily(2, 4, 32, 32),
}
# (family, state dtype, read dtype): FP32 with drafts (decode, verify, commit), and, decode only
# (the speculative kernels take f32/bf16/f16 checkpoints), the per-slot scales of e4m3 and NVFP4
# checkpoints and GDN's separate mode (a read copy with its own rings rec_v, rec_beta).
CASES = [
    ("mamba2", "f32", None),
    ("mamba2", "e4m3", None),
    ("gdn", "f32", None),
    ("gdn", "nvfp4", None),
    ("gdn", "f32", "bf16"),
    ("kda", "f32", None),
    ("kda", "e4m3", None),
]
DEVICES = [
    pytest.param(("cpu", "auto"), id="cpu"),
    pytest.param(("cuda", "per-item"), id="cuda-per-item", marks=GPU),
    pytest.param(("cuda", "split"), id="cuda-split", marks=GPU),
]
NUM_SLOTS, LIVE, WINDOW, DRAFTS = 6, (4, 1, 2), 4, 2


def raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (a view; NaN bits compare equal)."""
    return t.view(torch.uint8)


def page_layout(layout, gap: int = 16, tail: int = 48) -> tuple[dict[str, int], int]:
    """Each tensor's byte offset in a page (16-byte aligned, `gap` bytes of no tensor between
    tensors) and the page's bytes (a multiple of 16, `tail` spare bytes at its end)."""
    offsets, at = {}, gap
    for t in layout.tensors():
        offsets[t.name] = at
        at += math.prod(t.per_slot_shape) * t.dtype.itemsize
        at = -(-at // 16) * 16 + gap
    return offsets, -(-(at + tail) // 16) * 16


def carve(layout, buffer: torch.Tensor, offsets: dict[str, int]) -> dict[str, torch.Tensor]:
    """The layout's tensors as strided views into `buffer` [slots, page_bytes] uint8, as vLLM's
    runner views a layer's page: slot stride = the page, inner dims contiguous."""
    slots, page = buffer.shape
    flat = buffer.view(-1)
    views = {}
    for t in layout.tensors():
        size = t.dtype.itemsize
        dense = [math.prod(t.per_slot_shape[i + 1 :]) for i in range(len(t.per_slot_shape))]
        views[t.name] = torch.as_strided(
            flat.view(t.dtype), (slots, *t.per_slot_shape), (page // size, *dense),
            offsets[t.name] // size,
        )  # fmt: skip
    return views


def covered(layout, buffer: torch.Tensor, offsets: dict[str, int]) -> torch.Tensor:
    """Which bytes of each page belong to a tensor."""
    mask = torch.zeros(buffer.shape[1], dtype=torch.bool)
    for t in layout.tensors():
        mask[offsets[t.name] : offsets[t.name] + math.prod(t.per_slot_shape) * t.dtype.itemsize] = 1
    return mask


class Run:
    """One pool and its plan, stepped by `schedule`."""

    def __init__(self, fam, layout, tensors, device, kernel):
        self.fam, self.layout, self.tensors = fam, layout, tensors
        config = None if kernel == "auto" else LaunchConfig(kernel=kernel)  # (the verify too)
        self.plan = plan_decode(layout, 4, device=device, config=config)


def build(family: str, state: str, read: str | None, device: str, seed: int = 3):
    fam = FAMILIES[family]
    drafts = DRAFTS if state == "f32" and read is None else 1
    layout = fam.layout(WINDOW, drafts, TORCH_DTYPES[state])
    if read is not None:
        from replayssm_jit.families.layout import family_layout

        args = dict(num_k_heads=fam.H, num_v_heads=fam.HV, head_k_dim=fam.K, head_v_dim=fam.V)
        layout = family_layout(family, window=WINDOW, drafts=drafts, state_dtype=state,
                               read_dtype=read, **args)  # fmt: skip
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    packed = layout.allocate(NUM_SLOTS, dev)
    for t in packed.values():  # random bits everywhere: unnamed slots must keep theirs
        raw(t).copy_(torch.randint(0, 256, raw(t).shape, dtype=torch.uint8, generator=gen))
    offsets, page = page_layout(layout)
    buffer = torch.randint(0, 256, (NUM_SLOTS, page), dtype=torch.uint8, generator=gen).to(dev)
    paged = carve(layout, buffer, offsets)
    for name, t in paged.items():
        assert t.stride(0) * t.element_size() == page
        raw(t).copy_(raw(packed[name]))
    initial = 0.3 * torch.randn((len(LIVE), *fam.state_shape()), generator=gen).to(dev)
    for pool in (packed, paged):
        reset_slots(layout, pool, torch.tensor(LIVE, device=dev), initial)
    return fam, layout, packed, paged, buffer, offsets


def schedule(run: Run, seed: int = 11, decode_only: bool = False) -> list[torch.Tensor]:
    """Decode steps, verifies with fused and explicit commits, a pad row in every batch: the
    outputs in order (every call is made with the same inputs on every pool)."""
    fam, dev = run.fam, run.plan.device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    params = {k: v.to(dev) for k, v in fam.params(gen, "cpu").items()}
    act = run.layout.act_dtype
    slots = [[4, -1, 1, 2], [2, 4, 1, -1], [1, 2, -1, 4]]
    outs = []

    def decode(i, **kw):
        tok = {k: v[:, 0].to(dev) for k, v in fam.drafts(4, 1, gen, "cpu", act).items()}
        out = torch.empty((4, *fam.state_shape()[:2]), dtype=act, device=dev)
        s = torch.tensor(slots[i % 3], dtype=torch.int32, device=dev)
        fam.decode_op()(run.plan, **run.tensors, **params, **tok, slot_indices=s, out=out, **kw)
        outs.append(out)

    def verify(i, **kw):
        d = {k: v.to(dev) for k, v in fam.drafts(4, DRAFTS, gen, "cpu", act).items()}
        out = torch.empty((4, DRAFTS, *fam.state_shape()[:2]), dtype=act, device=dev)
        s = torch.tensor(slots[i % 3], dtype=torch.int32, device=dev)
        fam.verify(run.plan, run.tensors, params, d, s, out=out, **kw)
        outs.append(out)
        return s

    for i in range(5):  # past a flush (window 4)
        decode(i)
    if run.layout.drafts == 1 or decode_only:
        for i in range(6):
            decode(i)
        return outs
    s = verify(0)
    decode(0, num_accepted=torch.tensor([1, 1, 2, 0], dtype=torch.int32, device=dev))
    s = verify(1, parents=torch.tensor([[-1, 0], [-1, -1], [-1, 0], [-1, -1]], dtype=torch.int32,
                                       device=dev))  # fmt: skip
    commit_drafts(run.plan, run.tensors, num_accepted=torch.tensor([1, 2, 1, 0], dtype=torch.int32,
                  device=dev), slot_indices=s,
                  accepted_path=torch.tensor([[1, 0], [0, 1], [0, 0], [0, 0]], dtype=torch.int32,
                                             device=dev))  # fmt: skip
    s = verify(2, num_accepted=torch.tensor([0, 0, 0, 0], dtype=torch.int32, device=dev))
    commit_drafts(run.plan, run.tensors, num_accepted=torch.tensor([2, 1, 0, 2], dtype=torch.int32,
                  device=dev), slot_indices=s)  # fmt: skip
    for i in range(4):
        decode(i)
    return outs


def assert_same_pools(layout, packed, paged) -> None:
    for t in layout.tensors():
        a, b = raw(packed[t.name]), raw(paged[t.name])
        if not torch.equal(a, b):
            bad = [s for s in range(a.shape[0]) if not torch.equal(a[s], b[s])]
            raise AssertionError(f"{t.name}: slots {bad} differ from the packed run's")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family, state, read", CASES)
def test_a_pool_in_cache_pages_steps_as_the_packed_pool(family, state, read, device):
    dev, kernel = device
    fam, layout, packed, paged, buffer, offsets = build(family, state, read, dev)
    spare = ~covered(layout, buffer, offsets)
    spare_before = buffer[:, spare.to(buffer.device)].clone()
    unnamed = [s for s in range(NUM_SLOTS) if s not in LIVE]
    pages_before = buffer[unnamed].clone()
    state_before = raw(paged["state"])[list(LIVE)].clone()
    got = schedule(Run(fam, layout, paged, dev, kernel))
    want = schedule(Run(fam, layout, packed, dev, kernel))
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(raw(g), raw(w)), f"call {i}: outputs differ from the packed run's"
    assert_same_pools(layout, packed, paged)
    assert torch.equal(buffer[:, spare.to(buffer.device)], spare_before), (
        "bytes of no tensor changed"
    )
    assert torch.equal(buffer[unnamed], pages_before), "an unnamed slot's page changed"
    # (the schedule flushed: a replay that never folded would not exercise the checkpoint's strides)
    assert not torch.equal(raw(paged["state"])[list(LIVE)], state_before)


def test_cache_page_views_pass_the_checks_and_bad_ones_are_named():
    """Page-strided views pass; a slot stride below the block, a misaligned one and a
    non-contiguous block are each refused with the tensor, the expected and the actual strides."""
    fam, layout, packed, paged, _, _ = build("mamba2", "f32", None, "cpu")
    plan = plan_decode(layout, 4, device="cpu")
    assert layout.check_tensors(paged, device=torch.device("cpu")) == NUM_SLOTS
    rec_x = packed["rec_x"]
    block = rec_x[0].numel()
    cases = {
        "overlap": (torch.as_strided(rec_x, rec_x.shape, (block - 8, *rec_x.stride()[1:])),
                    r"^rec_x: expected slots \d+ or more elements apart .*got a slot stride of"),
        "misaligned": (torch.as_strided(torch.zeros(NUM_SLOTS * (block + 3), dtype=rec_x.dtype),
                                        rec_x.shape, (block + 3, *rec_x.stride()[1:])),
                       r"^rec_x: expected 16-byte aligned slots .*got strides"),
        "block": (rec_x.transpose(-1, -2).contiguous().transpose(-1, -2),
                  r"^rec_x: expected 16-byte aligned slots with contiguous .*inner strides .*got strides"),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    params = fam.params(gen, "cpu")
    tok = {k: v[:, 0] for k, v in fam.drafts(4, 1, gen, "cpu", layout.act_dtype).items()}
    for bad, message in cases.values():
        pool = {**paged, "rec_x": bad}
        with pytest.raises(ValueError, match=message):
            fam.decode_op()(plan, **pool, **params, **tok,
                            slot_indices=torch.tensor([4, -1, 1, 2], dtype=torch.int32))  # fmt: skip


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_a_step_that_ignores_the_slot_stride_is_caught(family, monkeypatch):
    """The comparison catches a torch path that indexes every slot tensor densely (slot * block,
    as the kernels did before they took each tensor's slot stride)."""
    from replayssm_jit.ops.torch_path import protocol

    fam, layout, packed, paged, _, _ = build(family, "f32", None, "cpu")

    def dense(t):
        if t is None or t.shape[0] < 2:
            return t
        return torch.as_strided(t, t.shape, (t[0].numel(), *t.stride()[1:]))

    named = protocol.Pool.named.__func__
    monkeypatch.setattr(protocol.Pool, "named", classmethod(
        lambda cls, tensors: named(cls, {k: dense(t) for k, t in tensors.items()})))  # fmt: skip
    got = schedule(Run(fam, layout, paged, "cpu", "auto"), decode_only=True)
    monkeypatch.undo()
    want = schedule(Run(fam, layout, packed, "cpu", "auto"), decode_only=True)
    outputs_differ = any(not torch.equal(raw(g), raw(w)) for g, w in zip(got, want))
    with pytest.raises(AssertionError):
        assert_same_pools(layout, packed, paged)
    assert outputs_differ


def vllm_views(entries, num_blocks: int, page_bytes: int, device="cpu") -> list[torch.Tensor]:
    """The runner's views of one layer's pages as vLLM's _reshape_kv_cache_tensors makes them
    (written here from reading it): offsets add up each entry's bytes, slot stride = the page in
    elements of the entry's dtype, inner dims contiguous."""
    raw_pages = torch.randint(0, 256, (num_blocks * page_bytes,), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(9)).to(device)  # fmt: skip
    views, offset = [], 0
    for shape, dtype in zip(entries.shapes, entries.dtypes):
        size = dtype.itemsize
        assert offset % size == 0
        dense = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        views.append(torch.as_strided(raw_pages.view(dtype), (num_blocks, *shape),
                                      (page_bytes // size, *dense), offset // size))  # fmt: skip
        offset += math.prod(shape) * size
    return views


@pytest.mark.parametrize(
    "family, state, read", [c for c in CASES if c[0] != "gdn" or c[1] == "f32"]
)
def test_page_entries_declare_a_page_vllms_runner_carves_into_a_valid_pool(family, state, read):
    """page_entries appends our tensors to vLLM's (a conv state of an odd byte size, then the SSM
    state); the runner's as_strided views of a padded page pass the layout's checks and step as
    the packed pool does."""
    from replayssm_jit.integrations.vllm.pages import page_entries, page_tensors

    fam, layout, packed, _, _, _ = build(family, state, read, "cpu")
    state_layout = layout.tensors()[0]
    conv = ((40, 3), torch.bfloat16)  # 240 bytes: the SSM state starts 16-byte aligned
    entries = page_entries(layout, [conv[0], state_layout.per_slot_shape],
                           [conv[1], state_layout.dtype])  # fmt: skip
    assert entries.names[:2] == (None, "state")
    assert sorted(n for n in entries.names if n) == sorted(t.name for t in layout.tensors())
    assert entries.page_bytes == 240 + layout.bytes_per_slot() + sum(
        math.prod(s) for s, n in zip(entries.shapes, entries.names) if n is None and s != conv[0]
    )
    page = -(-entries.page_bytes // 4096) * 4096  # vLLM pads to the attention page
    kv_cache = vllm_views(entries, NUM_SLOTS, page)
    pool = page_tensors(entries, kv_cache)
    assert layout.check_tensors(pool, device=torch.device("cpu")) == NUM_SLOTS
    for name, t in pool.items():
        raw(t).copy_(raw(packed[name]))
    got = schedule(Run(fam, layout, pool, "cpu", "auto"))
    want = schedule(Run(fam, layout, packed, "cpu", "auto"))
    for g, w in zip(got, want):
        assert torch.equal(raw(g), raw(w))
    assert_same_pools(layout, packed, pool)


def test_page_entries_pad_a_misaligned_offset_and_name_a_wrong_state():
    from replayssm_jit.integrations.vllm.pages import page_entries

    layout = FAMILIES["mamba2"].layout(WINDOW, DRAFTS, torch.float32)
    s = layout.tensors()[0]
    # (a conv state of 6 bytes, then the state: the state is vLLM's to place; ours start aligned)
    entries = page_entries(layout, [(3,), s.per_slot_shape], [torch.bfloat16, s.dtype])
    offset = 0
    for shape, dtype, name in zip(entries.shapes, entries.dtypes, entries.names):
        if name not in (None, "state"):
            align = next(t.alignment for t in layout.tensors() if t.name == name)
            assert offset % align == 0, name
        offset += math.prod(shape) * dtype.itemsize
    assert None in entries.names[2:]  # a pad entry was needed
    with pytest.raises(ValueError, match=r"^shapes\[-1\]: expected the SSM state"):
        page_entries(layout, [(3,), (1, 2, 3)], [torch.bfloat16, s.dtype])
