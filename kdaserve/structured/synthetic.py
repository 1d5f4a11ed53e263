"""A synthetic byte-level vocabulary of Kimi's size (163,840) for measuring grammar engines.

The mask cost of a grammar engine grows with the vocabulary and with how many tokens share
prefixes with what the grammar allows, so the synthetic vocabulary mixes what a real BPE
vocabulary of this size holds: all 256 bytes, English words and sub-words with and without a
leading space, digit runs, punctuation and JSON fragments, CJK characters and pairs, and
whitespace runs. No tokenizer files are needed.
"""

from __future__ import annotations

import random
import string

KIMI_VOCAB = 163_840

_SYLLABLES = ("th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha "
              "as ou io le ve co me de hi ri ro ic ne ea ra ce li ch ll be ma si om ur ca el "
              "ta la ns di fo ho pe ec pr no ct us ac ot il tr ly nc et ut ss so rs un lo wa "
              "ge ie wh ee wi em ad ol rt po we na ul ni ts mo ow pa im mi ai sh ir su id os "
              "iv ia am fi ci vi pl ig tu ev ld ry mp fe bl ab gh ty op wo sa ay ex ke fr oo"
              ).split()
_PUNCT = list('{}[]":,.;!?()<>/\\-_=+*&^%$#@~`\'|')


def synthetic_vocab(size: int = KIMI_VOCAB, seed: int = 0) -> list[bytes]:
    """`size` distinct byte strings; id 0 is reserved for an EOS special (empty bytes)."""
    rng = random.Random(seed)
    seen: set[bytes] = set()
    vocab: list[bytes] = [b""]

    def add(tok: bytes) -> None:
        if tok and tok not in seen and len(vocab) < size:
            seen.add(tok)
            vocab.append(tok)

    for b in range(256):
        add(bytes([b]))
    for n in range(1000):
        add(str(n).encode())
    for a in _PUNCT:
        add(a.encode())
        add((" " + a).encode())
        for b in _PUNCT[:12]:
            add((a + b).encode())
    for w in (' "', '":', '": ', '",', '", "', '{"', '"}', '[{', '}]', '},', '}, {', '\n', '\n\n',
              '  ', '    ', '\t', 'true', 'false', 'null', ' true', ' false', ' null'):
        add(w.encode())
    for n in range(2, 17):
        add(b" " * n)
        add(b"\n" + b" " * n)
    for cp in range(0x4E00, 0x4E00 + 12000):      # CJK ideographs, then pairs
        add(chr(cp).encode())
    while len(vocab) < size:
        r = rng.random()
        if r < 0.75:
            word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 5)))
            if rng.random() < 0.2:
                word = word.capitalize()
            if rng.random() < 0.55:
                word = " " + word
            add(word.encode())
        elif r < 0.85:
            add(chr(0x4E00 + rng.randrange(20000)).encode()
                + chr(0x4E00 + rng.randrange(20000)).encode())
        elif r < 0.92:
            add("".join(rng.choice(string.digits) for _ in range(rng.randint(2, 4))).encode())
        else:
            add("".join(rng.choice(_PUNCT + list(string.ascii_letters))
                        for _ in range(rng.randint(2, 4))).encode())
    return vocab


class GreedyEncoder:
    """Longest-match tokenization (what a measurement needs, not what BPE would give)."""

    def __init__(self, vocab: list[bytes]) -> None:
        self.index = {t: i for i, t in enumerate(vocab) if t}
        self.longest = max(len(t) for t in vocab)

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        index, longest = self.index, self.longest
        out, pos = [], 0
        while pos < len(data):
            for n in range(min(longest, len(data) - pos), 0, -1):
                tid = index.get(data[pos:pos + n])
                if tid is not None:
                    out.append(tid)
                    pos += n
                    break
        return out
