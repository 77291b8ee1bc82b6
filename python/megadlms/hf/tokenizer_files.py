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


# Special-token roles a source tokenizer_config.json declares and the export keeps: a chat template
# writes bos_token / eos_token by name, so the export must resolve them to the same tokens.
KEPT_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")


def source_tokenizer_settings(tokenizer_path: str) -> dict:
    """The chat template and special-token roles of the tokenizer directory holding
    ``tokenizer_path`` (its tokenizer_config.json, and transformers 5's chat_template.jinja
    beside it); {} when there is neither."""
    src = os.path.dirname(os.path.abspath(tokenizer_path))
    out: dict = {}
    config_path = os.path.join(src, "tokenizer_config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            config = json.load(f)
        for role in KEPT_ROLES:
            value = config.get(role)
            # An AddedToken is stored as {"content": "<s>", ...}: only the string names the token.
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[role] = value
        if config.get("chat_template"):
            out["chat_template"] = config["chat_template"]
    jinja = os.path.join(src, "chat_template.jinja")
    if "chat_template" not in out and os.path.isfile(jinja):
        with open(jinja) as f:
            out["chat_template"] = f.read()
    return out


def write_tokenizer_files(tokenizer, tokenizer_record: dict, out_dir: str, model_max_length: int) -> dict:
    """Write tokenizer.json + tokenizer_config.json for the run's tokenizer into ``out_dir``;
    returns the special-token ids ({"bos_token_id", "eos_token_id", "pad_token_id",
    "mask_token_id"}, None where the tokenizer has no such token).

    A Hugging Face tokenizer's chat template and the special tokens its directory declares
    (bos / eos / unk / pad) are kept, so ``AutoTokenizer.from_pretrained(out_dir)
    .apply_chat_template(...)`` renders the conversations the run was trained on."""
    path = os.path.join(out_dir, "tokenizer.json")
    kind = tokenizer_record.get("tokenizer_type", "ByteTokenizer")
    source: dict = {}
    if kind == "ByteTokenizer":
        byte_tokenizer_json(path)
    elif kind == "HuggingFaceTokenizer":
        shutil.copyfile(tokenizer.path, path)
        source = source_tokenizer_settings(tokenizer.path)
    else:
        raise ValueError(f"cannot export tokenizer_type {kind!r}")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    # Tokenizers without an eod / mask raise RuntimeError: those roles are left out, not guessed.
    for role, tid in (
        ("eos_token", _optional(lambda: tokenizer.eod)),
        ("pad_token", tokenizer.pad),
        ("mask_token", _optional(lambda: tokenizer.mask_token_id)),
    ):
        if tid is not None:
            config[role] = tok.id_to_token(tid)
    # The source directory's own declarations win over the names megadlms found by search (the mask
    # stays the run's: it is the token the model was trained to denoise).
    config.update(source)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    ids = {}
    for role in ("bos_token", "eos_token", "pad_token", "mask_token"):
        ids[f"{role}_id"] = tok.token_to_id(config[role]) if role in config else None
    return ids


def _optional(get) -> Optional[int]:
    try:
        return get()
    except RuntimeError:
        return None
