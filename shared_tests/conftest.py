"""Pytest setup shared by every test: quiet TensorFlow, repository root importable."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
