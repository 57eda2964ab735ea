"""fp16 loss scaling: static, or dynamic with overflow skip (DeepSpeed's semantics).

Only fp16 flat buffers use it; bf16 has fp32's range and trains unscaled.
"""

from __future__ import annotations

from ..config import ZeroConfig


class LossScaler:
    """Dynamic: start at ``2**initial_scale_power``; after ``hysteresis`` overflows in a
    row halve the scale (not below ``min_loss_scale``); after ``loss_scale_window`` clean
    steps double it."""

    def __init__(self, config: ZeroConfig, enabled: bool):
        self.enabled = enabled
        self.dynamic = enabled and config.loss_scale == 0
        self.scale = float(config.loss_scale or 2.0**config.initial_scale_power) if enabled else 1.0
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self.min_scale = config.min_loss_scale
        self._clean_steps = 0
        self._hysteresis_left = config.hysteresis
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped_steps += 1
        if not self.dynamic:
            return
        if overflow:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
                self._hysteresis_left = self.hysteresis
        else:
            self._clean_steps += 1
            if self._clean_steps % self.window == 0:
                self.scale *= 2
                self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "hysteresis_left": self._hysteresis_left,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])
