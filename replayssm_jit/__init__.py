"""replayssm-jit: JIT-compiled CUDA decode kernels for ReplaySSM (cache SSM inputs, not state).

Public API:
    mamba2_layout, gdn_layout, kda_layout, CacheLayout
                                            the per-slot tensors of a layer (engines allocate)
    plan_decode, mamba2_decode, gdn_decode, kda_decode
                                            functional ops on caller-owned tensors
    reset_slots, copy_slots                 slot lifecycle on them: new sequences, forks
    materialize_slots, materialize_states   a slot's exact FP32 state (prefix caching); the
                                            engines' [layers, batch] form, no host sync
    mamba2_verify, gdn_verify, kda_verify, commit_drafts
                                            speculative decoding (docs/speculative.md)
    mamba2_ / gdn_ / kda_snapshot_verify, commit_snapshots
                                            the conventional spec baseline to compare with
    torch.ops.replayssm.*                   the same ops as torch.library ops, for torch.compile
                                            (replayssm_jit.ops.plan_handle gives a plan's handle)
    LaunchConfig                            launch choices a plan may fix ("auto" by default)
    Mamba2DecodeCache, Mamba2DecodeWrapper  convenience cache + plan()/run() objects
    GDNDecodeCache, GDNDecodeWrapper
    KDADecodeCache, KDADecodeWrapper
    KernelSpec, mamba2_spec, gdn_spec, kda_spec
                                            typed specializations (readable URIs)
    replayssm_jit.reference                 float64 oracles (Mamba-2, GDN, KDA)
    python -m replayssm_jit demo | aot      the main job and AOT builds
"""

from replayssm_jit.core.version import __version__ as __version__
from replayssm_jit.families.layout import (
    CacheLayout,
    TensorLayout,
    gdn_layout,
    kda_layout,
    mamba2_layout,
)
from replayssm_jit.families.spec import KernelSpec, gdn_spec, kda_spec, mamba2_spec
from replayssm_jit.launch.config import LaunchConfig
from replayssm_jit.ops import (
    DecodePlan,
    commit_drafts,
    commit_snapshots,
    copy_slots,
    gdn_decode,
    gdn_snapshot_verify,
    gdn_verify,
    kda_decode,
    kda_snapshot_verify,
    kda_verify,
    mamba2_decode,
    mamba2_snapshot_verify,
    mamba2_verify,
    materialize_slots,
    materialize_states,
    plan_decode,
    reset_slots,
)
from replayssm_jit.wrappers.cache import SlotCache
from replayssm_jit.wrappers.gdn import GDNDecodeCache, GDNDecodeWrapper
from replayssm_jit.wrappers.kda import KDADecodeCache, KDADecodeWrapper
from replayssm_jit.wrappers.mamba2 import Mamba2DecodeCache, Mamba2DecodeWrapper

__all__ = [
    "CacheLayout",
    "DecodePlan",
    "GDNDecodeCache",
    "GDNDecodeWrapper",
    "KDADecodeCache",
    "KDADecodeWrapper",
    "KernelSpec",
    "LaunchConfig",
    "Mamba2DecodeCache",
    "Mamba2DecodeWrapper",
    "SlotCache",
    "TensorLayout",
    "commit_drafts",
    "commit_snapshots",
    "copy_slots",
    "gdn_decode",
    "gdn_layout",
    "gdn_snapshot_verify",
    "gdn_spec",
    "gdn_verify",
    "kda_decode",
    "kda_layout",
    "kda_snapshot_verify",
    "kda_spec",
    "kda_verify",
    "mamba2_decode",
    "mamba2_layout",
    "mamba2_snapshot_verify",
    "mamba2_spec",
    "mamba2_verify",
    "materialize_slots",
    "materialize_states",
    "plan_decode",
    "reset_slots",
]
