"""FSDP1 configs (Accelerate YAML, the `accelerate launch` environment, a Transformers fsdp_config) translated
to FSDP2, as Accelerate's `accelerate to-fsdp2` does, except that hybrid sharding becomes HSDP: replicas
across nodes, shards within a node. One line, on rank 0, lists every translation, what differs from what
Accelerate would run, and every dropped key."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config import ConfigError

# sharding_strategy -> reshard_after_forward (to-fsdp2's mapping); Accelerate also writes them as 1..5.
RESHARD = dict(
    FULL_SHARD=True, SHARD_GRAD_OP=False, NO_SHARD=False, HYBRID_SHARD=True, HYBRID_SHARD_ZERO2=False
)
NUMBERED = dict(enumerate(RESHARD, start=1))
# Keys with no FSDP2 meaning, dropped with the reason.
DROPPED = {
    "backward_prefetch": "FSDP2 always prefetches the next all-gather in backward",
    "forward_prefetch": "FSDP2 prefetches by module order",
    "limit_all_gathers": "FSDP2 needs no rate limiter",
    "use_orig_params": "FSDP2 always keeps the original parameters",
    "sync_module_states": "module states agree by construction (seeded init, or rank 0's broadcast)",
}
# What a translation runs differently from Accelerate, said in the one line.
APPROXIMATED = {
    "NO_SHARD": "NO_SHARD -> parameters stay sharded (FSDP1 replicates them on every rank, as DDP does)",
    # Accelerate's MixedPrecisionPolicy for "bf16" reduces in bf16 too; bf16 sums lose precision.
    "bf16": "mixed_precision=bf16 -> gradients reduced in float32 (Accelerate reduces them in bf16; "
    'fsdp.mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"} does that)',
}
FSDP1_KEYS = {"sharding_strategy", "ignored_modules", *DROPPED}
# What an FSDP1 `accelerate launch` (FSDP_VERSION 1 or unset) exports beside the FSDP2 keys; translated.
FSDP1_LAUNCH_KEYS = (
    "sharding_strategy backward_prefetch forward_prefetch use_orig_params sync_module_states".split()
)


def fsdp1_launch_values(values: dict) -> dict:
    """The FSDP_* values of an FSDP1 launch. Accelerate exports FSDP_RESHARD_AFTER_FORWARD=true and
    FSDP_SHARDING_STRATEGY=FULL_SHARD for every FSDP1 config: only a strategy name in the first (what
    `accelerate config` writes now) was chosen, and then it is the strategy; the boolean is dropped."""
    out = {k: v for k, v in values.items() if k != "reshard_after_forward"}
    if str(values.get("reshard_after_forward")).upper() in RESHARD:
        out["sharding_strategy"] = values["reshard_after_forward"]
    return out


@dataclass
class Translation:
    """What the FSDP1 keys of every source became: for the one line, and HSDP's sizes."""

    environ: dict = field(default_factory=dict)  # the launcher's: WORLD_SIZE, LOCAL_WORLD_SIZE
    translated: list[str] = field(default_factory=list)
    approximated: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    parallelism: dict = field(default_factory=dict)

    def line(self) -> str | None:
        parts = []
        if self.translated:
            parts.append(f"FSDP1 keys translated: {', '.join(self.translated)}")
        if self.approximated:
            parts.append(f"not as Accelerate runs it: {'; '.join(dict.fromkeys(self.approximated))}")
        if self.dropped:
            parts.append(f"dropped (no FSDP2 meaning): {', '.join(sorted(set(self.dropped)))}")
        return f"config: {'; '.join(parts)}" if parts else None

    def accelerate_mixed_precision(self, value):
        """Accelerate's top-level mixed_precision, which means the same here except where noted."""
        if str(value).lower() == "bf16":
            self.approximated.append(APPROXIMATED["bf16"])
        return value

    def add(self, raw_key: str, key: str, value, source: str) -> dict:
        """The FSDP2 keys (`fsdp` section) for FSDP1 `key`; HSDP's sizes go to self.parallelism."""
        if key in DROPPED:
            self.dropped.append(key)
            return {}
        if key == "ignored_modules":
            # Accelerate passes them to fully_shard as ignored_params: unsharded, and their gradients never
            # reduced, so each rank would train its own copy, which the seeded init, gradient clipping over
            # DTensors and DCP checkpoints here do not handle.
            if value:
                raise ConfigError(
                    f"'{raw_key}' in {source} is {value!r}, which FSDP2 would leave unsharded with gradients "
                    f"no rank reduces, and this recipe cannot train; remove it (to keep modules out of "
                    f"training, freeze them: lora, or requires_grad=False in your copy)"
                )
            self.dropped.append(key)
            return {}
        name = NUMBERED.get(value, value) if isinstance(value, int) else str(value).upper()
        if name not in RESHARD:
            raise ConfigError(
                f"'{raw_key}' in {source} is {value!r}; use one of {', '.join(RESHARD)} (or 1-5), or FSDP2's "
                f"reshard_after_forward"
            )
        after = RESHARD[name]
        note = f"{raw_key}={name} -> reshard_after_forward={str(after).lower()}"
        if name in APPROXIMATED:
            self.approximated.append(APPROXIMATED[name])
        if name.startswith("HYBRID"):  # replicas across nodes, shards within one: the launcher's sizes
            world = int(self.environ.get("WORLD_SIZE", 1))
            local = int(self.environ.get("LOCAL_WORLD_SIZE", world))
            self.parallelism = {"dp_replicate_size": world // local, "dp_shard_size": local}
            note += f", parallelism.dp_replicate_size={world // local} (nodes) x dp_shard_size={local}"
        self.translated.append(note)
        return {"reshard_after_forward": after}
