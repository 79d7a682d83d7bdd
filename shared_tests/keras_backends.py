"""The Keras file (Keras/Multi_Head_Attention.py) on each Keras 3 backend, one process per backend.

A Keras backend is fixed when Keras is imported, so each backend runs in a subprocess of its
own (`KERAS_BACKEND=...`): the parent pickles the cases and their data, the child runs them all
(shared_tests/keras_paths.py) and the checks asked for (shared_tests/keras_checks.py), and
pickles back one `Result` (or `DecodeResult`) per case as soon as it has it, or the error it
raised. The parity report starts the processes first (`prefetch`) and runs its own paths
beside them. The paths are
`keras:tensorflow`, `keras:jax` and `keras:torch`. The pickled protocol is this module's own:
other modules call `run_batch`, `prefetch`, `result` and `decode_result`.

Run a child by hand: `KERAS_BACKEND=jax python -m shared_tests.keras_backends jax IN.pkl FOLDER`.
"""

import atexit
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

from shared_tests import keras_paths

KERAS_BACKENDS = ("tensorflow", "jax", "torch")
KERAS_PATHS = tuple(f"keras:{backend}" for backend in KERAS_BACKENDS)
SUBPROCESS_TIMEOUT = 900  # seconds for one backend's whole batch
_POLL = 0.05  # seconds between two looks for a result not written yet
_TABLES = ("cases", "decode")

_RUNNING = {}  # backend -> (_Process, {(table, case name): (index, data)}): started by `prefetch`


class KerasBackendError(RuntimeError):
    """A case that raised inside a backend's process; the message is that error's."""


