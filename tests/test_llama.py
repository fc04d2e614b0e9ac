"""The llama provider: equality with transformers' LlamaForCausalLM, RoPE and GQA,
tied embeddings, weights independent of the pipeline cut, Hugging Face interop
(config, names, safetensors checkpoints) and the FLOPs formula."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from spotline.config import load_spec
from spotline.config.model import LlamaModelSpec
from spotline.models import build_sequential, layer_param_counts, llama, model_def
from spotline.models import hf as hfmod
from spotline.models.decode import LayerKV, attend
from spotline.models.provider import residual_std
from spotline.planning.partition import stage_bounds

pytestmark = pytest.mark.unit

VOCAB = 101
SHAPE = dict(
    kind="llama",
    n_layers=2,
    d_model=64,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden=96,
    seq_len=16,
    rope_theta=500000.0,
    vocab_size=VOCAB,
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def job(**model):
    return load_spec(
        None,
        {
            "model": {**SHAPE, **model},
            "parallel.pipeline_stages": 1,
            "tokenizer": {"kind": "byte"},
        },
    )


def built(**model):
    spec = job(**model)
    md = model_def(spec)
    return spec, md, llama.tie(build_sequential(md))


def hf_model(spec, state, attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_dict(hfmod.hf_config(spec.model, spec.vocab_size()))
    cfg._attn_implementation = attn
    m = LlamaForCausalLM(cfg).eval()
    sd = hfmod.to_hf(state, spec.model)
    if spec.model.tie_embeddings:
        missing, unexpected = m.load_state_dict(sd, strict=False)
        assert (missing, unexpected) == (["lm_head.weight"], [])
        assert m.lm_head.weight is m.model.embed_tokens.weight
    else:
        m.load_state_dict(sd, strict=True)
    return m


def ids(t=16, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, t), generator=g)


# --- equality with transformers --------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(tied, attn):
    spec, _, model = built(tie_embeddings=tied)
    ref = hf_model(spec, model.state_dict(), attn)
    assert ref.config._attn_implementation == attn
    with torch.no_grad():
        for t in (16, 7):  # the full context and a shorter one: RoPE over 0..T-1
            x = ids(t)
            ours, theirs = model(x), ref(input_ids=x).logits
            assert ours.shape == (3, t, VOCAB)
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("shard", [None, 40_000])
def test_save_hf_from_pretrained_and_load_hf(tmp_path, tied, shard):
    from transformers import AutoModelForCausalLM

    spec, _, model = built(tie_embeddings=tied)
    state = model.state_dict()
    kw = {} if shard is None else {"max_shard_bytes": shard}
    hfmod.save_hf(tmp_path, spec.model, VOCAB, state, **kw)
    files = sorted(p.name for p in tmp_path.iterdir())
    if shard is None:
        assert files == ["config.json", "model.safetensors"]
    else:
        shards = [f for f in files if f.startswith("model-")]
        assert len(shards) > 1 and all(
            f.endswith(f"-of-{len(shards):05d}.safetensors") for f in shards
        )
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(shards)
        assert ("lm_head.weight" in index["weight_map"]) is not tied

    ref = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert ref.config.rope_parameters["rope_theta"] == 500000.0
    assert ref.config.num_key_value_heads == 2 and ref.config.tie_word_embeddings is tied
    with torch.no_grad():
        x = ids()
        torch.testing.assert_close(model(x), ref(input_ids=x).logits, atol=1e-5, rtol=1e-5)

    back = hfmod.load_hf(tmp_path, spec.model, VOCAB)
    assert list(back) == list(state)
    for name, t in state.items():
        assert torch.equal(back[name], t), name


@pytest.mark.parametrize("tied", [False, True])
def test_load_hf_reads_transformers_save_pretrained(tmp_path, tied):
    spec, _, model = built(tie_embeddings=tied)
    ref = hf_model(spec, model.state_dict())
    ref.save_pretrained(tmp_path / "one")
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    for where in ("one", "sharded"):
        back = hfmod.load_hf(tmp_path / where, spec.model, VOCAB)
        assert list(back) == list(model.state_dict())
        for name, t in model.state_dict().items():
            assert torch.equal(back[name], t), (where, name)


def test_load_hf_reads_no_pickles(tmp_path):
    spec = job().model
    (tmp_path / "config.json").write_text(json.dumps(hfmod.hf_config(spec, VOCAB)))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"no model\.safetensors.*pytorch_model\.bin"):
        hfmod.load_hf(tmp_path, spec, VOCAB)


def test_hf_config_loads_in_transformers():
    from transformers import LlamaConfig

    spec = job(norm_eps=1e-6, tie_embeddings=True).model
    raw = hfmod.hf_config(spec, VOCAB, bos_token_id=1, eos_token_id=[2, 3])
    cfg = LlamaConfig.from_dict(raw)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 96, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.rms_norm_eps) == (VOCAB, 16, 1e-6)
    assert cfg.tie_word_embeddings is True and cfg.bos_token_id == 1 and cfg.eos_token_id == [2, 3]
    assert cfg.hidden_act == "silu" and not cfg.attention_bias and not cfg.mlp_bias
    # transformers' own config.json of this shape passes the check, and so does ours.
    hfmod.check_hf_config(cfg.to_dict(), spec, VOCAB, "x")
    hfmod.check_hf_config(raw, spec, VOCAB, "x")


# --- RoPE and GQA --------------------------------------------------------------------


def test_rope():
    cos, sin = llama.rope_cos_sin(16, 8, 10000.0, torch.device("cpu"), torch.float32)
    assert cos.shape == sin.shape == (16, 8)
    assert torch.equal(cos[0], torch.ones(8)) and torch.equal(sin[0], torch.zeros(8))
    # HF's layout: the frequencies repeat over the two halves of the head.
    torch.testing.assert_close(cos[:, :4], cos[:, 4:])
    # theta^(-2i/hd) for i = 0..hd/2-1, at position 1.
    inv = 10000.0 ** (-torch.arange(0, 8, 2).float() / 8)
    torch.testing.assert_close(sin[1, :4], torch.sin(inv))
    # A rotation: norms are kept, and q.k depends only on the distance of the positions.
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, generator=g), torch.randn(8, generator=g)
    qs = llama.apply_rope(q.expand(16, 8), cos, sin)
    ks = llama.apply_rope(k.expand(16, 8), cos, sin)
    torch.testing.assert_close(qs.norm(dim=-1), q.norm().expand(16))
    torch.testing.assert_close(qs[5] @ ks[2], qs[13] @ ks[10], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(qs[5] @ ks[2], qs[5] @ ks[3])
    # No buffers at all (nothing for a cast to bf16 to degrade, nothing to materialise).
    _, md, _ = built()
    block = md.layers[1].build()
    assert list(block.buffers()) == []


def test_gqa_shapes_and_sharing():
    _, md, model = built()
    blk = model[1]
    d, hd, kv = 64, 16, 2
    assert blk.attn.q.weight.shape == (d, d) and blk.attn.o.weight.shape == (d, d)
    assert blk.attn.k.weight.shape == (kv * hd, d) == blk.attn.v.weight.shape
    assert blk.mlp.gate.weight.shape == (96, d) == blk.mlp.up.weight.shape
    assert blk.mlp.down.weight.shape == (d, 96)
    assert all(p.dim() != 1 or n.endswith("norm.weight") for n, p in model.named_parameters())
    x = torch.randn(2, 16, d)
    assert blk(x).shape == (2, 16, d)
    assert model[0](ids()).shape == (3, 16, d) and model(ids()).shape == (3, 16, VOCAB)

    # Query heads 0,1 read k/v head 0; heads 2,3 read k/v head 1 (HF's repeat_kv order).
    attn = blk.attn
    with torch.no_grad():
        attn.o.weight.copy_(torch.eye(d))  # see the per-head outputs
        before = attn(x)
        attn.v.weight[hd:].mul_(-3.0)  # change k/v head 1 only
        after = attn(x)
    per_head = (after - before).abs().reshape(2, 16, 4, hd).amax(dim=(0, 1, 3))
    assert per_head[:2].max() == 0 and per_head[2:].min() > 0
    # Two query heads of a group with equal q weights give equal outputs: shared k and v.
    with torch.no_grad():
        attn.q.weight[hd : 2 * hd].copy_(attn.q.weight[:hd])
        y = attn(x).reshape(2, 16, 4, hd)
    torch.testing.assert_close(y[:, :, 0], y[:, :, 1])


@pytest.mark.parametrize("t", [16, 5, 1])  # a whole sequence, a draft, one decoded token
def test_grouped_attention_equals_repeated_kv_heads(t):
    # attend reads each k/v head for its group of query heads in place; the reference
    # repeats the heads first (HF's repeat_kv order: query heads 2j, 2j+1 read head j).
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, t, 16, generator=g)
    k, v = (torch.randn(2, 2, 16, 16, generator=g) for _ in range(2))
    want = attend(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(attend(q, k, v), want, rtol=1e-5, atol=1e-5)


def test_gqa_attention_matches_the_repeated_heads_formula():
    # The Attention module, against the formula it replaced: k/v heads copied with
    # repeat_interleave, then plain causal SDPA; also through the KV cache.
    _, _, model = built()
    attn = model[1].attn
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(5))
    b, t, hd = 2, 16, 16
    with torch.no_grad():
        q = attn.q(x).view(b, t, 4, hd).transpose(1, 2)
        k = attn.k(x).view(b, t, 2, hd).transpose(1, 2)
        v = attn.v(x).view(b, t, 2, hd).transpose(1, 2)
        cos, sin = llama.rope_cos_sin(t, hd, attn.rope_theta, x.device, q.dtype)
        q, k = llama.apply_rope(q, cos, sin), llama.apply_rope(k, cos, sin)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        want = attn.o(y.transpose(1, 2).reshape(b, t, 64))
        torch.testing.assert_close(attn(x), want, rtol=1e-5, atol=1e-5)
        cache = LayerKV(16)
        parts = [attn(x[:, :9], cache, 0), attn(x[:, 9:10], cache, 9), attn(x[:, 10:], cache, 10)]
        torch.testing.assert_close(torch.cat(parts, dim=1), want, rtol=1e-5, atol=1e-5)
        assert cache._k.shape[1] == 2  # the cache holds the 2 k/v heads, not 4 copies


# --- tied embeddings ---------------------------------------------------------------


def test_tied_embeddings_share_one_parameter():
    spec, md, model = built(tie_embeddings=True)
    names = [n for n, _ in model.named_parameters()]
    assert "0.tok.weight" in names and not any(".lm." in n for n in names)
    assert list(model.state_dict()) == names
    assert len(list(model.parameters())) == len(names)
    head = model[-1]
    assert head.projection() is model[0].tok.weight
    assert llama.tie(model) is model and head.projection() is model[0].tok.weight  # idempotent
    # ZeRO-3 gathers the embedding's weight for the head's forward and backward too.
    assert list(dict(head.ds_external_parameters()).values()) == [model[0].tok.weight]
    # The head's gradient reaches the embedding's weight.
    model(ids()).sum().backward()
    g_tied = model[0].tok.weight.grad.clone()
    model.zero_grad()
    model[0](ids()).sum().backward()
    assert not torch.allclose(g_tied, model[0].tok.weight.grad)
    # The embedding counts once: the head holds only its norm.
    counts = layer_param_counts(md)
    assert counts[-1] == 64 and sum(counts) == sum(p.numel() for p in model.parameters())
    # build_sequential ties it (ModelDef.post_build); a head built on its own is unlinked
    # and refuses to run.
    assert build_sequential(md)[-1].projection() is not None
    lone = torch.nn.Sequential(*[ld.build() for ld in md.layers])
    with pytest.raises(RuntimeError, match=r"tie\(model\)"):
        lone(ids())
    # Tying needs the embedding in the same model.
    with pytest.raises(ValueError, match="pipeline_stages: 1"):
        llama.tie(torch.nn.Sequential(md.layers[-1].build()))
    # Untied models are left alone.
    _, _, untied = built()
    assert llama.tie(untied)[-1].projection() is untied[-1].lm.weight


def test_tie_refused_with_pipeline_stages():
    with pytest.raises(ValueError, match="tie_embeddings needs parallel.pipeline_stages: 1"):
        load_spec(None, {"model": {**SHAPE, "tie_embeddings": True}, "parallel.pipeline_stages": 2})


# --- init ----------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_init_does_not_depend_on_the_cut(tied):
    _, md, model = built(tie_embeddings=tied)
    whole = model.state_dict()
    torch.manual_seed(999)  # whatever the RNG was doing before
    for i in reversed(range(len(md.layers))):  # any order, one at a time
        layer = md.layers[i].build()
        for name, t in layer.state_dict().items():
            assert torch.equal(whole[f"{i}.{name}"], t), f"{i}.{name}"
    other = build_sequential(model_def(job(tie_embeddings=tied)))
    for name, t in other.state_dict().items():
        assert torch.equal(whole[name], t)
    reseeded = build_sequential(model_def(load_spec(None, {"model": SHAPE, "train.seed": 7})))
    assert not torch.equal(reseeded[1].attn.q.weight, model[1].attn.q.weight)
    assert stage_bounds(md, 2) == [0, 2, 4]


def test_init_statistics():
    spec = job(d_model=256, n_heads=4, n_kv_heads=4, ffn_hidden=512, n_layers=8)
    model = build_sequential(model_def(spec))
    blk = model[3]
    for lin in (blk.attn.q, blk.attn.k, blk.mlp.gate, blk.mlp.up, model[-1].lm, model[0].tok):
        assert abs(lin.weight.std().item() - 0.02) < 0.001
    for lin in (blk.attn.o, blk.mlp.down):
        assert abs(lin.weight.std().item() / residual_std(8) - 1) < 0.05
    for norm in (blk.attn_norm, blk.mlp_norm, model[-1].norm):
        assert torch.equal(norm.weight, torch.ones(256))
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())


def test_preset_parameter_count_on_meta():
    # Llama 3.2 1B, as Hugging Face counts it (tied): 1,235,814,400 parameters.
    spec = load_spec(None, {"model": {"kind": "llama", "preset": "llama-1b", "vocab_size": 128256}})
    assert sum(layer_param_counts(model_def(spec))) == 1_235_814_400


# --- HF config check and names ---------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, field",
    [
        ("num_hidden_layers", 3, "n_layers"),
        ("hidden_size", 128, "d_model"),
        ("num_attention_heads", 8, "n_heads"),
        ("num_key_value_heads", 4, "n_kv_heads"),
        ("intermediate_size", 128, "ffn_hidden"),
        ("vocab_size", 102, "vocab_size"),
        ("rms_norm_eps", 1e-6, "norm_eps"),
        ("tie_word_embeddings", True, "tie_embeddings"),
    ],
)
def test_check_hf_config_names_the_field(key, value, field):
    spec = job().model
    cfg = hfmod.hf_config(spec, VOCAB)
    cfg[key] = value
    with pytest.raises(ValueError) as e:
        hfmod.check_hf_config(cfg, spec, VOCAB, "/ckpt")
    msg = str(e.value)
    assert f"model.{field} (" in msg and f"{key} {json.dumps(value)} in /ckpt/config.json" in msg
    assert f"set model.{field}: {json.dumps(value)} or point model.init_from" in msg


def test_check_hf_config_rope():
    spec = job().model
    cfg = hfmod.hf_config(spec, VOCAB)
    hfmod.check_hf_config(cfg, spec, VOCAB, "d")
    theta = {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    with pytest.raises(
        ValueError, match=r"model.rope_theta \(500000.0\) disagrees with rope_theta"
    ):
        hfmod.check_hf_config(theta, spec, VOCAB, "d")
    legacy = {k: v for k, v in cfg.items() if k != "rope_parameters"}  # transformers 4 style
    hfmod.check_hf_config(legacy, spec, VOCAB, "d")
    with pytest.raises(ValueError, match="rope_theta"):  # absent: HF's default 10000
        hfmod.check_hf_config(
            {k: v for k, v in legacy.items() if k != "rope_theta"}, spec, VOCAB, "d"
        )
    scaled = {**legacy, "rope_scaling": {"rope_type": "llama3", "factor": 32.0}}
    with pytest.raises(
        ValueError, match=r"rope_scaling in d/config.json asks for rope_type 'llama3'"
    ):
        hfmod.check_hf_config(scaled, spec, VOCAB, "d")
    yarn = {**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0}}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        hfmod.check_hf_config(yarn, spec, VOCAB, "d")
    for bad, match in [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"head_dim": 32}, "head_dim"),
        ({"model_type": "mistral"}, "model_type"),
    ]:
        with pytest.raises(ValueError, match=match):
            hfmod.check_hf_config({**cfg, **bad}, spec, VOCAB, "d")


def test_names_refuse_missing_extra_and_wrong_shape():
    spec, _, model = built()
    state = model.state_dict()
    hf_state = hfmod.to_hf(state, spec.model)
    assert "lm_head.weight" in hf_state and "model.layers.1.mlp.down_proj.weight" in hf_state
    assert hf_state["model.layers.0.self_attn.k_proj.weight"] is state["1.attn.k.weight"]
    assert hfmod.from_hf(hf_state, spec.model) == state

    with pytest.raises(ValueError, match=r"tensor 2\.mlp\.up\.weight is missing"):
        hfmod.to_hf({k: v for k, v in state.items() if k != "2.mlp.up.weight"}, spec.model)
    with pytest.raises(ValueError, match=r"tensor 9\.extra\.weight is not part"):
        hfmod.to_hf({**state, "9.extra.weight": torch.zeros(1)}, spec.model)
    bad = {**state, "1.attn.v.weight": torch.zeros(64, 64)}
    with pytest.raises(ValueError, match=r"tensor 1\.attn\.v\.weight has shape \(64, 64\)"):
        hfmod.to_hf(bad, spec.model)
    with pytest.raises(ValueError, match=r"HF tensor model\.norm\.weight is missing"):
        hfmod.from_hf({k: v for k, v in hf_state.items() if k != "model.norm.weight"}, spec.model)
    with pytest.raises(ValueError, match=r"lm_head\.weight has shape"):
        hfmod.from_hf({**hf_state, "lm_head.weight": torch.zeros(100, 64)}, spec.model)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.up_proj\.weight is not part"):
        hfmod.from_hf({**hf_state, "model.layers.2.mlp.up_proj.weight": torch.zeros(1)}, spec.model)
    # Derived RoPE buffers of older checkpoints are dropped.
    inv = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}
    assert hfmod.from_hf({**hf_state, **inv}, spec.model) == state

    tspec, _, tied = built(tie_embeddings=True)
    tstate = tied.state_dict()
    thf = hfmod.to_hf(tstate, tspec.model)
    assert "lm_head.weight" not in thf
    same = {**thf, "lm_head.weight": thf["model.embed_tokens.weight"].clone()}
    assert hfmod.from_hf(same, tspec.model) == tstate
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        hfmod.from_hf({**thf, "lm_head.weight": torch.zeros(VOCAB, 64)}, tspec.model)


def test_load_hf_checks_config_first(tmp_path):
    spec, _, model = built()
    hfmod.save_hf(tmp_path, spec.model, VOCAB, model.state_dict())
    other = LlamaModelSpec(**{**SHAPE, "d_model": 128})
    with pytest.raises(
        ValueError, match=rf"model.d_model \(128\) disagrees with hidden_size 64 in {tmp_path}"
    ):
        hfmod.load_hf(tmp_path, other, VOCAB)


# --- FLOPs ---------------------------------------------------------------------------


def test_flops_per_token_by_hand():
    spec = job().model
    # L=2, d=64, hd=16, kv=2, ffn=96, V=101, T=16:
    # N = 2*(2*64*64 + 2*64*32 + 3*64*96) + 64*101 = 67904; 6N + 12*2*16*64 = 432000.
    assert llama.flops_per_token(spec, VOCAB) == 432000.0
    assert model_def(job()).flops_per_token == 432000.0
    assert model_def(job(tie_embeddings=True)).flops_per_token == 432000.0


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_matches_flop_counter(tied):
    spec, md, model = built(tie_embeddings=tied)
    b, t = 2, spec.model.seq_len
    x, y = ids(t, b), ids(t, b, seed=1)
    attention = 12 * 2 * t * 64  # 12 L T d

    # The math SDPA path is plain bmm's, which FlopCounterMode counts: exact.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        md.loss(model(x), y).backward()
    assert fc.get_total_flops() == md.flops_per_token * b * t

    # CPU's fused SDPA kernel has no FLOP formula in FlopCounterMode: it counts the
    # matmuls only, exactly 12LTd per token short (or everything, where it has one).
    model.zero_grad()
    with FlopCounterMode(display=False) as fc:
        md.loss(model(x), y).backward()
    assert fc.get_total_flops() in (
        md.flops_per_token * b * t,
        (md.flops_per_token - attention) * b * t,
    )


# --- provider ------------------------------------------------------------------------


def test_provider():
    spec, md, model = built()
    assert llama.PROVIDER.hf is hfmod
    assert llama.PROVIDER.config_model is LlamaModelSpec
    assert md.n_blocks == 2 and md.block_class is llama.Block
    assert (md.vocab_size, md.seq_len) == (VOCAB, 16)
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["0.tok.weight", "1.attn_norm.weight"] and names[-1] == "3.lm.weight"
    assert "1.attn.q.weight" in names and "2.mlp.down.weight" in names
    assert sum(layer_param_counts(md)) == sum(p.numel() for p in model.parameters())
    loss = md.loss(model(ids()), ids(seed=1))
    assert loss.dim() == 0 and abs(loss.item() - torch.log(torch.tensor(VOCAB)).item()) < 0.1
    # The byte tokenizer's 256 when no vocab_size is given.
    spec256 = load_spec(None, {"model": {k: v for k, v in SHAPE.items() if k != "vocab_size"}})
    assert model_def(spec256).vocab_size == 256
