"""Train the lookup model with the Keras file under keras.distribution.ModelParallel on JAX, heads split across devices.

    python examples/distributed_keras_jax.py [--steps 300] [--seed 0] [--model 2]

The model of keras_model.py (Embedding -> MultiHeadAttention -> residual -> MLP -> logits), in
Keras 3 on the JAX backend, with the layer of Keras/Multi_Head_Attention.py (GQA: 4 query heads,
2 key/value heads). `layer.layout_map(mesh)` gives the `LayoutMap` that splits its heads over
the mesh axis "model" (`--model` devices); the batch is split over the others. The same model
with the same initial weights trains on one device beside it, on the same batches, and the
example prints how closely the two agree. Without `XLA_FLAGS` set, JAX is given 4 virtual CPU
devices (`--xla_force_host_platform_device_count=4`); on a TPU slice or a multi-GPU host the
same code runs on the real devices.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # before JAX starts

import argparse

import keras
import numpy as np
from task import IGNORE, VALUES, VOCAB, load_layer, make_batch

MultiHeadAttention = load_layer("Keras")
D_MODEL, HEADS, KV_HEADS, BATCH = 64, 4, 2, 64


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=int, default=2, help="devices the heads are split over (default 2)")
    return parser.parse_args(argv)


def build_model(attention):
    """keras_model.py's architecture around `attention`: (B, T) tokens -> (B, T, VALUES) logits."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, D_MODEL, mask_zero=True, name="embed")(tokens)
    x = keras.layers.Add()([x, attention(x)])
    x = keras.layers.Dense(D_MODEL, activation="relu", name="hidden")(x)
    model = keras.Model(tokens, keras.layers.Dense(VALUES, name="logits")(x))
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=IGNORE),
    )
    return model


def attention_layer():
    return MultiHeadAttention(D_MODEL, HEADS, num_kv_heads=KV_HEADS, name="attention")


def main(argv=None):
    args = parse_args(argv)
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices) // args.model, args.model), ("batch", "model"), devices)
    keras.utils.set_random_seed(args.seed)
    attention = attention_layer()
    distribution = keras.distribution.ModelParallel(layout_map=attention.layout_map(mesh), batch_dim_name="batch")
    with distribution.scope():
        split = build_model(attention)
    alone = build_model(attention_layer())
    alone.set_weights(split.get_weights())
    query_kernel = split.get_layer("attention").query_kernel.value
    print(f"{len(devices)} devices, mesh {dict(zip(mesh.axis_names, mesh.shape, strict=True))}: ", end="")
    print(f"query_kernel {tuple(query_kernel.shape)} held as {tuple(query_kernel.addressable_shards[0].data.shape)}")

    tokens, labels = make_batch(np.random.default_rng(args.seed), BATCH * args.steps)
    with distribution.scope():
        split.fit(tokens, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    alone.fit(tokens, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    held_out, answers = make_batch(np.random.default_rng(args.seed + 1000), 512)
    logits_split, logits_alone = (np.asarray(m.predict(held_out, batch_size=BATCH, verbose=0)) for m in (split, alone))
    asked = answers != IGNORE
    guesses_split, guesses_alone = logits_split.argmax(-1)[asked], logits_alone.argmax(-1)[asked]
    weights = max(float(np.abs(a - b).max()) for a, b in zip(split.get_weights(), alone.get_weights(), strict=True))
    print(f"held-out token accuracy: {np.mean(guesses_split == answers[asked]):.1%} (one device: "
          f"{np.mean(guesses_alone == answers[asked]):.1%})")  # fmt: skip
    print(f"largest difference from one device after {args.steps} steps: weights {weights:.1e}, "
          f"logits {np.abs(logits_split - logits_alone).max():.1e}")  # fmt: skip
    print(f"predictions that agree with one device: {np.mean(guesses_split == guesses_alone):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
