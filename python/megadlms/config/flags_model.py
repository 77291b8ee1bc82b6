"""Model, diffusion-objective, parallelism and precision flags (the parser's first groups;
``flags.build_parser`` assembles the whole parser)."""

from __future__ import annotations


def _int_or_str(value: str):
    # A token string that looks like a number would be taken as an id: name such tokens by their id.
    return int(value) if value.lstrip("-").isdigit() else value


def add_flag(group, *flags, help, **kw):  # noqa: A002 - argparse's name
    """``group.add_argument`` with ``help`` required (every flag documents itself)."""
    group.add_argument(*flags, help=help, **kw)


def model_args(p):
    """The transformer's shape and layers."""
    g = p.add_argument_group("model")
    for add in (_model_shape_flags, _model_layer_flags, _model_init_flags, _model_inert_flags):
        add(g)


def _model_shape_flags(g):
    """Layers, widths, heads and sequence length."""
    add_flag(g, "--num-layers", type=int, default=None, help="Number of transformer layers (required).")
    add_flag(g, "--hidden-size", type=int, default=None, help="Transformer hidden size (required).")
    add_flag(
        g,
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="MLP hidden size. Default 4*hidden-size, or int(8*hidden/3/64)*64 with --swiglu "
        "(Megatron's rule).",
    )
    add_flag(
        g,
        "--num-attention-heads",
        type=int,
        default=None,
        help="Number of attention (query) heads (required).",
    )
    add_flag(
        g,
        "--group-query-attention",
        action="store_true",
        help="Use grouped-query attention (with --num-query-groups).",
    )
    add_flag(
        g,
        "--num-query-groups",
        type=int,
        default=1,
        help="Key/value head groups with --group-query-attention; without it, equals --num-attention-heads.",
    )
    add_flag(
        g,
        "--kv-channels",
        type=int,
        default=None,
        help="Per-head dimension. Default hidden-size / num-attention-heads.",
    )
    add_flag(g, "--seq-length", type=int, default=None, help="Training sequence length in tokens (required).")
    add_flag(
        g,
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Longest sequence the model accepts (learned position table size). Default --seq-length.",
    )


def _model_layer_flags(g):
    """Position encoding, normalisation, MLP and bias choices."""
    add_flag(
        g,
        "--position-embedding-type",
        default="learned_absolute",
        choices=["learned_absolute", "rope"],
        help="Position encoding: learned absolute table or rotary (RoPE).",
    )
    add_flag(g, "--rotary-base", type=int, default=10000, help="RoPE base frequency.")
    add_flag(
        g,
        "--rotary-percent",
        type=float,
        default=1.0,
        help="Fraction of head dim rotated (only 1.0 supported).",
    )
    add_flag(
        g,
        "--normalization",
        default="LayerNorm",
        choices=["LayerNorm", "RMSNorm"],
        help="Normalisation layer type.",
    )
    add_flag(g, "--norm-epsilon", type=float, default=1e-5, help="Epsilon of LayerNorm/RMSNorm.")
    add_flag(g, "--swiglu", action="store_true", help="SwiGLU MLP (gated SiLU) instead of GeLU.")
    add_flag(
        g,
        "--disable-bias-linear",
        action="store_false",
        dest="add_bias_linear",
        help="No bias in the linear layers.",
    )
    add_flag(
        g,
        "--add-qkv-bias",
        action="store_true",
        help="Bias on the QKV projection even with --disable-bias-linear (Qwen2).",
    )
    add_flag(
        g, "--qk-layernorm", action="store_true", help="Normalise queries and keys per head before attention."
    )


def _model_init_flags(g):
    """Embeddings, dropout, initialisation and vocabulary."""
    add_flag(
        g,
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Separate output-layer weight instead of reusing the input embedding "
        "(required by --use-torch-fsdp2).",
    )
    add_flag(g, "--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    add_flag(
        g, "--hidden-dropout", type=float, default=0.1, help="Dropout on hidden states (residual branches)."
    )
    add_flag(
        g, "--init-method-std", type=float, default=0.02, help="Std of the normal weight initialisation."
    )
    add_flag(g, "--vocab-size", type=int, default=None, help="Vocabulary size. Default: the tokenizer's.")
    add_flag(
        g,
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the embedding rows to a multiple of this.",
    )
    add_flag(
        g,
        "--model-type",
        default="gpt",
        choices=["gpt"],
        help="Model family: decoder-style stack; attention direction comes from --attention-mask-type.",
    )


def _model_inert_flags(g):
    """Megatron kernel choices accepted without effect (megatron_compat.py)."""
    add_flag(
        g,
        "--attention-backend",
        default="auto",
        choices=["auto", "flash", "fused", "unfused", "local"],
        help="Megatron attention kernel choice (no effect: torch SDPA picks the kernel).",
    )
    add_flag(
        g,
        "--attention-softmax-in-fp32",
        action="store_true",
        help="Accepted for Megatron scripts (no effect).",
    )
    # Negative flags with positive dests (store_false): the inert value in megatron_compat is True.
    for name in ("gelu", "dropout"):
        add_flag(
            g,
            f"--no-bias-{name}-fusion",
            action="store_false",
            dest=f"bias_{name}_fusion",
            help="Accepted for Megatron scripts (no fused kernels; no effect).",
        )


