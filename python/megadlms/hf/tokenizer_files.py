"""Tokenizer files of an export: a ``tokenizer.json`` plus ``tokenizer_config.json`` that
``transformers.AutoTokenizer`` loads (PreTrainedTokenizerFast) and megadlms'
``HuggingFaceTokenizer`` reads back with the same ids.

A ``ByteTokenizer`` run gets an equivalent byte-level tokenizer.json: ids 0..255 are the
UTF-8 bytes (GPT-2's byte-to-unicode alphabet, no merges), then ``<|endoftext|>`` (256),
``<|mask|>`` (257), ``<|pad|>`` (258). One difference: the HF file turns those three
strings, when they occur in text, into their special ids; ByteTokenizer encodes them as bytes.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional


def _bytes_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            # Unprintable bytes move to code points past 255 so every byte has a visible, unique character.
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def byte_tokenizer_json(path: str) -> None:
    """Write the tokenizer.json equivalent of megadlms' ByteTokenizer to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No prefix space, no GPT-2 split regex, no merges: one byte is one token, exactly ByteTokenizer's ids.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # Added in this order so they get ids 256, 257, 258, the ids ByteTokenizer uses.
    tok.add_special_tokens(["<|endoftext|>", "<|mask|>", "<|pad|>"])
    tok.save(path)


def write_tokenizer_files(tokenizer, tokenizer_record: dict, out_dir: str, model_max_length: int) -> dict:
    """Write tokenizer.json + tokenizer_config.json for the run's tokenizer into ``out_dir``;
    returns the special-token ids ({"eos_token_id", "pad_token_id", "mask_token_id"})."""
    path = os.path.join(out_dir, "tokenizer.json")
    kind = tokenizer_record.get("tokenizer_type", "ByteTokenizer")
    if kind == "ByteTokenizer":
        byte_tokenizer_json(path)
    elif kind == "HuggingFaceTokenizer":
        shutil.copyfile(tokenizer.path, path)
    else:
        raise ValueError(f"cannot export tokenizer_type {kind!r}")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    ids = {
        # Tokenizers without an eod / mask raise RuntimeError: those roles are left out, not guessed.
        "eos_token_id": _optional(lambda: tokenizer.eod),
        "pad_token_id": tokenizer.pad,
        "mask_token_id": _optional(lambda: tokenizer.mask_token_id),
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    for role, key in (
        ("eos_token", "eos_token_id"),
        ("pad_token", "pad_token_id"),
        ("mask_token", "mask_token_id"),
    ):
        if ids[key] is not None:
            config[role] = tok.id_to_token(ids[key])
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return ids


def _optional(get) -> Optional[int]:
    try:
        return get()
    except RuntimeError:
        return None
