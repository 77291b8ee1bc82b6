"""megadlms-generate --chat: the template's prompt, our sampler, the answer cut at EOS / end-of-turn."""

import pytest
import torch

from megadlms.data.chat import chat_prompt_ids, load_chat_tokenizer
from megadlms.diffusion import generate
from megadlms.generate import chat_stop_ids, cut_at_stop, main

from .chat_helpers import BOS, EOS, EOT, MASK, VOCAB, WORDS, write_chat_tokenizer

pytest.importorskip("transformers")
GEN = ["--gen-length", "8", "--steps", "8", "--block-length", "4"]


def test_chat_prompt_ids_follow_the_llada_template(chat_ckpt):
    _, tok_dir, _ = chat_ckpt
    tok = load_chat_tokenizer(tok_dir)
    msgs = [{"role": "system", "content": "you are helpful"}, {"role": "user", "content": "hello"}]
    ids = chat_prompt_ids(tok, msgs)
    sh, eh = (len(WORDS) + i for i in (2, 3))
    w = {t: i for i, t in enumerate(WORDS)}
    expect = [BOS, sh, w["system"], eh, w["you"], w["are"], w["helpful"], EOT]
    expect += [sh, w["user"], eh, w["hello"], EOT, sh, w["assistant"], eh]
    assert ids == expect
    assert chat_prompt_ids(tok, msgs, add_generation_prompt=False) == expect[:-3]
    assert chat_stop_ids(tok) == {EOS, EOT}


def test_cut_at_first_stop():
    assert cut_at_stop([5, 6, EOT, 7, EOS], {EOS, EOT}) == [5, 6]
    assert cut_at_stop([EOS, 1], {EOS}) == []
    assert cut_at_stop([1, 2], {EOS}) == [1, 2]


def test_chat_cli_prints_the_cut_answer(chat_ckpt, capsys):
    ck, tok_dir, model = chat_ckpt
    tok = load_chat_tokenizer(tok_dir)
    # The recorded tokenizer is the default; --tokenizer-model names it explicitly: same answer.
    for extra in ([], ["--tokenizer-model", tok_dir]):
        argv = [
            "--load",
            str(ck),
            "--chat",
            "--prompt",
            "what is two plus two",
            "--system",
            "you are helpful",
        ]
        assert main(argv + GEN + extra) == 0
        out = capsys.readouterr().out
        msgs = [
            {"role": "system", "content": "you are helpful"},
            {"role": "user", "content": "what is two plus two"},
        ]
        ids = torch.tensor([chat_prompt_ids(tok, msgs)])
        ref = generate(model, ids, mask_token_id=MASK, gen_length=8, steps=8, block_length=4)
        new = ref[0, ids.shape[1] :].tolist()
        assert all(i < VOCAB for i in new) and MASK not in new
        assert out == tok.decode(cut_at_stop(new, {EOS, EOT}), skip_special_tokens=True) + "\n"


def test_chat_without_template_is_one_line_error(chat_ckpt, tmp_path, capsys):
    ck, _, _ = chat_ckpt
    plain = write_chat_tokenizer(tmp_path / "plain", template=False)
    assert main(["--load", str(ck), "--chat", "--prompt", "hi", "--tokenizer-model", plain] + GEN) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no chat template" in err[0] and plain in err[0]


def test_chat_on_a_byte_tokenizer_checkpoint_needs_a_tokenizer(rope_swiglu_ckpt, capsys):
    ck, _ = rope_swiglu_ckpt
    assert main(["--load", str(ck), "--chat", "--prompt", "hi"] + GEN) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tokenizer-model" in err[0] and "ByteTokenizer" in err[0]


def test_chat_cli_cuts_at_end_of_turn(chat_ckpt, monkeypatch, capsys):
    """The answer ends at the first EOS / end-of-turn: LLaDA pads its answers with EOS."""
    import megadlms.generate as gen

    ck, _, _ = chat_ckpt
    w = {t: i for i, t in enumerate(WORDS)}
    sampled = [[w["the"], w["answer"], w["is"], w["four"], EOT, w["no"], EOS, EOS]]
    sampled += [[w["yes"], EOS, w["no"], EOT, EOS, EOS, EOS, EOS]]
    monkeypatch.setattr(gen, "sample_ids", lambda *a, **k: torch.tensor(sampled))
    assert main(["--load", str(ck), "--chat", "--prompt", "hi", "--num-samples", "2"] + GEN) == 0
    assert capsys.readouterr().out == "the answer is four\nyes\n"


def test_cli_threshold_reports_the_forward_passes(chat_ckpt, capsys):
    """--threshold / --cache: Fast-dLLM's parallel decoding and KV cache; the CLI prints the forward
    passes (NFE)."""
    ck, tok_dir, model = chat_ckpt
    tok = load_chat_tokenizer(tok_dir)
    argv = [
        "--load",
        str(ck),
        "--chat",
        "--prompt",
        "what is two plus two",
        "--threshold",
        "0.05",
        "--cache",
        "prefix",
    ]
    assert main(argv + GEN) == 0
    captured = capsys.readouterr()
    ids = torch.tensor([chat_prompt_ids(tok, [{"role": "user", "content": "what is two plus two"}])])
    stats: dict = {}
    ref = generate(
        model, ids, mask_token_id=MASK, gen_length=8, steps=8, block_length=4, threshold=0.05, cache="prefix",
        stats=stats,
    )  # fmt: skip
    new = ref[0, ids.shape[1] :].tolist()
    assert captured.out == tok.decode(cut_at_stop(new, {EOS, EOT}), skip_special_tokens=True) + "\n"
    assert f"threshold 0.05, prefix cache, NFE {stats['nfe']}" in captured.err and stats["nfe"] <= 8
