"""Tokenizers: byte round trip, a tokenizer.json through the `tokenizers` library, --mask-token
handling and clear errors for bad files / flags."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megadlms.data import ByteTokenizer, HuggingFaceTokenizer, build_tokenizer


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.detokenize(ids + [tok.eod, tok.mask, tok.pad]) == text


def test_byte_tokenizer_ids_and_mask_flag():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod, tok.mask, tok.mask_token_id, tok.pad) == (259, 256, 257, 257, 258)
    assert tok.detokenize([0xE2, 0x82]) == "\ufffd"  # broken UTF-8 is replaced, not raised
    assert build_tokenizer("ByteTokenizer", mask_token="<|pad|>").mask == 258
    assert build_tokenizer("ByteTokenizer", mask_token="257").mask == 257
    assert build_tokenizer("ByteTokenizer", mask_token=7).mask == 7
    for bad in ("<|nope|>", "259", -1):
        with pytest.raises(ValueError, match="mask_token"):
            build_tokenizer("ByteTokenizer", mask_token=bad)
    with pytest.raises(ValueError, match="tokenizer_type"):
        build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer("ByteTokenizer", vocab_size=100)
    assert build_tokenizer("ByteTokenizer", vocab_size=512).vocab_size == 259


def _word_level_json(path, specials):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "in", "the", "beginning", "god", "created", "heaven", "and", "earth", "."]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(cleanup=False)  # joins words with spaces
    tok.add_special_tokens(specials)
    tok.save(str(path))
    return vocab


def test_huggingface_tokenizer_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    vocab = _word_level_json(path, ["<|endoftext|>", "<|mdm_mask|>", "<pad>"])
    tok = build_tokenizer("HuggingFaceTokenizer", str(path))
    assert isinstance(tok, HuggingFaceTokenizer)
    assert tok.vocab_size == len(vocab) + 3
    assert (tok.eod, tok.mask, tok.pad) == (len(vocab), len(vocab) + 1, len(vocab) + 2)
    ids = tok.tokenize("in the beginning god created the heaven and the earth .")
    assert ids == [vocab[w] for w in "in the beginning god created the heaven and the earth .".split()]
    assert tok.detokenize(ids + [tok.eod]) == "in the beginning god created the heaven and the earth ."
    # a directory holding tokenizer.json works too; --mask-token by string and by id
    assert HuggingFaceTokenizer(str(tmp_path), mask_token="<pad>").mask == tok.pad
    assert HuggingFaceTokenizer(str(tmp_path), mask_token=str(vocab["god"])).mask == vocab["god"]
    with pytest.raises(ValueError, match="mask_token '<MASK>' is not a token"):
        HuggingFaceTokenizer(str(path), mask_token="<MASK>")
    with pytest.raises(ValueError, match="mask_token.*outside the vocabulary"):
        HuggingFaceTokenizer(str(path), mask_token=tok.vocab_size)


def test_megadlms_bundled_mask_token_name(tmp_path):
    """MegaDLMs' bundled tokenizers (gpt2 / gptneox / llama2) add their mask as '<|mask_token|>'
    after the base vocabulary (gpt2: id 50257): found without --mask-token."""
    path = tmp_path / "tokenizer.json"
    vocab = _word_level_json(path, ["<|endoftext|>", "<|mask_token|>"])
    tok = HuggingFaceTokenizer(str(path))
    assert (tok.eod, tok.mask) == (len(vocab), len(vocab) + 1)
    assert tok.tokenize("<|mask_token|>") == [tok.mask]


def test_huggingface_tokenizer_without_mask_or_eod(tmp_path):
    path = tmp_path / "plain.json"
    _word_level_json(path, [])
    tok = HuggingFaceTokenizer(str(path))
    with pytest.raises(RuntimeError, match="mask_token"):
        tok.mask
    with pytest.raises(RuntimeError, match="end-of-document"):
        tok.eod
    assert HuggingFaceTokenizer(str(path), mask_token="[UNK]").mask == 0


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(ValueError, match="needs tokenizer_model"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(FileNotFoundError, match="tokenizer_model"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "missing.json"))
    for i, content in enumerate(["{not json", json.dumps({"model": {"type": "Nope"}}), ""]):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(content)
        with pytest.raises(ValueError, match=f"tokenizer_model .*bad{i}.json: not a valid tokenizer.json"):
            build_tokenizer("HuggingFaceTokenizer", str(bad))
