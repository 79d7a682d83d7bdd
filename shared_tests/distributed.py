"""Distributed checks, run by test_distributed.py in their own processes.

`python -m shared_tests.distributed torch OUT.json [--mix-batch]` spawns 2 CPU ranks (gloo,
file:// rendezvous) that train under DDP and FSDP2 and run tensor parallelism by heads; rank 0
writes, per check, the largest difference from one process doing the same work alone.
`python -m shared_tests.distributed keras OUT.json [--mix-batch]` fits a Keras model under
`tf.distribute.MirroredStrategy` on 2 logical CPU devices and on one device.
`--mix-batch` swaps in a layer that mixes the batch elements, which the data-parallel checks
must catch (tensor parallelism splits heads, not the batch).
These run in float64, so the differences are rounding alone (about 1e-15).
`python -m shared_tests.distributed keras_jax OUT.json` runs the Keras file under
`keras.distribution` on 4 virtual JAX CPU devices, in float32: `DataParallel`, `ModelParallel`
with the layouts of `layout_map` for each configuration and size of the "model" axis (forward,
gradients, `fit`, KV-cache decoding, the variables' shardings), and a layout written by hand
that splits heads; it saves the last ModelParallel model beside OUT.json
(model_parallel.keras, with its inputs and outputs in model_parallel.npz). Under XLA's GSPMD a
layer that mixes the batch elements still equals one device (the compiler moves what each
device needs), so no `--mix-batch` check runs there: the shardings are checked instead.
"""

import argparse
import copy
import datetime
import json
import os
import sys
import tempfile

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

WORLD = 2
STEPS, LR = 3, 0.1
ATTEMPTS = 2  # spawns of the PyTorch ranks when gloo kills one with a signal (see run_torch)
rng = np.random.default_rng(0)
X = rng.normal(size=(4, 5, 8))  # (B, T, E): the full batch, split across the ranks
Y = rng.normal(size=(4, 3))  # targets


# -- PyTorch -------------------------------------------------------------------------------------


def _torch_classes(mix_batch):
    import torch
    from torch import nn

    from PyTorch import MultiHeadAttention

    class BatchMixing(MultiHeadAttention):
        """A broken layer: each output depends on the other batch elements."""

        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            return output + output.mean(dim=0, keepdim=True)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = (BatchMixing if mix_batch else MultiHeadAttention)(8, 4, num_kv_heads=2)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.attention(x, causal=True).mean(dim=1))  # (B, T, E) -> (B, 3)

    torch.manual_seed(0)
    return Model


def _train(model, x, y):
    """STEPS of SGD on the mean squared error; returns the final parameters as float64 arrays."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {name: _full(p).detach().numpy() for name, p in model.named_parameters()}


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _largest(a, b):
    return max(float(np.abs(a[name] - b[name]).max()) for name in a)


def _data_parallel(rank, mix_batch):
    """DDP and FSDP2, each rank on its half of the batch, against one process on all of it."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = _torch_classes(mix_batch)()
    x, y = torch.from_numpy(X), torch.from_numpy(Y)
    initial = {name: p.detach().clone().numpy() for name, p in model.named_parameters()}
    alone = _train(copy.deepcopy(model), x, y)
    half = slice(rank * 2, rank * 2 + 2)
    ddp = _train(DistributedDataParallel(copy.deepcopy(model)), x[half], y[half])
    sharded = copy.deepcopy(model)
    fully_shard(sharded.attention)
    fully_shard(sharded)
    fsdp = _train(sharded, x[half], y[half])
    ddp = {name.removeprefix("module."): value for name, value in ddp.items()}
    return {"ddp": _largest(ddp, alone), "fsdp2": _largest(fsdp, alone), "moved": _largest(alone, initial)}


