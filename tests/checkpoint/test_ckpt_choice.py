"""Which checkpoint a run loads, with Megatron's / MegaDLMs' semantics: --ckpt-step, non-persistent
checkpoints (only the newest kept; the newer of persistent and non-persistent is loaded; a crash
during a non-persistent save keeps the previous one) and --use-checkpoint-args (architecture
flags from the checkpoint's record). Single process, plain modules; no ranks."""

from __future__ import annotations

import os
import shlex

import pytest
import torch

from megadlms import checkpoint as ck
from megadlms.checkpoint import commit
from megadlms.config import CheckpointConfig, parse_config


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _weights(path):
    m = _model(0)
    ck.load_model_state(path, m)
    return m.weight.detach().clone()


def _iters(root):
    return sorted(n for n in os.listdir(root) if n.startswith("iter_"))


def test_non_persistent_saves_keep_newest_and_load_picks_newer(tmp_path, monkeypatch):
    save = str(tmp_path / "ckpt")
    cfg = CheckpointConfig(
        save=save, save_interval=4, non_persistent_save_interval=3, non_persistent_ckpt_type="global"
    )
    saver = ck.Checkpointer(cfg)
    due = [saver.due(i) for i in (3, 4, 6, 12)]  # 12: both due, the persistent save wins (Megatron)
    assert due == ["non_persistent", "persistent", "non_persistent", "persistent"]
    saved = {}
    for it in (3, 4, 6, 8, 9):
        m = _model(it)
        saved[it] = m.weight.detach().clone()
        saver.save(it, m, non_persistent=saver.due(it) == "non_persistent")
    np_root = os.path.join(save, "non_persistent")  # Megatron's default: <save>/non_persistent
    assert _iters(np_root) == ["iter_0000009"] and ck.read_latest_iteration(np_root) == 9
    assert _iters(save) == ["iter_0000004", "iter_0000008"]
    # The persistent latest is never moved by a non-persistent save.
    assert ck.read_latest_iteration(save) == 8
    # Load side (as Megatron): <load>/non_persistent's 9 is newer than the persistent 8.
    load = CheckpointConfig(load=save, non_persistent_ckpt_type="global")
    assert ck.Checkpointer(load).find() == ck.checkpoint_dir(np_root, 9)
    assert torch.equal(_weights(ck.Checkpointer(load).find()), saved[9])
    # Without --non-persistent-ckpt-type only the persistent checkpoints count (Megatron).
    assert ck.Checkpointer(CheckpointConfig(load=save)).find() == ck.checkpoint_dir(save, 8)
    # --ckpt-step: exactly that iteration, also when a newer non-persistent one exists.
    step = CheckpointConfig(load=save, ckpt_step=4, non_persistent_ckpt_type="global")
    assert torch.equal(_weights(ck.Checkpointer(step).find()), saved[4])
    with pytest.raises(ValueError, match=r"--ckpt-step 5: .*complete iterations there: \[4, 8\]"):
        ck.Checkpointer(CheckpointConfig(load=save, ckpt_step=5)).find()

    # --ckpt-step does not read latest: one naming a missing iteration does not hide iteration 4.
    latest = os.path.join(save, ck.LATEST_FILE)
    open(latest, "w").write("99")
    assert ck.Checkpointer(step).find() == ck.checkpoint_dir(save, 4)
    open(latest, "w").write("8")

    # A persistent save newer than the non-persistent one wins at load.
    saver.save(12, _model(12))
    assert ck.Checkpointer(load).find() == ck.checkpoint_dir(save, 12)

    # A crash while committing a non-persistent save leaves the previous one whole and loadable.
    def dying(*a, **k):
        raise OSError("disk gone")

    monkeypatch.setattr(commit, "write_atomic", dying)
    with pytest.raises(OSError, match="disk gone"):
        saver.save(15, _model(15), non_persistent=True)
    monkeypatch.undo()
    assert ck.read_latest_iteration(np_root) == 9 and torch.equal(
        _weights(ck.resolve_checkpoint(np_root)), saved[9]
    )
    saver.save(18, _model(18), non_persistent=True)  # the next one commits and clears the torn save
    assert _iters(np_root) == ["iter_0000018"]

    # local: the same checkpoints under --non-persistent-local-ckpt-dir; refused across nodes.
    local = str(tmp_path / "local")
    kw = dict(
        save=save, save_interval=4, non_persistent_ckpt_type="local", non_persistent_local_ckpt_dir=local
    )
    ck.Checkpointer(CheckpointConfig(**kw)).save(21, _model(21), non_persistent=True)
    assert ck.Checkpointer(CheckpointConfig(load=save, **kw)).find() == ck.checkpoint_dir(local, 21)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="spans nodes .* use --non-persistent-ckpt-type global"):
        ck.Checkpointer(CheckpointConfig(**kw))


