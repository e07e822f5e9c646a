"""A tiny, random-weight llama-architecture GGUF for driving a real llama.cpp server in tests.

The model knows nothing; it exists so that ``llama-server`` has something real to batch, cache and
schedule. Its properties are chosen for tests:

* F16 weights, a byte-level BPE vocabulary (GPT-2 byte-to-unicode mapping, a few merges) and the
  ChatML special tokens ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>`` with a ChatML template.
* With ``eos_bias=True`` the end-of-generation tokens can never win, so every request runs to
  ``max_tokens``. With ``ascii_only=True`` (default) control bytes and bytes >= 0x7f are suppressed
  the same way, so generated text is printable ASCII.
* Deterministic: the same arguments and seed give a byte-identical file.

The suppression is exact rather than statistical. Embedding dimension 0 is a constant 1.0 for every
token and no attention or FFN output writes to it, so the final residual stream always carries a
positive value there. A suppressed token's output row is zero except a large negative weight on
dimension 0, so its logit is a large negative number whatever the context; every other output row
is zero on dimension 0.

CLI: ``python -m turnstile.engines.tiny_model OUT.gguf [--hidden 768 --layers 8]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "bytes_to_unicode",
    "output_weights",
    "suppressed_ids",
    "tiny_tokens",
    "tiny_vocab",
    "write_tiny_gguf",
]

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Logit weight on the always-positive dimension for suppressed tokens (fits in F16).
_SUPPRESS_WEIGHT = -1000.0

# Frequent English bigrams, used (after space+letter merges) to build the merge list.
_COMMON_BIGRAMS = (
    "th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le ve "
    "co me de hi ri ro ic ne ea ra ce li ch ll be ma si om ur"
)
_SPACE = 0x20


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character mapping."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codepoints = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codepoints.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codepoints, strict=True)}


def _merge_pairs(count: int) -> list[tuple[str, str]]:
    """``count`` deterministic merge pairs over byte-level symbols (ASCII letters only)."""
    b2u = bytes_to_unicode()
    space = b2u[_SPACE]
    pairs: list[tuple[str, str]] = [(space, c) for c in "tawsbcdfhimoeplnrgu"]
    pairs += [(bigram[0], bigram[1]) for bigram in _COMMON_BIGRAMS.split()]
    letters = "abcdefghijklmnopqrstuvwxyz"
    seen = set(pairs)
    for a in letters:
        for b in letters:
            if (a, b) not in seen:
                pairs.append((a, b))
                seen.add((a, b))
    pairs += [(space, c) for c in letters if (space, c) not in seen]
    if count > len(pairs):
        raise ValueError(f"vocab_extra={count} exceeds the {len(pairs)} available merges")
    return pairs[:count]


def tiny_tokens(vocab_extra: int = 64) -> tuple[list[str], list[str]]:
    """Return ``(tokens, merges)``: 256 byte tokens, ``vocab_extra`` merged tokens, then the
    special tokens (the vocabulary of both tiny models, GGUF and Hugging Face)."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges: list[str] = []
    for left, right in _merge_pairs(vocab_extra):
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    return tokens + list(SPECIAL_TOKENS), merges


def tiny_vocab(vocab_extra: int = 64) -> tuple[list[str], list[int], list[str]]:
    """Return ``(tokens, token_types, merges)``: 256 byte tokens, merges, then special tokens."""
    import gguf

    tokens, merges = tiny_tokens(vocab_extra)
    types = [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(SPECIAL_TOKENS))
    types += [int(gguf.TokenType.CONTROL)] * len(SPECIAL_TOKENS)
    return tokens, types, merges


def suppressed_ids(tokens: Sequence[str], *, eos_bias: bool, ascii_only: bool) -> list[int]:
    """Token ids the output layer makes unreachable (see the module docstring)."""
    index = {t: i for i, t in enumerate(tokens)}
    ids = [index["<|im_start|>"]]
    if eos_bias:
        ids += [index["<|im_end|>"], index["<|endoftext|>"]]
    if ascii_only:
        ids += [b for b in range(256) if (b < 0x20 and b != 0x0A) or b >= 0x7F]
    return sorted(set(ids))


def output_weights(rng: np.random.Generator, tokens: Sequence[str], hidden: int, *,
                   eos_bias: bool, ascii_only: bool) -> np.ndarray:
    """The output layer, ``(len(tokens), hidden)`` float32, drawn from ``rng``: random, nothing
    on the constant dimension 0, and the :func:`suppressed_ids` rows made unreachable (a large
    negative weight on dimension 0 alone)."""
    head = rng.standard_normal((len(tokens), hidden), dtype=np.float32)
    head *= np.float32(2.0 / np.sqrt(hidden))
    head[:, 0] = 0.0
    for tid in suppressed_ids(tokens, eos_bias=eos_bias, ascii_only=ascii_only):
        head[tid, :] = 0.0
        head[tid, 0] = _SUPPRESS_WEIGHT
    return head


