"""A decoder-only transformer of GPT-2's shape, from torch.nn blocks, on seeded synthetic tokens."""

from __future__ import annotations

import torch
from torch import nn

from ps_bench.models.base import (DATA, HELD_OUT_STREAM, MODELS, RANDOM, TEACHER_STREAM,
                                  BenchmarkModel, Dataset, SyntheticData, need_positive, preset,
                                  stream)

TOKENS = "token sequences"


@DATA.register("SyntheticTokens")
class SyntheticTokens(SyntheticData):
    """Uniformly drawn token sequences; the target of each position is the next token.

    Teacher sequences: every token has one seeded successor, the next token on one seeded
    cycle through the whole vocabulary (a permutation with short cycles would leave a sequence
    repeating a few tokens), and each sequence follows successors from a drawn first token, so
    the next token is a function of the current one that a language model learns (a
    deterministic bigram language; held-out sequences start from other drawn tokens)."""

    gives = TOKENS
    teacher = ("every token is followed by its seeded successor (one seeded cycle through the "
               "vocabulary)")

    def __init__(self, sample_count: int, sequence_length: int = 1024,
                 vocab_size: int = 50257) -> None:
        need_positive(sample_count=sample_count, sequence_length=sequence_length,
                      vocab_size=vocab_size)
        self.sample_count, self.sequence_length, self.vocab_size = (sample_count, sequence_length,
                                                                    vocab_size)

    def build(self, seed: int, labels: str = RANDOM) -> Dataset:
        generator = torch.Generator().manual_seed(seed)
        if labels != RANDOM:
            return self.taught(self.sample_count, generator, seed)
        tokens = torch.randint(0, self.vocab_size, (self.sample_count, self.sequence_length + 1),
                               generator=generator)
        return Dataset((tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous())

    def held_out(self, seed: int, count: int) -> Dataset:
        return self.taught(count, stream(seed, HELD_OUT_STREAM), seed)

    def taught(self, count: int, generator: torch.Generator, seed: int) -> Dataset:
        """``count`` sequences that follow the seed's successors from first tokens drawn from
        ``generator``."""
        order = torch.randperm(self.vocab_size, generator=stream(seed, TEACHER_STREAM))
        successor = torch.empty_like(order)
        successor[order] = order.roll(-1)  # one cycle through the whole vocabulary
        sequence = [torch.randint(0, self.vocab_size, (count,), generator=generator)]
        for _ in range(self.sequence_length):
            sequence.append(successor[sequence[-1]])
        tokens = torch.stack(sequence, dim=1)
        return Dataset((tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous())


@MODELS.register("GPT")
class GPT(BenchmarkModel):
    """Token and learned position embeddings, pre-norm causal self-attention blocks with GELU
    MLPs, a final LayerNorm and an output projection tied to the token embedding (GPT-2's
    layout and embedding initialisation, N(0, 0.02) and N(0, 0.01); the defaults are GPT-2
    small, about 124 M parameters). No dropout, so replicas stay comparable."""

    takes = TOKENS

    def __init__(self, vocab_size: int = 50257, context_length: int = 1024, layers: int = 12,
                 heads: int = 12, width: int = 768) -> None:
        super().__init__()
        need_positive(vocab_size=vocab_size, context_length=context_length, layers=layers,
                      heads=heads, width=width)
        if width % heads:
            raise ValueError(f"width ({width}) must be a multiple of heads ({heads})")
        self.vocab_size, self.context_length = vocab_size, context_length
        self.token = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(context_length, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.token.weight
        # GPT-2's: torch's N(0, 1) embeddings, tied to the output layer, make the first logits
        # so large that a fresh model's loss is several times a uniform guess's
        nn.init.normal_(self.token.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.01)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.token(tokens) + self.position(torch.arange(length, device=tokens.device))
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        for block in self.blocks:
            x = block(x, src_mask=causal, is_causal=True)
        # (batch, vocab, positions), as CrossEntropyLoss takes
        return self.head(self.norm(x)).transpose(1, 2)

    def fits(self, data: SyntheticData) -> str | None:
        if data.vocab_size > self.vocab_size:
            return (f"draws tokens below vocab_size={data.vocab_size} but the model has "
                    f"{self.vocab_size}")
        if data.sequence_length > self.context_length:
            return (f"has sequences of {data.sequence_length} tokens but the model's context is "
                    f"{self.context_length}")
        return None


preset("gpt2_small", "GPT", {}, "tokens1024", "SyntheticTokens",
       {"sample_count": 64, "sequence_length": 1024})
preset("gpt2_tiny", "GPT",
       {"vocab_size": 512, "context_length": 64, "layers": 2, "heads": 2, "width": 32},
       "tokens64", "SyntheticTokens",
       {"sample_count": 512, "sequence_length": 64, "vocab_size": 512}, small_of="gpt2_small")
