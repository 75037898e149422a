"""How the devices are arranged for one iteration. Pure Python: the planner imports it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, order=True)
class Layout:
    """Degrees of data (dp), pipeline (pp) and Ulysses sequence (sp) parallelism.

    The same devices are arranged as a ``(dp, pp, sp)`` mesh; ``sp`` is the fastest
    varying axis so that a sequence-parallel group stays inside a node.
    """

    dp: int = 1
    pp: int = 1
    sp: int = 1

    def __post_init__(self):
        for name in ("dp", "pp", "sp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive int, got {value!r}")

    @property
    def num_devices(self) -> int:
        return self.dp * self.pp * self.sp

    def validate(
        self,
        num_devices: int,
        *,
        num_heads: int | None = None,
        num_layers: int | None = None,
    ) -> None:
        """Raises ValueError naming the violated constraint."""
        if self.num_devices != num_devices:
            raise ValueError(
                f"{self}: dp*pp*sp = {self.num_devices} but there are {num_devices} devices; "
                "choose degrees whose product equals the device count"
            )
        if num_heads is not None and num_heads % self.sp:
            raise ValueError(f"{self}: Ulysses needs num_heads ({num_heads}) divisible by sp ({self.sp})")
        if num_layers is not None and num_layers % self.pp:
            raise ValueError(
                f"{self}: num_layers ({num_layers}) must be divisible by pp ({self.pp}) "
                "so that every stage holds the same number of layers"
            )

    def __str__(self) -> str:
        return f"Layout(dp={self.dp}, pp={self.pp}, sp={self.sp})"