class _Process:
    """One backend's process, running beside its caller: it writes each result to its folder
    as soon as it has it (`{table}-{index}.pkl`, then `checks.pkl`), and `get` waits for one."""

    def __init__(self, backend, cases=(), decode_cases=(), checks=(), workdir=None, compile_cache=None):
        self.backend, self.folder = backend, tempfile.mkdtemp(dir=workdir)
        given = os.path.join(self.folder, "in.pkl")
        with open(given, "wb") as handle:
            pickle.dump({"cases": list(cases), "decode": list(decode_cases), "checks": list(checks)}, handle)
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
        if compile_cache and backend == "jax":
            env.update(jax_compile_cache(compile_cache))
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "shared_tests.keras_backends", backend, given, self.folder]
        self.stderr = open(os.path.join(self.folder, "stderr.txt"), "w")  # noqa: SIM115  (closed by `close`)
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=self.stderr, cwd=root)
        self.deadline = time.monotonic() + SUBPROCESS_TIMEOUT

    def get(self, name):
        """The object the process wrote as `name`, waited for; raises KerasBackendError if the
        process ended without writing it, subprocess.TimeoutExpired past SUBPROCESS_TIMEOUT."""
        path = os.path.join(self.folder, f"{name}.pkl")
        while not os.path.exists(path):
            if self.process.poll() is not None and not os.path.exists(path):
                with open(os.path.join(self.folder, "stderr.txt")) as handle:
                    error = handle.read()[-3000:]
                raise KerasBackendError(f"the {self.backend} process exited {self.process.returncode}: {error}")
            if time.monotonic() > self.deadline:
                self.process.kill()
                raise subprocess.TimeoutExpired(self.process.args, SUBPROCESS_TIMEOUT)
            time.sleep(_POLL)
        with open(path, "rb") as handle:
            return pickle.load(handle)

    def close(self):
        """Ends the process if it still runs and removes its folder."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def run_batch(backend, cases=(), decode_cases=(), checks=(), workdir=None):
    """Runs (case, data) pairs, decode (case, data) pairs and named checks (`CHECKS`) on one
    backend in a subprocess; returns {"cases": {name: Result or error text}, "decode": ...,
    "checks": {name: error text or None}}."""
    process = _Process(backend, cases, decode_cases, checks, workdir)
    try:
        out = {
            table: {case.name: process.get(f"{table}-{index}") for index, (case, _) in enumerate(pairs)}
            for table, pairs in zip(_TABLES, (cases, decode_cases), strict=True)
        }
        return {**out, "checks": process.get("checks")}
    finally:
        process.close()


def jax_compile_cache(folder):
    """The environment that makes JAX keep its compiled programs in `folder` (JAX's persistent
    compilation cache, keyed by the program, the compile options and the versions of jax and
    jaxlib), every compile kept however short: a later process reads back the program a case
    compiles to instead of compiling it again (compiling is most of the JAX process's time), and
    still runs it. A changed layer file or case is another program, compiled afresh."""
    return {
        "JAX_COMPILATION_CACHE_DIR": os.path.abspath(folder),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def prefetch(backends, cases=(), decode_cases=(), compile_cache=None):
    """Starts one process per backend that runs every (case, data) and decode (case, data) pair,
    and returns at once: the processes run beside the caller, and `result` and `decode_result`
    wait only for a result not written yet. `compile_cache`: a folder where the JAX process keeps
    its compiled programs between runs (`jax_compile_cache`), or None."""
    for backend in backends:
        process = _Process(backend, cases, decode_cases, compile_cache=compile_cache)
        atexit.register(process.close)
        indices = {
            (table, case.name): (index, data)
            for table, pairs in zip(_TABLES, (cases, decode_cases), strict=True)
            for index, (case, data) in enumerate(pairs)
        }
        _RUNNING[backend] = (process, indices)


def stop():
    """Ends the processes `prefetch` started (each ends by itself once it has written every
    result) and forgets their results."""
    for process, _ in _RUNNING.values():
        process.close()
    _RUNNING.clear()


def _kept(path, case, data, table):
    """The result of a `prefetch` process for this case and these very data, or one computed now."""
    backend = path.split(":")[1]
    process, indices = _RUNNING.get(backend, (None, {}))
    index, given = indices.get((table, case.name), (None, None))
    if given is data:
        try:
            kept = process.get(f"{table}-{index}")
        except (KerasBackendError, subprocess.TimeoutExpired) as error:
            kept = str(error)
    else:
        kept = run_batch(backend, **{"cases" if table == "cases" else "decode_cases": [(case, data)]})[table][case.name]
    if isinstance(kept, str):
        raise KerasBackendError(kept)
    return kept


def result(case, data, path):
    """The `Result` of one case on one `keras:<backend>` path."""
    return _kept(path, case, data, "cases")


def decode_result(case, data, path):
    """The `DecodeResult` of one decode case on one `keras:<backend>` path."""
    return _kept(path, case, data, "decode")


# In the backend's process: the protocol's other end.


def _write(folder, name, value):
    """Writes one result where the parent looks for it, whole or not at all."""
    path = os.path.join(folder, f"{name}.pkl")
    with open(path + ".part", "wb") as handle:
        pickle.dump(value, handle)
    os.replace(path + ".part", path)


def _run_one(run_one, case, data):
    """The result of one case, or the text of the error it raised."""
    try:
        return run_one(case, data)
    except Exception as error:  # the report goes on; the row says what this case raised
        lines = str(error).strip().splitlines()
        print(traceback.format_exc(), file=sys.stderr)
        return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def _run_checks(names):
    """{check name: None when it held, else what failed} (shared_tests/keras_checks.py)."""
    from shared_tests import keras_checks  # only in a backend's process: it runs Keras

    results = {}
    for name in names:
        try:
            keras_checks.run(name)
            results[name] = None
        except Exception as error:  # every check is reported, each with what it raised
            results[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    return results


def _main(argv):
    backend, given, folder = argv
    import keras

    if keras.backend.backend() != backend:
        raise SystemExit(f"KERAS_BACKEND={backend} expected, Keras runs on {keras.backend.backend()}")
    with open(given, "rb") as handle:
        task = pickle.load(handle)
    for table, run_one in zip(_TABLES, (keras_paths.case_result, keras_paths.decode_result), strict=True):
        for index, (case, data) in enumerate(task[table]):
            _write(folder, f"{table}-{index}", _run_one(run_one, case, data))
    _write(folder, "checks", _run_checks(task["checks"]))


if __name__ == "__main__":
    _main(sys.argv[1:])
