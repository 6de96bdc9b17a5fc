"""Communication backends for titan: ``default`` (torchrun's env://) and the debugging backends
``fake`` and ``real_pp_fake_spmd`` (docs/debugging.md). Importing this package does not import
torch."""
