"""Loss scalers for fp16 training (Megatron-core's ``optimizer/grad_scaler.py`` semantics)."""

from __future__ import annotations


class ConstantGradScaler:
    """A fixed loss scale (``--loss-scale``); overflowing steps are still skipped."""

    def __init__(self, scale: float) -> None:
        if scale <= 0:
            raise ValueError(f"loss_scale must be positive, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        return None

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    """Dynamic loss scale.

    On overflow the growth counter resets and the hysteresis counter drops by one; when
    it reaches zero the scale is multiplied by ``backoff_factor`` (not below
    ``min_scale``). After ``growth_interval`` clean steps in a row the scale is multiplied
    by ``growth_factor`` and the hysteresis counter is refilled. Megatron's defaults:
    initial 2**32, window 1000, hysteresis 2, min 1, factors 2 and 0.5.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        if initial_scale <= 0 or min_scale <= 0 or min_scale > initial_scale:
            raise ValueError(f"need 0 < min_loss_scale ({min_scale}) <= initial_loss_scale ({initial_scale})")
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError("growth_factor must be > 1 and backoff_factor in (0, 1)")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(
                f"loss_scale_window ({growth_interval}) and hysteresis ({hysteresis}) must be >= 1"
            )
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            # Hysteresis tolerates a few overflows before backing off; only growth refills it, so
            # until the next growth every further overflow backs the scale off.
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))
