"""lm-eval's --apply_chat_template with the `megadlms` model: requests rendered with the
checkpoint's chat template, answers from our sampler cut at EOS / end-of-turn."""

import json
import os

import pytest
import torch

from tests.hf.chat_helpers import LLADA_TEMPLATE, MASK

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("datasets")
pytest.importorskip("transformers")

DOCS = [{"question": "what is two plus two", "answer": "four"}, {"question": "hello", "answer": "hi"}]
TASK = """task: tiny_chat
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: []
metric_list:
  - metric: exact_match
"""
MODEL_ARGS = dict(gen_length=8, steps=8, block_length=4)


def test_chat_template_properties(chat_ckpt):
    from megadlms.data.chat import chat_prompt_ids, load_chat_tokenizer
    from megadlms.eval.lm_eval_adapter import MegaDLMsLM

    ck, tok_dir, _ = chat_ckpt
    lm = MegaDLMsLM(pretrained=str(ck), **MODEL_ARGS)
    assert lm.chat_template(False) is None and lm.chat_template(True) == LLADA_TEMPLATE
    assert lm.tokenizer_name == tok_dir.replace("/", "__")
    history = [{"role": "user", "content": "hello"}]
    text = lm.apply_chat_template(history)
    assert text.startswith("<|startoftext|><|start_header_id|>user<|end_header_id|>")
    # The rendered string tokenizes (as any lm-eval context) to the template's own ids.
    assert lm.tokenizer.tokenize(text) == chat_prompt_ids(load_chat_tokenizer(tok_dir), history)


def test_no_template_is_an_error_naming_the_tokenizer(rope_swiglu_ckpt):
    from megadlms.eval.lm_eval_adapter import MegaDLMsLM

    ck, _ = rope_swiglu_ckpt
    lm = MegaDLMsLM(pretrained=str(ck), **MODEL_ARGS)
    with pytest.raises(ValueError, match="--tokenizer-model"):
        lm.chat_template(True)


def test_apply_chat_template_end_to_end(tmp_path, monkeypatch, chat_ckpt):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    from lm_eval.tasks import TaskManager

    from megadlms.data.chat import chat_prompt_ids, load_chat_tokenizer
    from megadlms.diffusion import generate
    from megadlms.generate import chat_stop_ids, cut_at_stop

    ck, tok_dir, ours = chat_ckpt
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    with open(tasks / "data.jsonl", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in DOCS)
    (tasks / "tiny_chat.yaml").write_text(TASK.format(data=os.path.join(tasks, "data.jsonl")))
    out = lm_eval.simple_evaluate(
        model="megadlms",
        model_args=f"pretrained={ck},tokenizer={tok_dir},gen_length=8,steps=8,block_length=4",
        tasks=["tiny_chat"],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        apply_chat_template=True,
        log_samples=True,
    )
    tok = load_chat_tokenizer(tok_dir)
    samples = sorted(out["samples"]["tiny_chat"], key=lambda s: s["doc_id"])
    for s, doc in zip(samples, DOCS):
        history = [{"role": "user", "content": doc["question"]}]
        # The context lm-eval built is the template's rendering of the user turn.
        assert s["arguments"][0][0] == tok.apply_chat_template(
            history, tokenize=False, add_generation_prompt=True
        )
        ids = chat_prompt_ids(tok, history)
        x = torch.tensor([ids])
        new = generate(ours, x, mask_token_id=MASK, **MODEL_ARGS)[0, len(ids) :].tolist()
        answer = tok.decode(cut_at_stop(new, chat_stop_ids(tok)), skip_special_tokens=True)
        assert s["resps"][0][0] == answer
