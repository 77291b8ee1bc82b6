"""The sft group: supervised fine-tuning on conversations (Megatron-LM's --sft flags, LLaDA's
objective). The data flags (--data-path, --train-data-path, --valid-data-path, --split,
--data-cache-path) name jsonl files of ``{"messages": [...]}`` rows under --sft."""

from __future__ import annotations

from megadlms.common.enums import SFTLossNormalization

from ._flag import add_flag

SFT_PROMPT_FORMATS = ("default",)
"""Megatron's --sft-tokenizer-prompt-format names we implement: "default", the tokenizer's own
chat template (its built-in formats, e.g. nemotron-h-aligned, are Megatron's tokenizer code)."""


def sft_args(p):
    g = p.add_argument_group("sft (supervised fine-tuning)")
    add_flag(
        g,
        "--sft",
        action="store_true",
        help="Supervised fine-tuning on conversations: the data paths name jsonl files of "
        '{"messages": [{"role", "content"}, ...]} rows (or megadlms-preprocess-sft prefixes), '
        "tokenized with --tokenizer-model's chat template; one sample per assistant turn, padded "
        "with EOS answer tokens. difflm-noshift: LLaDA's SFT (the prompt is never noised); "
        "vanilla: next-token loss on the answer only (Megatron's SFT).",
    )
    add_flag(
        g,
        "--sft-tokenizer-prompt-format",
        default="default",
        choices=SFT_PROMPT_FORMATS,
        help="How a conversation becomes tokens: 'default', the tokenizer's own chat template "
        "(Megatron's name for it).",
    )
    add_flag(
        g,
        "--sft-sequence-packing",
        action="store_true",
        help="Pack several conversations per sample, each attending only to itself (document "
        "packing); default one conversation per sample, EOS-padded (LLaDA's).",
    )
    add_flag(
        g,
        "--sft-loss-normalization",
        default=SFTLossNormalization.SAMPLE.value,
        choices=[m.value for m in SFTLossNormalization],
        help="'sample' (LLaDA's): each sample's loss over its answer length, averaged over the "
        "global batch's samples; 'token': the mean over every answer token of the global batch.",
    )
    add_flag(
        g,
        "--sft-skip-invalid-rows",
        action="store_true",
        help="Skip (and count) conversation rows without an assistant answer instead of failing "
        "on the first one.",
    )
