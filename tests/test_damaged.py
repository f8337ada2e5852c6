"""Damaged files: a broken dataset, model, tokenizer or export is one line naming the file (and the line),
exit 2, nothing written; a damaged checkpoint is moved aside and `auto` resumes from the one before it; a
checkpoint that fails to load without being damaged stays, and the next launch retries it."""

import errno
import json
import os
import shutil

import pytest
from safetensors.torch import load_file

from common.ops import integrity
from common.ops.integrity import model_dir_damage
from common.ops.run_dir import find_resume_checkpoint
from launch import TINY, each_rank, event, losses, pretrain, read_metrics, run

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> str:
    run_dir = tmp_path_factory.mktemp("export")
    pretrain(run_dir, "train.steps=1", nproc=0)
    return str(run_dir / "export")


def refused(run_dir, *overrides: str, nproc: int = 0, config: str = TINY, **kwargs) -> list[str]:
    """The config-error lines of a run that must stop at once, each rank with exit 2 and nothing written."""
    args = ["--config", config, f"checkpoint.dir={run_dir}", *overrides]
    if nproc == 0:
        proc = run("pretrain_fsdp.py", args, nproc=0, check=False, **kwargs)
        ranks = [(proc.returncode, proc.stderr)]
    else:
        ranks = each_rank("pretrain_fsdp.py", args, nproc, **kwargs)
    lines = []
    for code, stderr in ranks:
        mine = [line for line in stderr.splitlines() if "config error:" in line]
        assert code == 2 and len(mine) == 1 and "Traceback" not in stderr, stderr[-3000:]
        lines += mine
    assert not os.path.exists(run_dir), "nothing is written"
    return lines


def write_jsonl(path, records: list, broken: dict | None = None) -> str:
    with open(path, "w") as f:
        for number, record in enumerate(records, start=1):
            f.write((broken or {}).get(number, json.dumps(record)) + "\n")
    return str(path)


TEXTS = [{"text": f"document {i} " + "words " * 40} for i in range(400)]


def test_a_broken_jsonl_line_names_the_file_and_line_on_every_rank(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", TEXTS, broken={217: '{"text": "cut off'})
    lines = refused(tmp_path / "run", f"data.dataset={data}", nproc=2)
    assert all(f"data.dataset: {data}:217: not valid JSON" in line for line in lines)


def test_records_without_their_fields_name_the_line(tmp_path):
    data = write_jsonl(tmp_path / "text.jsonl", TEXTS[:4] + [{"content": "no text key"}] + TEXTS[5:])
    (line,) = refused(tmp_path / "a", f"data.dataset={data}")
    assert f"{data}:5: the record has no 'text' text" in line
    sft = [{"prompt": "1+1=", "completion": "2"}] * 9 + [{"prompt": "2+2="}]
    data = write_jsonl(tmp_path / "sft.jsonl", sft)
    (line,) = refused(tmp_path / "b", f"data.dataset={data}")
    assert f"{data}:10: the record has neither 'prompt' and 'completion' nor 'messages'" in line


def test_a_truncated_parquet_file_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(TEXTS), path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    (line,) = refused(tmp_path / "run", f"data.dataset={path}")
    assert f"{path} is not a readable Parquet file" in line


def damaged_copy(export: str, tmp_path, name: str) -> str:
    copy = tmp_path / name
    shutil.copytree(export, copy)
    return str(copy)


def truncate(path, keep: float = 0.5) -> None:
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep))