def write_tiny_gguf(
    path: str | Path,
    *,
    hidden: int = 256,
    layers: int = 4,
    ffn: int = 512,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_extra: int = 64,
    seed: int = 0,
    ctx: int = 8192,
    eos_bias: bool = True,
    ascii_only: bool = True,
) -> Path:
    """Write a random-weight llama-architecture F16 GGUF to ``path`` and return the path.

    ``vocab_extra`` is the number of merged (two-symbol) tokens added on top of the 256 byte
    tokens; the vocabulary is ``256 + vocab_extra + 3`` tokens. With ``eos_bias`` the
    end-of-generation tokens are suppressed so generations always run to ``max_tokens``.
    """
    import gguf

    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not divisible by kv_heads={kv_heads}")
    head_dim = hidden // heads
    if head_dim % 2:
        raise ValueError(f"head dimension {head_dim} must be even for RoPE")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)

    tokens, types, merges = tiny_vocab(vocab_extra)
    vocab = len(tokens)
    token_id = {t: i for i, t in enumerate(tokens)}
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        # numpy shape (rows, cols) == ggml ne [cols, rows]: `cols` is the input dimension.
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale)

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("turnstile-tiny")
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    writer.add_context_length(ctx)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(token_id["<|endoftext|>"])
    writer.add_eos_token_id(token_id["<|im_end|>"])
    writer.add_pad_token_id(token_id["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    embd = mat(vocab, hidden, 1.0)
    embd[:, 0] = 1.0  # the constant, always-positive dimension
    writer.add_tensor("token_embd.weight", embd.astype(np.float16))

    ones = np.ones(hidden, dtype=np.float32)
    kv_dim = kv_heads * head_dim
    for i in range(layers):
        wo = mat(hidden, hidden, 1.0 / np.sqrt(hidden))
        wo[0, :] = 0.0  # nothing writes to dimension 0
        down = mat(hidden, ffn, 1.0 / np.sqrt(ffn))
        down[0, :] = 0.0
        blk = {
            "attn_norm.weight": ones,
            "attn_q.weight": mat(hidden, hidden, 1.0 / np.sqrt(hidden)),
            "attn_k.weight": mat(kv_dim, hidden, 1.0 / np.sqrt(hidden)),
            "attn_v.weight": mat(kv_dim, hidden, 1.0 / np.sqrt(hidden)),
            "attn_output.weight": wo,
            "ffn_norm.weight": ones,
            "ffn_gate.weight": mat(ffn, hidden, 1.0 / np.sqrt(hidden)),
            "ffn_up.weight": mat(ffn, hidden, 1.0 / np.sqrt(hidden)),
            "ffn_down.weight": down,
        }
        for name, arr in blk.items():
            data = arr if arr.ndim == 1 else arr.astype(np.float16)
            writer.add_tensor(f"blk.{i}.{name}", data)

    writer.add_tensor("output_norm.weight", ones)
    head = output_weights(rng, tokens, hidden, eos_bias=eos_bias, ascii_only=ascii_only)
    writer.add_tensor("output.weight", head.astype(np.float16))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m turnstile.engines.tiny_model",
        description="Write a tiny random-weight llama GGUF for llama-server tests.",
    )
    parser.add_argument("out", type=Path, help="output .gguf path")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=None, help="default: 2 x hidden")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab-extra", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument(
        "--allow-eos", action="store_true", help="do not suppress end-of-generation tokens"
    )
    args = parser.parse_args(argv)
    try:
        import gguf  # noqa: F401
    except ImportError:
        print("error: writing the tiny model needs the gguf package: "
              "pip install 'turnstile[engine]'", file=sys.stderr)
        return 2
    start = time.perf_counter()
    path = write_tiny_gguf(
        args.out,
        hidden=args.hidden,
        layers=args.layers,
        ffn=args.ffn if args.ffn is not None else 2 * args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab_extra=args.vocab_extra,
        seed=args.seed,
        ctx=args.ctx,
        eos_bias=not args.allow_eos,
    )
    size_mb = path.stat().st_size / 1e6
    elapsed = time.perf_counter() - start
    print(f"wrote {path} ({size_mb:.1f} MB) in {elapsed:.2f} s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
