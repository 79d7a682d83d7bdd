"""Packed sequences against transformers: a tiny random Llama (no download) run padding-free, the
documents of one row with `position_ids` restarting at each, gives the logits of each document
run alone; the same model with every attention module replaced by this project's PyTorch layer,
called with `segment_ids` from those `position_ids` (its own mask, the model's ignored), gives them
too (float64; against transformers within its float32 RoPE angles)."""

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from interop.hf import port_attention  # noqa: E402
from PyTorch import MultiHeadAttention, segment_ids_from_position_ids  # noqa: E402

LENGTHS = (5, 3, 6)
ROPE_ATOL = (
    1e-6  # transformers turns by float32 cos and sin (its rotary embedding autocasts them), the layer in float64
)


class _PackedAttention(torch.nn.Module):
    """A Llama attention module's call, computed by the layer with `segment_ids` from `position_ids`."""

    def __init__(self, module, config):
        super().__init__()
        kwargs, weights = port_attention(module, config)
        self.layer = MultiHeadAttention(**kwargs)
        self.layer.import_weights(weights)
        self.layer.double()

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        positions = kwargs["position_ids"]
        ids = segment_ids_from_position_ids(positions)
        return self.layer(hidden_states, positions=positions, segment_ids=ids, causal=True), None


def _tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).double().eval()


def test_padding_free_llama_equals_the_layer_with_segment_ids():
    model = _tiny_llama()
    tokens = torch.randint(0, 50, (1, sum(LENGTHS)))
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]  # restarting at each document
    with torch.no_grad():
        alone = torch.cat([model(chunk).logits for chunk in tokens.split(LENGTHS, dim=1)], dim=1)
        packed = model(tokens, position_ids=position_ids, use_cache=False).logits  # padding-free (training-style)
        for block in model.model.layers:
            block.self_attn = _PackedAttention(block.self_attn, model.config)
        ours = model(tokens, position_ids=position_ids, use_cache=False).logits
        ours_alone = torch.cat([model(chunk, use_cache=False).logits for chunk in tokens.split(LENGTHS, dim=1)], 1)
    np.testing.assert_allclose(packed.numpy(), alone.numpy(), atol=1e-10, rtol=0)
    np.testing.assert_allclose(ours.numpy(), ours_alone.numpy(), atol=1e-10, rtol=0)
    np.testing.assert_allclose(ours.numpy(), packed.numpy(), atol=ROPE_ATOL, rtol=0)