def test_damaged_model_directories_are_one_line(tmp_path, export):
    model = ["model.config={}"]
    no_weights = damaged_copy(export, tmp_path, "no_weights")
    os.remove(os.path.join(no_weights, "model.safetensors"))
    os.remove(os.path.join(no_weights, "manifest.json"))
    (line,) = refused(tmp_path / "r1", f"model.name_or_path={no_weights}", *model)
    assert f"{no_weights} has no weights" in line
    cut = damaged_copy(export, tmp_path, "cut")  # with its manifest: the size differs from the one written
    truncate(os.path.join(cut, "model.safetensors"))
    (line,) = refused(tmp_path / "r2", f"model.name_or_path={cut}", *model)
    assert f"{cut}/model.safetensors has " in line and "(truncated or overwritten)" in line
    proc = run(  # eval_cp.py checks an export against its manifest the same way
        "eval_cp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path / 'e1'}", f"model.name_or_path={cut}", *model],
        nproc=0,
        check=False,
    )
    assert proc.returncode == 2 and proc.stderr.count("config error:") == 1, proc.stderr[-2000:]
    assert f"{cut}/model.safetensors has " in proc.stderr and not os.path.exists(tmp_path / "e1")
    flipped = damaged_copy(export, tmp_path, "flipped")  # the same size: only the checksum tells
    flip_a_byte(os.path.join(flipped, "model.safetensors"))
    (line,) = refused(tmp_path / "r6", f"model.name_or_path={flipped}", *model)
    assert f"{flipped}/model.safetensors does not match its checksum (corrupted)" in line
    assert model_dir_damage(flipped, checksums=False) is None  # checkpoint.verify_checksums=false
    os.remove(os.path.join(cut, "manifest.json"))  # a plain HF directory: the safetensors header tells
    (line,) = refused(tmp_path / "r3", f"model.name_or_path={cut}", *model)
    assert f"{cut}/model.safetensors has " in line and "(truncated)" in line
    sharded = damaged_copy(export, tmp_path, "index")
    os.remove(os.path.join(sharded, "manifest.json"))
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    os.rename(
        os.path.join(sharded, "model.safetensors"), os.path.join(sharded, "model-00001-of-00002.safetensors")
    )
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    (line,) = refused(tmp_path / "r4", f"model.name_or_path={sharded}", *model)
    assert "names " in line and "model-00002-of-00002.safetensors, which is missing" in line
    bad_config = damaged_copy(export, tmp_path, "bad_config")
    with open(os.path.join(bad_config, "config.json"), "w") as f:
        f.write('{"model_type": ')
    (line,) = refused(tmp_path / "r5", f"model.name_or_path={bad_config}", *model)
    assert f"{bad_config}/config.json is not valid JSON" in line


def test_a_damaged_tokenizer_is_one_line(tmp_path, export):
    tokenizer = damaged_copy(export, tmp_path, "tokenizer")
    truncate(os.path.join(tokenizer, "tokenizer.json"))
    (line,) = refused(tmp_path / "r1", f"data.tokenizer={tokenizer}")
    assert f"{tokenizer}/tokenizer.json is unreadable" in line
    (line,) = refused(tmp_path / "r2", f"data.tokenizer={tmp_path / 'missing'}")
    assert "could not be loaded" in line


def test_a_damaged_sharded_export_is_one_line_and_each_rank_checksums_its_share(tmp_path):
    """Each rank checksums every world-size-th weight file, so across the ranks the export is read once;
    the finding is every rank's: a corrupted file that rank 1 read is one line on both ranks."""
    pretrain(tmp_path / "sharded", "train.steps=1", "fsdp.state_dict_type=SHARDED_STATE_DICT")
    export = tmp_path / "sharded" / "export"
    files = sorted(name for name in os.listdir(export) if name.endswith(".distcp"))
    assert len(files) == 2
    flip_a_byte(export / files[1])
    log = tmp_path / "sums"
    model = [f"model.name_or_path={export}", "model.config={}"]
    lines = refused(
        tmp_path / "r1", *model, nproc=2, wrapper="with_checksum_log.py", extra_env={"CHECKSUM_LOG": str(log)}
    )
    assert all(f"{export}/{files[1]} does not match its checksum (corrupted)" in line for line in lines)
    read = [open(f"{log}.rank{rank}").read().split() for rank in (0, 1)]
    assert read == [[f"{export}/{files[0]}"], [f"{export}/{files[1]}"]]
    truncate(export / files[0])  # a size against the manifest: every rank sees it, before any process group
    (line,) = refused(tmp_path / "r2", *model)
    assert f"{export}/{files[0]} has " in line


