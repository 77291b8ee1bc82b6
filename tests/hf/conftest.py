"""Shared fixtures of the hf tests."""

from tests.hf.helpers import rope_swiglu_ckpt  # noqa: F401  (a session fixture)
