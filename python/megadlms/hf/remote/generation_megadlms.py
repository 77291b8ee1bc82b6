"""The diffusion sampler of a megadlms export (``MegaDLMsModelLM.generate``); torch only.

LLaDA's semi-autoregressive low-confidence remasking (Nie et al. 2025, their generate.py),
called with either project's argument names:

=====================  =====================  ==============================================
MegaDLMs               LLaDA                  meaning
=====================  =====================  ==============================================
``sample_steps``       ``steps``              denoising steps in all (split over the blocks)
``max_new_tokens``     ``gen_length``         tokens to generate (or ``max_length`` - prompt)
``inference_block_size`` ``block_length``     semi-autoregressive block length
``cfg``                ``cfg_scale``          classifier-free guidance scale
``remasking``          ``remasking``          "low_confidence" or "random"
``temperature``        ``temperature``        0: argmax; > 0: sample softmax(logits / T)
``top_p``              (none)                 nucleus filter of the logits before sampling
``threshold``          (Fast-dLLM)            commit every masked token of the block whose
                                              confidence reaches it (>= 1 a step; default off)
``cache``              (Fast-dLLM)            "prefix" / "dual": the block-wise approximate KV
                                              cache, refreshed at each block (default none)
(config)               ``mask_id``            the [MASK] id (default: config.mask_token_id)
=====================  =====================  ==============================================

Batches are left-padded with an ``attention_mask`` (1 = token): positions count from each
row's first token (MegaDLMs' ``cumsum - 1``) and padding is masked out of attention, so a
row's completion does not depend on the other rows (greedy and deterministic settings).
Sampling at temperature T draws from softmax(logits / T) after the top-p filter (MegaDLMs'
order); Gumbel-max in float64 (LLaDA) with ``generator`` or one seeded with ``seed``, so
a call is reproducible. [MASK] is excluded from the draw (as ``megadlms-generate``).

Vocabulary: an export holds only the real tokens' rows (``megadlms-export-hf`` drops
Megatron's padding rows), so every logit here is a token; megadlms' own sampler cuts its
logits to the same rows, and both choose the same tokens.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F

# MegaDLMs' name -> LLaDA's (the sampler's own names).
ALIASES = {
    "sample_steps": "steps",
    "inference_block_size": "block_length",
    "max_new_tokens": "gen_length",
    "cfg": "cfg_scale",
}
REMASKING = ("low_confidence", "random")
# Generation arguments of HF's generate that change nothing in a fixed-length diffusion sampler.
IGNORED = ("token_type_ids", "do_sample", "use_cache", "pad_token_id", "eos_token_id", "bos_token_id")


def _pick(explicit: dict, llada: str, megadlms: Optional[str]):
    """The value given under either name (an error when both are given and differ)."""
    a, b = explicit.get(llada), explicit.get(megadlms) if megadlms else None
    if a is not None and b is not None and a != b:
        raise ValueError(f"generate: {llada}={a!r} and {megadlms}={b!r} disagree; pass one of them")
    return a if a is not None else b


def resolve(args: dict, defaults: dict, prompt_len: int, max_positions: int) -> dict:
    """Sampler settings from generate()'s keyword arguments ``args`` (either name set, or a
    ``generation_config`` object) over the export's ``defaults`` (config.json)."""
    gen_cfg = args.pop("generation_config", None)
    if gen_cfg is not None:
        # A GenerationConfig the caller built (MegaDLMs reads temperature / top_p from it); kwargs win.
        for key in ("temperature", "top_p", "max_new_tokens", "max_length"):
            if args.get(key) is None and getattr(gen_cfg, key, None) is not None:
                args[key] = getattr(gen_cfg, key)
    reverse = {v: k for k, v in ALIASES.items()}
    out = {}
    for name in ("steps", "gen_length", "block_length", "cfg_scale", "remasking", "temperature", "top_p"):
        out[name] = _pick(args, name, reverse.get(name))
    out["threshold"] = None if args.get("threshold") is None else float(args["threshold"])
    out["cache"] = None if args.get("cache") in (None, "none") else args["cache"]
    if out["gen_length"] is None and args.get("max_length") is not None:
        out["gen_length"] = int(args["max_length"]) - prompt_len  # HF: max_length counts the prompt
    # The export's steps / block length belong to its gen_length: a caller's own length gets
    # one token per step in one block unless it says otherwise.
    stored = defaults if out["gen_length"] is None else {}
    for name, fallback in (("cfg_scale", 0.0), ("remasking", "low_confidence")):
        if out[name] is None:
            out[name] = defaults.get(name, fallback)
    if out["gen_length"] is None:
        # MegaDLMs' default without a stored one: fill the model's positions after the prompt.
        out["gen_length"] = stored.get("gen_length") or max_positions - prompt_len
    out["steps"] = out["steps"] or stored.get("steps") or out["gen_length"]
    out["block_length"] = out["block_length"] or stored.get("block_length") or out["gen_length"]
    out["temperature"] = 0.0 if out["temperature"] is None else float(out["temperature"])
    out["top_p"] = 1.0 if out["top_p"] is None else float(out["top_p"])
    _check(out)
    return out


