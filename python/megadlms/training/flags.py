"""The command-line flags of ``pretrain_difflm.py``: Megatron-LM / MegaDLMs names and defaults.

Only the parser lives here (``build_parser``); turning the parsed flags into the typed
run configuration, and every rule that spans several flags, is ``arguments.py``.
Three kinds of Megatron flags are accepted:

* implemented flags (most of them; docs/flags.md lists every one);
* flags that only tune speed or external logging we do not have (e.g.
  ``--attention-backend``, ``--wandb-project``): accepted so a MegaDLMs script runs as
  written, and reported once at start as having no effect;
* flags for features we do not implement yet (tensor/pipeline/expert/context
  parallelism, fp8, activation recompute, ...): they parse, and the validation rejects
  any non-default value, naming the flag.

Any other flag is an argparse error naming it.
"""

from __future__ import annotations

import argparse


def _int_or_str(value: str):
    return int(value) if value.lstrip("-").isdigit() else value


def _add(group, *flags, help, **kw):  # noqa: A002 - argparse's name
    group.add_argument(*flags, help=help, **kw)


def _model_args(p):
    g = p.add_argument_group("model")
    _add(g, "--num-layers", type=int, default=None, help="Number of transformer layers (required).")
    _add(g, "--hidden-size", type=int, default=None, help="Transformer hidden size (required).")
    _add(
        g,
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="MLP hidden size. Default 4*hidden-size, or int(8*hidden/3/64)*64 with --swiglu "
        "(Megatron's rule).",
    )
    _add(
        g,
        "--num-attention-heads",
        type=int,
        default=None,
        help="Number of attention (query) heads (required).",
    )
    _add(
        g,
        "--group-query-attention",
        action="store_true",
        help="Use grouped-query attention (with --num-query-groups).",
    )
    _add(
        g,
        "--num-query-groups",
        type=int,
        default=1,
        help="Key/value head groups with --group-query-attention; without it, equals --num-attention-heads.",
    )
    _add(
        g,
        "--kv-channels",
        type=int,
        default=None,
        help="Per-head dimension. Default hidden-size / num-attention-heads.",
    )
    _add(g, "--seq-length", type=int, default=None, help="Training sequence length in tokens (required).")
    _add(
        g,
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Longest sequence the model accepts (learned position table size). Default --seq-length.",
    )
    _add(
        g,
        "--position-embedding-type",
        default="learned_absolute",
        choices=["learned_absolute", "rope"],
        help="Position encoding: learned absolute table or rotary (RoPE).",
    )
    _add(g, "--rotary-base", type=int, default=10000, help="RoPE base frequency.")
    _add(
        g,
        "--rotary-percent",
        type=float,
        default=1.0,
        help="Fraction of head dim rotated (only 1.0 supported).",
    )
    _add(
        g,
        "--normalization",
        default="LayerNorm",
        choices=["LayerNorm", "RMSNorm"],
        help="Normalisation layer type.",
    )
    _add(g, "--norm-epsilon", type=float, default=1e-5, help="Epsilon of LayerNorm/RMSNorm.")
    _add(g, "--swiglu", action="store_true", help="SwiGLU MLP (gated SiLU) instead of GeLU.")
    _add(
        g,
        "--disable-bias-linear",
        action="store_false",
        dest="add_bias_linear",
        help="No bias in the linear layers.",
    )
    _add(
        g,
        "--add-qkv-bias",
        action="store_true",
        help="Bias on the QKV projection even with --disable-bias-linear (Qwen2).",
    )
    _add(
        g, "--qk-layernorm", action="store_true", help="Normalise queries and keys per head before attention."
    )
    _add(
        g,
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Separate output-layer weight instead of reusing the input embedding "
        "(required by --use-torch-fsdp2).",
    )
    _add(g, "--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    _add(g, "--hidden-dropout", type=float, default=0.1, help="Dropout on hidden states (residual branches).")
    _add(g, "--init-method-std", type=float, default=0.02, help="Std of the normal weight initialisation.")
    _add(g, "--vocab-size", type=int, default=None, help="Vocabulary size. Default: the tokenizer's.")
    _add(
        g,
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the embedding rows to a multiple of this.",
    )
    _add(
        g,
        "--model-type",
        default="gpt",
        choices=["gpt"],
        help="Model family: decoder-style stack; attention direction comes from --attention-mask-type.",
    )
    _add(
        g,
        "--attention-backend",
        default="auto",
        choices=["auto", "flash", "fused", "unfused", "local"],
        help="Megatron attention kernel choice (no effect: torch SDPA picks the kernel).",
    )
    _add(
        g,
        "--attention-softmax-in-fp32",
        action="store_true",
        help="Accepted for Megatron scripts (no effect).",
    )
    for name in ("gelu", "dropout", "swiglu"):
        _add(
            g,
            f"--no-bias-{name}-fusion",
            action="store_false",
            dest=f"bias_{name}_fusion",
            help="Accepted for Megatron scripts (no fused kernels; no effect).",
        )
    _add(g, "--num-experts", type=int, default=None, help="Mixture of experts (not supported yet).")


def _difflm_args(p):
    g = p.add_argument_group("difflm (diffusion language model)")
    _add(
        g,
        "--model-running-mode",
        default="difflm-noshift",
        choices=["difflm-noshift", "vanilla"],
        help="difflm-noshift: masked diffusion LM on unshifted tokens; vanilla: autoregressive "
        "(causal, shifted labels).",
    )
    _add(
        g,
        "--base-model",
        default="vanilla",
        choices=["vanilla"],
        help="MegaDLMs model series (only vanilla).",
    )
    _add(
        g,
        "--mask-token",
        type=_int_or_str,
        default=None,
        help="Mask token id or string. Default: the tokenizer's mask token.",
    )
    _add(
        g,
        "--attention-mask-type",
        default=None,
        choices=["no_mask", "causal", "causal_bottom_right", "block_causal"],
        help="no_mask (bidirectional) or causal. Default: no_mask for difflm-noshift, causal for vanilla "
        "(MegaDLMs: causal_bottom_right). causal_bottom_right equals causal here (queries and keys have "
        "the same length); vanilla mode always runs causal (as MegaDLMs); block_causal needs MegaDLMs' "
        "conditional mode (not available).",
    )
    _add(
        g,
        "--core-attn-implementation",
        default="TEDotProductAttention",
        choices=["TEDotProductAttention", "FlexAttention"],
        help="Attention kernel: TEDotProductAttention runs torch SDPA (with a boolean block mask when "
        "packing documents), FlexAttention runs torch flex_attention with a document block mask.",
    )
    _add(
        g,
        "--difflm-mask-eps",
        type=float,
        default=None,
        help="Mask probability p = (1-eps)*t + eps. "
        "Default: 0 (MegaDLMs), 1e-3 with --difflm-objective llada.",
    )
    _add(
        g,
        "--difflm-p-mask",
        default=None,
        choices=["sampled", "realised"],
        help="Weight the loss by the realised mask fraction with >= 1 masked token per row (default, "
        "MegaDLMs) or the sampled p (--difflm-objective llada's default).",
    )
    _add(
        g,
        "--difflm-varilen-prob",
        type=float,
        default=0.01,
        help="Probability that a step's batch is cropped to a random length (same on every rank).",
    )
    _add(
        g,
        "--difflm-eval-mc-samples",
        type=int,
        default=1,
        help="K: Monte Carlo samples (stratified t, fixed seed) of the validation NELBO (1: one forward "
        "per eval batch, as MegaDLMs).",
    )
    _add(
        g,
        "--difflm-objective",
        default="megadlms",
        choices=["megadlms", "llada"],
        help="megadlms (default): MegaDLMs' difflm-noshift objective (model input and target text[1:L], "
        "eps 0, realised mask fraction, >= 1 masked token per row, a per-micro-batch crop); llada: "
        "LLaDA's (target text[1:S+1], eps 1e-3, sampled p, one crop per step).",
    )


def _parallel_args(p):
    g = p.add_argument_group("distributed")
    _add(
        g,
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Tensor parallel size (only 1 supported yet).",
    )
    _add(
        g,
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="Pipeline parallel size (only 1 supported yet).",
    )
    _add(
        g,
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="Expert parallel size (only 1 supported yet).",
    )
    _add(
        g,
        "--context-parallel-size",
        type=int,
        default=1,
        help="Context parallel size (only 1 supported yet).",
    )
    _add(
        g,
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Interleaved pipeline schedule (not supported yet).",
    )
    _add(
        g,
        "--sequence-parallel",
        action="store_true",
        help="Megatron sequence parallelism (off when TP is 1).",
    )
    _add(
        g,
        "--data-parallel-size",
        type=int,
        default=None,
        help="Data-parallel size; derived as world / (TP x PP). When given it must equal that.",
    )
    _add(
        g,
        "--use-torch-fsdp2",
        action="store_true",
        help="Shard params, grads and optimizer state with PyTorch FSDP2 instead of DDP.",
    )
    _add(
        g,
        "--torch-fsdp2-no-reshard-after-forward",
        action="store_false",
        dest="torch_fsdp2_reshard_after_forward",
        help="FSDP2: keep gathered params after forward (accepted; the trainer always reshards).",
    )
    _add(
        g,
        "--use-distributed-optimizer",
        action="store_true",
        help="DDP: reduce-scatter grads and shard fp32 main params + Adam state across ranks.",
    )
    _add(
        g,
        "--num-distributed-optimizer-instances",
        type=int,
        default=1,
        help="Partial distributed optimizer replicas (only 1 supported yet).",
    )
    _add(
        g,
        "--overlap-grad-reduce",
        action="store_true",
        help="Launch each bucket's grad collective during backward.",
    )
    _add(
        g,
        "--overlap-param-gather",
        action="store_true",
        help="Distributed optimizer: all-gather updated params during the next forward.",
    )
    _add(
        g,
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="Elements per grad bucket (default: Megatron's rule).",
    )
    _add(
        g,
        "--ddp-average-in-collective",
        action="store_true",
        help="Average inside the collective (ReduceOp.AVG) instead of pre-scaling by 1/dp.",
    )
    _add(
        g,
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="Keep and reduce grads in fp32 with bf16/fp16 params (implied by --bf16).",
    )
    _add(
        g,
        "--no-gradient-accumulation-fusion",
        action="store_false",
        dest="gradient_accumulation_fusion",
        default=None,
        help="Disable fused weight-gradient accumulation (megadlms has no such kernel: always off).",
    )
    _add(
        g,
        "--distributed-backend",
        default=None,
        choices=["nccl", "gloo"],
        help="torch.distributed backend. Default: nccl when CUDA is available, else gloo.",
    )
    _add(g, "--distributed-timeout-minutes", type=int, default=10, help="Timeout of collectives, minutes.")
    _add(
        g,
        "--comm-backend",
        default="torch",
        choices=["torch", "nccl_ext"],
        help="DDP collectives through torch.distributed or the extension's own NCCL communicator (GPU).",
    )
    _add(
        g,
        "--local-rank",
        "--local_rank",
        type=int,
        default=None,
        help="Set by old launchers; torchrun passes LOCAL_RANK in the environment instead.",
    )


def _precision_args(p):
    g = p.add_argument_group("mixed precision")
    _add(g, "--bf16", action="store_true", help="bf16 params/compute, fp32 main params and grad reduction.")
    _add(g, "--fp16", action="store_true", help="fp16 params/compute with loss scaling (DDP only).")
    _add(g, "--loss-scale", type=float, default=None, help="Static fp16 loss scale; default dynamic scaling.")
    _add(g, "--initial-loss-scale", type=float, default=2.0**32, help="Initial dynamic loss scale.")
    _add(g, "--min-loss-scale", type=float, default=1.0, help="Lower bound of the dynamic loss scale.")
    _add(g, "--loss-scale-window", type=float, default=1000, help="Clean steps before the loss scale grows.")
    _add(g, "--hysteresis", type=int, default=2, help="Overflows tolerated before the loss scale backs off.")
    _add(
        g,
        "--fp8-format",
        dest="fp8",
        default=None,
        choices=["e4m3", "hybrid"],
        help="FP8 training (not supported yet).",
    )


def _training_args(p):
    g = p.add_argument_group("training / optimisation")
    _add(
        g, "--micro-batch-size", type=int, default=None, help="Sequences per rank per micro-step (required)."
    )
    _add(
        g,
        "--global-batch-size",
        type=int,
        default=None,
        help="Sequences per optimizer step; a multiple of micro-batch x dp. Default micro-batch x dp.",
    )
    _add(g, "--rampup-batch-size", nargs="*", default=None, help="Batch-size ramp-up (not supported yet).")
    _add(g, "--train-iters", type=int, default=None, help="Optimizer steps to train (required).")
    _add(
        g,
        "--train-samples",
        type=int,
        default=None,
        help="Sample-based training (not supported yet; use --train-iters).",
    )
    _add(
        g,
        "--optimizer",
        default="adam",
        choices=["adam", "sgd"],
        help="AdamW (decoupled weight decay) or SGD.",
    )
    _add(g, "--lr", type=float, default=None, help="Peak learning rate (required).")
    _add(g, "--min-lr", type=float, default=0.0, help="Learning-rate floor after decay.")
    _add(
        g,
        "--lr-decay-style",
        default="linear",
        choices=["constant", "linear", "cosine", "WSD"],
        help="Learning-rate decay after warmup.",
    )
    _add(g, "--lr-warmup-iters", type=int, default=0, help="Linear warmup steps.")
    _add(
        g, "--lr-warmup-fraction", type=float, default=None, help="Warmup as a fraction of --lr-decay-iters."
    )
    _add(g, "--lr-warmup-init", type=float, default=0.0, help="Learning rate at the start of warmup.")
    _add(
        g,
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Steps over which the LR decays (incl. warmup). Default --train-iters.",
    )
    _add(
        g,
        "--lr-wsd-decay-style",
        default="exponential",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
        help="WSD: shape of the final decay phase.",
    )
    _add(
        g,
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        dest="override_opt_param_scheduler",
        help="On resume, take the LR schedule from these flags instead of the checkpoint.",
    )
    _add(
        g,
        "--lr-wsd-decay-iters",
        type=int,
        default=None,
        help="WSD: length of the final decay phase (required for WSD).",
    )
    _add(g, "--weight-decay", type=float, default=0.01, help="Decoupled weight decay (not on biases/norms).")
    _add(g, "--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    _add(g, "--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    _add(g, "--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    _add(g, "--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    _add(g, "--clip-grad", type=float, default=1.0, help="Clip the global grad L2 norm to this (0 disables).")
    _add(g, "--seed", type=int, default=1234, help="Seed of init, masking noise and data order.")
    _add(
        g,
        "--nan-skip-limit",
        type=int,
        default=10,
        help="Steps with a NaN/Inf loss are skipped on every rank; after this many the run stops "
        "(0: stop at the first).",
    )
    _add(
        g,
        "--no-check-for-nan-in-loss-and-grad",
        action="store_false",
        dest="check_for_nan_in_loss_and_grad",
        help="Do not check loss and reduced grads for NaN/Inf.",
    )
    _add(
        g,
        "--rerun-mode",
        default="disabled",
        choices=["disabled", "validate_results", "report_stats"],
        help="Megatron rerun state machine (no effect; NaN/Inf handling is --nan-skip-limit).",
    )
    _add(
        g,
        "--recompute-granularity",
        default=None,
        choices=["full", "selective"],
        help="Activation recompute (not supported yet).",
    )
    _add(g, "--recompute-activations", action="store_true", help="Activation recompute (not supported yet).")


def _data_args(p):
    g = p.add_argument_group("data")
    _add(
        g,
        "--data-path",
        nargs="*",
        default=None,
        help="Blend of .bin/.idx prefixes: 'PREFIX' or 'W1 P1 W2 P2 ...'.",
    )
    _add(
        g,
        "--train-data-path",
        nargs="*",
        default=None,
        help="Training blend (instead of --data-path + --split).",
    )
    _add(g, "--valid-data-path", nargs="*", default=None, help="Validation blend.")
    _add(g, "--test-data-path", nargs="*", default=None, help="Test blend.")
    _add(
        g,
        "--split",
        default=None,
        help="Train/valid/test split of --data-path, e.g. '969,30,1' (the default).",
    )
    _add(g, "--mock-data", action="store_true", help="Random tokens instead of files (smoke tests).")
    _add(
        g,
        "--tokenizer-type",
        default=None,
        choices=["ByteTokenizer", "HuggingFaceTokenizer"],
        help="ByteTokenizer (offline: 256 bytes + eod/mask/pad) or a tokenizers-library tokenizer.json. "
        "Default: HuggingFaceTokenizer with --tokenizer-model (as MegaDLMs), else ByteTokenizer.",
    )
    _add(
        g,
        "--tokenizer-model",
        default=None,
        help="HuggingFaceTokenizer: tokenizer.json file or its directory.",
    )
    _add(g, "--data-cache-path", default=None, help="Directory for the dataset index caches.")
    _add(g, "--eod-mask-loss", action="store_true", help="No loss on end-of-document tokens.")
    _add(g, "--num-workers", type=int, default=2, help="DataLoader worker processes.")
    _add(
        g,
        "--reset-position-ids",
        action="store_true",
        help="Position ids restart after every end-of-document token (Megatron).",
    )
    _add(
        g,
        "--reset-attention-mask",
        action="store_true",
        help="With --reset-position-ids: document packing, each token attends only within its document.",
    )


def _checkpoint_args(p):
    g = p.add_argument_group("checkpointing")
    _add(g, "--save", default=None, help="Directory to save checkpoints to.")
    _add(g, "--load", default=None, help="Directory to resume from (latest_checkpointed_iteration.txt).")
    _add(g, "--save-interval", type=int, default=None, help="Save every N steps (required with --save).")
    _add(
        g,
        "--ckpt-format",
        default="torch_dist",
        choices=["torch_dist", "torch", "torch_dcp", "fsdp_dtensor", "zarr"],
        help="torch_dist: sharded torch.distributed.checkpoint, reshardable across wrappers and dp sizes; "
        "torch: one rank-0 file.",
    )
    _add(
        g,
        "--auto-detect-ckpt-format",
        action="store_true",
        help="Accepted for Megatron scripts (the format is always read from the checkpoint).",
    )
    _add(
        g,
        "--ckpt-fully-parallel-load",
        action="store_true",
        help="Accepted for Megatron scripts (no effect).",
    )
    _add(
        g,
        "--async-save",
        action="store_true",
        help="Write torch_dist checkpoints in the background while training continues; the next save "
        "and the exit wait for the previous one (docs/reliability.md).",
    )
    _add(g, "--no-load-optim", action="store_true", help="Do not load optimizer state.")
    _add(g, "--no-load-rng", action="store_true", help="Do not load RNG states.")
    _add(g, "--no-save-optim", action="store_true", help="Do not save optimizer state.")
    _add(g, "--no-save-rng", action="store_true", help="Do not save RNG states.")
    _add(
        g,
        "--finetune",
        action="store_true",
        help="Load weights only; reset iteration, optimizer and scheduler.",
    )
    _add(
        g,
        "--use-checkpoint-args",
        action="store_true",
        help="Take model flags from the checkpoint (not supported yet).",
    )
    _add(
        g,
        "--exit-interval",
        type=int,
        default=None,
        help="Save and exit when the iteration is a multiple of N.",
    )
    _add(
        g, "--exit-duration-in-mins", type=float, default=None, help="Save and exit after this many minutes."
    )
    _add(
        g, "--exit-signal-handler", action="store_true", help="On SIGTERM save a checkpoint and exit cleanly."
    )
    _add(
        g,
        "--non-persistent-save-interval",
        type=int,
        default=None,
        help="Accepted for Megatron scripts (no effect).",
    )
    _add(
        g,
        "--non-persistent-ckpt-type",
        default=None,
        choices=["global", "local", "in_memory"],
        help="Accepted for Megatron scripts (no effect).",
    )
    _add(
        g, "--non-persistent-global-ckpt-dir", default=None, help="Accepted for Megatron scripts (no effect)."
    )
    _add(
        g,
        "--no-auto-resume",
        dest="auto_resume",
        action="store_false",
        help="With --save and no --load, start from scratch even if --save holds a checkpoint "
        "(default: resume from it, as Megatron does with --load equal to --save).",
    )
    _add(
        g,
        "--ckpt-fallback",
        action="store_true",
        help="If the checkpoint to resume fails verification (corrupt, truncated or missing file), load "
        "the newest older complete checkpoint instead of stopping with an error.",
    )


def _logging_args(p):
    g = p.add_argument_group("logging / evaluation")
    _add(g, "--log-interval", type=int, default=100, help="Print a progress line every N steps.")
    _add(g, "--eval-interval", type=int, default=1000, help="Validation NELBO every N steps.")
    _add(g, "--eval-iters", type=int, default=100, help="Validation batches per evaluation (0 disables).")
    _add(
        g,
        "--tensorboard-dir",
        default=None,
        help="Write TensorBoard scalars here (if tensorboard is installed).",
    )
    _add(
        g,
        "--log-throughput",
        action="store_true",
        help="Accepted for Megatron scripts (tokens/s and TFLOP/s are always logged).",
    )
    _add(g, "--log-params-norm", action="store_true", help="Log the global parameter L2 norm (pnorm).")
    _add(
        g,
        "--metrics-jsonl",
        default=None,
        help="Append one JSON object per logged step (iteration, consumed_samples, lm_loss, lr, grad_norm, "
        "loss_scale, skipped, tokens_per_sec, event='train'; at eval a separate event='eval' "
        "record with valid_nelbo and valid_ppl_bound).",
    )
    for flag in (
        "--log-num-zeros-in-grad",
        "--log-progress",
        "--log-timers-to-tensorboard",
        "--log-validation-ppl-to-tensorboard",
        "--log-memory-to-tensorboard",
    ):
        _add(g, flag, action="store_true", help="Accepted for Megatron scripts (no effect).")
    _add(g, "--wandb-project", default="", help="Accepted for Megatron scripts (no wandb client; no effect).")
    for flag in (
        "--wandb-exp-name",
        "--wandb-run-id",
        "--wandb-save-dir",
        "--wandb-mode",
        "--wandb-tags",
        "--wandb-notes",
        "--wandb-resume",
        "--wandb-group",
    ):
        _add(g, flag, default=None, help="Accepted with --wandb-project (no effect).")


def _megadlms_args(p):
    """MegaDLMs-only flags (custom_args/difflm.py) beyond the objective's."""
    g = p.add_argument_group("MegaDLMs")
    for flag, why in (
        ("--debug", "MegaDLMs debug mode (no effect)"),
        ("--turn-on-debugpy", "attach debugpy (no effect)"),
        ("--use-on-the-fly-eval", "MegaDLMs' on-the-fly downstream eval (not available; no effect)"),
        ("--gpt-block-return-loss-and-logits", "MegaDLMs model API detail (no effect on training)"),
    ):
        _add(g, flag, action="store_true", help=f"Accepted for MegaDLMs scripts: {why}.")
    _add(
        g,
        "--detect-anomaly",
        action="store_true",
        help="Run forward/backward under torch.autograd.detect_anomaly (slow; names the op making a NaN).",
    )
    _add(
        g,
        "--non-special-vocab-size",
        type=int,
        default=None,
        help="MegaDLMs' size of the non-special vocabulary, used by its uniform-noise modes only "
        "(accepted; no effect in difflm-noshift).",
    )
    _add(
        g,
        "--cut-off-varlen-to-seqlen",
        action="store_true",
        help="Document packing: also cut documents at every --seq-length boundary (packing here never "
        "crosses samples, so this is always the behaviour; MegaDLMs requires the flag).",
    )
    _add(
        g,
        "--checkpoint-steps",
        default=None,
        help="Also save at these iterations, comma-separated (e.g. '100,2000').",
    )


def _interop_args(p):
    g = p.add_argument_group("Hugging Face interop / checkpoint conversion")
    _add(
        g,
        "--hf-init",
        default=None,
        help="Initialise the model from a local Hugging Face Llama/Qwen2 (or megadlms export) directory; "
        "the model flags must match its config.json.",
    )
    _add(
        g,
        "--ckpt-convert-format",
        default=None,
        choices=["torch", "torch_dist"],
        help="Convert the --load checkpoint to this format into --ckpt-convert-save/<format>, then exit.",
    )
    _add(g, "--ckpt-convert-save", default=None, help="Root directory of the converted checkpoint.")


def build_parser() -> argparse.ArgumentParser:
    """The full Megatron-compatible parser (no validation; see :func:`parse_args`)."""
    p = argparse.ArgumentParser(
        prog="pretrain_difflm.py",
        allow_abbrev=False,
        description="Pretrain a diffusion language model (megadlms).",
    )
    for add in (
        _model_args,
        _difflm_args,
        _parallel_args,
        _precision_args,
        _training_args,
        _data_args,
        _checkpoint_args,
        _logging_args,
        _megadlms_args,
        _interop_args,
    ):
        add(p)
    return p
