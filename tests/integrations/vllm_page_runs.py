"""A plugin layer of each family driven through its own core method in vLLM's cache pages
(fake_vllm.py, fake_vllm_runner.py), against float64 references: the harness of
test_engine_pages_vllm.py and test_engine_align_vllm.py."""

from __future__ import annotations

import torch
from fake_vllm import GDN, KDA, M2, CacheConfig, ForwardContext, GDNAttentionMetadata
from fake_vllm import Mamba2AttentionMetadata as M2Metadata
from fake_vllm import install as install_fake_vllm
from fake_vllm_runner import VllmConfig, allocate, install_models, padded_page

from replayssm_jit.integrations.vllm import hooks, page_hooks, plugin
from replayssm_jit.reference import gdn_gates
from replayssm_jit.reference.gdn import gdn_step
from replayssm_jit.reference.kda import kda_step
from replayssm_jit.reference.mamba2 import mamba2_step

F64, I32 = torch.float64, torch.int32
SLOTS, L, TOL = 9, 4, 2e-5
PREFIX = "model.layers.0.mixer"
ATTN_BYTES_PER_TOKEN = 2 * 2 * 64 * 4  # K and V, 2 heads of 64, float32
QUIET = [0, 1, 3, 4, 6, 8]  # the null block and the slots no row names
DIMS = {
    "mamba2": dict(heads=4, head_dim=8, groups=2, state=16),
    "gdn": dict(key_heads=2, value_heads=4, k=16, v=8),
    "kda": dict(heads=4, head_dim=16),
}


def install_vllm_pages(monkeypatch) -> dict:
    """The fake vLLM and its model classes, the plugin registered, fresh process-wide state."""
    monkeypatch.setenv("REPLAYSSM_VLLM", "1")
    monkeypatch.setenv("REPLAYSSM_VLLM_WINDOW", str(L))
    monkeypatch.setattr(plugin.BACKEND, "_layers", {})
    for name in ("_DRAFTS", "_RESETS"):
        monkeypatch.setattr(hooks, name, {})
    monkeypatch.setattr(page_hooks, "_BOUND", {})
    monkeypatch.setattr(page_hooks, "_WARNED", set())
    monkeypatch.setattr(page_hooks, "_DECLARED", {})
    mods = install_fake_vllm(monkeypatch, lower_bound=-5.0)
    mods["models"] = install_models(monkeypatch)
    assert plugin.register() is True
    return mods


def rel(actual, expected):
    a, e = actual.to(F64), expected.to(F64)
    return float(torch.linalg.vector_norm(a - e) / max(torch.linalg.vector_norm(e), 1e-30))


# ---------------------------------------------------------------------------------------------
# One layer of each family, driven through its own core method
# ---------------------------------------------------------------------------------------------


def gdn_metadata(decodes, prefills, lens, initial=()):
    """vLLM's non-spec GDN metadata: decode rows (one token) first, then prefills (those whose
    slot is in `initial` start from its state)."""
    seqlens = [1] * len(decodes) + list(lens)
    loc = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=I32)
    p_loc = torch.tensor([0, *torch.tensor(list(lens) or [0]).cumsum(0).tolist()], dtype=I32)
    init = torch.tensor([s in initial for s in prefills], dtype=torch.bool)
    return GDNAttentionMetadata(
        num_prefills=len(prefills), num_decodes=len(decodes), num_decode_tokens=len(decodes),
        num_actual_tokens=sum(seqlens),
        has_initial_state=torch.cat([torch.ones(len(decodes), dtype=torch.bool), init]),
        non_spec_query_start_loc=loc,
        non_spec_state_indices_tensor=torch.tensor(list(decodes) + list(prefills), dtype=I32),
        prefill_state_indices=torch.tensor(prefills, dtype=I32) if prefills else None,
        prefill_has_initial_state=init if prefills else None,
        prefill_query_start_loc=p_loc[: len(lens) + 1] if prefills else None,
    )  # fmt: skip


def spec_indices(slots, T):
    """[bs, 1 + num_spec]: column 0 the request's block, then spare blocks (pads: 0)."""
    return torch.tensor([[s] + [0 if s == 0 else 8] * (T - 1) for s in slots], dtype=I32)


