"""Conversations through a tokenizer's chat template: the prompt generation feeds the model,
and the (token ids, answer mask) samples supervised fine-tuning trains on.

The tokenizer is a Hugging Face tokenizer DIRECTORY (tokenizer.json + tokenizer_config.json
whose ``chat_template`` is a jinja template), loaded with transformers from the local files.

LLaDA's SFT layout (Nie et al., "Large Language Diffusion Models", SFT section): a dialogue
with n assistant turns gives n samples; sample k is the template rendered over the history
and assistant turn k. Its answer mask is True exactly on turn k's content and its
end-of-turn token(s); system / user turns and the template's own tokens, the assistant
header included, are prompt. The split point is found by rendering, not by parsing the
template:

- P = ids of ``template(history, add_generation_prompt=True)`` (what generation feeds);
- F = ids of ``template(history + [turn k])``, E = the same with turn k's content empty;
- P must be a prefix of F and of E (the template is "prefix-stable"), and E's tail after P
  (the end-of-turn and any trailing template text) must end F: then F = P + content + tail;
- of the tail, the tokens up to its last special token are the end-of-turn (answer), the
  rest (e.g. ChatML's newline after ``<|im_end|>``) template (prompt).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence, Tuple

ROLES = ("system", "user", "assistant")
_ASSISTANT = "assistant"

Message = Dict[str, str]
Sample = Tuple[List[int], List[bool]]


def load_chat_tokenizer(path: str) -> Any:
    """The transformers tokenizer of the directory ``path``; ValueError when it has no chat template."""
    if not path or not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ValueError(
            f"tokenizer_model {path!r}: SFT needs a tokenizer directory holding tokenizer.json and "
            "tokenizer_config.json with a 'chat_template' (e.g. a downloaded LLaDA-8B-Instruct's)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - install-time guard
        raise RuntimeError("chat templates need the `transformers` package: pip install -e .[hf]") from exc
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(tok, "chat_template", None):
        raise ValueError(
            f"tokenizer_model {path}: the tokenizer has no chat template; add a 'chat_template' (jinja) "
            "to its tokenizer_config.json (or a chat_template.jinja file), or use an instruct model's "
            "tokenizer"
        )
    return tok


def _render(tok: Any, messages: Sequence[Message], add_generation_prompt: bool) -> List[int]:
    # Render to text, then encode without added specials: what apply_chat_template(tokenize=True) does, but
    # independent of its return type (a BatchEncoding in transformers 5, a list before).
    text = tok.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return [int(i) for i in tok.encode(text, add_special_tokens=False)]


def chat_prompt_ids(tok: Any, messages: Sequence[Message], add_generation_prompt: bool = True) -> List[int]:
    """Token ids of ``messages`` through the template, ending with the assistant header when
    ``add_generation_prompt`` (what generation feeds the model before the answer)."""
    return _render(tok, messages, add_generation_prompt)


def parse_row(row: Any, where: str) -> List[Message]:
    """The messages of one jsonl row ``{"messages": [...]}``, checked; ValueError naming ``where``."""
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise ValueError(
            f'{where}: expected an object {{"messages": [{{"role": ..., "content": ...}}, ...]}}'
        )
    messages = row["messages"]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} is not an object with a string 'content'")
        if m.get("role") not in ROLES:
            raise ValueError(f"{where}: message {i} has unknown role {m.get('role')!r}; roles are {ROLES}")
    turns = [i for i, m in enumerate(messages) if m["role"] == _ASSISTANT]
    if not turns:
        raise ValueError(f"{where}: no assistant turn (nothing to learn from this conversation)")
    for i in turns:
        if not messages[i]["content"].strip():
            raise ValueError(f"{where}: message {i} is an empty assistant answer")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _special_ids(tok: Any) -> set:
    ids = {int(i) for i in getattr(tok, "all_special_ids", [])}
    for tid, added in getattr(tok, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(tid))
    return ids


def _turn_sample(tok: Any, messages: List[Message], k: int, specials: set, where: str) -> Sample:
    prompt = _render(tok, messages[:k], True)
    full = _render(tok, messages[: k + 1], False)
    empty = _render(tok, messages[:k] + [{"role": _ASSISTANT, "content": ""}], False)
    n = len(prompt)
    tail = empty[n:]
    if full[:n] != prompt or empty[:n] != prompt or (tail and full[len(full) - len(tail) :] != tail):
        raise ValueError(
            f"{where}: the chat template is not prefix-stable at message {k}: the generation prompt "
            "(add_generation_prompt=True) is not the start of the rendered conversation, so the answer "
            "cannot be told apart from the prompt; use a template that renders history unchanged"
        )
    content = len(full) - len(tail) - n
    if content <= 0:
        raise ValueError(f"{where}: message {k} is an empty assistant answer once tokenized")
    # The end-of-turn is the tail up to its last special token; what follows it is template text.
    last = max((i for i, t in enumerate(tail) if t in specials), default=len(tail) - 1)
    answer_len = content + last + 1
    mask = [False] * n + [True] * answer_len + [False] * (len(full) - n - answer_len)
    return full, mask


def conversation_samples(tok: Any, messages: Any, where: str) -> List[Sample]:
    """LLaDA's SFT samples of one conversation: one (ids, answer mask) per assistant turn.

    ``messages``: the row's list of ``{"role", "content"}`` (or the row ``{"messages": [...]}``);
    ``where``: ``file:row`` for the one-line ValueError a bad row raises.
    """
    row = messages if isinstance(messages, dict) else {"messages": messages}
    msgs = parse_row(row, where)
    specials = _special_ids(tok)
    try:
        return [
            _turn_sample(tok, msgs, k, specials, where) for k, m in enumerate(msgs) if m["role"] == _ASSISTANT
        ]
    except ValueError:
        raise
    except Exception as exc:  # jinja raises its own errors (e.g. a template's raise_exception)
        raise ValueError(f"{where}: the chat template failed on this conversation ({exc})") from None
