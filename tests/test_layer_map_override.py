"""model.layer_map.blocks names the blocks for every user of the LayerMap: the streaming engine streams them (under
peft's wrapper too), the layer store's folder key changes with it, and the .omny cut points fall between them."""

import copy
import dataclasses

import torch
from torch import nn

from onn.config.model import LanguageModelConfig, LayerMapOverride
from onn.export.model_facts import kv_cache_bytes, omny_runs
from onn.models.layers import discover
from onn.models.load import model_fingerprint
from onn.streaming.strategy import EngineSettings, build_engine, layer_store

BLOCKS = "model.model.layers"  # what a user sets model.layer_map.blocks to
LLAMA = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
)


class WrappedForCausalLM(nn.Module):
    """A Llama inside a wrapper with a run of two big unused MLPs beside it, which discovery takes for the blocks
    (they hold more weights than the four decoder layers): the case model.layer_map.blocks is for."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(**LLAMA))
        self.config = self.model.config
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 32)) for _ in range(2))

    def forward(self, **batch):
        return self.model(**batch)


def adapted(model: nn.Module) -> nn.Module:
    """LoRA on the override's blocks, as apply puts it (random A and B: every adapter gets a gradient)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(model, config).float()


def micro_batches(m: int = 2, b: int = 2, t: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(m):
        ids = torch.randint(3, 97, (b, t), generator=g)
        labels = ids.clone()
        labels[:, : t // 2] = -100
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


def test_discovery_alone_picks_another_list():
    """The premise: without the override the wrapper's blocks are the unused MLPs."""
    model = WrappedForCausalLM()
    assert discover(model).blocks_path == "heads"
    assert discover(model, BLOCKS).blocks == list(model.model.model.layers)


def test_the_engine_streams_the_overrides_blocks_and_trains_as_the_resident_model(tmp_path):
    resident = adapted(WrappedForCausalLM())
    streamed = copy.deepcopy(resident)
    settings = EngineSettings(
        chunk_size=2,
        store="cpu",
        store_dtype="float32",
        edges="resident",
        activations="device",
        cache_blocks=0,
        eval_tokens=64,
        blocks_path=BLOCKS,
    )
    engine = build_engine(streamed, settings, layer_store(settings, tmp_path), "cpu", micro_batch=None)
    # the path named in the model as loaded, found under peft's wrapper at its own path (through the wrapper's
    # attribute forwarding `model` is the wrapped model itself, where model.model.layers names nothing)
    assert engine.map.blocks == list(streamed.get_base_model().model.model.layers)
    assert engine.map.blocks_path == f"base_model.model.{BLOCKS}"
    # (by a path the forwarding resolved, the prefix was peft's whole base_model, the blocks inside it)
    assert [n for n, _ in engine.map.prefix] == [
        f"base_model.model.model.model.{n}" for n in ("embed_tokens", "rotary_emb")
    ]
    mbs = micro_batches()
    losses = []
    for mb in mbs:
        loss = resident(**mb).loss
        (loss / len(mbs)).backward()
        losses.append(loss.detach())
    loss = engine.train_step(mbs)
    engine.close()
    torch.testing.assert_close(loss, torch.stack(losses).mean(), rtol=1e-4, atol=1e-6)
    want = {n: p.grad for n, p in resident.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in streamed.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys() and len(want) == 3 * 4 * 2  # q, v, down: A and B in each of the 4 blocks
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_store_key_changes_with_the_override_and_stays_without_it():
    unset = LanguageModelConfig(
        name="x",
        source="random",
        tokenizer="byte",
        dtype="float32",
        trust_remote_code=False,
        layer_map=LayerMapOverride(blocks=None),
        architecture={"model_type": "llama"},
    )
    named = dataclasses.replace(unset, layer_map=LayerMapOverride(blocks=BLOCKS))
    other = dataclasses.replace(unset, layer_map=LayerMapOverride(blocks="model.model"))
    assert model_fingerprint(unset) == "932ece35bd7cf2e2"  # the folder this model's stores had before the override
    assert len({model_fingerprint(unset), model_fingerprint(named), model_fingerprint(other)}) == 3


def test_the_omny_cut_points_and_kv_cache_follow_the_override():
    model = WrappedForCausalLM()
    paths = [f"{BLOCKS}.{i}" for i in range(4)]
    assert omny_runs(model, BLOCKS)[0] == paths
    assert list(kv_cache_bytes(model, BLOCKS)) == paths
    assert omny_runs(model)[0] == ["heads.0", "heads.1"]  # (discovery's own, without it)
