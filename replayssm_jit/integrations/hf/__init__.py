"""HuggingFace transformers drop-in: a model's SSM layers decode through the ReplaySSM ops.

    from replayssm_jit.integrations import hf

    hf.patch(model, mode="replay", window=16)   # NemotronH, Qwen3-Next, Qwen3.5, Kimi-Linear
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=128)
    hf.unpatch(model)                           # the model's own forwards again

Each SSM mixer gets an instance-level forward. Prefill and every call that is not a one-token
cached decode run the model's own forward unchanged. A one-token decode keeps the mixer's
projections, HF's own causal conv (with the cache bookkeeping it does) and its gated norm and
output projection, and replaces only the SSM state update and readout with our decode op on a
slot pool the patch owns (one slot per batch row), loaded from HF's state at the first decode
step after a prefill. HF's SSM state goes stale while the slots decode: it is written back
(materialize_slots) before HF's own code reads it through a patched layer, when another cache
takes the layer over, by write_back(model) and by unpatch(model).

patch.py     patch / unpatch / write_back and the transformers version check
layer.py     one patched mixer: slots, plans, load and write-back
mixers.py    per mixer class: family, layout, gates and the decode around our step
"""

from replayssm_jit.integrations.hf.mixers import MIXERS
from replayssm_jit.integrations.hf.patch import (
    SUPPORTED_MODEL_TYPES,
    TESTED_TRANSFORMERS,
    HFPatch,
    check_transformers,
    patch,
    patched_layers,
    unpatch,
    write_back,
)

__all__ = [
    "MIXERS",
    "SUPPORTED_MODEL_TYPES",
    "TESTED_TRANSFORMERS",
    "HFPatch",
    "check_transformers",
    "patch",
    "patched_layers",
    "unpatch",
    "write_back",
]
