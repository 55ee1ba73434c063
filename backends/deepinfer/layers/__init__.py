"""DeepInfer's building blocks: linear layers with weight loaders, norms, RoPE, attention, MoE."""
