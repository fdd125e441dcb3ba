"""The experiment config's schema: a dataclass per section, a ``Literal`` per choice among names.

:mod:`jaxscale.config.read` reads YAML into these types and checks every key and value against them
(the command line's choices are read from the same types). No jax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

MESH_AXES = ("data", "stage", "fsdp", "context", "ulysses", "expert", "tensor")

DType = Literal["float32", "bfloat16", "float16"]
# auto: jaxscale/analysis/remat.py; offload_dots: jaxscale/layout/offload.py
Remat = Literal["none", "selective", "full", "save_dots", "offload_dots", "save_named", "auto"]
# resolved at build (models/attention.py): auto -> the kernel the devices run
Attention = Literal["dot", "blockwise", "ring", "cudnn", "auto"]
MoEDispatch = Literal["capacity", "dropless"]
MoERouter = Literal["softmax", "sigmoid"]
# shard_map: explicit all-to-all; partitioner: einsum dispatch, rules only
MoEImpl = Literal["shard_map", "partitioner"]
# routing bias outside the gradient (jaxscale/models/balance.py): off, DeepSeek-V3's sign step, quantile solve
MoEBalance = Literal["off", "sign", "quantile"]
# dropless under expert parallelism: move the routed rows (jaxscale/parallel/exchange.py), or all-gather
MoEExchange = Literal["rows", "all_gather"]
DataSource = Literal["builtin", "stdlib", "tokens"]
NonFinite = Literal["stop", "skip"]
Resume = Literal["off", "auto", "required"]
Schedule = Literal["gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1"]  # jaxscale/parallel/schedules.py
INTERLEAVED: tuple[Schedule, ...] = ("circular", "interleaved_1f1b")  # the schedules that take pipeline.repeats > 1
SPLIT: tuple[Schedule, ...] = ("zb_h1",)  # the schedules that split the backward into input and weight gradients
DEFAULT_SCHEDULE: Schedule = "1f1b"
FsdpGather = Literal["step", "visit", "tick"]  # when a pipeline stage gathers its FSDP-split blocks (pipeline.py)
XlaPreset = Literal["none", "gpu", "tpu"]
Fp8Mode = Literal["off", "delayed", "current", "blockwise", "mxfp8", "nvfp4"]
CopyDType = Literal["auto", "float32", "bfloat16", "float16"]
ReduceDType = Literal["float32", "bfloat16"]
RopeType = Literal["llama3"]
Packing = Literal["concat", "first_fit"]  # jaxscale/data/packing.py
Optimizer = Literal["adamw", "muon"]  # jaxscale/training/optim.py, jaxscale/training/muon.py
MuonScale = Literal["rms", "shape"]  # rms: rms * sqrt(max(fan_in, fan_out)) (Moonlight); shape: sqrt(max(1, out/in))


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key or axis."""


@dataclasses.dataclass
class MoEConfig:
    """Mixture-of-experts feed-forward (``jaxscale/models/moe.py``); ``model.moe: null`` is a dense model."""

    experts: int = 8
    top_k: int = 2
    mlp: int | None = None  # hidden size of each expert; None: model.mlp
    every_n_layers: int = 1  # layer i is MoE when (i + 1) % every_n_layers == 0
    shared_experts: int = 0  # always-on experts: one dense SwiGLU of shared_experts x mlp
    capacity_factor: float = 1.25
    dispatch: MoEDispatch = "capacity"
    router: MoERouter = "softmax"
    normalize_gates: bool = True  # the top-k gates of a token sum to 1
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    impl: MoEImpl = "shard_map"
    dropless_exchange: MoEExchange = "rows"
    groups: int = 1  # group-limited routing (DeepSeek-V3): experts in this many groups, ...
    top_groups: int = 1  # ... a token's choices among the experts of its top_groups best groups
    balance: MoEBalance = "off"  # a per-expert bias on the scores for top-k selection, updated each step
    bias_rate: float = 0.001  # balance: sign: the bias step towards equal load
    bias_ema: float = 0.0  # balance: quantile: the weight of the previous bias against the new solution


