"""LayerMap discovery on real architectures, with no model names in the code."""

import pytest
import torch
from torch import nn

from onn.errors import UserError
from onn.models.layers import discover, gated_mlps, resolve_indices


def _hf(model_type, **kw):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **kw)
    cls = AutoModel if model_type == "bert" else AutoModelForCausalLM
    with torch.device("meta"):
        return cls.from_config(cfg)


@pytest.mark.parametrize(
    "model_type,kw,blocks_path,n,prefix,suffix,gated",
    [
        (
            "phi3",
            dict(
                vocab_size=64,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=5,
                num_attention_heads=4,
                num_key_value_heads=2,
            ),
            "model.layers",
            5,
            ["model.embed_tokens"],
            ["model.norm", "lm_head"],
            (64, 64),  # one fused gate_up_proj: the gate's rows first, the up projection's after
        ),
        (
            "llama",
            dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4),
            "model.layers",
            3,
            ["model.embed_tokens"],
            ["model.norm", "lm_head"],
            (0, 64),
        ),
        # GPT-2's wte/wpe are a same-typed pair too, with more parameters than these tiny blocks:
        # composite blocks must still win.
        (
            "gpt2",
            dict(vocab_size=5000, n_embd=16, n_layer=2, n_head=2),
            "transformer.h",
            2,
            ["transformer.wte", "transformer.wpe"],
            ["transformer.ln_f", "lm_head"],
            None,  # an ungated MLP (c_fc, c_proj)
        ),
        (
            "bert",
            dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4),
            "encoder.layer",
            4,
            ["embeddings"],
            ["pooler"],
            None,
        ),
    ],
)
def test_transformers(model_type, kw, blocks_path, n, prefix, suffix, gated):
    lmap = discover(_hf(model_type, **kw))
    assert lmap.blocks_path == blocks_path and len(lmap) == n
    assert [name for name, _ in lmap.prefix if any(True for _ in _.parameters())] == prefix
    assert [name for name, _ in lmap.suffix if any(True for _ in _.parameters())] == suffix
    mlps = gated_mlps(lmap.blocks[0])  # what layer streaming may compute a slice at a time
    assert [(m.up_row, m.intermediate) for m in mlps] == ([gated] if gated else [])


def test_a_module_named_as_a_gated_mlp_but_computing_more_is_not_one():
    """gated_mlps goes by what a forward computes (transformers' Llama and Phi-3 MLP bytecode), not by names:
    an MLP with the same attributes that scales its features is left whole."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    class ScaledMLP(LlamaMLP):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)

    config = LlamaConfig(hidden_size=32, intermediate_size=64)
    assert len(gated_mlps(LlamaMLP(config))) == 1 and gated_mlps(ScaledMLP(config)) == []


def test_resnet_stages():
    from torchvision.models import resnet18

    lmap = discover(resnet18(num_classes=10))
    assert lmap.blocks_path == "" and lmap.block_names == ["layer1", "layer2", "layer3", "layer4"]
    assert [n for n, _ in lmap.prefix] == ["conv1", "bn1", "relu", "maxpool"]
    assert [n for n, _ in lmap.suffix] == ["avgpool", "fc"]


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))

    def forward(self, x):
        return x + self.ff(x)


def test_user_sequential_and_exact_params():
    model = nn.Sequential(nn.Embedding(10, 8), Block(8), Block(8), Block(8), nn.LayerNorm(8), nn.Linear(8, 10))
    lmap = discover(model)
    assert (
        lmap.block_names == ["1", "2", "3"]
        and [n for n, _ in lmap.prefix] == ["0"]
        and [n for n, _ in lmap.suffix] == ["4", "5"]
    )
    total = sum(p.numel() for p in model.parameters())
    assert lmap.prefix_params() + sum(lmap.block_params()) + lmap.suffix_params() == total
    x = torch.tensor([[1, 2, 3]])
    h = x
    for _, m in lmap.prefix:
        h = m(h)
    for b in lmap.blocks:
        h = b(h)
    for _, m in lmap.suffix:
        h = m(h)
    assert torch.equal(h, model(x))  # the map is the model's execution order


def test_a_list_of_one_block_is_a_one_layer_stack():
    """A one-layer model's blocks are its list of one block, not a pair of leaf layers inside or beside it (GPT-2's
    wte/wpe embeddings, a block's two linears); a run of two or more blocks elsewhere still comes first."""
    gpt2 = _hf("gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=64)
    lmap = discover(gpt2)
    assert lmap.block_paths == ["transformer.h.0"] and [n for n, _ in lmap.suffix] == ["transformer.ln_f", "lm_head"]
    model = nn.Module()
    model.stack = nn.ModuleList([Block(64)])  # the most weights, yet one block
    model.towers = nn.Sequential(Block(4), Block(4))
    assert discover(model).block_paths == ["towers.0", "towers.1"]
    lstms = nn.Module()  # leaf RNNs are never blocks: each returns (output, state)
    lstms.forward_rnn, lstms.backward_rnn = nn.LSTM(4, 4), nn.LSTM(4, 4)
    with pytest.raises(UserError, match="no repeated blocks"):
        discover(lstms)


def test_override_and_errors():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(UserError, match="no repeated blocks"):
        discover(model)
    lmap = discover(nn.ModuleDict({"stack": nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])}), blocks_path="stack")
    assert len(lmap) == 2
    with pytest.raises(UserError, match="not a submodule"):
        discover(model, blocks_path="nope")
    assert resolve_indices([0, 1, -1, -2], 10) == [0, 1, 8, 9]
    with pytest.raises(UserError, match="out of range"):
        resolve_indices([12], 10)
