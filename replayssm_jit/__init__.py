"""replayssm-jit: JIT-compiled CUDA decode kernels for ReplaySSM (cache SSM inputs, not state).

Public API:
    Mamba2DecodeCache, Mamba2DecodeWrapper   Mamba-2 state pool + record rings; plan()/run() decode
    GDNDecodeCache, GDNDecodeWrapper         Gated DeltaNet state pool + record rings; plan()/run()
    KernelSpec, mamba2_spec, gdn_spec        typed specializations (readable URIs)
    replayssm_jit.reference                  float64 oracles (Mamba-2, GDN, KDA)
    python -m replayssm_jit demo | aot       the main job and AOT builds
"""

from replayssm_jit.spec import KernelSpec, gdn_spec, mamba2_spec
from replayssm_jit.wrappers.gdn import GDNDecodeCache, GDNDecodeWrapper
from replayssm_jit.wrappers.mamba2 import Mamba2DecodeCache, Mamba2DecodeWrapper

__all__ = [
    "GDNDecodeCache",
    "GDNDecodeWrapper",
    "KernelSpec",
    "Mamba2DecodeCache",
    "Mamba2DecodeWrapper",
    "gdn_spec",
    "mamba2_spec",
]
__version__ = "0.1.0"
