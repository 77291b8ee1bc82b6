"""Chat templates: a Hugging Face tokenizer directory's template applied to conversations.

Minimal version for chat generation (``megadlms-generate --chat``, the lm-eval adapter);
the SFT data path extends this module with the same two functions.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence


def load_chat_tokenizer(path: str) -> Any:
    """The transformers tokenizer of the local tokenizer directory ``path`` (tokenizer.json +
    tokenizer_config.json with a ``chat_template``, or a chat_template.jinja beside them).

    Raises ValueError naming ``path`` when the tokenizer has no chat template."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise ValueError(f"chat tokenizer {path!r}: not a directory (pass the directory of tokenizer.json)")
    # local_files_only: a path that does not hold the files is an error, never a download.
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(tok, "chat_template", None):
        raise ValueError(
            f"tokenizer {path} has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja); chat needs a tokenizer with one"
        )
    return tok


def chat_prompt_ids(
    tok: Any, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True
) -> List[int]:
    """Token ids of ``messages`` ([{"role", "content"}, ...]) rendered with ``tok``'s chat
    template; ``add_generation_prompt`` appends the assistant header the answer follows."""
    text = tok.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
    )
    # The template writes BOS and the turn tokens itself: the tokenizer must not add its own again
    # (apply_chat_template(tokenize=True) does the same).
    return list(tok(text, add_special_tokens=False).input_ids)
