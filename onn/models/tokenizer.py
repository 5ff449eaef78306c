"""ONN's built-in tokenizers, which need no download: what tiny offline models need for tests and demos.

byte       256 byte tokens plus <bos>, <eos>, <pad>; round-trips any UTF-8 text exactly (phi4_tiny, llama_tiny)
wordpiece  BERT's uncased WordPiece over letters, digits and punctuation, with BERT's ids for [PAD], [UNK],
           [CLS], [SEP], [MASK], "." and "?" (Grounding DINO reads phrases between those ids)
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


BERT_IDS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103, ".": 1012, "?": 1029}


def wordpiece_tokenizer():
    """A BERT-style fast tokenizer (lower case, [CLS] text [SEP]) whose words are spelt letter by letter:
    `a`, `##b`, ... Its special tokens and the phrase delimiters "." and "?" have bert-base-uncased's ids."""
    import string

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = dict(BERT_IDS)
    free = (i for i in range(104, 2**16) if i not in vocab.values())
    symbols = [c for c in string.ascii_lowercase + string.digits + string.punctuation if c not in vocab]
    for piece in symbols + ["##" + c for c in string.ascii_lowercase + string.digits]:
        vocab[piece] = next(free)
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 102), ("[CLS]", 101))
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
