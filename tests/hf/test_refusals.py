"""Architectures the importer does not implement are refused by name, tested on the configs
transformers' own classes write: Gemma 1/2/3 (every missing feature listed) and the RoPE
scaling variants (llama3, yarn, linear)."""

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
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {"rope_type": "linear", "factor": 2.0},
    ],
)
def test_rope_scaling_variants_are_refused_by_name(scaling):
    for hf in (
        transformers.LlamaConfig(rope_scaling=dict(scaling)).to_dict(),
        {**transformers.Qwen2Config().to_dict(), "rope_scaling": dict(scaling), "rope_parameters": None},
    ):
        with pytest.raises(ValueError, match=f"RoPE scaling '{scaling['rope_type']}' cannot be mapped"):
            transformer_config_from_hf(hf)
