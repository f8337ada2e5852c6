"""Final exports and checkpoint loading: FULL is a Transformers directory, SHARDED is one file per rank."""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from common.config import DataConfig
from common.data.batches import LocalBatches, load_tokenizer, prepare_local_data
from launch import (
    REPO,
    TINY,
    anonymous_rise,
    anonymous_rises,
    assert_same_weights,
    each_rank,
    event,
    host_memory_env,
    pretrain,
    run,
    run_command,
    save_hf_llama,
    save_release,
)

INDEX = "model.safetensors.index.json"


def fixed_batch_loss_of(model, config_overrides: dict) -> float:
    """Rebuild the script's fixed batch (the first rows of the cached data) and score `model` on it."""
    data_cfg = DataConfig(seq_len=64, embedded_max_bytes=1_000_000, **config_overrides)
    tokenizer = (
        load_tokenizer(data_cfg) if os.path.exists(prepare_local_data(data_cfg, is_main=False)) else None
    )
    batch = LocalBatches(
        prepare_local_data(data_cfg, is_main=False), tokenizer.pad_token_id, 0, 8, 2, 0, 1
    ).fixed_batch(2)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).item()


@pytest.mark.compat
def test_full_export_loads_in_transformers_with_identical_outputs(tmp_path):
    # Split at checkpoint.max_shard_size, as save_pretrained splits: files and their index.
    records = pretrain(
        tmp_path, "train.steps=4", "fsdp.state_dict_type=FULL_STATE_DICT", "checkpoint.max_shard_size=1MB"
    )
    export = tmp_path / "export"
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert (
        info["missing_keys"] == set()
        and info["unexpected_keys"] == set()
        and info["mismatched_keys"] == set()
    )
    shards = sorted(name for name in os.listdir(export) if name.endswith(".safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", shards
    assert sorted(set(os.listdir(export)) - set(shards)) == [
        "config.json",
        "generation_config.json",
        "manifest.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.decode(tokenizer("def f(x): return x")["input_ids"]) == "def f(x): return x"
    # The trained FSDP model's loss on the fixed batch equals the reloaded model's: the logits match.
    assert fixed_batch_loss_of(model.eval(), {}) == pytest.approx(
        event(records, "final")["fixed_batch_loss"], abs=1e-6
    )
    assert not os.path.exists(f"{export}.tmp")
    assert (tmp_path / "run_config.json").exists()
    # The step-4 checkpoint converted without training, its files shared out over 2 processes, is the export.
    step4 = tmp_path / "checkpoints" / "step-4"
    run("convert_to_hf.py", [str(step4), str(tmp_path / "hf"), "--max-shard-size=1MB"], nproc=2)
    assert_same_weights(tmp_path / "hf", export)
    # Every rank writes its part of the next export; rank 1 killed in the middle leaves this one as it was.
    before = {name: (export / name).read_bytes() for name in os.listdir(export)}
    crashed = run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", "train.steps=6",
         "fsdp.state_dict_type=FULL_STATE_DICT", "checkpoint.max_shard_size=1MB"],
        nproc=2,
        check=False,
        extra_env={"FSDP2_RECIPES_FAULT": "export@6:1"},
        wrapper="with_faults.py",
    )  # fmt: skip
    assert crashed.returncode != 0 and len(glob.glob(f"{tmp_path}/export.tmp/model-*.safetensors")) > 1
    assert {name: (export / name).read_bytes() for name in os.listdir(export)} == before


def test_the_export_is_on_disk_before_its_rename_and_the_rename_after_it(tmp_path):
    """Each rank syncs the file regions it wrote; rank 0 then syncs every file and folder of export.tmp
    before the rename, and the run directory (the rename) after it (tests/with_fsync_log.py)."""
    log = tmp_path / "fsync"
    overrides = ["train.steps=1", "fsdp.state_dict_type=FULL_STATE_DICT", "checkpoint.max_shard_size=1MB"]
    pretrain(tmp_path / "run", *overrides, extra_env={"FSYNC_LOG": str(log)}, wrapper="with_fsync_log.py")
    synced = [(tmp_path / f"fsync.rank{rank}").read_text().splitlines() for rank in range(2)]
    tmp, export = f"{tmp_path}/run/export.tmp", tmp_path / "run" / "export"
    weights = {f"{tmp}/{name}" for name in os.listdir(export) if name.endswith(".safetensors")}
    for rank in range(2):  # each rank its own regions of (here) every file
        assert weights <= set(synced[rank]), synced[rank]
    everything = {f"{tmp}/{name}" for name in os.listdir(export)} | {tmp}
    last = {path: i for i, path in enumerate(synced[0])}  # where each was last synced
    assert everything <= last.keys() and last[f"{tmp_path}/run"] > max(last[path] for path in everything)


def test_a_filesystem_that_keeps_only_the_last_writers_copy_stops_the_export_in_one_line(tmp_path):
    """gcsfuse's semantics (tests/with_last_writer.py): rank 1's copy of the file wins and rank 0's regions
    come back as zeros. Each rank reads back what it wrote before the manifest, so every rank stops with the
    same line, exit 1, and the previous export is the one in place, byte for byte."""
    args = ["--config", TINY, "fsdp.state_dict_type=FULL_STATE_DICT", f"checkpoint.dir={tmp_path / 'run'}"]
    pretrain(tmp_path / "run", "train.steps=1", "fsdp.state_dict_type=FULL_STATE_DICT")
    before = {p.name: p.read_bytes() for p in (tmp_path / "run" / "export").iterdir()}
    results = each_rank("pretrain_fsdp.py", [*args, "train.steps=2"], wrapper="with_last_writer.py")
    for code, stderr in results:
        lines = [line for line in stderr.splitlines() if line.startswith("export: ")]
        assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
        assert "model.safetensors first) do not hold the bytes their ranks wrote" in lines[0], lines[0]
        assert "does not keep concurrent writes to one file" in lines[0]
    assert {p.name: p.read_bytes() for p in (tmp_path / "run" / "export").iterdir()} == before


def test_one_writer_per_file_exports_whole_through_a_filesystem_that_keeps_only_the_last_writers_copy(
    tmp_path,
):
    """checkpoint.export_writers=one on the same double: each of the 3 files is written by one rank from its
    gathered tensors (rank 0 two, rank 1 one), so no region is lost. The export is bit for bit the one every
    rank writes into on a POSIX filesystem, index included."""
    split = ["train.steps=1", "fsdp.state_dict_type=FULL_STATE_DICT", "checkpoint.max_shard_size=1MB"]
    pretrain(tmp_path / "all", *split)
    pretrain(tmp_path / "one", *split, "checkpoint.export_writers=one", wrapper="with_last_writer.py")
    ours, theirs = tmp_path / "one" / "export", tmp_path / "all" / "export"
    assert assert_same_weights(ours, theirs) == 3
    for file in glob.glob("*.safetensors", root_dir=theirs):
        assert (ours / file).read_bytes() == (theirs / file).read_bytes(), file


def test_a_rank_killed_inside_its_writes_is_one_line_and_the_next_run_exports(tmp_path):
    """Rank 1 dies (SIGKILL) inside the export's writes with one region written (tests/with_faults.py,
    write@2:1). Rank 0 writes its own, then its next collective fails at once (gloo sees the socket close):
    one line, exit 1, no traceback, before the process group's timeout. The previous export is untouched;
    the next run resumes from the last checkpoint and exports, nothing left over."""
    run_dir, first = tmp_path / "run", "model-00001-of-00003.safetensors"
    split = ["fsdp.state_dict_type=FULL_STATE_DICT", "checkpoint.max_shard_size=1MB"]
    pretrain(run_dir, "train.steps=1", *split)
    before = {p.name: p.read_bytes() for p in (run_dir / "export").iterdir()}
    args = ["--config", TINY, f"checkpoint.dir={run_dir}", "train.steps=2", "parallelism.timeout_minutes=2"]
    (survived, stderr), (killed, _) = each_rank(
        "pretrain_fsdp.py",
        [*args, *split],
        timeout=240,
        extra_env={"FSDP2_RECIPES_FAULT": "write@2:1"},
        wrapper="with_faults.py",
    )
    assert killed == -signal.SIGKILL and survived == 1 and "Traceback" not in stderr, stderr[-3000:]
    [line] = [line for line in stderr.splitlines() if "another rank died" in line]
    assert line.startswith("rank 0: another rank died in the middle of a collective") and "untouched" in line
    assert {p.name: p.read_bytes() for p in (run_dir / "export").iterdir()} == before
    assert len(glob.glob("*.safetensors", root_dir=run_dir / "export.tmp")) == 3  # under way
    records = pretrain(run_dir, "train.steps=2", *split)
    ready = [r for r in records if r.get("event") == "model_ready"][-1]  # metrics.jsonl holds all three runs
    assert ready["start_step"] == 2 and not (run_dir / "export.tmp").exists()
    after = {p.name: p.read_bytes() for p in (run_dir / "export").iterdir()}
    assert after.keys() == before.keys() and after[first] != before[first]


def test_an_export_or_conversion_that_does_not_fit_is_one_line_before_any_byte_is_written(small_disk):
    """A 9 MB disk holds the run's checkpoint (7.6 MB) but not its export beside it (2.4 MB): the files would
    be created sparse and fill the disk halfway through the writes, so their size is checked first. Every
    rank stops with one line naming the path, the bytes needed and the bytes free, exit 1, nothing written;
    converting the checkpoint onto the same disk says the same."""
    subprocess.run(["mount", "-o", "remount,size=9m", str(small_disk)], check=True)
    run_dir = small_disk / "run"
    args = ["--config", TINY, f"checkpoint.dir={run_dir}", "train.steps=1"]
    for code, stderr in each_rank("pretrain_fsdp.py", [*args, "fsdp.state_dict_type=FULL_STATE_DICT"]):
        lines = [line for line in stderr.splitlines() if line.startswith("export: ")]
        assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
        assert (
            lines[0].startswith(f"export: {run_dir}/export.tmp needs ")
            and "bytes but its filesystem has" in lines[0]
        )
    assert not [name for name in os.listdir(run_dir) if name.startswith("export")]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step-1"]
    converted = small_disk / "converted"
    proc = run(
        "convert_to_hf.py", [str(run_dir / "checkpoints" / "step-1"), str(converted)], nproc=0, check=False
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"export: {converted}.tmp needs " in proc.stderr and not os.path.exists(f"{converted}.tmp")


def test_a_run_killed_anywhere_in_moving_its_export_into_place_never_stops_the_next_one(tmp_path):
    """move_into_place renames the export aside, renames the new one into place, then removes the old one.
    Killed inside each (a removal with one file gone), the next run of the same command puts right what
    was left, in one line each, before any work, and exports: the same bytes, no leftovers."""
    args = ["--config", TINY, "train.steps=2", "fsdp.state_dict_type=FULL_STATE_DICT"]
    pretrain(tmp_path / "first", *args[2:], nproc=0)
    exported = {name: (tmp_path / "first" / "export" / name).read_bytes() for name in ["model.safetensors"]}
    left = {1: ["export", "export.tmp"], 2: ["export.old", "export.tmp"], 3: ["export", "export.old"]}
    said = {1: ["removed export.tmp"], 2: ["put back from export.old", "removed export.tmp"]}
    said[3] = ["removed export.old"]
    for point, names in left.items():
        run_dir = tmp_path / f"killed-{point}"
        shutil.copytree(tmp_path / "first", run_dir)
        fault = {"FSDP2_RECIPES_FAULT": f"rename@{point}"}
        killed = run(
            "pretrain_fsdp.py",
            [*args, f"checkpoint.dir={run_dir}"],
            nproc=0,
            check=False,
            extra_env=fault,
            wrapper="with_faults.py",
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        assert sorted(n for n in os.listdir(run_dir) if n.startswith("export")) == names
        rerun = run("pretrain_fsdp.py", [*args, f"checkpoint.dir={run_dir}"], nproc=0)
        lines = [line for line in rerun.stdout.splitlines() if line.startswith(f"{run_dir}/export: ")]
        assert [line.split(": ")[1].split(",")[0] for line in lines] == said[point], rerun.stdout[-2000:]
        assert sorted(n for n in os.listdir(run_dir) if n.startswith("export")) == ["export"]
        assert {name: (run_dir / "export" / name).read_bytes() for name in exported} == exported


@pytest.mark.compat
def test_sharded_export_is_one_file_per_rank_and_reloads_exactly_on_another_world_size(tmp_path):
    trained = pretrain(tmp_path / "a", "train.steps=4", "fsdp.state_dict_type=SHARDED_STATE_DICT")
    export = tmp_path / "a" / "export"
    assert sorted(os.path.basename(p) for p in glob.glob(str(export / "*.distcp"))) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    # Reload it on 4 ranks with no training (steps=0) and convert it to a FULL export on the way.
    reloaded = pretrain(
        tmp_path / "b", "train.steps=0", f"model.name_or_path={export}", "model.config={}", nproc=4
    )
    assert event(reloaded, "final")["fixed_batch_loss"] == pytest.approx(
        event(trained, "final")["fixed_batch_loss"], abs=1e-6
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "export")
    assert fixed_batch_loss_of(model.eval(), {}) == pytest.approx(
        event(trained, "final")["fixed_batch_loss"], abs=1e-6
    )
    # Converted by one process, without training: the same files.
    run("convert_to_hf.py", [str(export), str(tmp_path / "c")], nproc=0)
    assert_same_weights(tmp_path / "c", tmp_path / "b" / "export")
    refused = run("convert_to_hf.py", [str(tmp_path / "c"), str(tmp_path / "d")], nproc=0, check=False)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"config error: src is '{tmp_path / 'c'}', which has no .metadata; give a checkpoints/step-N or a "
        "SHARDED export"
    ]


@pytest.fixture(scope="module")
def big_hf_checkpoint(tmp_path_factory):
    """About 100M parameters (400 MB fp32): large enough that a full copy shows up in a rank's peak RSS."""
    return save_hf_llama(tmp_path_factory.mktemp("hf_llama"), hidden_size=1024, intermediate_size=4096)


def test_each_rank_reads_and_writes_its_share_of_an_hf_checkpoint(tmp_path, big_hf_checkpoint):
    """Loading raises no rank's anonymous memory by more than its share of the fp32 weights (its shards'
    pages, first touched here) plus the largest tensor plus 16 MiB, with fsdp.cpu_ram_efficient_loading on or
    off; from_pretrained on a rank holds a whole fp32 copy. The weights are from_pretrained's. The FULL export
    in fp32 writes the shards as they are: it raises no rank's by more than the largest tensor plus 16 MiB,
    and its files are byte for byte the ones save_pretrained writes on rank 0 from the gathered model (which
    holds the whole model: the contrast). With checkpoint.export_writers=one, a rank holds one gathered file
    of 100 MB more, and writes the same bytes."""
    share_mib, largest_mib = 100e6 * 4 / 2 / 2**20, 4096 * 1024 * 4 / 2**20
    losses = set()
    for efficient in ("true", "false"):
        out = tmp_path / f"mem-{efficient}"
        writers = "all" if efficient == "false" else "one"
        loaded = pretrain(
            tmp_path / efficient,
            "train.steps=0",
            "fsdp.state_dict_type=FULL_STATE_DICT",
            "checkpoint.max_shard_size=100MB",
            f"checkpoint.export_writers={writers}",
            f"model.name_or_path={big_hf_checkpoint}",
            "model.config={}",
            f"fsdp.cpu_ram_efficient_loading={efficient}",
            extra_env=host_memory_env(
                out, rank0_copy=tmp_path / "export-on-rank0" if writers == "all" else None
            ),
            wrapper="with_host_memory.py",
        )
        for rise in anonymous_rises(out, "load"):
            assert share_mib * 0.9 < rise <= share_mib + largest_mib + 16, (efficient, rise)
        losses.add(event(loaded, "final")["fixed_batch_loss"])
    [loss] = losses
    hf = LlamaForCausalLM.from_pretrained(big_hf_checkpoint).eval()
    # The run tokenized with the checkpoint's own tokenizer (data.tokenizer unset)
    assert fixed_batch_loss_of(hf, {"tokenizer": str(big_hf_checkpoint)}) == pytest.approx(loss, abs=1e-5)
    for rise in anonymous_rises(out, "export"):
        assert rise <= largest_mib + 16, rise  # fp32 as trained, written as it is; the checksums' buffer
    # one writer a file: the file it writes, and a tensor being gathered (all-gathered, then unpadded)
    for rise in anonymous_rises(tmp_path / "mem-true", "export"):
        assert 100e6 / 2**20 < rise <= 100e6 / 2**20 + 2 * largest_mib + 16, rise
    assert anonymous_rise(f"{out}.export_on_rank0.rank0.json") > 2 * share_mib
    theirs = tmp_path / "export-on-rank0"
    for ours in (tmp_path / "false" / "export", tmp_path / "true" / "export"):
        assert assert_same_weights(ours, theirs) == 5
        for file in glob.glob("*.safetensors", root_dir=ours):  # each rank's shards in place: save_file's
            assert (ours / file).read_bytes() == (theirs / file).read_bytes(), file


def test_every_rank_writes_its_part_of_the_merged_lora_export(tmp_path, big_hf_checkpoint):
    """lora.merge_on_export: each rank folds the adapters into its own shards and writes its part, bit for bit
    the merge rank 0 makes of the gathered model (which holds the whole of it: the contrast), with no rank's
    memory rising by more than its share (the merged shards), one whole weight (B A), the checksums' read
    buffer (16 MiB) and 16 MiB."""
    share_mib, largest_mib = 100e6 * 4 / 2 / 2**20, 4096 * 1024 * 4 / 2**20
    out = tmp_path / "mem"
    pretrain(
        tmp_path / "lora",
        "train.steps=1",
        f"model.name_or_path={big_hf_checkpoint}",
        "model.config={}",
        "lora.r=8",
        "lora.alpha=16",
        "lora.merge_on_export=true",
        "checkpoint.max_shard_size=100MB",
        extra_env=host_memory_env(out, rank0_copy=tmp_path / "merged-on-rank0"),
        wrapper="with_host_memory.py",
    )
    assert assert_same_weights(tmp_path / "lora" / "export", tmp_path / "merged-on-rank0") == 5
    for rise in anonymous_rises(out, "export"):
        assert rise <= share_mib + largest_mib + 2 * 16, rise
    assert anonymous_rise(f"{out}.export_on_rank0.rank0.json") > 2 * share_mib
    base = LlamaForCausalLM.from_pretrained(big_hf_checkpoint).state_dict()
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "lora" / "export").state_dict()
    assert merged.keys() == base.keys()
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )


