"""The command-line flags of ``pretrain_difflm.py``: Megatron-LM / MegaDLMs names and defaults.

Only the parser lives here (``build_parser``; the model, parallel, precision and MoE groups
are ``flags_model.py`` and ``flags_moe.py``). Turning the parsed flags into the typed run
configuration is ``arguments.py``; the rules that span several flags are ``rules.py``.
Three kinds of Megatron flags are accepted:

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

from .flags_ckpt23 import add_ckpt_choice_args
from .flags_cp import add_cp_args
from .flags_fusion import add_fusion_args
from .flags_logs23 import add_logs23_args
from .flags_model import add_flag, difflm_args, model_args, parallel_args, precision_args
from .flags_moe import moe_args
from .flags_paopt import add_paopt_args
from .flags_recompute import add_recompute_args


def _training_args(p):
    """Batch, schedule, optimizer and NaN handling."""
    g = p.add_argument_group("training / optimisation")
    for add in (_batch_flags, _lr_flags, _optimizer_flags, _robustness_flags):
        add(g)


def _batch_flags(g):
    """Batch sizes and the length of the run."""
    add_flag(
        g, "--micro-batch-size", type=int, default=None, help="Sequences per rank per micro-step (required)."
    )
    add_flag(
        g,
        "--global-batch-size",
        type=int,
        default=None,
        help="Sequences per optimizer step; a multiple of micro-batch x dp. Default micro-batch x dp.",
    )
    add_flag(
        g, "--rampup-batch-size", nargs="*", default=None, help="Batch-size ramp-up (not supported yet)."
    )
    add_flag(g, "--train-iters", type=int, default=None, help="Optimizer steps to train (required).")
    add_flag(
        g,
        "--train-samples",
        type=int,
        default=None,
        help="Sample-based training (not supported yet; use --train-iters).",
    )


def _lr_flags(g):
    """The optimizer kind and Megatron's learning-rate schedule."""
    add_flag(
        g,
        "--optimizer",
        default="adam",
        choices=["adam", "sgd"],
        help="AdamW (decoupled weight decay) or SGD.",
    )
    add_flag(g, "--lr", type=float, default=None, help="Peak learning rate (required).")
    add_flag(g, "--min-lr", type=float, default=0.0, help="Learning-rate floor after decay.")
    add_flag(
        g,
        "--lr-decay-style",
        default="linear",
        choices=["constant", "linear", "cosine", "WSD"],
        help="Learning-rate decay after warmup.",
    )
    add_flag(g, "--lr-warmup-iters", type=int, default=0, help="Linear warmup steps.")
    add_flag(
        g, "--lr-warmup-fraction", type=float, default=None, help="Warmup as a fraction of --lr-decay-iters."
    )
    add_flag(g, "--lr-warmup-init", type=float, default=0.0, help="Learning rate at the start of warmup.")
    add_flag(
        g,
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Steps over which the LR decays (incl. warmup). Default --train-iters.",
    )
    add_flag(
        g,
        "--lr-wsd-decay-style",
        default="exponential",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
        help="WSD: shape of the final decay phase.",
    )
    add_flag(
        g,
        # Megatron's own spelling mixes '_' and '-'; scripts use both, so both are accepted.
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        dest="override_opt_param_scheduler",
        help="On resume, take the LR schedule from these flags instead of the checkpoint.",
    )
    add_flag(
        g,
        "--lr-wsd-decay-iters",
        type=int,
        default=None,
        help="WSD: length of the final decay phase (required for WSD).",
    )


