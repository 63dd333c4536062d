"""Host time per micro-batch: what the CPU does around each forward (the simulator's only host
model; `CostModel` prices the devices).

For one micro-batch of `seqs` sequences, `rows` of them sampled:

    prepare(seqs) = prepare_s + prepare_per_seq_s · seqs      schedule + build + dispatch
    sample(rows)  = sample_per_row_s · rows                   penalties, softmax, top-k/p, draw

`sampler` says where sampling runs: "device" (vLLM: on the last stage's GPUs, after its
forward, so it lengthens the last stage: SiPipe's load-imbalance bubble) or "host" (SiPipe's
CPU samplers, jaxpipe's `sampler="host"`: the host samples a micro-batch after it leaves the
last stage, in line with its other work). Whether host work is on the critical path is the
executor's `in_flight` (simulate.py): with pp micro-batches in flight the host forms the next
one while the devices run the current tick; with pp - 1 it waits for the tick, and with
`stages_wait` every stage waits for its input too (jaxpipe's one tick program over all
stages without overlap; vLLM's PP, where each stage prepares its own input before its
forward). Without it only stage 0 waits: later stages prepare ahead (SiPipe's token-safe
execution model). `token_safe` (the engine's flowing pipeline with overlap, its default):
pp in flight, a micro-batch released when it leaves the last stage, the next one prepared
while the stages run: preparation is hidden and only the host sampler's time stays on the
path (stage 0 needs the sampled token).

The price of pp in flight: micro-batch k+1 is formed while k-pp+1 is still on the last stage.
When every sequence is in flight the policy has nothing to form and waits (the two depths run
alike), but when some are free (new prompts, a sequence back early) k+1 is formed from them
and the sequences spread over more, smaller micro-batches: on sharegpt (200 requests,
Qwen2.5-72B, 8x H100 pp=2 tp=4, no host time) the mean decode micro-batch falls from 21.5 to
17 rows and throughput by 21% against pp - 1 (scripts/reproduce_sipipe.py's settings).

Where the constants come from. The seconds are host (CPU) costs, not GPU ones, so one preset
is used on every mesh. No GPU was available to measure jaxpipe's own (`Engine.stats()
["host_ms_per_step"]` and the timeline's schedule/build/sample/dispatch parts on a GPU host
are the calibration to do); the presets are derived from the papers:

- SiPipe §3.1 (vLLM on 8x H100, Qwen2.5-72B, pp=4 tp=2, Fig. 3): input preparation leaves a
  gap of 12-19% at the start of every stage's iteration (Observation 2), and the last stage
  carries 22-40% more load, mainly sampling (Observation 1). At their midpoints against the
  cost model's stage time for that setting's 128-row decode micro-batch (6.37 ms: 512
  sequences over 4 stages, ShareGPT mean context), preparation is 0.155 / 0.845 x 6.37 = 1.17
  ms and device sampling 0.31 x 6.37 = 1.97 ms, i.e. 15.4 us a row. The split of preparation
  into 0.4 ms fixed plus 6 us per sequence is an assumption (the paper gives one fraction).
- SiPipe §5.1: its CPU sampler must finish within "the decoding slack, typically 1-2 ms per
  sampling strategy" for a micro-batch of up to 256 rows; 1.5 ms / 128 rows = 12 us a row
  is an assumption inside that range.
- gLLM §3.3: vLLM's input preparation is "approximately 17% of the total execution time"
  (consistent with SiPipe's 12-19%), and gLLM's runtime alone (gLLM w/ CK) is 10% faster than
  vLLM's (Fig. 15). Not a separate preset: the SiPipe-derived ones agree with it.
- TD-Pipe and gLLM's own runtimes overlap host work with the device (§3.3 of gLLM: "hiding
  CPU operations overhead"): their rows in the reproductions have `NO_HOST`, the default,
  and the vLLM baselines beside them `VLLM_PP`.
"""

from __future__ import annotations

from dataclasses import dataclass

SAMPLERS = ("device", "host")


@dataclass(frozen=True)
class HostCost:
    """Seconds of host work per micro-batch (see the module docstring for the sources)."""

    prepare_s: float = 0.0  # fixed: schedule + build + dispatch of one micro-batch
    prepare_per_seq_s: float = 0.0  # per sequence in it (block tables, positions, metadata)
    sample_per_row_s: float = 0.0  # per sampled row, on the sampler's side
    sampler: str = "device"  # "device": on the last stage; "host": by the host after it lands
    stages_wait: bool = True  # with pp - 1 in flight every stage waits for the preparation

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler {self.sampler!r}: accepted {SAMPLERS}")
        for name in ("prepare_s", "prepare_per_seq_s", "sample_per_row_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 seconds")

    def prepare(self, seqs: int) -> float:
        """Form and build one micro-batch of `seqs` sequences."""
        return self.prepare_s + self.prepare_per_seq_s * seqs if seqs else 0.0

    def sample(self, rows: int) -> float:
        """Sample `rows` rows (wherever `sampler` runs)."""
        return self.sample_per_row_s * rows

    def device_sample(self, rows: int) -> float:
        """The sampling the last stage's devices do after their forward (0 on the host)."""
        return self.sample(rows) if self.sampler == "device" else 0.0

    def host_sample(self, rows: int) -> float:
        """The sampling the host does when a micro-batch lands (0 on the devices)."""
        return self.sample(rows) if self.sampler == "host" else 0.0


NO_HOST = HostCost()  # no host time: the simulator before host time was modelled
VLLM_PP = HostCost(prepare_s=0.4e-3, prepare_per_seq_s=6e-6, sample_per_row_s=15.4e-6)
SIPIPE = HostCost(prepare_s=0.4e-3, prepare_per_seq_s=6e-6, sample_per_row_s=12e-6,
                  sampler="host", stages_wait=False)
