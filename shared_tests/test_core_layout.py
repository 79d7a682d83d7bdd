"""Core first: each layer file opens with the plain layer, readable alone, and every option
family lives in a section of its own, in the same order in every file (docs/design.md, "Reading
guide"). Measured by shared_tests/core_layout.py: a plain eager call is traced and the layer
file's definitions it enters are counted (the second call; the first may build)."""

import json
import os
import subprocess
import sys

import pytest

from shared_tests import core_layout

CORE_END_MAX = 560  # the core ends by this line (room for each new option family's signature, docstring and guard)
DOCSTRING_MAX = 40  # lines of the module docstring
INIT_BODY_MAX = 50  # lines of MultiHeadAttention.__init__'s body
PLAIN_LIMITS = {  # (definitions, their lines) a plain `layer(x)` enters: ../shared/tools/core_trace.py's targets
    "NumPy": (12, 150),
    "PyTorch": (15, 200),
    "TensorFlow": (15, 200),
    "Keras": (15, 200),
}
PLAIN_LAST_LINE_MAX = 500  # a plain call's definitions all end by this line: the functions first, then the class
MASKED_DEFS_MAX = 18  # with key_mask and causal=True (PyTorch, TensorFlow, Keras)
BACKWARD_DEFS_MAX = 12  # NumPy: a plain backward
SOFTCAP_OUTSIDE_MAX = 4  # functions outside the score-modifier section that read softcap
LATENT_OUTSIDE_MAX = 5  # functions outside the MLA section that read MLA's options
LATENT_SECTIONS = ("multi-head latent attention", "sparse indexer")  # the indexer is built on MLA


@pytest.mark.parametrize("framework", core_layout.FRAMEWORKS)
def test_sections_in_order(framework):
    found = [title for title, _ in core_layout.headers(framework)]
    assert found == core_layout.expected_headers(framework)


@pytest.mark.parametrize("framework", core_layout.FRAMEWORKS)
def test_core_is_short(framework):
    assert core_layout.core_end(framework) <= CORE_END_MAX
    assert core_layout.module_docstring_lines(framework) <= DOCSTRING_MAX
    assert core_layout.init_body_lines(framework) <= INIT_BODY_MAX


@pytest.mark.parametrize(
    ("framework", "names", "section", "most"),
    [
        pytest.param(f, names, section, most, id=f"{f}-{option}")
        for f in core_layout.FRAMEWORKS
        for option, names, section, most in (
            ("softcap", core_layout.SOFTCAP_NAMES, "score modifiers", SOFTCAP_OUTSIDE_MAX),
            ("latent", core_layout.LATENT_NAMES, LATENT_SECTIONS, LATENT_OUTSIDE_MAX),
        )
    ],
)
def test_options_stay_in_their_section(framework, names, section, most):
    outside = core_layout.readers_outside(framework, names, section)
    assert len(outside) <= most, f"{framework}: read outside '{section}' by {outside}"


def _check_trace(framework, measured):
    defs, lines = PLAIN_LIMITS[framework]
    plain = measured["plain"]
    assert plain["defs"] <= defs and plain["lines"] <= lines, plain
    assert plain["last"] <= PLAIN_LAST_LINE_MAX, plain
    assert not plain["outside"], f"{framework}: a plain call enters definitions after the core: {plain}"
    if framework == "NumPy":
        assert measured["backward"]["defs"] <= BACKWARD_DEFS_MAX, measured["backward"]
    else:
        assert measured["masked"]["defs"] <= MASKED_DEFS_MAX, measured["masked"]


@pytest.mark.parametrize("framework", core_layout.FRAMEWORKS)
def test_plain_call_reads_the_core_only(framework):
    """Keras here on the backend of this process (TensorFlow)."""
    _check_trace(framework, core_layout.measure(framework))


def test_plain_call_reads_the_core_only_on_jax():
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-m", "shared_tests.core_layout", "Keras"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=core_layout.ROOT,
    )
    _check_trace("Keras", json.loads(result.stdout.strip().splitlines()[-1])["Keras"])


def test_the_trace_counts_what_a_call_enters():
    """The tracer itself: a call through two definitions of a file is two definitions."""
    measured = core_layout.measure("NumPy")["plain"]
    assert measured["defs"] >= 2 and measured["lines"] > measured["defs"]
