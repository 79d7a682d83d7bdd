"""The lookup models of torch_model.py and keras_model.py, as a pair for the model comparison.

    make parity ARGS="--model examples/lookup_pair.py"
    .venv/bin/python -m shared_tests.parity --model examples/lookup_pair.py

PyTorch: Embedding -> MultiHeadAttention (a key padding mask) -> residual -> Linear, ReLU ->
Linear. Keras: Embedding(mask_zero=True) -> MultiHeadAttention (the padding mask flows from the
embedding) -> Add -> Dense(relu) -> Dense. The comparison moves the PyTorch weights into the Keras
model, pairs the four weight-carrying layers in execution order, and compares each.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from task import make_batch

KERAS_BACKENDS = ("tensorflow",)  # keras_model.py builds on TensorFlow/Multi_Head_Attention.py


def build_torch():
    """The PyTorch model (untrained: the comparison moves its weights, whatever they are)."""
    import torch
    from torch_model import LookupModel

    torch.manual_seed(0)
    return LookupModel()


def build_keras():
    """The Keras model, layer for layer."""
    from keras_model import build_model

    return build_model()


def example_inputs():
    """A padded batch of the lookup task: (B, T) token ids, 0 = padding."""
    tokens, _ = make_batch(np.random.default_rng(0), 4)
    return tokens