class Run:
    """A layer of `family` with num_spec = T - 1, its float64 reference per slot (the committed
    state; after a verify, the state after each of its tokens)."""

    def __init__(self, mods, family, T, padded, gen):
        self.mods, self.family, self.T, self.gen = mods, family, T, gen
        self.ref, self.window = {}, {}
        cache = CacheConfig(mamba_page_size_padded=padded)
        d = DIMS[family]
        if family == "mamba2":
            self.A = -(0.5 + torch.rand(d["heads"], generator=gen))
            self.D = torch.randn(d["heads"], generator=gen)
            self.dt_bias = torch.rand(d["heads"], generator=gen) - 0.5
            self.layer = mods[M2].MambaMixer2(PREFIX, d["heads"], d["head_dim"], d["groups"],
                                              d["state"], self.A, self.D, self.dt_bias,
                                              num_spec=T - 1, cache_config=cache)  # fmt: skip
        elif family == "gdn":
            HV = d["value_heads"]
            self.A_log = torch.rand(HV, generator=gen) - 1.0
            self.dt_bias = torch.rand(HV, generator=gen)
            self.layer = mods[GDN].QwenGatedDeltaNetAttention(
                PREFIX, d["key_heads"], HV, d["k"], d["v"], self.A_log, self.dt_bias,
                num_spec=T - 1, cache_config=cache,
            )  # fmt: skip
        else:
            H, D = d["heads"], d["head_dim"]
            self.A_log = (torch.rand(H, generator=gen) - 1.0).reshape(1, 1, H, 1)
            self.dt_bias = 0.5 * torch.randn(H * D, generator=gen)
            self.layer = mods[KDA].KimiGatedDeltaNetAttention(PREFIX, H, D, self.A_log,
                                                              self.dt_bias, num_spec=T - 1,
                                                              cache_config=cache)  # fmt: skip

    @property
    def state(self):
        return self.layer.kv_cache[1]

    def tokens(self, n):
        g, d = self.gen, DIMS[self.family]
        if self.family == "mamba2":
            H, G, N = d["heads"], d["groups"], d["state"]
            x, B, C = (torch.randn(n, w, generator=g) for w in (H * d["head_dim"], G * N, G * N))
            return {"x": x, "B": B, "C": C, "dt": -3.0 + 3.5 * torch.rand(n, H, generator=g)}
        if self.family == "gdn":
            width = 2 * d["key_heads"] * d["k"] + d["value_heads"] * d["v"]
            HV = d["value_heads"]
            return {"mixed": torch.randn(n, width, generator=g),
                    "a": torch.randn(n, HV, generator=g), "b": torch.randn(n, HV, generator=g)}  # fmt: skip
        H, D = d["heads"], d["head_dim"]
        qkv = {k: torch.randn(n, H * D, generator=g) for k in "qkv"}
        return {**qkv, "g1": torch.randn(1, n, H, D, generator=g),
                "beta": torch.randn(n, H, generator=g).sigmoid()[None]}  # fmt: skip

    def call(self, md, tok, n, spec=None):
        """The layer's core method on `md` (KDA's MTP: the decode name a spec row calls)."""
        self.mods["vllm.forward_context"]._current = ForwardContext({PREFIX: md})
        if self.family == "mamba2":
            out = torch.zeros(n, self.layer.num_heads * self.layer.head_dim)
            cat = torch.cat([tok["x"], tok["B"], tok["C"], tok["dt"]], dim=-1)
            self.layer.conv_ssm_forward(cat, out)
            return out
        if self.family == "gdn":
            out = torch.zeros(n, self.layer.num_v_heads, self.layer.head_v_dim)
            self.layer._forward_core(tok["mixed"], tok["b"], tok["a"], out)
            return out
        H, D = self.layer.num_heads, self.layer.head_dim
        if spec is None:
            out = torch.zeros(1, n, H, D)
            self.layer._forward(tok["q"], tok["k"], tok["v"], tok["g1"], tok["beta"], out)
            return out[0]
        idx, loc, accepted = spec
        q, k, v = (tok[c].view(1, n, H, D) for c in "qkv")
        o, _ = self.mods[KDA].fused_recurrent_kda(
            q=q, k=k, v=v, g=self.kda_gates(tok)[None], beta=tok["beta"], initial_state=self.state,
            use_qk_l2norm_in_kernel=True, cu_seqlens=loc, ssm_state_indices=idx,
            num_accepted_tokens=accepted,
        )  # fmt: skip
        return o[0]

    def kda_gates(self, tok):
        return self.mods[KDA].fused_kda_gate(tok["g1"][0].flatten(-2), self.A_log,
                                             self.layer.head_dim, self.dt_bias, -5.0)  # fmt: skip

    def reference(self, st, tok, i):
        """Token i from state st: (o float64, the state after it)."""
        if self.family == "mamba2":
            lay = self.layer
            H, P, G, N = lay.num_heads, lay.head_dim, lay.n_groups, lay.ssm_state_size
            o, st = mamba2_step(st[None], tok["x"][i].view(1, H, P), tok["dt"][i][None], self.A,
                                tok["B"][i].view(1, G, N), tok["C"][i].view(1, G, N), D=self.D,
                                dt_bias=self.dt_bias, dt_softplus=True)  # fmt: skip
            return o[0].flatten(), st[0]
        if self.family == "gdn":
            q, k, v = self.layer.rearrange_mixed_qkv(tok["mixed"])
            g, beta = gdn_gates(self.A_log, tok["a"], self.dt_bias, tok["b"])
            o, st = gdn_step(st[None], q[0, i][None], k[0, i][None], v[0, i][None], g[i][None],
                             beta[i][None])  # fmt: skip
            return o[0], st[0]
        H, D = self.layer.num_heads, self.layer.head_dim
        q, k, v = (tok[c][i].view(1, H, D) for c in "qkv")
        o, st = kda_step(st[None], q, k, v, self.kda_gates(tok)[i][None], tok["beta"][0, i][None])
        return o[0], st[0]

    def prefill(self, slots, lens, decodes=(), initial=()):
        """Sequences in `slots`, new or (those in `initial`) continuing from their slot's state,
        with one-token `decodes` first in the batch (T = 1; KDA's layer runs them through the
        chunk kernel too, from their folded checkpoints); the worst relative error of the
        decode rows' outputs and the continuing rows' written states."""
        nd, n = len(decodes), len(decodes) + sum(lens)
        if self.family == "mamba2":
            loc = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32)
            md = M2Metadata(
                num_prefills=len(slots), num_prefill_tokens=n - nd, num_decodes=nd,
                num_decode_tokens=nd,
                has_initial_states_p=torch.tensor([s in initial for s in slots], dtype=bool),
                query_start_loc_p=loc, state_indices_tensor_p=torch.tensor(slots, dtype=I32),
                state_indices_tensor_d=torch.tensor(decodes, dtype=I32),
            )  # fmt: skip
        else:
            md = gdn_metadata(decodes, slots, lens, initial)
        tok = self.tokens(n)
        out = self.call(md, tok, n)
        worst = 0.0
        for r, s in enumerate(decodes):
            o, self.ref[s] = self.reference(self.ref[s], tok, r)
            worst = max(worst, rel(out[r], o.view(out[r].shape)))
        first = nd
        for s, length in zip(slots, lens):
            if s in initial:  # the prompt's tokens from the state the slot held
                st = self.ref[s]
                for i in range(first, first + length):
                    _, st = self.reference(st, tok, i)
                worst = max(worst, rel(self.state[s], st.view(self.state[s].shape)))
            self.ref[s] = self.state[s].to(F64)  # what vLLM wrote is the sequence's state
            self.window.pop(s, None)
            first += length
        return worst

    def step(self, slots, accepted):
        """A decode (T = 1) or verify (T tokens a row) of `slots` (0: a pad row), after a
        verify that kept `accepted` tokens a row; the worst relative error of the live rows."""
        bs, T = len(slots), self.T
        for r, s in enumerate(slots):  # the previous verify's kept tokens are committed
            if s and s in self.window:
                self.ref[s] = self.window.pop(s)[int(accepted[r]) - 1]
        n, tok = bs * T, self.tokens(bs * T)
        loc = torch.arange(bs + 1, dtype=I32) * T
        acc = torch.tensor(accepted, dtype=I32)
        spec = (spec_indices(slots, T), loc, acc) if T > 1 else None
        if self.family == "mamba2":
            md = M2Metadata(
                num_prefills=0, num_prefill_tokens=0, num_decodes=bs, num_decode_tokens=n,
                has_initial_states_p=None, query_start_loc_p=None, state_indices_tensor_p=None,
                state_indices_tensor_d=spec[0] if spec else torch.tensor(slots, dtype=I32),
                query_start_loc_d=loc if spec else None, num_accepted_tokens=acc if spec else None,
            )  # fmt: skip
        elif self.family == "gdn" and spec:
            md = GDNAttentionMetadata(
                num_prefills=0, num_decodes=0, num_decode_tokens=0, num_actual_tokens=n,
                has_initial_state=None, non_spec_query_start_loc=None,
                non_spec_state_indices_tensor=None, spec_sequence_masks=torch.ones(bs, dtype=bool),
                num_accepted_tokens=acc, num_spec_decodes=bs, spec_state_indices_tensor=spec[0],
                spec_query_start_loc=loc,
            )  # fmt: skip
        else:
            md = gdn_metadata(slots, [], [])
        out = self.call(md, tok, n, spec)
        worst = 0.0
        for r, s in enumerate(slots):
            rows = out[r * T : (r + 1) * T]
            if s == 0:
                assert torch.equal(rows, torch.zeros_like(rows)), "a pad row's output"
                continue
            st, outs, states = self.ref[s], [], []
            for j in range(T):
                o, st = self.reference(st, tok, r * T + j)
                outs.append(o)
                states.append(st)
            worst = max(worst, rel(rows, torch.stack(outs).view(rows.shape)))
            if T > 1:
                self.window[s] = states
            else:
                self.ref[s] = st
        return worst


