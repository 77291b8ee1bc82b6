"""Verified checkpoints, a full disk, --ckpt-fallback, --async-save and the data position on
resume.

Single-process tests on a plain module for the files; the trainer paths on 2 (and 1) gloo
ranks through ``megadlms.pretrain.run``, against an uninterrupted run of the same flags."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from megadlms import checkpoint as ck
from megadlms.checkpoint import CheckpointCorruptError
from tests.dist_utils import run_distributed


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _save(root, it, seed, fmt="torch_dist"):
    m = _model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    return ck.save_checkpoint(root, it, model=m, optimizer=opt, ckpt_format=fmt, consumed_samples=it)


def _load(path):
    m = _model(9)
    return ck.load_checkpoint(path, model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2))


def _flip(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("damage", ["bit_flip", "truncate", "missing"])
def test_damaged_file_is_named_on_load(tmp_path, fmt, damage):
    path = _save(str(tmp_path), 3, seed=1, fmt=fmt)
    common = ck.read_common(path)
    files = common["files"]
    victim = ck.TORCH_FILE if fmt == "torch" else next(f for f in files if f.endswith(".distcp"))
    assert "rng/rank_0.pt" in files and victim in files
    for rel, rec in files.items():  # the record is what is on disk
        assert os.path.getsize(os.path.join(path, rel)) == rec["size"]
    assert _load(path).iteration == 3  # intact: loads
    target = os.path.join(path, victim)
    {"bit_flip": _flip, "truncate": _truncate, "missing": os.remove}[damage](target)
    words = {"bit_flip": "fails its checksum", "truncate": "bytes", "missing": "is missing"}[damage]
    with pytest.raises(CheckpointCorruptError, match=words) as info:
        _load(path)
    assert target in str(info.value) and "--ckpt-fallback" in str(info.value)


def test_checkpoint_without_manifest_still_loads(tmp_path):
    """Format-2 checkpoints (no ``files`` record) load unchecked."""
    path = _save(str(tmp_path), 2, seed=1)
    common = ck.read_common(path)
    del common["files"]
    common["format_version"] = 2
    with open(os.path.join(path, ck.COMMON_FILE), "w") as f:
        json.dump(common, f)
    assert _load(path).iteration == 2


def _fill_disk(monkeypatch, after_bytes=64):
    """DCP's writer fails with ENOSPC after writing a few bytes of its first item."""
    from torch.distributed.checkpoint import filesystem

    def full(transforms, stream, data, *a, **k):
        stream.write(b"\0" * after_bytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "__0_0.distcp")

    monkeypatch.setattr(filesystem, "_write_item", full)


def test_disk_full_keeps_previous_checkpoint_and_latest(tmp_path, monkeypatch):
    root = str(tmp_path)
    _save(root, 1, seed=1)
    _fill_disk(monkeypatch)
    with pytest.raises(OSError, match="no space left on device") as info:
        _save(root, 2, seed=2)
    assert info.value.errno == errno.ENOSPC
    assert "iter_0000001 and latest_checkpointed_iteration.txt are untouched" in str(info.value)
    assert ck.read_latest_iteration(root) == 1 and not os.path.exists(os.path.join(root, "iter_0000002"))
    monkeypatch.undo()
    assert _load(ck.resolve_checkpoint(root)).iteration == 1  # verifies and loads
    _save(root, 2, seed=2)  # space back: the next save clears the torn directory
    assert ck.read_latest_iteration(root) == 2


# ------------------------------------------------------------------ trainer paths (gloo ranks)
ITERS, SAVE = 4, 2  # every run trains ITERS steps and saves every SAVE (resumes split there)
LAST, PREV = f"iter_{ITERS:07d}", f"iter_{SAVE:07d}"  # the newest and the previous checkpoint
SECOND_HALF = list(range(SAVE + 1, ITERS + 1))
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--attention-dropout 0 --hidden-dropout 0 --micro-batch-size 2 --global-batch-size 8 "
    f"--train-iters {ITERS} --lr 2e-3 --seed 7 --mock-data --log-interval 1 --eval-interval 1000 "
    f"--eval-iters 0 --save-interval {SAVE}"
).split()


def _spied_run(argv, seen):
    """pretrain.run recording every step's sample indices on this rank."""
    from megadlms.pretrain import run
    from megadlms.training import train

    real = train.train_step

    def spy(model, optimizer, micro, cfg, iteration, **k):
        seen[iteration + 1] = sorted(int(i) for b in micro for i in b["sample_idx"])
        return real(model, optimizer, micro, cfg, iteration, **k)

    train.train_step = spy
    try:
        return run(TINY + list(argv))
    finally:
        train.train_step = real


def _position_world(rank, world, tmp):
    out = {}
    save = os.path.join(tmp, "s")
    seen = out["straight_seen"] = {}
    out["straight"] = _spied_run(["--num-workers", "0"], seen)  # the reference: no workers
    out["part"] = _spied_run(["--num-workers", "0", "--save", save, "--exit-interval", str(SAVE)], {})
    seen = out["resume_seen"] = {}
    out["resume"] = _spied_run(["--num-workers", "1", "--save", save], seen)  # auto-resume from --save
    return out


