"""A small pre-norm transformer decoder in PyTorch and in Keras, as a pair for the model comparison.

    make parity ARGS="--model examples/blocks_pair.py"
    .venv/bin/python -m shared_tests.parity --model examples/blocks_pair.py --keras tensorflow,jax,torch

Token and position embeddings, then BLOCKS blocks of LayerNorm -> causal MultiHeadAttention (a
key padding mask) -> residual, LayerNorm -> Linear -> GELU -> Linear -> residual, then a final
LayerNorm and the logits. The Keras model uses Keras/Multi_Head_Attention.py, so it runs on any
Keras backend. Its `Add` of the two embeddings drops the padding mask of `Embedding(mask_zero=True)`
(one of its inputs has none), so each attention layer gets the padding as an explicit `key_mask`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from task import load_layer

KERAS_BACKENDS = ("tensorflow", "jax", "torch")  # the Keras file runs on each
VOCAB, LENGTH, D_MODEL, HEADS, HIDDEN, BLOCKS = 40, 8, 16, 4, 16, 3
EPSILON = 1e-5  # every LayerNorm's epsilon, as torch's default (Keras' default is 1e-3)
BLOCK_DEFAULTS = {"epsilon": EPSILON, "causal": True, "approximate": False, "key_mask": True}


def build_torch():
    """The PyTorch model."""
    import torch
    from torch import nn

    MultiHeadAttention = load_layer("PyTorch")  # noqa: N806  (the class, as the copied file names it)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(D_MODEL, eps=EPSILON), nn.LayerNorm(D_MODEL, eps=EPSILON)
            self.attention = MultiHeadAttention(D_MODEL, HEADS)
            self.up, self.act, self.down = nn.Linear(D_MODEL, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D_MODEL)

        def forward(self, x, keep):
            x = x + self.attention(self.norm1(x), key_mask=keep, causal=True)
            return x + self.down(self.act(self.up(self.norm2(x))))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.positions = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(LENGTH, D_MODEL)
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.norm, self.head = nn.LayerNorm(D_MODEL, eps=EPSILON), nn.Linear(D_MODEL, VOCAB)

        def forward(self, tokens):
            keep = tokens != 0  # (B, T), True = a real token
            x = self.embed(tokens) + self.positions(torch.arange(tokens.shape[1]))
            for block in self.blocks:
                x = block(x, keep)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return Decoder()


def build_keras(block_options=None):
    """The Keras model, layer for layer.

    Args:
        block_options: {block index: {option: value}} replacing, in those blocks, the defaults
            of BLOCK_DEFAULTS: the LayerNorms' `epsilon`, the attention's `causal`, the GELU's
            `approximate`, and `key_mask` (False: the attention gets no padding mask).

    Returns:
        A functional keras.Model from (B, LENGTH) token ids to (B, LENGTH, VOCAB) logits.
    """
    import functools

    import keras

    MultiHeadAttention = load_layer("Keras")  # noqa: N806  (the class, as the copied file names it)
    tokens = keras.Input((LENGTH,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, D_MODEL, mask_zero=True, name="embed")(tokens)
    position_ids = keras.ops.zeros_like(tokens) + keras.ops.arange(LENGTH, dtype="int32")  # (B, T)
    x = keras.layers.Add()([x, keras.layers.Embedding(LENGTH, D_MODEL, name="positions")(position_ids)])
    keep = keras.ops.not_equal(tokens, 0)  # (B, T), True = a real token
    for index in range(BLOCKS):
        options = {**BLOCK_DEFAULTS, **(block_options or {}).get(index, {})}
        h = keras.layers.LayerNormalization(epsilon=options["epsilon"], name=f"norm1_{index}")(x)
        attention = MultiHeadAttention(D_MODEL, HEADS, name=f"attention_{index}")
        h = attention(h, key_mask=keep if options["key_mask"] else None, causal=options["causal"])
        x = keras.layers.Add()([x, h])
        h = keras.layers.LayerNormalization(epsilon=options["epsilon"], name=f"norm2_{index}")(x)
        h = keras.layers.Dense(HIDDEN, name=f"up_{index}")(h)
        gelu = functools.partial(keras.activations.gelu, approximate=options["approximate"])
        h = keras.layers.Activation(gelu, name=f"gelu_{index}")(h)
        x = keras.layers.Add()([x, keras.layers.Dense(D_MODEL, name=f"down_{index}")(h)])
    x = keras.layers.LayerNormalization(epsilon=EPSILON, name="norm")(x)
    return keras.Model(tokens, keras.layers.Dense(VOCAB, name="head")(x))


def example_inputs():
    """A batch of token ids with padding (0) at the end of two of its rows."""
    tokens = np.random.default_rng(0).integers(1, VOCAB, size=(3, LENGTH))
    tokens[1, 5:], tokens[2, 3:] = 0, 0
    return tokens.astype(np.int32)
