"""``megadlms-generate --load CKPT --prompt "..."``: sample from a trained checkpoint.

Loads a checkpoint of either format (torch_dist or torch), saved by any wrapper at any
data-parallel size, into a single process (GPU if available), rebuilds the model and
tokenizer from the checkpoint's own record, and prints the completion. With ``--chat
--prompt USER_TEXT [--system TEXT]`` the prompt is a user turn of the tokenizer's chat
template and only the assistant's answer is printed. Diffusion models use LLaDA's
sampler (``megadlms.diffusion.generate``); causal (vanilla) models sample left to right.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence, Set

import torch

from megadlms.checkpoint import load_model_state, open_checkpoint, tokenizer_record
from megadlms.common.enums import AttnMaskType, RunningMode
from megadlms.data import TokenizerConfig
from megadlms.data.chat import chat_prompt_ids, load_chat_tokenizer
from megadlms.diffusion import generate, token_logits
from megadlms.diffusion.sampler import CACHE_MODES
from megadlms.models import GPTModel, TransformerConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megadlms-generate", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--load",
        required=True,
        help="checkpoint: a --save directory (its latest iteration) or one iter_* directory",
    )
    p.add_argument("--prompt", default="", help="text to complete (may be empty)")
    p.add_argument("--gen-length", type=int, default=128, help="tokens to generate")
    p.add_argument(
        "--steps", type=int, default=None, help="denoising steps (default: --gen-length, one token per step)"
    )
    p.add_argument(
        "--block-length",
        type=int,
        default=None,
        help="semi-autoregressive block length (default: --gen-length, one block)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="Gumbel temperature; 0 = greedy")
    p.add_argument(
        "--remasking",
        choices=("low_confidence", "random"),
        default="low_confidence",
        help="which predictions to keep at each step (LLaDA)",
    )
    p.add_argument("--cfg-scale", type=float, default=0.0, help="classifier-free guidance scale")
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="Fast-dLLM's parallel decoding: each step commits every masked token of the block whose "
        "confidence reaches T (at least one); the forward passes used (NFE) are reported",
    )
    p.add_argument(
        "--cache",
        choices=CACHE_MODES,
        default="none",
        help="Fast-dLLM's block-wise approximate KV cache, refreshed at each block: prefix (keys/values "
        "before the block kept) or dual (those after it too); none recomputes every position",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature / random remasking)")
    p.add_argument("--num-samples", type=int, default=1, help="completions of the same prompt")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="--prompt is a user turn: apply the chat template, print only the assistant's answer "
        "(cut at EOS / end-of-turn)",
    )
    p.add_argument("--system", default=None, help="--chat: a system turn before the user turn")
    p.add_argument(
        "--tokenizer-model",
        default=None,
        help="--chat: tokenizer directory with a chat template (default: the checkpoint's tokenizer)",
    )
    return p


def load_for_inference(path: str, device: Optional[torch.device] = None, *, prefer_fp32_params: bool = True):
    """(model in eval mode, tokenizer, common.json dict) from a checkpoint path.

    ``prefer_fp32_params``: a bf16/fp16 run's exact fp32 main params where the checkpoint
    has them (False: its stored, rounded weights)."""

    ckpt, common = open_checkpoint(path)
    # Model and tokenizer come from the checkpoint's own records, never from flag names.
    tokenizer = TokenizerConfig.from_dict(tokenizer_record(common)).build()
    mcfg = common["model_config"]
    # The model knows its real vocabulary (the sampler and the scorers cut the padding rows by it);
    # checkpoints older than that record get it from their tokenizer record.
    cfg = {**mcfg, "unpadded_vocab_size": unpadded_vocab_size(tokenizer, common)}
    model = GPTModel(TransformerConfig.from_dict(cfg))
    # No layout: one process reads the full tensors whatever tp / pp / ep / dp saved them.
    load_model_state(ckpt, model, model_config=mcfg, prefer_fp32_params=prefer_fp32_params)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval(), tokenizer, common


def running_mode(common: dict) -> RunningMode:
    """The checkpoint's --model-running-mode (its run record; an import records it alone), so a
    shifted model (difflm-shift, Dream) is sampled and scored with its shift; difflm-noshift for
    records without one."""
    diffusion = (common.get("args") or {}).get("diffusion") or {}
    return RunningMode(diffusion.get("model_running_mode", RunningMode.DIFFLM_NOSHIFT.value))


def unpadded_vocab_size(tokenizer, common: dict) -> int:
    """The vocabulary before Megatron's padding (the rows past it are never tokens): as
    recorded with the model (``model_config.unpadded_vocab_size``), else (checkpoints before
    that record) --vocab-size when the run set it, else the tokenizer's size."""
    recorded = (common.get("model_config") or {}).get("unpadded_vocab_size")
    return int(recorded or tokenizer_record(common).get("vocab_size") or tokenizer.vocab_size)


