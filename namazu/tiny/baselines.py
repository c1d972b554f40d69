"""Count-based baselines the tiny model is measured against.

- `UnigramModel`: token frequencies of a train split with add-one smoothing (perplexity per token);
- `CharTrigramModel`: interpolated Kneser-Ney over characters (orders 3/2/1 + a uniform floor, discounts
  from count-of-counts), scored in bits per UTF-8 byte so it compares with any tokenizer. Characters never
  seen in training go through an UNK symbol and then cost 8 bits per UTF-8 byte.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

import numpy as np

BOS = "\x02"  # document-start padding; the corpus has no control characters


class UnigramModel:
    def __init__(self, train_ids: np.ndarray, vocab_size: int):
        counts = np.bincount(np.asarray(train_ids, dtype=np.int64), minlength=vocab_size).astype(np.float64) + 1.0
        self.logp = np.log(counts / counts.sum())

    def nll(self, ids: np.ndarray) -> float:
        """Total negative log-likelihood (nats) of a token sequence."""
        return float(-self.logp[np.asarray(ids, dtype=np.int64)].sum())


def _discount(count_of_counts: Counter) -> float:
    n1, n2 = count_of_counts.get(1, 0), count_of_counts.get(2, 0)
    return n1 / (n1 + 2 * n2) if n1 + n2 > 0 else 0.75


class CharTrigramModel:
    def __init__(self, documents: Iterable[str]):
        tri: Counter = Counter()
        for doc in documents:
            s = BOS + BOS + doc
            tri.update(zip(s, s[1:], s[2:]))
        self.tri = tri
        # History counts and the number of distinct continuations per history.
        self.c_ab: Counter = Counter()
        self.n_ab: Counter = Counter()
        # Kneser-Ney continuation counts for the lower orders.
        cont_bc: Counter = Counter()  # N1+(. b c)
        for (_a, b, c) in tri:
            cont_bc[(b, c)] += 1
        for (a, b, _c), n in tri.items():
            self.c_ab[(a, b)] += n
            self.n_ab[(a, b)] += 1
        self.cont_bc = cont_bc
        self.cont_b: Counter = Counter()  # N1+(. b .)
        self.n_b: Counter = Counter()  # N1+(b .) among continuation bigrams
        cont_c: Counter = Counter()  # N1+(. c) over distinct bigrams
        for (_b, c) in cont_bc:
            cont_c[c] += 1
        for (b, _c), n in cont_bc.items():
            self.cont_b[b] += n
            self.n_b[b] += 1
        self.cont_c = cont_c
        self.total_bigram_types = len(cont_bc)
        self.d3 = _discount(Counter(tri.values()))
        self.d2 = _discount(Counter(cont_bc.values()))
        self.d1 = _discount(Counter(cont_c.values()))
        self.vocab = set(cont_c)
        self.uniform = 1.0 / (len(self.vocab) + 1)  # + UNK

    def _p1(self, c: str) -> float:
        n = self.cont_c.get(c, 0)
        lam = self.d1 * len(self.cont_c) / self.total_bigram_types
        return max(n - self.d1, 0.0) / self.total_bigram_types + lam * self.uniform

    def _p2(self, b: str, c: str) -> float:
        denom = self.cont_b.get(b, 0)
        if denom == 0:
            return self._p1(c)
        n = self.cont_bc.get((b, c), 0)
        lam = self.d2 * self.n_b[b] / denom
        return max(n - self.d2, 0.0) / denom + lam * self._p1(c)

    def prob(self, a: str, b: str, c: str) -> float:
        """P(c | a b); c outside the training characters stands for UNK."""
        denom = self.c_ab.get((a, b), 0)
        if denom == 0:
            return self._p2(b, c)
        n = self.tri.get((a, b, c), 0)
        lam = self.d3 * self.n_ab[(a, b)] / denom
        return max(n - self.d3, 0.0) / denom + lam * self._p2(b, c)

    def bits(self, doc: str) -> float:
        """Total bits to encode a document (its characters, not an end marker)."""
        s = BOS + BOS + doc
        total = 0.0
        for a, b, c in zip(s, s[1:], s[2:]):
            total -= math.log2(self.prob(a, b, c))
            if c not in self.vocab:
                total += 8 * len(c.encode("utf-8"))
        return total


def bits_per_byte(model: CharTrigramModel, documents: Iterable[str]) -> float:
    bits, nbytes = 0.0, 0
    for d in documents:
        bits += model.bits(d)
        nbytes += len(d.encode("utf-8"))
    return bits / nbytes


def sanity_normalised(model: CharTrigramModel, a: str, b: str) -> float:
    """Sum of P(. | a b) over the known characters + UNK; 1.0 up to rounding (used by tests)."""
    total = sum(model.prob(a, b, c) for c in model.vocab)
    # UNK: a character outside the vocabulary has no trigram/bigram counts, only the floor mass.
    return total + model.prob(a, b, "\uffff" if "\uffff" not in model.vocab else "\ufffe")

