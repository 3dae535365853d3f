"""The torch path: what the CUDA modules' bindings do, in plain PyTorch, for tensors of any device
(the ops run it on CPU tensors). The same flush decision, ring rows, cursor words and stored
formats as the per-item kernels; FP32 arithmetic whose additions are ordered differently, so
results agree with the kernels' to FP32 rounding. Stochastic rounding draws the kernels' bits.

    protocol.py    the step protocol, once: pad rows, cursor read and check, fused commit, flush
                   decision, epoch and cursor advance; commit; the snapshot baseline's rows
    checkpoint.py  load and store a checkpoint copy in its format (core/codecs.py rounds)
    mamba2.py      Mamba-2's maths the protocol calls: stage, replay and fold of (x, B, dt)
    delta.py       the delta rule's for GDN and KDA, the decay per head or per key channel

Nothing here imports replayssm_jit.reference (the float64 oracles).
"""

from replayssm_jit.ops.torch_path import delta, mamba2
from replayssm_jit.ops.torch_path.checkpoint import checkpoint_values, store_checkpoint
from replayssm_jit.ops.torch_path.delta import *  # noqa: F403
from replayssm_jit.ops.torch_path.mamba2 import *  # noqa: F403
from replayssm_jit.ops.torch_path.protocol import Pool, Rows, StepScalars, commit

__all__ = ["Pool", "Rows", "StepScalars", "checkpoint_values", "commit", "store_checkpoint"]
# The maths modules list their public names once, in their own __all__.
__all__ += delta.__all__ + mamba2.__all__