TP_CONFIGS = {
    "mha": ({"d_model": 8, "num_heads": 4}, {}),
    "gqa_causal": ({"d_model": 8, "num_heads": 4, "num_kv_heads": 2}, {"causal": True}),
    "padding_mask": ({"d_model": 8, "num_heads": 4, "num_kv_heads": 2}, {"mask": "padding"}),
    "head_dim_cross": ({"d_model": 8, "num_heads": 4, "head_dim": 3, "kdim": 6, "vdim": 5}, {"cross": True}),
}


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "query": ColwiseParallel(),
        "key": ColwiseParallel(),
        "value": ColwiseParallel(),
        "output": RowwiseParallel(),
    }


def _tensor_parallel(mesh, config, options):
    """Forward and gradients of the layer with heads split across the ranks, against the whole
    layer in this process (every rank has the same inputs)."""
    import torch
    from torch.distributed.tensor.parallel import parallelize_module

    from PyTorch import MultiHeadAttention

    torch.manual_seed(1)
    layer = MultiHeadAttention(**config)
    split = parallelize_module(copy.deepcopy(layer), mesh, _tp_plan())
    x = torch.randn(4, 5, 8)
    kv = torch.randn(4, 7, config.get("kdim", 8)), torch.randn(4, 7, config.get("vdim", 8))
    args = (x, *kv) if options.get("cross") else (x,)
    s = 7 if options.get("cross") else 5
    mask = None
    if options.get("mask") == "padding":
        mask = torch.rand(4, 1, s, generator=torch.Generator().manual_seed(2)) < 0.6
        mask[:, :, 0] = True
    g = torch.randn(4, 5, 8)
    results = {}
    for name, module in (("whole", layer), ("split", split)):
        inputs = [a.clone().requires_grad_() for a in args]
        output = module(*inputs, attention_mask=mask, causal=options.get("causal", False))
        (output * g).sum().backward()
        grads = {f"input{i}": a.grad for i, a in enumerate(inputs)}
        grads.update({p_name: _full(p.grad) for p_name, p in module.named_parameters()})
        results[name] = (output.detach(), grads)
    (out_a, grads_a), (out_b, grads_b) = results["whole"], results["split"]
    diff = float((out_a - out_b).abs().max())
    return max(diff, *(float((grads_a[n] - grads_b[n]).abs().max()) for n in grads_a))


def _tensor_parallel_errors(mesh):
    """The configurations tensor parallelism cannot split: the ValueError messages."""
    import torch
    from torch.distributed.tensor.parallel import parallelize_module

    from PyTorch import MultiHeadAttention

    messages = {}
    x = torch.randn(2, 5, 8)
    cases = {
        "per_head_mask": ({"d_model": 8, "num_heads": 4}, {"attention_mask": torch.ones(2, 4, 5, 5, dtype=torch.bool)}),
        "per_head_bias": ({"d_model": 8, "num_heads": 4}, {"attention_bias": torch.zeros(1, 4, 5, 5)}),
        "mqa_on_two_ranks": ({"d_model": 8, "num_heads": 4, "num_kv_heads": 1}, {}),
        "sinks": ({"d_model": 8, "num_heads": 4, "sinks": True}, {}),
        "qk_norm_all": ({"d_model": 8, "num_heads": 4, "qk_norm": "all"}, {}),
        "output_norm": ({"d_model": 8, "num_heads": 4, "output_norm": "rms"}, {}),
    }
    for name, (config, kwargs) in cases.items():
        layer = parallelize_module(MultiHeadAttention(**config), mesh, _tp_plan())
        try:
            layer(x, **kwargs)
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    return messages


