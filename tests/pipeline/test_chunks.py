"""Model chunks: global layer names, init bitwise equal to the whole model, chunked forward."""

import pytest
import torch

from megadlms.models import GPTModel, PipelineChunk, TransformerConfig
from megadlms.parallel.sharding import ParamSharding, sharding_of
from megadlms.pipeline import model_chunks, stage_layers

V, S = 37, 10


def _config(**kw):
    base = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=V,
        seq_length=S,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _chunks(cfg, pp, vp=1, seed=0, **split_kw):
    split = stage_layers(cfg.num_layers, pp, vp=vp, **split_kw)
    out = []
    for r in range(pp):
        for c in model_chunks(split[r], r, pp, cfg.num_layers):
            torch.manual_seed(seed)  # every rank seeds the same way
            out.append(GPTModel(cfg, pipeline=c))
    return out


CONFIGS = {
    "tied_rope": {},
    "untied_learned": {
        "untie_embeddings_and_output_weights": True,
        "position_embedding_type": "learned_absolute",
    },
    "swiglu_bias_gqa": {
        "swiglu": True,
        "add_bias_linear": True,
        "num_query_groups": 2,
        "normalization": "RMSNorm",
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(
    "pp, vp, kw", [(2, 1, {}), (4, 1, {}), (2, 2, {}), (3, 1, {"first_stage_layers": 2})]
)
def test_chunk_params_are_the_whole_models(name, pp, vp, kw):
    cfg = _config(**CONFIGS[name])
    torch.manual_seed(0)
    whole = dict(GPTModel(cfg).named_parameters())
    union = {}
    for chunk in _chunks(cfg, pp, vp, **kw):
        for n, p in chunk.named_parameters():
            if sharding_of(p).tied_copy:
                assert n == "output_layer.weight" and chunk.pipeline.post_process
                assert torch.equal(p, whole["embedding.word_embeddings.weight"])
                continue
            assert n not in union, f"{n} in two chunks"
            union[n] = p
    assert sorted(union) == sorted(whole)
    for n, p in whole.items():
        assert torch.equal(union[n], p), n  # bitwise


def test_state_dict_keys_use_global_layer_numbers():
    cfg = _config()
    chunks = _chunks(cfg, 2, vp=2)  # rank 0: [0], [2]; rank 1: [1], [3]
    keys = [
        sorted({k.split(".")[2] for k in c.state_dict() if k.startswith("decoder.layers.")}) for c in chunks
    ]
    assert keys == [["0"], ["2"], ["1"], ["3"]]
    assert chunks[0].embedding is not None and chunks[0].output_layer is None
    assert chunks[1].embedding is None and chunks[1].decoder.final_layernorm is None
    assert sharding_of(chunks[3].output_layer.weight) == ParamSharding(tp_dim=0, tied_copy=True)
    assert chunks[3].decoder.layers[0] is chunks[3].decoder.layers.by_global(3)
    assert chunks[3].decoder.layers.global_indices == [3]


def test_whole_model_layers_still_index_like_a_list():
    cfg = _config()
    model = GPTModel(cfg)
    assert len(model.decoder.layers) == 4
    assert [layer.layer_number for layer in model.decoder.layers] == [1, 2, 3, 4]
    assert model.decoder.layers[-1].layer_number == 4
    assert [m.layer_number for m in model.decoder.layers[1:3]] == [2, 3]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chunked_forward_equals_whole(name):
    cfg = _config(**CONFIGS[name])
    torch.manual_seed(0)
    whole = GPTModel(cfg)
    ids = torch.randint(0, V, (2, S))
    pos = torch.arange(S).expand(2, S)
    chunks = _chunks(cfg, 2, vp=2)
    order = [chunks[0], chunks[2], chunks[1], chunks[3]]  # model order: (r0,v0), (r1,v0), (r0,v1), (r1,v1)
    h = order[0](ids, pos)
    for c in order[1:]:
        h = c(position_ids=pos, hidden_states=h)
    torch.testing.assert_close(h, whole(ids, pos), rtol=0, atol=0)


def test_chunk_input_errors():
    cfg = _config()
    first = GPTModel(cfg, pipeline=PipelineChunk(True, False, range(0, 2)))
    later = GPTModel(cfg, pipeline=PipelineChunk(False, True, range(2, 4)))
    with pytest.raises(ValueError, match="input_ids is required"):
        first(hidden_states=torch.zeros(1, S, 32))
    with pytest.raises(ValueError, match="hidden_states"):
        later(torch.zeros(1, S, dtype=torch.int64))
    with pytest.raises(ValueError, match="must start at layer 0"):
        GPTModel(cfg, pipeline=PipelineChunk(True, False, range(1, 2)))
    with pytest.raises(ValueError, match="must end at the last layer"):
        GPTModel(cfg, pipeline=PipelineChunk(False, True, range(1, 2)))
    with pytest.raises(ValueError, match="non-empty part"):
        GPTModel(cfg, pipeline=PipelineChunk(False, False, range(3, 6)))
