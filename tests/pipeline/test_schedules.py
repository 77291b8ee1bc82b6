"""1F1B and interleaved 1F1B on gloo ranks against one process on the same micro-batches:
losses and every parameter's gradient (fp32, dropout 0), plain modules and DDP per chunk."""

import pytest
import torch

from megadlms.pipeline import check_micro_batches
from tests.dist_utils import run_distributed

from .pipe_utils import pipeline_step, reference

TIMEOUT = 240
TOL = dict(rtol=1e-5, atol=1e-5)


def _compare(results, spec, ref_kw=None):
    dp, m = spec.get("dp", 1), spec["m"]
    ref = reference(spec.get("cfg", {}), m * dp, spec["b"], spec.get("loss", "ce"), spec.get("sgd_lr", 0.0))
    seen = set()
    last_stage_ranks = 0
    for r in results:
        if r["losses"]:
            last_stage_ranks += 1
            d = r["dp_rank"]
            torch.testing.assert_close(
                torch.stack([x.float() for x in r["losses"]]),
                torch.stack(ref["losses"][d * m : (d + 1) * m]),
                **TOL,
            )
        for n, g in r["grads"].items():
            key = "embedding.word_embeddings.weight" if n not in ref["grads"] else n
            torch.testing.assert_close(g, ref["grads"][key], **TOL, msg=lambda s, n=n: f"{n}: {s}")
            seen.add(n)
        for n, p in r["params"].items():
            key = "embedding.word_embeddings.weight" if n not in ref["params"] else n
            torch.testing.assert_close(p, ref["params"][key], **TOL)
    assert last_stage_ranks == dp * spec.get("tp", 1)
    assert set(ref["grads"]) <= seen
    return ref


@pytest.mark.parametrize(
    "world, spec",
    [
        (2, {"pp": 2, "m": 4, "b": 2}),
        (4, {"pp": 4, "m": 6, "b": 1}),
        (2, {"pp": 2, "vp": 2, "m": 4, "b": 2}),
        (2, {"pp": 2, "vp": 2, "m": 2, "b": 2}),  # m == pp: all warm-up, then all cool-down
        (4, {"pp": 4, "vp": 2, "m": 8, "b": 1, "cfg": {"num_layers": 8}}),
        (2, {"pp": 2, "m": 3, "b": 2, "loss": "diffusion"}),
        (
            2,
            {
                "pp": 2,
                "vp": 2,
                "m": 4,
                "b": 2,
                "loss": "diffusion",
                "cfg": {"untie_embeddings_and_output_weights": True},
            },
        ),
    ],
    ids=[
        "pp2",
        "pp4",
        "pp2-vp2",
        "pp2-vp2-m2",
        "pp4-vp2-m8",
        "pp2-diffusion",
        "pp2-vp2-untied-diffusion",
    ],
)
def test_pipeline_matches_one_process(world, spec):
    _compare(run_distributed(pipeline_step, world, args=(spec,), timeout=TIMEOUT), spec)


def test_pp2_dp2_ddp_chunks_match_one_process():
    spec = {"pp": 2, "dp": 2, "vp": 2, "m": 4, "b": 1, "ddp": True, "loss": "diffusion"}
    results = run_distributed(pipeline_step, 4, args=(spec,), timeout=TIMEOUT)
    _compare(results, spec)
    for r in results:  # every backward but each chunk's last ran under no_sync
        assert r["no_sync_calls"] == [3, 3]


def test_pp2_dp2_ddp_1f1b_match_one_process():
    spec = {"pp": 2, "dp": 2, "m": 3, "b": 2, "ddp": True}
    _compare(run_distributed(pipeline_step, 4, args=(spec,), timeout=TIMEOUT), spec)


def test_tied_embedding_copy_stays_equal_after_sgd():
    spec = {"pp": 2, "m": 2, "b": 2, "sgd_lr": 0.5}
    results = run_distributed(pipeline_step, 2, args=(spec,), timeout=TIMEOUT)
    _compare(results, spec)
    first, last = results[0]["params"], results[1]["params"]
    assert "output_layer.weight" in last and "output_layer.weight" not in first
    torch.testing.assert_close(
        last["output_layer.weight"], first["embedding.word_embeddings.weight"], rtol=0, atol=0
    )


