"""`interop/hf/` against `transformers` itself: each family's attention module, ported into this
project's layer, gives the module's output (float32, within the SPEC's 1e-5), on a full pass with
padding and when decoding left-padded prompts step by step against transformers' own cache.

Every model is a tiny random one built from a config (no download), seeded, in eval mode, with
`attn_implementation="eager"`; its parameters are redrawn at sizes where every variant matters
(scores of order 1, soft-capping active, norms away from 1). Forward hooks capture one attention
module's input hidden states and output while the model runs; our layer, built from
`port_attention`, runs on those hidden states with the call arguments of interop.hf's docstring.
RoPE models are called with explicit `position_ids` (cumsum(mask) - 1, as `generate` computes them
for left padding) and the layer gets the same `positions`. Every family is checked at two layers
(sliding and full where it alternates). `test_every_ported_variant_matters` removes each ported
variant in turn (window, soft-capping, QK-norm, RoPE and its scaling, sinks, scale, bias) and
requires the output to move by more than 1e-3, so none of the comparisons passes without it.

Frameworks: the NumPy reference (float64) always; PyTorch and TensorFlow are added to the
parametrization as soon as their layer file's constructor takes the modern arguments
(`rope_theta`, ...), read from the file's source without importing it (`_modern_frameworks`):
until they do, their cases are not generated (not skipped). TensorFlow is imported only by its
runner.

The Keras file runs in a process per backend (shared_tests/keras_ports.py: a Keras backend is fixed
when Keras is imported, and this process has imported TensorFlow and torch), in float32 as the PyTorch
and TensorFlow layers are: every family, the full pass and the decoding, on `KERAS_EVERY_FAMILY`'s
backend, and `KERAS_SPREAD`'s families on all three;
BART's cross-attention on all three, Whisper's cross-attention and encoder on the one. The
fixture `keras_outputs` starts a backend's process when a test first asks for it, with the ports,
captures and call arguments of every case of that backend (those the other frameworks compare with,
computed once), and each test compares its own family's outputs.
"""

import ast
import concurrent.futures
import contextlib
import copy
import dataclasses
import functools
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import interop.hf.registry
from interop.hf import (
    alibi_positions,
    port_attention,
    port_checkpoint,
    register_porter,
    replace_attention,
    supported_modules,
    t5_position_bias,
)
from shared_tests import keras_ports
from shared_tests.cases import INDEX_MARGIN, TOLERANCES, index_margin, index_rankings
from shared_tests.keras_backends import KERAS_BACKENDS, KerasBackendError

OUTPUT_TOL = TOLERANCES["float32"]["output"]  # SPEC, float32 outputs: transformers' float32 module vs each layer
MEANINGFUL = 0.1  # outputs smaller than this would pass any comparison: the check that each test can fail
SEED = 0
ROOT = Path(__file__).resolve().parents[1]
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4, 2, 8, 64
PROMPT_LENGTHS = (7, 5, 2)  # left-padded to the longest: padding in the batch, one row mostly padding
DECODE_STEPS = 3
WINDOW = 3  # shorter than the prompts, so the window removes keys
CHUNK = 3  # Llama 4's attention_chunk_size: the prompts and the decoding cross chunk boundaries
FLOOR = 2  # the queries' scale by position (Llama 4's `floor_scale`, Mistral 4's) is 1 below it: the prompts pass it
CHUNK_PROMPT_LENGTHS = (7, 4, 1)  # left padding 0, 3 and 6: whole chunks (see the chunk tests)
LOCAL_ATTENTION = 4  # ModernBERT's local band: |t - s| <= 2
MROPE_SECTION = [2, 1, 1]  # Qwen2-VL's mrope_section for H = 8: the R/2 = 4 rotated pairs
MROPE_THETA = 100.0  # a small base: the later sections turn fast enough to matter at these positions
CLIP_QKV = 0.5  # OLMo's and MPT's clip_qkv: below most unit-scale projections, so the clamp moves the output

COMMON = {"vocab_size": VOCAB, "num_hidden_layers": 2, "intermediate_size": 48, "max_position_embeddings": 64}
GQA = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM}
MOE = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16}
TOKENS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}  # within the tiny vocabulary


# ----------------------------------------------------------------------------------------------
# Frameworks
# ----------------------------------------------------------------------------------------------


