"""ONN's built-in byte tokenizer: 256 byte tokens plus <bos>, <eos>, <pad>.

It needs no download and round-trips any UTF-8 text exactly, which is what tiny offline models
(phi4_tiny, llama_tiny) need for tests and demos.
"""

from __future__ import annotations

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"


def byte_tokenizer():
    """A Hugging Face fast tokenizer over raw bytes (ids 0-255), then <bos>=256, <eos>=257, <pad>=258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # Order the vocabulary by byte value so that id == byte, which keeps ids readable.
    table = bytes_to_unicode()  # GPT-2's reversible byte -> printable-character table, the one ByteLevel uses
    vocab = {table[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    for i, special in enumerate((BOS, EOS, PAD)):
        vocab[special] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS, PAD])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
