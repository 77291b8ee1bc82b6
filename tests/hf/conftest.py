"""Shared fixtures of the hf tests."""

from tests.hf.chat_helpers import chat_ckpt  # noqa: F401  (a session fixture)
from tests.hf.helpers import rope_swiglu_ckpt, rope_swiglu_export  # noqa: F401  (session fixtures)