def difflm_args(p):
    """The diffusion-LM objective (MegaDLMs' custom_args/difflm.py)."""
    g = p.add_argument_group("difflm (diffusion language model)")
    for add in (_difflm_mode_flags, _difflm_objective_flags):
        add(g)


def _difflm_mode_flags(g):
    """Diffusion or autoregressive mode, mask token and attention."""
    add_flag(
        g,
        "--model-running-mode",
        default="difflm-noshift",
        choices=["difflm-noshift", "vanilla"],
        help="difflm-noshift: masked diffusion LM on unshifted tokens; vanilla: autoregressive "
        "(causal, shifted labels).",
    )
    add_flag(
        g,
        "--base-model",
        default="vanilla",
        choices=["vanilla"],
        help="MegaDLMs model series (only vanilla).",
    )
    add_flag(
        g,
        "--mask-token",
        type=_int_or_str,
        default=None,
        help="Mask token id or string. Default: the tokenizer's mask token.",
    )
    add_flag(
        g,
        "--attention-mask-type",
        default=None,
        choices=["no_mask", "causal", "causal_bottom_right", "block_causal"],
        help="no_mask (bidirectional) or causal. Default: no_mask for difflm-noshift, causal for vanilla "
        "(MegaDLMs: causal_bottom_right). causal_bottom_right equals causal here (queries and keys have "
        "the same length); vanilla mode always runs causal (as MegaDLMs); block_causal needs MegaDLMs' "
        "conditional mode (not available).",
    )
    add_flag(
        g,
        "--core-attn-implementation",
        default="TEDotProductAttention",
        choices=["TEDotProductAttention", "FlexAttention"],
        help="Attention kernel: TEDotProductAttention runs torch SDPA (with a boolean block mask when "
        "packing documents), FlexAttention runs torch flex_attention with a document block mask.",
    )


def _difflm_objective_flags(g):
    """The masking objective and its evaluation."""
    add_flag(
        g,
        "--difflm-mask-eps",
        type=float,
        default=None,
        help="Mask probability p = (1-eps)*t + eps. "
        "Default: 0 (MegaDLMs), 1e-3 with --difflm-objective llada.",
    )
    add_flag(
        g,
        "--difflm-p-mask",
        default=None,
        choices=["sampled", "realised"],
        help="Weight the loss by the realised mask fraction with >= 1 masked token per row (default, "
        "MegaDLMs) or the sampled p (--difflm-objective llada's default).",
    )
    add_flag(
        g,
        "--difflm-varilen-prob",
        type=float,
        default=0.01,
        help="Probability that a step's batch is cropped to a random length (same on every rank).",
    )
    add_flag(
        g,
        "--difflm-eval-mc-samples",
        type=int,
        default=1,
        help="K: Monte Carlo samples (stratified t, fixed seed) of the validation NELBO (1: one forward "
        "per eval batch, as MegaDLMs).",
    )
    add_flag(
        g,
        "--difflm-objective",
        default="megadlms",
        choices=["megadlms", "llada"],
        help="megadlms (default): MegaDLMs' difflm-noshift objective (model input and target text[1:L], "
        "eps 0, realised mask fraction, >= 1 masked token per row, a per-micro-batch crop); llada: "
        "LLaDA's (target text[1:S+1], eps 1e-3, sampled p, one crop per step).",
    )


def parallel_args(p):
    """Parallel sizes, the data-parallel wrapper and the collectives."""
    g = p.add_argument_group("distributed")
    for add in (_parallel_size_flags, _data_parallel_flags, _grad_accumulation_flags, _backend_flags):
        add(g)


def _parallel_size_flags(g):
    """The parallel sizes (Megatron's names)."""
    add_flag(
        g,
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Tensor parallel size: layers split over this many adjacent ranks (Megatron TP).",
    )
    add_flag(
        g,
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="Pipeline parallel size: the decoder layers split over this many stages (DDP only).",
    )
    add_flag(
        g,
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="Expert parallel size: the experts of every MoE layer are split over this many "
        "data-parallel ranks (must divide the data-parallel size and --num-experts).",
    )
    add_flag(
        g,
        "--context-parallel-size",
        type=int,
        default=1,
        help="Context parallel size: the sequence of every micro-batch is split over this many "
        "ranks (contiguous for bidirectional attention, Megatron's 2C-chunk load-balanced split "
        "for causal); attention all-gathers K/V over them. Not with FSDP2, MoE or "
        "--reset-attention-mask.",
    )
    add_flag(
        g,
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Interleaved 1F1B schedule: layers per virtual pipeline stage (model chunk).",
    )
    add_flag(
        g,
        "--sequence-parallel",
        action="store_true",
        help="Megatron sequence parallelism: activations outside the TP region are split on the "
        "sequence dim (off when TP is 1).",
    )
    add_flag(
        g,
        "--data-parallel-size",
        type=int,
        default=None,
        help="Data-parallel size; derived as world / (TP x PP). When given it must equal that.",
    )


