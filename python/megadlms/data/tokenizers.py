"""Tokenizers with Megatron's interface (``tokenize``, ``detokenize``, ``vocab_size``, ``eod``,
``pad``, ``mask``), plus the mask token a masked-diffusion LM needs.

- ``ByteTokenizer``: offline default. Ids 0..255 are the UTF-8 bytes, then eod=256,
  mask=257, pad=258 (vocab_size 259). Needs no files, round-trips any text.
- ``HuggingFaceTokenizer``: a ``tokenizer.json`` read with the ``tokenizers`` library
  (no ``transformers`` needed). eod / mask / pad are found among the usual special-token
  names; ``--mask-token`` names the mask explicitly (a token string or an id).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

from megadlms.common.errors import Problems

SUPPORTED_TOKENIZERS = ("ByteTokenizer", "HuggingFaceTokenizer")

# Searched in order when a tokenizer.json does not say which token plays which role.
_EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]", "<|im_end|>")
# "<|mask_token|>": the name in MegaDLMs' bundled tokenizers (gpt2 / gptneox / llama2 tokenizer.json).
MASK_NAMES = ("<|mdm_mask|>", "<|mask|>", "[MASK]", "<mask>", "<MASK>", "<|mask_token|>")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")


def resolve_mask_token(mask_token: Union[str, int], token_to_id, vocab_size: int, where: str) -> int:
    """--mask-token as a token string, or as an id (int or decimal string), inside the vocab."""
    # A string is tried as a token first: a vocabulary that really holds the token '5' keeps it.
    tid = token_to_id(mask_token) if isinstance(mask_token, str) else None
    if tid is None:
        text = str(mask_token).strip()
        # lstrip('-'): a negative id is parsed so the range check names it, rather than 'not a token'.
        if text.lstrip("-").isdigit():
            tid = int(text)
            if not 0 <= tid < vocab_size:
                raise ValueError(
                    f"mask_token {mask_token!r}: id {tid} is outside the vocabulary "
                    f"of {where} (ids 0..{vocab_size - 1})"
                )
        else:
            raise ValueError(
                f"mask_token {mask_token!r} is not a token of {where}; pass a token "
                "string that is in its vocabulary or a token id"
            )
    return int(tid)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then eod (256), mask (257), pad (258)."""

    EOD, MASK, PAD = 256, 257, 258
    _SPECIAL = {"<|endoftext|>": EOD, "<|mask|>": MASK, "<|pad|>": PAD}

    def __init__(self, mask_token: Optional[Union[str, int]] = None):
        self._mask = self.MASK
        if mask_token is not None:
            self._mask = resolve_mask_token(mask_token, self._SPECIAL.get, self.vocab_size, "ByteTokenizer")

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def vocab(self) -> Dict[str, int]:
        return dict(self._SPECIAL)

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        """Bytes back to text; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def eod(self) -> int:
        return self.EOD

    eos = eod

    @property
    def pad(self) -> int:
        return self.PAD

    @property
    def mask(self) -> int:
        return self._mask

    mask_token_id = mask

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size=259, eod=256, mask={self._mask}, pad=258)"


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` (file, or a directory holding one) via the ``tokenizers`` library."""

    def __init__(self, tokenizer_json_path: str, mask_token: Optional[Union[str, int]] = None):
        path = tokenizer_json_path
        if path and os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not path or not os.path.isfile(path):
            raise FileNotFoundError(
                f"tokenizer_model {tokenizer_json_path!r}: no tokenizer.json there; pass the "
                "path of a Hugging Face tokenizer.json (or the directory that holds it)"
            )
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - install-time guard
            raise RuntimeError(
                "HuggingFaceTokenizer needs the `tokenizers` package: pip install tokenizers"
            ) from exc
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises a bare Exception on parse errors
            raise ValueError(f"tokenizer_model {path}: not a valid tokenizer.json ({exc})") from exc
        self.path = path
        # with_added_tokens: eod and mask are usually added tokens; without them their ids would fall outside
        # the embedding table.
        self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._eod = self._find(_EOD_NAMES)
        self._pad = self._find(_PAD_NAMES)
        self._mask: Optional[int] = None
        if mask_token is not None:
            self._mask = resolve_mask_token(mask_token, self._tok.token_to_id, self._vocab_size, path)
        else:
            self._mask = self._find(MASK_NAMES)

    def _find(self, names) -> Optional[int]:
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return int(tid)
        return None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> Dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def tokenize(self, text: str) -> List[int]:
        # No BOS/EOS from the post-processor: document boundaries are the eod that --append-eod adds.
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise RuntimeError(
                f"{self.path} has none of the end-of-document tokens {_EOD_NAMES}; "
                "add one to the tokenizer (needed by --append-eod and eod masking)"
            )
        return self._eod

    eos = eod

    @property
    def pad(self) -> Optional[int]:
        return self._pad

    @property
    def mask(self) -> int:
        if self._mask is None:
            raise RuntimeError(
                f"tokenizer_model {self.path} has none of the mask tokens {MASK_NAMES}; a diffusion "
                "LM needs one: pass mask_token TOKEN_OR_ID (or model_running_mode vanilla for an AR model)"
            )
        return self._mask

    mask_token_id = mask

    def __repr__(self) -> str:
        return (
            f"HuggingFaceTokenizer({self.path!r}, vocab_size={self._vocab_size}, "
            f"eod={self._eod}, mask={self._mask}, pad={self._pad})"
        )


