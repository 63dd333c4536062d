"""Named device topologies (`meshes/*.toml`): how many devices, the default prefill and decode
layouts, and the hardware constants the cost model needs. Pure Python, no jax."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from jaxpipe.config.layout import Layout

MESH_DIR = Path(__file__).resolve().parents[2] / "meshes"


@dataclass(frozen=True)
class Hardware:
    """Per-device constants. Bandwidths in bytes/s, FLOP/s, memory in bytes."""

    memory_bytes: float
    hbm_bandwidth: float
    peak_flops: float
    host_link_bandwidth: float
    p2p_bandwidth: float
    allreduce_bandwidth: dict[int, float] = field(default_factory=dict)  # TP degree -> bytes/s

    def allreduce(self, tp: int) -> float:
        """All-reduce bus bandwidth at TP degree `tp` (nearest listed degree at or below)."""
        if tp <= 1:
            return float("inf")
        known = sorted(self.allreduce_bandwidth)
        below = [d for d in known if d <= tp] or known[:1]
        return self.allreduce_bandwidth[below[-1]]


@dataclass(frozen=True)
class MeshPreset:
    name: str
    description: str
    platform: str  # "cpu" | "gpu"
    num_devices: int
    prefill: Layout
    decode: Layout
    hardware: Hardware


def mesh_names() -> list[str]:
    return sorted(p.stem for p in MESH_DIR.glob("*.toml"))


def load_mesh(name: str) -> MeshPreset:
    """The preset `meshes/<name>.toml`, or a ValueError listing the presets."""
    path = MESH_DIR / f"{name}.toml"
    if not isinstance(name, str) or not path.is_file():
        raise ValueError(f"unknown mesh {name!r}; presets: {', '.join(mesh_names())}")
    raw = tomllib.loads(path.read_text())
    hw, n = raw["hardware"], int(raw["num_devices"])
    preset = MeshPreset(
        name=name, description=raw.get("description", ""), platform=raw["platform"],
        num_devices=n, prefill=Layout.parse(raw["layouts"]["prefill"]),
        decode=Layout.parse(raw["layouts"]["decode"]), hardware=_hardware(hw))
    preset.prefill.check_devices(n, f"mesh {name}: prefill layout")
    preset.decode.check_devices(n, f"mesh {name}: decode layout")
    return preset


def _hardware(hw: dict) -> Hardware:
    giga = 1e9
    return Hardware(
        memory_bytes=hw["memory_gb"] * 2**30, hbm_bandwidth=hw["hbm_gbps"] * giga,
        peak_flops=hw["peak_tflops"] * 1e12, host_link_bandwidth=hw["host_link_gbps"] * giga,
        p2p_bandwidth=hw["p2p_gbps"] * giga,
        allreduce_bandwidth={int(k): v * giga for k, v in hw["allreduce_gbps"].items()})
