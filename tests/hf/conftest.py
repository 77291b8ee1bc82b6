"""Shared fixtures of the hf tests."""

from tests.hf.helpers import rope_swiglu_ckpt, rope_swiglu_export  # noqa: F401  (session fixtures)
