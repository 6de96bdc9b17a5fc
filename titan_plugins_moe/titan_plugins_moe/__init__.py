"""Mixture-of-experts decoders for titan: Llama-style, Qwen3-MoE and DeepSeek-V2/V3.

Modules: ``flavors`` (arguments, published flavors, parameter and FLOP counts, layout checks),
``model`` (the decoder, multi-token prediction), ``attention`` (GQA with q/k norm, multi-head
latent attention, YaRN), ``moe`` (router, grouped experts: what expert parallelism works on),
``grouped_mm`` (grouped GEMM and its loop fallback), ``balance`` (the router callback: bias
update, statistics), ``config`` (the ``moe`` config section), ``plan`` (tensor parallelism),
``hf`` (Hugging Face conversion), ``recipes``, ``plugin`` (hook implementations). Importing this
package, ``plugin``, ``flavors``, ``config`` or ``hf`` does not import torch.
"""
