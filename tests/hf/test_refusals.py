"""Architectures the importer does not implement are refused by name, tested on the configs
transformers' own classes write: Gemma 1/2/3 (every missing feature listed) and the RoPE
scaling types other than linear, llama3 and yarn (those map: test_import.py checks their
logits); --rope-scaling parses back what it prints; a RoPE-scaled model is not exported."""

import pytest

from megadlms.hf.importer import transformer_config_from_hf

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "cls,features",
    [
        ("GemmaConfig", ["(1 + weight)", "sqrt(hidden_size)", "GeGLU"]),
        (
            "Gemma2Config",
            [
                "(1 + weight)",
                "GeGLU",
                "attention logit soft-capping 50",
                "final logit soft-capping 30",
                "sliding-window",
                "four norms per layer",
            ],
        ),
        ("Gemma3TextConfig", ["(1 + weight)", "sqrt(hidden_size)", "sliding-window", "four norms per layer"]),
        ("Gemma3Config", ["(1 + weight)", "GeGLU", "four norms per layer"]),
    ],
)
def test_gemma_is_refused_naming_each_missing_feature(cls, features):
    hf = getattr(transformers, cls)().to_dict()
    with pytest.raises(ValueError, match=f"{hf['model_type']} cannot be mapped") as err:
        transformer_config_from_hf(hf)
    for feature in features:
        assert feature in str(err.value), feature


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0] * 4, "long_factor": [1.0] * 4},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "extra": 1.0},
    ],
)
def test_unimplemented_rope_scaling_is_refused_by_name(scaling):
    hf = {**transformers.Qwen2Config().to_dict(), "rope_scaling": scaling, "rope_parameters": None}
    with pytest.raises(ValueError, match=f"RoPE scaling '{scaling['rope_type']}' cannot be mapped"):
        transformer_config_from_hf(hf)


def test_rope_scaling_flag_round_trips_and_export_refuses_it(tmp_path):
    from megadlms.config.flags.model import rope_scaling_arg, rope_scaling_flag
    from megadlms.hf.export import export_hf
    from tests.hf.helpers import ROPE_SWIGLU, save_tiny, tiny_config

    hf = transformers.LlamaConfig(
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "truncate": False,
        }
    ).to_dict()
    cfg = transformer_config_from_hf(hf)
    assert cfg.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "truncate": False,
    }
    assert rope_scaling_arg(rope_scaling_flag(cfg.rope_scaling)) == cfg.rope_scaling
    save_tiny(
        tmp_path / "ck", tiny_config(**ROPE_SWIGLU, rope_scaling={"rope_type": "linear", "factor": 2.0})
    )
    with pytest.raises(ValueError, match="exporting a RoPE-scaled model"):
        export_hf(str(tmp_path / "ck"), str(tmp_path / "hf"))
