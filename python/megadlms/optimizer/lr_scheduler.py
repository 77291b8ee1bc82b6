"""Learning-rate schedule with Megatron's ``OptimizerParamScheduler`` semantics.

Steps are counted in SAMPLES, as Megatron does: the trainer calls
``step(increment=global_batch_size)`` after every successful optimizer step, and
the warmup / decay lengths are ``iters x global_batch_size``. So changing the data-
parallel size or micro-batch size never changes the schedule.

    lr(n) = init_lr + (max_lr - init_lr) * n / warmup          n <= warmup (warmup > 0)
          = max_lr                                            style == constant
          = min_lr                                            n > decay_steps
          = min_lr + coeff(r) * (max_lr - min_lr)             otherwise,
    r = (n - warmup) / (decay_steps - warmup)
    linear: coeff = 1 - r;   cosine: coeff = (1 + cos(pi r)) / 2
    WSD: coeff = 1 until n > decay_steps - wsd_decay_steps, then with
         w = (n - (decay_steps - wsd_decay_steps)) / wsd_decay_steps:
         linear 1 - w | cosine (1 + cos(pi w)) / 2 | exponential 2 * 0.5**w - 1 |
         minus_sqrt 1 - sqrt(w)

Like Megatron, the constructor applies ``step(0)``: with warmup the very first
iteration runs at ``init_lr`` (0 by default).
"""

from __future__ import annotations

import math
from typing import Optional

DECAY_STYLES = ("constant", "linear", "cosine", "WSD", "inverse-square-root")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")

# Fields that define the schedule; a checkpoint's values must match unless overridden.
_SCHEDULE_FIELDS = (
    "max_lr",
    "min_lr",
    "init_lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "lr_decay_style",
    "wsd_decay_steps",
    "lr_wsd_decay_style",
    "weight_decay",
)


class OptimizerParamScheduler:
    """Sets ``lr`` (and ``weight_decay``) in every param group of ``optimizer``.

    Args:
        optimizer: anything with ``param_groups`` (list of dicts).
        max_lr / min_lr / init_lr: peak, floor, and warmup start (``--lr``, ``--min-lr``).
        lr_warmup_steps / lr_decay_steps / wsd_decay_steps: in samples.
        lr_decay_style: constant | linear | cosine | WSD | inverse-square-root.
        lr_wsd_decay_style: linear | cosine | exponential | minus_sqrt (WSD only).
        weight_decay: constant weight decay written into groups whose ``weight_decay``
            is non-zero (groups built with 0.0, e.g. biases and norms, keep 0.0).
    """

    def __init__(
        self,
        optimizer,
        *,
        max_lr: float,
        min_lr: float = 0.0,
        init_lr: float = 0.0,
        lr_warmup_steps: int = 0,
        lr_decay_steps: int,
        lr_decay_style: str = "linear",
        wsd_decay_steps: Optional[int] = None,
        lr_wsd_decay_style: str = "exponential",
        weight_decay: Optional[float] = None,
    ) -> None:
        if lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"lr_decay_style must be one of {DECAY_STYLES}, got {lr_decay_style!r}")
        if lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(
                f"lr_wsd_decay_style must be one of {WSD_DECAY_STYLES}, got {lr_wsd_decay_style!r}"
            )
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= min_lr ({min_lr}) <= lr ({max_lr})")
        if lr_decay_steps <= 0:
            raise ValueError(
                f"lr decay length must be positive (lr_decay_iters / train_iters), "
                f"got {lr_decay_steps} samples"
            )
        if not 0 <= lr_warmup_steps < lr_decay_steps:
            raise ValueError(
                f"lr_warmup_iters ({lr_warmup_steps} samples) must be smaller "
                f"than lr_decay_iters ({lr_decay_steps} samples)"
            )
        if lr_decay_style == "WSD":
            if wsd_decay_steps is None or wsd_decay_steps <= 0:
                raise ValueError("lr_decay_style WSD needs lr_wsd_decay_iters > 0")
            if wsd_decay_steps > lr_decay_steps - lr_warmup_steps:
                raise ValueError(
                    f"lr_wsd_decay_iters ({wsd_decay_steps} samples) must fit in "
                    f"lr_decay_iters minus lr_warmup_iters "
                    f"({lr_decay_steps - lr_warmup_steps} samples)"
                )
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.init_lr = float(max_lr), float(min_lr), float(init_lr)
        self.lr_warmup_steps, self.lr_decay_steps = int(lr_warmup_steps), int(lr_decay_steps)
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = None if wsd_decay_steps is None else int(wsd_decay_steps)
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.weight_decay = weight_decay
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        """The learning rate at the current ``num_steps`` (Megatron's formula, module doc)."""
        n, warmup = self.num_steps, self.lr_warmup_steps
        if warmup > 0 and n <= warmup:
            return self.init_lr + (self.max_lr - self.init_lr) * n / warmup
        if self.lr_decay_style == "constant":
            return self.max_lr
        if n > self.lr_decay_steps:
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            # No warmup counts as 1 step: max_lr * sqrt(0) would pin the lr at min_lr.
            warmup = max(warmup, 1)
            return max(self.min_lr, self.max_lr * math.sqrt(warmup) / math.sqrt(max(n, 1)))
        ratio = (n - warmup) / (self.lr_decay_steps - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable until the last wsd_decay_steps, then anneal
            assert self.wsd_decay_steps is not None  # WSD requires it (__init__)
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                w = (n - anneal_start) / self.wsd_decay_steps
                coeff = {
                    "linear": lambda: 1.0 - w,
                    "cosine": lambda: 0.5 * (math.cos(math.pi * w) + 1.0),
                    "exponential": lambda: 2.0 * math.pow(0.5, w) - 1.0,
                    "minus_sqrt": lambda: 1.0 - math.sqrt(w),
                }[self.lr_wsd_decay_style]()
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int) -> float:
        """Advance by ``increment`` samples and write the new lr into the param groups."""
        self.num_steps += int(increment)
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            # A group built with 0.0 (biases, norms) stays 0.0: no_weight_decay decided that once.
            if self.weight_decay is not None and group.get("weight_decay", 0.0) != 0.0:
                group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)
        return lr

    def state_dict(self) -> dict:
        """Plain ints/floats/strs only (safe to store in JSON or load with weights_only)."""
        sd = {k: getattr(self, k) for k in _SCHEDULE_FIELDS}
        sd["num_steps"] = self.num_steps
        return sd

    def load_state_dict(self, state_dict: dict, *, override: bool = False) -> None:
        """Restore ``num_steps``. A schedule field that differs from the checkpoint is an
        error naming the field, unless ``override`` (the current flags win, Megatron's
        ``--override-opt-param-scheduler``)."""
        if not override:
            for key in _SCHEDULE_FIELDS:
                if key in state_dict and state_dict[key] != getattr(self, key):
                    raise ValueError(
                        f"LR schedule mismatch: {key} is {state_dict[key]!r} in the checkpoint but "
                        f"{getattr(self, key)!r} from the flags; use the checkpoint's value or pass "
                        "override_opt_param_scheduler (--override-opt_param-scheduler, Megatron's "
                        "spelling; --override-opt-param-scheduler also works) to keep the new schedule"
                    )
        self.num_steps = int(state_dict["num_steps"])
        # Write the restored position's lr into the groups now, as the constructor does.
        self.step(0)
