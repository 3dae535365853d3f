"""vLLM's varlen MTP call (packed [tokens, ...] with cu_seqlens, rows of 1..T tokens) laid out
as the verify op's [batch, T, ...] rows and back, in plan-owned buffers: gathers and a
searchsorted on the device, no allocation, no host read under capture. Any family: the
buffers follow its per-token inputs (Mamba-2 x, z, B, C, dt; GDN / KDA q, k, v, a, b)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayssm_jit.families.schema import expected_shape

__all__ = ["PackedRows"]


@dataclass(frozen=True)
class PackedRows:
    """Index and padded-row buffers of one plan with drafts (T >= 2)."""

    num_drafts: torch.Tensor  # [batch] int32: the tokens of each row
    src: torch.Tensor  # [batch, T] int64: the packed token a padded row reads
    dst: torch.Tensor  # [batch * T] int64: the padded row a packed token came from
    row: torch.Tensor  # [batch * T] int64: the row of each packed token
    last: torch.Tensor  # [batch] int64: each row's last packed token
    starts: torch.Tensor  # [batch] int64: each row's first packed token
    steps: torch.Tensor  # [T] int64: 0..T-1
    token_ids: torch.Tensor  # [batch * T] int32 and int64: 0..batch*T-1
    token_ids64: torch.Tensor
    staged: dict  # FP32 gates (dt; a, b) as packed [batch * T, ...], before their gather
    padded: dict  # token inputs and out as [batch, T, ...] in the activation dtype

    @classmethod
    def make(cls, plan) -> PackedRows:
        batch, T, shape, device = (plan.batch_size, plan.layout.drafts, plan.layout.shape,
                                   plan.device)  # fmt: skip

        def buf(*s, dtype=torch.int64):
            return torch.zeros(s, dtype=dtype, device=device)

        lead = [arg for arg in plan.family.inputs if arg.shape[:1] == ("lead",)
                and arg.present(plan.spec.flags)]  # fmt: skip
        padded = {arg.name: buf(*expected_shape(arg, shape, (batch, T)),
                                dtype=plan.layout.act_dtype)
                  for arg in lead if arg.dtype == "act"}  # fmt: skip
        padded["out"] = buf(batch, T, shape.value_heads, shape.value_dim,
                            dtype=plan.layout.act_dtype)  # fmt: skip
        staged = {arg.name: buf(*expected_shape(arg, shape, (batch * T,)), dtype=torch.float32)
                  for arg in lead if arg.dtype == "f32"}  # fmt: skip
        ids = torch.arange(batch * T, device=device)
        return cls(buf(batch, dtype=torch.int32), buf(batch, T), buf(batch * T),
                   buf(batch * T), buf(batch), buf(batch), torch.arange(T, device=device),
                   ids.to(torch.int32), ids, staged, padded)  # fmt: skip

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

    def gather_gate(self, name: str, packed: torch.Tensor, tokens: int, dest: torch.Tensor):
        """packed [tokens, ...] gates (any float dtype and strides) into the plan's FP32
        [batch, T, ...] gate buffer `dest`."""
        stage = self.staged[name]
        stage[:tokens].copy_(packed)
        torch.index_select(stage, 0, self.src.view(-1), out=dest.view(-1, *stage.shape[1:]))
        return dest

    def scatter_out(self, out: torch.Tensor, tokens: int) -> None:
        """The padded outputs back into the engine's packed out [tokens, ...]."""
        flat = self.padded["out"].view(-1, *out.shape[1:])
        torch.index_select(flat, 0, self.dst[:tokens], out=out)
