"""Write a synthetic Vidur profile (compute + network) into a Hugging Face hub cache layout.

Vidur 0.0.26 fetches its profiling data with ``huggingface_hub.snapshot_download`` from the
datasets named by ``--<predictor>_model_profiling_dataset`` / ``..._network_profiling_dataset``
into ``<cache_dir>/profiling_data/{compute,network}/``. The hub is unreachable here, so this
script writes those datasets straight into that cache (``refs/main`` + ``snapshots/<sha>/``);
run Vidur with ``HF_HUB_OFFLINE=1`` and it reads them as if downloaded.

The numbers are a roofline for Llama-3-8B on one H100-SXM (bf16 989 TFLOP/s at 0.7, HBM
3.35 TB/s at 0.85, 5 µs per kernel), per layer and per operation, in milliseconds, with the
columns ``SklearnExecutionTimePredictor`` reads (``_load_compute_df``, ``_load_attention_df``,
``_train_general_models``, ``_train_attention_layer_models``). They drive Vidur's simulated
clock only; simulator speed does not depend on them beyond the batch shapes they produce.

Runs in the throwaway Vidur venv (needs pandas): ``/tmp/vidur-venv/bin/python make_profile.py
CACHE_DIR``. Standalone on purpose: it must not import turnstile.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd

MODEL = "meta-llama/Llama-3-8B"
DEVICE = "h100"
NETWORK_DEVICE = "h100_dgx"
COMPUTE_DATASET = "turnstile-synthetic/llama-3-8b-h100-roofline"
NETWORK_DATASET = "turnstile-synthetic/h100-dgx-roofline"

# Llama-3-8B (vidur.config.model_config.Llama38BModelConfig)
N_HEAD, N_KV_HEAD, N_EMBD, N_FFN, VOCAB = 32, 8, 4096, 14336, 128256
HEAD_DIM = N_EMBD // N_HEAD
# H100-SXM, achievable
FLOPS = 989e12 * 0.7
BW = 3.35e12 * 0.85
LAUNCH_MS = 0.005


def _ms(flops: np.ndarray | float, nbytes: np.ndarray | float) -> np.ndarray:
    return np.maximum(np.asarray(flops) / FLOPS, np.asarray(nbytes) / BW) * 1e3 + LAUNCH_MS


def compute_df() -> pd.DataFrame:
    t = np.unique(np.concatenate([np.arange(1, 129), np.arange(128, 16385, 32)])).astype(float)

    def gemm(k: int, n: int) -> np.ndarray:  # [t, k] x [k, n], bf16
        return _ms(2.0 * t * k * n, 2.0 * (k * n + t * k + t * n))

    def elementwise(width: int, passes: float) -> np.ndarray:
        return _ms(t * width * passes, 2.0 * t * width * passes)

    df = pd.DataFrame({"num_tokens": t.astype(int)})
    df["time_stats.attn_pre_proj.median"] = gemm(N_EMBD, (N_HEAD + 2 * N_KV_HEAD) * HEAD_DIM)
    df["time_stats.attn_post_proj.median"] = gemm(N_EMBD, N_EMBD)
    df["time_stats.mlp_up_proj.median"] = gemm(N_EMBD, 2 * N_FFN)
    df["time_stats.mlp_down_proj.median"] = gemm(N_FFN, N_EMBD)
    df["time_stats.mlp_act.median"] = elementwise(N_FFN, 3)
    df["time_stats.input_layernorm.median"] = elementwise(N_EMBD, 2)
    df["time_stats.post_attention_layernorm.median"] = elementwise(N_EMBD, 2)
    df["time_stats.attn_rope.median"] = elementwise((N_HEAD + N_KV_HEAD) * HEAD_DIM, 2)
    df["time_stats.add.median"] = elementwise(N_EMBD, 3)
    df["n_head"] = N_HEAD
    df["n_kv_head"] = N_KV_HEAD
    df["n_embd"] = N_EMBD
    df["n_expanded_embd"] = N_FFN
    df["use_gated_mlp"] = True
    df["vocab_size"] = VOCAB
    df["num_tensor_parallel_workers"] = 1
    return df


def attention_df(block_size: int) -> pd.DataFrame:
    kv_bytes = 2 * N_KV_HEAD * HEAD_DIM * 2  # K and V, bf16, one layer, one token
    rows = []
    kv_sizes = list(range(0, 16385, 256))
    for b in range(1, 129):  # decode: batch b, mean KV length k
        for k in kv_sizes:
            rows.append((0, b, k, _ms(4.0 * b * k * N_HEAD * HEAD_DIM, b * max(k, 1) * kv_bytes)))
    for c in range(32, 4097, 32):  # prefill chunk c after k cached tokens (batch 1)
        for k in kv_sizes:
            f = 4.0 * c * (k + c / 2) * N_HEAD * HEAD_DIM
            rows.append((c, 1, k, float(f / (FLOPS * 0.85) * 1e3 + LAUNCH_MS)))
    df = pd.DataFrame(rows, columns=["prefill_chunk_size", "batch_size", "kv_cache_size",
                                     "time_stats.attn_decode.median"])
    df["time_stats.attn_prefill.median"] = df["time_stats.attn_decode.median"]
    tokens = np.maximum(df["prefill_chunk_size"], df["batch_size"]).to_numpy(float)
    df["time_stats.attn_kv_cache_save.median"] = _ms(0.0, tokens * kv_bytes * 2)
    df["n_embd"] = N_EMBD
    df["n_q_head"] = N_HEAD
    df["n_kv_head"] = N_KV_HEAD
    df["block_size"] = block_size
    df["num_tensor_parallel_workers"] = 1
    return df


def network_dfs() -> tuple[pd.DataFrame, pd.DataFrame]:
    size = np.array([2**i for i in range(10, 31)], dtype=float)  # bytes
    rows_ar, rows_sr = [], []
    for n in (1, 2, 4, 8):
        for dpn in (1, 2, 4, 8):
            t = 0.01 + size * 2 * (n - 1) / n / 400e9 * 1e3
            rows_ar += [("all_reduce", s, n, dpn, v) for s, v in zip(size, t, strict=True)]
    for dpn in (1, 2):
        t = 0.01 + size / (400e9 if dpn == 2 else 50e9) * 1e3
        rows_sr += [("send_recv", s, 2, dpn, v) for s, v in zip(size, t, strict=True)]
    cols = ["collective", "size", "num_workers", "devices_per_node"]
    ar = pd.DataFrame(rows_ar, columns=[*cols, "time_stats.all_reduce.median"])
    sr = pd.DataFrame(rows_sr, columns=[*cols, "time_stats.send_recv.median"])
    return ar, sr


def _dataset_dir(cache: Path, kind: str, repo_id: str, config: dict) -> Path:
    """``<cache>/profiling_data/<kind>/datasets--org--name/{refs/main, snapshots/<sha>}``."""
    storage = cache / "profiling_data" / kind / ("datasets--" + repo_id.replace("/", "--"))
    sha = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()
    snap = storage / "snapshots" / sha
    snap.mkdir(parents=True, exist_ok=True)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(sha)
    (snap / "config.json").write_text(json.dumps(config, indent=2))
    return snap


def write_profile(cache: Path, block_size: int = 16) -> dict[str, str]:
    compute = _dataset_dir(cache, "compute", COMPUTE_DATASET,
                           {"model": MODEL, "device_sku": DEVICE, "synthetic": "roofline"})
    network = _dataset_dir(cache, "network", NETWORK_DATASET,
                           {"sku": NETWORK_DEVICE, "synthetic": "roofline"})
    if not (compute / "attention.csv.xz").exists():
        compute_df().to_csv(compute / "mlp.csv.xz", index=False, compression="xz")
        attention_df(block_size).to_csv(compute / "attention.csv.xz", index=False,
                                        compression="xz")
        ar, sr = network_dfs()
        ar.to_csv(network / "all_reduce.csv.xz", index=False, compression="xz")
        sr.to_csv(network / "send_recv.csv.xz", index=False, compression="xz")
    return {"compute": str(compute), "network": str(network)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cache_dir", type=Path)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args()
    print(json.dumps(write_profile(a.cache_dir, a.block_size), indent=2))


if __name__ == "__main__":
    main()
