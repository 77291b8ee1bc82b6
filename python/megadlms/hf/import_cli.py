"""``megadlms-import-hf --hf DIR --output CKPT``: a Hugging Face model (Llama / Qwen2 / Qwen3, LLaDA,
Dream) as a megadlms checkpoint (iteration 0, weights only) to continue pretraining from with
``--load CKPT --finetune`` (see ``importer`` for what maps and how rows are initialised).

The tokenizer.json of DIR is copied next to the checkpoint; when it has no mask token and
``--mask-token`` names none, ``<|mask|>`` is added to it as a special token (the next id)
and its embedding row starts at the mean of the real tokens' rows.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch

from megadlms.checkpoint import RunRecords, save_checkpoint
from megadlms.common.enums import AttnMaskType, CkptFormat, RunningMode
from megadlms.config import padded_vocab_size
from megadlms.data import TokenizerConfig
from megadlms.data.tokenizers import MASK_NAMES, resolve_mask_token
from megadlms.models import GPTModel

from . import dream
from .importer import init_from_hf, model_flags, read_hf_config, transformer_config_from_hf


def _mask_token(tok, requested: Optional[str]):
    """(mask id, added?) for tokenizers.Tokenizer ``tok``."""

    size = tok.get_vocab_size(with_added_tokens=True)
    if requested is not None:
        return resolve_mask_token(requested, tok.token_to_id, size, "the Hugging Face tokenizer"), False
    for name in MASK_NAMES:
        if tok.token_to_id(name) is not None:
            return int(tok.token_to_id(name)), False
    tok.add_special_tokens(["<|mask|>"])
    return int(tok.token_to_id("<|mask|>")), True


def import_hf(
    hf_dir: str,
    output: str,
    *,
    mask_token: Optional[str] = None,
    seq_length: Optional[int] = None,
    vocab_divisible_by: int = 128,
    attention: AttnMaskType = AttnMaskType.BIDIRECTIONAL,
    ckpt_format: str = "torch_dist",
    running_mode: Optional[RunningMode] = None,
) -> dict:
    """Write the checkpoint; returns {"checkpoint", "mask_token_id", "added", "flags"}.
    ``running_mode``: recorded with the checkpoint (generation and scoring read it); default
    the model's own (``dream.running_mode``: difflm-shift for Dream)."""
    from tokenizers import Tokenizer

    tok_path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise FileNotFoundError(f"--hf {hf_dir}: no tokenizer.json there (a fast tokenizer is needed)")
    tok = Tokenizer.from_file(tok_path)
    real_tokens = tok.get_vocab_size(with_added_tokens=True)
    mask_id, added = _mask_token(tok, mask_token)
    hf = read_hf_config(hf_dir)
    cfg = transformer_config_from_hf(hf, f"--hf {hf_dir}", seq_length=seq_length, attention=attention)
    if attention == AttnMaskType.CAUSAL:
        running_mode = RunningMode.VANILLA
    running_mode = dream.running_mode(hf) if running_mode is None else RunningMode(running_mode)
    dream.check_running_mode(hf, running_mode, f"--hf {hf_dir}")
    hf_rows = cfg.vocab_size  # the rows of the HF embedding (LLaDA: its embedding_size)
    # Either may be larger (HF pads vocab_size; added tokens go past it): HF's own rows stay tokens, as in HF.
    real = max(hf_rows, tok.get_vocab_size(with_added_tokens=True))
    vocab = padded_vocab_size(real, vocab_divisible_by)
    cfg = type(cfg).from_dict({**cfg.to_dict(), "vocab_size": vocab, "unpadded_vocab_size": real})
    torch.manual_seed(0)  # rows beyond the HF vocabulary are set to the mean; the rest is copied
    model = GPTModel(cfg)
    report = init_from_hf(
        model,
        hf_dir,
        mean_init_ids=[mask_id] if added else [],
        # real_tokens is counted before the mask token is added, so the mean excludes the new row.
        num_real_tokens=min(real_tokens, hf_rows),
    )
    tok_dir = os.path.join(os.path.abspath(output), "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    record = TokenizerConfig(
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=os.path.join(tok_dir, "tokenizer.json"),
        mask_token=mask_id,
        vocab_size=real,
    )
    ckpt = save_checkpoint(
        output,
        0,
        model=model,
        ckpt_format=ckpt_format,
        records=RunRecords(
            args={"diffusion": {"model_running_mode": running_mode.value}},
            model_config=cfg.to_dict(),
            tokenizer=record.to_dict(),
        ),
        extra={"hf_import": {"source": os.path.abspath(hf_dir), **report}},
    )
    flags = model_flags(cfg) + [
        f"--seq-length {cfg.seq_length}",
        "--tokenizer-type HuggingFaceTokenizer",
        f"--tokenizer-model {record.tokenizer_model}",
        f"--mask-token {mask_id}",
        # Before padding, as Megatron's flag: the run pads it (and keeps this checkpoint's rows).
        f"--vocab-size {real}",
        f"--load {output} --finetune",
    ]
    if running_mode is not RunningMode.DIFFLM_NOSHIFT:
        # A causal import continues as an AR model (the flag makes the run's attention causal); Dream shifted.
        flags.append(f"--model-running-mode {running_mode}")
    return {"checkpoint": ckpt, "mask_token_id": mask_id, "added": added, "flags": flags}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megadlms-import-hf", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--hf", required=True, help="local Hugging Face model directory (config.json, safetensors)"
    )
    p.add_argument("--output", required=True, help="megadlms checkpoint directory to write (a --save root)")
    p.add_argument("--mask-token", default=None, help="existing token (string or id) to use as [MASK]")
    p.add_argument(
        "--seq-length", type=int, default=None, help="training length (default min(max pos, 4096))"
    )
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="Megatron's vocab padding")
    p.add_argument(
        "--model-running-mode",
        choices=[m.value for m in RunningMode],
        default=None,
        help="default: the model's own (difflm-shift for Dream, else difflm-noshift)",
    )
    p.add_argument(
        "--ckpt-format", choices=[m.value for m in CkptFormat], default=CkptFormat.TORCH_DIST.value
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = import_hf(
            args.hf,
            args.output,
            mask_token=args.mask_token,
            seq_length=args.seq_length,
            vocab_divisible_by=args.make_vocab_size_divisible_by,
            # An AR import keeps its causal mask; a DLM sees the whole sequence.
            attention=(
                AttnMaskType.CAUSAL
                if args.model_running_mode is not None
                and RunningMode(args.model_running_mode) is RunningMode.VANILLA
                else AttnMaskType.BIDIRECTIONAL
            ),
            ckpt_format=CkptFormat(args.ckpt_format),
            running_mode=None if args.model_running_mode is None else RunningMode(args.model_running_mode),
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"megadlms-import-hf: error: {exc}", file=sys.stderr)
        return 2
    how = "added" if out["added"] else "chosen"
    print(f"wrote {out['checkpoint']} (mask token id {out['mask_token_id']}, {how})")
    print("continue with: pretrain_difflm.py " + " ".join(out["flags"]) + " <data and training flags>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
