"""Seesaw's analytic cost model (paper appendix A) for one layout of one model on one mesh.

Notation (per transformer layer): W parameters, hidden size e = h·d, h query heads and h_kv KV
heads of size d, bf16 everywhere (2 bytes per value). On a layout with `tp` tensor shards and `pp`
pipeline stages, one layer's time on one device for a micro-batch is

    T_layer = max(T_dm_linear, T_comp_linear) + max(T_dm_attn, T_comp_attn) + T_nw(tp)

    T_dm_linear   = 2W / (tp · B_hbm)                 weights read once per forward
    T_comp_linear = 2 · tokens · W / (tp · F)         = 2bWs (prefill) or 2bW (decode) FLOPs
    T_dm_attn     = 4 · h_kv · d · kv_tokens / (tp · B_hbm)   K and V rows read + written
    T_comp_attn   = 4 · h · d · pairs / (tp · F)      QK^T and PV over (query, key) pairs
    T_nw(tp)      = 4 · tokens · e / B_ar(tp)          two all-reduces of bf16 activations

where B_ar(tp) = busbw(tp) · tp / (2(tp − 1)) from the mesh preset's all-reduce bus bandwidth
falls as tp grows, and T_nw(1) = 0. A stage holds L/pp
layers; the last one also runs the LM head, and each stage hands its activations on over P2P.
Pipelining splits a step of b sequences into m = min(b, pp) micro-batches of b/m: decode steps
depend on the previous token, so a step costs pp forwards of a stage (`pp · T_stage(b/m)`);
prefill micro-batches are independent, so the pipeline stays full and a step costs
`m · T_stage(b/m)`. KV capacity per replica is the paper's b_max · s:
(u · M · tp · pp − 2P) / (4 · L · h_kv · d) tokens, with u the usable memory fraction.
Re-sharding loads each device's new weight shard from the host copy (2P / (N · B_host)); KV
swaps move 4 · L · h_kv · d bytes per token over all N host links in parallel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxpipe.config import ModelConfig
from jaxpipe.layout import Layout
from jaxpipe.meshes import Hardware

BYTES = 2  # bf16 weights, activations and KV
MEMORY_UTILIZATION = 0.9  # usable fraction of device memory (vLLM's gpu_memory_utilization)


@dataclass(frozen=True)
class CostModel:
    """Step times (seconds), memory and transfer costs of `model` on `layout` over `hardware`."""

    model: ModelConfig
    hardware: Hardware
    layout: Layout
    memory_utilization: float = MEMORY_UTILIZATION

    # ---- model dimensions ------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        """W: parameters of one layer's linear maps (q, k, v, o, gate, up, down)."""
        m = self.model
        attn = 2 * m.hidden_size * m.num_heads * m.head_dim
        attn += 2 * m.hidden_size * m.num_kv_heads * m.head_dim
        return attn + 3 * m.hidden_size * m.intermediate_size

    @property
    def kv_heads_stored(self) -> int:
        """KV heads held across a TP group: replicated up to tp when tp > h_kv."""
        return max(self.model.num_kv_heads, self.layout.tp)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies in one replica, all layers."""
        m = self.model
        return 2 * BYTES * m.num_layers * self.kv_heads_stored * m.head_dim

    # ---- per-layer terms (one device, one micro-batch) --------------------------------------
    def t_dm_linear(self) -> float:
        return BYTES * self.layer_params / (self.layout.tp * self.hardware.hbm_bandwidth)

    def t_comp_linear(self, tokens: float) -> float:
        return 2 * tokens * self.layer_params / (self.layout.tp * self.hardware.peak_flops)

    def t_dm_attn(self, kv_tokens: float) -> float:
        """K and V rows moved (read for decode, written by prefill) for `kv_tokens` tokens."""
        per_token = 2 * BYTES * self.kv_heads_stored * self.model.head_dim
        return kv_tokens * per_token / (self.layout.tp * self.hardware.hbm_bandwidth)

    def t_comp_attn(self, pairs: float) -> float:
        """`pairs` = sum over queries of the keys each attends to."""
        m = self.model
        flops = 4 * pairs * m.num_heads * m.head_dim
        return flops / (self.layout.tp * self.hardware.peak_flops)

    def allreduce_bandwidth(self) -> float:
        """B_ar(tp): bytes of payload all-reduced per second. The mesh lists NCCL-style *bus*
        bandwidth; a ring all-reduce moves 2(tp-1)/tp of the payload over each link."""
        tp = self.layout.tp
        return self.hardware.allreduce(tp) * tp / (2 * (tp - 1))

    def t_nw(self, tokens: float) -> float:
        """Two all-reduces per layer of `tokens` bf16 activation rows over the TP group."""
        if self.layout.tp == 1:
            return 0.0
        return 2 * BYTES * tokens * self.model.hidden_size / self.allreduce_bandwidth()

    def layer_time(self, tokens: float, pairs: float, kv_tokens: float) -> float:
        """T_layer for one micro-batch: linear + attention + TP communication."""
        linear = max(self.t_dm_linear(), self.t_comp_linear(tokens))
        attention = max(self.t_dm_attn(kv_tokens), self.t_comp_attn(pairs))
        return linear + attention + self.t_nw(tokens)

    # ---- stages and steps -------------------------------------------------------------------
    def t_head(self, rows: float) -> float:
        """LM head on the last stage for `rows` sampled positions."""
        params = self.model.vocab_size * self.model.hidden_size
        hw, tp = self.hardware, self.layout.tp
        weights = BYTES * params / (tp * hw.hbm_bandwidth)
        return max(weights, 2 * rows * params / (tp * hw.peak_flops))

    def t_p2p(self, tokens: float) -> float:
        """Hand one micro-batch's activations to the next stage (zero without pipelining)."""
        if self.layout.pp == 1:
            return 0.0
        return BYTES * tokens * self.model.hidden_size / self.hardware.p2p_bandwidth

    def stage_time(self, tokens: float, pairs: float, kv_tokens: float, rows: float) -> float:
        """One micro-batch through the slowest (last) stage: L/pp layers + LM head + P2P."""
        layers = self.model.num_layers / self.layout.pp
        return (layers * self.layer_time(tokens, pairs, kv_tokens) + self.t_head(rows)
                + self.t_p2p(tokens))

    def step_time(self, num_seqs: int, tokens: float, pairs: float, kv_tokens: float,
                  dependent: bool) -> float:
        """Seconds for one step over `num_seqs` sequences split into m = min(num_seqs, pp)
        micro-batches. `dependent` (decode): pp stage-forwards per step; else m."""
        if num_seqs < 1:
            return 0.0
        m = min(num_seqs, self.layout.pp)
        per_mb = self.stage_time(tokens / m, pairs / m, kv_tokens / m, num_seqs / m)
        return (self.layout.pp if dependent else m) * per_mb

    def prefill_time(self, b: int, s: int) -> float:
        """Prefill of `b` prompts of `s` tokens (causal attention: s(s+1)/2 pairs each)."""
        return self.step_time(b, b * s, b * s * (s + 1) / 2, b * s, dependent=False)

    def decode_time(self, b: int, s: int) -> float:
        """One decode step of `b` sequences attending over `s` tokens of context each."""
        return self.step_time(b, b, b * s, b * (s + 1), dependent=True)

    # ---- memory -----------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        """2P: the whole model's weights (one replica)."""
        return BYTES * self.model.num_params()

    def weight_bytes_per_device(self) -> float:
        return self.weight_bytes / (self.layout.tp * self.layout.pp)

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV one replica holds: (u·M·tp·pp − 2P) / kv bytes per token (>= 0)."""
        devices = self.layout.tp * self.layout.pp
        free = self.memory_utilization * self.hardware.memory_bytes * devices - self.weight_bytes
        return max(0, math.floor(free / self.kv_bytes_per_token))

    def b_max(self, s: int) -> int:
        """Sequences of `s` tokens whose KV fits at once (the paper's b_max)."""
        return self.kv_capacity_tokens() // s

    def fits(self, min_kv_tokens: int = 1) -> bool:
        """Weights fit and at least `min_kv_tokens` of KV fit beside them."""
        return self.kv_capacity_tokens() >= min_kv_tokens

    # ---- transfers --------------------------------------------------------------------------
    def reshard_seconds(self, target: Layout) -> float:
        """Switch to `target`: each device loads its new weight shard from the host copy."""
        if target == self.layout:
            return 0.0
        devices = target.num_devices
        return self.weight_bytes * target.dp / (devices * self.hardware.host_link_bandwidth)

    def swap_seconds(self, tokens: float) -> float:
        """Move `tokens` of KV between device and host, all host links in parallel."""
        links = self.layout.num_devices * self.hardware.host_link_bandwidth
        return self.swap_bytes(tokens) / links

    def swap_bytes(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token