def _torch_rank(rank, folder, mix_batch):
    """One rank: every check, then its results in folder/rank<N>.json before the teardown."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_default_dtype(torch.float64)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(folder, 'rendezvous')}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        results = _data_parallel(rank, mix_batch)
        mesh = init_device_mesh("cpu", (WORLD,))
        for name, (config, options) in TP_CONFIGS.items():
            results[f"tp_{name}"] = _tensor_parallel(mesh, config, options)
        results["tp_errors"] = _tensor_parallel_errors(mesh)
        path = os.path.join(folder, f"rank{rank}.json")
        with open(f"{path}.part", "w") as handle:
            json.dump(results, handle)
        os.replace(f"{path}.part", path)  # a rank killed while writing leaves no results
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _finished_ranks(folder):
    """The results of every rank, or None when some rank did not write them."""
    paths = [os.path.join(folder, f"rank{rank}.json") for rank in range(WORLD)]
    if not all(os.path.exists(path) for path in paths):
        return None
    ranks = []
    for path in paths:
        with open(path) as handle:
            ranks.append(json.load(handle))
    return ranks


def run_torch(out, mix_batch):
    """Spawns the ranks and writes their results to `out`.

    gloo's TCP transport can kill a rank with a signal (SIGABRT from a C++ exception in its I/O
    thread, pytorch/pytorch#50701) on a loaded machine. Such a death after every rank wrote its
    results is a teardown crash and is reported on stderr; one before is retried once. A Python
    exception in a rank (a wrong number, a ValueError) is never retried.
    """
    import torch.multiprocessing as mp

    for attempt in range(1, ATTEMPTS + 1):
        with tempfile.TemporaryDirectory() as folder:
            try:
                mp.spawn(_torch_rank, args=(folder, mix_batch), nprocs=WORLD, join=True)
            except mp.ProcessExitedException as error:
                if error.signal_name is None:
                    raise
                print(f"attempt {attempt}: {error}", file=sys.stderr)
            ranks = _finished_ranks(folder)
        if ranks is not None:
            with open(out, "w") as handle:
                json.dump(ranks, handle)
            return
    raise RuntimeError(f"a signal killed a rank before every rank wrote its results, in all {ATTEMPTS} attempts")


# -- Keras -----------------------------------------------------------------------------------------


def run_keras(out, mix_batch):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * WORLD)
    keras = tf.keras
    keras.config.set_floatx("float64")

    from TensorFlow import MultiHeadAttention

    class BatchMixing(MultiHeadAttention):
        def call(self, query, key=None, value=None, **kwargs):  # Keras matches build's *_shape to these
            output = super().call(query, key, value, **kwargs)
            return output + tf.reduce_mean(output, axis=0, keepdims=True)

    def fit():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5, 8))
        attended = (BatchMixing if mix_batch else MultiHeadAttention)(8, 4, num_kv_heads=2)(inputs, causal=True)
        outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(attended))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
        initial = [w.numpy().copy() for w in model.weights]
        model.fit(X, Y, batch_size=4, epochs=STEPS, shuffle=False, verbose=0)
        return initial, [w.numpy() for w in model.weights]

    initial, alone = fit()
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    with tf.distribute.MirroredStrategy(devices).scope():
        _, mirrored = fit()
    results = {
        "replicas": len(devices),
        "mirrored": max(float(np.abs(a - b).max()) for a, b in zip(alone, mirrored, strict=True)),
        "moved": max(float(np.abs(a - b).max()) for a, b in zip(alone, initial, strict=True)),
    }
    with open(out, "w") as handle:
        json.dump(results, handle)


# -- Keras 3 on JAX: keras.distribution ----------------------------------------------------------

DEVICES = 4  # virtual CPU devices (XLA_FLAGS), set before JAX starts
FIT_STEPS, FIT_LR = 3, 0.1
# ModelParallel configurations: (layer options, sizes of the "model" axis); E = 16, T = S = 5
KERAS_CONFIGS = {
    "mha": ({"num_heads": 4}, (2, 4)),
    "gqa": ({"num_heads": 8, "num_kv_heads": 4, "head_dim": 4}, (2, 4)),
    "gqa_k2": ({"num_heads": 4, "num_kv_heads": 2}, (2,)),
    "mqa": ({"num_heads": 4, "num_kv_heads": 1}, (2, 4)),
    "variants": ({"num_heads": 4, "num_kv_heads": 2, "qk_norm": "all", "sinks": True, "rope_theta": 1e4}, (2,)),
}


def _keras_model(keras, options):
    """Attention (causal, a key padding mask) between an input and a Dense head: (B, T, E) -> (B, T, 3)."""
    from Keras import MultiHeadAttention

    x = keras.Input((5, 16))
    keep = keras.Input((5,), dtype="bool")
    attended = MultiHeadAttention(16, name="attention", **options)(x, key_mask=keep, causal=True)
    return keras.Model([x, keep], keras.layers.Dense(3, name="head")(attended))


def _keras_data():
    x = rng.normal(size=(4, 5, 16)).astype("float32")  # (B, T, E)
    keep = np.ones((4, 5), dtype=bool)  # (B, S): padding at the end of two sequences
    keep[1, 3:] = keep[3, 4:] = False
    return [x, keep], rng.normal(size=(4, 5, 3)).astype("float32")


def _forward_and_gradients(model, inputs, targets, data_layout=None):
    """The output and the gradients of the mean squared error, under one `jax.jit`."""
    import jax

    def loss(trainable, non_trainable, inputs):
        output, _ = model.stateless_call(trainable, non_trainable, inputs)
        return ((output - targets) ** 2).mean(), output

    if data_layout is not None:  # the batch split over the devices as `fit` splits it
        inputs = [jax.device_put(a, data_layout(a.shape).backend_layout) for a in inputs]
    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    (_, output), grads = step(trainable, non_trainable, inputs)
    return np.asarray(output), [np.asarray(g) for g in grads]


def _fit(keras, model, inputs, targets):
    model.compile(optimizer=keras.optimizers.SGD(FIT_LR), loss="mse", jit_compile=True)
    model.fit(inputs, targets, batch_size=4, epochs=FIT_STEPS, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()]


def _largest_difference(a, b):
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b, strict=True))


def _keras_against_one_device(keras, distribution, options):
    """Forward, gradients and `fit` of the model under `distribution` against the same weights
    on one device: the largest difference of each, and the variables' shardings."""
    inputs, targets = _keras_data()
    with distribution.scope():
        split = _keras_model(keras, options)
    alone = _keras_model(keras, options)
    alone.set_weights(split.get_weights())
    initial = split.get_weights()
    out_s, grads_s = _forward_and_gradients(split, inputs, targets, distribution.get_data_layout)
    out_a, grads_a = _forward_and_gradients(alone, inputs, targets)
    shardings = {v.path: _sharding(v.value) for v in split.weights}
    with distribution.scope():
        fitted_s = _fit(keras, split, inputs, targets)
    fitted_a = _fit(keras, alone, inputs, targets)
    return {
        "output": _largest_difference([out_s], [out_a]),
        "gradients": _largest_difference(grads_s, grads_a),
        "fit": _largest_difference(fitted_s, fitted_a),
        "moved": _largest_difference(fitted_a, initial),
        "shardings": shardings,
    }, split


