"""A padded-vocabulary checkpoint (the byte tokenizer's 259 ids in 384 rows) whose padding rows
carry the largest logits on purpose (issue 43): megadlms' sampler and the Hugging Face
export's ``generate`` choose the same tokens, real ones only; ``megadlms-generate`` prints
only decodable text; a checkpoint older than the model's vocabulary record gets it from its
tokenizer record."""

import pytest
import torch

from megadlms.checkpoint import RunRecords, save_checkpoint
from megadlms.data import TokenizerConfig
from megadlms.diffusion import generate
from megadlms.generate import load_for_inference
from megadlms.generate import main as generate_main
from megadlms.hf.export import export_hf
from megadlms.models import GPTModel, TransformerConfig
from tests.diffusion._padding import padding_rows_win

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REAL, MASK = 259, 257
CONFIG = dict(
    num_layers=1,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=384,
    unpadded_vocab_size=REAL,
    seq_length=32,
    position_embedding_type="rope",
    normalization="LayerNorm",
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def _save(root, runner_up=None, record_vocab=True, attention="bidirectional"):
    torch.manual_seed(0)
    # Tied: the padding rows of the word embedding are the output layer's.
    cfg = TransformerConfig(**CONFIG, attention=attention)
    model = padding_rows_win(GPTModel(cfg), REAL, runner_up)
    record = cfg.to_dict()
    if not record_vocab:  # as checkpoints saved before the record
        del record["unpadded_vocab_size"]
    save_checkpoint(
        str(root),
        1,
        model=model,
        ckpt_format="torch",
        records=RunRecords(model_config=record, tokenizer=TokenizerConfig().to_dict()),
    )
    return root


@pytest.fixture(scope="module")
def padded_export(tmp_path_factory):
    ck = _save(tmp_path_factory.mktemp("padded") / "ck")
    out = tmp_path_factory.mktemp("padded_export")
    export_hf(str(ck), str(out))
    hf = transformers.AutoModel.from_pretrained(str(out), trust_remote_code=True).eval()
    ours, _, _ = load_for_inference(str(ck), torch.device("cpu"))
    return ours, hf


@pytest.mark.parametrize(
    "kw",
    [
        dict(gen_length=8, steps=8, block_length=8),
        dict(gen_length=12, steps=6, block_length=4, remasking="random"),
        dict(gen_length=8, steps=4, block_length=8, temperature=1.0),
        dict(gen_length=8, steps=8, block_length=4, cfg_scale=1.5, temperature=0.5),
    ],
)
def test_sampler_and_export_choose_the_same_real_tokens(padded_export, kw):
    ours, hf = padded_export
    prompt = torch.tensor([list(b"And God"), list(b"In the ")], dtype=torch.int64)
    with torch.no_grad():
        assert (ours(prompt).argmax(-1) >= REAL).all()  # the padding rows would win everywhere
    assert hf.config.vocab_size == REAL and ours.config.unpadded_vocab_size == REAL
    # No vocab_size argument: the loaded model knows its vocabulary from the checkpoint.
    ref = generate(ours, prompt, mask_token_id=MASK, seed=4, **kw)
    got = hf.generate(prompt, seed=4, **kw)
    assert torch.equal(got, ref)
    assert (got < REAL).all() and not (got == MASK).any()


def test_megadlms_generate_prints_only_decodable_text(tmp_path, capsys):
    # 'x' is the best real token: a sampler that cuts the padding rows prints x's; one that draws the
    # padding rows prints ids no tokenizer decodes (the byte tokenizer drops them: nothing).
    ck = _save(tmp_path / "ck", runner_up=ord("x"), record_vocab=False)
    model, _, _ = load_for_inference(str(ck), torch.device("cpu"))
    # The record is missing: the loader takes the real vocabulary from the tokenizer record.
    assert (model.config.vocab_size, model.config.unpadded_vocab_size) == (384, REAL)
    capsys.readouterr()
    argv = ["--load", str(ck), "--prompt", "ab", "--gen-length", "8", "--steps", "4", "--block-length", "4"]
    assert generate_main(argv) == 0
    assert generate_main(argv + ["--temperature", "1.0", "--remasking", "random", "--cfg-scale", "0.5"]) == 0
    assert capsys.readouterr().out.splitlines() == ["ab" + "x" * 8] * 2
    # A causal (vanilla) checkpoint: the left-to-right sampler cuts the padding rows too.
    causal = _save(tmp_path / "causal", runner_up=ord("x"), attention="causal")
    argv = ["--load", str(causal), "--prompt", "ab", "--gen-length", "4"]
    assert generate_main(argv) == 0 and generate_main(argv + ["--temperature", "1.0"]) == 0
    assert capsys.readouterr().out.splitlines() == ["abxxxx"] * 2
