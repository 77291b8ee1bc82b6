"""A tiny LLaDA-style chat tokenizer and a tiny checkpoint that records it (chat tests)."""

import json
import os

import pytest
import torch

from megadlms.checkpoint import RunRecords, save_checkpoint
from megadlms.data import TokenizerConfig
from megadlms.models import GPTModel

from .helpers import ROPE_SWIGLU, tiny_config

# LLaDA-8B-Instruct's template (its tokenizer_config.json), BOS before the first turn.
LLADA_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
WORDS = ["[UNK]", "system", "user", "assistant", "you", "are", "helpful", "hello", "hi", "what", "is", "two"]
WORDS += ["plus", "three", "four", "five", "yes", "no", "the", "answer", "a", "b", "c", "d"]
SPECIAL = [
    "<|endoftext|>",
    "<|startoftext|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|mdm_mask|>",
]
VOCAB = len(WORDS) + len(SPECIAL)
EOS = len(WORDS) + SPECIAL.index("<|endoftext|>")
BOS = len(WORDS) + SPECIAL.index("<|startoftext|>")
EOT = len(WORDS) + SPECIAL.index("<|eot_id|>")
MASK = len(WORDS) + SPECIAL.index("<|mdm_mask|>")


def write_chat_tokenizer(path, template: bool = True) -> str:
    """A WordLevel tokenizer directory (tokenizer.json + tokenizer_config.json, with the
    LLaDA template when ``template``); returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIAL)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
    }
    if template:
        config["chat_template"] = LLADA_TEMPLATE
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def save_chat_ckpt(root, tokenizer_dir: str, seed: int = 0) -> GPTModel:
    """A tiny RoPE/SwiGLU DLM over the chat tokenizer's VOCAB ids (padded to 32 rows), saved
    with a HuggingFaceTokenizer record pointing at ``tokenizer_dir``."""
    cfg = tiny_config(**ROPE_SWIGLU, vocab_size=32, unpadded_vocab_size=VOCAB)
    torch.manual_seed(seed)
    model = GPTModel(cfg)
    with torch.no_grad():
        model.embedding.word_embeddings.weight.mul_(20.0)  # confident logits: no sampler tie-breaks
    record = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_dir)
    save_checkpoint(
        str(root),
        1,
        model=model,
        ckpt_format="torch",
        records=RunRecords(model_config=cfg.to_dict(), tokenizer=record.to_dict()),
    )
    return model.eval()


@pytest.fixture(scope="session")
def chat_ckpt(tmp_path_factory):
    """(checkpoint dir, tokenizer dir, model): a tiny DLM that records the chat tokenizer."""
    base = tmp_path_factory.mktemp("chat")
    tok_dir = write_chat_tokenizer(base / "tok")
    return base / "ck", tok_dir, save_chat_ckpt(base / "ck", tok_dir)
