"""examples/sft.sh (docs/fine_tuning.md's measured table), shortened for CI to 3 steps per run:
the synthetic task's data, megadlms-preprocess-sft, three trainings on 2 CPU ranks (chance, --sft,
the pretraining objective on the same tokens) and the held-out exact-match table."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sft_example_runs_and_prints_the_table(tmp_path):
    env = dict(os.environ, PY=sys.executable, OUT=str(tmp_path / "sft"), ITERS="3", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "examples", "sft.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "wrote 3840 conversations (3840 samples, 0 rows skipped)" in out
    rows = re.findall(r"^\| (untrained|--sft|pretraining objective)[^|]*\| (\d+\.\d)% \|$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["untrained", "--sft", "pretraining objective"], proc.stdout[-2000:]
    for name in ("chance", "sft", "pretraining_objective"):
        assert (tmp_path / "sft" / name / "latest_checkpointed_iteration.txt").exists()
    _chat_through_transformers(tmp_path / "sft")


def _chat_through_transformers(out):
    """The fine-tuned checkpoint exported to Hugging Face chats as LLaDA-8B-Instruct's model card
    shows: the export's tokenizer applies the chat template, its model generates (the same ids as
    our sampler on the checkpoint)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from megadlms.diffusion import generate
    from megadlms.generate import load_for_inference
    from megadlms.hf.export import main as export

    assert export(["--load", str(out / "sft"), "--output", str(out / "hf")]) == 0
    tok = AutoTokenizer.from_pretrained(str(out / "hf"))
    model = AutoModel.from_pretrained(str(out / "hf"), trust_remote_code=True).eval()
    messages = [{"role": "user", "content": "reverse a b c d"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])[None]
    got = model.generate(ids, steps=8, gen_length=8, block_length=8, temperature=0.0)
    ours, ours_tok, _ = load_for_inference(str(out / "sft"), torch.device("cpu"))
    want = generate(ours, ids, mask_token_id=ours_tok.mask, gen_length=8, steps=8, block_length=8)
    assert ids[0, 0].item() == tok.bos_token_id and torch.equal(got, want)