# Run a script with its peak resident memory over its memory at its first dcp.load printed last (MiB): the
# kernel's high-water mark, reset there through /proc/self/clear_refs.
PEAK_OVER_FIRST_LOAD = """
import json, runpy, sys
import torch.distributed.checkpoint as dcp

def vm():
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) // 1024 for line in f if line.startswith("Vm")}

first, load = [], dcp.load

def first_load(*args, **kwargs):
    if not first:
        open("/proc/self/clear_refs", "w").write("5")
        first.append(vm()["VmRSS"])
    return load(*args, **kwargs)

dcp.load, script, sys.argv = first_load, sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
print(json.dumps({"rise_mib": vm()["VmHWM"] - first[0]}))
"""


def test_one_process_converts_one_output_file_at_a_time(tmp_path, big_hf_checkpoint):
    """A 400 MB fp32 checkpoint into files of at most 20 MB: the converter's memory rises by at most three
    output files' worth (the tensors read, DCP's read buffers, safetensors' bytes), not by the model; the
    files hold the checkpoint's tensors. A LoRA checkpoint is refused in one line."""
    src = tmp_path / "sharded"
    model = LlamaForCausalLM.from_pretrained(big_hf_checkpoint)
    dcp.save({"model": model.state_dict()}, checkpoint_id=src, no_dist=True)  # a SHARDED export's layout
    model.config.save_pretrained(src)
    script = os.path.join(REPO, "scripts", "convert_to_hf.py")
    cmd = [sys.executable, "-c", PEAK_OVER_FIRST_LOAD, script, str(src), str(tmp_path / "hf")]
    # glibc's default would keep the freed 16 MB buffers in its heap, as in the other memory tests
    done = run_command([*cmd, "--max-shard-size=20MB"], extra_env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    rise = json.loads(done.stdout.splitlines()[-1])["rise_mib"]
    largest_file_mib = (
        max(os.path.getsize(f) for f in glob.glob(str(tmp_path / "hf" / "*.safetensors"))) / 2**20
    )
    print(f"converter: {rise} MiB over its start; largest output file {largest_file_mib:.1f} MiB")
    assert rise <= 3 * largest_file_mib + 16 < 400e6 / 2**20 / 2, (rise, largest_file_mib)
    assert len(glob.glob(str(tmp_path / "hf" / "*.safetensors"))) > 10
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(converted.state_dict()[k], v) for k, v in model.state_dict().items())

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    state = AutoModelForCausalLM.from_config(config).state_dict()
    state["model.layers.0.self_attn.q_proj.lora_A.default.weight"] = torch.zeros(4, 16)
    dcp.save({"model": state}, checkpoint_id=tmp_path / "lora", no_dist=True)
    config.save_pretrained(tmp_path / "lora")
    refused = run(
        "convert_to_hf.py", [str(tmp_path / "lora"), str(tmp_path / "lora-hf")], nproc=0, check=False
    )
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "LoRA adapters?" in lines[0], refused.stderr
    assert not os.path.exists(tmp_path / "lora-hf.tmp") and not os.path.exists(tmp_path / "lora-hf")