BASE = shlex.split(
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 10 --lr 1e-3 --mock-data"
)


def test_use_checkpoint_args_takes_the_recorded_architecture(tmp_path):
    root = str(tmp_path)
    trained = parse_config(
        BASE + shlex.split("--swiglu --normalization RMSNorm --qk-layernorm --hidden-dropout 0.0 --num-layers 3 "
                           "--ffn-hidden-size 48 --disable-bias-linear --make-vocab-size-divisible-by 64"),
        world_size=1,
    )  # fmt: skip
    records = ck.RunRecords(trained.to_dict(), trained.model.to_dict(), trained.data.tokenizer.to_dict())
    for it in (2, 5):
        ck.save_checkpoint(root, it, model=_model(it), records=records)
    argv = BASE + ["--load", root, "--use-checkpoint-args", "--hidden-dropout", "0.1", "--num-layers", "2"]
    argv += ["--group-query-attention", "--num-query-groups", "2"]  # the checkpoint has no GQA
    cfg = parse_config(argv, world_size=1, checkpoint_args=ck.checkpoint_record)
    m = cfg.model
    # Forced (MegaDLMs' force=True): the checkpoint's value replaces the command line's.
    assert (m.swiglu, m.normalization, m.qk_layernorm, m.hidden_dropout, m.add_bias_linear) == (
        True, "RMSNorm", True, 0.0, False,
    )  # fmt: skip
    assert cfg.vocab_divisible_by == 64 and m.num_query_groups == trained.model.num_query_groups == 4
    # Sizes (force=False): a size given on the command line wins, one not given comes from the checkpoint.
    assert m.num_layers == 2 and m.ffn_hidden_size == 48
    note = next(n for n in cfg.logging.notes if n.startswith("--use-checkpoint-args"))
    assert "iter_0000005" in note and "--swiglu" in note and "--num-layers" not in note
    # Without the flag nothing is taken from the checkpoint.
    plain = parse_config(BASE + ["--load", root], world_size=1, checkpoint_args=ck.checkpoint_record).model
    assert (plain.swiglu, plain.ffn_hidden_size, plain.hidden_dropout) == (False, 128, 0.1)
    # --ckpt-step picks the record too; an empty --load keeps the flags given, with a note.
    empty = str(tmp_path / "empty")
    cfg = parse_config(
        BASE + ["--load", empty, "--use-checkpoint-args"], world_size=1, checkpoint_args=ck.checkpoint_record
    )
    assert not cfg.model.swiglu and any("no checkpoint in --load" in n for n in cfg.logging.notes)


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--ckpt-step 3", "--ckpt-step needs --load DIR"),
        ("--use-checkpoint-args", "--use-checkpoint-args needs --load DIR"),
        ("--save /tmp/x --save-interval 5 --non-persistent-save-interval 2",
         "--non-persistent-save-interval needs --non-persistent-ckpt-type global"),
        ("--non-persistent-ckpt-type in_memory", "in_memory is not supported"),
        ("--non-persistent-ckpt-type local", "needs --non-persistent-local-ckpt-dir DIR"),
    ],
)  # fmt: skip
def test_checkpoint_choice_errors_name_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_config(BASE + shlex.split(flags), world_size=1)
