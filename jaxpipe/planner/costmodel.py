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

where B_ar(n) = busbw(n) · n / (2(n − 1)), the payload bandwidth of a ring all-reduce over n
devices from the mesh preset's all-reduce bus bandwidth, falls as n grows, and T_nw(1) = 0.
A stage holds L/pp layers; the last one also runs the LM head, and each stage hands its
activations on over P2P.
Pipelining splits a step of b sequences into m = min(b, pp) micro-batches of b/m: decode steps
depend on the previous token, so a step costs pp forwards of a stage (`pp · T_stage(b/m)`);
prefill micro-batches are independent, so the pipeline stays full and a step costs
`m · T_stage(b/m)`. KV capacity per replica is the paper's b_max · s:
(u · M · tp · pp − 2P) / (4 · L · h_kv · d) tokens, with u the usable memory fraction.
Re-sharding loads each device's new weight shard from the host copy (2P / (N · B_host)); KV
swaps move 4 · L · h_kv · d bytes per token over all N host links in parallel.

Mixture of experts (X experts of width F, top-k per token, ep expert shards). W above is then
the layer's dense part: attention, the router (E·X), the shared expert (3·E·F_s) and its gate
(E) where the model has one. The experts add, per MoE layer and micro-batch of T tokens,

    T_experts = max(T_dm_experts, T_comp_experts) + T_ep

    T_dm_experts   = 2 · D(T) · 3EF / (tp · ep · B_hbm)   weights of the experts touched
    T_comp_experts = 2 · T · k · 3EF / (tp · ep · F)     k experts per token
    D(T)           = X · (1 − (1 − k/X)^T)               expected distinct experts touched
    T_ep           = 2 · T · e / B_ar(ep)                one all-reduce of the experts' output

D(T) treats each token's k experts as a uniform draw without replacement (an expert misses
one token with probability 1 − k/X, independently over tokens): with X=128, k=8 a decode
batch of 32 tokens already touches 112 of the 128 experts, so decode reads most experts'
weights at a moderate batch, while its FLOPs are only k/X of theirs. Routing is assumed
balanced: each of the ep groups holds X/ep experts, reads D(T)/ep of them and computes T·k/ep
(token, expert) pairs. Inside a group each expert's F columns split over tp, as the dense
MLP's do, and their partial sums join the existing MLP all-reduce (T_nw).

T_ep prices the exchange the engine runs under ep (`sharding.py`, `decoder._moe_mlp`,
`pipeline.expert_shard`): every non-expert weight, the KV and the activations are
replicated over ep, so every ep device holds all T tokens of the micro-batch, runs
attention, the router and the shared expert on all of them, and runs its own X/ep experts
on the tokens routed to them; one `psum` over the ep group then sums the [T, E] partial
outputs of the routed experts, once per MoE layer (before the tp all-reduce of the MLP,
which T_nw already prices). No token is sent to another device (no all-to-all). So attention is
computed ep times over (its terms divide by tp only), each ep group stores every sequence's
KV (KV capacity divides by ep), and T_ep is a ring all-reduce of the [T, E] rows over ep
devices at the mesh's all-reduce bus bandwidth for degree ep, priced as T_nw's are, at 2
bytes a value. (The engine's tp and ep psums both sum f32 partial outputs, 4 bytes a value:
both terms are half of what it moves today, alike, so tp and ep still compare evenly.)
T_ep(1) = 0. Dense models have ep = 1 and
none of these terms. A mixed model's `dense_layers` (Qwen2/3-MoE's mlp_only_layers) have
none of them either: their W is attention + 3·E·F_dense (the engine runs only a layer's
own path), and a stage takes 1/pp of all L layers' time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import Hardware
from jaxpipe.config.model import ModelConfig

BYTES = 2  # bf16 weights, activations and KV
MEMORY_UTILIZATION = 0.9  # usable fraction of device memory (vLLM's gpu_memory_utilization)