def test_a_checkpoint_loaded_through_from_pretrained_is_read_by_rank0_alone_with_cpu_ram_efficient_loading(
    tmp_path,
):
    """A checkpoint read whole through from_pretrained (the path of a conversion Transformers makes as it
    loads other than stacking experts; taken here with WEIGHTS_IO=rank0): with
    fsdp.cpu_ram_efficient_loading by rank 0 alone (the others receive their shards), else by every rank.
    The MoE recipe, 2 ranks, a 34M-parameter Qwen3-MoE."""
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=4096, hidden_size=512, intermediate_size=512, moe_intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, head_dim=64, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    save_release(AutoModelForCausalLM.from_config(config), tmp_path / "qwen3_moe")
    model_mib = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters()) * 4 / 2**20
    rises = {}
    for efficient in ("true", "false"):
        out = tmp_path / f"load-{efficient}"
        run(
            "finetune_moe_ep_fsdp.py",
            ["--config", os.path.join(REPO, "configs", "debug_moe.json"), "train.steps=0", "eval.interval=0",
             "checkpoint.export=false", f"checkpoint.dir={tmp_path / efficient}",
             f"model.name_or_path={tmp_path / 'qwen3_moe'}", "model.config={}",
             f"fsdp.cpu_ram_efficient_loading={efficient}"],
            nproc=2,
            extra_env={**host_memory_env(out), "WEIGHTS_IO": "rank0"},
            wrapper="with_host_memory.py",
        )  # fmt: skip
        for rank in (0, 1):  # the kernel's high-water mark: the whole model lives only for a moment
            with open(f"{out}.load.rank{rank}.json") as f:
                memory = json.load(f)
            rises[efficient, rank] = memory["peak"]["Rss"] - memory["before"]["Rss"]
    assert rises["false", 1] > model_mib and rises["false", 0] > model_mib, rises
    assert rises["true", 0] > model_mib > rises["true", 1] + model_mib / 4, rises


