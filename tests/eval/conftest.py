"""Shared fixtures of the eval tests."""

from tests.hf.helpers import rope_swiglu_ckpt  # noqa: F401  (a session fixture)
