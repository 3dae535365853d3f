"""FlashInfer's batch decode for the replica's GQA attention layers (where flashinfer-python,
the bench extra, is installed): the per-row KV cache [batch, kv_heads, context, head_dim] is a
paged cache of one page per row in FlashInfer's "HND" layout, so no copy is made."""

from __future__ import annotations

import torch

__all__ = ["FlashInferDecode", "available"]

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's documented default float workspace


def available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


class FlashInferDecode:
    """One wrapper for every GQA layer of a replica (same batch, heads and context), planned
    once outside the CUDA graph with fixed index buffers, so that run() can be captured."""

    def __init__(self, batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, scale: float, device: torch.device):  # fmt: skip
        import flashinfer

        i32 = dict(dtype=torch.int32, device=device)
        self.indptr = torch.arange(batch + 1, **i32)  # row b owns page b
        self.indices = torch.arange(batch, **i32)
        self.last_page_len = torch.full((batch,), context, **i32)  # every page full
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "HND", use_cuda_graph=True, paged_kv_indptr_buffer=self.indptr,
            paged_kv_indices_buffer=self.indices, paged_kv_last_page_len_buffer=self.last_page_len,
        )  # fmt: skip
        self.wrapper.plan(
            self.indptr, self.indices, self.last_page_len, q_heads, kv_heads, head_dim,
            context, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale,
        )  # fmt: skip

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """q [batch, q_heads, head_dim] -> [batch, q_heads, head_dim]."""
        return self.wrapper.run(q, (k_cache, v_cache))
