"""A tiny, random-weight Llama in the Hugging Face layout, for driving a real vLLM in tests.

The sibling of :mod:`turnstile.engines.tiny_model` (the GGUF for llama.cpp): the same byte-level
BPE vocabulary (256 byte tokens, a few merges, the ChatML special tokens), the same ChatML chat
template and the same exact suppression of end-of-generation, control and non-ASCII tokens (so
every request runs to ``max_tokens`` and streams printable text). Written with numpy alone —
``config.json``, ``model.safetensors`` (bfloat16), ``tokenizer.json`` in the ``tokenizers``
format, ``tokenizer_config.json`` with the chat template, ``generation_config.json`` — so it
needs neither torch nor transformers nor a model hub, and the same arguments give the same
bytes. Takes well under a second.

CLI: ``python -m turnstile.engines.tiny_hf_model OUT_DIR [--hidden 256 --layers 4]``.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from turnstile.engines.tiny_model import (
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    output_weights,
    tiny_tokens,
)

__all__ = ["write_safetensors", "write_tiny_hf_model"]


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits (round to nearest even), as uint16."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write float32 arrays as a bfloat16 ``.safetensors`` file (the format is a little-endian
    u64 header length, a JSON header of dtypes, shapes and byte ranges, then the raw data)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name, arr in tensors.items():
        data = _bf16(arr).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def _tokenizer_json(tokens: list[str], merges: list[str]) -> dict[str, object]:
    n_normal = len(tokens) - len(SPECIAL_TOKENS)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": n_normal + i, "content": t, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": {**byte_level, "trim_offsets": False},
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }


def write_tiny_hf_model(
    out_dir: str | Path,
    *,
    hidden: int = 256,
    layers: int = 4,
    ffn: int = 512,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_extra: int = 64,
    seed: int = 0,
    max_positions: int = 8192,
    eos_bias: bool = True,
    ascii_only: bool = True,
) -> Path:
    """Write the model directory (``vllm serve OUT_DIR``) and return its path."""
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden}, heads={heads}, kv_heads={kv_heads} do not divide")
    head_dim = hidden // heads
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokens, merges = tiny_tokens(vocab_extra)
    vocab = len(tokens)
    tid = {t: i for i, t in enumerate(tokens)}
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:  # (out, in), as torch Linear
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale)

    tensors: dict[str, np.ndarray] = {}
    embd = mat(vocab, hidden, 1.0)
    embd[:, 0] = 1.0  # the constant, always-positive dimension (nothing below writes to it)
    tensors["model.embed_tokens.weight"] = embd
    ones = np.ones(hidden, dtype=np.float32)
    kv_dim = kv_heads * head_dim
    for i in range(layers):
        p = f"model.layers.{i}."
        wo = mat(hidden, hidden, 1.0 / np.sqrt(hidden))
        wo[0, :] = 0.0
        down = mat(hidden, ffn, 1.0 / np.sqrt(ffn))
        down[0, :] = 0.0
        tensors |= {
            p + "input_layernorm.weight": ones,
            p + "self_attn.q_proj.weight": mat(hidden, hidden, 1.0 / np.sqrt(hidden)),
            p + "self_attn.k_proj.weight": mat(kv_dim, hidden, 1.0 / np.sqrt(hidden)),
            p + "self_attn.v_proj.weight": mat(kv_dim, hidden, 1.0 / np.sqrt(hidden)),
            p + "self_attn.o_proj.weight": wo,
            p + "post_attention_layernorm.weight": ones,
            p + "mlp.gate_proj.weight": mat(ffn, hidden, 1.0 / np.sqrt(hidden)),
            p + "mlp.up_proj.weight": mat(ffn, hidden, 1.0 / np.sqrt(hidden)),
            p + "mlp.down_proj.weight": down,
        }
    tensors["model.norm.weight"] = ones
    tensors["lm_head.weight"] = output_weights(rng, tokens, hidden, eos_bias=eos_bias,
                                               ascii_only=ascii_only)
    write_safetensors(out / "model.safetensors", tensors)

    bos, eos = tid["<|endoftext|>"], tid["<|im_end|>"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": bos, "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
        "add_eos_token": False, "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False, "chat_template": CHATML_TEMPLATE,
    }
    files = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": bos, "eos_token_id": eos},
        "tokenizer.json": _tokenizer_json(tokens, merges),
        "tokenizer_config.json": tok_config,
        "special_tokens_map.json": {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                                    "pad_token": "<|endoftext|>"},
    }
    for name, doc in files.items():
        (out / name).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n",
                                encoding="utf-8")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m turnstile.engines.tiny_hf_model",
        description="Write a tiny random-weight Llama (Hugging Face layout) for vLLM tests.")
    parser.add_argument("out", type=Path, help="output directory")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=None, help="default: 2 x hidden")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allow-eos", action="store_true",
                        help="do not suppress end-of-generation tokens")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = write_tiny_hf_model(args.out, hidden=args.hidden, layers=args.layers,
                               ffn=args.ffn if args.ffn is not None else 2 * args.hidden,
                               heads=args.heads, kv_heads=args.kv_heads, seed=args.seed,
                               eos_bias=not args.allow_eos)
    print(f"wrote {path} in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
