"""Parallelism flags: the parallel sizes (TP, PP, EP, CP, DP), the data-parallel wrapper
(DDP / FSDP2) and its buckets, gradient accumulation and the collectives' backend (the
"distributed" group), then the pipeline layout and the context-parallel communication groups."""

from __future__ import annotations

from ._flag import add_flag


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


def pipeline_args(p):
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
    add_flag(
        g,
        "--variable-seq-lengths",
        action="store_true",
        help="Accepted for Megatron scripts (no effect): every pipeline stage computes each "
        "micro-batch's activation shape from its crop, so lengths may vary without a shape exchange.",
    )


CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


def cp_args(p) -> None:
    """--cp-comm-type: accepted with Megatron's choices; attention always all-gathers K/V here
    (a different choice changes speed and memory, never the numbers: noted once at start)."""
    g = p.add_argument_group("context parallelism")
    add_flag(
        g,
        "--cp-comm-type",
        nargs="+",
        choices=CP_COMM_TYPES,
        default=["allgather"],
        help="How attention communicates across the context-parallel ranks (Megatron: p2p ring, "
        "a2a, allgather, a2a+p2p; one value or one per layer). megadlms always all-gathers K/V "
        "(the default here); other values are accepted and noted as without effect.",
    )
