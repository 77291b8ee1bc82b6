"""MegaDLMs' examples/dlm_generation/dlm_inference.py against our export: its calls, in its
order, with its arguments (device cpu instead of cuda), offline; then the properties the
script relies on: left-padded batches, both argument-name sets, top_p, the unpadded
vocabulary and one precision for direct and converted exports."""

import importlib
import json
import os
import types

import pytest
import torch

from megadlms.checkpoint import RunRecords, save_checkpoint
from megadlms.checkpoint.convert import ConvertedCheckpoint, convert_checkpoint
from megadlms.config import CheckpointConfig
from megadlms.data import TokenizerConfig
from megadlms.diffusion import generate
from megadlms.hf.export import export_hf
from megadlms.hf.importer import init_from_hf, read_hf_config, transformer_config_from_hf
from megadlms.models import GPTModel

from .helpers import ROPE_SWIGLU, tiny_config

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

PROMPT = "The capital of France is"  # the script's prompt


@pytest.fixture(scope="module")
def script_model(rope_swiglu_export):
    """(tokenizer, model) loaded as dlm_inference.py loads them, with no network."""
    out, _ = rope_swiglu_export
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("TRANSFORMERS_OFFLINE", "1")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(out), torch_dtype="auto", trust_remote_code=True, attn_implementation="flash_attention_2"
        ).to("cpu")
    finally:
        mp.undo()
    return tokenizer, model


def test_dlm_inference_script_runs_unchanged(script_model, rope_swiglu_export, capsys):
    _, ours = rope_swiglu_export
    tokenizer, model = script_model
    model_inputs = tokenizer([PROMPT], return_tensors="pt", padding_side="left", padding=True).to("cpu")
    generated_ids = model.generate(
        **model_inputs,
        temperature=0.0,
        cfg=0.0,
        remasking="low_confidence",
        inference_block_size=256,
        sample_steps=256,
        max_new_tokens=256,
        verbose=True,
    )
    response = tokenizer.batch_decode(generated_ids, skip_special_tokens=True)
    print(response)
    assert "block 1/1 done" in capsys.readouterr().err  # verbose
    prompt = torch.tensor([list(PROMPT.encode())])
    # Reference: megadlms' own sampler on the megadlms model, LLaDA's names, the tokenizer's vocabulary.
    ref = generate(
        ours, prompt, mask_token_id=257, gen_length=256, steps=256, block_length=256, vocab_size=259
    )
    assert torch.equal(generated_ids, ref)
    assert len(response) == 1 and response[0].startswith(PROMPT)
    assert model.config.vocab_size == 259 and len(tokenizer) == 259


def test_left_padded_batch_equals_each_prompt_alone(script_model):
    tokenizer, model = script_model
    prompts = ["In the beginning God created", "And God said", "Let there be light, and"]
    batch = tokenizer(prompts, return_tensors="pt", padding_side="left", padding=True)
    assert (batch["attention_mask"] == 0).any()  # really padded
    for kw in (
        dict(sample_steps=8, inference_block_size=4, max_new_tokens=8, cfg=0.0),  # semi-autoregressive
        dict(sample_steps=6, inference_block_size=6, max_new_tokens=6, cfg=1.5),  # guidance
    ):
        got = model.generate(**batch, temperature=0.0, remasking="low_confidence", **kw)
        for i, text in enumerate(prompts):
            alone = tokenizer([text], return_tensors="pt")
            one = model.generate(**alone, temperature=0.0, remasking="low_confidence", **kw)
            assert torch.equal(got[i, -kw["max_new_tokens"] :], one[0, -kw["max_new_tokens"] :]), (i, kw)
    # LLaDA's names are the same sampler: steps / gen_length / block_length / cfg_scale / mask_id.
    llada = model.generate(
        batch["input_ids"],
        batch["attention_mask"],
        steps=6,
        gen_length=6,
        block_length=6,
        temperature=0.0,
        cfg_scale=1.5,
        remasking="low_confidence",
        mask_id=257,
    )
    assert torch.equal(llada, got)
    with pytest.raises(ValueError, match="steps=4 and sample_steps=8 disagree"):
        model.generate(batch["input_ids"], steps=4, sample_steps=8, max_new_tokens=8)


