"""The planner's KV cache of an encoder-decoder (T5, BART) against what transformers caches while generating, and the
spec cache measured again when a folder's tokenizer gains tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import compose
from test_planning_review5 import spec_of

from onn.models.tokenizer import byte_tokenizer
from onn.planning.costs import kv_cache_elements
from onn.planning.spec import model_spec

PROMPT, NEW = 11, 7  # the encoder's input and the tokens generated
# decoders whose layers are not the LayerMap's blocks: T5's are its two stacks (encoder and decoder), BART's its
# encoder's 4 layers, deeper than the decoder's 2 (as distil-whisper's 32 and 2); the decoder's heads other than the
# encoder's (BART), and T5's d_kv (12) other than d_model / heads (8)
SEQ2SEQ = {
    "t5": dict(
        model_type="t5",
        architectures=["T5ForConditionalGeneration"],
        vocab_size=64,
        d_model=32,
        d_kv=12,
        d_ff=48,
        num_layers=4,
        num_decoder_layers=3,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    ),
    "bart": dict(
        model_type="bart",
        architectures=["BartForConditionalGeneration"],
        vocab_size=64,
        d_model=32,
        encoder_layers=4,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        max_position_embeddings=64,
    ),
}


def generated_cache_bytes(architecture: dict) -> int:
    """Bytes of the self- and cross-attention caches the real model holds after generating NEW tokens for a prompt
    of PROMPT tokens (random weights, fp32)."""
    import transformers as tf

    torch.manual_seed(0)
    values = {k: v for k, v in architecture.items() if k != "model_type"}
    model = tf.AutoModelForSeq2SeqLM.from_config(tf.AutoConfig.for_model(architecture["model_type"], **values)).eval()
    prompt = torch.randint(2, 64, (1, PROMPT))
    with torch.no_grad():
        out = model.generate(
            prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, return_dict_in_generate=True
        )
    cache = out.past_key_values
    layers = [*cache.self_attention_cache.layers, *cache.cross_attention_cache.layers]
    assert cache.self_attention_cache.get_seq_length() == NEW
    # (T5's cache makes a layer for each encoder layer too: those past the decoder's stay empty)
    return sum(t.nbytes for layer in layers for t in (layer.keys, layer.values) if t is not None)


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_an_encoder_decoders_planned_kv_cache_is_what_it_caches_generating(name):
    """Each decoder layer caches its self-attention over the generated tokens and its cross-attention over the
    prompt (the encoder's input), with the decoder's heads (BART: 4, not the encoder's 2) and T5's d_kv. The plan
    counted a cache in each of the LayerMap's blocks: T5's 2 stacks for its 3 decoder layers, BART's 4 encoder
    layers for its 2 decoder layers."""
    spec = spec_of(SEQ2SEQ[name])
    assert spec.n_blocks == {"t5": 3, "bart": 4}[name]  # T5: its decoder's layers (no longer its 2 stacks)
    planned = kv_cache_elements(spec, PROMPT, NEW) * 4
    assert planned == pytest.approx(generated_cache_bytes(SEQ2SEQ[name]), rel=0.02)


def test_a_cached_spec_is_measured_again_when_the_folders_tokenizer_gains_tokens(tmp_path):
    """A folder's own tokenizer that outgrows model.architecture's 320 rows resizes the planned embeddings; a spec
    cached before tokens were added to it was reused, with the rows, parameters and logits of before."""
    folder, cache = tmp_path / "model", str(tmp_path / "cache")
    tokenizer = byte_tokenizer()  # ids 0-258: within the architecture's 320 rows
    tokenizer.save_pretrained(folder)
    model_cfg = replace(compose("model=llama_tiny").model, source=str(folder), tokenizer=None)
    before = model_spec(model_cfg, 8, cache_dir=cache)
    assert before.vocab == 320
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(70)])  # ids up to 328
    tokenizer.save_pretrained(folder)
    after = model_spec(model_cfg, 8, cache_dir=cache)
    assert after.vocab == 329 and after.params == before.params + 9 * 2 * 64  # embedding and head rows
