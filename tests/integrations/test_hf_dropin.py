"""The HF transformers drop-in (replayssm_jit.integrations.hf): tiny random-weight NemotronH
(Mamba-2), Qwen3-Next and Qwen3.5 (GDN) models generate the same greedy tokens and logits
through our ops as through HF's own decode.

The models are set up so that a wrong state shows: decays near 1 (A_log, dt_bias), Mamba-2's
D small, larger input projections (the state term dominates the output), rows with different
prompt lengths (left padding) whose flushes are staggered (stagger_flushes: a launch mixes
flush and non-flush rows), window 16 over 63 decode steps (not a multiple). A broken fold on
the CPU path must then fail the comparison. GPU twins run the same through the kernels.
"""

from __future__ import annotations

import pytest
import torch

from replayssm_jit import LaunchConfig
from replayssm_jit.integrations import hf

transformers = pytest.importorskip("transformers")
if not hasattr(pytest.importorskip("transformers.cache_utils").Cache, "get_recurrent_state"):
    pytest.skip("needs transformers 5's Cache state accessors", allow_module_level=True)

F32, F64 = torch.float32, torch.float64
NEW_TOKENS, WINDOW, VOCAB = 64, 16, 96
PROMPT_LENGTHS = (9, 5, 12)  # rows left-padded to 12 tokens


# Tiny matmuls: thread hand-offs would dominate on a shared 2-core runner (one thread).
pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------------------------


def _long_memory(mixer, gen) -> None:
    """Decays near 1 and a visible state: small |A| and step (decay per token ~ 0.997), D near
    zero, and input projections scaled up so that the state's readout dominates the output."""
    if hasattr(mixer, "forget_gate"):  # KDA: its gate holds A_log and dt_bias (per channel)
        _long_memory_kda(mixer, gen)
        return
    heads = mixer.A_log.shape[0]
    with torch.no_grad():
        mixer.A_log.copy_(torch.log(0.02 + 0.08 * torch.rand(heads, generator=gen)))
        mixer.dt_bias.copy_(-3.0 + 0.5 * torch.rand(heads, generator=gen))
        if hasattr(mixer, "D"):
            mixer.D.fill_(0.01)
        for name, proj in mixer.named_children():
            if name.startswith("in_proj"):
                proj.weight.mul_(8.0)


def _long_memory_kda(mixer, gen) -> None:
    """KDA's per-channel decays near 1 (softplus(dt_bias + f) exp(A_log) ~ 3e-3 a token) and
    q, k, v projections scaled up."""
    gate = mixer.forget_gate
    with torch.no_grad():
        gate.A_log.copy_(torch.log(0.02 + 0.08 * torch.rand(gate.A_log.shape, generator=gen)))
        gate.dt_bias.copy_(-3.0 + 0.5 * torch.rand(gate.dt_bias.shape, generator=gen))
        gate.f_b_proj.weight.mul_(0.1)
        for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj):
            proj.weight.mul_(8.0)


def nemotron_h(dtype=F32, seed=0, *, headdim=16, dstate=16):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
        layers_block_type=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        mamba_num_heads=4, mamba_head_dim=headdim, ssm_state_size=dstate, n_groups=2,
        conv_kernel=4, chunk_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return _build(NemotronHForCausalLM, config, dtype, seed)


def qwen3_next(dtype=F32, seed=0, *, key_dim=16, value_dim=16):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=key_dim,
        linear_value_head_dim=value_dim, mlp_only_layers=[0, 1],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return _build(Qwen3NextForCausalLM, config, dtype, seed)


def qwen3_5(dtype=F32, seed=0):
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return _build(modeling.Qwen3_5ForCausalLM, config, dtype, seed)


def kimi_linear(dtype=F32, seed=0, *, head_dim=16):
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    config = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense"] * 3, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, linear_attn_config={"head_dim": head_dim, "num_heads": 4},
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return _build(modeling.KimiLinearForCausalLM, config, dtype, seed)


MODELS = {"nemotron_h": nemotron_h, "qwen3_next": qwen3_next, "qwen3_5": qwen3_5,
          "kimi_linear": kimi_linear}  # fmt: skip