def test_top_p_and_temperature_sampling(script_model):
    from transformers.generation.logits_process import TopPLogitsWarper

    tokenizer, model = script_model
    # The sampler module as the export ships it (the copy transformers imported next to the model).
    gen_module = importlib.import_module(type(model).__module__.rsplit(".", 1)[0] + ".generation_megadlms")
    logits = torch.randn(4, 7, 259, generator=torch.Generator().manual_seed(0)) * 3
    for top_p in (0.3, 0.9):
        ref = TopPLogitsWarper(top_p)(None, logits.view(-1, 259)).view_as(logits)
        assert torch.equal(gen_module.top_p_filter(logits, top_p).isinf(), ref.isinf())
    ids = tokenizer([PROMPT], return_tensors="pt")
    kw = dict(sample_steps=4, inference_block_size=4, max_new_tokens=4, temperature=1.0, top_p=0.5)
    a, b = model.generate(**ids, seed=5, **kw), model.generate(**ids, seed=5, **kw)
    assert torch.equal(a, b)  # seeded
    # The draw samples softmax(top_p(logits) / T) (MegaDLMs: TopPLogitsWarper, then multinomial).
    row = logits[0, 0].clone()
    row[257] = float("-inf")  # the draw never picks [MASK]; the reference excludes it the same way
    T, n = 1.5, 6000
    settings = {"temperature": T, "top_p": 0.9}
    drawn = gen_module.draw(row.expand(n, 259), settings, 257, torch.Generator().manual_seed(1))
    expect = torch.softmax(gen_module.top_p_filter(row, 0.9).double() / T, dim=-1)
    freq = torch.bincount(drawn, minlength=259).double() / n
    assert expect[drawn].min() > 0  # only tokens of the top-p set
    assert (freq - expect).abs().max() < 0.03 and (expect > 0).sum() > 3


def _save(root, cfg, state, optimizer=None):
    save_checkpoint(
        str(root),
        2,
        model=ConvertedCheckpoint(state),
        optimizer=optimizer,
        ckpt_format="torch_dist",
        records=RunRecords(model_config=cfg.to_dict(), tokenizer=TokenizerConfig().to_dict()),
    )


def _files(out):
    tensors = safetensors.load_file(os.path.join(out, "model.safetensors"))
    config = json.load(open(os.path.join(out, "config.json")))
    config.pop("megadlms_source")
    return tensors, config


