"""megadlms.data: tokenizers, Megatron .bin/.idx datasets, GPT samples, blends, samplers,
SFT conversations (chat templates, answer masks).

Knows nothing about models, diffusion or distribution: the training loop builds the
datasets with ``build_pretraining_datasets`` and feeds them through ``PretrainingSampler``.
"""

from .blended_dataset import BlendedDataset, build_blending_indices
from .builder import DEFAULT_SPLIT, build_pretraining_datasets, data_source_problems, parse_blend, parse_split
from .corpus import kjv_jsonl_path
from .gpt_dataset import GPTDataset, MockGPTDataset
from .indexed_dataset import DTYPE_CODES, IndexedDataset, IndexedDatasetBuilder
from .sampler import PretrainingSampler, build_pretraining_data_loader
from .sft import SFTDataset, build_sft_datasets
from .tokenizers import ByteTokenizer, HuggingFaceTokenizer, TokenizerConfig, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "build_tokenizer",
    "TokenizerConfig",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "DTYPE_CODES",
    "GPTDataset",
    "BlendedDataset",
    "MockGPTDataset",
    "build_blending_indices",
    "DEFAULT_SPLIT",
    "build_pretraining_datasets",
    "data_source_problems",
    "parse_blend",
    "parse_split",
    "PretrainingSampler",
    "build_pretraining_data_loader",
    "kjv_jsonl_path",
    "SFTDataset",
    "build_sft_datasets",
]
