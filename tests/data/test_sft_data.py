"""The SFT data path: chat-template samples with LLaDA's answer mask, SFTDataset items
(padding, truncation, packing, epochs), bad rows, the token cache and megadlms-preprocess-sft."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megadlms.data import chat, sft_store
from megadlms.data.chat import chat_prompt_ids, conversation_samples, load_chat_tokenizer
from megadlms.data.preprocess_sft import main as preprocess_sft_main
from megadlms.data.sampler import build_pretraining_data_loader
from megadlms.data.sft import SFTDataset, build_sft_datasets, open_conversations, truncate_sample
from megadlms.data.tokenizers import HuggingFaceTokenizer
from tests.data.sft_fixtures import WORDS, end_of_turn_token, make_chat_tokenizer

QA = [
    {"role": "system", "content": "you are a helpful bot ."},
    {"role": "user", "content": "what is one plus two ?"},
    {"role": "assistant", "content": "three ."},
]
TWO_TURNS = QA + [
    {"role": "user", "content": "why ?"},
    {"role": "assistant", "content": "because one plus two equals three ."},
]


@pytest.fixture(scope="module", params=["llada", "qwen"])
def tok_dir(request, tmp_path_factory):
    return make_chat_tokenizer(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_chat_tokenizer(tok_dir)


def _words(tok, ids):
    return tok.convert_ids_to_tokens(list(ids))


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _rows(n):
    """n conversations with distinct, checkable answers; every third one has two turns."""
    numbers = "one two three four five six seven eight nine ten".split()
    rows = []
    for i in range(n):
        a, b = numbers[i % 10], numbers[(i * 3) % 10]
        msgs = [
            {"role": "user", "content": f"what is {a} plus {b} ?"},
            {"role": "assistant", "content": f"{a} {b} ."},
        ]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "say again"}, {"role": "assistant", "content": f"{b} {a}"}]
        rows.append({"messages": msgs})
    return rows


def test_answer_mask_is_the_assistant_content_and_end_of_turn(tok, tok_dir):
    [(ids, answer)] = conversation_samples(tok, QA, "x.jsonl:1")
    eot = tok.convert_tokens_to_ids(end_of_turn_token("llada" if "llada" in tok_dir else "qwen"))
    words = _words(tok, ids)
    assert [w for w, a in zip(words, answer) if a] == ["three", ".", tok.convert_ids_to_tokens(eot)]
    # the prompt is exactly what generation feeds the model (assistant header included)
    prompt = chat_prompt_ids(tok, QA[:2])
    assert ids[: len(prompt)] == prompt and not any(answer[: len(prompt)])
    assert answer.index(True) == len(prompt)
    # the row form gives the same
    assert conversation_samples(tok, {"messages": QA}, "x.jsonl:1") == [(ids, answer)]


def test_multi_turn_gives_one_sample_per_assistant_turn(tok):
    samples = conversation_samples(tok, TWO_TURNS, "x.jsonl:1")
    assert len(samples) == 2
    first, second = samples
    assert first == conversation_samples(tok, QA, "x.jsonl:1")[0]
    ids, answer = second
    answer_words = [w for w, a in zip(_words(tok, ids), answer) if a]
    assert answer_words[:-1] == "because one plus two equals three .".split()
    # the first turn's answer is history (prompt) in the second sample
    assert ids[: len(first[0])] == first[0] and sum(answer) == len(answer_words)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}, "empty"),
        (
            {"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "yes"}]},
            "unknown role",
        ),
        ({"text": "hi"}, "expected an object"),
        ([1, 2], "message 0 is not an object"),
        ("hello", "expected an object"),
    ],
)
def test_bad_rows_are_one_line_naming_file_and_row(tok, row, message):
    with pytest.raises(ValueError, match=message) as err:
        conversation_samples(tok, row, "data/chat.jsonl:7")
    assert str(err.value).startswith("data/chat.jsonl:7: ") and "\n" not in str(err.value)


def test_no_template_and_unstable_template_are_named(tmp_path, tok_dir):
    bare = make_chat_tokenizer(tmp_path / "bare", template=False)
    with pytest.raises(ValueError, match=f"{bare}.*no chat template"):
        load_chat_tokenizer(bare)
    with pytest.raises(ValueError, match="tokenizer directory"):
        load_chat_tokenizer(str(tmp_path / "missing"))
    tok = load_chat_tokenizer(tok_dir)
    # a template that renders the generation prompt differently from the history
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] + ' ' + m['content'] + ' ' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'hello ' }}{% endif %}"
    )
    with pytest.raises(ValueError, match="a.jsonl:3: the chat template is not prefix-stable"):
        conversation_samples(tok, QA, "a.jsonl:3")


def test_truncation_keeps_the_answer_start():
    ids, ans = np.arange(10), np.array([0] * 6 + [1] * 4, dtype=bool)
    t, a = truncate_sample(ids, ans, 7)
    assert t.tolist() == [3, 4, 5, 6, 7, 8, 9] and a.tolist() == [False] * 3 + [True] * 4
    t, a = truncate_sample(ids, ans, 3)  # the answer alone is longer: its end goes
    assert t.tolist() == [6, 7, 8] and a.all()
    t, a = truncate_sample(ids, ans, 12)
    assert t is ids


def _dataset(tmp_path, tok_dir, rows, seq_length, n=None, **kw):
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    store = open_conversations(path, tok_dir, skip_invalid=kw.pop("skip_invalid", False))
    convs = np.arange(len(store.document_indices) - 1)
    eod = HuggingFaceTokenizer(tok_dir).eod
    return SFTDataset(store, convs, n, seq_length=seq_length, seed=5, eod=eod, **kw), store, eod


def test_items_pad_with_eod_as_answer(tmp_path, tok, tok_dir):
    ds, store, eod = _dataset(tmp_path, tok_dir, [{"messages": QA}], 32, n=3)
    assert len(ds) == 3 and ds.num_truncated == 0
    [(ids, answer)] = conversation_samples(tok, QA, "w")
    item = ds[1]
    # a leading eod (the autoregressive input's first token), the sample from labels[0], eod padding
    seq = np.array([eod] + ids + [eod] * (32 - len(ids)))
    ans = np.array([False] + answer + [True] * (32 - len(ids)))
    assert torch.equal(item["tokens"], torch.from_numpy(seq[:-1])) and torch.equal(
        item["labels"], torch.from_numpy(seq[1:])
    )
    assert torch.equal(item["answer_mask"], torch.from_numpy(ans[1:]))
    assert item["loss_mask"].dtype == torch.float32 and torch.equal(
        item["loss_mask"], item["answer_mask"].float()
    )
    assert torch.equal(item["position_ids"], torch.arange(32)) and int(item["sample_idx"]) == 1
    assert {k: v.dtype for k, v in item.items()} == {
        "tokens": torch.int64,
        "labels": torch.int64,
        "answer_mask": torch.bool,
        "loss_mask": torch.float32,
        "position_ids": torch.int64,
        "sample_idx": torch.int64,
    }


def test_long_conversations_are_truncated_and_counted(tmp_path, tok, tok_dir):
    ds, store, _ = _dataset(tmp_path, tok_dir, [{"messages": TWO_TURNS}], 12, n=2)
    assert ds.num_truncated == 2  # both turns are longer than 12 tokens
    assert ds.num_answer_truncated == 0
    for i in range(2):
        item = ds[i]
        s = int(ds.order[i])
        ids, ans = store.tokens(s), store.answer(s)
        start = int(np.argmax(ans))
        # the answer is whole and at the end, the prompt lost its start
        assert (
            item["labels"].tolist() == ids[-12:].tolist()
            and item["answer_mask"].tolist() == ans[-12:].tolist()
        )
        assert len(ids) - start <= 12
    # S = 4: the second turn's answer (8 tokens + end-of-turn) loses its end, the first keeps it whole
    ds, store, _ = _dataset(tmp_path, tok_dir, [{"messages": TWO_TURNS}], 4, n=2)
    assert ds.num_answer_truncated == 1
    for i in range(2):
        s = int(ds.order[i])
        ids, ans = store.tokens(s), store.answer(s)
        start = int(np.argmax(ans))
        expected = ids[start : start + 4] if len(ids) - start > 4 else ids[-4:]
        assert ds[i]["labels"].tolist() == expected.tolist()


def test_epochs_repeat_and_shuffle_like_gpt_dataset(tmp_path, tok_dir):
    ds, store, _ = _dataset(tmp_path, tok_dir, _rows(6), 40, n=20)
    n = len(store.sequence_lengths)  # 8 samples (two conversations have two turns)
    assert n == 8 and len(ds) == 20
    counts = np.bincount(ds.order, minlength=n)
    assert counts.min() >= 2 and counts.max() <= 3
    # the full epochs are shuffled together; the short final one (4 of 8 < 80 %) apart, so it repeats none
    assert sorted(ds.order[:16].tolist()) == sorted(list(range(8)) * 2)
    assert len(set(ds.order[16:].tolist())) == 4
    again, _, _ = _dataset(tmp_path, tok_dir, _rows(6), 40, n=20)
    assert np.array_equal(again.order, ds.order)


def test_packing_document_ids_and_positions(tmp_path, tok_dir):
    ds, store, eod = _dataset(tmp_path, tok_dir, _rows(9), 48, n=6, packing=True)
    assert len(ds) == 6
    plain, _, _ = _dataset(tmp_path, tok_dir, _rows(9), 48, n=6)
    multi = 0
    for r in range(len(ds)):
        item = ds[r]
        samples = ds.order[ds.row_starts[r] : ds.row_starts[r + 1]]
        lengths = [int(store.sequence_lengths[s]) for s in samples]
        assert sum(lengths) <= 48 and len(samples) >= 1
        multi += len(samples) > 1
        seq = np.concatenate([store.tokens(s) for s in samples])
        assert item["labels"][: len(seq)].tolist() == seq.tolist()
        # the row: a leading eod (conversation 0's), the samples, the padding (the last one's);
        # labels[j] is row[j + 1]; positions (of tokens = row[:-1]) restart per conversation
        conv = np.concatenate(
            [[0]]
            + [np.full(n, k) for k, n in enumerate(lengths)]
            + [np.full(48 - len(seq), len(lengths) - 1)]
        )
        assert item["document_ids"].tolist() == conv[1:].tolist()
        first = {k: int(np.argmax(conv == k)) for k in set(conv.tolist())}
        expected_pos = [j - first[int(conv[j])] for j in range(48)]
        assert item["position_ids"].tolist() == expected_pos
        assert item["answer_mask"][len(seq) - 1 :].all()  # the tail padding is answer
    assert multi > 0
    # one conversation per row is the unpacked item
    single, _, _ = _dataset(tmp_path, tok_dir, [{"messages": QA}], 32, n=2, packing=True)
    unpacked, _, _ = _dataset(tmp_path, tok_dir, [{"messages": QA}], 32, n=2)
    a, b = single[0], unpacked[0]
    assert all(torch.equal(a[k], b[k]) for k in b) and a["document_ids"].eq(0).all()


def test_bad_rows_raise_or_are_skipped_and_counted(tmp_path, tok_dir):
    rows = (
        _rows(3)
        + [{"messages": [{"role": "user", "content": "hi"}]}, "{not json", {"messages": []}]
        + _rows(2)
    )
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=f"^{path}:4: no assistant turn"):
        build_sft_datasets(
            data_path=path, tokenizer_model=tok_dir, seq_length=32, seed=1, train_samples=4, valid_samples=0
        )
    train, valid = build_sft_datasets(
        data_path=path,
        split="1,0,0",
        tokenizer_model=tok_dir,
        seq_length=32,
        seed=1,
        train_samples=4,
        valid_samples=0,
        skip_invalid=True,
    )
    assert valid is None and train is not None and train.skipped == 3 and len(train) == 4
    code = preprocess_sft_main(
        ["--input", path, "--output-prefix", str(tmp_path / "p"), "--tokenizer-model", tok_dir]
    )
    assert code == 1 and not list(tmp_path.glob("p*"))  # nothing half-written is left
    bad_json = _write_jsonl(tmp_path / "j.jsonl", ["", "{not json"])
    with pytest.raises(ValueError, match=f"^{bad_json}:2: not valid JSON"):
        open_conversations(bad_json, tok_dir)


def test_cache_is_hit_on_the_second_build(tmp_path, tok_dir, monkeypatch):
    path = _write_jsonl(tmp_path / "c.jsonl", _rows(40))
    kw = dict(
        data_path=[path],
        tokenizer_model=tok_dir,
        seed=3,
        train_samples=30,
        valid_samples=5,
        cache_dir=str(tmp_path / "cache"),
    )
    train, valid = build_sft_datasets(seq_length=40, **kw)
    assert train is not None and valid is not None
    first = [train[i] for i in range(5)]

    def no_template(*a, **k):
        raise AssertionError("the second build re-tokenized")

    monkeypatch.setattr(sft_store, "conversation_samples", no_template)
    monkeypatch.setattr(chat, "_render", no_template)
    train2, valid2 = build_sft_datasets(seq_length=40, **kw)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(first, [train2[i] for i in range(5)]) for k in a)
    # another sequence length shares the cache too
    build_sft_datasets(seq_length=24, **kw)
    assert len(list((tmp_path / "cache").glob("*-description.json"))) == 1
    # split between conversations: valid holds none of train's conversations
    assert len(train.sample_ids) + len(valid.sample_ids) <= len(train.store.sequence_lengths)
    assert not set(train.sample_ids.tolist()) & set(valid.sample_ids.tolist())


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_reads_back_equal_to_the_jsonl(tmp_path, tok_dir, workers):
    path = _write_jsonl(tmp_path / "p.jsonl", _rows(12))
    prefix = str(tmp_path / "out" / "chats")
    argv = [
        "--input",
        path,
        "--output-prefix",
        prefix,
        "--tokenizer-model",
        tok_dir,
        "--workers",
        str(workers),
    ]
    assert preprocess_sft_main(argv) == 0
    kw = dict(
        tokenizer_model=tok_dir, seq_length=40, seed=2, train_samples=25, valid_samples=0, split="1,0,0"
    )
    from_prefix, _ = build_sft_datasets(data_path=prefix, **kw)
    from_text, _ = build_sft_datasets(data_path=prefix + "_text_document", **kw)
    from_jsonl, _ = build_sft_datasets(data_path=path, **kw)
    assert from_prefix.store.answers.dtype == np.uint8
    for i in range(25):
        a, b, c = from_prefix[i], from_jsonl[i], from_text[i]
        assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)


def test_separate_train_and_valid_paths(tmp_path, tok_dir):
    tr = _write_jsonl(tmp_path / "tr.jsonl", _rows(5))
    va = _write_jsonl(tmp_path / "va.jsonl", _rows(2))
    train, valid = build_sft_datasets(
        train_data_path=tr,
        valid_data_path=va,
        tokenizer_model=tok_dir,
        seq_length=40,
        seed=0,
        train_samples=7,
        valid_samples=3,
    )
    assert len(train) == 7 and len(valid) == 3 and len(valid.sample_ids) == 3
    with pytest.raises(ValueError, match="not both"):
        build_sft_datasets(
            data_path=tr,
            train_data_path=tr,
            tokenizer_model=tok_dir,
            seq_length=8,
            seed=0,
            train_samples=1,
            valid_samples=0,
        )
    with pytest.raises(FileNotFoundError, match="nope"):
        build_sft_datasets(
            data_path=str(tmp_path / "nope"),
            tokenizer_model=tok_dir,
            seq_length=8,
            seed=0,
            train_samples=1,
            valid_samples=0,
        )


def test_the_pretraining_loader_batches_sft_items_in_worker_processes(tmp_path, tok_dir):
    """The trainer's loader (PretrainingSampler + default collate) over packed items read from
    a preprocessed prefix by worker processes (the mmapped store pickles by path)."""
    path = _write_jsonl(tmp_path / "l.jsonl", _rows(10))
    prefix = str(tmp_path / "l")
    argv = ["--input", path, "--output-prefix", prefix, "--tokenizer-model", tok_dir]
    assert preprocess_sft_main(argv) == 0
    train, _ = build_sft_datasets(
        data_path=prefix,
        split="1,0,0",
        tokenizer_model=tok_dir,
        seq_length=40,
        seed=0,
        train_samples=8,
        valid_samples=0,
        packing=True,
    )
    loader = build_pretraining_data_loader(train, 0, 4, 0, 1, num_workers=1)
    batches = list(loader)
    assert len(batches) == 2 and batches[1]["sample_idx"].tolist() == [4, 5, 6, 7]
    b = batches[0]
    assert b["answer_mask"].shape == (4, 40) and b["answer_mask"].dtype == torch.bool
    assert b["document_ids"].shape == (4, 40) and torch.equal(b["tokens"][2], train[2]["tokens"])


_CONTENT = st.lists(st.sampled_from(WORDS[1:]), min_size=1, max_size=6).map(" ".join)
_TURNS = st.lists(st.tuples(_CONTENT, _CONTENT), min_size=1, max_size=4)


@settings(max_examples=25, deadline=None)
@given(system=st.one_of(st.none(), _CONTENT), turns=_TURNS)
def test_answer_mask_over_random_dialogues(tok, tok_dir, system, turns):
    """For any dialogue: one sample per assistant turn, whose answer is exactly that turn's
    words and the end-of-turn token, placed right after the generation prompt."""
    msgs = [] if system is None else [{"role": "system", "content": system}]
    eot = end_of_turn_token("llada" if "llada" in tok_dir else "qwen")
    expected = []
    for user, answer in turns:
        msgs += [{"role": "user", "content": user}]
        expected.append((list(msgs), answer))
        msgs += [{"role": "assistant", "content": answer}]
    samples = conversation_samples(tok, msgs, "h:1")
    assert len(samples) == len(turns)
    for (ids, mask), (history, answer) in zip(samples, expected):
        prompt = chat_prompt_ids(tok, history)
        assert ids[: len(prompt)] == prompt and mask.index(True) == len(prompt)
        assert [w for w, a in zip(_words(tok, ids), mask) if a] == answer.split() + [eot]


def test_template_text_after_the_end_of_turn_is_prompt(tmp_path):
    """ChatML writes a newline after <|im_end|>: tokens after the end-of-turn special token
    are template (prompt), not answer. Here the template writes a visible word there."""
    tok = load_chat_tokenizer(make_chat_tokenizer(tmp_path / "q", "qwen"))
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + '<|im_end|>' + ' good ' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
    )
    [(ids, answer)] = conversation_samples(tok, QA, "q:1")
    words = _words(tok, ids)
    assert words[-2:] == ["<|im_end|>", "good"]
    assert [w for w, a in zip(words, answer) if a] == ["three", ".", "<|im_end|>"]
