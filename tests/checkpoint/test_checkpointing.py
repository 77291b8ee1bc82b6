"""Checkpoint files: crash safety, safe loading, config checks, both formats.

Single-process tests on plain modules + torch.optim (the multi-rank, cross-wrapper
resharding is exercised through the trainer in test_pretrain_resume.py)."""

import multiprocessing as mp
import os
import pickle
import signal

import pytest
import torch

from megadlms import checkpoint as ck
from megadlms.checkpoint import commit
from megadlms.checkpoint.format import SafeFileSystemReader


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _trained(seed):
    m = _model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(2):
        m(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _save(root, it, seed, fmt="torch_dist"):
    m, opt = _trained(seed)
    ck.save_checkpoint(
        root,
        it,
        model=m,
        optimizer=opt,
        ckpt_format=fmt,
        consumed_samples=8 * it,
        records=ck.RunRecords(args={"seed": seed}, model_config={"hidden_size": 5}),
    )
    return m, opt


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_round_trip(tmp_path, fmt):
    m, opt = _save(str(tmp_path), 3, seed=1, fmt=fmt)
    m2 = _model(2)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    path = ck.resolve_checkpoint(str(tmp_path))
    assert path == os.path.join(str(tmp_path), "iter_0000003")
    common = ck.load_model_state(path, m2, model_config={"hidden_size": 5})
    ck.load_optimizer_state(path, opt2, m2)
    assert common["iteration"] == 3 and common["consumed_samples"] == 24
    assert common["ckpt_format"] == fmt and common["args"] == {"seed": 1}
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict(), opt2.state_dict()
    for i in sa["state"]:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa["state"][i][k], sb["state"][i][k])
    assert sa["param_groups"] == sb["param_groups"]


def test_model_config_mismatch_names_field(tmp_path):
    _save(str(tmp_path), 1, seed=1)
    path = ck.resolve_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match=r"hidden_size=5 .* hidden_size=7 \(--hidden-size\)"):
        ck.load_model_state(path, _model(1), model_config={"hidden_size": 7})
    wrong = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 4))
    with pytest.raises(RuntimeError, match="shape"):
        ck.load_model_state(path, wrong)


def test_metadata_unpickler_refuses_foreign_globals(tmp_path):
    _save(str(tmp_path), 1, seed=1)
    path = ck.resolve_checkpoint(str(tmp_path))
    assert SafeFileSystemReader(path).read_metadata().state_dict_metadata  # the real one loads

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + os.path.join(str(tmp_path), "pwned"),))

    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        ck.load_model_state(path, _model(1))
    assert not os.path.exists(os.path.join(str(tmp_path), "pwned"))
    # tensor payloads are read with weights_only=True: a pickled object there fails too
    torch_root = os.path.join(str(tmp_path), "t")
    _save(torch_root, 1, seed=1, fmt="torch")
    tpath = ck.resolve_checkpoint(torch_root)
    torch.save({"model/0.weight": Evil()}, os.path.join(tpath, ck.TORCH_FILE))
    with pytest.raises(pickle.UnpicklingError):
        ck.load_model_state(tpath, _model(1))
    assert not os.path.exists(os.path.join(str(tmp_path), "pwned"))


def _crash_child(root, where):
    """Save iteration 1, then die by SIGKILL in the middle of saving iteration 2."""
    torch.set_num_threads(1)
    m, _ = _save(root, 1, seed=1)
    torch.save(m.state_dict(), os.path.join(root, "reference_weights.pt"))  # what iter 1 holds
    if where == "tensors":  # half-way through writing the DCP data files
        from torch.distributed.checkpoint import filesystem

        real = filesystem.FileSystemWriter.write_data

        def dying(self, plan, planner):
            real(self, plan, planner).wait()
            os.kill(os.getpid(), signal.SIGKILL)

        filesystem.FileSystemWriter.write_data = dying
    else:  # data written, common.json being written

        def dying_write(path, data):
            with open(path + ".tmp.partial", "w") as f:
                f.write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)

        commit.write_atomic = dying_write
    _save(root, 2, seed=2)


