"""Assembly in one place: an engine's parts built from its config, in order, with memory sized
once (the weights, the activation reserve, the device pool and the host tier: `sizing.size`).

    prepare(config, n)            what every process derives alike: dtype, architecture, the
                                  loaded model, tokenizer, max_model_len, the two layouts
    build(config, devices, leader) -> Parts
                                  the leader's (or a single process's) engine: the kernel
                                  choices, the sizes, the runner (mirrored to the followers),
                                  the scheduler state and policy, the KV manager, the executor
    follow(config)                a follower: the same runner from the leader's sizes, then its
                                  loop until the leader closes
    mesh_devices(mesh, cluster)   the devices of a mesh preset (joining the cluster first)
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxpipe.config.cluster import Cluster, check_same, cluster_of, shared_fields
from jaxpipe.config.engine import EngineConfig
from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import MeshPreset, load_mesh
from jaxpipe.config.model import ModelConfig
from jaxpipe.engine.executor import Executor, policy_for, scheduler_state
from jaxpipe.engine.step_builder import restore_penalties
from jaxpipe.engine.structured import Constraints
from jaxpipe.kernels.paged import storage_dtype
from jaxpipe.kv.manager import KVManager
from jaxpipe.model import gguf_quantized, loading, smoothing
from jaxpipe.model.decoder import checked_values, init_random, param_decls
from jaxpipe.model.gguf_quantized import GgufWeight
from jaxpipe.model.gguf_weights import kept_weights
from jaxpipe.model.presets import resolve_model
from jaxpipe.model.quantized import Quantization
from jaxpipe.model.tokenizer import Tokenizer
from jaxpipe.runtime import distributed, kernel_choice, sharding, sizing
from jaxpipe.runtime.buckets import Buckets
from jaxpipe.runtime.kernel_choice import KernelChoice
from jaxpipe.runtime.runner import Runner, attention_cases, attention_impl

log = logging.getLogger("jaxpipe")


@dataclass(frozen=True)
class Prepared:
    """What every process of an engine derives alike from its config."""

    dtype: jnp.dtype
    model_config: ModelConfig
    # the host weights by parameter name (quantization="gguf": those kept in the file's
    # blocks as `GgufWeight`s); a path: an orbax checkpoint, restored straight into shardings
    weights: dict | Path
    tokenizer: Tokenizer | None
    max_model_len: int
    layouts: dict[str, Layout]


@dataclass(frozen=True)
class Parts:
    """An engine's parts, as `build` made them."""

    dtype: jnp.dtype
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    layouts: dict[str, Layout]
    kernels: KernelChoice | None  # this machine's measured kernel paths (CPU), else None
    sizes: sizing.Sizes
    buckets: Buckets
    runner: Runner | distributed.MirroredRunner
    executor: Executor


def build(config: EngineConfig, devices: list, leader: distributed.Leader | None) -> Parts:
    """Every part of the engine of `config` on `devices`; with a `leader`, the followers get
    the sizes first and every device call of the runner and the KV manager is mirrored to
    them."""
    prep = prepare(config, len(devices))
    kernels = choose_kernels(config, prep.model_config, prep.dtype, devices)
    sizes = sizing.size(config, prep.model_config, prep.dtype, prep.layouts, devices,
                        sizing.weight_bytes(prep.model_config, prep.dtype, prep.layouts,
                                            devices, kernels, quantization(config, prep)),
                        prep.max_model_len)
    if leader is not None:
        leader.send("setup", {"max_num_seqs": sizes.max_num_seqs, "num_blocks": sizes.num_blocks,
                              "timings": kernels and kernels.timings,
                              "config": shared_fields(config)})
    buckets = Buckets.for_engine(sizes.max_num_seqs, prep.max_model_len,
                                 config.max_num_batched_tokens)
    runner = make_runner(config, prep, buckets, sizes.max_num_seqs, sizes.num_blocks, devices,
                         kernels)
    if leader is not None:
        runner = distributed.MirroredRunner(runner, leader)
    executor = make_executor(config, runner, buckets, sizes, prep.max_model_len,
                             mirror=leader.send if leader is not None else None,
                             tokenizer=prep.tokenizer)
    return Parts(prep.dtype, prep.model_config, prep.tokenizer, prep.max_model_len,
                 prep.layouts, kernels, sizes, buckets, runner, executor)


def make_executor(config: EngineConfig, runner, buckets: Buckets, sizes: sizing.Sizes,
                  max_model_len: int, mirror=None, tokenizer=None) -> Executor:
    """The scheduler state and policy, the KV manager (its host tier of `sizes.host_tokens`;
    `mirror`: the leader's send, every KV move then reaches the followers), the structured
    outputs' grammars (over `tokenizer`) and the executor that runs them on `runner`."""
    state = scheduler_state(config, runner, sizes.max_num_seqs, sizes.host_tokens)
    policy = policy_for(config.scheduler, config, runner, buckets, sizes.host_tokens)
    kv = KVManager(runner, sizes.host_tokens > 0, on_insert=partial(restore_penalties, runner),
                   mirror=mirror)
    constraints = Constraints(tokenizer, runner.config.vocab_size, runner.config.eos_token_ids)
    return Executor(config, runner, buckets, state, policy, kv, max_model_len, constraints)


