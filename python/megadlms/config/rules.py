"""The rules that span several configs (a rule about one config's own fields lives in its
``__post_init__``), each stated once.

Where a lower layer knows a constraint it owns the rule as a ``*_problems`` function worded
with field names, and its run-time guard raises that same function's message; this module
only calls it at parse time and says it with flags (:func:`~.messages.flag_message`):

    FSDP2's limits            distributed.fsdp2.fsdp2_config_problems
    FSDP2 + fp16              optimizer.dtensor_problems
    EP + optimizer instances  distributed.ddp_groups.expert_instances_problems
    micro-batches vs pp       pipeline.micro_batch_problems
    the pipeline layer split  pipeline.stage_layers
    the data source           data.data_source_problems (called by DataConfig)
    TP / EP shapes            models.config.tensor_parallel_problems / expert_parallel_problems
    activation recompute      models.recompute.recompute_problems
    optimizer instances / dp  parallel.groups.check_instances
    context parallelism       parallel.context_parallel.context_parallel_problems
    precision-aware optimizer optimizer.precision_aware_problems
"""

from __future__ import annotations

from typing import List, Optional

import torch

from megadlms.distributed import DistributedDataParallelConfig
from megadlms.distributed.ddp_groups import expert_instances_problems
from megadlms.distributed.fsdp2 import fsdp2_config_problems, torch_supports_fsdp2
from megadlms.models.config import expert_parallel_problems, tensor_parallel_problems
from megadlms.models.recompute import recompute_problems
from megadlms.optimizer import OptimizerConfig, dtensor_problems, precision_aware_problems
from megadlms.parallel.context_parallel import context_parallel_problems
from megadlms.parallel.groups import check_instances
from megadlms.pipeline import micro_batch_problems, stage_layers

from .flags.logging import logging_flag_problems
from .megatron_compat import UNSUPPORTED
from .messages import flag_message
from .profiling_config import ProfilingConfig
from .run_config import ParallelConfig


def checkpoint_steps(args) -> Optional[tuple]:
    """--checkpoint-steps '100,2000' -> (100, 2000); () when not given, None when malformed."""
    text = args.checkpoint_steps
    try:
        # None (not an exception) on a bad list: the caller reports it among the other problems.
        return tuple(int(x) for x in text.split(",") if x.strip()) if text else ()
    except ValueError:
        return None


def _unsupported_problems(args) -> List[str]:
    out = []
    for dest, flag, off in UNSUPPORTED:
        value = getattr(args, dest, off)
        if value != off:
            # A store_true flag is named alone: "--recompute-activations True" would not parse.
            shown = "" if isinstance(value, bool) else f" {value}"
            fix = "remove it" if off in (None, False) else f"remove it (or set it to {off})"
            out.append(f"{flag}{shown} is not supported yet by megadlms: {fix}")
    if args.attention_mask_type == "block_causal":
        out.append(
            "--attention-mask-type block_causal needs MegaDLMs' conditional mode, which megadlms does not "
            "have: use no_mask (block diffusion is --difflm-block-size B with no_mask)"
        )
    return out + _megadlms_problems(args)


def _megadlms_problems(args) -> List[str]:
    out = []
    if args.tokenizer_model and args.tokenizer_type == "ByteTokenizer":
        out.append(
            f"--tokenizer-model {args.tokenizer_model} is given with --tokenizer-type ByteTokenizer, "
            "which reads no model: drop --tokenizer-type (HuggingFaceTokenizer is the default with "
            "--tokenizer-model) or drop --tokenizer-model"
        )
    if args.core_attn_implementation == "FlexAttention" and args.attention_dropout > 0:
        out.append(
            f"--core-attn-implementation FlexAttention has no attention dropout: add --attention-dropout 0 "
            f"(got {args.attention_dropout}) or use TEDotProductAttention"
        )
    # Checked at parse time, not at the first backward: the CPU error would come after minutes of setup.
    if args.core_attn_implementation == "FlexAttention" and not torch.cuda.is_available():
        out.append(
            "--core-attn-implementation FlexAttention needs CUDA: torch's flex_attention has no CPU "
            "backward; use TEDotProductAttention (SDPA with a block mask) on CPU"
        )
    if checkpoint_steps(args) is None:
        out.append(f"--checkpoint-steps {args.checkpoint_steps!r}: expected comma-separated integers")
    return out