@dataclasses.dataclass
class DeepSeekConfig:
    """The DeepSeek-V3-style decoder (``jaxscale/models/deepseek.py``): multi-head latent attention, ``dense_layers``
    dense blocks before the MoE ones (``model.moe``), multi-token prediction. ``model.heads`` are MLA's heads;
    ``model.kv_heads`` and ``model.head_dim`` are not read by it."""

    q_lora_rank: int | None = 1536  # the queries' latent width; None: a full-rank query projection
    kv_lora_rank: int = 512  # the keys' and values' shared latent width
    qk_nope_head_dim: int = 128  # each head's query/key width without rotation
    qk_rope_head_dim: int = 64  # the rotated width, its key part shared by every head
    v_head_dim: int = 128
    dense_layers: int = 3  # the first layers with a dense SwiGLU of model.mlp (first_k_dense_replace)
    routed_scale: float = 2.5  # the routed experts' output scaled by this (routed_scaling_factor)
    mtp_depth: int = 1  # multi-token prediction modules (0: none)
    mtp_loss_weight: float = 0.3  # lambda: the weight of the MTP losses' mean over the depths


@dataclasses.dataclass
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (:func:`jaxscale.models.llama.llama3_scaled`), as Hugging Face's
    ``rope_scaling``."""

    rope_type: RopeType = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass
class ModelConfig:
    """A Llama-style decoder."""

    vocab_size: int = 256
    embed: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    mlp: int = 384
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on each head's query and key, before RoPE (Qwen3)
    init_std: float = 0.02
    dtype: DType = "float32"
    param_dtype: DType = "float32"
    remat: Remat = "none"
    remat_names: list[str] = dataclasses.field(default_factory=list)
    remat_offload: list[str] = dataclasses.field(default_factory=list)  # save_named: moved to host (offload.py)
    moe: MoEConfig | None = None
    deepseek: DeepSeekConfig | None = None  # None: Llama-style; set: DeepSeek-V3-style (MLA, MTP)
    attention: Attention = "dot"
    attention_block: int = 512
    loss_chunk: int = 0  # > 0: chunked cross-entropy, logits blocks of this many tokens' size (jaxscale/ops/loss.py)
    tp_overlap: bool = False  # collective matmul for sequence parallelism (jaxscale/parallel/collective_matmul.py)
    fused_projections: bool = False  # one w_qkv and one w_gate_up GEMM per layer (jaxscale/models/fusion.py)


@dataclasses.dataclass
class AxisSizes:
    """A size per mesh axis (:data:`MESH_AXES`)."""

    data: int = 1
    stage: int = 1
    fsdp: int = 1
    context: int = 1
    ulysses: int = 1  # USP's all-to-all part of context parallelism (rules usp)
    expert: int = 1
    tensor: int = 1

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}


@dataclasses.dataclass
class DcnConfig(AxisSizes):
    """Mesh sizes across slices or hosts (the slow network); 1 = within one slice."""


@dataclasses.dataclass
class MeshConfig(AxisSizes):
    """Parallelism sizes per mesh axis; one may be -1 (the rest of the devices)."""

    data: int = -1
    dcn: DcnConfig | None = None
    # auto: XLA propagates shardings from the rules' constraints; explicit: shardings are part of every array's
    # type (jax's AxisType.Explicit), a user model's out_sharding= and reshard work (jaxscale/layout/mesh.py)
    axis_types: Literal["auto", "explicit"] = "auto"


@dataclasses.dataclass
class MuonConfig:
    """Muon (``train.optimizer: muon``, :mod:`jaxscale.training.muon`): Nesterov momentum orthogonalised by the quintic
    Newton-Schulz iteration on each hidden matrix, AdamW (``train.b1``, ``b2``, ``eps``) on the rest."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: ReduceDType = "bfloat16"  # the iteration's matmuls, and the moves to and from the owner devices
    scale: MuonScale = "rms"
    rms: float = 0.2  # scale: rms, the update's RMS (AdamW's, so that train.learning_rate carries over)
    learning_rate: float | None = None  # the hidden matrices' peak rate (None: train.learning_rate)
    weight_decay: float | None = None  # decoupled, times the rate (None: train.weight_decay)
    adamw_axes: list[str] = dataclasses.field(default_factory=lambda: ["vocab"])  # a matrix with one: AdamW


