"""lm-evaluation-harness model ``megadlms``: a megadlms checkpoint evaluated with
LLaDA's likelihood estimator (loglikelihood tasks: multiple choice, ...) and our sampler
(generate_until tasks).

    megadlms-lm-eval --model megadlms --model_args pretrained=CKPT,mc_samples=128 --tasks ...

``megadlms-lm-eval`` is lm-eval's own command line with this model registered (lm-eval
0.4 has no plugin discovery for third-party models, so a plain ``lm_eval`` does not see
it); from Python, ``import megadlms.eval.lm_eval_adapter`` then ``lm_eval.simple_evaluate(
model="megadlms", model_args="pretrained=CKPT")``.

model_args: ``pretrained`` (a --save directory or an iter_* directory), ``mc_samples``
(128, LLaDA's default), ``mc_batch_size`` (forward rows per estimator batch, 16; lm-eval's
own ``--batch_size`` is accepted and has no effect: requests are scored one by one),
``cfg_scale`` (0), ``seed`` (0), ``is_check_greedy`` (False: report is_greedy=False without
the extra decode), ``gen_length`` / ``steps`` / ``block_length`` / ``temperature`` /
``remasking`` / ``threshold`` (Fast-dLLM's parallel decoding) / ``cache`` (none, prefix or dual:
Fast-dLLM's KV cache; the forward passes summed over the requests are ``self.nfe``) for
generate_until (cut at EOS / end-of-turn tokens, then at the task's ``until`` strings),
``device``, ``tokenizer`` (--apply_chat_template: the tokenizer directory whose chat template
renders the requests; default: the checkpoint's recorded tokenizer).

Scores and generations are over the checkpoint's real vocabulary: the loaded model carries
its ``unpadded_vocab_size`` and both the estimator and the sampler cut Megatron's padding
rows by it (``megadlms.diffusion.token_logits``), so a padded run scores and generates as
its Hugging Face export does.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from megadlms.common.enums import AttnMaskType
from megadlms.data.chat import load_chat_tokenizer
from megadlms.diffusion import conditional_log_likelihood, generate
from megadlms.diffusion.sampler import CACHE_MODES
from megadlms.generate import (
    END_OF_TURN_TOKENS,
    chat_tokenizer_dir,
    cut_at_stop,
    load_for_inference,
    running_mode,
)


def _bool(v) -> bool:
    # lm-eval hands model_args over as strings: bool("False") would be True.
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")


@register_model("megadlms")
class MegaDLMsLM(LM):
    """The ``megadlms`` model of lm-evaluation-harness (see the module docstring)."""

    def __init__(
        self,
        pretrained: str,
        mc_samples: int = 128,
        mc_batch_size: int = 16,
        batch_size=None,
        cfg_scale: float = 0.0,
        seed: int = 0,
        is_check_greedy: bool = False,
        gen_length: int = 128,
        steps: Optional[int] = None,
        block_length: Optional[int] = None,
        temperature: float = 0.0,
        remasking: str = "low_confidence",
        threshold: Optional[float] = None,
        cache: Optional[str] = None,
        device: Optional[str] = None,
        tokenizer: Optional[str] = None,
        **unused,
    ) -> None:
        super().__init__()
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's CLI passes --device (default cuda); like its HF model, use the CPU then
            logging.getLogger("megadlms.eval").warning(f"device {device} is not available: using cpu")
            device = "cpu"
        self.model, self.tokenizer, self.common = load_for_inference(
            pretrained, torch.device(device) if device else None
        )
        # LLaDA's estimator needs every position to see the whole sequence: a causal model's scores
        # would mean nothing.
        if self.model.config.attention != AttnMaskType.BIDIRECTIONAL:
            raise ValueError(f"pretrained={pretrained} is a causal (vanilla) model; this adapter is for DLMs")
        self.mask_id = self.tokenizer.mask_token_id
        self.running_mode = running_mode(self.common)  # difflm-shift (Dream): scored and sampled shifted
        self.mc_samples, self.mc_batch = int(mc_samples), int(mc_batch_size)
        self.cfg_scale, self.seed = float(cfg_scale), int(seed)
        self.is_check_greedy = _bool(is_check_greedy)
        self.gen_length = int(gen_length)
        self.steps = int(steps) if steps else self.gen_length
        self.block_length = int(block_length) if block_length else self.gen_length
        self.temperature, self.remasking = float(temperature), remasking
        self.threshold = None if threshold in (None, "", "None") else float(threshold)
        self.cache = None if cache in (None, "", "None", "none") else str(cache)
        if self.cache not in (None, *CACHE_MODES):
            raise ValueError(f"model_args cache={cache!r}: use one of {CACHE_MODES}")
        self.nfe = 0  # forward passes of generate_until so far
        self.max_length = self.model.config.max_position_embeddings
        # --apply_chat_template: the template of this tokenizer directory (None: the recorded one),
        # loaded on first use, so checkpoints without a chat tokenizer evaluate as before.
        self.chat_tokenizer_dir = tokenizer
        self._chat_tok = None
        # A generation ends at EOS / end-of-turn (lm-eval's HF model adds EOS to every `until` too).
        vocab = self.tokenizer.vocab
        self.stop_ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab} | {self.tokenizer.eod}

    # ------------------------------------------------------------------ encoding
    def _split(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
        """Token ids of (context, continuation), tokenized together so a merge across the
        boundary stays in the continuation (lm-eval's HF convention)."""
        # Trailing spaces move to the continuation: BPE joins " word" into one token, which belongs to
        # the answer being scored, not to the prompt.
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tokenizer.tokenize(context + continuation)
        ctx = self.tokenizer.tokenize(context)
        n = len(ctx)
        if whole[:n] != ctx:
            # The context's last token merged with the continuation: it is scored as part of the answer.
            n = max(0, n - 1)
        prompt, answer = whole[:n], whole[n:]
        if not prompt:  # RoPE: an all-[MASK] input has no positions; give one real token
            prompt = [self.tokenizer.eod]
        keep = self.max_length - len(answer)
        if keep < 1:
            raise ValueError(f"continuation of {len(answer)} tokens does not fit {self.max_length} positions")
        # Cut the prompt from the left: the answer is scored whole, the oldest context matters least.
        return prompt[-keep:], answer

    def score(self, context: str, continuation: str) -> float:
        """The estimate of log p(continuation | context) this adapter reports."""
        prompt, answer = self._split(context, continuation)
        return conditional_log_likelihood(
            self.model,
            prompt,
            answer,
            mask_token_id=self.mask_id,
            running_mode=self.running_mode,
            mc_samples=self.mc_samples,
            batch_size=self.mc_batch,
            cfg_scale=self.cfg_scale,
            seed=self.seed,
        )

    def _greedy(self, prompt: List[int], answer: List[int]) -> bool:
        device = next(self.model.parameters()).device
        x = torch.tensor([prompt], dtype=torch.int64, device=device)
        L = len(answer)
        out = generate(
            self.model,
            x,
            mask_token_id=self.mask_id,
            running_mode=self.running_mode,
            gen_length=L,
            # One token per step in one block, as LLaDA's own is_greedy check decodes.
            steps=L,
            block_length=L,
            cfg_scale=self.cfg_scale,
        )
        return out[0, len(prompt) :].tolist() == list(answer)

    # ------------------------------------------------------------------ lm-eval API
    def loglikelihood(self, requests) -> List[Tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args[:2]
            prompt, answer = self._split(context, continuation)
            ll = self.score(context, continuation)
            greedy = self._greedy(prompt, answer) if self.is_check_greedy else False
            out.append((ll, greedy))
        return out

    def loglikelihood_rolling(self, requests) -> List[float]:
        """ELBO of the whole text: disjoint windows, each scored after one eod token."""
        out = []
        for req in requests:
            ids = self.tokenizer.tokenize(req.args[0])
            # One position holds the eod prefix (RoPE needs a real token); windows are disjoint, so a
            # later one sees none of the earlier text.
            width = self.max_length - 1
            total = 0.0
            for start in range(0, len(ids), width):
                total += conditional_log_likelihood(
                    self.model,
                    [self.tokenizer.eod],
                    ids[start : start + width],
                    mask_token_id=self.mask_id,
                    running_mode=self.running_mode,
                    mc_samples=self.mc_samples,
                    batch_size=self.mc_batch,
                    seed=self.seed,
                )
            out.append(total)
        return out

    def generate_until(self, requests) -> List[str]:
        device = next(self.model.parameters()).device
        out = []
        for req in requests:
            context, gen_kwargs = req.args[0], dict(req.args[1]) if len(req.args) > 1 else {}
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            # Left-truncate so prompt + gen_length fits the positions; an empty prompt gets one eod token.
            prompt = self.tokenizer.tokenize(context)[-(self.max_length - self.gen_length) :] or [
                self.tokenizer.eod
            ]
            x = torch.tensor([prompt], dtype=torch.int64, device=device)
            stats: dict = {}
            ids = generate(
                self.model,
                x,
                mask_token_id=self.mask_id,
                running_mode=self.running_mode,
                gen_length=self.gen_length,
                steps=self.steps,
                block_length=self.block_length,
                temperature=self.temperature,
                remasking=self.remasking,
                cfg_scale=self.cfg_scale,
                seed=self.seed,
                threshold=self.threshold,
                cache=self.cache,
                stats=stats,
            )[0, len(prompt) :].tolist()
            self.nfe += stats["nfe"]
            text = self.tokenizer.detokenize(cut_at_stop(ids, self.stop_ids))
            # The sampler has no stop sequences (all positions are decoded at once): cut after the fact.
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(text)
        return out

    # ------------------------------------------------------------------ chat (--apply_chat_template)
    @property
    def chat_tokenizer(self):
        """The transformers tokenizer whose chat template lm-eval applies (loaded once)."""
        if self._chat_tok is None:
            self._chat_tok = load_chat_tokenizer(chat_tokenizer_dir(self.chat_tokenizer_dir, self.common))
        return self._chat_tok

    @property
    def tokenizer_name(self) -> str:
        """The chat tokenizer's directory as one name (lm-eval keys its request cache by it)."""
        return str(self.chat_tokenizer.name_or_path).replace("/", "__")

    def chat_template(self, chat_template=False) -> Optional[str]:
        """The template lm-eval records for --apply_chat_template (None: no template asked for);
        a name picks one of a tokenizer's named templates."""
        if chat_template is False or chat_template is None:
            return None
        template = self.chat_tokenizer.chat_template
        if isinstance(template, dict):
            name = chat_template if isinstance(chat_template, str) else "default"
            if name not in template:
                raise ValueError(f"chat template {name!r} is not one of {sorted(template)}")
            return template[name]
        return template

    def apply_chat_template(self, chat_history: List[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered as text with the chat template; the requests then tokenize
        it as any context (the template's special tokens become their ids)."""
        return self.chat_tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )


def main() -> None:
    """``megadlms-lm-eval``: lm-eval's CLI with the ``megadlms`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
