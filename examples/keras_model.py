"""Train the same small model in Keras, save it as .keras, reload it, compare predictions.

    python examples/keras_model.py [--steps 1500] [--seed 0] [--out out/keras]

The model: Embedding(mask_zero=True) -> MultiHeadAttention (self-attention; the padding mask
flows implicitly from the embedding) -> residual -> MLP -> logits over the values. The layer
comes from TensorFlow/Multi_Head_Attention.py, imported as the copied file it is meant to be.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from task import IGNORE, VALUES, VOCAB, Progress, load_layer, make_batch, parse_args

keras = tf.keras
MultiHeadAttention = load_layer("TensorFlow")
D_MODEL, HEADS, BATCH = 64, 4, 64


def build_model():
    """The same architecture as LookupModel in torch_model.py, layer for layer."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, D_MODEL, mask_zero=True, name="embed")(tokens)
    attended = MultiHeadAttention(D_MODEL, HEADS, name="attention")(x)
    x = keras.layers.Add()([x, attended])
    x = keras.layers.Dense(D_MODEL, activation="relu", name="hidden")(x)
    return keras.Model(tokens, keras.layers.Dense(VALUES, name="logits")(x))


def attention_weights(model, tokens, causal=False):
    """(B, N, T, S) per-head weights of the attention layer on these tokens."""
    x = model.get_layer("embed")(tokens)
    return model.get_layer("attention")(x, causal=causal, return_attention=True)[1]


def accuracy(logits, labels):
    asked = labels != IGNORE
    return float(np.mean(np.argmax(logits, -1)[asked] == labels[asked]))


def train(steps, seed):
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    model = build_model()
    optimizer = keras.optimizers.Adam(3e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=IGNORE)

    @tf.function
    def step_fn(tokens, labels):
        with tf.GradientTape() as tape:
            logits = model(tokens, training=True)
            loss = loss_fn(labels, logits)
        optimizer.apply_gradients(
            zip(tape.gradient(loss, model.trainable_weights), model.trainable_weights, strict=True)
        )
        return loss, logits

    progress = Progress(steps)
    for step in range(1, steps + 1):
        tokens, labels = make_batch(rng, BATCH)
        loss, logits = step_fn(tokens, labels)
        if step % 25 == 0 or step == steps:
            progress.update(step, loss=float(loss), acc=accuracy(logits.numpy(), labels))
    progress.close()
    return model


def evaluate(model, seed, batches=20):
    rng = np.random.default_rng(seed + 1000)
    return float(np.mean([accuracy(model(t).numpy(), y) for t, y in (make_batch(rng, 256) for _ in range(batches))]))


def main(argv=None):
    args = parse_args(__doc__, "out/keras", argv)
    model = train(args.steps, args.seed)
    print(f"held-out token accuracy: {evaluate(model, args.seed):.1%}")

    path = args.out / "lookup_model.keras"
    model.save(path)
    reloaded = keras.models.load_model(path)
    tokens, _ = make_batch(np.random.default_rng(args.seed + 2000), 256)
    same = np.array_equal(model(tokens).numpy(), reloaded(tokens).numpy())
    print(f"saved to {path}; reloaded model gives identical logits: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
