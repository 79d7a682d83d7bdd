"""Measurements in fresh processes without a framework import for each: one server per Keras
backend forks a child per measurement.

`Forks().run(backend, module, function, args)` returns the JSON result of
`module.function(*args)` computed in a child of the server of `backend` ("tensorflow", "jax" or
"torch"; the PyTorch and TensorFlow layers' measurements go to "torch" and "tensorflow"). The
server (`python -m bench.fresh BACKEND`, started on first use with KERAS_BACKEND=BACKEND) imports
Keras and the backend's framework, runs no operation, and forks a child for each measurement:
the child inherits the imports (3 to 8 s of CPU each) but no framework state, threads or
allocator pools, and its peak resident memory (getrusage's ru_maxrss) starts at its own
resident memory at the fork, not at the peak of the benchmark that started the server. A
measurement that fails gives {"error": its traceback}.

Legend: none (no tensors here).
"""

import importlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).parents[1]
PRELOAD = {"tensorflow": ("tensorflow", "keras"), "jax": ("jax", "keras"), "torch": ("torch", "keras")}


class Forks:
    """The servers of one run, one per backend, started on first use; a context manager that
    ends them."""

    def __init__(self):
        self._servers = {}

    def run(self, backend, module, function, args):
        """The JSON result of `module.function(*args)` in a fresh child of `backend`'s server."""
        if backend not in self._servers:
            self._servers[backend] = _start(backend)
        server = self._servers[backend]
        server.stdin.write(json.dumps([module, function, list(args)]) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"the {backend} server ended with status {server.wait()} (its stderr is above)")
        return json.loads(line)

    def close(self):
        for server in self._servers.values():
            server.stdin.close()
            server.wait()
        self._servers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _start(backend):
    """The server process of `backend`; its stderr (framework logs) is the caller's."""
    env = {**os.environ, "KERAS_BACKEND": backend}
    command = [sys.executable, "-m", "bench.fresh", backend]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def _child(job, write_end):
    """Runs one job in the forked child and writes its JSON result; never returns (the child must
    not go on to serve the parent's jobs, whatever fails)."""
    try:
        module, function, args = job
        text = json.dumps(getattr(importlib.import_module(module), function)(*args))
    except BaseException:
        text = json.dumps({"error": traceback.format_exc()})
    try:
        with os.fdopen(write_end, "w") as pipe:
            pipe.write(text)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(0)


def _fork(job):
    """The JSON text of one job's result, computed in a forked child."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _child(job, write_end)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return text if text else json.dumps({"error": f"the child ended with status {status} and no result"})


def serve(backend):
    """Imports the backend's frameworks, then answers each job line of stdin with a result line."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print goes to stderr, not to the results
    for name in PRELOAD[backend]:
        importlib.import_module(name)
    for line in iter(sys.stdin.readline, ""):
        out.write(_fork(json.loads(line)) + "\n")
        out.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
