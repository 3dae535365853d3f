"""float64 reference oracles for every kernel (conventional step, pool step, ReplaySSM replay,
fold, speculative verify, per-sequence helper). CPU or GPU tensors of any float dtype; compute
and return float64. The fast path never imports this package."""

from . import gdn, kda, mamba2
from .common import (
    Records,
    ReplaySequence,
    ancestor_mask,
    cat_records,
    decays_to_end,
    expand_heads,
    l2norm,
    parse_parents,
    root_path,
    segment_decays,
    unrolled_apply,
    unrolled_fold,
)
from .gdn import *  # noqa: F403
from .kda import *  # noqa: F403
from .mamba2 import *  # noqa: F403

__all__ = [
    "Records",
    "ReplaySequence",
    "ancestor_mask",
    "cat_records",
    "decays_to_end",
    "expand_heads",
    "l2norm",
    "parse_parents",
    "root_path",
    "segment_decays",
    "unrolled_apply",
    "unrolled_fold",
]
# Each family module lists its public names once, in its own __all__.
__all__ += gdn.__all__ + kda.__all__ + mamba2.__all__