def _check(s: dict) -> None:
    gen, block, steps = s["gen_length"], s["block_length"], s["steps"]
    if gen <= 0 or block <= 0 or steps <= 0:
        raise ValueError(f"generate: gen_length ({gen}), block_length ({block}), steps ({steps}) must be > 0")
    if gen % block:
        raise ValueError(
            f"generate: gen_length / max_new_tokens ({gen}) must be a multiple of block_length ({block})"
        )
    if steps % (gen // block):
        raise ValueError(
            f"generate: steps ({steps}) must be a multiple of gen_length/block_length = {gen // block}"
        )
    if s["remasking"] not in REMASKING:
        raise ValueError(f"generate: remasking must be one of {REMASKING}, got {s['remasking']!r}")
    if s["temperature"] < 0 or s["cfg_scale"] < 0 or not 0 < s["top_p"] <= 1:
        raise ValueError(
            f"generate: temperature ({s['temperature']}) and cfg ({s['cfg_scale']}) must be >= 0, "
            f"top_p ({s['top_p']}) in (0, 1]"
        )
    threshold = s.get("threshold")
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise ValueError(f"generate: threshold must be in (0, 1] (a confidence), got {threshold}")
    if s.get("cache") not in (None, "prefix", "dual"):
        raise ValueError(f"generate: cache must be 'none', 'prefix' or 'dual', got {s['cache']!r}")


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits outside the smallest set of most likely tokens holding ``top_p`` of the
    probability set to -inf (the most likely token always stays; HF's TopPLogitsWarper)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Mass strictly above each token: a token goes once the more likely ones already reach top_p.
    above = probs.cumsum(dim=-1) - probs
    drop = torch.zeros_like(above, dtype=torch.bool).scatter(-1, order, above >= top_p)
    return logits.masked_fill(drop, float("-inf"))


def draw(logits: torch.Tensor, s: dict, mask_id: int, generator: torch.Generator) -> torch.Tensor:
    """x0 per position: argmax (T = 0) or a sample of softmax(top_p(logits) / T)."""
    scores = logits.clone()
    scores[..., mask_id] = float("-inf")  # a committed position never holds [MASK]
    if s["temperature"] == 0:
        return scores.argmax(dim=-1)
    scores = top_p_filter(scores.to(torch.float64), s["top_p"])
    u = torch.rand(scores.shape, dtype=torch.float64, device=scores.device, generator=generator)
    # Gumbel-max in product form (LLaDA): argmax of exp(l) / (-log u)^T samples softmax(l / T).
    return (scores.exp() / (-torch.log(u)) ** s["temperature"]).argmax(dim=-1)


def _num_transfer(block_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """[b, steps] tokens to commit per step: each row's masks spread evenly, remainder first."""
    num = block_mask.sum(dim=1, keepdim=True)
    ids = torch.arange(steps, device=block_mask.device)[None, :]
    return num // steps + (ids < num % steps).to(torch.int64)


class _Forwards:
    """The model calls of one generation, through Fast-dLLM's cache protocol when ``cache`` is
    "prefix" (keys/values before the block kept, the block and the rest recomputed) or "dual"
    (only the block recomputed, at its ``replace_position``); every block starts with a full
    forward that refreshes the cache. ``nfe`` counts the forward passes (a CFG pair is one)."""

    def __init__(self, model, keep, position_ids, prompt_index, s, mask_id) -> None:
        self.model, self.keep, self.position_ids = model, keep, position_ids
        self.prompt_index, self.s, self.mask_id = prompt_index, s, mask_id
        self.rows = 2 if s["cfg_scale"] > 0 else 1
        # The mask only when a row is padded: an unpadded batch runs the plain attention path.
        self.mask = None if bool(keep.all()) else keep.to(torch.int64).repeat(self.rows, 1)
        self.past: Optional[list] = None
        self.nfe = 0

    def span(self, step: int, start: int, end: int, total: int):
        if self.s["cache"] is None or step == 0:
            return 0, total
        return start, (total if self.s["cache"] == "prefix" else end)

    def logits(self, x, lo: int, hi: int, step: int, start: int):
        """Logits of x[:, lo:hi] (CFG mixed)."""
        self.nfe += 1
        part = x[:, lo:hi]
        if self.rows == 2:
            uncond = part.clone()
            uncond[self.prompt_index[:, lo:hi]] = self.mask_id
            part = torch.cat([part, uncond])
        kwargs = {
            "attention_mask": self.mask,
            "position_ids": self.position_ids[:, lo:hi].repeat(self.rows, 1),
        }
        if self.s["cache"] is not None and step > 0:
            kwargs["past_key_values"] = self.past
            if self.s["cache"] == "dual":
                replace = torch.zeros(part.shape[0], x.shape[1], dtype=torch.bool, device=x.device)
                replace[:, lo:hi] = True
                kwargs["replace_position"] = replace
            elif self.mask is not None:
                kwargs["attention_mask"] = self.mask[:, :hi]
        out = self.model(part, use_cache=self.s["cache"] is not None and step == 0, **kwargs)
        if self.s["cache"] is not None and step == 0:
            keep_to = start if self.s["cache"] == "prefix" else x.shape[1]
            self.past = [(k[:, :, :keep_to], v[:, :, :keep_to]) for k, v in out.past_key_values]
        if self.rows == 1:
            return out.logits
        cond, unc = out.logits.chunk(2)
        return unc + (self.s["cfg_scale"] + 1) * (cond - unc)


@torch.no_grad()
def diffusion_generate(
    model, prompt, attention_mask, s: dict, mask_id: int, generator, verbose=False, stats=None
):
    """Complete left-padded ``prompt`` [b, P] -> [b, P + gen_length] (settings ``s``); ``stats``
    receives "nfe", the forward passes."""
    b, P = prompt.shape
    gen, block_len = s["gen_length"], s["block_length"]
    device = prompt.device
    if attention_mask is None:
        attention_mask = torch.ones_like(prompt)
    keep = torch.cat(
        [attention_mask.to(device).bool(), torch.ones(b, gen, dtype=torch.bool, device=device)], 1
    )
    position_ids = keep.to(torch.int64).cumsum(-1) - 1
    position_ids.masked_fill_(~keep, 1)  # padding: any position, it is never attended to
    x = torch.full((b, P + gen), mask_id, dtype=torch.int64, device=device)
    x[:, :P] = prompt
    # Padding is never a position to fill, even when its id is the [MASK] id.
    prompt_index = (x != mask_id) | ~keep
    forwards = _Forwards(model, keep, position_ids, prompt_index, s, mask_id)
    num_blocks = gen // block_len
    steps, threshold = s["steps"] // num_blocks, s.get("threshold")
    for block in range(num_blocks):
        start, end = P + block * block_len, P + (block + 1) * block_len
        num_transfer = _num_transfer(x[:, start:end] == mask_id, steps)
        step = 0
        # The schedule's steps; with a threshold, as many as the block needs (each commits >= 1 per row).
        while (
            (step < steps)
            if threshold is None
            else bool(((x[:, start:end] == mask_id) & keep[:, start:end]).any())
        ):
            lo, hi = forwards.span(step, start, end, P + gen)
            part = x[:, lo:hi]
            mask_index = (part == mask_id) & keep[:, lo:hi]
            logits = forwards.logits(x, lo, hi, step, start)
            x0 = draw(logits, s, mask_id, generator)
            if s["remasking"] == "low_confidence":
                conf = F.softmax(logits.to(torch.float64), dim=-1).gather(-1, x0[..., None]).squeeze(-1)
            else:
                conf = torch.rand(x0.shape, dtype=torch.float64, device=device, generator=generator)
            conf[:, end - lo :] = float("-inf")  # later blocks wait their turn
            x0 = torch.where(mask_index, x0, part)
            conf = torch.where(mask_index, conf, torch.full_like(conf, float("-inf")))
            k = num_transfer[:, step] if threshold is None else None
            x = x.clone()
            x[:, lo:hi] = torch.where(_transfer(conf, k, threshold), x0, part)
            step += 1
        if verbose:
            left = int(((x[:, start:end] == mask_id) & keep[:, start:end]).sum())
            print(
                f"generate: block {block + 1}/{num_blocks} done ({step} steps, {left} masks left)",
                file=sys.stderr,
            )
    if stats is not None:
        stats["nfe"] = forwards.nfe
    return x


def _transfer(conf: torch.Tensor, k: Optional[torch.Tensor], threshold: Optional[float]) -> torch.Tensor:
    """The positions to commit: each row's ``k`` most confident, or (``threshold``, Fast-dLLM)
    every one at or above it and always the row's most confident one."""
    finite = torch.isfinite(conf)
    if threshold is not None:
        transfer = (conf >= threshold) & finite
        rows = finite.any(dim=1)
        transfer[rows, conf[rows].argmax(dim=1)] = True
        return transfer
    transfer = torch.zeros_like(finite)
    # Row by row: rows may commit different numbers of tokens.
    for j, n in enumerate(k.tolist() if k is not None else []):
        if n > 0:
            transfer[j, torch.topk(conf[j], n).indices] = True
    return transfer


@torch.no_grad()
def block_diffusion_generate(
    model, prompt, s: dict, mask_id: int, generator, block_size: int, eos_id=None, stats=None
):
    """A block-diffusion export (config ``megadlms_model_config.difflm_block_size``): block by
    block, blocks aligned to end at the prompt's end, the keys/values of each committed clean
    block cached exactly (they never change; megadlms' ``generate_blocks`` with cache
    "prefix"); stops after the block in which every row has produced ``eos_id``. Returns
    [b, P + n * block_size]."""
    b, P = prompt.shape
    x = torch.cat(
        [prompt, torch.full((b, s["gen_length"]), mask_id, dtype=torch.int64, device=prompt.device)], 1
    )
    past = None
    nfe = 0

    def run(lo, hi, commit):
        nonlocal past, nfe
        nfe += 1
        pos = torch.arange(lo, hi, device=x.device).expand(b, hi - lo)
        out = model(x[:, lo:hi], position_ids=pos, past_key_values=past, use_cache=commit)
        if commit:
            past = out.past_key_values
        return out.logits

    bounds = sorted({0, *range(P % block_size, P + 1, block_size)})
    for lo, hi in zip(bounds, bounds[1:]):  # the prompt's clean blocks
        run(lo, hi, True)
    num_blocks = s["gen_length"] // block_size
    steps, threshold = s["steps"] // num_blocks, s.get("threshold")
    done = torch.zeros(b, dtype=torch.bool, device=x.device)
    end = P
    for block in range(num_blocks):
        start, end = P + block * block_size, P + (block + 1) * block_size
        num_transfer = _num_transfer(x[:, start:end] == mask_id, steps)
        step = 0
        while step < steps if threshold is None else bool((x[:, start:end] == mask_id).any()):
            part = x[:, start:end]
            logits = run(start, end, False)
            x0 = draw(logits, s, mask_id, generator)
            if s["remasking"] == "low_confidence":
                conf = F.softmax(logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1).to(torch.float64)
            else:
                conf = torch.rand(x0.shape, dtype=torch.float64, device=x.device, generator=generator)
            mask_index = part == mask_id
            x0 = torch.where(mask_index, x0, part)
            conf = torch.where(mask_index, conf, torch.full_like(conf, float("-inf")))
            k = num_transfer[:, step] if threshold is None else None
            x[:, start:end] = torch.where(_transfer(conf, k, threshold), x0, part)
            step += 1
        if block < num_blocks - 1:
            run(start, end, True)  # the committed block's clean keys/values
        if eos_id is not None:
            done |= (x[:, start:end] == eos_id).any(dim=1)
            if bool(done.all()):
                break
    if stats is not None:
        stats["nfe"] = nfe
    return x[:, :end]