def test_the_full_export_is_ready_for_generation(tmp_path):
    pretrain(tmp_path / "scratch", "train.steps=2", "checkpoint.export_dtype=bfloat16", nproc=0)
    export = tmp_path / "scratch" / "export"
    with safe_open(export / "model.safetensors", framework="pt") as f:  # cast from the fp32 master weights
        assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}
    tokenizer = AutoTokenizer.from_pretrained(export)
    config = json.loads((export / "config.json").read_text())
    generation = json.loads((export / "generation_config.json").read_text())
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the embedded tokenizer's, not Llama's 1/2
        assert config[name] == generation[name] == getattr(tokenizer, name), name
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|endoftext|>", "<|pad|>")
    assert config["use_cache"] is True and generation["use_cache"] is True
    modes = {path.name: path.stat().st_mode & 0o777 for path in export.iterdir()}
    assert len(set(modes.values())) == 1 and all(mode & 0o044 == 0o044 for mode in modes.values()), modes
    # EOS made certain: with the final norm zeroed every logit is 0 and greedy decoding picks token 0, the
    # tokenizer's EOS. generate() stops right there only if the export names that EOS.
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    assert model.dtype == torch.bfloat16 and tokenizer.eos_token_id == 0
    with torch.no_grad():
        model.model.norm.weight.zero_()
    prompt = tokenizer("def main(", return_tensors="pt").input_ids
    generated = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert generated[0, prompt.shape[1] :].tolist() == [tokenizer.eos_token_id]


