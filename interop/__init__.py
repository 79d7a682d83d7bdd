"""Converters from other libraries' attention modules to this project's `MultiHeadAttention`.

`interop.hf`: Hugging Face `transformers` (a test dependency; this package imports no framework itself).
"""
