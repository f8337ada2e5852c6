"""Image-text fine-tuning: pretrain_fsdp.py against the Transformers Trainer + Accelerate FSDP2 with TRL's
collator, side by side on 2 gloo ranks on CPU, on the same release and records.

    python benchmarks/vlm_vs_trainer.py [--repeats 3] [--steps 20] [--micro-batch 8] [--tiny]

The release is a Gemma 3 made here (`--tiny`: configs/debug_vlm.json's sizes; else a language model of hidden
256 x 4 layers and a SigLIP tower of hidden 128 x 4 layers, 32x32 images as 4 image tokens) with the embedded
processor (common/data/image_records.py), saved as a checkpoint both sides load. The records are the built-in
shapes task's. Both sides: the vision tower and projector frozen (our defaults), the decoder layers and vision
blocks as FSDP2 units, fp32, AdamW at the same lr, one micro-batch of `--micro-batch` records per rank per
step, rows padded to the longest of the micro-batch. The Trainer gets TRL's collator
(DataCollatorForVisionLanguageModeling; by default it trains on every token, ours on the answers only, which
costs the same) and benchmarks/trainer_baseline.py's patch to run FSDP2 on CPU, checked. Step time is the
median over the steps after the first 3; peak RSS is per rank during training, the larger rank, with glibc
returning large blocks. Runs alternate ours / Trainer, `--repeats` times each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.launch import REPO, run_command, run_recipe

CONFIG = os.path.join(REPO, "configs", "debug_vlm.json")
WARMUP_STEPS = 3
ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # peak RSS then tracks live memory (benchmarks/vs_trainer.py)


def save_release(path: str, tiny: bool) -> None:
    """debug_vlm.json's Gemma 3 (wider unless `tiny`), random, with the embedded processor."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from common.config import DataConfig
    from common.data.embedded import ensure_embedded_tokenizer
    from common.data.image_records import embedded_processor

    with open(CONFIG) as f:
        values = json.load(f)["model"]["config"]
    if not tiny:
        values["text_config"].update(hidden_size=256, intermediate_size=768, num_hidden_layers=4, head_dim=64)
        values["vision_config"].update(hidden_size=128, intermediate_size=512, num_hidden_layers=4)
    config = AutoConfig.for_model(**values)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(path)
    data = DataConfig(embedded_max_bytes=1_000_000)
    ensure_embedded_tokenizer(data, True)
    embedded_processor(data).save_pretrained(path)


def ours(release: str, steps: int, micro: int) -> dict:
    overrides = [
        f"model.name_or_path={release}",
        "model.config={}",
        "model.freeze_vision_tower=true",
        "model.freeze_multi_modal_projector=true",
        "eval.interval=0",
        f"train.steps={steps}",
        f"train.global_batch_size={2 * micro}",
        f"train.micro_batch_size={micro}",
    ]
    records = run_recipe(2, overrides, extra_env=ENV, config=CONFIG)
    timed = [r for r in records if "step" in r and "event" not in r and r["step"] > WARMUP_STEPS]
    final = next(r for r in records if r.get("event") == "final")
    return {
        "step_time_s": statistics.median(r["tokens"] / r["tokens_per_s"] for r in timed),
        "peak_rss_gib": max(final["peak_mem_gib_per_rank"]),
    }


def trainer(release: str, steps: int, micro: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        script = os.path.abspath(__file__)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script]
        cmd += ["--trainer-run", release, out, f"--steps={steps}", f"--micro-batch={micro}"]
        run_command(cmd, timeout=3600, extra_env=ENV)
        with open(out) as f:
            return json.load(f)


def trainer_run(release: str, out: str, steps: int, micro: int) -> None:
    """Under torchrun: the Trainer with TRL's collator on the same release and records."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, Trainer
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from benchmarks.trainer_baseline import CPU, GIB, Probe, cpu_fsdp2_arguments
    from common import image_text
    from common.config import FsdpConfig
    from common.data.image_records import shape_records
    from common.mesh import gather_objects
    from common.ops.metrics import peak_memory_bytes
    from common.wrap import resolve_layer_classes

    model = AutoModelForImageTextToText.from_pretrained(release, dtype=torch.float32)
    layers = sorted(resolve_layer_classes(model, FsdpConfig()))  # the units the recipe wraps
    args = cpu_fsdp2_arguments(
        "vlm_trainer_baseline",
        layers,
        max_steps=steps,
        per_device_train_batch_size=micro,
        learning_rate=3e-3,
        remove_unused_columns=False,  # the collator takes the records' messages and images
    )
    tower, projector = image_text.vision_parameters(model)
    for name in tower + projector:  # frozen, as the recipe's defaults
        model.get_parameter(name).requires_grad_(False)
    processor = AutoProcessor.from_pretrained(release)
    probe = Probe(2)
    records = shape_records("train")
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=records,
        data_collator=DataCollatorForVisionLanguageModeling(processor),
        callbacks=[probe],
    )
    trainer.train()
    times = [t1 - t0 for t0, t1 in zip(probe.times, probe.times[1:])][WARMUP_STEPS - 1 :]
    peaks = gather_objects(round(peak_memory_bytes(CPU) / GIB, 4))
    if args.process_index == 0:
        with open(out, "w") as f:
            json.dump({"step_time_s": statistics.median(times), "peak_rss_gib": max(peaks), **probe.fsdp}, f)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=8, help="records per rank per step")
    parser.add_argument(
        "--tiny", action="store_true", help="debug_vlm's sizes, 1 repeat: checks that it runs"
    )
    parser.add_argument("--trainer-run", nargs=2, metavar=("RELEASE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer_run:
        trainer_run(*args.trainer_run, args.steps, args.micro_batch)
        return
    if args.tiny:
        args.repeats, args.steps = 1, WARMUP_STEPS + 3
    with tempfile.TemporaryDirectory() as release:
        save_release(release, args.tiny)
        runs = {"ours": [], "Trainer + TRL": []}
        for _ in range(args.repeats):  # alternate, so drift on a noisy machine hits both alike
            runs["ours"].append(ours(release, args.steps, args.micro_batch))
            runs["Trainer + TRL"].append(trainer(release, args.steps, args.micro_batch))
    median = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("step_time_s", "peak_rss_gib")}
        for name, rs in runs.items()
    }
    base = median["Trainer + TRL"]
    size = "tiny" if args.tiny else "small"
    print(f"Gemma 3 ({size}), {args.micro_batch} records per rank per step, 2 ranks\n")
    print(
        "| recipe | step time s (median) | peak RSS GiB / rank | step time vs Trainer | memory vs Trainer |"
    )
    print("|---|---|---|---|---|")
    for name, m in median.items():
        print(
            f"| {name} | {m['step_time_s']:.3f} | {m['peak_rss_gib']:.3f} | "
            f"{m['step_time_s'] / base['step_time_s']:.2f}x | "
            f"{m['peak_rss_gib'] / base['peak_rss_gib']:.2f}x |"
        )


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    from common.ops.cli import end_process

    if dist.is_initialized():  # the Trainer's gloo groups: leave as benchmarks/trainer_baseline.py does
        dist.destroy_process_group()
    end_process(0)
