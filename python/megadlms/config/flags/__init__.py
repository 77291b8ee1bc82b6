"""The command-line flags of ``pretrain_difflm.py``: Megatron-LM / MegaDLMs names and defaults.

Only the parser lives in this package (``build_parser``), one module per flag group:
``model``, ``fusion``, ``diffusion``, ``parallel`` (sizes, DDP/FSDP2, pipeline layout,
context parallelism), ``optimizer`` (schedule, hyper-parameters, mixed precision, the
precision-aware optimizer), ``training``, ``data``, ``checkpoint`` (incl. interop and
conversion), ``logging``, ``megadlms_only``, ``moe``, ``recompute``, ``sft``,
``resilience`` and ``profiling``. Turning the parsed flags into the typed run configuration is
``config/arguments.py``; the rules that span several flags are ``config/rules.py``. Three
kinds of Megatron flags are accepted:

* implemented flags (most of them, tensor/sequence/pipeline/expert parallelism included;
  docs/flags.md lists every one);
* flags that only tune speed (e.g. ``--attention-backend``, ``--tp-comm-overlap``): accepted
  so a MegaDLMs script runs as written, and reported once at start as having no effect
  (``megatron_compat.WITHOUT_EFFECT``);
* flags for features not implemented yet (fp8,
  sample-based training, batch-size ramp-up, ...; ``megatron_compat.UNSUPPORTED``): they
  parse, and the validation rejects any non-default value, naming the flag.

Any other flag is an argparse error naming it.
"""

from __future__ import annotations

import argparse

from .checkpoint import checkpoint_args, ckpt_choice_args, interop_args
from .data import data_args
from .diffusion import difflm_args
from .fusion import fusion_args
from .logging import logging_args, megatron_logging_args
from .megadlms_only import megadlms_args
from .model import model_args
from .moe import moe_args
from .optimizer import precision_args, precision_aware_args
from .parallel import cp_args, parallel_args, pipeline_args
from .profiling import profiling_args
from .recompute import recompute_args
from .resilience import resilience_args
from .sft import sft_args
from .training import training_args

__all__ = ["build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The full Megatron-compatible parser (no validation; see :func:`parse_args`)."""
    p = argparse.ArgumentParser(
        prog="pretrain_difflm.py",
        # One usage line, not ~170: an argparse error (a misspelt flag) stays two lines.
        usage="%(prog)s [flags]  (--help lists every flag; docs/flags.md)",
        # No prefix matching: a misspelt or newer Megatron flag must fail, not bind to a longer one.
        allow_abbrev=False,
        description="Pretrain a diffusion language model (megadlms).",
    )
    # The order of the groups is the order of --help.
    for add in (
        model_args,
        fusion_args,
        difflm_args,
        parallel_args,
        precision_args,
        training_args,
        data_args,
        checkpoint_args,
        logging_args,
        megatron_logging_args,
        megadlms_args,
        interop_args,
        moe_args,
        pipeline_args,
        recompute_args,
        cp_args,
        ckpt_choice_args,
        precision_aware_args,
        sft_args,
        resilience_args,
        profiling_args,
    ):
        add(p)
    return p
