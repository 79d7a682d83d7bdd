"""The `transformers` ports in the Keras file (Keras/Multi_Head_Attention.py), one process per backend.

shared_tests/test_hf.py ports each family's attention module (`interop.hf.port_attention`) and
captures the module's inputs and outputs in its own process, which has imported TensorFlow and
torch already. A Keras backend is fixed when Keras is imported, so the Keras file runs in a
process of its own per backend (`KERAS_BACKEND=...`, started by `run`): the parent pickles one
`Job` per comparison (the port's constructor arguments and weights, each call's inputs and
arguments, the cache's size when decoding), the child builds each job's layer, makes its calls
in order and pickles back their outputs, or the error the job raised. An `AlibiBias` among the
arguments stands for the bias the child computes with the Keras file's own `alibi_bias`. The
pickled protocol is this module's own: other modules call `run`, or `run_shared`, which runs a
backend's jobs once for all the processes that share a folder (pytest-xdist's workers).

Legend: B batch, T query length, S key/value length, E d_model, N num_heads, L cache slots.

Run a child by hand: `KERAS_BACKEND=jax python -m shared_tests.keras_ports IN.pkl OUT.pkl`.
"""

import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from typing import NamedTuple

import filelock
import numpy as np

from shared_tests.keras_backends import SUBPROCESS_TIMEOUT, KerasBackendError


class AlibiBias(NamedTuple):
    """The ALiBi bias `scale * alibi_bias(num_heads, positions)`, (B, N, 1, S), computed by the Keras file."""

    num_heads: int
    positions: np.ndarray  # (B, S) integer key positions
    scale: float = 1.0  # Falcon's: the bias is scaled with the scores


class Call(NamedTuple):
    """One call of the layer: `layer(*inputs, **arguments)` (and the job's cache when decoding)."""

    inputs: tuple  # (query,) or (query, key, value): (B, T, E), (B, S, E), (B, S, E) float32
    arguments: dict  # keyword arguments: NumPy arrays, an `AlibiBias`, or plain values


class Job(NamedTuple):
    """A layer built from a port (`MultiHeadAttention(**kwargs)`, `import_weights(weights)`) and its calls."""

    kwargs: dict
    weights: dict
    calls: tuple  # of `Call`, made in order
    cache: tuple | None = None  # (B, L): the calls decode through `init_cache(B, L)`


def run(backend, jobs, folder):
    """Runs {name: `Job`} in one process on Keras' `backend`, its files in `folder`; returns {name: [each
    call's output as a NumPy array]}, or {name: the text of the error the job raised}. Raises
    `KerasBackendError` if the process fails as a whole, `subprocess.TimeoutExpired` past SUBPROCESS_TIMEOUT."""
    given, taken = os.path.join(folder, "in.pkl"), os.path.join(folder, "out.pkl")
    with open(given, "wb") as handle:
        pickle.dump(jobs, handle)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "shared_tests.keras_ports", given, taken]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    if done.returncode != 0:
        raise KerasBackendError(f"the {backend} process exited {done.returncode}: {done.stderr[-3000:]}")
    with open(taken, "rb") as handle:
        return pickle.load(handle)


def run_shared(backend, make_jobs, folder):
    """`run(backend, make_jobs(), ...)` once for every process that passes this `folder`: the first
    to ask runs it and keeps the results there, the others wait for them (a lock in `folder`) and
    read them. Returns what `run` returns."""
    kept = os.path.join(folder, f"keras_ports_{backend}.pkl")
    with filelock.FileLock(kept + ".lock"):
        if not os.path.exists(kept):
            results = run(backend, make_jobs(), tempfile.mkdtemp(dir=folder))
            with open(kept + ".part", "wb") as handle:
                pickle.dump(results, handle)
            os.replace(kept + ".part", kept)
    with open(kept, "rb") as handle:
        return pickle.load(handle)


# In the backend's process: the protocol's other end.


def _argument(module, value):
    """A call argument as the Keras file takes it: arrays as tensors, `AlibiBias` computed by the file."""
    from keras import ops

    if isinstance(value, AlibiBias):
        return module.alibi_bias(value.num_heads, ops.convert_to_tensor(value.positions)) * value.scale  # (B, N, 1, S)
    return ops.convert_to_tensor(value) if isinstance(value, np.ndarray) else value


def _run_job(module, job):
    """Each call's output of one job, in order."""
    from keras import ops

    layer = module.MultiHeadAttention(**job.kwargs)
    layer.import_weights(job.weights)
    cache = None if job.cache is None else layer.init_cache(*job.cache)
    outputs = []
    for call in job.calls:
        arguments = {name: _argument(module, value) for name, value in call.arguments.items()}
        inputs = [ops.convert_to_tensor(x) for x in call.inputs]
        if cache is None:
            output = layer(*inputs, **arguments)  # (B, T, E)
        else:
            output, cache = layer(*inputs, **arguments, cache=cache)  # (B, T, E), the cache one call on
        outputs.append(ops.convert_to_numpy(output))
    return outputs


def _main(argv):
    given, taken = argv
    from Keras import Multi_Head_Attention as module

    with open(given, "rb") as handle:
        jobs = pickle.load(handle)
    results = {}
    for name, job in jobs.items():
        try:
            results[name] = _run_job(module, job)
        except Exception as error:  # every job is reported, each with what it raised
            results[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"[-3000:]
    with open(taken + ".part", "wb") as handle:
        pickle.dump(results, handle)
    os.replace(taken + ".part", taken)


if __name__ == "__main__":
    from shared_tests.keras_ports import _main as main  # the importable module, whose classes the pickle names

    main(sys.argv[1:])