def follow(config: EngineConfig) -> None:
    """Be a follower of a multi-process engine (process_id > 0; see runtime/distributed.py):
    join the cluster, load the same model, make the runner with the sizes the leader chose,
    then run the leader's calls until it closes."""
    cluster = cluster_of(config)
    if cluster is None or cluster.is_leader:
        raise ValueError("follow() runs a follower: give EngineConfig a coordinator, "
                         "num_processes > 1 and process_id > 0")
    devices = mesh_devices(load_mesh(config.mesh), cluster)
    channel = distributed.FollowerChannel(cluster)
    prep = prepare(config, len(devices))
    name, sizes = channel.recv()
    if name != "setup":
        channel.close()
        raise RuntimeError(f"the leader (process 0) failed to start: {sizes}")
    check_same(sizes["config"], shared_fields(config))
    buckets = Buckets.for_engine(sizes["max_num_seqs"], prep.max_model_len,
                                 config.max_num_batched_tokens)
    # The leader's measured choices, so that every process compiles the same programs.
    timings = sizes["timings"]
    kernels = None if timings is None else KernelChoice(_forced(config), timings=timings)
    runner = make_runner(config, prep, buckets, sizes["max_num_seqs"], sizes["num_blocks"],
                         devices, kernels)
    log.info("process %d follows the leader at %s", cluster.process_id, cluster.coordinator)
    distributed.Follower(runner, channel).serve()


def prepare(config: EngineConfig, num_devices: int) -> Prepared:
    """What every process derives alike from the config: dtype, architecture (from the
    model's metadata), the two layouts, the loaded weights, tokenizer and max_model_len."""
    _enable_compilation_cache(config.compilation_cache_dir)
    dtype = jnp.dtype(config.dtype)
    source = resolve_model(config.model)
    _check_gguf_source(config, source)
    model_config = loading.source_config(source)
    layouts = _resolve_layouts(config, model_config, num_devices)
    blocks = kept_weights(source.path, model_config) if config.quantization == "gguf" else {}
    _check_gguf_splits(layouts, model_config, blocks)
    return Prepared(dtype, model_config, _load(config, source, model_config, dtype, blocks),
                    loading.load_tokenizer(source), _max_model_len(config, model_config),
                    layouts)


def _check_gguf_source(config: EngineConfig, source) -> None:
    """quantization="gguf" keeps a GGUF file's blocks: it needs a GGUF file's weights."""
    if config.quantization == "gguf" and (source.kind != "gguf" or config.random_weights):
        raise ValueError(f"quantization='gguf' keeps a GGUF file's blocks: it needs a GGUF "
                         f"model (a .gguf path or a preset whose weights are one) and its "
                         f"weights; model {config.model!r} is {source.kind}"
                         + (" with random_weights" if config.random_weights else ""))


def _check_gguf_splits(layouts: dict[str, Layout], cfg: ModelConfig,
                       blocks: dict[str, GgufWeight]) -> None:
    """quantization="gguf" splits the row-split weights' blocks over tp
    (`gguf_quantized.check_splits`): a clear error where one cannot be split whole."""
    tp = math.lcm(*(layout.tp for layout in layouts.values()))
    decls = param_decls(cfg)
    for name, w in blocks.items():
        gguf_quantized.check_splits(name, decls[name].shape, decls[name].axes, w.kind, tp)


def mesh_devices(mesh: MeshPreset, cluster: Cluster | None = None) -> list:
    """The devices of a mesh preset, over every process of `cluster` (joined here); a cpu-N
    preset adds virtual CPU devices if JAX has not started yet (a clear error if it has, with
    fewer)."""
    if cluster is not None:
        distributed.initialize(cluster, mesh.num_devices // cluster.num_processes,
                               mesh.platform)
    elif mesh.platform == "cpu" and mesh.num_devices > 1:
        sharding.ensure_cpu_devices(mesh.num_devices)
    devices = jax.devices("cpu" if mesh.platform == "cpu" else None)
    if len(devices) < mesh.num_devices or (mesh.platform != "cpu"
                                           and devices[0].platform == "cpu"):
        raise RuntimeError(f"mesh {mesh.name!r} needs {mesh.num_devices} {mesh.platform} "
                           f"devices; found {len(devices)} {devices[0].platform} device(s)")
    return devices[: mesh.num_devices]


