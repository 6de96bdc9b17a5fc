"""Llama 3 for titan: the model, its flavors, recipes and tensor-parallel plan.

Modules: ``model`` (architecture), ``flavors`` (hyper-parameters, parameter and FLOP counts),
``recipes`` (``llama3_debugmodel`` ...), ``plan`` (TP/SP plan), ``plugin`` (hook
implementations). Importing this package does not import torch.
"""
