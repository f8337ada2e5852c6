"""The config schema, one dataclass per section (its fields are the reference for every key), and how
fsdp.mixed_precision reads. No torch import, so a bad config fails in well under a second. Reading the files
and checking each value's type is common/ops/config_sources.py; the checks that span several keys are
common/ops/config_checks.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """Bad user input. Scripts print it as one line and exit with code 2."""


@dataclass
class ModelConfig:
    name_or_path: str | None = None  # local HF directory or hub id; None: from scratch
    config: dict = field(default_factory=dict)  # inline LlamaConfig kwargs, used when name_or_path is None
    attn_implementation: str | None = None  # None: Transformers' choice for the model (sdpa, else eager)
    trust_remote_code: bool = False
    freeze_vision_tower: bool = True  # image-text releases (common/image_text.py): as in LLaMA-Factory
    freeze_multi_modal_projector: bool = True


@dataclass
class DataConfig:
    # "embedded", local files (json/jsonl/parquet/txt), or a hub dataset name. Records with prompt and
    # completion, or chat messages, and the built-in "arithmetic" task train on the answers only (SFT).
    dataset: str | list = "embedded"
    # The held-out set of every evaluation, in the same forms; "embedded": the corpus's files after the
    # training slice. None: an evaluation of a checkpoint scores the first rows of data.dataset.
    eval_dataset: str | list | None = None
    eval_split: str = "test"  # its split, for a hub dataset
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = False  # hub datasets only
    pack: bool = True  # concatenate documents with EOS; false: one padded document per sample
    document_mask: bool = False  # packed documents attend only within themselves
    tokenizer: str | None = None  # None: the embedded byte-level BPE tokenizer
    seq_len: int = 256
    embedded_max_bytes: int = 4_000_000
    embedded_vocab_size: int = 4096
    cache_dir: str = "~/.cache/fsdp2-recipes"


@dataclass
class TrainConfig:
    steps: int = 100  # 0: load (or init), evaluate and export, e.g. to convert SHARDED to FULL
    global_batch_size: int = 16  # sequences per optimizer step, whatever the world size
    micro_batch_size: int = 4  # sequences per rank per forward/backward
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    lr_schedule: Literal["cosine", "wsd"] = "cosine"
    wsd_decay_ratio: float = 0.2
    weight_decay: float = 0.1
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    seed: int = 0
    gradient_checkpointing: bool = False  # the HF model's own; prefer fsdp.activation_checkpointing
    compile: bool = False  # torch.compile each transformer layer
    # The output layer and loss this many tokens at a time: no full-vocabulary logits (common/loss.py); 0: off
    loss_chunk_tokens: int = 1024
    # Before step 1, the training and evaluation losses equal Transformers' own on rows of the data, or the
    # run stops (common/ops/loss_check.py); false: skip that check
    verify_loss_at_start: bool = True
    # Accelerate's sync_each_batch. false: reduce-scatter once per step, on the last micro-batch (fewer
    # collectives, more memory for unsharded gradients); true: after every micro-batch.
    sync_each_batch: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    stop_after: int = 0  # stop (with a checkpoint) after this many steps of this run; 0: never
    router_aux_loss_coef: float | None = None  # MoE load-balancing loss weight; None: the model's own


@dataclass
class FsdpConfig:
    version: int = 2
    reshard_after_forward: bool | int = True
    cpu_offload: bool = False
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"] = (
        "TRANSFORMER_BASED_WRAP"
    )
    transformer_layer_cls_to_wrap: list | str | None = None  # empty: the model's _no_split_modules
    min_num_params: int | None = None
    state_dict_type: Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"] = "FULL_STATE_DICT"  # FULL, SHARDED too
    cpu_ram_efficient_loading: bool = False
    activation_checkpointing: bool = False
    # Accelerate's: with activation_checkpointing, each checkpointed layer's saved inputs go to host memory
    # until backward (torch's offload_wrapper), so they leave device memory
    activation_checkpointing_offload: bool = False
    # With activation_checkpointing: "full" recomputes each layer; N checkpoints every Nth layer only; "op"
    # saves each layer's matmul and attention outputs and recomputes the rest (elementwise ops, norms)
    ac_policy: Literal["full", "op"] | int = "full"
    mixed_precision: dict | str | None = None  # None: bf16 params + fp32 reduce on CUDA, fp32 on CPU
    # Transformers' PyTorch/XLA keys, for the PyTorch/XLA recipe only.
    xla: bool = False
    xla_fsdp_settings: dict = field(default_factory=dict)
    xla_fsdp_grad_ckpt: bool = False
    xla_fsdp_v2: bool = True  # SPMD FSDPv2; Transformers defaults to FSDPv1, which is not implemented here


@dataclass
class ParallelismConfig:
    dp_replicate_size: int = 1
    dp_shard_size: int = -1  # -1: the rest of the world
    fsdp_size: int = -1  # Transformers' name (DistributedConfig), MoE recipe only; elsewhere dp_shard_size
    ep_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    sp_size: int = 1
    # How torch_cp's ring (evaluation with eval.attention=torch_cp) passes K/V shards; training always
    # all-gathers K/V (common/cp.py)
    cp_comm_strategy: Literal["allgather", "alltoall"] = "allgather"
    timeout_minutes: float = 10.0  # collective timeout: a dead rank ends the job instead of hanging it


@dataclass
class CheckpointConfig:
    dir: str = "runs/debug"  # the run directory; everything a run writes goes under it
    interval: int = 0  # resume checkpoints every N steps (0: only at the end of the run)
    keep_latest: int = 2
    resume: str = "auto"  # auto: the newest complete checkpoint in dir, if any | none | a step-N path
    export: bool = True  # write the final export to <dir>/export per fsdp.state_dict_type
    async_save: bool = False  # training waits only for a copy in host memory; DCP writes in the background
    # Before a resume, and before an export given as model.name_or_path is loaded, check each file's
    # checksum against its manifest (sizes are always checked); false: skip it for a huge checkpoint
    verify_checksums: bool = True
    # Export the weights of the step with the lowest eval_loss, not the last step's; its checkpoint is kept
    load_best_model_at_end: bool = False
    # A FULL export (or a merged LoRA one), as save_pretrained writes it: split into files of at most this
    # size (Transformers' max_shard_size), in this dtype (torchtitan's export_dtype; None: the compute dtype,
    # fsdp.mixed_precision's param_dtype, bf16 on CUDA by default)
    max_shard_size: str | int = "5GB"
    export_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    # all: every rank writes its part of each file (POSIX filesystems) | one: one rank a file (object stores)
    export_writers: Literal["all", "one"] = "all"


@dataclass
class MetricsConfig:
    log_every: int = 1
    comm_stats: bool = False  # count all-gather / reduce-scatter calls and bytes per step
    tensorboard: bool = True  # used only when the package is installed
    peak_flops: float | None = None  # FLOP/s per device for MFU; None: the datasheet table (known GPUs only)
    profile_steps: list[int] = field(default_factory=list)  # [first, last]: a profiler trace per rank
    memory_snapshot: bool = False  # CUDA: allocator history, dumped after the profiled steps and on OOM


@dataclass
class EvalConfig:
    # Evaluate data.eval_dataset before the first step, every N optimizer steps and at the last (Trainer's
    # eval_steps); 0: never during training
    interval: int = 0
    # Stop after this many evaluations in a row without an improvement of more than the threshold (the
    # Trainer's EarlyStoppingCallback); 0: never
    early_stopping_patience: int = 0
    early_stopping_threshold: float = 0.0
    max_sequences: int = 64  # sequences of data.seq_len (+ 1) tokens, from the start of the held-out set
    batch_size: int = 1  # sequences per data-parallel rank per forward
    load_balance: bool = True  # head-tail (zig-zag) sharding: every cp rank gets the same causal work
    loss_chunk_tokens: int = 1024  # lm_head + cross-entropy this many tokens at a time
    attention: Literal["auto", "allgather", "torch_cp"] = "auto"  # auto: torch_cp on CUDA, else allgather


@dataclass
class LoraConfig:
    """LoRA adapters (PEFT's), trained while the base stays frozen: PEFT's r, lora_alpha, lora_dropout and
    target_modules. r = 0: off, every weight trains."""

    r: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list | str = "all-linear"  # every linear layer of the decoder (not the output layer)
    base_dtype: Literal["auto", "bfloat16", "float32"] = (
        "auto"  # the frozen base; auto: bf16 on CUDA, fp32 on CPU
    )
    merge_on_export: bool = (
        False  # export the merged model (a plain Transformers directory), not the adapters
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation
    lora: LoraConfig = field(default_factory=LoraConfig)


DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "no": "float32", "fp16": "float16"}


def class_names(value: list | str | None) -> list[str]:
    if isinstance(value, str):  # "A,B", or a list written without JSON's quotes: [A, B]
        return [name.strip(" '\"") for name in value.strip(" []").split(",") if name.strip(" '\"")]
    return list(value or [])


def mixed_precision_dtypes(value: dict | str | None, device_type: str) -> dict:
    if value is None:
        value = "bfloat16" if device_type == "cuda" else "float32"
    if isinstance(value, str):
        value = {"param_dtype": value, "reduce_dtype": "float32"}
    if not isinstance(value, dict) or set(value) - {"param_dtype", "reduce_dtype"}:
        raise ConfigError(
            f"fsdp.mixed_precision is {value!r}; use 'bf16', 'no', or "
            f'{{"param_dtype": "bfloat16", "reduce_dtype": "float32"}}'
        )
    out = {}
    for key in ("param_dtype", "reduce_dtype"):
        name = str(value.get(key, "float32")).lower().replace("torch.", "")
        name = DTYPE_ALIASES.get(name, name)
        if name not in ("bfloat16", "float32", "float16"):
            raise ConfigError(f"fsdp.mixed_precision.{key} is {value.get(key)!r}; use bfloat16 or float32")
        if name == "float16":
            raise ConfigError(
                f"fsdp.mixed_precision.{key} is float16, which needs loss scaling that FSDP2 "
                f"does not do; use bfloat16"
            )
        out[key] = name
    return out


def resolve_mixed_precision(fsdp: FsdpConfig, device_type: str) -> dict:
    return mixed_precision_dtypes(fsdp.mixed_precision, device_type)