def make_runner(config: EngineConfig, prep: Prepared, buckets: Buckets, num_slots: int,
                num_blocks: int, devices: list, kernels: KernelChoice | None) -> Runner:
    """The runner over `prep.layouts` of `devices` (one device: pp=1,tp=1 for both phases),
    holding `prep.weights` (restored from orbax when it is a path)."""
    weights = _smoothed(config, prep, prep.weights)
    return Runner(prep.model_config, weights, buckets, num_slots, prep.max_model_len,
                  prep.dtype, prep.layouts, devices, num_blocks, attention=config.attention,
                  sampler=config.sampler, sampler_threads=config.sampler_threads,
                  kernels=kernels, kv_cache_dtype=config.kv_cache_dtype,
                  quant=quantization(config, prep))


def quantization(config: EngineConfig, prep: Prepared) -> Quantization | None:
    """The weights quantized at load (`EngineConfig.quantization`; "gguf": those `prep` keeps
    in the file's blocks); None: none."""
    if config.quantization == "none":
        return None
    if config.quantization == "gguf":
        kept = {n: w for n, w in prep.weights.items() if isinstance(w, GgufWeight)}
        formats = tuple((name, w.kind) for name, w in kept.items())
        head = "lm_head" if "lm_head" in param_decls(prep.model_config) else "embed"
        return Quantization("gguf", head in kept, formats)
    return Quantization(config.quantization, config.quantize_lm_head)


def _smoothed(config: EngineConfig, prep: Prepared, weights: dict | Path) -> dict | Path:
    """int8's weights smoothed before quantization (`model/smoothing.py`); as given for the
    other kinds, random weights (nothing to calibrate) and orbax checkpoints (restored
    straight into shardings: not smoothed, with a log line)."""
    if config.quantization != "int8" or config.random_weights:
        return weights
    if isinstance(weights, Path):
        log.info("int8 smoothing skipped: orbax checkpoints are restored straight into the "
                 "layout, unsmoothed")
        return weights
    return smoothing.smooth_model(prep.model_config, weights, prep.tokenizer)


def choose_kernels(config: EngineConfig, cfg: ModelConfig, dtype,
                   devices: list) -> KernelChoice | None:
    """This machine's measured kernel choices on CPU (None elsewhere), with the attention
    measured now if the config leaves it to the machine: every process of a cluster then
    gets the same timings from the leader."""
    if devices[0].platform != "cpu":
        return None
    chosen = kernel_choice.for_machine(_forced(config))
    if config.attention == "auto":
        attention_impl("auto", devices, partial(chosen.attention, attention_cases(cfg),
                                                storage_dtype(dtype, "cpu",
                                                              config.kv_cache_dtype)))
    return chosen


def _forced(config: EngineConfig) -> str | None:
    """The matmul implementation the config names, or None to measure."""
    return None if config.matmul == "auto" else config.matmul


def _enable_compilation_cache(path: str | None) -> None:
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _resolve_layouts(config: EngineConfig, cfg: ModelConfig, num_devices: int) -> dict:
    """The two layouts, with "auto" replaced by the planner's choice (cost model, sharegpt);
    one device runs both phases on pp=1,tp=1."""
    if num_devices == 1:
        return {"prefill": Layout(), "decode": Layout()}
    layouts = {"prefill": config.prefill, "decode": config.decode}
    if "auto" in layouts.values():
        # lazy: the planner loads only for "auto" layouts (`import jaxpipe` reaches no tool)
        from jaxpipe.planner import choose_layouts

        chosen = dict(zip(("prefill", "decode"),
                          choose_layouts(cfg, load_mesh(config.mesh), "sharegpt"), strict=True))
        layouts = {k: chosen[k] if v == "auto" else v for k, v in layouts.items()}
    return {k: Layout.parse(v) for k, v in layouts.items()}


def _load(config: EngineConfig, source, cfg: ModelConfig, dtype,
          blocks: dict[str, GgufWeight]) -> dict | Path:
    """The host weights of architecture `cfg` by parameter name: `blocks` (GGUF blocks) and
    the others read from the model (those in `blocks` neither read nor dequantized). An
    orbax checkpoint is not read here: its path is returned, for the runner to restore
    straight into the layout's shardings."""
    if config.random_weights:  # the metadata alone: the weights are not read
        model = init_random(cfg, config.seed, dtype)
        return {name: getattr(model, name)[...] for name in param_decls(cfg)}
    if source.kind == "orbax":
        return source.path
    start = time.perf_counter()
    loaded_cfg, values = loading.load_weights(source, frozenset(blocks), dtype)
    if loaded_cfg != cfg:
        raise ValueError(f"model {source.name!r}: its weights' architecture {loaded_cfg} is "
                         f"not its metadata's {cfg}")
    weights = checked_values(cfg, values, dtype, frozenset(blocks)) | blocks
    log.info("loaded %s in %.1f s", source.name, time.perf_counter() - start)
    return weights


def _max_model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    limit, what = cfg.context_limit
    if config.max_model_len is None:
        return min(limit, 2048)
    if config.max_model_len > limit:
        raise ValueError(f"EngineConfig.max_model_len={config.max_model_len} exceeds the model's "
                         f"{what}")
    return config.max_model_len
