"""A layout: how one model replica is spread over devices (`pp` pipeline stages x `tp` tensor
shards x `ep` expert shards, times `dp` replicas). Written as text like "tp=4,pp=2" or
"ep=4,tp=2"; pure Python, no jax."""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("pp", "tp", "ep", "dp")


@dataclass(frozen=True)
class Layout:
    """Degrees of pipeline (`pp`), tensor (`tp`), expert (`ep`: a mixture-of-experts layer's
    experts split over devices) and data (`dp`) parallelism."""

    pp: int = 1
    tp: int = 1
    ep: int = 1
    dp: int = 1

    def __post_init__(self):
        for axis in AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"layout degree {axis} must be a positive integer, got {value!r}")

    @property
    def num_devices(self) -> int:
        return self.pp * self.tp * self.ep * self.dp

    @classmethod
    def parse(cls, text: str | Layout) -> Layout:
        """"tp=4,pp=2" -> Layout(pp=2, tp=4). Omitted axes are 1."""
        if isinstance(text, Layout):
            return text
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"a layout is written like 'pp=4,tp=2', got {text!r}")
        degrees: dict[str, int] = {}
        for part in text.replace(" ", "").split(","):
            axis, sep, value = part.partition("=")
            if not sep or axis not in AXES or not value.isdigit() or axis in degrees:
                raise ValueError(f"bad layout {text!r} at {part!r}: write comma-separated "
                                 f"'axis=degree' with axis in {AXES}, each once, e.g. 'pp=4,tp=2'")
            degrees[axis] = int(value)
        return cls(**degrees)

    def check_devices(self, num_devices: int, what: str = "layout") -> None:
        """Raise unless pp*tp*ep*dp uses exactly `num_devices` devices."""
        if self.num_devices != num_devices:
            raise ValueError(f"{what} {self} uses pp*tp*ep*dp = {self.num_devices} devices but the "
                             f"mesh has {num_devices}; the product must equal the device count")

    def __str__(self) -> str:
        parts = [f"{a}={getattr(self, a)}" for a in AXES if getattr(self, a) > 1]
        return ",".join(parts) or "pp=1,tp=1"