def test_a_model_loaded_from_name_or_path_keeps_its_own_special_ids(tmp_path):
    pretrain(tmp_path / "scratch", "train.steps=1", nproc=0)
    source = tmp_path / "scratch" / "export"
    config = json.loads((source / "config.json").read_text())
    config.update(bos_token_id=5, eos_token_id=6, pad_token_id=7)
    (source / "config.json").write_text(json.dumps(config))
    pretrain(tmp_path / "loaded", "train.steps=0", f"model.name_or_path={source}", "model.config={}", nproc=0)
    exported = json.loads((tmp_path / "loaded" / "export" / "config.json").read_text())
    assert [exported[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [5, 6, 7]
    assert exported["use_cache"] is True


def test_a_disk_that_fills_in_the_middle_of_the_export_is_one_line_on_every_rank(small_disk):
    """The free-space check passes, then another writer fills the disk but 64 KiB (tests/with_faults.py,
    full@2:0): the first rank whose write fails has DCP carry its error to every rank, and each prints one
    line naming export.tmp, the bytes the export needs and the bytes free, exit 1, no traceback. The
    previous export is untouched. Converting the step-2 checkpoint onto the disk filled the same way says
    the same (safetensors' save_file raises its own error, not an OSError)."""
    subprocess.run(["mount", "-o", "remount,size=40m", str(small_disk)], check=True)
    run_dir, full = small_disk / "run", "fsdp.state_dict_type=FULL_STATE_DICT"
    pretrain(run_dir, "train.steps=1", full)
    before = {p.name: p.read_bytes() for p in (run_dir / "export").iterdir()}
    results = each_rank(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={run_dir}", "train.steps=2", full],
        extra_env={"FSDP2_RECIPES_FAULT": "full@2:0"},
        wrapper="with_faults.py",
    )
    for code, stderr in results:
        lines = [line for line in stderr.splitlines() if line.startswith("export: ")]
        assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
        assert lines[0].startswith(
            f"export: the disk filled while {run_dir}/export.tmp was written: it needs "
        )
        assert re.search(r"needs [\d,]{9} bytes and [\d,]+ are free now", lines[0]), lines[0]
    assert {p.name: p.read_bytes() for p in (run_dir / "export").iterdir()} == before
    (small_disk / "another-job").unlink()
    (small_disk / "converted").mkdir()
    converted = run(
        "convert_to_hf.py",
        [str(run_dir / "checkpoints" / "step-2"), str(small_disk / "converted" / "export")],
        nproc=0,
        check=False,
        extra_env={"FSDP2_RECIPES_FAULT": "full@0"},
        wrapper="with_faults.py",
    )
    assert converted.returncode == 1 and "Traceback" not in converted.stderr, converted.stderr[-3000:]
    [line] = [line for line in converted.stderr.splitlines() if line.startswith("export: ")]
    assert line.startswith(f"export: the disk filled while {small_disk}/converted/export.tmp was written: ")