# A damaged checkpoint never blocks `auto`: it moves aside and the run resumes from the one before.
SIX = ["train.steps=6", "checkpoint.interval=2", "checkpoint.keep_latest=3"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    return run_dir, pretrain(run_dir, *SIX)


def flip_a_byte(path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def copy_checkpoints(ref_dir, run_dir, *steps: int):
    """The straight run's checkpoints of `steps`, as a run stopped after the last of them leaves them."""
    root = run_dir / "checkpoints"
    for step in steps:
        shutil.copytree(ref_dir / "checkpoints" / f"step-{step}", root / f"step-{step}")
    return root


def corrupt_without_manifest(checkpoint) -> str:
    """No manifest (as written before manifests), and a .distcp whose first tensor no longer unpickles: the
    checks before the load pass, and the load fails. Returns the file's name."""
    os.remove(checkpoint / "manifest.json")
    distcp = sorted(name for name in os.listdir(checkpoint) if name.endswith(".distcp"))[-1]
    with open(checkpoint / distcp, "r+b") as f:
        f.write(b"\0" * 4)  # the zip signature of the tensor torch.save wrote there
    return distcp


def same_export(run_dir, ref_dir) -> bool:
    ours, theirs = (
        load_file(run_dir / "export" / "model.safetensors"),
        load_file(ref_dir / "export" / "model.safetensors"),
    )
    return ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in theirs)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "unloadable", "corrupted"])
def test_auto_moves_a_damaged_checkpoint_aside_and_resumes_from_the_one_before(tmp_path, straight, damage):
    """A truncated or flipped .distcp fails the checks. "unloadable" and "corrupted" pass them (no manifest
    to catch it, as written before manifests): a train_state.json of the same size that no longer parses,
    or a .distcp whose tensor no longer unpickles. The load fails on every rank, the checkpoint then shows
    the damage, and auto falls back all the same."""
    ref_dir, ref = straight
    root = copy_checkpoints(ref_dir, tmp_path, 2, 4)
    newest = root / "step-4"
    distcp = sorted(name for name in os.listdir(newest) if name.endswith(".distcp"))[-1]
    if damage == "unloadable":
        os.remove(newest / "manifest.json")
        with open(newest / "train_state.json", "r+b") as f:
            f.write(b"x")
    elif damage == "corrupted":
        corrupt_without_manifest(newest)
    else:
        (truncate if damage == "truncated" else flip_a_byte)(newest / distcp)
    proc = run("pretrain_fsdp.py", ["--config", TINY, f"checkpoint.dir={tmp_path}", *SIX], nproc=2)
    aside = root / "damaged" / "step-4"
    if damage == "unloadable":
        assert proc.stdout.count("checkpoint: step-4 could not be loaded (JSONDecodeError: ") == 1
        assert f"{newest}/train_state.json is not valid JSON" in proc.stdout
    elif damage == "corrupted":  # DCP's collective read failed on the rank reading that file, so on both
        assert proc.stdout.count("checkpoint: step-4 could not be loaded (rank ") == 1
        assert f"{newest}/{distcp} is unreadable at " in proc.stdout
    else:
        assert f"checkpoint: step-4 is damaged ({newest}/{distcp} " in proc.stdout
    assert f"moved it to {aside}" in proc.stdout and (aside / distcp).exists()
    resumed = read_metrics(tmp_path)
    assert event(resumed, "model_ready")["start_step"] == 2
    assert losses(resumed) == losses(ref)[2:]
    assert same_export(tmp_path, ref_dir)  # bit-identical to resuming at step 2