def kept(gen, slots, T):
    """The rejection sampler's tokens kept a row (bonus included; pads and T = 1: 1)."""
    k = torch.randint(1, T + 1, (len(slots),), generator=gen).tolist()
    return [1 if s == 0 else v for s, v in zip(slots, k)]


def config(mods, family, T):
    """vLLM at config time: the model class's entries padded to the attention page."""
    cfg = VllmConfig(hf_config=DIMS[family], num_spec=T - 1)
    return mods["models"][family], cfg, padded_page(mods["models"][family], cfg,
                                                    ATTN_BYTES_PER_TOKEN)  # fmt: skip


def run_pages(mods, family, T, form="as_strided", shift=0, seed=1):
    """Prefill, decode or verify rounds, a recycled slot and a fresh one; returns the checks."""
    gen = torch.Generator().manual_seed(seed)
    _, _, padded = config(mods, family, T)
    run = Run(mods, family, T, padded, gen)
    pages = allocate([run.layer], SLOTS, padded, form=form, fill=gen, shift=shift)
    run.prefill([2, 5], [3, 2])
    worst, acc = 0.0, [1, 1, 1]
    for _ in range(2 * L + 1):  # (T = 1: slot 2 holds a record at the mixed batch below)
        worst = max(worst, run.step([2, 5, 0], acc))
        acc = kept(gen, [2, 5, 0], T)
    layer = plugin.BACKEND.layer(run.state)
    in_pages = all(layer.pool[n] is v for n, v in zip(layer_names(run.layer), pages.views) if n)
    in_pages &= all(t.untyped_storage().data_ptr() == pages.raw.data_ptr()
                    for t in layer.pool.values())  # fmt: skip
    before = pages.raw.view(SLOTS, pages.page)[QUIET].clone()
    # Slot 5 recycled for a new request, 7 a fresh block; T = 1: slot 2 decodes in that batch.
    worst = max(worst, run.prefill([5, 7], [2, 3], decodes=[2] if T == 1 else []))
    acc = [acc[0], 1, 1, 1]
    for _ in range(2 * L):
        worst = max(worst, run.step([2, 5, 7, 0], acc))
        acc = kept(gen, [2, 5, 7, 0], T)
    untouched = torch.equal(before, pages.raw.view(SLOTS, pages.page)[QUIET])
    # vLLM's views keep their indices (and its code saw those two alone)
    own = len(run.layer.kv_cache) > 2
    own &= all(a is b for a, b in zip(run.layer.kv_cache[:2], pages.views[:2]))
    return {"outputs": worst < TOL, "in_pages": in_pages, "untouched": untouched,
            "vllm_entries": own}  # fmt: skip


def layer_names(layer):
    return layer.__dict__["_replayssm_pages"].entries.names
