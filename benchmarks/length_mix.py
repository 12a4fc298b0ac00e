"""Document-length mixes for ``benchmarks/placement.py``: one length a line on stdout.

    python benchmarks/length_mix.py --mix finetune --documents 4000 > finetune.txt
    python benchmarks/length_mix.py --mix byted --documents 4000 > byted.txt

No published per-document length list is available offline here, so both mixes are
generated (seeded: the same file every run) from a stated distribution, each band
log-uniform (every length scale in a band equally likely):

- ``finetune``: the issue's acceptance mix, 90% of the documents under 4K tokens and a
  few over 100K: 90% in [64, 4096), 9.5% in [4096, 16384), 0.5% in [100K, 400K].
- ``byted``: the long-context training data ByteScale describes (Ge et al., "ByteScale:
  Efficient Scaling of LLM Training with a 2048K Context Length on More Than 12,000
  GPUs", arXiv:2502.21231, its Byted dataset as summarised in public coverage: 80% of
  the samples at most 4K tokens, 0.05% at least 2M): 80% in [64, 4096], 19.95% in
  (4096, 2M), 0.05% of 2M tokens. The split of the 20% between 4K and 2M is not
  stated there; log-uniform is this script's assumption.
"""

from __future__ import annotations

import argparse
import math
import random

#: name -> [(share of the documents, lowest length, highest length)]
MIXES = {
    "finetune": [(0.90, 64, 4095), (0.097, 4096, 8191), (0.003, 100_000, 400_000)],
    "byted": [(0.80, 64, 4096), (0.1995, 4097, 2_097_151), (0.0005, 2_097_152, 2_097_152)],
}


def lengths(mix: str, documents: int, seed: int = 0) -> list[int]:
    """``documents`` lengths of ``mix``: each band's share of them (rounded; the first
    band takes the rest), shuffled."""
    rng = random.Random(seed)
    bands = MIXES[mix]
    counts = [round(share * documents) for share, _, _ in bands]
    counts[0] = documents - sum(counts[1:])
    out = []
    for count, (_, low, high) in zip(counts, bands):
        for _ in range(count):
            out.append(round(math.exp(rng.uniform(math.log(low), math.log(high)))))
    rng.shuffle(out)
    return out


def main(argv=None) -> list[int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", choices=sorted(MIXES), required=True)
    parser.add_argument("--documents", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = lengths(args.mix, args.documents, args.seed)
    print("\n".join(map(str, out)))
    return out


if __name__ == "__main__":
    main()