@pytest.mark.parametrize("where", ["tensors", "common"])
def test_kill_during_save_keeps_previous_checkpoint(tmp_path, where):
    root = str(tmp_path)
    # fork, not spawn: the child needs a process of its own to die in, not a fresh
    # interpreter (spawn re-imported torch and megadlms, ~5 s of the test); the patches it
    # makes stay in the child.
    p = mp.get_context("fork").Process(target=_crash_child, args=(root, where))
    p.start()
    p.join(120)
    stuck = p.is_alive()
    if stuck:  # a child stuck (e.g. on a lock held at the fork) fails this test and is reaped
        p.kill()
        p.join()
    assert not stuck, "the crash child hung: killed after 120 s"
    assert p.exitcode == -signal.SIGKILL
    assert os.path.isdir(os.path.join(root, "iter_0000002.tmp"))  # the torn save
    assert not os.path.exists(os.path.join(root, "iter_0000002"))
    assert ck.read_latest_iteration(root) == 1
    ref = torch.load(os.path.join(root, "reference_weights.pt"), weights_only=True)
    m = _model(5)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    path = ck.resolve_checkpoint(root)
    ck.load_model_state(path, m)
    ck.load_optimizer_state(path, opt, m)
    for k, v in m.state_dict().items():
        assert torch.equal(ref[k], v), k
    # the next save of iteration 2 clears the torn directory and completes
    _save(root, 2, seed=2)
    assert ck.read_latest_iteration(root) == 2
    assert not os.path.exists(os.path.join(root, "iter_0000002.tmp"))


def test_resave_same_iteration_and_missing_dirs(tmp_path):
    root = str(tmp_path)
    assert ck.resolve_checkpoint(root) is None
    _save(root, 4, seed=1)
    m2, _ = _save(root, 4, seed=2)  # replaces iteration 4 in place
    m = _model(9)
    ck.load_model_state(ck.resolve_checkpoint(root), m)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    with open(os.path.join(root, ck.LATEST_FILE), "w") as f:
        f.write("7")
    with pytest.raises(RuntimeError, match="iteration 7"):
        ck.resolve_checkpoint(root)


def test_checkpointer_find_save_load_fallback(tmp_path):
    """The Checkpointer a run uses: resume from --save, save with the run's counters and
    records, verified load (weights, optimizer, counters) and --ckpt-fallback past a corrupt one."""
    from megadlms.config import CheckpointConfig

    root = str(tmp_path)
    cfg = CheckpointConfig(save=root, save_interval=1)
    saver = ck.Checkpointer(cfg)
    assert saver.find() is None  # nothing under --save yet: start fresh
    trained = {}
    for it in (1, 2):
        m, opt = _trained(it)
        written = saver.save(
            it, m, opt, consumed_samples=8 * it, extra={"nan_iterations": it},
            records=ck.RunRecords(model_config={"hidden_size": 5, "vocab_size": 384}),
        )  # fmt: skip
        assert written == ck.checkpoint_dir(root, it) and saver.wait() is None  # synchronous
        trained[it] = (m, opt)
    newest = saver.find()
    assert newest == ck.checkpoint_dir(root, 2) and saver.recorded_vocab(newest) == 384

    def check(path, state, it):
        m_ref, opt_ref = trained[it]
        assert path == ck.checkpoint_dir(root, it)
        assert (state.iteration, state.consumed_samples, state.extra) == (it, 8 * it, {"nan_iterations": it})
        assert all(torch.equal(a, b) for a, b in zip(m_ref.state_dict().values(), m.state_dict().values()))
        sa, sb = opt_ref.state_dict()["state"], opt.state_dict()["state"]
        assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)

    m = _model(9)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    check(*saver.load(newest, m, opt, model_config={"hidden_size": 5}), 2)
    victim = next(f for f in sorted(os.listdir(newest)) if f.endswith(".distcp"))
    with open(os.path.join(newest, victim), "r+b") as f:
        f.write(b"\xff\xff")  # same size, different bytes: only the checksum notices
    with pytest.raises(ck.CheckpointCorruptError, match=victim):
        saver.load(newest, m, opt)
    fallback = ck.Checkpointer(CheckpointConfig(save=root, save_interval=1, ckpt_fallback=True))
    check(*fallback.load(newest, m, opt), 1)
