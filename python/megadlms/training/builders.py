"""Build the run's pieces from the parsed flags, once, at start-up.

Each builder reads the ``argparse.Namespace`` produced by
``megadlms.training.arguments.parse_args`` and returns a plain object (config
dataclass, model, wrapper, optimizer, schedule, data loaders); nothing below the
training layer ever sees ``args``.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from megadlms.data import build_pretraining_data_loader, build_pretraining_datasets, build_tokenizer
from megadlms.diffusion import DiffusionConfig
from megadlms.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    Float16Module,
    TorchFullyShardedDataParallel,
)
from megadlms.models import GPTModel, TransformerConfig
from megadlms.optimizer.lr_scheduler import OptimizerParamScheduler
from megadlms.training.arguments import config_from_args, fsdp_mixed_precision_from_args


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel_size: int = 1) -> int:
    """Megatron's padding of the embedding table: round up to divisible_by x tp."""
    multiple = max(1, divisible_by) * max(1, tensor_parallel_size)
    return int(math.ceil(vocab_size / multiple) * multiple)


def tokenizer_from_args(args):
    """The tokenizer of ``--tokenizer-type/--tokenizer-model/--mask-token/--vocab-size``."""
    return build_tokenizer(
        args.tokenizer_type, args.tokenizer_model, mask_token=args.mask_token, vocab_size=args.vocab_size
    )


def attention_kind(args) -> str:
    """--attention-mask-type (filled by parse_args: no_mask for DLMs, causal for vanilla)."""
    return "causal" if args.attention_mask_type == "causal" else "bidirectional"


def transformer_config_from_args(args, tokenizer) -> TransformerConfig:
    """TransformerConfig from the model flags. Parameters are created in fp32 even with
    --bf16/--fp16 (cast by Float16Module or FSDP2's policy), so every wrapper starts
    from the same initial weights for a given --seed."""
    vocab = args.vocab_size or tokenizer.vocab_size
    padded = padded_vocab_size(vocab, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    qg = args.num_query_groups
    if not args.group_query_attention:
        qg = None  # Megatron ignores --num-query-groups without --group-query-attention
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=padded,
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=qg,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        norm_epsilon=args.norm_epsilon,
        swiglu=bool(args.swiglu),
        add_bias_linear=bool(args.add_bias_linear),
        qk_layernorm=bool(args.qk_layernorm),
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        untie_embeddings_and_output_weights=bool(args.untie_embeddings_and_output_weights),
        init_method_std=args.init_method_std,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        params_dtype=torch.float32,
    )


def model_config_dict(config: TransformerConfig, attention: str) -> dict:
    """The JSON-able architecture record stored in (and checked against) checkpoints."""
    d = {k: v for k, v in vars(config).items() if isinstance(v, (int, float, str, bool)) or v is None}
    d["attention"] = attention
    return d


def transformer_config_from_dict(d: dict) -> TransformerConfig:
    """Inverse of :func:`model_config_dict` (for megadlms-generate)."""
    fields = {k: v for k, v in d.items() if k in TransformerConfig.__dataclass_fields__}
    return TransformerConfig(**fields)


def diffusion_config_from_args(args, tokenizer) -> DiffusionConfig:
    vanilla = args.model_running_mode == "vanilla"
    return DiffusionConfig(
        model_running_mode=args.model_running_mode,
        mask_token_id=-1 if vanilla else tokenizer.mask_token_id,
        mask_eps=args.difflm_mask_eps,
        p_mask=args.difflm_p_mask,
        varilen_prob=args.difflm_varilen_prob,
        seed=args.seed,
    )


def device_for_rank() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_model(
    config: TransformerConfig, attention: str, *, seed: int, device: torch.device
) -> torch.nn.Module:
    """The plain GPTModel, initialised from ``seed`` identically on every rank."""
    torch.manual_seed(seed)
    return GPTModel(config, attention=attention).to(device)


def ddp_config_from_args(args) -> DistributedDataParallelConfig:
    return config_from_args(args, "ddp")


def wrap_model(model: torch.nn.Module, args, ddp_config: DistributedDataParallelConfig):
    """Apply precision and the data-parallel wrapper. The wrapper class is chosen HERE
    and nowhere else; the loop only uses the common interface (DESIGN.md)."""
    DP = TorchFullyShardedDataParallel if args.use_torch_fsdp2 else DistributedDataParallel
    if DP is TorchFullyShardedDataParallel:
        return DP(model, ddp_config, mixed_precision=fsdp_mixed_precision_from_args(args))
    if args.bf16 or args.fp16:
        model = Float16Module(model, dtype=torch.bfloat16 if args.bf16 else torch.float16)
    return DP(model, ddp_config)


def optimizer_config_from_args(args):
    return config_from_args(args, "optimizer")


def build_scheduler(args, optimizer, global_batch_size: int) -> OptimizerParamScheduler:
    """Megatron's iteration-based schedule, counted in samples (see lr_scheduler)."""
    decay_iters = args.lr_decay_iters or args.train_iters
    wsd_iters = args.lr_wsd_decay_iters
    return OptimizerParamScheduler(
        optimizer,
        max_lr=args.lr,
        min_lr=args.min_lr,
        init_lr=args.lr_warmup_init,
        lr_warmup_steps=args.lr_warmup_iters * global_batch_size,
        lr_decay_steps=decay_iters * global_batch_size,
        lr_decay_style=args.lr_decay_style,
        wsd_decay_steps=None if wsd_iters is None else wsd_iters * global_batch_size,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        weight_decay=args.weight_decay,
    )


def build_datasets(args, tokenizer, *, global_batch_size: int):
    """(train, valid) datasets sized for --train-iters and --eval-iters global batches."""
    eval_iters = args.eval_iters
    valid_samples = eval_iters * global_batch_size if args.eval_interval else 0
    train, valid, _ = build_pretraining_datasets(
        data_path=args.data_path,
        train_data_path=args.train_data_path,
        valid_data_path=args.valid_data_path,
        split=args.split or "969,30,1",
        seq_length=args.seq_length,
        seed=args.seed,
        train_samples=args.train_iters * global_batch_size,
        valid_samples=valid_samples,
        test_samples=0,
        tokenizer=tokenizer,
        data_cache_path=args.data_cache_path,
        eod_mask_loss=bool(args.eod_mask_loss),
        mock=bool(args.mock_data),
    )
    if train is None:
        raise ValueError(
            "no training data: the --split gives the train split no share (or --train-data-path is missing)"
        )
    return train, valid


def build_loader(
    dataset, *, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, num_workers: int = 0
) -> Optional[torch.utils.data.DataLoader]:
    return build_pretraining_data_loader(
        dataset, consumed_samples, micro_batch_size, dp_rank, dp_size, num_workers=num_workers
    )


def batch_schedule(args, world_size: int) -> Tuple[int, int, int]:
    """(global batch, micro batch, micro-batches per rank per step); dp = world (no TP/PP)."""
    mbs = args.micro_batch_size
    gbs = args.global_batch_size or mbs * world_size
    if gbs % (mbs * world_size):
        raise ValueError(
            f"--global-batch-size ({gbs}) must be a multiple of --micro-batch-size "
            f"({mbs}) x data-parallel size ({world_size})"
        )
    return gbs, mbs, gbs // (mbs * world_size)