def _build(model_class, config, dtype, seed):
    torch.manual_seed(seed)
    model = model_class(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    for mixer in model.modules():
        if type(mixer).__name__ in hf.MIXERS:
            _long_memory(mixer, gen)
    return model.to(dtype)


def prompts(device="cpu", seed=0):
    """Left-padded prompts of PROMPT_LENGTHS tokens (pad id 0) and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(PROMPT_LENGTHS)
    ids = torch.zeros(len(PROMPT_LENGTHS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(PROMPT_LENGTHS):
        ids[row, width - length :] = torch.randint(3, VOCAB, (length,), generator=gen)
        mask[row, width - length :] = 1
    return ids.to(device), mask.to(device)


def generate(model, device="cpu"):
    """Greedy decode of NEW_TOKENS tokens: (tokens [batch, NEW_TOKENS], logits [NEW_TOKENS,
    batch, vocab] float64, the generate output)."""
    ids, mask = prompts(device)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            do_sample=False, output_logits=True, return_dict_in_generate=True,
            pad_token_id=0,
        )  # fmt: skip
    tokens = out.sequences[:, ids.shape[1] :]
    return tokens, torch.stack(out.logits).to(F64), out


def logits_error(logits, expected) -> float:
    """The worst step's norm(logits - expected) / norm(expected), over the batch and vocab."""
    diff = (logits - expected).flatten(1).norm(dim=1)
    return float((diff / expected.flatten(1).norm(dim=1)).max())


def run_patched(model, device="cpu", **options):
    """generate() through our ops: (tokens, logits, the generate output, decode steps per
    layer, flush epochs per layer and row). The returned cache holds the exact final states:
    write_back() copies them in before unpatch()."""
    options = dict(window=WINDOW, stagger_flushes=True) | options
    handle = hf.patch(model, **options)
    try:
        tokens, logits, out = generate(model, device)
        layers = handle.layers
        steps = [layer.decode_steps for layer in layers]
        epochs = [layer.pool["cursors"][:, 1].tolist() for layer in layers]
        hf.write_back(model)
        assert all(layer.held_cache is None for layer in layers)
    finally:
        hf.unpatch(model)
    return tokens, logits, out, steps, epochs


_HF_RUNS: dict = {}


def hf_reference(name, dtype=F32, device="cpu"):
    """HF's own generate of the model (cached per model, dtype and device)."""
    key = (name, dtype, device)
    if key not in _HF_RUNS:
        model = MODELS[name](dtype).to(device)
        _HF_RUNS[key] = (model, generate(model, device))
    return _HF_RUNS[key]


# ---------------------------------------------------------------------------------------------
# Same tokens and logits as HF's decode
# ---------------------------------------------------------------------------------------------


def check_matches_hf(name, device, mode="replay", kernel="per-item"):
    """kernel: the replay kernel; "per-item" keeps records across the window (the policy
    may pick the flush-every-step kernel for these small batches, on which no flush count
    is asserted)."""
    model, (hf_tokens, hf_logits, hf_out) = hf_reference(name, F32, device)
    config = LaunchConfig(kernel=kernel) if mode == "replay" and kernel != "auto" else None
    tokens, logits, out, steps, epochs = run_patched(model, device, mode=mode,
                                                     launch_config=config)  # fmt: skip
    decode_steps = NEW_TOKENS - 1  # the first new token comes from the prefill
    assert steps == [decode_steps] * len(steps), "every SSM layer decoded through our ops"
    if mode == "replay" and kernel == "per-item":
        # Staggered rows: (63 + offset) // 16 flushes each, offsets 0, 5, 10 -> 3, 4, 4.
        assert all(layer_epochs == [3, 4, 4] for layer_epochs in epochs)
    assert torch.equal(tokens, hf_tokens)
    assert logits_error(logits, hf_logits) < 1e-4
    # The final SSM states, written back into HF's cache, are HF's own.
    for ours, expected in zip(_recurrent_states(model, out.past_key_values),
                              _recurrent_states(model, hf_out.past_key_values)):  # fmt: skip
        assert float((ours - expected).norm() / expected.norm()) < 1e-4


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_and_logits_match_hf(name):
    check_matches_hf(name, "cpu")


def test_conventional_mode_matches_hf():
    check_matches_hf("nemotron_h", "cpu", mode="conventional")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["per-item", "auto"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_and_logits_match_hf_gpu(name, kernel):
    check_matches_hf(name, "cuda", kernel=kernel)


def check_bf16(name, device):
    """A bf16 model with FP32 states (HF keeps FP32 states too), teacher-forced along HF's own
    bf16 greedy decode (the prompts, then its generated tokens one at a time) with and without
    the patch: logits within bf16 noise at every step, and the same greedy token except at
    near-ties. HF's Mamba-2 readout rounds the state to bf16 where ours reads it in FP32, so
    where HF's top two logits are closer than that noise either token is right."""
    model, (hf_tokens, _, hf_out) = hf_reference(name, torch.bfloat16, device)
    assert all(t.dtype == F32 for t in _recurrent_states(model, hf_out.past_key_values))
    ids, mask = prompts(device)
    chunks = [ids, *hf_tokens[:, :-1].split(1, dim=1)]
    first = ids.shape[1] - 1  # the position whose logits give the first new token
    expected = forward_schedule(model, chunks, mask)[:, first:].transpose(0, 1)
    handle = hf.patch(model, window=WINDOW, stagger_flushes=True, state_dtype=F32)
    try:
        logits = forward_schedule(model, chunks, mask)[:, first:].transpose(0, 1)
        assert all(layer.decode_steps == NEW_TOKENS - 1 for layer in handle.layers)
        assert all(layer.layout.act_dtype == torch.bfloat16 for layer in handle.layers)
    finally:
        hf.unpatch(model)
    assert logits_error(logits, expected) < 2e-2
    ours, theirs = logits.argmax(-1), expected.argmax(-1)
    assert float((ours == theirs).double().mean()) > 0.9
    for step, row in (ours != theirs).nonzero().tolist():
        top_two = expected[step, row].topk(2).values
        noise = (logits[step, row] - expected[step, row]).abs().max()
        assert top_two[0] - top_two[1] <= 2 * noise, (step, row)


def _recurrent_states(model, cache):
    return [
        cache.get_recurrent_state(m.layer_idx)
        for m in model.modules()
        if type(m).__name__ in hf.MIXERS
    ]


@pytest.mark.parametrize("name", ["nemotron_h", "qwen3_next"])
def test_bf16_model_fp32_state_matches_hf(name):
    check_bf16(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nemotron_h", "qwen3_next"])
def test_bf16_model_fp32_state_matches_hf_gpu(name):
    check_bf16(name, "cuda")


# ---------------------------------------------------------------------------------------------
# The comparison can fail
# ---------------------------------------------------------------------------------------------


def _skip_fold(original):
    """A flush that folds nothing: the checkpoint keeps its old value."""

    def store_state(copy, slots, values, key):
        return None

    return store_state


def _drop_oldest_record(original):
    """Ring reads that lose the oldest held record (its x / k read as zero)."""

    def with_current(ring, slots, held, current):
        rows = original(ring, slots, held, current)
        if held:
            rows = rows.clone()
            rows[:, :, 0] = 0
        return rows

    return with_current


# Each break: the torch-path module whose function it replaces, the function's name, the breaker.
BREAKS = {"skip_fold": ("checkpoint", "store_state", _skip_fold),
          "drop_record": ("protocol", "with_current", _drop_oldest_record)}  # fmt: skip


# Each break on one family (each fails on both: logits off by 1.5 to 1.7). With transformers'
# default init instead of _long_memory the 1e-4 comparison would pass all four (measured:
# NemotronH 8.9e-6 skip_fold, 1.9e-6 drop_record; Qwen3-Next 6.2e-5, 3.9e-5; tokens equal).
@pytest.mark.parametrize(("name", "broken"), [("nemotron_h", "skip_fold"),
                                              ("qwen3_next", "drop_record"),
                                              ("kimi_linear", "skip_fold"),
                                              ("kimi_linear", "drop_record")])  # fmt: skip
def test_broken_fold_fails_the_comparison(name, broken, monkeypatch):
    import importlib

    model, (hf_tokens, hf_logits, _) = hf_reference(name)
    module_name, attr, breaker = BREAKS[broken]
    module = importlib.import_module(f"replayssm_jit.ops.torch_path.{module_name}")
    monkeypatch.setattr(module, attr, breaker(getattr(module, attr)))
    tokens, logits, *_ = run_patched(model)
    assert logits_error(logits, hf_logits) > 1e-2  # far outside the 1e-4 the real path meets
    assert not torch.equal(tokens, hf_tokens)


def forward_schedule(model, chunks, prompt_mask=None):
    """Teacher-forced forwards of `chunks` ([batch, t] token blocks, in order) on one cache,
    the first chunk's padding masked by `prompt_mask`: the logits of every position, [batch,
    sum of t, vocab] float64."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    mask, logits = None, []
    with torch.no_grad():
        for index, chunk in enumerate(chunks):
            if prompt_mask is not None:  # the mask covers every token seen so far
                mask = prompt_mask if index == 0 else torch.cat([mask, torch.ones_like(chunk)], 1)
            out = model(input_ids=chunk, attention_mask=mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, dim=1).to(F64)


def check_reads_exact_states(name, device):
    """Decode steps through our ops, then a 3-token forward that HF runs itself from its cache's
    SSM state (written back first), then decode steps again (the slots reloaded): the logits
    are the unpatched model's."""
    model, _ = hf_reference(name, F32, device)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, VOCAB, (3, 5 + 20 + 3 + 20), generator=gen).to(device)
    sizes = [5] + [1] * 20 + [3] + [1] * 20
    chunks = list(torch.split(tokens, sizes, dim=1))
    expected = forward_schedule(model, chunks)
    handle = hf.patch(model, window=WINDOW, stagger_flushes=True)
    try:
        logits = forward_schedule(model, chunks)
        assert [layer.decode_steps for layer in handle.layers] == [40] * len(handle.layers)
    finally:
        hf.unpatch(model)
    assert logits_error(logits.transpose(0, 1), expected.transpose(0, 1)) < 1e-4


@pytest.mark.parametrize("name", ["nemotron_h", "qwen3_next"])
def test_hf_reads_exact_states_between_decode_steps(name):
    check_reads_exact_states(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nemotron_h", "qwen3_next"])
def test_hf_reads_exact_states_between_decode_steps_gpu(name):
    check_reads_exact_states(name, "cuda")


# ---------------------------------------------------------------------------------------------
# Lifecycle: unpatch, errors
# ---------------------------------------------------------------------------------------------


def test_unpatch_restores_the_model():
    model, (hf_tokens, hf_logits, _) = hf_reference("nemotron_h")
    mixers = [m for m in model.modules() if type(m).__name__ in hf.MIXERS]
    handle = hf.patch(model, window=WINDOW)
    assert [layer.mixer for layer in handle.layers] == mixers
    assert all(m.forward == layer.forward for m, layer in zip(mixers, handle.layers))
    with pytest.raises(ValueError, match="already patched"):
        hf.patch(model)
    hf.unpatch(model)
    for mixer in mixers:
        assert "forward" not in vars(mixer)
        assert mixer.forward.__func__ is type(mixer).forward
    assert hf.patched_layers(model) == []
    with pytest.raises(ValueError, match="not patched"):
        hf.unpatch(model)
    tokens, logits, _ = generate(model)  # HF's own decode again, bit for bit
    assert torch.equal(tokens, hf_tokens) and torch.equal(logits, hf_logits)


def test_unpatch_keeps_an_instance_forward_set_before_the_patch():
    model, _ = hf_reference("qwen3_next")
    mixer = next(m for m in model.modules() if type(m).__name__ in hf.MIXERS)
    hooked = mixer.forward  # a bound method, as accelerate's hooks leave one
    mixer.forward = hooked
    try:
        hf.patch(model)
        assert mixer.forward != hooked
        hf.unpatch(model)
        assert vars(mixer)["forward"] is hooked
    finally:
        del mixer.forward


def test_patch_errors_change_nothing():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"'llama' is not supported.*nemotron_h.*qwen3_next"):
        hf.patch(LlamaForCausalLM(config))
    model, _ = hf_reference("nemotron_h")
    with pytest.raises(ValueError, match="mode"):
        hf.patch(model, mode="fast")
    with pytest.raises(ValueError, match="window"):
        hf.patch(model, window=0)
    assert hf.patched_layers(model) == []
    assert not any("forward" in vars(m) for m in model.modules())
