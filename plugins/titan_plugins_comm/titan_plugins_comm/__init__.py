"""Communication backends for titan: ``default`` (torchrun's env://), and the fake debugging
backends. Importing this package does not import torch."""