def test_vocab_unpadded_and_one_precision(tmp_path, rope_swiglu_ckpt, rope_swiglu_export):
    ck, ours = rope_swiglu_ckpt
    # tp2 pads 259 tokens to 512 rows (128 * tp), dp to 384: the same weights, more padding rows.
    cfg512 = tiny_config(**ROPE_SWIGLU, vocab_size=512)
    sd = {k: v.clone() for k, v in ours.state_dict().items()}
    emb = sd["embedding.word_embeddings.weight"]
    sd["embedding.word_embeddings.weight"] = torch.cat([emb, torch.randn(128, emb.shape[1])])
    _save(tmp_path / "tp2", cfg512, sd)
    export_hf(str(tmp_path / "tp2"), str(tmp_path / "hf_tp2"))
    dp_tensors, dp_config = _files(rope_swiglu_export[0])
    tp_tensors, tp_config = _files(tmp_path / "hf_tp2")
    assert dp_config == tp_config and dp_config["vocab_size"] == 259
    assert dp_tensors.keys() == tp_tensors.keys()
    assert all(torch.equal(dp_tensors[k], tp_tensors[k]) for k in dp_tensors)
    assert dp_tensors["model.embed_tokens.weight"].shape[0] == 259
    # Our importer re-pads: into a tp2-sized run the real rows are copied, the padding is their mean.
    run = GPTModel(cfg512)
    report = init_from_hf(run, str(tmp_path / "hf_tp2"))
    assert report["mean_rows"] == list(range(259, 512))
    got = run.embedding.word_embeddings.weight
    assert torch.equal(got[:259], emb[:259])
    torch.testing.assert_close(got[300], emb[:259].double().mean(0).float())

    # A bf16 run: bf16 model weights + fp32 main params; its --ckpt-convert-format copy has no optimizer.
    cfg = tiny_config(**ROPE_SWIGLU)
    main = {k: v + 1e-3 * torch.randn_like(v) for k, v in ours.state_dict().items()}
    optim = {
        "state": {
            k: {"exp_avg": torch.zeros_like(v), "exp_avg_sq": torch.zeros_like(v), "fp32_param": v}
            for k, v in main.items()
        },
        "step": 1,
        "param_groups": [{"lr": 1e-4, "params": list(main)}],
        "grad_scaler": None,
    }
    bf16 = {k: v.to(torch.bfloat16) for k, v in main.items()}
    _save(tmp_path / "bf16", cfg, bf16, optimizer=ConvertedCheckpoint(optim))
    conf = types.SimpleNamespace(
        checkpoint=CheckpointConfig(
            load=str(tmp_path / "bf16"),
            ckpt_convert_save=str(tmp_path / "conv"),
            ckpt_convert_format="torch",
            no_load_optim=True,
            no_save_optim=True,
        )
    )
    convert_checkpoint(conf)
    direct = export_hf(str(tmp_path / "bf16"), str(tmp_path / "hf_direct"))
    converted = export_hf(str(tmp_path / "conv" / "torch"), str(tmp_path / "hf_conv"))
    assert direct["dtype"] == converted["dtype"] == "bfloat16"  # as MegaDLMs writes a --bf16 run
    a, _ = _files(tmp_path / "hf_direct")
    b, _ = _files(tmp_path / "hf_conv")
    assert all(torch.equal(a[k], b[k]) for k in a)
    exact = export_hf(str(tmp_path / "bf16"), str(tmp_path / "hf_fp32"), dtype="fp32")
    assert exact["megadlms_source"]["weights"] == "fp32 main params"
    c, _ = _files(tmp_path / "hf_fp32")
    assert torch.equal(c["model.norm.weight"], main["decoder.final_layernorm.weight"])
    assert not torch.equal(c["model.norm.weight"], a["model.norm.weight"].float())


def test_importer_reads_megadlms_style_export(tmp_path, rope_swiglu_ckpt, rope_swiglu_export):
    """A directory as MegaDLMs' megatron_to_hf_te.py writes it (hf_configs/gptneox_1.7b_dlm)."""
    _, ours = rope_swiglu_ckpt
    src = rope_swiglu_export[0]
    ours_cfg = json.load(open(os.path.join(src, "config.json")))
    os.makedirs(tmp_path / "mega")
    tensors = safetensors.load_file(os.path.join(src, "model.safetensors"))
    # Saved untied, as MegaDLMs' --untieembed conversion writes it.
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    safetensors.save_file(tensors, str(tmp_path / "mega" / "model.safetensors"), {"format": "pt"})
    mega = {
        "architectures": ["DiffLM"],
        "auto_map": {
            "AutoConfig": "configuration_dlm.DLMConfig",
            "AutoModelForCausalLM": "modeling_dlm.DiffLM",
        },
        "hidden_act": "silu",
        "hidden_size": 32,
        "intermediate_size": ours_cfg["intermediate_size"],
        "max_position_embeddings": ours_cfg["max_position_embeddings"],
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": ours_cfg["norm_eps"],
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 259,
        "mask_token_id": 257,
        "attn_mask_type": "bidirectional",
    }
    json.dump(mega, open(tmp_path / "mega" / "config.json", "w"))
    cfg = transformer_config_from_hf(read_hf_config(str(tmp_path / "mega")), seq_length=48)
    assert cfg.qk_layernorm and not cfg.add_bias_linear and cfg.attention == "bidirectional"
    run = GPTModel(type(cfg).from_dict({**cfg.to_dict(), "vocab_size": 384})).eval()
    init_from_hf(run, str(tmp_path / "mega"))
    ids = torch.randint(0, 259, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(run(ids)[..., :259], ours(ids)[..., :259], rtol=0, atol=1e-5)