def _data_parallel_flags(g):
    """The data-parallel wrapper and its buckets."""
    add_flag(
        g,
        "--use-torch-fsdp2",
        action="store_true",
        help="Shard params, grads and optimizer state with PyTorch FSDP2 instead of DDP (over dp; "
        "with --tensor-model-parallel-size each TP rank's shards are sharded again over dp).",
    )
    add_flag(
        g,
        "--torch-fsdp2-no-reshard-after-forward",
        action="store_false",
        dest="torch_fsdp2_reshard_after_forward",
        help="FSDP2 (ZeRO-2): keep each unit's gathered params after forward and through the step's "
        "micro-batches (one all-gather per step instead of two per micro-batch; the unsharded "
        "params stay in memory for the step).",
    )
    add_flag(
        g,
        "--use-distributed-optimizer",
        action="store_true",
        help="DDP: reduce-scatter grads and shard fp32 main params + Adam state across ranks.",
    )
    add_flag(
        g,
        "--num-distributed-optimizer-instances",
        type=int,
        default=1,
        help="Distributed-optimizer instances: state sharded within each of N groups of dp/N ranks, "
        "gradients all-reduced across them (Megatron; MegaDLMs passes the node count). With "
        "--use-torch-fsdp2: hybrid sharding (HSDP), FSDP2 shards within each group and replicates "
        "across them (Megatron-FSDP's DP-outer size).",
    )
    add_flag(
        g,
        "--overlap-grad-reduce",
        action="store_true",
        help="Launch each bucket's grad collective during backward.",
    )
    add_flag(
        g,
        "--overlap-param-gather",
        action="store_true",
        help="Distributed optimizer: all-gather updated params during the next forward.",
    )
    add_flag(
        g,
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="Elements per grad bucket (default: Megatron's rule).",
    )
    add_flag(
        g,
        "--ddp-average-in-collective",
        action="store_true",
        help="Average inside the collective (ReduceOp.AVG) instead of pre-scaling by 1/dp.",
    )


def _grad_accumulation_flags(g):
    """Where weight gradients accumulate."""
    add_flag(
        g,
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="Keep and reduce grads in fp32 with bf16/fp16 params (implied by --bf16).",
    )
    add_flag(
        g,
        "--gradient-accumulation-fusion",
        action="store_true",
        dest="gradient_accumulation_fusion",
        default=None,
        help="Weight-gradient GEMMs accumulate straight into the fp32 main_grad (default on with DDP, "
        "off with FSDP2; passing it with --use-torch-fsdp2 is an error).",
    )
    add_flag(
        g,
        # Both flags share one dest with default None: None means "not given", resolved by ParallelConfig
        # (on for DDP, off for FSDP2), so an explicit --gradient-accumulation-fusion can be refused.
        "--no-gradient-accumulation-fusion",
        action="store_false",
        dest="gradient_accumulation_fusion",
        default=None,
        help="Disable fused weight-gradient accumulation (a separate param.grad per weight).",
    )


def _backend_flags(g):
    """torch.distributed and the collectives' backend."""
    add_flag(
        g,
        "--distributed-backend",
        default=None,
        choices=["nccl", "gloo"],
        help="torch.distributed backend. Default: nccl when CUDA is available, else gloo.",
    )
    add_flag(
        g, "--distributed-timeout-minutes", type=int, default=10, help="Timeout of collectives, minutes."
    )
    add_flag(
        g,
        "--comm-backend",
        default="torch",
        choices=["torch", "nccl_ext"],
        help="DDP collectives through torch.distributed or the extension's own NCCL communicator (GPU).",
    )
    add_flag(
        g,
        "--local-rank",
        "--local_rank",
        type=int,
        default=None,
        help="Set by old launchers; torchrun passes LOCAL_RANK in the environment instead.",
    )


def precision_args(p):
    """bf16 / fp16 and fp16 loss scaling."""
    g = p.add_argument_group("mixed precision")
    add_flag(
        g, "--bf16", action="store_true", help="bf16 params/compute, fp32 main params and grad reduction."
    )
    add_flag(g, "--fp16", action="store_true", help="fp16 params/compute with loss scaling (DDP only).")
    add_flag(
        g, "--loss-scale", type=float, default=None, help="Static fp16 loss scale; default dynamic scaling."
    )
    # Megatron's defaults: start high and let the first overflows back the scale off quickly.
    add_flag(g, "--initial-loss-scale", type=float, default=2.0**32, help="Initial dynamic loss scale.")
    add_flag(g, "--min-loss-scale", type=float, default=1.0, help="Lower bound of the dynamic loss scale.")
    add_flag(
        g, "--loss-scale-window", type=float, default=1000, help="Clean steps before the loss scale grows."
    )
    add_flag(
        g, "--hysteresis", type=int, default=2, help="Overflows tolerated before the loss scale backs off."
    )
    add_flag(
        g,
        "--fp8-format",
        dest="fp8",
        default=None,
        choices=["e4m3", "hybrid"],
        help="FP8 training (not supported yet).",
    )
