"""Shared test configuration."""

import os

# Keep XLA on the CPU and quiet; tests must never need an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
