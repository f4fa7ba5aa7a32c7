"""The tiny models' weights: random, then made decisive (every greedy choice leads by far
more than float noise, and the first two are the input's)."""

from __future__ import annotations

from typing import Any

IDENTITY_DIMS = 96
"""The language model's first hidden dims, where the current token's identity lives."""
QUERY_GAIN = 4.0
"""Sharper attention: a position's context leans on fewer positions, so what the model
chooses from it follows the image more often."""
IDENTITY_NORM = 100.0
"""The identity part's norm in a chain token's embedding: the layers' writes (to the other
dims) stay a small fraction of it, so the context hardly moves the next token's logits."""
CLASS_NORM = 1.0
"""The identity part's norm in the prompt's closing newline and the opening tokens: the
context keeps its say there (it chooses the next token)."""
HEAD_GAIN = 4.0
"""The LM head's identity columns: the chain's lead (~25 logits) and the opening tokens'
lead as a class (~10) over whatever the context adds."""
OPENINGS = 64
"""Tokens an answer may open with: the context chooses one after the prompt, then the
chain token after it (two choices, so that two inputs rarely answer alike)."""


def init_weights(model: Any, seed: int) -> None:
    """std 1/sqrt(fan_in) everywhere: the image then visibly moves greedy outputs."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                fan_in = param[0].numel()
                param.copy_(torch.randn(param.shape, generator=gen) / fan_in**0.5)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)  # norm scales


def chain_tokens(tokenizer: Any) -> list[int]:
    """The ordinary tokens: all but the special tokens and the whitespace-only ones (the
    chat template's last prompt token is "\n": the context chooses after it)."""
    vocab = tokenizer.get_vocab()
    outside = {i for t, i in vocab.items()
               if t.startswith("<|") or t == "<image>" or not t.strip("\u010a\u0109\u0120")}
    return sorted(i for i in vocab.values() if i not in outside)


def make_decisive(model: Any, tokenizer: Any, seed: int) -> None:
    """Make every greedy choice decisive, and the first two the input's.

    A random-weight LM has near-tied logits: over hundreds of tokens some step's top two
    differ by less than the float noise between batch shapes, or between a prefix
    prefilled at once and decoded token by token, and the argmax flips (answers that
    should be equal are not, one run in a few). So the language model is a chain with a
    context-chosen start. Hidden dims [0, IDENTITY_DIMS) hold the current token's
    identity; no layer writes there (the attention and MLP output rows are zero), so the
    final hidden state keeps it, and the LM head's identity columns score from it:

    - after the prompt's closing "\n" (identity: class 0) every opening token scores the
      same, every other token nothing: the context alone chooses among the OPENINGS;
    - after an opening token (identity: class 1) every chain token scores the same: the
      context, which now holds the opening token too, chooses among them;
    - after a chain token t (identity: IDENTITY_NORM times a random unit vector u_t) its
      successor in a fixed random permutation of the chain tokens (scored by u_pred(s))
      leads every other token by ~25 logits, while the context, scaled down by the
      identity's norm, moves logits by well under 1.

    The context is the random layers' reading of the image and the text: the two choices
    are where the answer depends on the input. tests/e2e/test_tiny_models.py measures
    every margin through vLLM's logprobs."""
    import torch

    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    vocab = emb.shape[0]
    ordinary = chain_tokens(tokenizer)
    gen = torch.Generator().manual_seed(seed + 1)
    mixed = torch.randperm(len(ordinary), generator=gen).tolist()
    openings = {ordinary[i] for i in mixed[:OPENINGS]}
    chain = [t for t in ordinary if t not in openings]
    order = torch.randperm(len(chain), generator=gen).tolist()
    pred = {chain[order[i]]: chain[i] for i in range(len(chain))}
    # dims 0 and 1: the two classes; the chain's unit vectors live in the others.
    units = torch.zeros(vocab, IDENTITY_DIMS)
    units[:, 2:] = torch.randn(vocab, IDENTITY_DIMS - 2, generator=gen)
    units /= units.norm(dim=1, keepdim=True)
    after_newline, after_opening = torch.eye(IDENTITY_DIMS)[:2]
    newline = tokenizer.get_vocab()["\u010a"]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" not in name:
                continue
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param[:IDENTITY_DIMS] = 0
            elif name.endswith("q_proj.weight"):
                param *= QUERY_GAIN
        emb[:, :IDENTITY_DIMS] = 0
        head[:, :IDENTITY_DIMS] = 0
        emb[newline, :IDENTITY_DIMS] = CLASS_NORM * after_newline
        for token in openings:
            emb[token, :IDENTITY_DIMS] = CLASS_NORM * after_opening
            head[token, :IDENTITY_DIMS] = HEAD_GAIN * after_newline
        for token in chain:
            emb[token, :IDENTITY_DIMS] = IDENTITY_NORM * units[token]
            head[token, :IDENTITY_DIMS] = HEAD_GAIN * (units[pred[token]] + after_opening)
