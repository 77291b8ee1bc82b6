"""megadlms-export-hf of a chat model: the tokenizer's chat template and BOS / EOS travel with
the export, and LLaDA-8B-Instruct's model-card calls (apply_chat_template + generate) work."""

import json
import os

import pytest
import torch

from megadlms.data.chat import chat_prompt_ids, load_chat_tokenizer
from megadlms.diffusion import generate
from megadlms.hf.export import export_hf
from megadlms.hf.tokenizer_files import source_tokenizer_settings

from .chat_helpers import BOS, EOS, LLADA_TEMPLATE, MASK, VOCAB, write_chat_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
MESSAGES = [{"role": "user", "content": "what is two plus three"}]
SAMPLER = dict(
    steps=8, gen_length=8, block_length=4, temperature=0.0, cfg_scale=0.0, remasking="low_confidence"
)


@pytest.fixture(scope="module")
def chat_export(tmp_path_factory, chat_ckpt):
    """(export dir, source tokenizer dir, our model)."""
    ck, tok_dir, model = chat_ckpt
    out = tmp_path_factory.mktemp("chat_export")
    config = export_hf(str(ck), str(out))
    assert config["vocab_size"] == VOCAB
    return out, tok_dir, model


def test_export_keeps_template_and_special_tokens(chat_export):
    out, _, _ = chat_export
    tok_config = json.load(open(os.path.join(out, "tokenizer_config.json")))
    assert tok_config["chat_template"] == LLADA_TEMPLATE
    assert tok_config["bos_token"] == "<|startoftext|>" and tok_config["eos_token"] == "<|endoftext|>"
    assert tok_config["mask_token"] == "<|mdm_mask|>"
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["bos_token_id"], config["eos_token_id"], config["mask_token_id"]) == (BOS, EOS, MASK)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (tok.bos_token_id, tok.eos_token_id, tok.mask_token_id) == (BOS, EOS, MASK)


def test_model_card_chat_calls_match_our_sampler(chat_export):
    out, tok_dir, ours = chat_export
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    inputs = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt")
    ids = inputs["input_ids"]
    # The export renders the conversation exactly as the training tokenizer did (BOS included).
    assert ids[0].tolist() == chat_prompt_ids(load_chat_tokenizer(tok_dir), MESSAGES)
    assert ids[0, 0].item() == BOS
    # LLaDA's card: render as text, tokenize, generate.
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert tok(text)["input_ids"] == ids[0].tolist()
    ref = generate(ours, ids, mask_token_id=MASK, gen_length=8, steps=8, block_length=4)
    for got in (
        model.generate(ids, **SAMPLER),
        model.generate(inputs, **SAMPLER),
        model.generate(**inputs, **SAMPLER),
    ):
        assert torch.equal(got, ref)
    answer = tok.batch_decode(ref[:, ids.shape[1] :], skip_special_tokens=True)[0]
    assert "<|" not in answer


def test_source_settings_from_transformers5_layout(tmp_path):
    """transformers 5 saves the template as chat_template.jinja and tokens as AddedToken dicts."""
    src = write_chat_tokenizer(tmp_path / "tok", template=False)
    (tmp_path / "tok" / "chat_template.jinja").write_text(LLADA_TEMPLATE)
    config = json.load(open(tmp_path / "tok" / "tokenizer_config.json"))
    config["bos_token"] = {"content": "<|startoftext|>", "special": True}
    json.dump(config, open(tmp_path / "tok" / "tokenizer_config.json", "w"))
    got = source_tokenizer_settings(os.path.join(src, "tokenizer.json"))
    assert got == {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "chat_template": LLADA_TEMPLATE,
    }
    assert source_tokenizer_settings(str(tmp_path / "nowhere" / "tokenizer.json")) == {}
