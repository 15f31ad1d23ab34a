"""One small model file per family where the architecture differs; shared pieces live in
``kvjax.serve.layers``. ``llama`` also serves Mistral and Qwen2 (their differences are projection
biases, which ``ModelConfig`` carries); ``qwen3`` adds RMSNorms on q and k."""