def test_a_transient_read_error_moves_nothing_and_the_next_launch_resumes_bit_identical(tmp_path, straight):
    """An I/O timeout on rank 0 alone, in DCP's collective read, reaches both ranks as DCP's
    CheckpointException. The checkpoint shows no damage, so nothing moves: one line per rank, exit 1, and
    the next launch (a requeue, a torchrun restart) resumes from it."""
    ref_dir, ref = straight
    root = copy_checkpoints(ref_dir, tmp_path, 2, 4)
    ranks = each_rank(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", *SIX],
        wrapper="with_faults.py",
        extra_env={"FSDP2_RECIPES_FAULT": "read@4:0"},
    )
    timeout = f"TimeoutError: [Errno {errno.ETIMEDOUT}] {os.strerror(errno.ETIMEDOUT)}"
    line = (
        f"checkpoint {root}/step-4 could not be loaded (rank 0: {timeout}) and shows no damage; it stays in "
        f"place: rerun the same command (or requeue) to retry it"
    )
    for code, stderr in ranks:  # one line per rank, exit 1, no traceback
        assert code == 1 and stderr.count(line) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert sorted(os.listdir(root)) == ["step-2", "step-4"]
    resumed = pretrain(tmp_path, *SIX)
    assert event(resumed, "model_ready")["start_step"] == 4
    assert losses(resumed) == losses(ref)[4:]
    assert same_export(tmp_path, ref_dir)  # bit-identical to the run that never stopped


def test_a_read_error_while_checking_is_no_evidence_of_damage(tmp_path, straight, monkeypatch):
    """Before the load, rank 0 checksums the newest checkpoint: an I/O error there stops the launch with one
    line, and nothing moves."""
    root = copy_checkpoints(straight[0], tmp_path, 2, 4)

    def unreadable(path):
        raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    monkeypatch.setattr(integrity, "checksum", unreadable)
    with pytest.raises(
        SystemExit, match=r"could not read a checkpoint to check it \(\[Errno \d+\] .*step-4/"
    ):
        find_resume_checkpoint(str(tmp_path), "auto")
    assert sorted(os.listdir(root)) == ["step-2", "step-4"]


def test_with_every_checkpoint_damaged_auto_refuses_to_start_over_until_told(tmp_path, straight):
    """step-4 fails to load and shows why (a corrupted .distcp, no manifest), step-2 fails the checks (a
    truncated .distcp): both move aside. Starting from step 0 would drop their training silently, so auto
    refuses, in one line, on this launch and the next, until checkpoint.resume=none says so. One process:
    the failure path without collectives."""
    ref_dir, _ = straight
    root = copy_checkpoints(ref_dir, tmp_path, 2, 4)
    corrupt_without_manifest(root / "step-4")
    truncate(root / "step-2" / sorted(n for n in os.listdir(root / "step-2") if n.endswith(".distcp"))[0])
    line = (
        f"config error: checkpoint.resume=auto: no checkpoint is left to resume, and {root}/damaged holds "
        "step-2, step-4; set checkpoint.resume=none to start from step 0, or checkpoint.resume=<a "
        "checkpoint path>"
    )
    for launch in range(2):
        proc = run(
            "pretrain_fsdp.py", ["--config", TINY, f"checkpoint.dir={tmp_path}", *SIX], nproc=0, check=False
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert [text for text in proc.stderr.splitlines() if "config error:" in text] == [line]
        assert os.listdir(root) == ["damaged"] and not (tmp_path / "metrics.jsonl").exists()
        assert proc.stdout.count("; moved it to ") == (2 if launch == 0 else 0)
    records = pretrain(
        tmp_path, "train.steps=1", "checkpoint.export=false", "checkpoint.resume=none", nproc=0
    )
    assert event(records, "model_ready")["start_step"] == 0


def test_an_explicit_damaged_resume_is_one_line_and_a_checkpoint_without_manifest_still_loads(
    tmp_path, straight
):
    ref_dir, _ = straight
    copy = tmp_path / "copy"
    shutil.copytree(ref_dir / "checkpoints" / "step-4", copy)
    truncate(copy / sorted(n for n in os.listdir(copy) if n.endswith(".distcp"))[0])
    (line,) = refused(tmp_path / "run", f"checkpoint.resume={copy}")
    assert f"checkpoint.resume '{copy}' is damaged: {copy}/" in line
    old = tmp_path / "old"  # written before manifests existed
    shutil.copytree(ref_dir / "checkpoints" / "step-4", old)
    os.remove(old / "manifest.json")
    records = pretrain(tmp_path / "resumed", *SIX, f"checkpoint.resume={old}")
    assert event(records, "model_ready")["start_step"] == 4