@dataclass(frozen=True)
class CostModel:
    """Step times (seconds), memory and transfer costs of `model` on `layout` over `hardware`."""

    model: ModelConfig
    hardware: Hardware
    layout: Layout
    memory_utilization: float = MEMORY_UTILIZATION

    def __post_init__(self):
        ep, x = self.layout.ep, self.model.num_experts
        if ep > 1 and (not self.model.is_moe or x % ep):
            raise ValueError(f"layout {self.layout}: ep={ep} must divide the model's experts "
                             f"({x}; a dense model takes ep=1 only)")

    # ---- model dimensions ------------------------------------------------------------------
    @property
    def attention_params(self) -> int:
        """q, k, v and o of one layer."""
        m = self.model
        return 2 * m.hidden_size * (m.num_heads + m.num_kv_heads) * m.head_dim

    @property
    def layer_params(self) -> int:
        """W: parameters of one layer's dense linear maps (q, k, v, o, and gate, up, down of
        the MLP, or of an MoE layer's shared expert, plus its router and shared gate)."""
        m = self.model
        dense = self.attention_params + 3 * m.hidden_size * m.intermediate_size
        if m.is_moe:  # the router [E, X] and the shared expert's gate [E] if any
            dense += m.hidden_size * m.num_experts + (m.hidden_size if m.intermediate_size else 0)
        return dense

    @property
    def dense_layer_params(self) -> int:
        """W of one of a mixed dense/MoE model's `dense_layers`: attention and its dense MLP
        (no router, no experts; the engine runs only the layer's own path)."""
        m = self.model
        return self.attention_params + 3 * m.hidden_size * m.dense_intermediate_size

    @property
    def moe_layers(self) -> int:
        """Layers that run experts (0 for a dense model)."""
        m = self.model
        return m.num_layers - len(m.dense_layers) if m.is_moe else 0

    @property
    def expert_params(self) -> int:
        """3EF: parameters of one expert of one layer (gate, up, down); 0 for a dense model."""
        return 3 * self.model.hidden_size * self.model.moe_intermediate_size

    @property
    def non_expert_params(self) -> int:
        """Parameters outside the experts (embedding, attention, norms, router, head)."""
        m = self.model
        return m.num_params() - m.num_layers * m.num_experts * self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token's forward pass uses: the non-expert ones plus k experts per
        MoE layer (the 'A3B' of Qwen3-30B-A3B; all of them for a dense model)."""
        m = self.model
        return self.non_expert_params + self.moe_layers * m.num_experts_per_tok * self.expert_params

    @property
    def kv_heads_stored(self) -> int:
        """KV heads held across a TP group: replicated up to tp when tp > h_kv."""
        return max(self.model.num_kv_heads, self.layout.tp)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies in one ep group, all layers (every ep group
        holds its own copy)."""
        m = self.model
        return 2 * BYTES * m.num_layers * self.kv_heads_stored * m.head_dim

    # ---- per-layer terms (one device, one micro-batch) --------------------------------------
    def t_dm_linear(self, params: int | None = None) -> float:
        """Read one layer's W (`params`; None: `layer_params`)."""
        w = self.layer_params if params is None else params
        return BYTES * w / (self.layout.tp * self.hardware.hbm_bandwidth)

    def t_comp_linear(self, tokens: float, params: int | None = None) -> float:
        """2 · tokens · W FLOPs (`params`: W; None: `layer_params`)."""
        w = self.layer_params if params is None else params
        return 2 * tokens * w / (self.layout.tp * self.hardware.peak_flops)

    def t_dm_attn(self, kv_tokens: float) -> float:
        """K and V rows moved (read for decode, written by prefill) for `kv_tokens` tokens."""
        per_token = 2 * BYTES * self.kv_heads_stored * self.model.head_dim
        return kv_tokens * per_token / (self.layout.tp * self.hardware.hbm_bandwidth)

    def t_comp_attn(self, pairs: float) -> float:
        """`pairs` = sum over queries of the keys each attends to."""
        m = self.model
        flops = 4 * pairs * m.num_heads * m.head_dim
        return flops / (self.layout.tp * self.hardware.peak_flops)

    def allreduce_bandwidth(self, degree: int) -> float:
        """B_ar(n): bytes of payload all-reduced per second over a ring of `degree` devices.
        The mesh lists NCCL-style *bus* bandwidth; a ring all-reduce moves 2(n-1)/n of the
        payload over each link."""
        return self.hardware.allreduce(degree) * degree / (2 * (degree - 1))

    def t_allreduce(self, tokens: float, degree: int) -> float:
        """One ring all-reduce of `tokens` bf16 activation rows [tokens, E] over `degree`
        devices (zero on one device)."""
        if degree == 1:
            return 0.0
        return BYTES * tokens * self.model.hidden_size / self.allreduce_bandwidth(degree)

    def t_nw(self, tokens: float) -> float:
        """Two all-reduces per layer of `tokens` activation rows over the TP group (after
        attention's `wo` and the MLP's `w_down`)."""
        return 2 * self.t_allreduce(tokens, self.layout.tp)

    def t_ep(self, tokens: float) -> float:
        """T_ep: the engine's one all-reduce per MoE layer of the routed experts' partial
        outputs [tokens, E] over the ep group (every ep device holds every token; zero
        without ep)."""
        return self.t_allreduce(tokens, self.layout.ep)

    def expected_experts(self, tokens: float) -> float:
        """D(T): experts at least one of `tokens` tokens routes to, in expectation."""
        return expected_distinct_experts(tokens, self.model.num_experts,
                                         self.model.num_experts_per_tok)

    def t_dm_experts(self, tokens: float) -> float:
        """Read the weights of the experts the micro-batch touches (this device's share)."""
        shards = self.layout.tp * self.layout.ep
        weights = BYTES * self.expected_experts(tokens) * self.expert_params
        return weights / (shards * self.hardware.hbm_bandwidth)

    def t_comp_experts(self, tokens: float) -> float:
        """k experts' FLOPs per token, spread evenly over tp x ep devices."""
        shards = self.layout.tp * self.layout.ep
        flops = 2 * tokens * self.model.num_experts_per_tok * self.expert_params
        return flops / (shards * self.hardware.peak_flops)

    def t_experts(self, tokens: float) -> float:
        """T_experts: one MoE layer's experts and their ep all-reduce for one micro-batch of
        `tokens` (0 for a dense model)."""
        compute = max(self.t_dm_experts(tokens), self.t_comp_experts(tokens))
        return compute + self.t_ep(tokens)

    def layer_time(self, tokens: float, pairs: float, kv_tokens: float,
                   dense: bool = False) -> float:
        """T_layer for one micro-batch: linear + attention + TP communication, without the
        experts (`t_experts`, which `layers_time` adds per MoE layer). `dense`: one of a
        mixed model's `dense_layers` (W of its dense MLP, no router)."""
        params = self.dense_layer_params if dense else self.layer_params
        linear = max(self.t_dm_linear(params), self.t_comp_linear(tokens, params))
        attention = max(self.t_dm_attn(kv_tokens), self.t_comp_attn(pairs))
        return linear + attention + self.t_nw(tokens)

    def layers_time(self, tokens: float, pairs: float, kv_tokens: float) -> float:
        """Every layer of the model for one micro-batch: each layer's T_layer (a mixed
        model's dense layers at their own W), plus T_experts in each of the `moe_layers`."""
        dense = len(self.model.dense_layers)
        return ((self.model.num_layers - dense) * self.layer_time(tokens, pairs, kv_tokens)
                + dense * self.layer_time(tokens, pairs, kv_tokens, dense=True)
                + self.moe_layers * self.t_experts(tokens))

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
        """One micro-batch through the slowest (last) stage: 1/pp of the layers' time (a mixed
        model's dense layers taken as spread evenly over the stages) + LM head + P2P."""
        layers = self.layers_time(tokens, pairs, kv_tokens) / self.layout.pp
        return layers + self.t_head(rows) + self.t_p2p(tokens)

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
        """2P: the whole model's weights (one copy)."""
        return BYTES * self.model.num_params()

    @property
    def stored_weight_bytes(self) -> int:
        """Weight bytes one replica's devices hold together: 2P, plus ep − 1 more copies of
        the non-expert weights (replicated over the ep groups)."""
        extra = (self.layout.ep - 1) * BYTES * self.non_expert_params
        return self.weight_bytes + extra if extra else self.weight_bytes

    def weight_bytes_per_device(self) -> float:
        return self.stored_weight_bytes / (self.layout.tp * self.layout.pp * self.layout.ep)

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV one replica holds: (u·M·tp·pp·ep − stored weights) / (kv bytes per
        token · ep) (>= 0): every ep group stores every token's KV."""
        devices = self.layout.tp * self.layout.pp * self.layout.ep
        free = (self.memory_utilization * self.hardware.memory_bytes * devices
                - self.stored_weight_bytes)
        return max(0, math.floor(free / (self.kv_bytes_per_token * self.layout.ep)))

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
        stored = CostModel(self.model, self.hardware, target).stored_weight_bytes
        return stored * target.dp / (devices * self.hardware.host_link_bandwidth)

    def swap_seconds(self, tokens: float) -> float:
        """Move `tokens` of KV between device and host, all host links in parallel (each ep
        group moves its own copy over its own links)."""
        links = self.layout.num_devices * self.hardware.host_link_bandwidth
        return self.swap_bytes(tokens) * self.layout.ep / links

    def swap_bytes(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token


def expected_distinct_experts(tokens: float, num_experts: int, k: int) -> float:
    """X · (1 − (1 − k/X)^T): the expected number of the `num_experts` (X) experts that at
    least one of `tokens` (T) tokens routes to, each token's `k` experts a uniform draw
    without replacement, tokens independent."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1 - (1 - k / num_experts) ** tokens)
