"""GPTModel against an independent hand-written forward, attention masks, tying, GQA, init."""

import math

import pytest
import torch

from megadlms.models import GPTModel, TransformerConfig

V, S = 37, 12


def _config(**kw):
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=V,
        seq_length=S,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=torch.float64,
    )
    base.update(kw)
    return TransformerConfig(**base)


# ---------------------------------------------------------------- independent reference
def _norm(x, sd, prefix, c):
    w = sd[prefix + ".weight"]
    if c.normalization == "RMSNorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.norm_epsilon) * w
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + c.norm_epsilon) * w + sd[prefix + ".bias"]


def _lin(x, sd, prefix):
    y = x @ sd[prefix + ".weight"].T
    return y + sd[prefix + ".bias"] if prefix + ".bias" in sd else y


def _rope_complex(x, pos, base):
    # x [S, heads, D]; pair (i, i + D/2) as a complex number rotated by pos * base^(-2i/D)
    D = x.shape[-1]
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = pos[:, None, None].double() * theta
    z = torch.complex(x[..., : D // 2], x[..., D // 2 :]) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1)


def reference_forward(model, ids, causal):
    """Per-sequence loops, explicit softmax, weights read by name from the state dict."""
    c = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    N, G, D = c.num_attention_heads, c.num_query_groups, c.kv_channels
    out = []
    for row in ids:
        pos = torch.arange(row.shape[0])
        x = sd["embedding.word_embeddings.weight"][row]
        if c.position_embedding_type == "learned_absolute":
            x = x + sd["embedding.position_embeddings.weight"][pos]
        for i in range(c.num_layers):
            p = f"decoder.layers.{i}."
            h = _norm(x, sd, p + "input_layernorm", c)
            qkv = _lin(h, sd, p + "self_attention.linear_qkv")
            per = N // G
            qs, ks, vs = [], [], []
            for g in range(G):  # Megatron layout: [q_g0 .. q_g(per-1), k_g, v_g] per group
                blk = qkv[:, g * (per + 2) * D : (g + 1) * (per + 2) * D]
                for j in range(per):
                    qs.append(blk[:, j * D : (j + 1) * D])
                ks.append(blk[:, per * D : (per + 1) * D])
                vs.append(blk[:, (per + 1) * D : (per + 2) * D])
            q, k, v = torch.stack(qs, 1), torch.stack(ks, 1), torch.stack(vs, 1)
            if c.qk_layernorm:
                q = _norm(q, sd, p + "self_attention.q_layernorm", c)
                k = _norm(k, sd, p + "self_attention.k_layernorm", c)
            if c.position_embedding_type == "rope":
                q, k = _rope_complex(q, pos, c.rotary_base), _rope_complex(k, pos, c.rotary_base)
            heads = []
            for n in range(N):
                scores = q[:, n] @ k[:, n // per].T / math.sqrt(D)
                if causal:
                    scores = scores.masked_fill(torch.ones_like(scores).triu(1).bool(), float("-inf"))
                w = scores.exp() / scores.exp().sum(-1, keepdim=True)
                heads.append(w @ v[:, n // per])
            x = x + _lin(torch.cat(heads, -1), sd, p + "self_attention.linear_proj")
            h = _lin(_norm(x, sd, p + "pre_mlp_layernorm", c), sd, p + "mlp.linear_fc1")
            if c.swiglu:
                a, b = h[:, : c.ffn_hidden_size], h[:, c.ffn_hidden_size :]
                h = a * torch.sigmoid(a) * b
            else:
                h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
            x = x + _lin(h, sd, p + "mlp.linear_fc2")
        x = _norm(x, sd, "decoder.final_layernorm", c)
        w_out = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
        out.append(x @ w_out.T)
    return torch.stack(out)


CONFIGS = {
    "rope_gqa_swiglu_rms_qkln_untied": dict(
        position_embedding_type="rope",
        num_query_groups=2,
        swiglu=True,
        normalization="RMSNorm",
        qk_layernorm=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    ),
    "learned_gelu_layernorm_bias_tied": dict(position_embedding_type="learned_absolute"),
    "rope_mqa_causal": dict(position_embedding_type="rope", num_query_groups=1, rotary_base=500),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_hand_written_reference(name):
    torch.manual_seed(0)
    model = GPTModel(_config(**CONFIGS[name]), attention="causal" if "causal" in name else "bidirectional")
    # perturb norms and biases away from (1, 0) so they are really exercised
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, V, (2, S))
    got = model(ids)
    want = reference_forward(model, ids, causal="causal" in name)
    assert got.dtype == torch.float64 and got.shape == (2, S, V)
    # float64 weights; RoPE angles are computed in fp32 (as Megatron), hence 1e-6 not 1e-12
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_bidirectional_sees_future_causal_does_not():
    torch.manual_seed(1)
    ids = torch.randint(0, V, (1, S))
    perturbed = ids.clone()
    perturbed[0, -1] = (ids[0, -1] + 1) % V
    for attention in ("bidirectional", "causal"):
        torch.manual_seed(2)
        model = GPTModel(_config(position_embedding_type="rope"), attention=attention)
        a, b = model(ids), model(perturbed)
        diff_before_last = (a[0, :-1] - b[0, :-1]).abs().max().item()
        if attention == "bidirectional":
            assert diff_before_last > 1e-4  # every earlier position saw the change
            assert ((a[0, :-1] - b[0, :-1]).abs().amax(-1) > 1e-6).all()
        else:
            assert diff_before_last < 1e-12
        assert (a[0, -1] - b[0, -1]).abs().max().item() > 1e-4


def test_tied_and_untied_output():
    tied = GPTModel(_config())
    assert tied.output_layer.weight is None
    assert "output_layer.weight" not in tied.state_dict()
    untied = GPTModel(_config(untie_embeddings_and_output_weights=True))
    assert untied.output_layer.weight is not untied.embedding.word_embeddings.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == V * 32
    # tied: the embedding matrix gets gradient from both its uses
    ids = torch.randint(0, V, (2, S))
    tied(ids).sum().backward()
    g_full = tied.embedding.word_embeddings.weight.grad.clone()
    unused = sorted(set(range(V)) - set(ids.flatten().tolist()))
    assert unused and g_full[unused].abs().sum() > 0  # only the output use reaches unused rows


def test_gqa_shapes_and_mha_equivalence():
    c = _config(num_attention_heads=8, num_query_groups=2, position_embedding_type="rope")
    model = GPTModel(c)
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.shape == (2 * (8 // 2 + 2) * 4, 32)
    # GQA equals MHA whose kv heads are copies: build MHA weights by repeating each group's k/v
    mha = GPTModel(_config(num_attention_heads=8, position_embedding_type="rope"))
    sd = dict(model.state_dict())
    D, per = 4, 4
    for i in range(2):
        key = f"decoder.layers.{i}.self_attention.linear_qkv"
        w, bias = sd[key + ".weight"], sd[key + ".bias"]
        new_w, new_b = [], []
        for g in range(2):
            blk = slice(g * (per + 2) * D, (g + 1) * (per + 2) * D)
            wg, bg = w[blk], bias[blk]
            for j in range(per):  # each MHA group: one q head then the copied k, v
                new_w += [wg[j * D : (j + 1) * D], wg[per * D : (per + 2) * D]]
                new_b += [bg[j * D : (j + 1) * D], bg[per * D : (per + 2) * D]]
        sd[key + ".weight"], sd[key + ".bias"] = torch.cat(new_w), torch.cat(new_b)
    mha.load_state_dict(sd)
    ids = torch.randint(0, V, (2, S))
    torch.testing.assert_close(model(ids), mha(ids), rtol=1e-10, atol=1e-10)


def test_init_megatron_scaled_and_no_rotary_state():
    c = TransformerConfig(
        num_layers=8,
        hidden_size=256,
        num_attention_heads=4,
        vocab_size=512,
        seq_length=16,
        position_embedding_type="rope",
        init_method_std=0.02,
    )
    model = GPTModel(c)
    layer = model.decoder.layers[0]
    assert abs(layer.self_attention.linear_qkv.weight.std().item() - 0.02) < 1e-3
    scaled = 0.02 / math.sqrt(16)
    assert abs(layer.self_attention.linear_proj.weight.std().item() - scaled) < 2e-4
    assert abs(layer.mlp.linear_fc2.weight.std().item() - scaled) < 2e-4
    assert abs(model.embedding.word_embeddings.weight.std().item() - 0.02) < 1e-3
    assert layer.self_attention.linear_qkv.bias.abs().max() == 0
    assert not any("rotary" in k for k in model.state_dict())
    assert list(model.rotary_pos_emb.parameters()) == []


def test_params_dtype_and_forward_dtype():
    model = GPTModel(_config(params_dtype=torch.bfloat16, position_embedding_type="rope"))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model(torch.randint(0, V, (1, S))).dtype == torch.bfloat16


def test_config_errors_name_the_flags():
    with pytest.raises(ValueError, match="seq_length.*max_position_embeddings"):
        TransformerConfig(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=2,
            vocab_size=5,
            seq_length=64,
            max_position_embeddings=32,
        )
    with pytest.raises(ValueError, match="num_query_groups"):
        TransformerConfig(
            num_layers=1,
            hidden_size=12,
            num_attention_heads=6,
            vocab_size=5,
            seq_length=4,
            num_query_groups=4,
        )
    with pytest.raises(ValueError, match="normalization"):
        TransformerConfig(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=2,
            vocab_size=5,
            seq_length=4,
            normalization="BatchNorm",
        )
    c = TransformerConfig(
        num_layers=1, hidden_size=96, num_attention_heads=2, vocab_size=5, seq_length=4, swiglu=True
    )
    assert c.ffn_hidden_size == 256 and c.num_query_groups == 2 and c.kv_channels == 48
    assert (
        TransformerConfig(
            num_layers=1, hidden_size=96, num_attention_heads=2, vocab_size=5, seq_length=4
        ).ffn_hidden_size
        == 384
    )
    model = GPTModel(_config())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, S + 1, dtype=torch.int64))
