"""titan's float8 training plugin: torchao's ``Float8Linear`` as a strategy (``float8.enable``)."""
