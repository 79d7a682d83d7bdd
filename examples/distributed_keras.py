"""Train the Keras lookup model of keras_model.py with `fit` under tf.distribute.MirroredStrategy.

    python examples/distributed_keras.py [--steps 1500] [--seed 0] [--replicas 2]

MirroredStrategy keeps one copy of the model per device and all-reduces the gradients. With
GPUs it uses them all; on a CPU-only machine this example splits the CPU into `--replicas`
logical devices so the strategy has several replicas to mirror. What was found not to work
(TensorFlow 2.21, Keras 3.15), for any layer: `keras.distribution.DataParallel` does nothing
on the TensorFlow backend; Keras `fit` under `MultiWorkerMirroredStrategy` fails upstream; and
XLA (`jit_compile=True`) under MirroredStrategy fails on CPU, so `fit` runs without it here.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from keras_model import BATCH, build_model, evaluate
from task import IGNORE, make_batch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=2, help="logical CPU devices when there is no GPU")
    return parser.parse_args(argv)


def devices(replicas):
    """The GPUs, or the CPU split into `replicas` logical devices (before TensorFlow starts)."""
    if tf.config.list_physical_devices("GPU"):
        return None  # MirroredStrategy takes every GPU
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def main(argv=None):
    args = parse_args(argv)
    strategy = tf.distribute.MirroredStrategy(devices(args.replicas))
    tf.keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=tf.keras.optimizers.Adam(3e-3),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=IGNORE),
            jit_compile=False,
        )
    tokens, labels = make_batch(np.random.default_rng(args.seed), BATCH * args.steps)
    model.fit(tokens, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=2)
    print(f"{strategy.num_replicas_in_sync} replicas: held-out token accuracy {evaluate(model, args.seed):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