def _accepts_modern_kwargs(directory, argument="rope_theta"):
    """True if the layer file's `MultiHeadAttention.__init__` has an `argument` parameter (`rope_theta`)."""
    tree = ast.parse((ROOT / directory / "Multi_Head_Attention.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "MultiHeadAttention":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    arguments = item.args.args + item.args.kwonlyargs
                    return any(parameter.arg == argument for parameter in arguments)
    return False


def _modern_frameworks():
    return [name for name in ("NumPy", "PyTorch", "TensorFlow") if _accepts_modern_kwargs(name)]


FRAMEWORKS = _modern_frameworks()


class _Runner:
    """Builds one framework's layer from ported kwargs and weights, and calls it on NumPy arrays."""

    def __init__(self, name):
        self.name = name
        self.module = importlib.import_module(f"{name}.Multi_Head_Attention")

    def layer(self, kwargs, weights):
        layer = self.module.MultiHeadAttention(**kwargs)
        layer.import_weights(weights)
        return layer

    def tensor(self, array):
        if self.name == "NumPy":
            return array.astype(np.float64) if np.issubdtype(array.dtype, np.floating) else array
        if self.name == "PyTorch":
            return torch.from_numpy(np.ascontiguousarray(array))
        import tensorflow as tf  # only when the TensorFlow layer is under test

        return tf.convert_to_tensor(array)

    def call(self, layer, hidden, arguments, cache=None):
        arguments = {
            name: self.tensor(value) if isinstance(value, np.ndarray) else value for name, value in arguments.items()
        }
        extra = {} if cache is None else {"cache": cache}
        with torch.no_grad():
            result = layer(self.tensor(hidden), **arguments, **extra)
        output, cache = result if cache is not None else (result, None)
        return np.asarray(output), cache

    def alibi_bias(self, num_heads, positions, scale=1.0):
        """`scale` times the file's ALiBi bias, (B, N, 1, S) float32."""
        alibi = np.asarray(self.module.alibi_bias(num_heads, self.tensor(positions)), dtype=np.float32)  # (B, N, 1, S)
        return alibi * np.float32(scale)


@functools.cache
def _runner(name):
    return _Runner(name)


# ----------------------------------------------------------------------------------------------
# Tiny models
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """One `transformers` family: how to build a tiny model and where its attention modules are."""

    name: str
    build: Callable[[], torch.nn.Module]
    attention: str  # path of layer i's attention module, with {i}
    output: str = ""  # the module's submodule whose output is the layer's (BERT, Bloom: before the residual)
    causal: bool = True
    rope: bool = True  # RoPE: the model is called with position_ids, the layer with positions
    bias: str = ""  # "t5", "alibi" or "scaled_alibi" (Falcon's): an attention_bias
    decode: bool = True
    seq2seq: bool = False  # an encoder-decoder model: the decoder self-attends, the encoder reads the prompt
    prefix: bool = False  # port_checkpoint needs `prefix=` (a decoder stack, not the family's default path)
    implementation: str = "eager"  # transformers' attention implementation the model runs
    prompts: tuple = PROMPT_LENGTHS  # the left-padded prompts' lengths
    real_rows: bool = False  # compare the real tokens only, as for a causal model
    mrope: str = ""  # M-RoPE's (3, B, T) positions: "text" (one row thrice, as Qwen2-VL builds them), "grid" (three)

    def module(self, model, index):
        return model.get_submodule(self.attention.format(i=index))


def _llama_like(model_class, config_class, **config):
    """A builder that imports the family's modeling code only when called (collection stays fast)."""
    return lambda: getattr(transformers, model_class)(getattr(transformers, config_class)(**COMMON, **config))


def _bart():
    sizes = {"encoder_layers": 2, "decoder_layers": 2, "encoder_ffn_dim": 48, "decoder_ffn_dim": 48}
    config = transformers.BartConfig(
        d_model=HIDDEN, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, vocab_size=VOCAB,
        max_position_embeddings=64, **sizes, **TOKENS,
    )  # fmt: skip
    return transformers.BartModel(config)


def _falcon(**config):
    sizes = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_hidden_layers": 2, "vocab_size": VOCAB}
    return transformers.FalconForCausalLM(transformers.FalconConfig(**sizes, bias=True, **TOKENS, **config))


WHISPER_FEATURES = (8, 16)  # mel bins, frames (2 * max_source_positions)


def _whisper():
    config = transformers.WhisperConfig(
        d_model=HIDDEN, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_layers=2,
        decoder_layers=2, encoder_ffn_dim=48, decoder_ffn_dim=48, num_mel_bins=WHISPER_FEATURES[0],
        max_source_positions=WHISPER_FEATURES[1] // 2, max_target_positions=64, vocab_size=VOCAB,
        decoder_start_token_id=0, **TOKENS,
    )  # fmt: skip
    return transformers.WhisperModel(config)


def _bert_like(prefix):
    config = getattr(transformers, f"{prefix}Config")(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=2, intermediate_size=48, vocab_size=VOCAB,
        max_position_embeddings=64,
    )  # fmt: skip
    return getattr(transformers, f"{prefix}Model")(config)


LFM3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "proportional", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
}
FAMILIES = [
    Family(
        "llama",
        _llama_like("LlamaForCausalLM", "LlamaConfig", **GQA),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "llama3_scaled",
        _llama_like(
            "LlamaForCausalLM",
            "LlamaConfig",
            **GQA,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "llama_linear",
        _llama_like(
            "LlamaForCausalLM",
            "LlamaConfig",
            **GQA,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "llama_yarn",
        _llama_like(
            "LlamaForCausalLM",
            "LlamaConfig",
            **GQA,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 256,  # the ramp of R = 8 spans pairs 0 to 2 (0, 0.5, 1, 1)
                "mscale": 1.0,
                "mscale_all_dim": 0.5,  # attention factor (0.1 ln 4 + 1) / (0.05 ln 4 + 1)
            },
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "phi_yarn",
        _llama_like(
            "PhiForCausalLM",
            "PhiConfig",
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            partial_rotary_factor=0.5,  # the attention factor scales the 4 rotated features of 8 only
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "attention_factor": 1.25,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
            },
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "mistral",
        _llama_like("MistralForCausalLM", "MistralConfig", **GQA, sliding_window=WINDOW),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "qwen2",
        _llama_like(
            "Qwen2ForCausalLM",
            "Qwen2Config",
            **GQA,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "qwen3",
        _llama_like("Qwen3ForCausalLM", "Qwen3Config", **GQA),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "gemma2",
        _llama_like(
            "Gemma2ForCausalLM",
            "Gemma2Config",
            **GQA,
            sliding_window=WINDOW,
            query_pre_attn_scalar=2,
            attn_logit_softcapping=1.0,
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "gemma3",
        _llama_like(
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            **GQA,
            sliding_window=WINDOW,
            query_pre_attn_scalar=4,
            sliding_window_pattern=2,
        ),
        "model.layers.{i}.self_attn",
    ),
    Family("gemma", _llama_like("GemmaForCausalLM", "GemmaConfig", **GQA), "model.layers.{i}.self_attn"),
    Family(
        "mixtral",
        _llama_like(
            "MixtralForCausalLM",
            "MixtralConfig",
            **GQA,
            sliding_window=WINDOW,
            num_local_experts=2,
            num_experts_per_tok=1,
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "starcoder2",
        _llama_like("Starcoder2ForCausalLM", "Starcoder2Config", **GQA, sliding_window=WINDOW),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "granite",
        _llama_like("GraniteForCausalLM", "GraniteConfig", **GQA, attention_multiplier=0.5),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "cohere",
        _llama_like(
            "CohereForCausalLM",
            "CohereConfig",
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "gpt2",
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_embd=HIDDEN,
                n_head=HEADS,
                n_layer=2,
                vocab_size=VOCAB,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
                scale_attn_by_inverse_layer_idx=True,  # layer i's scale is 1 / (sqrt(H) * (i + 1))
                reorder_and_upcast_attn=True,  # its other eager code path
            )
        ),
        "transformer.h.{i}.attn",
        rope=False,
    ),
    Family(
        "bert",
        lambda: transformers.BertModel(
            transformers.BertConfig(
                hidden_size=HIDDEN,
                num_attention_heads=HEADS,
                num_hidden_layers=2,
                intermediate_size=48,
                vocab_size=VOCAB,
                max_position_embeddings=64,
            )
        ),
        "encoder.layer.{i}.attention",
        output="output.dense",
        causal=False,
        rope=False,
        decode=False,
    ),
    Family(
        "olmo2",
        _llama_like("Olmo2ForCausalLM", "Olmo2Config", **GQA, eos_token_id=0),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "gpt_neox",
        _llama_like(
            "GPTNeoXForCausalLM",
            "GPTNeoXConfig",
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            rotary_pct=0.5,
        ),
        "gpt_neox.layers.{i}.attention",
    ),
    Family(
        "phi",
        _llama_like(
            "PhiForCausalLM",
            "PhiConfig",
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            partial_rotary_factor=0.5,
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "gptj",
        lambda: transformers.GPTJForCausalLM(
            transformers.GPTJConfig(
                n_embd=HIDDEN,
                n_head=HEADS,
                n_layer=2,
                rotary_dim=4,
                vocab_size=VOCAB,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        "transformer.h.{i}.attn",
    ),
    Family(
        "codegen",
        lambda: transformers.CodeGenForCausalLM(
            transformers.CodeGenConfig(
                n_embd=HIDDEN,
                n_head=HEADS,  # a multiple of the 4 shards of its fused projection
                n_layer=2,
                rotary_dim=4,
                vocab_size=VOCAB,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        "transformer.h.{i}.attn",
    ),
    Family(
        "gpt_oss",
        _llama_like(
            "GptOssForCausalLM",
            "GptOssConfig",
            **GQA,
            sliding_window=WINDOW,
            num_local_experts=2,
            num_experts_per_tok=1,
        ),  # its default rope_parameters: YaRN, factor 32, theta 150000, truncate False
        "model.layers.{i}.self_attn",
    ),
    Family(
        "t5_encoder",
        lambda: transformers.T5Model(
            transformers.T5Config(
                d_model=HIDDEN, d_kv=HEAD_DIM, num_heads=HEADS, num_layers=2, d_ff=48, vocab_size=VOCAB
            )
        ),
        "encoder.block.{i}.layer.0.SelfAttention",
        causal=False,
        rope=False,
        bias="t5",
        decode=False,
        seq2seq=True,
    ),
    Family(
        "t5_decoder",
        lambda: transformers.T5Model(
            transformers.T5Config(
                d_model=HIDDEN, d_kv=HEAD_DIM, num_heads=HEADS, num_layers=2, d_ff=48, vocab_size=VOCAB
            )
        ),
        "decoder.block.{i}.layer.0.SelfAttention",
        rope=False,
        bias="t5",
        seq2seq=True,
        prefix=True,
    ),
    Family(
        "bloom",
        lambda: transformers.BloomForCausalLM(
            transformers.BloomConfig(hidden_size=HIDDEN, n_head=HEADS, n_layer=2, vocab_size=VOCAB)
        ),
        "transformer.h.{i}.self_attention",
        output="dense",
        rope=False,
        bias="alibi",
    ),
]
FAMILIES += [
    Family("qwen3_moe", _llama_like("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **GQA, **MOE), "model.layers.{i}.self_attn"),
    Family(
        "qwen2_moe",
        _llama_like(
            "Qwen2MoeForCausalLM", "Qwen2MoeConfig", **GQA, **MOE, shared_expert_intermediate_size=16,
            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
        ),
        "model.layers.{i}.self_attn",
    ),
    Family("phi3", _llama_like("Phi3ForCausalLM", "Phi3Config", **GQA, **TOKENS, sliding_window=WINDOW),
           "model.layers.{i}.self_attn"),
    Family("olmo", _llama_like("OlmoForCausalLM", "OlmoConfig", **GQA, **TOKENS), "model.layers.{i}.self_attn"),
    Family(
        "olmo_clip_qkv",
        _llama_like("OlmoForCausalLM", "OlmoConfig", **GQA, **TOKENS, clip_qkv=CLIP_QKV),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "stablelm",
        _llama_like("StableLmForCausalLM", "StableLmConfig", **GQA, **TOKENS, use_qkv_bias=True),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "smollm3",
        _llama_like("SmolLM3ForCausalLM", "SmolLM3Config", **GQA, **TOKENS, no_rope_layers=[1, 0]),
        "model.layers.{i}.self_attn",
    ),
    Family("glm4", _llama_like("Glm4ForCausalLM", "Glm4Config", **GQA, **TOKENS), "model.layers.{i}.self_attn"),
    Family(
        "cohere2",
        _llama_like(
            "Cohere2ForCausalLM", "Cohere2Config", **GQA, **TOKENS, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "gpt_neo",
        lambda: transformers.GPTNeoForCausalLM(
            transformers.GPTNeoConfig(
                hidden_size=HIDDEN, num_heads=HEADS, num_layers=2, attention_types=[[["global", "local"], 1]],
                window_size=WINDOW, vocab_size=VOCAB, max_position_embeddings=64, **TOKENS,
            )
        ),
        "transformer.h.{i}.attn.attention",
        rope=False,
    ),
    Family(
        "gpt_bigcode",
        lambda: transformers.GPTBigCodeForCausalLM(
            transformers.GPTBigCodeConfig(n_embd=HIDDEN, n_head=HEADS, n_layer=2, vocab_size=VOCAB, n_positions=64,
                                          **TOKENS)
        ),
        "transformer.h.{i}.attn",
        rope=False,
    ),
    Family(
        "gpt_bigcode_mha",
        lambda: transformers.GPTBigCodeForCausalLM(
            transformers.GPTBigCodeConfig(n_embd=HIDDEN, n_head=HEADS, n_layer=2, vocab_size=VOCAB, n_positions=64,
                                          multi_query=False, **TOKENS)
        ),
        "transformer.h.{i}.attn",
        rope=False,
    ),
    Family(
        "opt",
        lambda: transformers.OPTForCausalLM(
            transformers.OPTConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=2, ffn_dim=48,
                                   vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=HIDDEN, **TOKENS)
        ),
        "model.decoder.layers.{i}.self_attn",
        rope=False,
    ),
    Family("bart_encoder", lambda: _bart(), "encoder.layers.{i}.self_attn", causal=False, rope=False, decode=False,
           seq2seq=True),
    Family("bart_decoder", lambda: _bart(), "decoder.layers.{i}.self_attn", rope=False, seq2seq=True, prefix=True),
    Family("falcon", lambda: _falcon(), "transformer.h.{i}.self_attention"),
    Family("falcon_grouped", lambda: _falcon(new_decoder_architecture=True, num_kv_heads=KV_HEADS),
           "transformer.h.{i}.self_attention"),
    Family("falcon_mha", lambda: _falcon(multi_query=False), "transformer.h.{i}.self_attention"),
    # transformers' eager Falcon adds ALiBi twice (in the module and in the mask it builds); its default sdpa
    # path adds it once, as the original Falcon code does, and the port follows that.
    Family("falcon_alibi", lambda: _falcon(alibi=True), "transformer.h.{i}.self_attention", rope=False,
           bias="scaled_alibi", implementation="sdpa"),
    Family(
        "mpt",
        lambda: transformers.MptForCausalLM(
            transformers.MptConfig(d_model=HIDDEN, n_heads=HEADS, n_layers=2, expansion_ratio=2, max_seq_len=64,
                                   vocab_size=VOCAB, **TOKENS)
        ),
        "transformer.blocks.{i}.attn",
        rope=False,
        bias="alibi",
    ),
    Family(
        "mpt_clip_qkv",
        lambda: transformers.MptForCausalLM(
            transformers.MptConfig(d_model=HIDDEN, n_heads=HEADS, n_layers=2, expansion_ratio=2, max_seq_len=64,
                                   vocab_size=VOCAB, attn_config={"clip_qkv": CLIP_QKV}, **TOKENS)
        ),
        "transformer.blocks.{i}.attn",
        rope=False,
        bias="alibi",
    ),
    Family(
        "modernbert",
        lambda: transformers.ModernBertModel(
            transformers.ModernBertConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=2,
                                          intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=64,
                                          global_attn_every_n_layers=2, local_attention=LOCAL_ATTENTION,
                                          attention_bias=True, **TOKENS)
        ),  # layer 0 global, layer 1 local
        "layers.{i}.attn",
        causal=False,
        decode=False,
        real_rows=True,
    ),
    Family(
        "llama4",
        _llama_like(
            "Llama4ForCausalLM", "Llama4TextConfig", **GQA, **TOKENS, num_local_experts=2, intermediate_size_mlp=48,
            no_rope_layers=[1, 0], attention_chunk_size=64, floor_scale=FLOOR,  # no layer chunks
            layer_types=["full_attention", "full_attention"],
        ),
        "model.layers.{i}.self_attn",
    ),
    Family("whisper_decoder", lambda: _whisper(), "decoder.layers.{i}.self_attn", rope=False, seq2seq=True,
           prefix=True),
    Family("roberta", lambda: _bert_like("Roberta"), "encoder.layer.{i}.attention", output="output.dense",
           causal=False, rope=False, decode=False),
    Family("xlm_roberta", lambda: _bert_like("XLMRoberta"), "encoder.layer.{i}.attention", output="output.dense",
           causal=False, rope=False, decode=False),
    Family(
        "stablelm_qk_layernorm",
        _llama_like("StableLmForCausalLM", "StableLmConfig", **GQA, **TOKENS, qk_layernorm=True,
                    use_parallel_residual=True),  # StableLM 2 12B's: a LayerNorm per head of q and k
        "model.layers.{i}.self_attn",
    ),
    Family(
        "phi_qk_layernorm",
        _llama_like("PhiForCausalLM", "PhiConfig", hidden_size=HIDDEN, num_attention_heads=HEADS,
                    partial_rotary_factor=0.5, qk_layernorm=True),  # one LayerNorm (H,) with a bias, shared
        "model.layers.{i}.self_attn",
    ),
    Family(
        "cohere_qk_norm",
        _llama_like("CohereForCausalLM", "CohereConfig", hidden_size=HIDDEN, num_attention_heads=HEADS,
                    num_key_value_heads=KV_HEADS, use_qk_norm=True),  # a LayerNorm of (heads, H), no bias
        "model.layers.{i}.self_attn",
    ),
    Family(
        "llama4_chunked",
        _llama_like(
            "Llama4ForCausalLM", "Llama4TextConfig", **GQA, **TOKENS, num_local_experts=2, intermediate_size_mlp=48,
            no_rope_layers=[1, 0], attention_chunk_size=CHUNK, floor_scale=FLOOR,
        ),  # layer 0 chunked (RoPE), layer 1 full (NoPE, its queries scaled by position)
        "model.layers.{i}.self_attn",
        prompts=CHUNK_PROMPT_LENGTHS,
    ),
    Family(
        "qwen2_vl",
        _llama_like("Qwen2VLTextModel", "Qwen2VLTextConfig", **GQA,
                    rope_parameters={"rope_type": "default", "rope_theta": MROPE_THETA, "mrope_section": MROPE_SECTION}),
        "layers.{i}.self_attn",
        mrope="text",
    ),
    Family(
        "qwen2_5_vl",
        _llama_like("Qwen2_5_VLTextModel", "Qwen2_5_VLTextConfig", **GQA,
                    rope_parameters={"rope_type": "default", "rope_theta": MROPE_THETA, "mrope_section": MROPE_SECTION}),
        "layers.{i}.self_attn",
        mrope="grid",
    ),
    # Gated attention: sigmoid(hidden @ W_g) times each head's result. The tiny hybrid models hold their full-
    # attention layers only (their linear-attention and convolution layers are refused by name, pinned below).
    Family(
        "qwen3_next",  # q_proj yields each head's query and gate; a (1 + weight) QK-norm; a quarter of H rotated
        _llama_like("Qwen3NextForCausalLM", "Qwen3NextConfig", **GQA, **MOE, shared_expert_intermediate_size=16,
                    layer_types=["full_attention"] * 2),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "qwen3_5",  # with attention_bias: q_proj's bias splits into the query's and the gate's
        _llama_like("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", **GQA, layer_types=["full_attention"] * 2,
                    attention_bias=True),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "qwen3_5_moe",
        _llama_like("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", **GQA, **MOE, shared_expert_intermediate_size=16,
                    layer_types=["full_attention"] * 2),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "afmoe",  # gate_proj (N*H, E); RoPE and the window on its sliding layers only
        _llama_like("AfmoeForCausalLM", "AfmoeConfig", **GQA, **MOE, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"]),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "lfm3",  # g_proj (N, E): one gate per head; its full-attention layer's RoPE proportional (half the pairs),
        # at a base of 100 (LFM3's is 1e6) so that the unturned pairs would turn visibly
        _llama_like("Lfm3ForCausalLM", "Lfm3Config", **GQA, **TOKENS, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"], rope_parameters=LFM3_ROPE),
        "model.layers.{i}.self_attn",
    ),
]  # fmt: skip
LATENT = {  # DeepSeek's multi-head latent attention at a tiny size, every layer dense (no MoE)
    "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "q_lora_rank": 16,
    "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 2,
}  # fmt: skip
SPARSE = {"index_topk": 4, "index_n_heads": 8, "index_head_dim": 8}  # DSA: k below the keys a row attends; 8 heads:
# few keys whose relu scores are all 0 (ties, which transformers' topk ranks in no set order)
LATENT_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
               "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}  # fmt: skip
# Mistral 4's default `llama_4_scaling_beta` with a floor the prompts pass (its default, 8192, leaves the scale 1)
MISTRAL4_SCALING = {"llama_4_scaling_beta": 0.1, "original_max_position_embeddings": FLOOR}
MISTRAL_LARGE4 = {  # LATENT without a q latent, every layer its own latent KV; layer 1 NoPE, "shared" (no indexer)
    **{name: value for name, value in LATENT.items() if name != "q_lora_rank"}, **SPARSE, **TOKENS,
    "mlp_layer_types": ["dense"] * 2, "indexer_types": ["full", "shared"], "no_rope_layers": [1, 0],
    "index_n_heads": 6, "index_head_dim": 4,  # every indexer feature turned (its pairing shows); inputs keep the margin
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                        "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0},  # its YaRN, the prompts past 16
}  # fmt: skip
MISTRAL_LARGE4_NOPE = {"no_rope_layers": [0, 1], "indexer_types": ["full", "full"]}  # its default: NoPE every 4th


def _mistral_large4_text():
    """Mistral Large 4's text model (it has no causal language model of its own)."""
    return transformers.MistralLarge4TextModel(transformers.MistralLarge4TextConfig(**COMMON, **MISTRAL_LARGE4))


def _mistral_large4_nope_text():
    """Mistral Large 4's text model with a NoPE layer (0) before a RoPE one (1), each with its own indexer."""
    config = {**COMMON, **MISTRAL_LARGE4, **MISTRAL_LARGE4_NOPE}
    return transformers.MistralLarge4TextModel(transformers.MistralLarge4TextConfig(**config))


def _mistral_large4_generation():
    """Mistral Large 4's model with a language-model head (and its vision tower, a tiny Pixtral, unused): a NoPE
    layer before a RoPE one, each with its own indexer as by default (`_mistral_large4_nope_text`). Not a "shared"
    layer after the NoPE one: a token repeated in the prompts gives the NoPE layer 0 the same indexer key twice, an
    exact tie that transformers' topk ranks in no set order, which a layer attending that selection would show."""
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14, "head_dim": 8}  # fmt: skip
    text = {**COMMON, **MISTRAL_LARGE4, **MISTRAL_LARGE4_NOPE}
    return transformers.MistralLarge4ForConditionalGeneration(
        transformers.MistralLarge4Config(text_config=text, vision_config=vision)
    )


MLA_FAMILIES = [  # run in the files that have MLA (`kv_lora_rank`)
    Family(
        "deepseek_v3", _llama_like("DeepseekV3ForCausalLM", "DeepseekV3Config", **LATENT), "model.layers.{i}.self_attn"
    ),
    Family(
        "deepseek_v3_yarn_no_q_lora",  # q_proj, YaRN's mscale in the scale, RoPE in halves
        _llama_like(
            "DeepseekV3ForCausalLM",
            "DeepseekV3Config",
            **{**LATENT, "q_lora_rank": None},
            rope_interleave=False,
            rope_parameters=LATENT_YARN,
            attention_bias=True,
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "deepseek_v2", _llama_like("DeepseekV2ForCausalLM", "DeepseekV2Config", **LATENT), "model.layers.{i}.self_attn"
    ),
    Family(
        "glm4_moe_lite",
        _llama_like(
            "Glm4MoeLiteForCausalLM",
            "Glm4MoeLiteConfig",
            **{**LATENT, "q_lora_rank": None},
            **TOKENS,
            mlp_layer_types=["dense"] * 2,
        ),
        "model.layers.{i}.self_attn",
    ),
    Family("youtu", _llama_like("YoutuForCausalLM", "YoutuConfig", **LATENT, **TOKENS), "model.layers.{i}.self_attn"),
    Family("axk1", _llama_like("AXK1ForCausalLM", "AXK1Config", **LATENT, **TOKENS), "model.layers.{i}.self_attn"),
    Family(  # YaRN with Mistral 4's partial_rotary_factor (Hr / (Hn + Hr)), q_proj, halves
        "mistral4",
        _llama_like(
            "Mistral4ForCausalLM",
            "Mistral4Config",
            **{**LATENT, "q_lora_rank": None},
            rope_interleave=False,
            rope_parameters={**LATENT_YARN, **MISTRAL4_SCALING, "partial_rotary_factor": 0.5},
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(
        "minicpm3",
        _llama_like("MiniCPM3ForCausalLM", "MiniCPM3Config", **LATENT, **TOKENS, scale_emb=1),
        "model.layers.{i}.self_attn",
    ),
    Family(  # NoPE latents
        "kimi_linear",
        _llama_like(
            "KimiLinearForCausalLM", "KimiLinearConfig", **LATENT, **TOKENS, layer_types=["full_attention"] * 2
        ),
        "model.layers.{i}.self_attn",
        rope=False,
    ),
    Family(  # the per-head output gate
        "bailing_hybrid",
        _llama_like(
            "BailingHybridForCausalLM", "BailingHybridConfig", **LATENT, **TOKENS, layer_types=["full_attention"] * 2
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(  # the sparse indexer, k = 4 of up to 10 keys: its RoPE in halves, MLA's interleaved
        "deepseek_v32",
        _llama_like("DeepseekV32ForCausalLM", "DeepseekV32Config", **LATENT, **SPARSE),
        "model.layers.{i}.self_attn",
    ),
    Family(  # the indexer's RoPE interleaved; layer 1 "shared": it attends layer 0's top-k (`topk_indices`)
        "glm_moe_dsa",
        _llama_like(
            "GlmMoeDsaForCausalLM",
            "GlmMoeDsaConfig",
            **LATENT,
            **SPARSE,
            **TOKENS,
            mlp_layer_types=["dense"] * 2,
            indexer_types=["full", "shared"],
        ),
        "model.layers.{i}.self_attn",
    ),
    Family(  # no q latent, learned log-position query scales, the indexer's query LayerNorm; layer 1 "shared" and NoPE
        "mistral_large4",
        _mistral_large4_text,
        "layers.{i}.self_attn",
    ),
    Family(  # its NoPE layer (0: queries and keys unturned, its indexer's too) before a RoPE one
        "mistral_large4_nope",
        _mistral_large4_nope_text,
        "layers.{i}.self_attn",
    ),
    Family(  # two attention sublayers per decoder layer (one decoder layer here), the LoRA scales
        "longcat_flash",
        _llama_like("LongcatFlashForCausalLM", "LongcatFlashConfig", **LATENT, **TOKENS, head_dim=4),
        "model.layers.0.self_attn.{i}",
        prefix=True,
    ),
]
FAMILIES += MLA_FAMILIES
FAMILIES_BY_NAME = {family.name: family for family in FAMILIES}
FAMILIES_BY_NAME["mistral_large4_generation"] = Family(  # its language model (a tiny Pixtral beside): generate
    "mistral_large4_generation", _mistral_large4_generation, "model.language_model.layers.{i}.self_attn"
)
LAYERS = (0, 1)  # every family alternates or repeats its layer types within two layers


def _redraw(model):
    """Redraws every parameter at a size where each variant shows: unit-scale projections, norm scales
    and biases away from 1 and 0, T5's relative bias and gpt-oss' sinks of order 1."""
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith(("relative_attention_bias.weight", "sinks")):
                parameter.copy_(noise)
            elif parameter.ndim >= 2:
                parameter.copy_(noise / HIDDEN**0.5)
            elif name.endswith("bias"):
                parameter.copy_(0.5 * noise)
            else:  # norm scales (Gemma's are 1 + weight)
                parameter.copy_(1.0 + 0.3 * noise)


@functools.cache
def _model(name):
    torch.manual_seed(SEED)
    model = FAMILIES_BY_NAME[name].build()
    implementation = FAMILIES_BY_NAME[name].implementation
    model.config._attn_implementation = implementation
    for config in (getattr(model.config, name, None) for name in ("text_config", "encoder", "decoder")):
        if config is not None:
            config._attn_implementation = implementation
    _redraw(model)
    return model.eval()


def _config(model):
    return getattr(model.config, "text_config", model.config)


# ----------------------------------------------------------------------------------------------
# Inputs, capture and the call arguments of interop.hf's docstring
# ----------------------------------------------------------------------------------------------


def _left_padded_mask(lengths, total):
    width = max(lengths)
    mask = np.zeros((len(lengths), total), dtype=np.int64)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    return mask


def _positions(mask):
    """What `generate` uses for left padding: cumsum(mask) - 1, 1 at the padding."""
    return np.where(mask == 1, np.cumsum(mask, axis=-1) - 1, 1)


def _family_positions(family, mask):
    """The family's `position_ids`: (B, L), or M-RoPE's (3, B, L): generate's rows for text (Qwen2-VL gives every
    section the text positions), or three rows that differ by more than a constant (as an image grid's do), so
    that each section turns by its own row."""
    positions = _positions(mask)  # (B, L)
    if family.mrope == "text":
        return np.stack([positions] * 3)  # (3, B, L)
    if family.mrope == "grid":
        return np.stack([positions, positions // 2, 3 * positions])  # (3, B, L)
    return positions


def _model_arguments(family, ids, mask, positions, prompt=None):
    """The model call on `ids`; T5 encodes `prompt` (ids, mask) (default: `ids`) and self-attends `ids` in its decoder."""
    arguments = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
    if family.rope or family.name == "gpt2":
        arguments["position_ids"] = torch.from_numpy(positions)
    if family.seq2seq:
        encoder_ids, encoder_mask = (ids, mask) if prompt is None else prompt
        encoder = {"input_ids": torch.from_numpy(encoder_ids), "attention_mask": torch.from_numpy(encoder_mask)}
        if family.name.startswith("whisper"):  # the encoder reads audio features
            features = np.random.default_rng(SEED).standard_normal((ids.shape[0], *WHISPER_FEATURES))
            encoder = {"input_features": torch.from_numpy(features.astype(np.float32))}
        arguments = encoder | {
            "decoder_input_ids": arguments["input_ids"],
            "decoder_attention_mask": arguments["attention_mask"],
        }
    return arguments


@contextlib.contextmanager
def _capture(model, family, index):
    """Records each call's hidden states into layer `index`'s attention module and its attention output."""
    module = family.module(model, index)
    calls = []

    def take_input(_, args, kwargs):
        calls.append({"hidden": (args[0] if args else kwargs["hidden_states"]).detach().numpy().copy()})
        if kwargs.get("prev_topk_indices") is not None:  # GLM-MoE-DSA: the previous layer's top-k
            calls[-1]["topk"] = kwargs["prev_topk_indices"].numpy().copy()

    def take_output(_, args, output):
        calls[-1]["output"] = (output[0] if isinstance(output, tuple) else output).detach().numpy().copy()

    handles = [module.register_forward_pre_hook(take_input, with_kwargs=True)]
    handles.append(
        (module.get_submodule(family.output) if family.output else module).register_forward_hook(take_output)
    )
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _call_arguments(runner, model, family, mask, positions, start, stop, kwargs, call=None):
    """The call arguments of interop.hf's docstring for the tokens [start, stop) of a (B, L) padding mask
    over the L keys (the cache's slots when decoding; L = T on a full pass); `kwargs` the port's (a NoPE
    layer, with no `rope_theta`, takes no positions; a sparse layer without its own indexer takes the previous
    layer's top-k the module was given as `topk_indices`)."""
    arguments = {"causal": family.causal, "key_mask": mask[:, start:stop].astype(bool)}
    if call is not None and "topk" in call and "index_topk" not in kwargs:
        arguments["topk_indices"] = call["topk"]
    if family.rope and "rope_theta" in kwargs:
        arguments["positions"] = positions[..., start:stop].astype(np.int64)
    if family.bias == "t5":
        arguments["attention_bias"] = t5_position_bias(family.module(model, 0), stop - start, mask.shape[1], start)
    if family.bias == "alibi":
        arguments["attention_bias"] = runner.alibi_bias(kwargs["num_heads"], alibi_positions(mask))  # (B, N, 1, L)
    if family.bias == "scaled_alibi":  # Falcon: the bias is scaled with the scores
        arguments["attention_bias"] = runner.alibi_bias(kwargs["num_heads"], alibi_positions(mask), kwargs["scale"])
    return arguments


def _full_pass(family, index):
    """The model run on left-padded prompts: the model, layer `index`'s module input/output, mask and positions."""
    calls, mask, positions = _full_passes(family)
    return _model(family.name), calls[index], mask, positions


@functools.cache
def _full_passes(family):
    """One run of the model captures every layer in LAYERS, once per process (every framework compares with it)."""
    model = _model(family.name)
    total = max(family.prompts)
    mask = _left_padded_mask(family.prompts, total)
    ids = np.random.default_rng(SEED).integers(1, VOCAB, size=mask.shape)
    positions = _family_positions(family, mask)
    with _capture_layers(model, family) as calls, torch.no_grad():
        model(**_model_arguments(family, ids, mask, positions))
    return {index: captured for index, (captured,) in calls.items()}, mask, positions


@contextlib.contextmanager
def _capture_layers(model, family):
    """`_capture` of every layer in LAYERS: {index: its calls}."""
    with contextlib.ExitStack() as stack:
        yield {index: stack.enter_context(_capture(model, family, index)) for index in LAYERS}


def _compared_rows(family, mask):
    """Causal models: real tokens only (transformers leaves padded query rows attending nothing useful); so
    ModernBERT, whose local band leaves padded queries far from the real tokens no key."""
    return mask.astype(bool) if family.causal or family.real_rows else np.ones(mask.shape, dtype=bool)


def _max_diff(ours, theirs, rows):
    return float(np.max(np.abs(ours.astype(np.float64) - theirs.astype(np.float64))[rows]))


# Exact clones and second layouts of a family that runs in every framework: their ports differ from it only in
# what the porter reads (the same arguments reach the layer), which the NumPy case checks.
NUMPY_ONLY = {"qwen2_moe", "qwen3_moe", "roberta", "xlm_roberta", "falcon_mha", "gpt_bigcode_mha", "qwen3_5_moe"}
CASES = [
    (framework, family.name, index)
    for framework in FRAMEWORKS
    for family in FAMILIES
    for index in LAYERS
    if framework == "NumPy" or family.name not in NUMPY_ONLY
    if family not in MLA_FAMILIES or _accepts_modern_kwargs(framework, "kv_lora_rank")
]
DECODE_CASES = [case for case in CASES if FAMILIES_BY_NAME[case[1]].decode]


def _case_id(case):
    return "-".join(str(part) for part in case)


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


PACKAGE_NAMES = {
    "gemma3",
    "xlm_roberta",
    "llama4",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_5",
    "qwen3_5_moe",
    "mistral_large4",  # its language model's config is `mistral_large4_text` (its head: mistral_large4_generation)
}  # where a transformers package's name is not its config's model type


def test_every_supported_model_type_has_a_family_here():
    """Every model type `interop.hf` reads is tested here, or (layers that share keys and values: a shared layer's
    call takes another layer's) in test_hf_sharing.py."""
    from shared_tests.test_hf_sharing import MODEL_TYPES

    tested = {_config(_model(family.name)).model_type for family in FAMILIES}
    assert set(supported_modules()) == tested | PACKAGE_NAMES | MODEL_TYPES


def _full_pass_port(runner, family, index):
    """Layer `index`'s port and its full-pass call: kwargs, weights, the capture and the call arguments."""
    model, call, mask, positions = _full_pass(family, index)
    kwargs, weights = port_attention(family.module(model, index), _config(model))
    arguments = _call_arguments(runner, model, family, mask, positions, 0, mask.shape[1], kwargs, call)
    return kwargs, weights, call, arguments


def _assert_full_pass(family, index, output):
    """The layer's output on the full pass equals the module's on the compared rows."""
    _, call, mask, _ = _full_pass(family, index)
    rows = _compared_rows(family, mask)
    assert np.max(np.abs(call["output"][rows])) > MEANINGFUL
    assert _max_diff(output, call["output"], rows) <= OUTPUT_TOL


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_full_pass_with_padding_matches_transformers(case):
    framework, name, index = case
    family, runner = FAMILIES_BY_NAME[name], _runner(framework)
    kwargs, weights, call, arguments = _full_pass_port(runner, family, index)
    output, _ = runner.call(runner.layer(kwargs, weights), call["hidden"], arguments)
    _assert_full_pass(family, index, output)


CROSS_ATTENTION = ["bart", "whisper"]


@functools.cache
def _seq2seq_pass(name, attention):
    """A padded batch through a seq2seq model: each layer's call of the module at `attention` (with {i}):
    (query states, key states, output), the key states' padding mask (all frames real for Whisper's
    encoder) and the model."""
    family = FAMILIES_BY_NAME[f"{name}_decoder"]
    model = _model(family.name)
    mask = _left_padded_mask(PROMPT_LENGTHS, max(PROMPT_LENGTHS))
    ids = np.random.default_rng(SEED).integers(1, VOCAB, size=mask.shape)
    calls = {}
    handles = []
    for index in LAYERS:

        def take(_, args, kwargs, output, index=index):
            hidden = args[0] if args else kwargs["hidden_states"]
            states = kwargs.get("key_value_states")
            states = hidden if states is None else states
            calls[index] = [t.detach().numpy().copy() for t in (hidden, states, output[0])]

        module = model.get_submodule(attention.format(i=index))
        handles.append(module.register_forward_hook(take, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**_model_arguments(family, ids, mask, _positions(mask)))
    finally:
        for handle in handles:
            handle.remove()
    key_mask = mask if name == "bart" else np.ones(calls[LAYERS[0]][1].shape[:2], dtype=mask.dtype)
    return model, calls, key_mask


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", CROSS_ATTENTION)
@pytest.mark.parametrize("index", LAYERS)
def test_cross_attention_matches_transformers(framework, name, index):
    """BART's and Whisper's `encoder_attn`: `layer(decoder_states, encoder_states, encoder_states,
    key_mask=encoder_mask)`, every decoder row (cross-attention has no causal mask)."""
    _assert_seq2seq_module_ported(framework, name, "decoder.layers.{i}.encoder_attn", index)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("index", LAYERS)
def test_whisper_encoder_self_attention_matches_transformers(framework, index):
    """Whisper's encoder (its module class is the decoder's): `layer(frames)`, every frame attended."""
    _assert_seq2seq_module_ported(framework, "whisper", "encoder.layers.{i}.self_attn", index)


def _seq2seq_port(name, attention, index):
    """Layer `index`'s port of the seq2seq module at `attention`: kwargs, weights, the call's (query states,
    key states) and the key states' padding mask."""
    model, calls, key_mask = _seq2seq_pass(name, attention)
    hidden, states, _ = calls[index]
    kwargs, weights = port_attention(model.get_submodule(attention.format(i=index)), _config(model))
    return kwargs, weights, (hidden, states), key_mask > 0


def _assert_seq2seq_output(name, attention, index, output):
    """The layer's output equals the seq2seq module's, every row."""
    _, calls, _ = _seq2seq_pass(name, attention)
    expected = calls[index][2]
    assert np.max(np.abs(expected)) > MEANINGFUL
    assert _max_diff(np.asarray(output), expected, np.ones(expected.shape[:2], dtype=bool)) <= OUTPUT_TOL


def _assert_seq2seq_module_ported(framework, name, attention, index):
    runner = _runner(framework)
    kwargs, weights, (hidden, states), key_mask = _seq2seq_port(name, attention, index)
    layer = runner.layer(kwargs, weights)
    with torch.no_grad():
        output = layer(*(runner.tensor(x) for x in (hidden, states, states)), key_mask=runner.tensor(key_mask))
    _assert_seq2seq_output(name, attention, index, output)


def _decode_with_transformers(model, family, ids, mask, positions, prompt):
    """Prefill the prompt, then one token a step, with transformers' DynamicCache; returns each call's capture
    for each layer in LAYERS."""
    cache = transformers.DynamicCache(config=_config(model))
    if family.seq2seq:
        cache = transformers.EncoderDecoderCache(cache, transformers.DynamicCache(config=_config(model)))
    encoder = (ids[:, :prompt], mask[:, :prompt])
    with _capture_layers(model, family) as calls, torch.no_grad():
        for start, stop in [(0, prompt), *((p, p + 1) for p in range(prompt, mask.shape[1]))]:
            arguments = _model_arguments(
                family, ids[:, start:stop], mask[:, :stop], positions[..., start:stop], encoder
            )
            model(**arguments, past_key_values=cache, use_cache=True)
    return calls


@functools.cache
def _transformers_decoding(family):
    """transformers decoding left-padded prompts (once per process): {layer: each call's capture}, mask, positions."""
    prompt = max(family.prompts)
    mask = _left_padded_mask(family.prompts, prompt + DECODE_STEPS)
    mask[:, prompt:] = 1
    ids = np.random.default_rng(SEED).integers(1, VOCAB, size=mask.shape)
    positions = _family_positions(family, mask)
    return _decode_with_transformers(_model(family.name), family, ids, mask, positions, prompt), mask, positions


def _decode_port(runner, family, index):
    """Layer `index`'s port and its decode calls: kwargs, weights, the (B, L) mask over the cache's slots and,
    per call of transformers' decoding (the prompt, then one token a step), (start, stop, capture, arguments)."""
    model = _model(family.name)
    calls, mask, positions = _transformers_decoding(family)
    kwargs, weights = port_attention(family.module(model, index), _config(model))
    steps, start = [], 0
    for call in calls[index]:
        stop = start + call["hidden"].shape[1]
        arguments = _call_arguments(runner, model, family, mask, positions, start, stop, kwargs, call)
        steps.append((start, stop, call, arguments))
        start = stop
    return kwargs, weights, mask, steps


def _assert_decode_step(mask, start, stop, call, output):
    """One decode call's output equals transformers' on the real tokens [start, stop)."""
    rows = mask[:, start:stop].astype(bool)
    assert np.max(np.abs(call["output"][rows])) > MEANINGFUL
    assert _max_diff(output, call["output"], rows) <= OUTPUT_TOL, f"tokens [{start}, {stop})"


@pytest.mark.parametrize("case", DECODE_CASES, ids=_case_id)
def test_decoding_left_padded_prompts_matches_transformers_cache(case):
    framework, name, index = case
    family, runner = FAMILIES_BY_NAME[name], _runner(framework)
    kwargs, weights, mask, steps = _decode_port(runner, family, index)
    layer = runner.layer(kwargs, weights)
    cache = layer.init_cache(*mask.shape)
    for start, stop, call, arguments in steps:
        output, cache = runner.call(layer, call["hidden"], arguments, cache)
        _assert_decode_step(mask, start, stop, call, output)


# ----------------------------------------------------------------------------------------------
# The Keras file, in a process per backend
# ----------------------------------------------------------------------------------------------


KERAS_EVERY_FAMILY = "torch"  # runs every family: the cheapest (CPU for all: torch 11 s, TensorFlow 16 s, JAX 30 s)
KERAS_SPREAD = (  # on every backend too: plain, soft-capping and a window, a gate, MLA, sinks, ALiBi
    "llama", "gemma2", "qwen3_next", "deepseek_v3", "gpt_oss", "bloom",
)  # fmt: skip
KERAS_CASES = [
    (f"Keras:{backend}", family.name, index)
    for backend in KERAS_BACKENDS
    for family in FAMILIES
    for index in LAYERS
    if backend == KERAS_EVERY_FAMILY or family.name in KERAS_SPREAD
]
KERAS_DECODE_CASES = [case for case in KERAS_CASES if FAMILIES_BY_NAME[case[1]].decode]
KERAS_SEQ2SEQ_CASES = [  # (backend, name, attention, index): cross-attention, and Whisper's encoder on one backend
    (f"Keras:{backend}", name, attention, index)
    for backend in KERAS_BACKENDS
    for name, attention in [
        ("bart", "decoder.layers.{i}.encoder_attn"),
        ("whisper", "decoder.layers.{i}.encoder_attn"),
        ("whisper", "encoder.layers.{i}.self_attn"),
    ]
    for index in LAYERS
    if backend == KERAS_EVERY_FAMILY or name == "bart"
]


class _InKerasProcess:
    """Stands in for a runner where the Keras file's process computes a call argument (the ALiBi bias)."""

    @staticmethod
    def alibi_bias(num_heads, positions, scale=1.0):
        return keras_ports.AlibiBias(num_heads, positions, scale)


def _keras_jobs(framework):
    """{job name: `keras_ports.Job`} of every Keras case on this framework ("Keras:<backend>")."""
    runner, jobs, only = _InKerasProcess(), {}, (lambda cases: [case[1:] for case in cases if case[0] == framework])
    for name, index in only(KERAS_CASES):
        kwargs, weights, call, arguments = _full_pass_port(runner, FAMILIES_BY_NAME[name], index)
        jobs["full", name, index] = keras_ports.Job(kwargs, weights, (keras_ports.Call((call["hidden"],), arguments),))
    for name, index in only(KERAS_DECODE_CASES):
        kwargs, weights, mask, steps = _decode_port(runner, FAMILIES_BY_NAME[name], index)
        calls = tuple(keras_ports.Call((call["hidden"],), arguments) for _, _, call, arguments in steps)
        jobs["decode", name, index] = keras_ports.Job(kwargs, weights, calls, cache=mask.shape)
    for name, attention, index in only(KERAS_SEQ2SEQ_CASES):
        kwargs, weights, (hidden, states), key_mask = _seq2seq_port(name, attention, index)
        call = keras_ports.Call((hidden, states, states), {"key_mask": key_mask})
        jobs[name, attention, index] = keras_ports.Job(kwargs, weights, (call,))
    return jobs


@pytest.fixture(scope="module")
def keras_outputs(tmp_path_factory):
    """`keras_outputs(framework, job name)`: the job's outputs, one per call. Each backend's process runs
    every job of its cases once, when a test first asks, for all of pytest-xdist's workers (their common
    temporary folder: `make test` spreads a backend's tests over two)."""
    folder = tmp_path_factory.getbasetemp()
    folder = folder.parent if os.environ.get("PYTEST_XDIST_WORKER") else folder
    outputs = {}

    def get(framework, name):
        if framework not in outputs:
            backend = framework.split(":")[1]
            outputs[framework] = keras_ports.run_shared(backend, lambda: _keras_jobs(framework), folder)
        result = outputs[framework][name]
        if isinstance(result, str):
            raise KerasBackendError(result)
        return result

    return get


@pytest.mark.parametrize("case", KERAS_CASES, ids=_case_id)
def test_keras_full_pass_with_padding_matches_transformers(case, keras_outputs):
    framework, name, index = case
    (output,) = keras_outputs(framework, ("full", name, index))
    _assert_full_pass(FAMILIES_BY_NAME[name], index, output)


@pytest.mark.parametrize("case", KERAS_DECODE_CASES, ids=_case_id)
def test_keras_decoding_left_padded_prompts_matches_transformers_cache(case, keras_outputs):
    framework, name, index = case
    outputs = keras_outputs(framework, ("decode", name, index))
    _, _, mask, steps = _decode_port(_InKerasProcess(), FAMILIES_BY_NAME[name], index)
    assert len(outputs) == len(steps)
    for (start, stop, call, _), output in zip(steps, outputs, strict=True):
        _assert_decode_step(mask, start, stop, call, output)


@pytest.mark.parametrize("case", KERAS_SEQ2SEQ_CASES, ids=_case_id)
def test_keras_cross_attention_and_whisper_encoder_match_transformers(case, keras_outputs):
    """BART's and Whisper's `encoder_attn` (every backend for BART's) and Whisper's encoder self-attention."""
    framework, name, attention, index = case
    (output,) = keras_outputs(framework, (name, attention, index))
    _assert_seq2seq_output(name, attention, index, output)


def test_keras_ports_run_once_for_the_workers_that_share_a_folder(tmp_path, monkeypatch):
    """`make test`'s two workers each ask for a backend's outputs: its process runs once, the other waits."""
    runs = []

    def run(backend, jobs, folder):
        runs.append(backend)
        time.sleep(0.1)  # long enough for the other threads to ask meanwhile
        return {"job": jobs}

    monkeypatch.setattr(keras_ports, "run", run)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(lambda _: keras_ports.run_shared("torch", lambda: ["outputs"], tmp_path), range(4)))
    assert runs == ["torch"]
    assert outputs == [{"job": ["outputs"]}] * 4


def _chunk_keep(query_positions, key_positions, size):
    """interop.hf's chunk mask for left-padded rows: (B, T, S), True where query and key share a chunk of
    positions (transformers counts a row's chunks from its first real token)."""
    return key_positions[:, None, :] // size == query_positions[:, :, None] // size


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_chunks_of_rows_padded_otherwise_take_the_documented_mask(framework):
    """Left padding of 2 and 5 tokens (not multiples of C = 3): `attention_chunk_size` counts chunks from the
    first slot, transformers from each row's first real token, so the port's chunks differ there; the layer
    without `attention_chunk_size` and with interop.hf's position chunk mask gives transformers' output."""
    family = dataclasses.replace(FAMILIES_BY_NAME["llama4_chunked"], prompts=PROMPT_LENGTHS)
    runner = _runner(framework)
    model, call, mask, positions = _full_pass(family, 0)
    kwargs, weights = port_attention(family.module(model, 0), _config(model))
    arguments = _call_arguments(runner, model, family, mask, positions, 0, mask.shape[1], kwargs)
    rows = _compared_rows(family, mask)
    chunked, _ = runner.call(runner.layer(kwargs, weights), call["hidden"], arguments)
    assert _max_diff(chunked, call["output"], rows) > DIFFERS  # the padded rows' chunks are not transformers'
    kwargs = {**kwargs, "attention_chunk_size": None}
    arguments["attention_mask"] = _chunk_keep(positions, positions, CHUNK)
    output, _ = runner.call(runner.layer(kwargs, weights), call["hidden"], arguments)
    assert np.max(np.abs(call["output"][rows])) > MEANINGFUL
    assert _max_diff(output, call["output"], rows) <= OUTPUT_TOL


@pytest.mark.parametrize(
    "name", ["deepseek_v32", "glm_moe_dsa", "mistral_large4", "mistral_large4_nope"] if "NumPy" in FRAMEWORKS else []
)
def test_sparse_ports_rank_with_a_margin(name):
    """The indexer families' inputs keep INDEX_MARGIN (docs/SPEC.md "Sparse indexer (DSA)", Rounding) at every
    ranking of their full passes and decoding, in the NumPy reference: the selection cannot flip between it,
    transformers' float32 topk and the other files; and the selection matters (k is below the keys of some row)."""
    family, runner = FAMILIES_BY_NAME[name], _runner("NumPy")
    kwargs, weights, call, arguments = _full_pass_port(runner, family, 0)
    layer = runner.layer(kwargs, weights)
    rankings = index_rankings(None, None, lambda *_: runner.call(layer, call["hidden"], arguments))
    kwargs, weights, mask, steps = _decode_port(runner, family, 0)
    layer = runner.layer(kwargs, weights)

    def decode(*_):
        cache = layer.init_cache(*mask.shape)
        for _, _, step, step_arguments in steps:
            _, cache = runner.call(layer, step["hidden"], step_arguments, cache)

    rankings += index_rankings(None, None, decode)
    assert min(index_margin(*ranking) for ranking in rankings) >= INDEX_MARGIN
    assert any((allowed.sum(-1) > k).any() for _, allowed, k in rankings)


@pytest.mark.parametrize("framework", [name for name in ("NumPy", "PyTorch") if name in FRAMEWORKS])
def test_mistral_large4_nope_indexer_selects_as_transformers(framework):
    """A NoPE layer's indexer ported with its zero rotary part (`interop/hf/sparse.py` `_nope_indexer`: its added
    key features at the others' mean and every feature times c before the LayerNorm, the score scale restored)
    selects transformers' keys: each real row's top-k of its allowed keys is the module's `indexer`'s, on the full
    pass with left padding, and the selection matters (some row allows more than k keys)."""
    family, runner = FAMILIES_BY_NAME["mistral_large4_nope"], _runner(framework)
    kwargs, weights, call, arguments = _full_pass_port(runner, family, 0)
    model, _, mask, positions = _full_pass(family, 0)
    ids = np.random.default_rng(SEED).integers(1, VOCAB, size=mask.shape)
    theirs = []
    hook = model.layers[0].self_attn.indexer.register_forward_hook(lambda *hooked: theirs.append(hooked[2].numpy()))
    with torch.no_grad():
        model(**_model_arguments(family, ids, mask, positions))
    hook.remove()
    arguments = {name: runner.tensor(v) if isinstance(v, np.ndarray) else v for name, v in arguments.items()}
    with torch.no_grad():
        _, ours = runner.layer(kwargs, weights)(runner.tensor(call["hidden"]), **arguments, return_topk=True)
    ours, k = np.asarray(ours), kwargs["index_topk"]
    allowed = np.cumsum(mask, axis=1)  # (B, T): the real keys up to each query
    assert (allowed[mask.astype(bool)] > k).any()
    for b, t in zip(*np.nonzero(mask), strict=True):
        m = min(k, allowed[b, t])
        assert set(ours[b, t, :m]) == set(theirs[0][b, t, :m]), (b, t)


# What each family's port carries beyond plain attention; `test_every_ported_variant_matters` removes
# each one in turn and requires the output to move, so the comparisons above cannot pass without it.
# (`positions` is not among them: a left-padded row's positions are its plain ones shifted by a
# constant, which RoPE, relative by construction, does not see in the scores.)
VARIANTS = {
    "deepseek_v3": {"rope", "rope_interleaved"},
    "deepseek_v3_yarn_no_q_lora": {"rope", "rope_scaling", "scale"},
    "deepseek_v2": {"rope", "rope_interleaved"},
    "glm4_moe_lite": {"rope", "rope_interleaved"},
    "youtu": {"rope", "rope_interleaved"},
    "axk1": {"rope", "rope_interleaved"},
    "mistral4": {"rope", "rope_scaling", "scale", "query_scaling"},
    "minicpm3": {"rope"},
    "kimi_linear": set(),
    "bailing_hybrid": {"rope", "rope_interleaved", "gate"},
    "longcat_flash": {"rope", "rope_interleaved"},
    "deepseek_v32": {"rope", "rope_interleaved", "index_topk"},
    "glm_moe_dsa": {"rope", "rope_interleaved", "index_topk", "index_rope_interleaved", "topk_indices"},
    "mistral_large4": {
        "rope",
        "rope_interleaved",
        "rope_scaling",
        "query_scaling",
        "index_topk",
        "index_rope_interleaved",
        "topk_indices",
        "scale",
    },
    "mistral_large4_nope": {  # its NoPE layer's `scale` is transformers' 1/sqrt(Hn + Hr), not the padded width's
        "rope",
        "rope_interleaved",
        "rope_scaling",
        "query_scaling",
        "index_topk",
        "index_rope_interleaved",
        "scale",
    },
    "llama": {"rope"},
    "llama3_scaled": {"rope", "rope_scaling"},
    "llama_linear": {"rope", "rope_scaling"},
    "llama_yarn": {"rope", "rope_scaling"},
    "phi_yarn": {"rope", "rope_fraction", "rope_scaling"},
    "mistral": {"rope", "window"},
    "qwen2": {"rope", "window"},
    "qwen3": {"rope", "qk_norm"},
    "gemma2": {"rope", "window", "softcap", "scale"},
    "gemma3": {"rope", "window", "qk_norm", "scale"},
    "gemma": {"rope"},
    "mixtral": {"rope", "window"},
    "starcoder2": {"rope", "window"},
    "granite": {"rope", "scale"},
    "cohere": {"rope", "rope_interleaved"},
    "gpt2": {"scale"},
    "bert": set(),
    "olmo2": {"rope", "qk_norm"},
    "gpt_neox": {"rope", "rope_fraction"},
    "phi": {"rope", "rope_fraction"},
    "gptj": {"rope", "rope_fraction", "rope_interleaved"},
    "codegen": {"rope", "rope_fraction", "rope_interleaved"},
    "gpt_oss": {"rope", "window", "sinks", "rope_scaling"},
    "t5_encoder": {"scale", "attention_bias"},
    "t5_decoder": {"scale", "attention_bias"},
    "bloom": {"attention_bias"},
    "qwen3_moe": {"rope", "qk_norm"},
    "qwen2_moe": {"rope", "window"},
    "phi3": {"rope", "window"},
    "olmo": {"rope"},
    "olmo_clip_qkv": {"rope", "clip_qkv"},
    "stablelm": {"rope", "rope_fraction"},
    "smollm3": {"rope"},
    "glm4": {"rope", "rope_fraction", "rope_interleaved"},
    "cohere2": {"rope", "rope_interleaved", "window"},
    "gpt_neo": {"scale", "window"},
    "gpt_bigcode": set(),
    "gpt_bigcode_mha": set(),
    "opt": set(),
    "bart_encoder": set(),
    "bart_decoder": set(),
    "roberta": set(),
    "falcon": {"rope"},
    "falcon_grouped": {"rope"},
    "falcon_mha": {"rope"},
    "falcon_alibi": {"attention_bias"},
    "mpt": {"attention_bias"},
    "mpt_clip_qkv": {"attention_bias", "clip_qkv"},
    "modernbert": {"rope", "window"},
    "whisper_decoder": set(),
    "llama4": {"rope", "rope_interleaved", "qk_norm", "query_scaling"},
    "xlm_roberta": set(),
    "stablelm_qk_layernorm": {"rope", "rope_fraction", "qk_norm", "qk_norm_type"},
    "phi_qk_layernorm": {"rope", "rope_fraction", "qk_norm", "qk_norm_type", "qk_norm_bias"},
    "cohere_qk_norm": {"rope", "rope_interleaved", "qk_norm", "qk_norm_type"},
    "llama4_chunked": {"rope", "rope_interleaved", "qk_norm", "attention_chunk_size", "query_scaling"},
    "qwen2_vl": {"rope"},  # one row of positions thrice: the sections turn alike (plain RoPE)
    "qwen2_5_vl": {"rope", "rope_sections"},
    "qwen3_next": {"rope", "rope_fraction", "qk_norm", "gate"},
    "qwen3_5": {"rope", "rope_fraction", "qk_norm", "gate"},
    "qwen3_5_moe": {"rope", "rope_fraction", "qk_norm", "gate"},
    "afmoe": {"rope", "window", "qk_norm", "gate"},
    "lfm3": {"rope", "window", "qk_norm", "gate", "rope_scaling"},
}
DIFFERS = 1e-3  # a removed variant must move the output by 100 times the tolerance at least


# The arguments and weights that go with a removed variant.
WITH_THE_VARIANT = {
    "qk_norm": ("qk_norm_eps", "qk_norm_type", "qk_norm_bias", "query_norm", "key_norm", "query_norm_bias",
                "key_norm_bias"),
    "qk_norm_bias": ("query_norm_bias", "key_norm_bias"),
    "sinks": ("sinks",),
    "gate": ("gate_kernel", "gate_bias"),
    "index_topk": ("index_num_heads", "index_head_dim", "index_rope_interleaved", "index_query_kernel",
                   "index_key_kernel", "index_key_norm", "index_key_norm_bias", "index_weights_kernel",
                   "index_query_input_norm", "index_query_norm", "index_query_norm_bias",
                   "index_query_scaling_scale", "index_query_scaling_bias"),
    "query_scaling": ("query_scaling_scale", "query_scaling_bias", "index_query_scaling_scale",
                      "index_query_scaling_bias"),
}  # fmt: skip


def _without(variant, kwargs, weights, arguments):
    """The port with one variant removed (the layer's default in its place)."""
    kwargs, weights, arguments = dict(kwargs), dict(weights), dict(arguments)
    if variant == "rope":
        for name in ("rope_theta", "rope_fraction", "rope_interleaved", "rope_scaling", "rope_sections"):
            kwargs.pop(name, None)
        arguments.pop("positions")
    elif variant == "rope_sections":  # plain RoPE by the first row
        kwargs.pop(variant)
        arguments["positions"] = arguments["positions"][0]
    elif variant == "scale":
        kwargs["scale"] = _head_width(kwargs) ** -0.5
    elif variant in ("attention_bias", "topk_indices"):
        arguments.pop(variant)
    else:
        kwargs.pop(variant)
        for name in WITH_THE_VARIANT.get(variant, ()):
            kwargs.pop(name, None)
            weights.pop(name, None)
    return kwargs, weights, arguments


def _variants(kwargs, arguments):
    present = {
        name
        for name in (
            "window",
            "attention_chunk_size",
            "softcap",
            "rope_scaling",
            "rope_fraction",
            "rope_interleaved",
            "rope_sections",
            "qk_norm",
            "qk_norm_type",
            "qk_norm_bias",
            "sinks",
            "clip_qkv",
            "gate",
            "query_scaling",
            "index_topk",
        )
        if name in kwargs
    }
    present |= {"index_rope_interleaved"} if kwargs.get("index_rope_interleaved") else set()
    present |= {"topk_indices"} if "topk_indices" in arguments else set()
    present |= {"rope"} if "rope_theta" in kwargs else set()
    present |= {"attention_bias"} if "attention_bias" in arguments else set()
    if "rope_sections" in kwargs and np.all(arguments["positions"] == arguments["positions"][:1]):
        present.discard("rope_sections")  # rows alike: the sections turn as plain RoPE does, with or without them
    return present | ({"scale"} if not np.isclose(kwargs["scale"], _head_width(kwargs) ** -0.5) else set())


def _head_width(kwargs):
    """The width H whose 1/sqrt(H) is the layer's default scale: `head_dim`, Hn + Hr with MLA, else E / N."""
    latent = kwargs.get("qk_nope_head_dim", 0) + kwargs.get("qk_rope_head_dim", 0)
    return kwargs.get("head_dim") or latent or kwargs["d_model"] // kwargs["num_heads"]


@pytest.mark.parametrize("name", [family.name for family in FAMILIES] if "NumPy" in FRAMEWORKS else [])
def test_every_ported_variant_matters(name):
    family, runner = FAMILIES_BY_NAME[name], _runner("NumPy")
    moved = {}
    for index in LAYERS:
        model, call, mask, positions = _full_pass(family, index)
        kwargs, weights = port_attention(family.module(model, index), _config(model))
        arguments = _call_arguments(runner, model, family, mask, positions, 0, mask.shape[1], kwargs, call)
        for variant in _variants(kwargs, arguments):
            kwargs_, weights_, arguments_ = _without(variant, kwargs, weights, arguments)
            output, _ = runner.call(runner.layer(kwargs_, weights_), call["hidden"], arguments_)
            moved[variant] = max(
                moved.get(variant, 0.0), _max_diff(output, call["output"], _compared_rows(family, mask))
            )
    assert set(moved) == VARIANTS[name]
    assert all(diff > DIFFERS for diff in moved.values()), moved


@functools.cache
def _clamped_llama_attention():
    """A subclass that computes otherwise: it clamps the hidden states first (defined when first used, so that
    collecting the tests imports no modeling code)."""

    class _ClampedLlamaAttention(transformers.models.llama.modeling_llama.LlamaAttention):
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states.clamp(-0.1, 0.1), *args, **kwargs)

    return _ClampedLlamaAttention


class _ScaledLinear(torch.nn.Linear):
    """A projection class of the user's (as LoRA or quantization wrappers are): it doubles its output."""

    def forward(self, x):
        return 2 * super().forward(x)


def _with_custom_projection():
    module = _tiny_module(transformers.models.llama.modeling_llama.LlamaAttention, transformers.LlamaConfig, **GQA)
    module.q_proj = _ScaledLinear(HIDDEN, HEADS * HEAD_DIM, bias=False)
    return module


def _tiny_module(module_class, config_class, **config):
    return module_class(config_class(**COMMON, **config), layer_idx=0)


ERROR_CASES = [
    (
        "dynamic_rope",
        lambda: _tiny_module(
            transformers.models.llama.modeling_llama.LlamaAttention,
            transformers.LlamaConfig,
            **GQA,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
        ),
        r"`config.rope_parameters` must have rope_type 'default', 'linear', 'llama3', 'yarn' or 'proportional' .* "
        r"Received: rope_parameters=.*'dynamic'",
    ),
    (
        "bert_self_attention",
        lambda: transformers.models.bert.modeling_bert.BertSelfAttention(
            transformers.BertConfig(hidden_size=HIDDEN, num_attention_heads=HEADS)
        ),
        r"Pass the `BertAttention` module .* Received: a module holding key.bias, key.weight",
    ),
    (
        "gpt2_cross_attention",
        lambda: transformers.models.gpt2.modeling_gpt2.GPT2Attention(
            transformers.GPT2Config(n_embd=HIDDEN, n_head=HEADS), is_cross_attention=True, layer_idx=0
        ),
        r"`module` must be a GPT-2 self-attention .* Received: a module with `q_attn`",
    ),
    (
        "unknown_module",
        lambda: torch.nn.MultiheadAttention(HIDDEN, HEADS),
        r"`module` must be a transformers attention module of one of the model types .* Received: MultiheadAttention",
    ),
    (
        "subclass_overriding_forward",
        lambda: _clamped_llama_attention()(transformers.LlamaConfig(**COMMON, **GQA), layer_idx=0),
        r"`module` must compute what its transformers class computes: _ClampedLlamaAttention overrides `forward`",
    ),
    (
        "replaced_projection",
        lambda: _with_custom_projection(),
        r"`module`'s projections must be torch or transformers modules .* Received: `q_proj` is _ScaledLinear",
    ),
]


INDEXED = {"index_head_dim": 8, "index_n_heads": 2, "index_topk": 16}  # GLM-5-Next's index_kpool is 16
NOPE_INDEXED = {"glm5_next": {"qk_nope_head_dim": 8, "qk_rope_head_dim": 0}}  # GLM-5-Next's DSA layers are NoPE
QWEN4_INDEXER = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
                 "indexer_compress_ratio": 1}  # fmt: skip
BEYOND = "beyond DeepSeek-V3.2's indexer: "
REFUSED_SPARSE = [  # the families built on the sparse indexer that add more: module and config (None: the
    # checkpoint route only), and what they add
    ("glm5_next", "Glm5NextTextAttention", "Glm5NextTextConfig", r"linear-attention layers .*`index_kpool`"),
    ("hy_v4", "HYV4Attention", "HYV4Config", r"a per-head output gate and attention sinks on MLA with its RoPE"),
    ("axk2", "AXK2Attention", "AXK2Config", r"a query and output gate projected from both the normalized and the raw"),
    ("dots3_note", "Dots3NoteTextAttention", "Dots3NoteTextConfig",
     r"an RMSNorm on the shared rotary key \(`k_rope_only_layernorm`\)"),
    ("qwen4_exp", "Qwen4ExpTextAttention", "Qwen4ExpTextConfig", r"an indexer that scores blocks of keys"),
    ("deepseek_v4", None, None, r"compressed keys \(its CSA and HCA compressors"),
    ("minimax_m3_vl", None, None, r"an indexer that keeps blocks of `index_block_size` keys"),
]  # fmt: skip


@pytest.mark.parametrize(("model_type", "module_class", "config_class", "adds"), REFUSED_SPARSE,
                         ids=[row[0] for row in REFUSED_SPARSE])  # fmt: skip
def test_sparse_indexer_families_adding_more_are_refused_with_what_they_add(model_type, module_class, config_class,
                                                                            adds):  # fmt: skip
    """Each family of the issue's list beyond DeepSeek-V3.2, GLM-MoE-DSA and Mistral Large 4: refused by name, from a module (where
    its tiny module builds) and from a checkpoint's config, with what its attention adds."""
    reason = rf"must hold an attention the layer computes: .*{BEYOND}{adds}.*, which the layer cannot"
    if module_class is not None:
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        sizes = {**GQA, **QWEN4_INDEXER} if model_type == "qwen4_exp" else {**LATENT, **INDEXED}
        config = getattr(transformers, config_class)(**{**COMMON, **sizes, **NOPE_INDEXED.get(model_type, {})})
        with pytest.raises(ValueError, match=rf"`module` {reason}. Received: model_type='{model_type}'"):
            port_attention(getattr(modeling, module_class)(config, layer_idx=0), config)
    with pytest.raises(ValueError, match=rf"`config` {reason}. Received: model_type='{model_type}'"):
        port_checkpoint({"model_type": model_type}, {}, 0)


def test_mistral_large4_refuses_its_kv_sharing_layers():
    """Mistral Large 4's cross-layer KV sharing is refused with why, from a module and from a checkpoint's config
    (the layer sharing its cache: 0, the source, and 1, which attends it). Its NoPE layers port
    (`mistral_large4_nope`)."""
    config, layers = {"kv_source_layers": [0, 0]}, (0, 1)
    message = r"cross-layer KV sharing \(`kv_source_layers`: a layer attends"
    config = transformers.MistralLarge4TextConfig(**COMMON, **{**MISTRAL_LARGE4, **config})
    model = transformers.MistralLarge4TextModel(config)
    reason = rf"`module` must hold an attention the layer computes: Mistral Large 4's {message}"
    for index in layers:
        with pytest.raises(ValueError, match=reason):
            port_attention(model.layers[index].self_attn, config)
    with pytest.raises(ValueError, match=reason):
        port_checkpoint(
            config.to_dict(),
            {f"layers.1.attention.{n}": t for n, t in model.layers[1].self_attn.state_dict().items()},
            1,
        )


@pytest.mark.parametrize(("name", "config_class"), [("kimi_linear", "KimiLinearConfig"),
                                                    ("bailing_hybrid", "BailingHybridConfig")])  # fmt: skip
def test_linear_attention_layers_of_mla_hybrids_are_refused_by_name(name, config_class):
    """Kimi Linear's and Ling's MLA layers port; their linear-attention layers are refused by their type, and
    `replace_attention` leaves them as they are (the MLA layer swapped)."""
    config = getattr(transformers, config_class)(
        **COMMON, **LATENT, **TOKENS, layer_types=["linear_attention", "full_attention"]
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    message = (
        rf"`layer_index` must be a full-attention \(MLA\) layer of a {name} model: its linear_attention layers "
        r".* Received: layer 0 of type 'linear_attention'"
    )
    with pytest.raises(ValueError, match=message):
        port_attention(model.model.layers[0].self_attn, config)
    port_attention(model.model.layers[1].self_attn, config)  # the MLA layer ports
    linear = model.model.layers[0].self_attn
    assert [name.split(".")[2] for name in replace_attention(model)] == ["1"]
    assert model.model.layers[0].self_attn is linear


def test_default_configurations_scale_the_queries_by_position():
    """Mistral 4's and Llama 4's default configurations port: Mistral 4's queries scaled by `position_ids` past
    `original_max_position_embeddings` (`llama_4_scaling_beta`), Llama 4's NoPE layers' by the cache's length past
    `floor_scale` (`attn_temperature_tuning`); its RoPE layers' not at all."""
    mistral = _tiny_module(transformers.models.mistral4.modeling_mistral4.Mistral4Attention,
                           transformers.Mistral4Config, **LATENT)  # fmt: skip
    kwargs, _ = port_attention(mistral, mistral.config)
    assert kwargs["query_scaling"] == {"type": "positions", "beta": 0.1, "floor": 8192}
    config = transformers.Llama4TextConfig(**COMMON, **GQA, no_rope_layers=[0, 1])
    attention = transformers.models.llama4.modeling_llama4.Llama4TextAttention
    kwargs, _ = port_attention(attention(config, layer_idx=0), config)
    assert kwargs["query_scaling"] == {"type": "temperature", "beta": 0.1, "floor": 8192}
    kwargs, _ = port_attention(attention(config, layer_idx=1), config)
    assert "query_scaling" not in kwargs


def test_llama4_vision_attention_is_refused_as_vision_attention_not_as_smollm3():
    """Bug: Llama 4's vision encoder attention was refused with SmolLM3's message ("`layer_index` must be given for
    SmolLM3 (`no_rope_layers`)"), its porter's for the text layers. It is refused as what it is, with the model's
    config or its vision config; a text layer read without its index names Llama 4."""
    vision = transformers.Llama4VisionConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, image_size=28,
                                             patch_size=14)  # fmt: skip
    module = transformers.models.llama4.modeling_llama4.Llama4VisionAttention(vision)
    message = (
        r"`module` must hold an attention the layer computes: Llama4VisionAttention is Llama 4's vision encoder "
        r"attention, whose 2-D RoPE \(`freqs_ci`, Pixtral's\) turns the first half of each head's feature pairs by "
        r"the image patch's column and the second half by its row, .* Received: Llama4VisionAttention$"
    )
    for config in (vision, transformers.Llama4Config(vision_config=vision.to_dict(), text_config={**COMMON, **GQA})):
        with pytest.raises(ValueError, match=message):
            port_attention(module, config)
    text = _tiny_module(transformers.models.llama4.modeling_llama4.Llama4TextAttention, transformers.Llama4TextConfig,
                        **GQA)  # fmt: skip
    tensors = {f"model.layers.0.self_attn.{name}": value.numpy() for name, value in text.state_dict().items()}
    with pytest.raises(ValueError, match=r"^`layer_index` must be given for Llama 4 .* Received: layer_index=None$"):
        port_checkpoint(text.config.to_dict(), tensors, None, prefix="model.layers.0.self_attn")


@pytest.mark.parametrize(("name", "build", "message"), ERROR_CASES, ids=[case[0] for case in ERROR_CASES])
def test_port_refuses_what_the_layer_cannot_hold(name, build, message):
    module = build()
    with pytest.raises(ValueError, match=message):
        port_attention(module, getattr(module, "config", None))


def test_t5_position_bias_needs_the_module_that_holds_it():
    config = transformers.T5Config(
        d_model=HIDDEN, d_kv=HEAD_DIM, num_heads=HEADS, num_layers=2, d_ff=48, vocab_size=VOCAB
    )
    module = transformers.models.t5.modeling_t5.T5Attention(config, has_relative_attention_bias=False, layer_idx=1)
    with pytest.raises(
        ValueError, match=r"`module` must hold T5's `relative_attention_bias` .* has_relative_attention_bias=False"
    ):
        t5_position_bias(module, 3, 3)


def test_alibi_positions_are_blooms():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(alibi_positions(mask), [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])


def test_a_multimodal_config_ports_like_its_text_config():
    text = {**COMMON, **GQA, "sliding_window": WINDOW, "query_pre_attn_scalar": 4, "sliding_window_pattern": 2}
    config = transformers.Gemma3Config(text_config=text)
    module = FAMILIES_BY_NAME["gemma3"].module(_model("gemma3"), 1)
    assert port_attention(module, config)[0] == port_attention(module, config.text_config)[0]


def test_qwen2_vl_configs_of_both_eras_give_the_sections():
    """Qwen2-VL's config (its text config under `text_config`) and a config.json written before transformers 5
    (flat, `rope_scaling={"type": "mrope", "mrope_section": ...}`) port the same multimodal RoPE."""
    model = _model("qwen2_vl")
    module = FAMILIES_BY_NAME["qwen2_vl"].module(model, 0)
    text = _config(model).to_dict()
    expected = port_attention(module, text)[0]
    assert expected["rope_sections"] == tuple(MROPE_SECTION)
    assert port_attention(module, transformers.Qwen2VLConfig(text_config=text))[0] == expected
    flat = {key: value for key, value in text.items() if key != "rope_parameters"}
    flat |= {"model_type": "qwen2_vl", "rope_theta": MROPE_THETA,
             "rope_scaling": {"type": "mrope", "mrope_section": MROPE_SECTION}}  # fmt: skip
    tensors = {f"model.layers.0.self_attn.{name}": value.numpy() for name, value in module.state_dict().items()}
    assert port_checkpoint(flat, tensors, 0)[0] == expected


YARN_PARAMETERS = {
    "gpt_oss_default": {"rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "truncate": False, "original_max_position_embeddings": 4096},
    "truncated": {"rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048},
    "mscale": {"rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
               "mscale_all_dim": 0.707},
    "attention_factor_and_betas": {"rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 8192,
                                   "attention_factor": 1.5, "beta_fast": 16.0, "beta_slow": 2.0},
}  # fmt: skip
YARN_RELATIVE_TOL = 1e-6  # transformers computes its frequencies in float32, the layers in float64 rounded once


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", sorted(YARN_PARAMETERS))
def test_yarn_frequencies_and_attention_factor_are_transformers(framework, name):
    """At a real head size (H = 64, partial 0.5 and full), for every YaRN option transformers reads."""
    parameters = {"rope_type": "yarn", **YARN_PARAMETERS[name]}
    layer_file = _runner(framework).module
    for fraction in (0.5, 1.0):
        config = transformers.LlamaConfig(
            hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=131072,
            rope_parameters={**parameters, "partial_rotary_factor": fraction},
        )  # fmt: skip
        inv_freq, attention_factor = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config)
        module_kwargs, _ = port_attention(transformers.models.llama.modeling_llama.LlamaAttention(config, 0), config)
        scaling = module_kwargs["rope_scaling"]
        ours = np.asarray(layer_file.rope_frequencies(int(64 * fraction), parameters["rope_theta"], scaling))
        np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=YARN_RELATIVE_TOL, atol=0)
        assert layer_file.rope_attention_factor(scaling) == pytest.approx(attention_factor, rel=1e-12)


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(44, 30), (47, 6), (80, 32), (64, 64)])
def test_gptj_rotary_dim_survives_float_rounding(head_dim, rotary_dim):
    """44 * (30 / 44) is 29.999...: a fraction of R / H would make the layer rotate 29 features."""
    config = transformers.GPTJConfig(n_embd=2 * head_dim, n_head=2, n_layer=1, rotary_dim=rotary_dim, vocab_size=VOCAB)
    kwargs, _ = port_attention(transformers.models.gptj.modeling_gptj.GPTJAttention(config, layer_idx=0), config)
    assert int(head_dim * kwargs.get("rope_fraction", 1.0)) == rotary_dim


# ----------------------------------------------------------------------------------------------
# From a checkpoint: config.json and safetensors, with NumPy only
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`saved(name)`: the directory where the family's tiny model was saved with `save_pretrained` (once)."""
    paths = {}

    def save(name):
        if name not in paths:
            paths[name] = tmp_path_factory.mktemp(name)
            _model(name).save_pretrained(paths[name])
        return paths[name]

    return save


def _assert_same_port(ours, theirs):
    assert ours[0] == theirs[0]
    assert sorted(ours[1]) == sorted(theirs[1])
    for name, array in theirs[1].items():
        assert ours[1][name].dtype == np.float32
        np.testing.assert_array_equal(ours[1][name], array, err_msg=name)


@pytest.mark.parametrize(("name", "index"), [(family.name, index) for family in FAMILIES for index in LAYERS])
def test_checkpoint_ports_like_the_module(name, index, saved):
    """config.json as `save_pretrained` writes it (defaults left out) and model.safetensors give `port_attention`'s
    arguments and weights, the attention found at its family's path under the model's own prefix."""
    family, model, path = FAMILIES_BY_NAME[name], _model(name), saved(name)
    prefix = family.attention.format(i=index) if family.prefix else None
    ours = port_checkpoint(path / "config.json", path / "model.safetensors", index, prefix=prefix)
    _assert_same_port(ours, port_attention(family.module(model, index), _config(model)))


def test_checkpoint_reads_bfloat16_shards(tmp_path):
    """A bfloat16 checkpoint split in shards (model.safetensors.index.json) reads as the bfloat16 module does."""
    model = copy.deepcopy(_model("gemma3")).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    module = FAMILIES_BY_NAME["gemma3"].module(model, 1)
    ours = port_checkpoint(tmp_path, tmp_path / "model.safetensors.index.json", 1)
    _assert_same_port(ours, port_attention(module, _config(model)))


def test_checkpoint_from_dicts_with_a_prefix():
    model = _model("t5_decoder")
    tensors = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    path = FAMILIES_BY_NAME["t5_decoder"].attention.format(i=1)
    ours = port_checkpoint(model.config.to_dict(), tensors, 1, prefix=path)
    _assert_same_port(ours, port_attention(model.get_submodule(path), model.config))


CHECKPOINT_ERRORS = [
    ({"model_type": "mamba"}, {}, 0, r"`config` must be of one of the model types .* Received: model_type='mamba'"),
    (
        {**COMMON, **GQA, "model_type": "llama"},
        {"model.layers.0.self_attn.q_proj.weight": np.zeros((32, 32))},
        1,
        r"`tensors` must hold one attention module at `layers.1.self_attn` .* Received: 0 \(none\)",
    ),
    (
        {**COMMON, **GQA, "model_type": "llama"},
        {f"{part}.layers.0.self_attn.q_proj.weight": np.zeros((32, 32)) for part in ("vision", "text")},
        0,
        r"\(pass `prefix=` to choose\). Received: 2 \(text.layers.0.self_attn, vision.layers.0.self_attn\)",
    ),
    (
        {**COMMON, **GQA, "model_type": "llama"},
        {"layers.0.self_attn.q_proj.weight": np.zeros((32, 32))},
        0,
        r"`tensors` must hold `k_proj.weight` for this family's attention. Received: q_proj.weight",
    ),
    ({"model_type": "llama"}, [1, 2], 0, r"`tensors` must be a mapping of names to arrays .* Received: list"),
    *(
        (
            {**COMMON, **GQA, "model_type": model_type, "layer_types": [layer_type, "full_attention"]},
            {},
            0,
            rf"`layer_index` must name an attention layer: layer 0 of this {model_type} model is {what}, not "
            rf"attention. Received: layer_types\[0\]='{layer_type}'",
        )
        for model_type, layer_type, what in (
            ("qwen3_next", "linear_attention", r"a linear attention \(a gated delta rule\)"),
            ("qwen3_5_text", "linear_attention", r"a linear attention \(a gated delta rule\)"),
            ("lfm3", "conv", "a short convolution"),
        )
    ),
    *(
        (
            {"model_type": model_type},
            {},
            0,
            rf"`config` must hold an attention the layer computes: {reason} .* Received: model_type='{model_type}'",
        )
        for model_type, reason in (
            ("step3p5", r"Step-3.7's attention reads its head counts, RoPE bases and partial rotary factors"),
        )
    ),
    ([1, 2], {}, 0, r"`config` must be a dict, a path to config.json or a transformers config. Received: list"),
]


@pytest.mark.parametrize(("config", "tensors", "index", "message"), CHECKPOINT_ERRORS)
def test_checkpoint_refuses_with_the_reason(config, tensors, index, message):
    with pytest.raises(ValueError, match=message):
        port_checkpoint(config, tensors, index)


# The checkpoint route in a process where torch, transformers and safetensors cannot be imported.
BLOCKED_SCRIPT = """
import importlib.abc, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "safetensors", "tensorflow"):
            raise ImportError(f"{name} is blocked")

sys.meta_path.insert(0, Blocked())
import numpy as np
from interop.hf import port_checkpoint
from NumPy.Multi_Head_Attention import MultiHeadAttention

directory, index, data = sys.argv[1], int(sys.argv[2]), np.load(sys.argv[3])
kwargs, weights = port_checkpoint(directory + "/config.json", directory + "/model.safetensors", index)
layer = MultiHeadAttention(**kwargs)
layer.import_weights(weights)
arguments = {name: data[name] for name in data.files if name not in ("hidden", "causal")}
output = layer(data["hidden"].astype(np.float64), causal=bool(data["causal"]), **arguments)
np.save(sys.argv[4], output)
print(sorted(name for name in ("torch", "transformers", "safetensors") if name in sys.modules))
"""


@pytest.mark.parametrize(("name", "index"), [("gemma3", 0), ("bert", 1)])
def test_checkpoint_route_runs_without_torch_or_transformers(name, index, saved, tmp_path):
    """A NumPy user's route: config.json and model.safetensors to the NumPy layer, with torch, transformers and
    safetensors blocked from importing, gives what transformers' module gave (full pass, padding)."""
    family, runner = FAMILIES_BY_NAME[name], _runner("NumPy")
    model, call, mask, positions = _full_pass(family, index)
    kwargs, _ = port_attention(family.module(model, index), _config(model))
    arguments = _call_arguments(runner, model, family, mask, positions, 0, mask.shape[1], kwargs)
    np.savez(tmp_path / "data.npz", hidden=call["hidden"], **arguments)
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED_SCRIPT, str(saved(name)), str(index), str(tmp_path / "data.npz"),
         str(tmp_path / "output.npy")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"  # none of them was imported
    rows = _compared_rows(family, mask)
    assert _max_diff(np.load(tmp_path / "output.npy"), call["output"], rows) <= OUTPUT_TOL


# ----------------------------------------------------------------------------------------------
# Registered porters
# ----------------------------------------------------------------------------------------------


def test_a_registered_porter_ports_a_subclass_and_a_model_type(monkeypatch):
    """`register_porter` by class name takes a subclass that overrides `forward` (refused otherwise); by model
    type it serves `port_checkpoint`; the porter gets the config dict, the module's tensor names and its layer."""
    monkeypatch.setattr(interop.hf.registry, "_REGISTERED", {})
    received = []

    def porter(config, tensors, index):
        received.append((config["model_type"], sorted(tensors), index))
        return {"d_model": config["hidden_size"], "num_heads": config["num_attention_heads"]}, {}

    register_porter("_ClampedLlamaAttention", porter)
    register_porter("my_llama", porter)
    assert "my_llama" in supported_modules()
    config = transformers.LlamaConfig(**COMMON, **GQA)
    module = _clamped_llama_attention()(config, layer_idx=1)
    assert port_attention(module, config) == ({"d_model": HIDDEN, "num_heads": HEADS}, {})
    tensors = {f"model.layers.0.self_attn.{name}": value.numpy() for name, value in module.state_dict().items()}
    port_checkpoint({**config.to_dict(), "model_type": "my_llama"}, tensors, 0)
    names = ["k_proj.weight", "o_proj.weight", "q_proj.weight", "v_proj.weight"]
    assert received == [("llama", names, 1), ("my_llama", names, 0)]
    with pytest.raises(ValueError, match=r"`porter` must be callable. Received: str"):
        register_porter("x", "not a porter")


# ----------------------------------------------------------------------------------------------
# The layer swapped into transformers models
# ----------------------------------------------------------------------------------------------

NEW_TOKENS = 12  # past the layer's first cache of 16 slots: the wrapper grows it while generating


def _swapped(name):
    """The family's tiny model and a copy of it with every attention module replaced by the PyTorch layer."""
    model = _model(name)
    ours = copy.deepcopy(model)
    replaced = replace_attention(ours)
    assert replaced == [FAMILIES_BY_NAME[name].attention.format(i=index) for index in LAYERS]
    assert all(isinstance(ours.get_submodule(path).layer, _runner("PyTorch").module.MultiHeadAttention)
               for path in replaced)  # fmt: skip
    return model, ours


def _prompts():
    mask = _left_padded_mask(PROMPT_LENGTHS, max(PROMPT_LENGTHS))
    ids = np.random.default_rng(SEED).integers(1, VOCAB, size=mask.shape)
    return torch.from_numpy(ids), torch.from_numpy(mask)


SWAPPED = ["llama", "gemma3", "qwen3", "phi_qk_layernorm", "qwen3_next", "qwen3_5", "lfm3", "deepseek_v3",
           "kimi_linear", "bailing_hybrid", "longcat_flash", "llama4", "mistral4", "deepseek_v32",
           "glm_moe_dsa", "mistral_large4_generation"]  # fmt: skip


@pytest.mark.parametrize("name", SWAPPED if "PyTorch" in FRAMEWORKS else [])
def test_replaced_attention_generates_the_same_tokens(name):
    """Left-padded prompts: the same logits on a full pass and at every greedy step (transformers' DynamicCache
    beside the layer's own cache, the latent cache with MLA; Gemma 3's sliding layers included), hence the same
    tokens. The tolerance is the SPEC's for outputs of standard deviation 1, grown by the logits' own (those of
    Qwen3-Next's and Qwen3.5's tiny models about 2, their float32 noise about 1e-5)."""
    model, ours = _swapped(name)
    ids, mask = _prompts()
    with torch.no_grad():
        full = [m(input_ids=ids, attention_mask=mask).logits for m in (model, ours)]
    rows = mask.numpy().astype(bool)
    tolerance = OUTPUT_TOL * max(1.0, float(full[0].numpy()[rows].std()))
    assert _max_diff(full[1].numpy(), full[0].numpy(), rows) <= tolerance
    settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    theirs, mine = (
        m.generate(input_ids=ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **settings)
        for m in (model, ours)
    )
    assert theirs.sequences.shape[1] == ids.shape[1] + NEW_TOKENS
    assert torch.equal(mine.sequences, theirs.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(mine.logits, theirs.logits, strict=True)) <= tolerance


@pytest.mark.parametrize("name", ["bert", "roberta"] if "PyTorch" in FRAMEWORKS else [])
def test_replaced_attention_gives_the_encoders_states(name):
    """BERT's wrapper keeps the module's dropout, residual and LayerNorm after the ported output projection."""
    model, ours = _swapped(name)
    ids, mask = _prompts()
    with torch.no_grad():
        theirs, mine = (m(input_ids=ids, attention_mask=mask).last_hidden_state for m in (model, ours))
    assert np.max(np.abs(theirs.numpy())) > MEANINGFUL
    assert _max_diff(mine.numpy(), theirs.numpy(), mask.numpy().astype(bool)) <= OUTPUT_TOL


def test_port_refuses_a_linear_attention_layer_of_a_hybrid_model_by_name():
    """Qwen3-Next's linear-attention layers (a gated delta rule, `linear_attn`) are not attention: refused with
    their `layer_types` entry, where its full-attention layers port (`test_full_pass_with_padding_...`)."""
    config = transformers.Qwen3NextConfig(**COMMON, **GQA, **MOE, shared_expert_intermediate_size=16,
                                          layer_types=["linear_attention", "full_attention"])  # fmt: skip
    model = transformers.Qwen3NextForCausalLM(config)
    with pytest.raises(ValueError, match=r"layer 0 of this qwen3_next model is a linear attention .* "
                       r"Received: layer_types\[0\]='linear_attention'"):  # fmt: skip
        port_attention(model.model.layers[0].linear_attn, config)
    kwargs, _ = port_attention(model.model.layers[1].self_attn, config)
    assert kwargs["gate"] and kwargs["rope_fraction"] == 0.25


def test_replace_attention_refuses_a_model_it_cannot_swap():
    with pytest.raises(ValueError, match=r"`model` must hold attention modules of the Llama kind .* Received: Bloom"):
        replace_attention(copy.deepcopy(_model("bloom")))  # ALiBi: its bias is not the module's to build
    model = copy.deepcopy(_model("qwen2_vl"))
    with pytest.raises(ValueError, match=r"`model` must hold the rotary embedding \(`rotary_emb`\) of its multimodal "
                       r"RoPE above its attention modules: .* Received: none above layers\.0\.self_attn$"):  # fmt: skip
        del model.rotary_emb  # where the (3, B, T) positions come from
        replace_attention(model)
    assert type(model.layers[0].self_attn).__name__ == "Qwen2VLAttention"  # refused before any swap


def test_regression_mistral_large4_learned_rope_factors_were_ported_as_zero():
    """LeRoPE's `rotary_emb.alpha` (outside the attention modules) scales each pair's frequency by exp(alpha): the
    port used to drop it silently. `replace_attention` and `port_checkpoint` refuse a model or checkpoint where it
    is not 0, and take the ones at 0 (transformers' initial value)."""
    model = _mistral_large4_text()
    config = model.config.to_dict()
    layer = {f"layers.0.attention.{n}": t.detach().numpy() for n, t in model.layers[0].self_attn.state_dict().items()}
    port_checkpoint(config, {**layer, "lerope.alpha": np.zeros(4, np.float32)}, 0)
    with pytest.raises(ValueError, match=r"^`tensors` must hold LeRoPE's learned frequency factors at 0 .* Received: "
                       r"lerope\.alpha with 1 nonzero entries$"):  # fmt: skip
        port_checkpoint(config, {**layer, "lerope.alpha": np.array([0, 0.5, 0, 0], np.float32)}, 0)
    with torch.no_grad():
        model.rotary_emb.alpha[1] = 0.5
    with pytest.raises(ValueError, match=r"^`model` must hold LeRoPE's .* Received: rotary_emb\.alpha with 1 nonzero"):
        replace_attention(model)


@pytest.mark.parametrize("name", ["gptj", "gpt_neox"] if "PyTorch" in FRAMEWORKS else [])
def test_regression_gpt_kind_generate_after_replace_attention_ignored_the_cache(name):
    """GPT-J's, CodeGen's, GPT-Neo's, GPT-NeoX's and GPTBigCode's blocks pass the model's cache as `layer_past`,
    which the swapped module used to drop: `generate` then ran the whole prefix at every step (the same tokens,
    no cache). Each swapped module now decodes with its layer's own cache, and the tokens and logits still match."""
    model, ours = _swapped(name)
    ids, mask = _prompts()
    settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    theirs, mine = (
        m.generate(input_ids=ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **settings)
        for m in (model, ours)
    )
    tolerance = OUTPUT_TOL * max(1.0, float(torch.stack(theirs.logits).std()))  # as in the test above
    assert torch.equal(mine.sequences, theirs.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(mine.logits, theirs.logits, strict=True)) <= tolerance
    wrappers = [m for m in ours.modules() if hasattr(m, "_cache") and hasattr(m, "layer")]
    assert wrappers and all(int(w._cache.index) == ids.shape[1] + NEW_TOKENS - 1 for w in wrappers)