def _one_rank_world(rank, world, tmp):
    seen = {}
    _spied_run(["--num-workers", "1", "--load", os.path.join(tmp, "s", PREV), "--no-auto-resume",
                "--save", os.path.join(tmp, "one")], seen)  # fmt: skip
    return seen


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_restores_exact_next_sample_any_rank_count_with_workers(tmp_path):
    """--num-workers 1: after a resume every rank gets exactly the samples the uninterrupted run
    (no workers) gave it, and a 1-rank run resuming the 2-rank checkpoint gets the same global samples."""
    tmp = str(tmp_path)
    r = run_distributed(_position_world, 2, (tmp,))
    for res in r:
        assert [res["resume_seen"][i] for i in SECOND_HALF] == [res["straight_seen"][i] for i in SECOND_HALF]
    a = r[0]
    assert a["part"].iteration == SAVE and sorted(a["resume"].losses) == SECOND_HALF
    assert [a["resume"].losses[i] for i in SECOND_HALF] == [a["straight"].losses[i] for i in SECOND_HALF]
    one = run_distributed(_one_rank_world, 1, (tmp,))[0]
    for i in SECOND_HALF:
        assert one[i] == sorted(r[0]["straight_seen"][i] + r[1]["straight_seen"][i]), i


def _save_world(rank, world, tmp):
    import torch.distributed as dist
    from torch.distributed.checkpoint import filesystem

    out = {}
    out["async"] = _spied_run(["--num-workers", "0", "--save", os.path.join(tmp, "a"), "--async-save"], {})
    out["sync"] = _spied_run(["--num-workers", "0", "--save", os.path.join(tmp, "b")], {})
    # FSDP2 + --async-save (DTensor shards staged), read back by DDP: resharding still works
    fsdp = ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--num-workers", "0"]
    _spied_run(fsdp + ["--save", os.path.join(tmp, "f"), "--async-save", "--exit-interval", str(SAVE)], {})
    out["from_fsdp"] = _spied_run(
        ["--untie-embeddings-and-output-weights", "--num-workers", "0", "--load", os.path.join(tmp, "f")], {}
    )
    out["untied"] = _spied_run(["--untie-embeddings-and-output-weights", "--num-workers", "0"], {})
    # damage the newest checkpoint of the async run: the resume names the file; --ckpt-fallback
    # takes the previous one
    files = ck.read_common(os.path.join(tmp, "a", LAST))["files"]
    out["victim"] = victim = max((f for f in files if f.endswith(".distcp")), key=lambda f: files[f]["size"])
    if rank == 0:
        _flip(os.path.join(tmp, "a", LAST, victim))
    dist.barrier()
    try:
        _spied_run(["--num-workers", "0", "--save", os.path.join(tmp, "a")], {})
        out["corrupt"] = None
    except CheckpointCorruptError as exc:
        out["corrupt"] = str(exc)
    out["fallback"] = _spied_run(
        ["--num-workers", "0", "--save", os.path.join(tmp, "a"), "--ckpt-fallback"], {}
    )
    # ENOSPC on rank 1 only while the trainer saves the last iteration: every rank raises it
    real_write = filesystem._write_item

    def full(transforms, stream, *a, **k):
        if LAST in str(getattr(stream, "name", "")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)
        return real_write(transforms, stream, *a, **k)

    if rank == 1:
        filesystem._write_item = full
    try:
        _spied_run(["--num-workers", "0", "--save", os.path.join(tmp, "full")], {})
        out["enospc"] = None
    except OSError as exc:
        out["enospc"] = str(exc)
    finally:
        filesystem._write_item = real_write
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_async_save_fallback_and_disk_full_on_two_ranks(tmp_path):
    """--async-save trains the same numbers as synchronous saves and leaves complete
    checkpoints (an FSDP2 one still reshards into DDP); a bit flip in a shard is named on every rank, --ckpt-fallback resumes from
    the previous checkpoint and continues the same curve; ENOSPC on one rank is a clear error
    on every rank, the previous checkpoint and latest untouched."""
    r = run_distributed(_save_world, 2, (str(tmp_path),))
    a = r[0]
    assert a["async"].losses == a["sync"].losses and len(a["async"].save_stalls) == 2
    assert (tmp_path / "a" / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)
    assert sorted(a["from_fsdp"].losses) == SECOND_HALF
    for i in SECOND_HALF:
        assert a["from_fsdp"].losses[i] == pytest.approx(a["untied"].losses[i], rel=1e-5), i
    for res in r:
        assert res["victim"] in res["corrupt"] and "fails its checksum" in res["corrupt"]
        fb = res["fallback"]
        assert sorted(fb.losses) == SECOND_HALF
        assert [fb.losses[i] for i in SECOND_HALF] == [a["sync"].losses[i] for i in SECOND_HALF]
        assert "no space left on device" in res["enospc"] and PREV in res["enospc"]
    assert (tmp_path / "full" / "latest_checkpointed_iteration.txt").read_text() == str(SAVE)
    assert not (tmp_path / "full" / LAST).exists()
    assert ck.read_common(str(tmp_path / "full" / PREV))["files"]


def test_reliability_flags_parse_into_the_config():
    from megadlms.config import parse_config

    base = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
            "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--mock-data"]  # fmt: skip
    cfg = parse_config(
        base + ["--save", "s", "--save-interval", "1", "--async-save", "--ckpt-fallback"], world_size=1
    )
    ck_cfg = cfg.checkpoint
    assert ck_cfg.async_save and ck_cfg.ckpt_fallback and ck_cfg.auto_resume
    assert not any("--async-save" in n for n in cfg.logging.notes)  # it has an effect now
    assert not parse_config(base + ["--no-auto-resume"], world_size=1).checkpoint.auto_resume
    with pytest.raises(ValueError, match="--async-save needs --ckpt-format torch_dist"):
        parse_config(base + ["--async-save", "--ckpt-format", "torch"], world_size=1)
