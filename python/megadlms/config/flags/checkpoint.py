"""Checkpoint flags: saving, loading, resuming and exiting; which checkpoint a run loads
(--ckpt-step, non-persistent checkpoints, --use-checkpoint-args, with Megatron-LM / MegaDLMs
semantics); Hugging Face interop and checkpoint conversion.

:func:`ckpt_choice_problems` is the rule on the checkpoint-choice fields, called by
``CheckpointConfig.__post_init__`` (worded with field names).
"""

from __future__ import annotations

from typing import List

from ._flag import add_flag


def checkpoint_args(p):
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
    """Resuming and exiting (which checkpoint to load: ckpt_choice_args)."""
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


NON_PERSISTENT_TYPES = ("global", "local", "in_memory")


def ckpt_choice_args(p) -> None:
    """--ckpt-step, --use-checkpoint-args and Megatron's --non-persistent-* flags."""
    g = p.add_argument_group("checkpointing: which checkpoint to load, non-persistent checkpoints")
    add_flag(
        g,
        "--pretrained-checkpoint",
        default=None,
        help="Checkpoint directory to fine-tune from when --load holds none (Megatron's): its weights "
        "only, as --finetune (iteration, optimizer and schedule start afresh); later restarts resume "
        "from --load / --save.",
    )
    add_flag(
        g,
        "--ckpt-step",
        type=int,
        default=None,
        help="Load iteration N of --load instead of the one its latest_checkpointed_iteration.txt names "
        "(MegaDLMs' flag; also picks the step --ckpt-convert-format converts).",
    )
    add_flag(
        g,
        "--use-checkpoint-args",
        action="store_true",
        help="Take the model architecture flags from the --load checkpoint's recorded run, overriding "
        "the command line (Megatron's load_args_from_checkpoint; sizes given on the command line win).",
    )
    add_flag(
        g,
        "--no-use-tokenizer-model-from-checkpoint-args",
        dest="use_tokenizer_model_from_checkpoint_args",
        action="store_false",
        help="With --use-checkpoint-args keep this run's --tokenizer-model.",
    )
    add_flag(
        g,
        "--non-persistent-save-interval",
        type=int,
        default=None,
        help="Also save a non-persistent checkpoint every N iterations (only the newest is kept; a "
        "persistent save at the same iteration wins).",
    )
    add_flag(
        g,
        "--non-persistent-ckpt-type",
        default=None,
        choices=list(NON_PERSISTENT_TYPES),
        help="global: a normal checkpoint under --non-persistent-global-ckpt-dir; local: the same under "
        "--non-persistent-local-ckpt-dir on node-local storage (single-node runs); in_memory: refused "
        "(Megatron has none either). On load the newer of persistent and non-persistent wins.",
    )
    add_flag(
        g,
        "--non-persistent-global-ckpt-dir",
        default=None,
        help="Directory of global non-persistent checkpoints (default: <save>/non_persistent, and "
        "<load>/non_persistent on load).",
    )
    add_flag(
        g,
        "--non-persistent-local-ckpt-dir",
        default=None,
        help="Node-local directory of --non-persistent-ckpt-type local checkpoints.",
    )


def ckpt_choice_problems(ck) -> List[str]:
    """What is wrong with a CheckpointConfig's checkpoint-choice fields (field names)."""
    out = []
    if ck.ckpt_step is not None and (not isinstance(ck.ckpt_step, int) or ck.ckpt_step < 0):
        out.append(f"ckpt_step must be an iteration >= 0, got {ck.ckpt_step!r}")
    if ck.ckpt_step is not None and not ck.load:
        out.append("ckpt_step needs load DIR (the checkpoint root holding iter_N)")
    if ck.use_checkpoint_args and not ck.load:
        out.append("use_checkpoint_args needs load DIR (the checkpoint whose recorded flags to use)")
    kind, interval = ck.non_persistent_ckpt_type, ck.non_persistent_save_interval
    if interval is not None and (not isinstance(interval, int) or interval <= 0):
        out.append(f"non_persistent_save_interval must be a positive integer, got {interval!r}")
    # A conversion saves nothing periodically: MegaDLMs' convert_ckpt mode keeps the interval alone.
    if interval is not None and ck.ckpt_convert_format is None:
        if kind is None:
            out.append("non_persistent_save_interval needs non_persistent_ckpt_type global (or local)")
        if not ck.save:
            out.append("non_persistent_save_interval needs save DIR (non-persistent saves go under it)")
    if kind == "in_memory":
        out.append(
            "non_persistent_ckpt_type in_memory is not supported (Megatron's validation refuses it too): "
            "use global or local"
        )
    if kind == "local" and not ck.non_persistent_local_ckpt_dir:
        out.append(
            "non_persistent_ckpt_type local needs non_persistent_local_ckpt_dir DIR (node-local storage)"
        )
    if kind == "local" and ck.use_checkpoint_args:
        out.append(
            "use_checkpoint_args does not work with non_persistent_ckpt_type local (as in Megatron): "
            "use global"
        )
    return out


def interop_args(p):
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
