"""A block-diffusion checkpoint's Hugging Face export carries its block size: the remote code's
``generate`` runs block by block with the exact cache and gives megadlms' tokens (float64,
greedy and threshold), stopping at the EOS block."""

from __future__ import annotations

import copy

import torch
import transformers

from megadlms.checkpoint import RunRecords, save_checkpoint
from megadlms.data import TokenizerConfig
from megadlms.diffusion import generate
from megadlms.hf.export import export_hf
from megadlms.models import GPTModel
from tests.hf.helpers import ROPE_SWIGLU, tiny_config
from tests.hf.test_fast_dllm_cache import MASK, _varied_weights


def test_block_export_generates_megadlms_tokens(tmp_path):
    cfg = tiny_config(**ROPE_SWIGLU, untie_embeddings_and_output_weights=True, difflm_block_size=4)
    torch.manual_seed(0)
    model = GPTModel(cfg, attention="bidirectional")
    _varied_weights(model)
    records = RunRecords(model_config=cfg.to_dict(), tokenizer=TokenizerConfig().to_dict())
    save_checkpoint(str(tmp_path / "ck"), 1, model=model, ckpt_format="torch_dist", records=records)
    export_hf(str(tmp_path / "ck"), str(tmp_path / "hf"))
    hf = transformers.AutoModelForMaskedLM.from_pretrained(
        str(tmp_path / "hf"), trust_remote_code=True, dtype=torch.float64
    )
    assert hf.config.megadlms_model_config["difflm_block_size"] == 4
    ours = copy.deepcopy(model).double().eval()
    for plen, threshold in ((3, None), (8, None), (5, 0.5)):
        prompt = torch.randint(0, MASK, (1, plen), generator=torch.Generator().manual_seed(plen))
        kw = dict(steps=16, gen_length=16, threshold=threshold)
        want = generate(ours, prompt, mask_token_id=MASK, cache="prefix", **kw)
        got = hf.eval().generate(prompt, mask_id=MASK, eos_token_id=None, **kw)
        assert torch.equal(got, want), (plen, threshold)
    eos = int(want[0, 6])  # a token of the first generated block
    short = hf.generate(prompt, mask_id=MASK, eos_token_id=eos, **kw)
    assert torch.equal(short, generate(ours, prompt, mask_token_id=MASK, eos_token_id=eos, **kw))
    assert short.shape[1] < want.shape[1]


def test_megadlms_generate_cli_runs_a_block_checkpoint(tmp_path, capsys):
    from megadlms.generate import main

    cfg = tiny_config(**ROPE_SWIGLU, difflm_block_size=4)
    torch.manual_seed(0)
    model = GPTModel(cfg, attention="bidirectional")
    records = RunRecords(model_config=cfg.to_dict(), tokenizer=TokenizerConfig().to_dict())
    save_checkpoint(str(tmp_path / "ck"), 1, model=model, ckpt_format="torch_dist", records=records)
    base = ["--load", str(tmp_path / "ck"), "--prompt", "abc", "--gen-length", "8", "--device", "cpu"]
    assert main(base + ["--cache", "prefix"]) == 0
    cached = capsys.readouterr().out
    assert main(base) == 0
    assert capsys.readouterr().out == cached and cached.startswith("abc")
