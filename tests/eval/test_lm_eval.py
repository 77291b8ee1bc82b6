"""lm-evaluation-harness: the `megadlms` model runs a local multiple-choice task end to end."""

import json
import os

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("datasets")

DOCS = [
    {"question": "In the beginning God created the", "choices": ["heaven", "sea", "fish"], "answer": 0},
    {"question": "And God said, Let there be", "choices": ["dark", "light"], "answer": 1},
    {"question": "The earth was without form, and", "choices": ["void", "full", "blue"], "answer": 0},
]
TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def test_multiple_choice_task_end_to_end(tmp_path, monkeypatch, rope_swiglu_ckpt):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    from lm_eval.tasks import TaskManager

    from megadlms.eval.lm_eval_adapter import MegaDLMsLM

    ck, _ = rope_swiglu_ckpt
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    with open(tasks / "data.jsonl", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in DOCS)
    (tasks / "tiny_mc.yaml").write_text(TASK.format(data=os.path.join(tasks, "data.jsonl")))
    args = f"pretrained={ck},mc_samples=8,mc_batch_size=4,seed=2"
    out = lm_eval.simple_evaluate(
        model="megadlms",
        model_args=args,
        tasks=["tiny_mc"],
        # only the local task: indexing lm-eval's thousands of built-in task files takes ~30 s
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
    )
    lm = MegaDLMsLM(pretrained=str(ck), mc_samples=8, mc_batch_size=4, seed=2)
    direct = [[lm.score(d["question"], " " + c) for c in d["choices"]] for d in DOCS]
    samples = sorted(out["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    for s, lls in zip(samples, direct):
        assert [r[0][0] for r in s["resps"]] == pytest.approx(lls, abs=1e-9)
    acc = sum(max(range(len(ll)), key=ll.__getitem__) == d["answer"] for ll, d in zip(direct, DOCS)) / len(
        DOCS
    )
    assert out["results"]["tiny_mc"]["acc,none"] == pytest.approx(acc)


def test_generate_until_uses_our_sampler(rope_swiglu_ckpt):
    import torch
    from lm_eval.api.instance import Instance

    from megadlms.data import ByteTokenizer
    from megadlms.diffusion import generate
    from megadlms.eval.lm_eval_adapter import MegaDLMsLM
    from megadlms.generate import cut_at_stop

    ck, ours = rope_swiglu_ckpt
    lm = MegaDLMsLM(pretrained=str(ck), gen_length=8, steps=8, block_length=4)
    req = Instance("generate_until", {}, ("And God", {"until": []}), 0)
    text = lm.generate_until([req])[0]
    prompt = torch.tensor([ByteTokenizer().tokenize("And God")])
    ids = generate(ours, prompt, mask_token_id=257, gen_length=8, steps=8, block_length=4)[0, 7:].tolist()
    ids = cut_at_stop(ids, {256})  # the text ends at EOS (lm-eval's HF model stops there too)
    # Real tokens only (the checkpoint's padding rows are never drawn), so the text is not empty.
    assert all(i < 259 for i in ids) and text == ByteTokenizer().detokenize(ids) and text
    stop = text[len(text) // 2 :]
    req = Instance("generate_until", {}, ("And God", {"until": [stop]}), 0)
    assert lm.generate_until([req])[0] == text[: text.index(stop)]
    assert lm.nfe == 16  # two requests, one forward a step

    # model_args threshold=..., cache=...: Fast-dLLM's parallel decoding and KV cache, forward passes counted
    fast = MegaDLMsLM(
        pretrained=str(ck), gen_length=8, steps=8, block_length=4, threshold="0.02", cache="dual"
    )
    stats: dict = {}
    ids = generate(
        ours, prompt, mask_token_id=257, gen_length=8, steps=8, block_length=4, threshold=0.02, cache="dual",
        stats=stats,
    )[0, 7:].tolist()  # fmt: skip
    req = Instance("generate_until", {}, ("And God", {"until": []}), 0)
    assert fast.generate_until([req])[0] == ByteTokenizer().detokenize(cut_at_stop(ids, {256}))
    assert fast.nfe == stats["nfe"] <= 8
