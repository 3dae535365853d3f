"""GDN head shapes shared by gdn/test_gdn_cpu.py and gdn/test_gdn_wrapper_cpu.py."""

# Qwen3.5-4B's GDN layer: 16 key heads, 32 value heads, K = V = 128.
QWEN4B = dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