def test_uneven_first_last_stages():
    spec = {
        "pp": 3,
        "m": 3,
        "b": 1,
        "cfg": {"num_layers": 5},
        "split": {"first_stage_layers": 1, "last_stage_layers": 2},
    }
    _compare(run_distributed(pipeline_step, 3, args=(spec,), timeout=TIMEOUT), spec)


def test_forward_only_gives_the_losses_and_no_grads():
    spec = {"pp": 2, "vp": 2, "m": 2, "b": 2, "forward_only": True, "loss": "diffusion"}
    results = run_distributed(pipeline_step, 2, args=(spec,), timeout=TIMEOUT)
    ref = reference({}, 2, 2, "diffusion")
    torch.testing.assert_close(
        torch.stack([x.float() for x in results[1]["losses"]]), torch.stack(ref["losses"]), **TOL
    )
    assert results[0]["losses"] == []
    for r in results:
        assert all(g is None for g in r["grads"].values())
        assert {e["kind"] for e in r["timeline"]} == {"F"}


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_pp2_tp2_matches_one_process(sp):
    # sequence parallel: odd crops (S-1 = 11, 10, ...) are padded; hidden states [B, S'/2, H] travel
    spec = {"pp": 2, "tp": 2, "sp": sp, "m": 3, "b": 2, "loss": "diffusion", "cfg": {"swiglu": True}}
    results = run_distributed(pipeline_step, 4, args=(spec,), timeout=TIMEOUT)
    _compare(results, spec)
    torch.manual_seed(7)
    from megadlms.models import GPTModel

    from .pipe_utils import config

    whole = dict(GPTModel(config(swiglu=True)).named_parameters())
    for r in results:  # TP x PP chunks initialise to the whole tp=1 model's tensors
        for n, p in r["init"].items():
            key = "embedding.word_embeddings.weight" if n not in whole else n
            assert torch.equal(p, whole[key]), n


def test_timeline_records_every_forward_and_backward():
    spec = {"pp": 2, "vp": 2, "m": 4, "b": 1}
    results = run_distributed(pipeline_step, 2, args=(spec,), timeout=TIMEOUT)
    for r in results:
        kinds = sorted((e["kind"], e["chunk"], e["micro"]) for e in r["timeline"])
        assert kinds == sorted((k, c, i) for k in "BF" for c in range(2) for i in range(4))
        assert all(e["end"] >= e["start"] for e in r["timeline"])


@pytest.mark.parametrize(
    "m, pp, vp, forward_only, match",
    [
        (1, 2, 1, False, "at least pipeline_model_parallel_size 2 micro-batches"),
        (3, 2, 2, False, "multiple of pipeline_model_parallel_size 2"),
        (3, 2, 2, True, "multiple of pipeline_model_parallel_size 2"),
        (0, 2, 1, True, "at least one micro-batch"),
    ],
)
def test_micro_batch_rules(m, pp, vp, forward_only, match):
    with pytest.raises(ValueError, match=match) as e:
        check_micro_batches(m, pp, vp, forward_only)
    assert "global_batch_size" in str(e.value) and "micro_batch_size" in str(e.value)
    check_micro_batches(1, 2, 1, forward_only=True)  # validation may use fewer micro-batches


def test_megatron_default_dropout_trains_and_keeps_the_tied_copy():
    """Dropout 0.1 (Megatron's default): no bitwise reference (the masks differ from one
    process's), so check what must hold anyway: finite losses, a grad on every parameter, the
    tied copy equal to the embedding after an SGD step."""
    cfg = {"attention_dropout": 0.1, "hidden_dropout": 0.1}
    spec = {"pp": 2, "vp": 2, "m": 2, "b": 2, "sgd_lr": 0.5, "cfg": cfg, "loss": "diffusion"}
    results = run_distributed(pipeline_step, 2, args=(spec,), timeout=TIMEOUT)
    assert all(torch.isfinite(x) for x in results[1]["losses"]) and len(results[1]["losses"]) == 2
    for r in results:
        assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in r["grads"].values())
    torch.testing.assert_close(
        results[1]["params"]["output_layer.weight"],
        results[0]["params"]["embedding.word_embeddings.weight"],
        rtol=0,
        atol=0,
    )
