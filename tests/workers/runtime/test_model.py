import math

import pytest
import torch

from trainyard.mesh import param_count
from trainyard.spec import ModelSpec
from workers.runtime.model import build_model, lm_loss


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_logits_shape_and_initial_loss_near_uniform(kind):
    cfg = ModelSpec(kind=kind, layers=2, hidden=32, heads=4, seq_len=16, vocab=256)
    torch.manual_seed(0)
    model = build_model(cfg)
    idx = torch.randint(0, 256, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 256)
    # small init => near-uniform predictions => loss ~ ln(vocab)
    assert abs(lm_loss(logits, torch.randint(0, 256, (3, 16))).item() - math.log(256)) < 0.1


def test_gpt_is_causal_and_mlp_is_per_position():
    torch.manual_seed(0)
    for kind in ("gpt", "mlp"):
        model = build_model(ModelSpec(kind=kind, layers=2, hidden=32, heads=4, seq_len=16, vocab=64))
        a = torch.randint(0, 64, (1, 16))
        b = a.clone()
        b[0, 10] = (a[0, 10] + 1) % 64  # change one later token
        la, lb = model(a), model(b)
        assert torch.allclose(la[:, :10], lb[:, :10], atol=1e-6), kind  # earlier positions unaffected
        assert not torch.allclose(la[:, 10], lb[:, 10]), kind


def test_same_seed_same_weights_and_too_long_sequence_rejected():
    cfg = ModelSpec(layers=1, hidden=32, heads=2, seq_len=8, vocab=256)
    torch.manual_seed(3)
    a = build_model(cfg)
    torch.manual_seed(3)
    b = build_model(cfg)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError, match="exceeds model.seq_len=8"):
        a(torch.zeros(1, 9, dtype=torch.long))


def test_attention_has_separate_q_k_v_with_the_fused_layouts_size_and_init():
    # tensor parallelism splits q, k and v by output columns (sharded.py), so they are three
    # Linears; together exactly a fused hidden -> 3 x hidden Linear: 3C^2 + 3C parameters
    c, layers = 64, 2
    torch.manual_seed(0)
    model = build_model(ModelSpec(layers=layers, hidden=c, heads=4, seq_len=16, vocab=256))
    attn = model.blocks[0].attn
    qkv = [attn.q, attn.k, attn.v]
    assert sum(p.numel() for m in qkv for p in m.parameters()) == 3 * c * c + 3 * c
    assert sum(p.numel() for p in attn.parameters()) == 4 * c * c + 4 * c  # + proj
    for m in qkv:
        assert m.weight.std().item() == pytest.approx(0.02, rel=0.1) and not m.bias.any()
    # GPT-2's residual projections: std 0.02 / sqrt(2 x layers)
    assert attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * layers), rel=0.1)


@pytest.mark.parametrize("shape", [
    {},  # the demo GPT: 875,264
    {"kind": "mlp"},
    {"layers": 3, "hidden": 48, "heads": 6, "seq_len": 17, "vocab": 301},
    {"kind": "mlp", "layers": 5, "hidden": 40, "vocab": 97},
])
def test_mesh_param_count_is_the_built_models_parameter_count(shape):
    cfg = ModelSpec(**shape)
    built = sum(p.numel() for p in build_model(cfg).parameters())
    assert param_count(cfg.kind, layers=cfg.layers, hidden=cfg.hidden, seq_len=cfg.seq_len,
                       vocab=cfg.vocab) == built