@torch.no_grad()
def _sample_causal(
    model, prompt: torch.Tensor, gen_length: int, temperature: float, generator: torch.Generator
) -> torch.Tensor:
    x = prompt
    for _ in range(gen_length):
        # No KV cache: the whole sequence is re-run for every token (a reference sampler, not a fast one).
        # The real tokens only: Megatron's padding rows are cut before the softmax / argmax.
        logits = token_logits(model, model(x)[:, -1]).double()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            # On the CPU with a CPU generator: the same seed gives the same text on any device.
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(x.device)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        x = torch.cat([x, nxt], dim=1)
    return x


def sample_ids(
    model,
    common: dict,
    ids: Sequence[int],
    mask_token_id: Optional[int],
    *,
    gen_length: int = 128,
    steps: Optional[int] = None,
    block_length: Optional[int] = None,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    cfg_scale: float = 0.0,
    seed: int = 0,
    num_samples: int = 1,
    threshold: Optional[float] = None,
    cache: Optional[str] = None,
    stats: Optional[Dict[str, int]] = None,
    eos_token_id: Optional[int] = None,
) -> torch.Tensor:
    """The ``gen_length`` new token ids [num_samples, gen_length] (CPU) after prompt ``ids`` (a
    block-diffusion model given ``eos_token_id``: up to the block in which every sample has it);
    ``threshold``, ``cache`` and ``stats`` (receives "nfe"): :func:`megadlms.diffusion.generate`'s."""

    device = next(model.parameters()).device
    max_len = model.config.max_position_embeddings
    if len(ids) + gen_length > max_len:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + --gen-length ({gen_length}) exceeds the "
            f"model's {max_len} positions; shorten one of them"
        )
    # Samples differ only through the RNG: one batch of identical prompts.
    prompt_t = torch.tensor([list(ids)] * num_samples, dtype=torch.int64, device=device)
    if common["model_config"].get("attention") == AttnMaskType.CAUSAL:
        if not ids:
            # Left-to-right needs a last position to predict from; a DLM denoises from all-[MASK] instead.
            raise ValueError("a causal (vanilla) model needs a non-empty --prompt")
        g = torch.Generator().manual_seed(seed)
        out = _sample_causal(model, prompt_t, gen_length, temperature, g)
    else:
        if mask_token_id is None:
            raise ValueError("a diffusion model needs the tokenizer's [MASK] id to sample")
        out = generate(
            model,
            prompt_t,
            mask_token_id=mask_token_id,
            gen_length=gen_length,
            steps=steps or gen_length,
            # a block-diffusion model generates with its own block size
            block_length=block_length or (None if model.config.difflm_block_size else gen_length),
            temperature=temperature,
            remasking=remasking,
            cfg_scale=cfg_scale,
            seed=seed,
            threshold=threshold,
            cache=cache,
            stats=stats,
            running_mode=running_mode(common),
            eos_token_id=eos_token_id,  # a block-diffusion model stops after the block holding it
        )
    return out[:, len(ids) :].cpu()


def generate_text(model, tokenizer, common: dict, prompt: str, **sampling) -> list:
    """Completions (strings, prompt excluded) of ``prompt``; ``sampling``: the keyword
    arguments of :func:`sample_ids` (gen_length, steps, block_length, temperature,
    remasking, cfg_scale, seed, num_samples)."""

    mask_id = None if _is_causal(common) else tokenizer.mask_token_id
    if model.config.difflm_block_size is not None:  # variable length: stop at the end-of-document block
        sampling.setdefault("eos_token_id", getattr(tokenizer, "eod", None))
    rows = sample_ids(model, common, tokenizer.tokenize(prompt), mask_id, **sampling)
    return [tokenizer.detokenize(row.tolist()) for row in rows]


def _is_causal(common: dict) -> bool:
    return common["model_config"].get("attention") == AttnMaskType.CAUSAL