@dataclasses.dataclass
class TrainConfig:
    """Optimisation and loop settings."""

    steps: int = 200
    schedule_steps: int | None = None  # length of warmup + cosine (None: steps); kept in the checkpoint
    seed: int = 0
    global_batch: int = 16
    seq_len: int = 128
    microbatches: int = 1
    log_every: int = 10
    tensorboard: bool = False  # also log to <run_dir>/tensorboard (needs tensorboardX)
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    optimizer: Optimizer = "adamw"
    muon: MuonConfig = dataclasses.field(default_factory=MuonConfig)  # train.optimizer: muon
    # QK-clip (Kimi K2's MuonClip, with either optimizer): after each update, a head whose largest pre-softmax
    # logit of the step exceeds this tau has its query and key weights scaled down to it (training/qk_clip.py)
    qk_clip: float | None = None
    peak_flops: float | None = None
    eval_every: int = 0
    eval_steps: int = 4
    nonfinite: NonFinite = "stop"
    max_consecutive_skips: int = 10  # nonfinite=skip: the run stops after this many skipped updates in a row


@dataclasses.dataclass
class MixturePart:
    """One source of a weighted mixture (``data.mixture``): a token directory or raw source, its weight, a name
    for its metrics (default: the path's file name)."""

    path: str
    weight: float = 1.0
    name: str | None = None


@dataclasses.dataclass
class DataConfig:
    """Where tokens come from: ``builtin`` (the bytes of the corpus shipped with jaxscale), ``stdlib``
    (the bytes of this Python's standard library sources) or ``tokens`` (a directory written by
    ``jaxscale prepare-data``, or a raw source it prepares once, named by ``path``)."""

    source: DataSource = "builtin"
    path: str | None = None  # a prepare-data directory, or a raw source prepared once into the cache (tokencache.py)
    cache_dir: str | None = None  # where raw sources are prepared (None: $XDG_CACHE_HOME/jaxscale/tokens)
    tokenizer: str = "byte"  # a raw data.path: 'byte' or a tokenizer.json
    text_field: str = "text"
    prompt_field: str | None = None  # with response_field: prompt/response records, trained on the response
    response_field: str | None = None
    mixture: list[MixturePart] | None = None  # several sources by weight, in place of path (jaxscale/data/batches.py)
    documents: bool = False  # positions restart at each document, attention masked across them (model.attention dot)
    packing: Packing = "concat"  # first_fit (with documents): whole documents in padded sequences
    boundary_targets: bool = False  # with documents: train a document's first token, predicted from the one before
    ring_balance: bool = False  # with documents and a ring: documents arranged per row to even the ring's tiles
    max_bytes: int = 8_000_000
    eval_bytes: int = 60_000


@dataclasses.dataclass
class CheckpointConfig:
    """orbax checkpoints of the train state, loader state and config; ``every: 0`` saves none."""

    every: int = 0
    keep: int = 3
    keep_every: int = 0
    dir: str | None = None
    resume: Resume = "off"  # off | auto (the latest checkpoint if any) | required (--resume: fail without one)
    async_save: bool = True
    continuous: bool = False  # a save starts as soon as the last one committed (jaxscale/checkpoint/continuous.py)
    continuous_interval_s: float = 0.0  # and no sooner than this after the last one started
    fast_dir: str | None = None  # with continuous: the continuous saves' tier (a fast directory all processes see)
    init_from: str | None = None  # params of a new run (fresh optimizer, step 0): a converted or a run checkpoint


@dataclasses.dataclass
class DistributedConfig:
    """Bounded waits of the multi-process runtime (``jax.distributed``)."""

    init_timeout_s: int = 300
    heartbeat_timeout_s: int = 100
    elastic: bool = False  # fewer devices than the mesh: shrink the data axis (jaxscale/runtime/elastic.py)
    rejoin_every: int = 0  # shrunk: save and exit (status 75) after this many steps, for the launcher to re-expand


