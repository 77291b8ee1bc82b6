"""Data of the crossover experiment: a budget of unique KJV tokens, held-out verses kept
apart, fixed evaluation rows and a multiple-choice cloze built from held-out verses.

Everything is byte-level (``ByteTokenizer``: one token per UTF-8 byte, eod after each
verse, as ``preprocess --append-eod`` writes it), so the cloze choices have equal token
counts and their summed log-likelihoods compare without length normalisation.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Iterable, List, Sequence

import torch

from megadlms.data import ByteTokenizer


def _is_letter(b: int) -> bool:
    return 65 <= b <= 90 or 97 <= b <= 122


@dataclass(frozen=True)
class VerseSplit:
    """Disjoint verse texts: the training budget, held-out rows, held-out cloze verses."""

    train: List[str]
    heldout: List[str]
    cloze: List[str]

    @property
    def train_tokens(self) -> int:
        return sum(verse_tokens(v) for v in self.train)


@dataclass(frozen=True)
class ClozeItem:
    """One question: ``prompt`` ids (eod + a verse's opening words), ``choices`` (equal-length
    id lists), ``answer`` the index of the verse's true continuation."""

    prompt: List[int]
    choices: List[List[int]]
    answer: int


def verse_tokens(text: str) -> int:
    """Tokens a verse occupies in the training corpus: its bytes plus one eod."""
    return len(text.encode("utf-8")) + 1


def read_verses(path: str) -> List[str]:
    """The "text" of every line of a jsonl corpus, in file order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def write_jsonl(texts: Iterable[str], path: str) -> bool:
    """Write one {"text": ...} line per text; False (and the file untouched) when it already
    holds exactly that, so a rerun never rewrites data a running training reads."""
    body = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == body:
                return False
    with open(path, "w", encoding="utf-8") as f:
        f.write(body)
    return True


def _take(pool: List[str], budget: int, keep=lambda t: True) -> List[str]:
    """Pop verses from the front of ``pool`` until ``budget`` tokens are taken."""
    out, n = [], 0
    while n < budget:
        if not pool:
            raise ValueError(f"the corpus has too few verses for a budget of {budget} tokens")
        t = pool.pop(0)
        if keep(t):
            out.append(t)
            n += verse_tokens(t)
    return out


def split_verses(
    texts: Sequence[str],
    *,
    unique_tokens: int,
    heldout_tokens: int,
    cloze_questions: int,
    min_cloze_bytes: int,
    seed: int,
) -> VerseSplit:
    """Shuffle the distinct verses (seeded), then take held-out rows, cloze verses (at least
    ``min_cloze_bytes`` long) and the training budget, in that order. Identical verse texts
    (KJV repeats some) are kept once, so no held-out verse also occurs in training."""
    pool = list(dict.fromkeys(t for t in texts if t.strip()))
    random.Random(seed).shuffle(pool)
    heldout = _take(pool, heldout_tokens)
    cloze: List[str] = []
    while len(cloze) < cloze_questions:
        if not pool:
            raise ValueError(f"too few verses of >= {min_cloze_bytes} bytes for {cloze_questions} questions")
        t = pool.pop(0)
        if len(t.encode("utf-8")) >= min_cloze_bytes:
            cloze.append(t)
    train = _take(pool, unique_tokens)
    return VerseSplit(train=train, heldout=heldout, cloze=cloze)


def token_rows(texts: Sequence[str], seq_length: int, max_rows: int) -> torch.Tensor:
    """int64 [n, seq_length + 1]: the verses (eod after each) concatenated and cut into
    consecutive rows, as the trainer's GPT samples are; at most ``max_rows`` rows."""
    tok = ByteTokenizer()
    stream: List[int] = []
    width = seq_length + 1
    for t in texts:
        stream += tok.tokenize(t) + [tok.eod]
        if len(stream) >= width * max_rows:
            break
    n = min(len(stream) // width, max_rows)
    if n == 0:
        raise ValueError(f"{len(stream)} tokens do not fill one row of {width}")
    return torch.tensor(stream[: n * width], dtype=torch.int64).view(n, width)


def _mid_word_cuts(ids: Sequence[int], lo: int, hi: int, length: int) -> List[int]:
    """Positions i in [lo, hi] inside a word (letters on both sides of the cut) where a
    ``length``-token segment starts."""
    return [
        i
        for i in range(max(lo, 1), min(hi, len(ids) - length) + 1)
        if _is_letter(ids[i - 1]) and _is_letter(ids[i])
    ]


def build_cloze(
    verses: Sequence[str],
    *,
    num_questions: int,
    num_choices: int,
    answer_len: int,
    min_prompt: int,
    max_prompt: int,
    seed: int,
) -> List[ClozeItem]:
    """``num_questions`` questions, one per verse (verses without a cut in range are passed
    over): prompt = eod + the verse up to a cut inside a word (``min_prompt`` to
    ``max_prompt`` bytes), true choice = its next ``answer_len`` bytes, distractors =
    ``answer_len`` bytes from inside words of the other verses, so every choice starts by
    completing some word and only the true one completes the prompt's; the true choice's slot
    is drawn too. Deterministic in ``seed``."""
    if num_choices < 2:
        raise ValueError(f"num_choices ({num_choices}) must be >= 2")
    tok = ByteTokenizer()
    rng = random.Random(seed)
    ids = [tok.tokenize(v) for v in verses]
    items = []
    for verse in ids:
        cuts = _mid_word_cuts(verse, min_prompt, max_prompt, answer_len)
        if not cuts:
            continue
        cut = rng.choice(cuts)
        true = verse[cut : cut + answer_len]
        choices = [true]
        while len(choices) < num_choices:
            other = ids[rng.randrange(len(ids))]
            starts = _mid_word_cuts(other, 1, len(other), answer_len)
            if other is verse or not starts:
                continue
            j = rng.choice(starts)
            seg = other[j : j + answer_len]
            if seg not in choices:
                choices.append(seg)
        slot = rng.randrange(num_choices)
        choices[0], choices[slot] = choices[slot], choices[0]
        items.append(ClozeItem(prompt=[tok.eod] + verse[:cut], choices=choices, answer=slot))
        if len(items) == num_questions:
            return items
    raise ValueError(
        f"only {len(items)} of {len(ids)} cloze verses have a cut inside a word in "
        f"[{min_prompt}, {max_prompt}] bytes; {num_questions} questions were asked for"
    )
