"""A mixture-of-experts decoder for titan: Llama-style attention, top-k routed FFN experts.

Modules: ``model`` (architecture; ``MoE`` and ``GroupedExperts`` are what expert parallelism
works on), ``flavors`` (hyper-parameters, parameter and FLOP counts), ``recipes``
(``moe_debugmodel``), ``plugin`` (hook implementations). Importing this package does not import
torch.
"""