@dataclasses.dataclass
class PipelineConfig:
    """Pipeline parallelism, used when the rules put ``layers`` on the ``stage`` mesh axis (size > 1).

    ``schedule``: gpipe, 1f1b or zb_h1 (v = 1; zb_h1 splits the backward into its input and weight
    gradients, :mod:`jaxscale.parallel.schedules`), circular or interleaved_1f1b (``repeats`` = v ≥ 2
    chunks per stage); every schedule keeps each in-flight microbatch's stage input and recomputes the
    stage in its backward (:mod:`jaxscale.parallel.pipeline`). ``layers_per_stage``: the layers
    of each virtual stage 0..p·v−1 (e.g. the first and last one lighter: they also hold the embedding
    and the head), summing to ``model.layers``; None splits them evenly
    (:mod:`jaxscale.config.stage_layers`: the stack then holds p·v·max slots). ``fsdp``: with FSDP inside a
    stage, ``step`` gathers the stage's blocks once a step and reduces their gradients once (the stage's
    blocks and their fp32 gradients held whole; idle slots skipped unless TP, SP or CP is inside too),
    ``visit`` gathers each layer when a slot runs it and reduce-scatters its gradient after its backward
    (one layer held whole, the fp32 gradients sharded; idle slots skipped as with ``step``; 2·m gathers and
    m reduce-scatters of the stage's blocks a step), ``tick`` leaves the gathers to the partitioner, every
    tick (the blocks stay sharded; idle slots computed and masked, gathered and reduced too).
    """

    microbatches: int | None = None  # None: as many as there are stages
    repeats: int = 1
    schedule: Schedule = DEFAULT_SCHEDULE
    layers_per_stage: list[int] | None = None
    fsdp: FsdpGather = "step"
    offload_stash: bool = False  # the stage's kept layer inputs in host memory (jaxscale/parallel/stage_state.py)


@dataclasses.dataclass
class XlaConfig:
    """XLA flags set before the backend starts (``jaxscale/runtime/xla_flags.py``): a preset plus flags of one's own."""

    preset: XlaPreset = "none"
    flags: list[str] = dataclasses.field(default_factory=list)
    # auto: <run_dir>/compile_cache where safe; off; or a directory (jaxscale/runtime/compile_cache.py)
    compile_cache: Literal["auto", "off"] | str = "auto"


@dataclasses.dataclass
class Nvfp4Config:
    """NVIDIA's NVFP4 pretraining recipe's parts (``precision.fp8: nvfp4``, ``jaxscale/precision/fp8/block_scaled.py``),
    each on by default as published: the 16 x 16 random Hadamard transform of the weight-gradient GEMM's inputs,
    the weights in 16 x 16 blocks (the same values forward and backward), the gradients rounded stochastically,
    and the last 15% of the layers in ``model.dtype`` (``jaxscale/precision/fp8/tail.py``)."""

    hadamard: bool = True
    weight_2d: bool = True
    stochastic_rounding: bool = True
    bf16_last: float = 0.15


@dataclasses.dataclass
class PrecisionConfig:
    """Mixed precision (``jaxscale/precision/policy.py``) and low-precision matmuls (``jaxscale/precision/fp8/``).

    ``params``: the compute copy's dtype (auto: ``model.dtype``); ``master``: the dtype the optimizer
    updates (auto: ``model.param_dtype``); ``grads_reduce``: the dtype of the weight gradients'
    cross-device sums and of the accumulator under ``train.microbatches``. ``fp8: off | delayed | current |
    blockwise | mxfp8 | nvfp4`` scaling of the block projections; ``fp8_head``: the LM head in fp8 too; ``fp8_block``:
    the tile and block size of ``blockwise`` (1 x block activation tiles, block x block weight blocks); ``nvfp4``:
    the NVFP4 recipe's parts.
    """

    params: CopyDType = "auto"
    master: CopyDType = "auto"
    grads_reduce: ReduceDType = "float32"
    fp8: Fp8Mode = "off"
    amax_history: int = 16  # steps of amaxes kept per tensor (delayed scaling takes their maximum)
    margin: int = 0  # scales leave 2^margin of headroom
    fp8_head: bool = False
    fp8_block: int = 128
    nvfp4: Nvfp4Config = dataclasses.field(default_factory=Nvfp4Config)
    offload_state: bool = False  # the master and the optimizer's state in host memory (jaxscale/layout/offload.py)
    offload_params: bool = False  # the compute copy in host memory, fetched layer by layer (jaxscale/layout/offload.py)


@dataclasses.dataclass
class Config:
    """One experiment: model, mesh, rules table, data and training."""

    run_dir: str = "runs/default"
    rules: str = "dp"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    xla: XlaConfig = dataclasses.field(default_factory=XlaConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def schedule_length(config: TrainConfig) -> int:
    """The steps the learning-rate schedule spans: ``train.schedule_steps``, by default ``train.steps``.

    Part of the run: a checkpoint keeps it, and a resume with another length is refused unless
    ``train.schedule_steps`` says so (:func:`jaxscale.checkpoint.store.check_compatible`)."""
    return config.steps if config.schedule_steps is None else config.schedule_steps