def _optimizer_flags(g):
    """Optimizer hyper-parameters, clipping and the seed."""
    add_flag(
        g, "--weight-decay", type=float, default=0.01, help="Decoupled weight decay (not on biases/norms)."
    )
    add_flag(g, "--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    add_flag(g, "--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    add_flag(g, "--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    add_flag(g, "--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    add_flag(
        g, "--clip-grad", type=float, default=1.0, help="Clip the global grad L2 norm to this (0 disables)."
    )
    add_flag(g, "--seed", type=int, default=1234, help="Seed of init, masking noise and data order.")


def _robustness_flags(g):
    """NaN/Inf handling."""
    add_flag(
        g,
        "--nan-skip-limit",
        type=int,
        default=10,
        help="Steps with a NaN/Inf loss are skipped on every rank; after this many the run stops "
        "(0: stop at the first).",
    )
    add_flag(
        g,
        # Megatron names only the opt-out; the check is on by default.
        "--no-check-for-nan-in-loss-and-grad",
        action="store_false",
        dest="check_for_nan_in_loss_and_grad",
        help="Do not check loss and reduced grads for NaN/Inf.",
    )
    add_flag(
        g,
        "--rerun-mode",
        default="disabled",
        choices=["disabled", "validate_results", "report_stats"],
        help="Megatron's rerun state machine modes (accepted; no re-runs here: a one-time note says "
        "what is done instead, see --nan-skip-limit).",
    )


def _data_args(p):
    g = p.add_argument_group("data")
    add_flag(
        g,
        "--data-path",
        nargs="*",
        default=None,
        help="Blend of .bin/.idx prefixes: 'PREFIX' or 'W1 P1 W2 P2 ...'.",
    )
    add_flag(
        g,
        "--train-data-path",
        nargs="*",
        default=None,
        help="Training blend (instead of --data-path + --split).",
    )
    add_flag(g, "--valid-data-path", nargs="*", default=None, help="Validation blend.")
    add_flag(g, "--test-data-path", nargs="*", default=None, help="Test blend.")
    add_flag(
        g,
        "--split",
        default=None,
        help="Train/valid/test split of --data-path, e.g. '969,30,1' (the default).",
    )
    add_flag(g, "--mock-data", action="store_true", help="Random tokens instead of files (smoke tests).")
    add_flag(
        g,
        "--tokenizer-type",
        default=None,
        choices=["ByteTokenizer", "HuggingFaceTokenizer"],
        help="ByteTokenizer (offline: 256 bytes + eod/mask/pad) or a tokenizers-library tokenizer.json. "
        "Default: HuggingFaceTokenizer with --tokenizer-model (as MegaDLMs), else ByteTokenizer.",
    )
    add_flag(
        g,
        "--tokenizer-model",
        default=None,
        help="HuggingFaceTokenizer: tokenizer.json file or its directory.",
    )
    add_flag(g, "--data-cache-path", default=None, help="Directory for the dataset index caches.")
    add_flag(g, "--eod-mask-loss", action="store_true", help="No loss on end-of-document tokens.")
    add_flag(g, "--num-workers", type=int, default=2, help="DataLoader worker processes.")
    add_flag(
        g,
        "--reset-position-ids",
        action="store_true",
        help="Position ids restart after every end-of-document token (Megatron).",
    )
    add_flag(
        g,
        "--reset-attention-mask",
        action="store_true",
        help="With --reset-position-ids: document packing, each token attends only within its document.",
    )


def _checkpoint_args(p):
    """Saving, loading, resuming and exiting."""
    g = p.add_argument_group("checkpointing")
    for add in (_save_load_flags, _resume_exit_flags):
        add(g)


def _save_load_flags(g):
    """Where and how checkpoints are written and read."""
    add_flag(g, "--save", default=None, help="Directory to save checkpoints to.")
    add_flag(g, "--load", default=None, help="Directory to resume from (latest_checkpointed_iteration.txt).")
    add_flag(g, "--save-interval", type=int, default=None, help="Save every N steps (required with --save).")
    add_flag(
        g,
        "--ckpt-format",
        default="torch_dist",
        # Megatron's other formats parse, so validation can answer "not supported yet" instead of argparse.
        choices=["torch_dist", "torch", "torch_dcp", "fsdp_dtensor", "zarr"],
        help="torch_dist: sharded torch.distributed.checkpoint, reshardable across wrappers and dp sizes; "
        "torch: one rank-0 file.",
    )
    add_flag(
        g,
        "--auto-detect-ckpt-format",
        action="store_true",
        help="Accepted for Megatron scripts (the format is always read from the checkpoint).",
    )
    add_flag(
        g,
        "--ckpt-fully-parallel-load",
        action="store_true",
        help="Accepted for Megatron scripts (no effect).",
    )
    add_flag(
        g,
        "--async-save",
        action="store_true",
        help="Write torch_dist checkpoints in the background while training continues; the next save "
        "and the exit wait for the previous one (docs/reliability.md).",
    )
    add_flag(g, "--no-load-optim", action="store_true", help="Do not load optimizer state.")
    add_flag(g, "--no-load-rng", action="store_true", help="Do not load RNG states.")
    add_flag(g, "--no-save-optim", action="store_true", help="Do not save optimizer state.")
    add_flag(g, "--no-save-rng", action="store_true", help="Do not save RNG states.")


def _resume_exit_flags(g):
    """Resuming and exiting (which checkpoint to load: flags_ckpt23.py)."""
    add_flag(
        g,
        "--finetune",
        action="store_true",
        help="Load weights only; reset iteration, optimizer and scheduler.",
    )
    add_flag(
        g,
        "--exit-interval",
        type=int,
        default=None,
        help="Save and exit when the iteration is a multiple of N.",
    )
    add_flag(
        g, "--exit-duration-in-mins", type=float, default=None, help="Save and exit after this many minutes."
    )
    add_flag(
        g, "--exit-signal-handler", action="store_true", help="On SIGTERM save a checkpoint and exit cleanly."
    )
    add_flag(
        g,
        "--no-auto-resume",
        dest="auto_resume",
        action="store_false",
        help="With --save and no --load, start from scratch even if --save holds a checkpoint "
        "(default: resume from it, as Megatron does with --load equal to --save).",
    )
    add_flag(
        g,
        "--ckpt-fallback",
        action="store_true",
        help="If the checkpoint to resume fails verification (corrupt, truncated or missing file), load "
        "the newest older complete checkpoint instead of stopping with an error.",
    )


def _logging_args(p):
    g = p.add_argument_group("logging / evaluation")
    add_flag(g, "--log-interval", type=int, default=100, help="Print a progress line every N steps.")
    add_flag(g, "--eval-interval", type=int, default=1000, help="Validation NELBO every N steps.")
    add_flag(g, "--eval-iters", type=int, default=100, help="Validation batches per evaluation (0 disables).")
    add_flag(
        g,
        "--tensorboard-dir",
        default=None,
        help="Write TensorBoard scalars here, with Megatron's tag names (needs tensorboard).",
    )
    add_flag(
        g, "--log-params-norm", action="store_true", help="Log the global parameter L2 norm (params norm)."
    )
    add_flag(
        g,
        "--metrics-jsonl",
        default=None,
        help="Append one JSON object per logged step (iteration, consumed_samples, lm_loss, lr, grad_norm, "
        "loss_scale, skipped, tokens_per_sec, event='train'; at eval a separate event='eval' "
        "record with valid_nelbo and valid_ppl_bound; the end-of-training evaluations as "
        "event='final_validation' / 'final_test').",
    )


def _megadlms_args(p):
    """MegaDLMs-only flags (custom_args/difflm.py) beyond the objective's."""
    g = p.add_argument_group("MegaDLMs")
    for flag, why in (
        ("--debug", "MegaDLMs debug mode (no effect)"),
        ("--turn-on-debugpy", "attach debugpy (no effect)"),
        ("--use-on-the-fly-eval", "MegaDLMs' on-the-fly downstream eval (not available; no effect)"),
        ("--gpt-block-return-loss-and-logits", "MegaDLMs model API detail (no effect on training)"),
    ):
        add_flag(g, flag, action="store_true", help=f"Accepted for MegaDLMs scripts: {why}.")
    add_flag(
        g,
        "--detect-anomaly",
        action="store_true",
        help="Run forward/backward under torch.autograd.detect_anomaly (slow; names the op making a NaN).",
    )
    add_flag(
        g,
        "--non-special-vocab-size",
        type=int,
        default=None,
        help="MegaDLMs' size of the non-special vocabulary, used by its uniform-noise modes only "
        "(accepted; no effect in difflm-noshift).",
    )
    add_flag(
        g,
        "--cut-off-varlen-to-seqlen",
        action="store_true",
        help="Document packing: also cut documents at every --seq-length boundary (packing here never "
        "crosses samples, so this is always the behaviour; MegaDLMs requires the flag).",
    )
    add_flag(
        g,
        "--checkpoint-steps",
        default=None,
        help="Also save at these iterations, comma-separated (e.g. '100,2000').",
    )


def _interop_args(p):
    g = p.add_argument_group("Hugging Face interop / checkpoint conversion")
    add_flag(
        g,
        "--hf-init",
        default=None,
        help="Initialise the model from a local Hugging Face Llama/Qwen2 (or megadlms export) directory; "
        "the model flags must match its config.json.",
    )
    add_flag(
        g,
        "--ckpt-convert-format",
        default=None,
        choices=["torch", "torch_dist"],
        help="Convert the --load checkpoint to this format into --ckpt-convert-save/<format>, then exit.",
    )
    add_flag(g, "--ckpt-convert-save", default=None, help="Root directory of the converted checkpoint.")


def _pipeline_args(p):
    """Pipeline-parallel layout flags beyond --pipeline-model-parallel-size and
    --num-layers-per-virtual-pipeline-stage (Megatron's names)."""
    g = p.add_argument_group("pipeline parallelism")
    add_flag(
        g,
        "--virtual-pipeline-model-parallel-size",
        # Newer Megatron's name for the same setting; one dest, so both spellings agree downstream.
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        dest="virtual_pipeline_model_parallel_size",
        help="Interleaved 1F1B schedule: model chunks (virtual stages) per pipeline rank "
        "(exclusive with --num-layers-per-virtual-pipeline-stage).",
    )
    add_flag(
        g,
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="Uneven split: decoder layers on the first pipeline stage (the rest split evenly).",
    )
    add_flag(
        g,
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="Uneven split: decoder layers on the last pipeline stage (the rest split evenly).",
    )


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
    for add in (
        model_args,
        add_fusion_args,
        difflm_args,
        parallel_args,
        precision_args,
        _training_args,
        _data_args,
        _checkpoint_args,
        _logging_args,
        add_logs23_args,
        _megadlms_args,
        _interop_args,
        moe_args,
        _pipeline_args,
        add_recompute_args,
        add_cp_args,
        add_ckpt_choice_args,
        add_paopt_args,
    ):
        add(p)
    return p