# End-of-turn tokens of the common chat templates (LLaDA / Llama 3, ChatML, Phi, Gemma) and the usual
# EOS strings: the assistant's answer ends at the first of them the tokenizer has.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


def chat_stop_ids(chat_tok) -> Set[int]:
    """Ids that end an assistant turn: the tokenizer's EOS and its end-of-turn tokens."""
    stops = {chat_tok.eos_token_id} if chat_tok.eos_token_id is not None else set()
    vocab = chat_tok.get_vocab()
    return stops | {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}


def cut_at_stop(ids: Sequence[int], stop_ids: Set[int]) -> List[int]:
    """``ids`` up to (without) the first stop id: LLaDA fills the rest of the answer with EOS."""
    for i, t in enumerate(ids):
        if int(t) in stop_ids:
            return [int(x) for x in ids[:i]]
    return [int(x) for x in ids]


def chat_tokenizer_dir(tokenizer_model: Optional[str], common: dict) -> str:
    """The tokenizer directory whose chat template --chat applies: --tokenizer-model, else
    the directory of the checkpoint's recorded HuggingFaceTokenizer."""
    if tokenizer_model:
        return tokenizer_model
    record = tokenizer_record(common)
    path = record.get("tokenizer_model")
    if record.get("tokenizer_type") != "HuggingFaceTokenizer" or not path:
        raise ValueError(
            f"--chat needs --tokenizer-model DIR (a tokenizer with a chat template); the checkpoint's "
            f"tokenizer is {record.get('tokenizer_type', 'ByteTokenizer')}, which has none"
        )
    return path if os.path.isdir(path) else os.path.dirname(path)


def generate_chat(
    model, tokenizer, common: dict, chat_tok, user: str, *, system: Optional[str] = None, **sampling
) -> List[str]:
    """Assistant answers (strings) to one ``user`` turn (after an optional ``system`` turn),
    rendered with ``chat_tok``'s template and cut at EOS / end-of-turn; ``sampling``: the
    keyword arguments of :func:`sample_ids`."""

    vocab = model.config.unpadded_vocab_size or model.config.vocab_size
    if len(chat_tok) > vocab:
        raise ValueError(
            f"the chat tokenizer has {len(chat_tok)} tokens, more than the model's {vocab}: "
            "pass the tokenizer the model was trained with"
        )
    turns = [("system", system)] if system else []
    messages = [{"role": r, "content": c} for r, c in turns + [("user", user)]]
    ids = chat_prompt_ids(chat_tok, messages, add_generation_prompt=True)
    mask_id = None if _is_causal(common) else tokenizer.mask_token_id
    stops = chat_stop_ids(chat_tok)
    rows = sample_ids(model, common, ids, mask_id, **sampling)
    return [chat_tok.decode(cut_at_stop(row.tolist(), stops), skip_special_tokens=True) for row in rows]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    sampling = dict(
        gen_length=args.gen_length,
        steps=args.steps,
        block_length=args.block_length,
        temperature=args.temperature,
        remasking=args.remasking,
        cfg_scale=args.cfg_scale,
        seed=args.seed,
        num_samples=args.num_samples,
        threshold=args.threshold,
        cache=args.cache,
        stats={},
    )
    try:
        if args.system is not None and not args.chat:
            raise ValueError("--system needs --chat")
        model, tokenizer, common = load_for_inference(
            args.load, torch.device(args.device) if args.device else None
        )
        if args.chat:
            chat_tok = load_chat_tokenizer(chat_tokenizer_dir(args.tokenizer_model, common))
            texts = generate_chat(
                model, tokenizer, common, chat_tok, args.prompt, system=args.system, **sampling
            )
        else:
            texts = [
                args.prompt + t for t in generate_text(model, tokenizer, common, args.prompt, **sampling)
            ]
    except (ValueError, FileNotFoundError) as exc:
        print(f"megadlms-generate: error: {exc}", file=sys.stderr)
        return 2
    nfe = sampling["stats"].get("nfe")
    print(
        f"# checkpoint {args.load} (iteration {common['iteration']}), "
        f"{args.gen_length} tokens, {args.steps or args.gen_length} steps"
        + ("" if args.threshold is None else f", threshold {args.threshold}")
        + ("" if args.cache == "none" else f", {args.cache} cache")
        + ("" if nfe is None else f", NFE {nfe}"),
        file=sys.stderr,
    )
    for text in texts:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
