"""Megatron's layer split: even, uneven first/last stage, interleaved virtual chunks, errors."""

import pytest

from megadlms.pipeline import PipelineChunk, model_chunks, stage_layers, virtual_pipeline_size


def _flat(split):
    return [list(r) for rank in split for r in rank]


def test_even_split():
    assert stage_layers(8, 2) == [[range(0, 4)], [range(4, 8)]]
    assert stage_layers(4, 4) == [[range(i, i + 1)] for i in range(4)]
    assert stage_layers(3, 1) == [[range(0, 3)]]


def test_interleaved_block_v_times_pp_plus_r():
    split = stage_layers(16, 4, vp=2)  # blocks of 2 layers; chunk v of rank r = block v*4 + r
    for r in range(4):
        for v in range(2):
            b = v * 4 + r
            assert split[r][v] == range(2 * b, 2 * b + 2)
    assert sorted(i for rank in _flat(split) for i in rank) == list(range(16))


def test_uneven_first_last_matches_megatron_offsets():
    # Megatron: first stage 1 layer, last 3, the middle 2 stages share 8 - 4 = 4 -> 2 each
    assert stage_layers(8, 4, first_stage_layers=1, last_stage_layers=3) == [
        [range(0, 1)],
        [range(1, 3)],
        [range(3, 5)],
        [range(5, 8)],
    ]
    assert stage_layers(7, 2, first_stage_layers=3) == [[range(0, 3)], [range(3, 7)]]
    assert stage_layers(7, 3, last_stage_layers=1) == [[range(0, 3)], [range(3, 6)], [range(6, 7)]]


def test_uneven_interleaved_rounds():
    # per rank 2, 4, 2 layers; vp 2: each round holds 1 + 2 + 1 layers
    split = stage_layers(8, 3, vp=2, first_stage_layers=2, last_stage_layers=2)
    assert split == [
        [range(0, 1), range(4, 5)],
        [range(1, 3), range(5, 7)],
        [range(3, 4), range(7, 8)],
    ]


@pytest.mark.parametrize(
    "args, kw, field",
    [
        ((7, 2), {}, "num_layers 7 is not divisible by pipeline_model_parallel_size 2"),
        ((8, 2), {"vp": 3}, "num_layers_per_virtual_pipeline_stage"),
        ((8, 1), {"vp": 2}, "pipeline_model_parallel_size > 1"),
        ((8, 3), {"first_stage_layers": 3}, "middle stages"),
        ((8, 2), {"first_stage_layers": 3, "last_stage_layers": 4}, "decoder_last_pipeline_num_layers"),
        ((8, 2), {"first_stage_layers": 0}, "decoder_first_pipeline_num_layers must be a positive"),
        ((8, 1), {"first_stage_layers": 2}, "pipeline_model_parallel_size > 1"),
        ((0, 2), {}, "num_layers must be a positive"),
        ((8, 0), {}, "pipeline_model_parallel_size must be a positive"),
        (
            (
                8,
                4,
            ),
            {"first_stage_layers": 1, "last_stage_layers": 1, "vp": 2},
            "virtual chunks",
        ),
    ],
)
def test_errors_name_the_fields(args, kw, field):
    with pytest.raises(ValueError, match=field):
        stage_layers(*args, **kw)


def test_virtual_pipeline_size():
    assert virtual_pipeline_size(16, 4) == 1
    assert virtual_pipeline_size(16, 4, num_layers_per_virtual_pipeline_stage=2) == 2
    assert virtual_pipeline_size(16, 4, virtual_pipeline_model_parallel_size=4) == 4
    with pytest.raises(ValueError, match="num_layers_per_virtual_pipeline_stage 3"):
        virtual_pipeline_size(16, 4, num_layers_per_virtual_pipeline_stage=3)
    with pytest.raises(ValueError, match="only one of"):
        virtual_pipeline_size(
            16, 4, num_layers_per_virtual_pipeline_stage=2, virtual_pipeline_model_parallel_size=2
        )


def test_model_chunks_pre_and_post():
    split = stage_layers(8, 2, vp=2)
    assert model_chunks(split[0], 0, 2, 8) == [
        PipelineChunk(True, False, range(0, 2)),
        PipelineChunk(False, False, range(4, 6)),
    ]
    assert model_chunks(split[1], 1, 2, 8) == [
        PipelineChunk(False, False, range(2, 4)),
        PipelineChunk(False, True, range(6, 8)),
    ]
    with pytest.raises(ValueError, match="pipeline rank 2"):
        model_chunks(split[1], 2, 2, 8)