def build_tokenizer(
    tokenizer_type: str = "ByteTokenizer",
    tokenizer_model: Optional[str] = None,
    mask_token: Optional[Union[str, int]] = None,
    vocab_size: Optional[int] = None,
):
    """Tokenizer from Megatron-style flags (--tokenizer-type, --tokenizer-model, --mask-token).

    ``vocab_size`` (--vocab-size), when given, must hold every id of the tokenizer; the model
    may use a larger (padded) embedding table, never a smaller one.
    """
    tok: Union[ByteTokenizer, HuggingFaceTokenizer]
    if tokenizer_type == "ByteTokenizer":
        tok = ByteTokenizer(mask_token=mask_token)
    elif tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError(
                "tokenizer_type HuggingFaceTokenizer needs tokenizer_model PATH/TO/tokenizer.json"
            )
        tok = HuggingFaceTokenizer(tokenizer_model, mask_token=mask_token)
    else:
        raise ValueError(
            f"tokenizer_type {tokenizer_type!r} is not supported; use one of "
            f"{', '.join(SUPPORTED_TOKENIZERS)} (Megatron's GPT2BPETokenizer / "
            "HuggingFace models: export their tokenizer.json and use "
            "HuggingFaceTokenizer)"
        )
    if vocab_size is not None and vocab_size < tok.vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is smaller than the {tokenizer_type}'s "
            f"{tok.vocab_size} ids; drop vocab_size or raise it"
        )
    return tok


@dataclass(kw_only=True)
class TokenizerConfig:
    """Which tokenizer a run uses, as data: built into a tokenizer by :meth:`build`, and
    stored in every checkpoint (``to_dict``) so that loading never depends on flag names."""

    tokenizer_type: str = "ByteTokenizer"
    """One of ``SUPPORTED_TOKENIZERS``."""
    tokenizer_model: Optional[str] = None
    """HuggingFaceTokenizer: path of a tokenizer.json (or its directory)."""
    mask_token: Optional[Union[str, int]] = None
    """The [MASK] token (string or id); None: the tokenizer's own mask token."""
    vocab_size: Optional[int] = None
    """Embedding rows before padding; must hold every id (None: the tokenizer's count)."""

    def __post_init__(self) -> None:
        bad = Problems("TokenizerConfig")
        bad.check(
            self.tokenizer_type in SUPPORTED_TOKENIZERS,
            f"tokenizer_type must be one of {SUPPORTED_TOKENIZERS}, got {self.tokenizer_type!r}",
        )
        bad.check(
            self.tokenizer_type != "HuggingFaceTokenizer" or bool(self.tokenizer_model),
            "tokenizer_type HuggingFaceTokenizer needs tokenizer_model PATH "
            "(tokenizer.json or its directory)",
        )
        bad.positive(self, "vocab_size", required=False)
        bad.raise_if_any()

    def build(self):
        """The tokenizer this record describes (reads ``tokenizer_model`` from disk)."""
        return build_tokenizer(self.tokenizer_type, self.tokenizer_model, self.mask_token, self.vocab_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TokenizerConfig:
        # Unknown keys are dropped: a checkpoint written by a newer version with more fields still loads.
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
