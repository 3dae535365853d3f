"""vLLM's varlen MTP call (packed [tokens, ...] with cu_seqlens, rows of 1..T tokens) laid out
as the verify op's [batch, T, ...] rows and back, in plan-owned buffers: gathers and a
searchsorted on the device, no allocation, no host read under capture."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedRows"]


@dataclass(frozen=True)
class PackedRows:
    """Index and padded-row buffers of one Mamba-2 plan with drafts (T >= 2)."""

    num_drafts: torch.Tensor  # [batch] int32: the tokens of each row
    src: torch.Tensor  # [batch, T] int64: the packed token a padded row reads
    dst: torch.Tensor  # [batch * T] int64: the padded row a packed token came from
    row: torch.Tensor  # [batch * T] int64: the row of each packed token
    last: torch.Tensor  # [batch] int64: each row's last packed token
    starts: torch.Tensor  # [batch] int64: each row's first packed token
    steps: torch.Tensor  # [T] int64: 0..T-1
    token_ids: torch.Tensor  # [batch * T] int32 and int64: 0..batch*T-1
    token_ids64: torch.Tensor
    dt: torch.Tensor  # [batch * T, H] float32: the packed dt before its gather
    padded: dict  # x, B, C, z, out as [batch, T, ...] in the activation dtype

    @classmethod
    def make(cls, batch: int, T: int, shape, act_dtype, device) -> PackedRows:
        H, P, G, N = shape.value_heads, shape.value_dim, shape.key_heads, shape.key_dim

        def buf(*s, dtype=torch.int64):
            return torch.zeros(s, dtype=dtype, device=device)

        padded = {n: buf(batch, T, *s, dtype=act_dtype)
                  for n, s in (("x", (H, P)), ("z", (H, P)), ("B", (G, N)), ("C", (G, N)),
                               ("out", (H, P)))}  # fmt: skip
        ids = torch.arange(batch * T, device=device)
        return cls(buf(batch, dtype=torch.int32), buf(batch, T), buf(batch * T),
                   buf(batch * T), buf(batch), buf(batch), torch.arange(T, device=device),
                   ids.to(torch.int32), ids, buf(batch * T, H, dtype=torch.float32),
                   padded)  # fmt: skip

    def lay_out(self, cu_seqlens: torch.Tensor, tokens: int) -> None:
        """Row lengths, and the gathers both ways, from cu_seqlens [batch + 1]."""
        starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
        torch.sub(ends, starts, out=self.num_drafts)
        # A padded row past its row's tokens reads the row's last token (never used: masked).
        torch.sub(ends, 1, out=self.last)
        torch.add(starts[:, None], self.steps[None, :], out=self.src)
        torch.minimum(self.src, self.last[:, None], out=self.src)
        self.src.clamp_(min=0)
        ids = self.token_ids if cu_seqlens.dtype == torch.int32 else self.token_ids64
        row, dst = self.row[:tokens], self.dst[:tokens]
        torch.searchsorted(ends, ids[:tokens], right=True, out=row)
        # dst = row * T + (token - start of its row)
        self.starts.copy_(starts)
        torch.index_select(self.starts, 0, row, out=dst)
        torch.sub(self.token_ids64[:tokens], dst, out=dst)
        dst.add_(row, alpha=self.steps.shape[0])

    def gather_in(self, name: str, packed: torch.Tensor) -> torch.Tensor:
        """packed [tokens, ...] as the padded [batch, T, ...] buffer."""
        buf = self.padded[name]
        torch.index_select(packed, 0, self.src.view(-1), out=buf.view(-1, *buf.shape[2:]))
        return buf

    def scatter_out(self, out: torch.Tensor, tokens: int) -> None:
        """The padded outputs back into the engine's packed out [tokens, ...]."""
        flat = self.padded["out"].view(-1, *out.shape[1:])
        torch.index_select(flat, 0, self.dst[:tokens], out=out)
