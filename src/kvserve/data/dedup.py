"""Exact and near-duplicate removal.

Exact: a 16-byte BLAKE2 digest of the normalized text (lower case, whitespace collapsed); a
document whose digest was seen is dropped.

Near: MinHash signatures (datasketch, `num_perm` permutations) over word `shingle`-grams, in
an LSH index (b bands of r rows chosen by datasketch for the Jaccard `threshold`). A document
whose signature collides with a kept document's in any band *and* whose estimated Jaccard
similarity with it reaches the threshold is dropped, else it is kept and indexed. First come,
first kept: the order of the inputs decides which copy survives.

Signatures are computed in the worker processes; the index lives in the main process, the
one part of the pipeline whose memory grows with the corpus (a digest and b band keys per kept
document, plus its signature for the Jaccard check).
"""

from __future__ import annotations

import numpy as np

_SEED = 1
_SCHEME = "affine32"     # datasketch 2's 32-bit hash values


def minhash_values(words: list[str], shingle: int, num_perm: int) -> np.ndarray:
    from datasketch import MinHash

    m = MinHash(num_perm=num_perm, seed=_SEED, scheme=_SCHEME)
    n = max(1, len(words) - shingle + 1)
    m.update_batch([" ".join(words[i:i + shingle]).encode() for i in range(n)])
    return m.hashvalues


class Deduplicator:
    def __init__(self, threshold: float = 0.7, num_perm: int = 128):
        from datasketch import MinHashLSH

        self.threshold = threshold
        self.num_perm = num_perm
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        self.digests: set[bytes] = set()
        self.signatures: list[np.ndarray] = []

    def check(self, digest: bytes, hashvalues: np.ndarray) -> str | None:
        """'exact_duplicate' | 'near_duplicate' | None (then the document is indexed as kept)."""
        from datasketch import MinHash

        if digest in self.digests:
            return "exact_duplicate"
        m = MinHash(num_perm=self.num_perm, seed=_SEED, hashvalues=hashvalues, scheme=_SCHEME)
        for key in self.lsh.query(m):
            if float(np.mean(self.signatures[key] == hashvalues)) >= self.threshold:
                return "near_duplicate"
        key = len(self.signatures)
        self.signatures.append(hashvalues)
        self.lsh.insert(key, m, check_duplication=False)
        self.digests.add(digest)
        return None