def _fsdp2_problems(args, ddp, optimizer) -> List[str]:
    """Megatron's rules for --use-torch-fsdp2, each with its fix. Tensor (and sequence)
    parallelism compose with it (FSDP2 shards each TP rank's local parameters over dp:
    distributed/fsdp2_grid.py), as does --num-distributed-optimizer-instances (HSDP)."""
    out = []
    for flag, value in (
        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
        ("--expert-model-parallel-size", args.expert_model_parallel_size),
    ):
        if value != 1:
            out.append(f"--use-torch-fsdp2 requires {flag} 1 (got {value})")
    if getattr(args, "num_experts", None) is not None:
        out.append(
            f"--use-torch-fsdp2 does not shard mixture-of-experts layers (--num-experts {args.num_experts}): "
            "drop --use-torch-fsdp2 (DDP, optionally with --use-distributed-optimizer and "
            "--expert-model-parallel-size) or drop --num-experts"
        )
    # The wrapper's own rules (distributed optimizer, param-gather overlap, comm backend): a
    # broken ddp config is reported by its own dataclass instead.
    if ddp is not None:
        out += [flag_message(p) for p in fsdp2_config_problems(ddp, who="use_torch_fsdp2")]
    if args.gradient_accumulation_fusion:
        out.append(
            "--use-torch-fsdp2 is incompatible with gradient accumulation fusion: "
            "add --no-gradient-accumulation-fusion"
        )
    if args.ckpt_format != "torch_dist":
        out.append(f"--use-torch-fsdp2 requires --ckpt-format torch_dist (got {args.ckpt_format})")
    if not args.untie_embeddings_and_output_weights:
        out.append(
            "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights "
            "(a tied weight cannot live in two FSDP units)"
        )
    if optimizer is not None:  # the optimizer's rule for DTensor (FSDP2) parameters
        out += [flag_message(p) for p in dtensor_problems(optimizer, who="use_torch_fsdp2")]
    if not torch_supports_fsdp2():
        out.append(
            f"--use-torch-fsdp2 requires PyTorch >= 2.4 (found {torch.__version__}): "
            "upgrade torch or drop --use-torch-fsdp2"
        )
    return out


def cross_flag_problems(
    args,
    ddp: Optional[DistributedDataParallelConfig] = None,
    optimizer: Optional[OptimizerConfig] = None,
) -> List[str]:
    """The rules worded with the flags themselves (unsupported features, the nccl_ext and FSDP2
    rules); ``ddp`` / ``optimizer``: the built configs, None when they failed their own checks."""
    out = _unsupported_problems(args) + logging_flag_problems(args)
    if args.comm_backend == "nccl_ext" and (
        args.distributed_backend == "gloo" or not torch.cuda.is_available()
    ):
        out.append(
            "--comm-backend nccl_ext needs CUDA GPUs and --distributed-backend nccl: "
            "use --comm-backend torch on CPU"
        )
    # nccl_ext with FSDP2 is fsdp2_config_problems' rule (comm_backend), reported below
    if args.use_torch_fsdp2:
        out += _fsdp2_problems(args, ddp, optimizer)
    out += [
        flag_message(p)
        for p in context_parallel_problems(
            args.context_parallel_size,
            use_torch_fsdp2=args.use_torch_fsdp2,
            reset_attention_mask=args.reset_attention_mask,
            num_moe_experts=args.num_experts,
            num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        )
    ]
    if optimizer is not None:
        out += [flag_message(p) for p in _precision_aware(args, optimizer)]
    return out + _sft_problems(args) + _shift_problems(args) + _block_problems(args)


def _block_problems(args) -> List[str]:
    """--difflm-block-size (block diffusion): what its [x_t ; x_0] pass runs with."""
    B, S = args.difflm_block_size, args.seq_length
    clip_flags = (("--difflm-noise-clip-low", args.difflm_noise_clip_low),
                  ("--difflm-noise-clip-high", args.difflm_noise_clip_high))  # fmt: skip
    clip = [f for f, v in clip_flags if v is not None]
    if args.difflm_ar_loss_weight is not None:
        clip.append("--difflm-ar-loss-weight")
    if B is None:
        return [f"{f} needs --difflm-block-size" for f in clip]
    out = []
    if args.difflm_ar_loss_weight is not None and args.model_running_mode != "difflm-shift":
        out.append(
            "--difflm-ar-loss-weight needs --model-running-mode difflm-shift (the AR loss reads "
            "logits that predict the next token)"
        )
    if B < 1 or (S and S % B):
        out.append(f"--difflm-block-size {B} must be positive and divide --seq-length {S}")
    if args.model_running_mode == "vanilla" or args.sft:
        out.append("--difflm-block-size needs masked-diffusion pretraining: drop it with vanilla or --sft")
    if args.context_parallel_size > 1:
        out.append(
            "--difflm-block-size is not supported with --context-parallel-size > 1 (the [x_t ; x_0] "
            "block mask is not sliced over cp ranks): use --context-parallel-size 1"
        )
    if args.reset_attention_mask:
        out.append("--difflm-block-size cannot be combined with --reset-attention-mask (document packing)")
    if args.attention_mask_type not in (None, "no_mask"):
        out.append(f"--difflm-block-size needs --attention-mask-type no_mask, got {args.attention_mask_type}")
    return out


def _shift_problems(args) -> List[str]:
    """--model-running-mode difflm-shift (Dream): a masked-diffusion model, so bidirectional."""
    if args.model_running_mode == "difflm-shift" and args.attention_mask_type in (
        "causal",
        "causal_bottom_right",
    ):
        return [
            f"--model-running-mode difflm-shift trains a bidirectional mask predictor (Dream): drop "
            f"--attention-mask-type {args.attention_mask_type} (or use --model-running-mode vanilla)"
        ]
    return []


