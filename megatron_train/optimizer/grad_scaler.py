"""fp16 loss scalers (Megatron's ConstantGradScaler and DynamicGradScaler)."""

from __future__ import annotations


class ConstantGradScaler:
    """A fixed loss scale (`--loss-scale`); overflowing steps are still skipped."""

    def __init__(self, scale: float) -> None:
        if scale <= 0:
            raise ValueError(f"--loss-scale must be positive, got {scale}")
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """A static scale never changes."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler(ConstantGradScaler):
    """Halve the scale after `hysteresis` overflowing steps, double it after `growth_interval` clean ones.

    Same state machine as Megatron: an overflow resets the growth counter and uses up one unit of hysteresis;
    the scale backs off (never below `min_scale`) once hysteresis is exhausted; a growth refills hysteresis.
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_interval: int,
        hysteresis: int,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ) -> None:
        super().__init__(initial_scale)
        if not 0 < min_scale <= initial_scale:
            raise ValueError(
                f"need 0 < --min-loss-scale ({min_scale}) <= --initial-loss-scale ({initial_scale})"
            )
        if growth_interval <= 0 or hysteresis <= 0:
            raise ValueError("--loss-scale-window and --hysteresis must be positive")
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
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
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
