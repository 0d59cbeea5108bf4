"""The project's shared tokenizer: a small word-level vocabulary with one token per digit.

Built with the `tokenizers` library from the task's word list, deterministic, saved with the run
(`tokenizer/` in the output folder, loadable with `AutoTokenizer`). Spaces and newlines are tokens
of their own and the decoder fuses tokens back without separators, so decode(encode(s)) == s for
any text over the vocabulary; digits are single tokens, so every number is writable.
"""

from __future__ import annotations

import hashlib
import json
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Words, single digits, single whitespace characters, runs of '#', any other single character.
_PIECE = r"[A-Za-z]+|\d|\s|#+|[^\sA-Za-z\d#]"


def build_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `words`, digits, ASCII punctuation, space and newline."""
    symbols = list(string.digits) + [c for c in string.punctuation if c != "#"] + [" ", "\n"]
    vocab: dict[str, int] = {}
    for token in [PAD, EOS, UNK] + symbols + sorted(set(words)):
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )


def vocab_fingerprint(tokenizer) -> str:
    """sha256 of the token -> id map: two nodes can exchange token ids iff their fingerprints match."""  # noqa: E501
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()
