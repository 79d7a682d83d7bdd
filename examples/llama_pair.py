"""The PyTorch and Keras rebuilds of examples/port_llama.py, as a pair for the model comparison.

    make parity ARGS="--model examples/llama_pair.py"

An untrained character-level Llama of port_llama.py's size (built from its config by
`transformers`, seeded, no download) is ported once (`interop.hf.port_attention`, to a temporary
folder), then rebuilt around `MultiHeadAttention` twice: `TorchLlama` and `KerasLlama`, each
given the same weights by port_llama.py itself. The Keras rebuild is a plain Python class of Keras
layers, not a Keras Model, so the comparison runs at the models' outputs (the logits of one
prefill of two left-padded prompts, the way port_llama.py decodes), with the weights each rebuild
was given; its note says so. Only the real tokens are compared (`compare_mask`).
"""

import functools
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import port_llama
import torch

KERAS_BACKENDS = ("tensorflow",)  # KerasLlama builds on TensorFlow/Multi_Head_Attention.py
DTYPES = ("float32",)  # the rebuilds hold their weights as float32 arrays


@functools.cache
def _ported():
    """(untrained LlamaForCausalLM, the folder of its ported attention layers), made once; the
    folder is removed when the process ends."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=port_llama.VOCAB,
        hidden_size=port_llama.HIDDEN,
        num_attention_heads=port_llama.HEADS,
        num_key_value_heads=port_llama.KV_HEADS,
        num_hidden_layers=port_llama.LAYERS,
        intermediate_size=port_llama.MLP,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tempfile.TemporaryDirectory(prefix="llama_pair_")  # kept, with the cache, until the process ends
    port_llama.save_ports(model, Path(folder.name))
    return model, Path(folder.name), folder


class TorchPrefill(torch.nn.Module):
    """`TorchLlama` called as a model: (tokens, positions, key_mask) -> logits of one prefill."""

    def __init__(self):
        super().__init__()
        self.rebuilt = port_llama.TorchLlama(*_ported()[:2])

    def forward(self, tokens, positions, key_mask):
        b, t = tokens.shape
        caches = self.rebuilt.init_caches(b, t)
        logits, _ = self.rebuilt(tokens.numpy(), positions.numpy(), key_mask.numpy(), caches)
        return torch.from_numpy(logits)


class KerasPrefill:
    """`KerasLlama` called as a Keras model is: on the list of inputs, with `training`."""

    def __init__(self):
        self.rebuilt = port_llama.KerasLlama(*_ported()[:2])

    def __call__(self, inputs, training=False):
        tokens, positions, key_mask = inputs
        logits, _ = self.rebuilt(tokens, positions, key_mask, self.rebuilt.init_caches(*tokens.shape))
        return logits


def build_torch():
    """The PyTorch rebuild."""
    return TorchPrefill()


def build_keras():
    """The Keras rebuild."""
    return KerasPrefill()


def example_inputs():
    """port_llama.py's two prompts, left-padded: tokens, positions (as `generate` computes them), key mask."""
    tokens, mask = port_llama.left_padded(port_llama.PROMPTS)
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    return tokens, positions, mask.astype(bool)


def compare_mask(tokens, positions, key_mask):
    """The real tokens: a padding query keeps no key, and each rebuild outputs its bias there."""
    return key_mask