def _sharding(array):
    """The spec of a JAX array's sharding and the shape each device holds."""
    spec = getattr(array.sharding, "spec", ())
    return {
        "spec": [None if p is None else str(p) for p in spec],
        "shard": list(array.addressable_shards[0].data.shape),
    }


def _decode(layer, x, mesh_layout):
    """A prompt of 3 tokens, then 2 single tokens, through the layer's KV cache (its key and value
    put on the mesh by `mesh_layout`, split by heads) under `jax.jit`: the outputs and the cache."""
    import jax

    cache = layer.init_cache(2, 6)
    if mesh_layout is not None:
        cache = cache._replace(
            key=jax.device_put(cache.key, mesh_layout), value=jax.device_put(cache.value, mesh_layout)
        )
    step = jax.jit(lambda x, cache: layer(x, cache=cache, causal=True))
    outputs = []
    for start, stop in ((0, 3), (3, 4), (4, 5)):
        output, cache = step(x[:, start:stop], cache)
        outputs.append(np.asarray(output))
    return np.concatenate(outputs, axis=1), cache


def _keras_model_parallel(keras, options, model_size):
    from jax.sharding import NamedSharding, PartitionSpec

    from Keras import MultiHeadAttention

    mesh = keras.distribution.DeviceMesh((DEVICES // model_size, model_size), ("batch", "model"))
    layout_map = MultiHeadAttention(16, name="attention", **options).layout_map(mesh)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    result, model = _keras_against_one_device(keras, distribution, options)
    layer, alone = model.get_layer("attention"), MultiHeadAttention(16, **options)
    alone.import_weights(layer.export_weights())
    heads = PartitionSpec(None, "model") if layer.num_kv_heads > 1 else PartitionSpec()
    x = rng.normal(size=(2, 5, 16)).astype("float32")  # (B, T, E)
    decoded, cache = _decode(layer, x, NamedSharding(mesh.backend_mesh, heads))
    decoded_alone, _ = _decode(alone, x, None)
    result["decode"] = _largest_difference([decoded], [decoded_alone])
    result["decode_vs_full"] = _largest_difference([decoded], [np.asarray(alone(x, causal=True))])
    result["cache"] = _sharding(cache.key)
    return result, model


def _keras_head_split_by_hand(keras):
    """A LayoutMap written by hand, not by `layout_map`, that splits each of 2 heads (H = 8) over a
    "model" axis of 4: XLA moves what each score needs between the devices, so the numbers
    still equal one device (the layout costs communication, not correctness)."""
    mesh = keras.distribution.DeviceMesh((1, DEVICES), ("batch", "model"))
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*/(query|key|value)_kernel"] = (None, "model")
    layout_map[".*/output_kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    result, _ = _keras_against_one_device(keras, distribution, {"num_heads": 2})
    return result


def _keras_saved(keras, model, folder):
    """The model trained under ModelParallel saved to .keras, reloaded here on one device."""
    path = os.path.join(folder, "model_parallel.keras")
    inputs, _ = _keras_data()
    model.save(path)
    expected = np.asarray(model.predict(inputs, verbose=0))
    np.savez(os.path.join(folder, "model_parallel.npz"), x=inputs[0], keep=inputs[1], expected=expected)
    reloaded = keras.saving.load_model(path)
    return _largest_difference([reloaded.predict(inputs, verbose=0)], [expected])


def run_keras_jax(out, mix_batch):
    """`keras.distribution` on DEVICES virtual CPU devices: DataParallel, and ModelParallel for
    each configuration and "model" axis; the results, and a .keras file beside `out`."""
    del mix_batch
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    import keras

    keras.utils.set_random_seed(0)
    results = {"devices": len(keras.distribution.list_devices())}
    data_parallel = keras.distribution.DataParallel()
    results["data_parallel"], _ = _keras_against_one_device(keras, data_parallel, {"num_heads": 4, "num_kv_heads": 2})
    for name, (options, sizes) in KERAS_CONFIGS.items():
        for size in sizes:
            results[f"{name}_{size}"], model = _keras_model_parallel(keras, options, size)
    results["saved"] = _keras_saved(keras, model, os.path.dirname(out))
    results["head_split_by_hand"] = _keras_head_split_by_hand(keras)
    with open(out, "w") as handle:
        json.dump(results, handle)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("framework", choices=["torch", "keras", "keras_jax"])
    parser.add_argument("out")
    parser.add_argument("--mix-batch", action="store_true")
    args = parser.parse_args(argv)
    run = {"torch": run_torch, "keras": run_keras, "keras_jax": run_keras_jax}[args.framework]
    run(args.out, args.mix_batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
