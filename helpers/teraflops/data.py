"""Generated training data: nothing is downloaded.

Token sequences come from a seeded random Markov chain over the vocabulary (each token's next-token
distribution is a sparse random softmax), so a language model has something real to learn: its
loss falls from ln(vocab) towards the chain's entropy rate. The same ``seed`` gives the same
tokens on every machine and every rank.
"""

from __future__ import annotations

import torch


def markov_tokens(num_sequences: int, seq_len: int, vocab_size: int = 256, seed: int = 0,
                  branching: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences from a random Markov chain where each token has ``branching`` likely successors.

    Returns ``(inputs, targets)``, both int64 ``(num_sequences, seq_len)``; ``targets`` is
    ``inputs`` shifted left by one token (next-token prediction). Raises ``ValueError`` for
    non-positive sizes.
    """
    if min(num_sequences, seq_len, vocab_size, branching) < 1:
        raise ValueError("num_sequences, seq_len, vocab_size and branching must all be ≥ 1")
    g = torch.Generator().manual_seed(seed)
    logits = torch.full((vocab_size, vocab_size), -4.0)
    successors = torch.randint(vocab_size, (vocab_size, branching), generator=g)
    logits.scatter_(1, successors, 2.0 * torch.rand(vocab_size, branching, generator=g) + 1.0)
    probs = logits.softmax(-1)
    seq = torch.empty(num_sequences, seq_len + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(vocab_size, (num_sequences,), generator=g)
    for t in range(seq_len):
        seq[:, t + 1] = torch.multinomial(probs[seq[:, t]], 1, generator=g).squeeze(1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