def _sft_problems(args) -> List[str]:
    """--sft's data and tokenizer: conversations need a chat template and an answer mask."""
    sft_only = [f for f, on in (("--sft-sequence-packing", args.sft_sequence_packing),) if on]
    if not args.sft:
        return [f"{f} needs --sft" for f in sft_only]
    out = []
    if args.mock_data:
        out.append("--sft needs conversations (--data-path / --train-data-path jsonl files), not --mock-data")
    if args.tokenizer_type != "HuggingFaceTokenizer":
        out.append(
            "--sft needs --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (a tokenizer with a "
            f"chat template), got --tokenizer-type {args.tokenizer_type or 'ByteTokenizer (the default)'}"
        )
    if args.model_running_mode != "vanilla" and args.difflm_objective != "llada":
        # LLaDA's layout: the model reads the conversation as the template renders it, from position 0
        out.append(f"--sft trains LLaDA's SFT: add --difflm-objective llada (got {args.difflm_objective})")
    if args.sft_sequence_packing and args.context_parallel_size > 1:
        out.append(
            "--sft-sequence-packing is not supported with --context-parallel-size > 1 (packed "
            "conversations attend within themselves; context parallelism has no document mask)"
        )
    if args.reset_attention_mask or args.reset_position_ids:
        out.append("--sft lays out its own samples: drop --reset-attention-mask / --reset-position-ids")
    return out


def _precision_aware(args, optimizer: OptimizerConfig) -> List[str]:
    fusion = args.gradient_accumulation_fusion
    return precision_aware_problems(
        optimizer,
        accumulate_allreduce_grads_in_fp32=bool(args.accumulate_allreduce_grads_in_fp32),
        # None: the default, on under DDP (ParallelConfig)
        gradient_accumulation_fusion=bool(fusion) or (fusion is None and not args.use_torch_fsdp2),
        fsdp2=bool(args.use_torch_fsdp2),
    )


def layout_problems(model, parallel: Optional[ParallelConfig], ddp) -> List[str]:
    """The model shapes the tensor-parallel size must divide (the vocabulary is padded
    later), the data-parallel size the distributed-optimizer instances must divide, and the
    expert layout; worded with flags."""
    if parallel is None:
        return []
    out = []
    if model is not None:
        tp, sp = parallel.tensor_model_parallel_size, parallel.sequence_parallel
        out += tensor_parallel_problems(model, tp, sp, check_vocab=False)
        layers_per_rank = model.num_layers // parallel.pipeline_model_parallel_size
        out += recompute_problems(model, tp, sp, layers_per_rank)
    if ddp is not None and parallel.data_parallel_size:
        try:
            check_instances(parallel.data_parallel_size, ddp.num_distributed_optimizer_instances)
        except ValueError as exc:
            # Worded as the field so flag_message below turns it into the flag name like every other problem.
            out.append(str(exc).replace("the data-parallel size", "data_parallel_size"))
    ep = parallel.expert_model_parallel_size
    if model is not None:
        out += expert_parallel_problems(model, ep)
    if ddp is not None:
        out += expert_instances_problems(ep, ddp.num_distributed_optimizer_instances)
    return [flag_message(p) for p in out]


def pipeline_problems(model, parallel: Optional[ParallelConfig], training, checkpoint) -> List[str]:
    """The pipeline rules that span configs: the layer split over the stages (and chunks),
    the number of micro-batches the schedule needs, and what pipeline stages cannot load or
    write; worded with flags."""
    if parallel is None or parallel.pipeline_model_parallel_size == 1:
        return []
    pp, out, vp = parallel.pipeline_model_parallel_size, [], None
    if model is not None:
        try:
            vp = parallel.virtual_stages(model.num_layers)
            # Called only for its ValueError: the split itself is recomputed when the model is built.
            stage_layers(
                model.num_layers,
                pp,
                vp=vp,
                first_stage_layers=parallel.decoder_first_pipeline_num_layers,
                last_stage_layers=parallel.decoder_last_pipeline_num_layers,
            )
        except ValueError as exc:
            out.append(str(exc))
    if checkpoint is not None and checkpoint.ckpt_format == "torch":
        out.append(
            "ckpt_format torch (one file written by rank 0) needs pipeline_model_parallel_size 1: "
            "every pipeline stage writes its own tensors with ckpt_format torch_dist (the default)"
        )
    # vp is None when the layer split is already wrong: that error stands alone
    if training is not None and training.global_batch_size and vp is not None:
        t = training
        batch = (t.global_batch_size, t.micro_batch_size, t.data_parallel_size)
        out += micro_batch_problems(t.num_micro_batches, pp, vp, batch=batch)
    return [flag_message(p) for p in out]


def profiling_problems(profiling: Optional[ProfilingConfig], parallel: Optional[ParallelConfig]) -> List[str]:
    """--profile-ranks must name ranks of this world (a rank that does not exist never profiles)."""
    if profiling is None or parallel is None or not profiling.profile:
        return []
    world = parallel.world_size
    out = [r for r in profiling.profile_ranks if not 0 <= r < world]
    if not out:
        return []
    return [
        f"--profile-ranks {' '.join(map(str, out))} out of range for a world of {world} rank(s): "
        f"give global ranks 0..{world - 1}"
    ]
